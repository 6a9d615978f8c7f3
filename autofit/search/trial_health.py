"""Numeric health: a low-precision trial is trusted only when its losses track a
full-precision reference's over the same batches, and its updates move every weight the
reference's move (none lost to 16-bit rounding)."""

import dataclasses
import statistics

from autofit.config.train_config import TrainConfig
from autofit.measure.measurement import Measurement
from autofit.search.study import TrialRecord

# A precision is trusted when its loss tracks 32-true's over the same batches: the first
# loss (before any update) within FIRST_LOSS_RTOL, the mean over the trial within MEAN_LOSS_RTOL.
FIRST_LOSS_RTOL = 0.02
MEAN_LOSS_RTOL = 0.10
REFERENCE_PRECISIONS = ("32-true", "tf32")
# A reference planned for its losses (the health of a low-precision best) times this many
# steps, with no warm-up and no time window: the first loss and a short mean are what the
# checks read, and a full-precision step can be the dearest there is (13.6 s on gen-2026-01).
# Its figure may still rank: the median of its steps outvotes the one cold step (a figure
# from cold steps would drop its precision's groups as slow).
REFERENCE_TRIAL_STEPS = 3
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


# Where no full-precision trial ran at a freezing depth (its steps are dear where memory is
# tight), the autocast precisions stand in for the mean loss of a config whose numerics go
# further (weights in 16 bits, 8-bit optimizer state): torch.amp's numerics are what the user
# would run without autofit, so a config whose loss is worse than theirs is not picked over
# them (one whose loss is better is not judged by them: the stand-in may be what drifts).
# In this order: bf16 autocast also stands in for fp16 autocast, whose narrow exponent range
# (gradients under a loss scale) is what drifts where the two disagree; bf16 keeps fp32's.
STAND_IN_PRECISIONS = ("bf16-mixed", "16-mixed")


def _stand_in(config: TrainConfig, records: list[TrialRecord]) -> TrialRecord | None:
    """An autocast trial with fp32 optimizer state at `config`'s freezing depth, of a
    precision before `config`'s in `STAND_IN_PRECISIONS` where `config` is such a trial
    itself, the first precision there that ran (bf16 before fp16 whatever ran first). None
    where there is none."""
    judges = STAND_IN_PRECISIONS
    if config.precision in STAND_IN_PRECISIONS and config.optimizer_bits == 32:
        judges = STAND_IN_PRECISIONS[:STAND_IN_PRECISIONS.index(config.precision)]
    return next((r for precision in judges for r in records if r.config.precision == precision
                 and r.config.optimizer_bits == 32 and r.status == "ok" and r.measurement is not None
                 and r.measurement.losses and r.config.freeze_blocks == config.freeze_blocks), None)


def health_problem(record: TrialRecord, records: list[TrialRecord]) -> str | None:
    """Why a low-precision trial's losses cannot be trusted; None when fine or unknown.

    Every config sees the same initial weights and batches, so the first loss (before any
    update) differs only by precision, whatever the freezing depth; the mean over the
    trial is compared only with a reference of the same freezing depth, or without one with
    an autocast trial there (`_stand_in`)."""
    if is_reference(record.config) or record.measurement is None:
        return None
    mine = record.measurement.losses
    if not mine:
        return None
    any_ref = reference_for(record.config, records, same_freeze=False)
    if any_ref is not None:
        ref0 = any_ref.measurement.losses[0]
        first = abs(mine[0] - ref0) / max(abs(ref0), 1e-12)
        if first > FIRST_LOSS_RTOL:
            return (f"first-step loss differs from {any_ref.config.precision} by {first:.1%} "
                    f"(limit {FIRST_LOSS_RTOL:.0%})")
        stalled = stagnation_problem(record.measurement, any_ref)
        if stalled:
            return stalled
    same = reference_for(record.config, records, same_freeze=True)
    stand_in = _stand_in(record.config, records) if same is None else None
    judge = same or stand_in
    if judge is not None:
        share = _share_problem(record.measurement, judge)
        if share:
            return share
        ref = judge.measurement.losses
        n = min(len(mine), len(ref))
        gap = (statistics.fmean(mine[:n]) - statistics.fmean(ref[:n])) / max(abs(statistics.fmean(ref[:n])), 1e-12)
        # Against a stand-in only a worse loss counts: damage to the numerics slows learning,
        # and a config that learns faster than autocast says autocast is the one to doubt.
        if (gap if stand_in is not None else abs(gap)) > MEAN_LOSS_RTOL:
            return f"mean loss differs from {judge.config.precision} by {abs(gap):.1%} (limit {MEAN_LOSS_RTOL:.0%})"
    return None


