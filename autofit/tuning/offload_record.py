"""What offloading costs, said in the profile (`SearchSummary.offload`): what the winner
offloads, the host bytes it pins (predicted), and its step time against the fastest config
measured in this study that offloads nothing, where one was (a config that fit the card
without offloading, or one measured under a larger budget that shared the study)."""

from collections.abc import Callable, Sequence

from autofit.config.knobs import KNOBS
from autofit.config.train_config import TrainConfig
from autofit.search.study import TrialRecord

# The offload knobs: the memory knobs that cost speed wherever they act.
OFFLOAD_KNOBS = tuple(k.name for k in KNOBS.values() if k.last_resort)


def offloaded(config: TrainConfig) -> list[str]:
    """The offload knobs `config` turns on."""
    return [name for name in OFFLOAD_KNOBS if getattr(config, name) != KNOBS[name].default]


def offload_record(winner: TrainConfig, step_time_s: float, records: Sequence[TrialRecord],
                   host_bytes: Callable[[TrainConfig], int]) -> dict:
    """The profile's `search.offload` for `winner` ({} when it offloads nothing). `host_bytes`:
    the estimator's pinned host bytes of a config (asked only for an offloading winner)."""
    names = offloaded(winner)
    if not names:
        return {}
    out = {"offloaded": names, "host_bytes": host_bytes(winner), "step_time_s": step_time_s}
    plain = [r for r in records if r.status == "ok" and r.measurement is not None
             and r.measurement.step_time_s and not offloaded(r.config)]
    if not plain:
        return out | {"without_offload": {}, "note": "none measured: nothing without offloading fit this budget"}
    best = max(plain, key=lambda r: r.samples_per_s)
    out["without_offload"] = {"config": best.config.to_dict(), "step_time_s": best.measurement.step_time_s,
                              "budget_bytes": best.budget_bytes}
    # Both are one optimizer step over the same global batch: the ratio is what offloading costs.
    out["step_time_ratio"] = round(step_time_s / best.measurement.step_time_s, 3)
    return out
