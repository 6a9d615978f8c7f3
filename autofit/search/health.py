"""Numeric health: a low-precision trial is trusted only when its losses track a
full-precision reference's over the same batches, and its updates move every weight the
reference's move (none lost to 16-bit rounding)."""

import statistics

from autofit.knobs import TrainConfig
from autofit.search.study import TrialRecord

# A precision is trusted when its loss tracks 32-true's over the same batches: the first
# loss (before any update) within FIRST_LOSS_RTOL, the mean over the trial within MEAN_LOSS_RTOL.
FIRST_LOSS_RTOL = 0.02
MEAN_LOSS_RTOL = 0.10
REFERENCE_PRECISIONS = ("32-true", "tf32")
# Of the trainable elements, the share left bit-identical by the timed steps may exceed the
# reference's by this much (elements whose gradient was zero stay put in both).
UNCHANGED_SHARE_EXCESS = 0.01


def is_reference(config: TrainConfig) -> bool:
    """Full numerics: fp32 (or tf32) math and fp32 optimizer state. 8-bit state is judged
    against such a trial as a 16-bit precision is (the chunked loss computes the same fp32
    loss, so it may be a reference)."""
    return config.precision in REFERENCE_PRECISIONS and config.optimizer_bits == 32


def reference_for(config: TrainConfig | None, records: list[TrialRecord], *,
                  same_freeze: bool) -> TrialRecord | None:
    """A healthy full-precision trial with fp32 optimizer state (same freezing depth as
    `config` if asked)."""
    for r in records:
        if is_reference(r.config) and r.status == "ok" and r.measurement is not None \
                and r.measurement.losses and (not same_freeze or r.config.freeze_blocks == config.freeze_blocks):
            return r
    return None


def health_problem(record: TrialRecord, records: list[TrialRecord]) -> str | None:
    """Why a low-precision trial's losses cannot be trusted; None when fine or unknown.

    Every config sees the same initial weights and batches, so the first loss (before any
    update) differs only by precision, whatever the freezing depth; the mean over the
    trial is compared only with a reference of the same freezing depth."""
    if is_reference(record.config) or record.measurement is None:
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
    stalled = stagnation_problem(record.measurement, any_ref)
    if stalled:
        return stalled
    same = reference_for(record.config, records, same_freeze=True)
    if same is not None:
        share = _share_problem(record.measurement, same)
        if share:
            return share
        ref = same.measurement.losses
        n = min(len(mine), len(ref))
        mean = abs(statistics.fmean(mine[:n]) - statistics.fmean(ref[:n])) / max(abs(statistics.fmean(ref[:n])), 1e-12)
        if mean > MEAN_LOSS_RTOL:
            return f"mean loss differs from {same.config.precision} by {mean:.1%} (limit {MEAN_LOSS_RTOL:.0%})"
    return None


def stagnation_problem(mine, reference: TrialRecord) -> str | None:
    """Trainable tensors that the timed steps left bit-identical here but moved in the
    reference (same initial weights, same batches): updates lost to rounding, e.g. a
    LayerNorm gain of 1.0 under plain bf16 AdamW. A tensor whose gradient was zero stays
    put in the reference too, so it is never counted."""
    theirs = reference.measurement
    if mine.unchanged_share is None or theirs.unchanged_share is None:
        return None  # measured before the check existed
    lost = [name for name in mine.stalled_params if name not in set(theirs.stalled_params)]
    if not lost:
        return None
    shown = ", ".join(lost[:3]) + (f" and {len(lost) - 3} more" if len(lost) > 3 else "")
    return (f"{len(lost)} trainable tensor(s) never changed in the timed steps though {reference.config.precision} "
            f"moved them ({shown}): updates below the weights' resolution are lost")


def _share_problem(mine, reference: TrialRecord) -> str | None:
    theirs = reference.measurement
    if mine.unchanged_share is None or theirs.unchanged_share is None:
        return None
    excess = mine.unchanged_share - theirs.unchanged_share
    if excess <= UNCHANGED_SHARE_EXCESS:
        return None
    return (f"the updates left {mine.unchanged_share:.1%} of trainable elements bit-identical, "
            f"{reference.config.precision} {theirs.unchanged_share:.1%} (limit +{UNCHANGED_SHARE_EXCESS:.0%})")