def drifting(records: list[TrialRecord]) -> set[tuple]:
    """What was seen to drift, judged against the references measured by now (a trial
    measured before its reference is judged again): ("precision", p) for a low precision
    with fp32 optimizer state, ("optimizer_bits", 8) for 8-bit state under full-precision
    math, (p, 8) for the two together (either could be to blame). Seeds and twins are not
    planned with them (`drifts`); the sampler may still propose them, and every trial is
    judged on its own."""
    out = set()
    for r in records:
        if r.repeat or is_reference(r.config) or r.measurement is None:
            continue
        if r.status == "unhealthy" or (r.status == "ok" and health_problem(r, records) is not None):
            precision, bits = r.config.precision, r.config.optimizer_bits
            if bits == 32:
                out.add(("precision", precision))
            elif precision in REFERENCE_PRECISIONS:
                out.add(("optimizer_bits", bits))
            else:
                out.add((precision, bits))
    return out


def drifts(config: TrainConfig, seen: set[tuple]) -> bool:
    """`config`'s numerics include something `drifting` found."""
    precision, bits = config.precision, config.optimizer_bits
    return (("precision", precision) in seen
            or (bits != 32 and (("optimizer_bits", bits) in seen or (precision, bits) in seen)))


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


# ---- validation: the loss curve against the reference's ---------------------------------

# Steps per point of the curve, each point the median of its window: a loss spike (one
# step whose size is chaotic in the weights' last bits) is no trend. On the example GPT
# (benchmarks/loss_curves.py) a spike of 4.75 in 32-true was 6.44 in bf16-true: a 9% gap
# of 5-step means, while the medians of healthy bf16-mixed and bf16-true stay within 0.3%
# of 32-true's and plain bf16 AdamW drifts to 1.15%.
LOSS_CURVE_WINDOW_STEPS = 5


def loss_curve_gap(mine: list[float], reference: list[float], window_steps: int = LOSS_CURVE_WINDOW_STEPS) -> float:
    """The largest relative gap between the two curves' medians over consecutive windows of
    `window_steps` steps (the last window may be shorter), over the steps both have."""
    n = min(len(mine), len(reference))
    gaps = []
    for start in range(0, n, window_steps):
        end = min(start + window_steps, n)
        a, b = statistics.median(mine[start:end]), statistics.median(reference[start:end])
        gaps.append(abs(a - b) / max(abs(b), 1e-12))
    return max(gaps, default=0.0)


class LossCurveCheck:
    """Validation runs compared with the reference's (the 32-true baseline) over the same
    batches: a run whose windowed loss curve leaves the reference's by more than `rtol` is
    unhealthy (16-bit precisions and 8-bit optimizer state alike). Full-numerics runs, runs
    at another freezing depth and runs made before the reference is known pass unchecked."""

    def __init__(self, rtol: float, window_steps: int = LOSS_CURVE_WINDOW_STEPS):
        self.rtol, self.window_steps = rtol, window_steps
        self.reference: Measurement | None = None
        self.gaps: dict[TrainConfig, float] = {}  # config -> its largest gap, for the profile

    def set_reference(self, m: Measurement) -> None:
        if m.status == "ok" and m.losses:
            self.reference = m

    def check(self, m: Measurement) -> Measurement:
        ref = self.reference
        if (ref is None or m.status != "ok" or not m.losses or is_reference(m.config)
                or m.config.freeze_blocks != ref.config.freeze_blocks):
            return m
        gap = loss_curve_gap(m.losses, ref.losses, self.window_steps)
        self.gaps[m.config] = max(gap, self.gaps.get(m.config, 0.0))
        if gap <= self.rtol:
            return m
        return dataclasses.replace(m, status="unhealthy", reason=(
            f"loss curve over {min(len(m.losses), len(ref.losses))} validation steps leaves "
            f"{ref.config.precision}'s by up to {gap:.1%} ({self.window_steps}-step medians; limit {self.rtol:.1%}, "
            f"search.loss_curve_rtol)"))

    def summary(self, winner: TrainConfig) -> dict:
        """What the profile states: the reference, the tolerance and the winner's gap."""
        if self.reference is None:
            return {"reference": None, "rtol": self.rtol,
                    "note": "no 32-true baseline validated: loss curves not compared"}
        out = {"reference": self.reference.config.short(), "steps": len(self.reference.losses),
               "window_steps": self.window_steps, "rtol": self.rtol,
               "gap": None if winner not in self.gaps else round(self.gaps[winner], 5)}
        rejected = {c.short(): round(g, 4) for c, g in self.gaps.items() if g > self.rtol}
        return out | ({"rejected": rejected} if rejected else {})
