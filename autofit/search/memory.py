"""The memory model: the estimator's prediction, its calibration from measured trials, and
the pruning decision (predicted to fit the budget or not)."""

import statistics
from collections.abc import Callable

from autofit.knobs import TrainConfig
from autofit.search.study import TrialRecord


class MemoryModel:
    """Predicted peak bytes of a config, corrected by what the study has measured."""

    def __init__(self, estimate: Callable[[TrainConfig], int], budget_bytes: int):
        self.estimate, self.budget_bytes = estimate, budget_bytes
        self._estimates: dict[TrainConfig, int] = {}

    def predicted_peak(self, config: TrainConfig) -> int:
        """The estimator's bytes (cached: each is a fake training step)."""
        if config not in self._estimates:
            self._estimates[config] = int(self.estimate(config))
        return self._estimates[config]

    def correction(self, config: TrainConfig, records: list[TrialRecord]) -> tuple[float, bool]:
        """Measured / predicted peak for configs like this one (same precision, checkpointing
        on or off): the estimator's blind spots (CUDA context, fragmentation, kernels) learned
        on this device. An OOM at a prediction below budget raises the factor to at least
        budget / prediction. Returns (factor, calibrated by measurements)."""
        group = (config.precision, config.checkpoint_blocks > 0)
        ratios, all_ratios, floor = [], [], 0.0
        for r in records:
            if not r.predicted_peak_bytes:
                continue
            same = (r.config.precision, r.config.checkpoint_blocks > 0) == group
            if r.status in ("ok", "unhealthy") and r.peak_memory_bytes:
                ratio = r.peak_memory_bytes / r.predicted_peak_bytes
                all_ratios.append(ratio)
                if same:
                    ratios.append(ratio)
            elif r.status == "oom" and same:
                floor = max(floor, 1.02 * self.budget_bytes / r.predicted_peak_bytes)
        chosen = ratios or all_ratios
        factor = statistics.median(chosen) if chosen else 1.0
        return max(factor, floor), bool(chosen)

    def fits(self, config: TrainConfig, records: list[TrialRecord]) -> bool:
        """Predicted to fit: the calibrated prediction within budget (with a margin for the
        estimator's error while nothing is measured), and below every config of the same
        precision that ran out of memory: peak grows with what the estimator predicts."""
        predicted = self.predicted_peak(config)
        if any(r.status == "oom" and r.config.precision == config.precision and r.predicted_peak_bytes
               and predicted >= r.predicted_peak_bytes for r in records):
            return False
        factor, calibrated = self.correction(config, records)
        margin = 0.02 if calibrated else 0.10
        return predicted * factor <= self.budget_bytes * (1 + margin)

    def corrected_peak(self, config: TrainConfig, records: list[TrialRecord]) -> int:
        factor, _ = self.correction(config, records)
        return int(self.predicted_peak(config) * factor)
