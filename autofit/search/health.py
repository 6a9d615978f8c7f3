"""Numeric health: a low-precision trial is trusted only when its losses track a
full-precision reference's over the same batches."""

import statistics

from autofit.knobs import TrainConfig
from autofit.search.study import TrialRecord

# A precision is trusted when its loss tracks 32-true's over the same batches: the first
# loss (before any update) within FIRST_LOSS_RTOL, the mean over the trial within MEAN_LOSS_RTOL.
FIRST_LOSS_RTOL = 0.02
MEAN_LOSS_RTOL = 0.10
REFERENCE_PRECISIONS = ("32-true", "tf32")


def reference_for(config: TrainConfig | None, records: list[TrialRecord], *,
                  same_freeze: bool) -> TrialRecord | None:
    """A healthy full-precision trial (same freezing depth as `config` if asked)."""
    for r in records:
        if r.config.precision in REFERENCE_PRECISIONS and r.status == "ok" and r.measurement is not None \
                and r.measurement.losses and (not same_freeze or r.config.freeze_blocks == config.freeze_blocks):
            return r
    return None


def health_problem(record: TrialRecord, records: list[TrialRecord]) -> str | None:
    """Why a low-precision trial's losses cannot be trusted; None when fine or unknown.

    Every config sees the same initial weights and batches, so the first loss (before any
    update) differs only by precision, whatever the freezing depth; the mean over the
    trial is compared only with a reference of the same freezing depth."""
    if record.config.precision in REFERENCE_PRECISIONS or record.measurement is None:
        return None
    mine = record.measurement.losses
    any_ref = reference_for(record.config, records, same_freeze=False)
    if not mine or any_ref is None:
        return None
    ref0 = any_ref.measurement.losses[0]
    first = abs(mine[0] - ref0) / max(abs(ref0), 1e-12)
    if first > FIRST_LOSS_RTOL:
        return (f"first-step loss differs from {any_ref.config.precision} by {first:.1%} "
                f"(limit {FIRST_LOSS_RTOL:.0%})")
    same = reference_for(record.config, records, same_freeze=True)
    if same is not None:
        ref = same.measurement.losses
        n = min(len(mine), len(ref))
        mean = abs(statistics.fmean(mine[:n]) - statistics.fmean(ref[:n])) / max(abs(statistics.fmean(ref[:n])), 1e-12)
        if mean > MEAN_LOSS_RTOL:
            return f"mean loss differs from {same.config.precision} by {mean:.1%} (limit {MEAN_LOSS_RTOL:.0%})"
    return None
