"""The search's time, for the `Tuner` (search/tuner.py): whether a trial can end in the time
left (priced from the trials measured), when the loop must stop, and the estimates held
back so that they never starve the trials.
"""

import math
from collections.abc import Callable

from loguru import logger

from autofit.config.train_config import TrainConfig
from autofit.search import seeding
from autofit.search._state import SearchTimeUp, Timing
from autofit.search.memory_model import EstimateDeferred
from autofit.search.search_space import SearchSpace
from autofit.search.study import TrialRecord
from autofit.search.trial_health import REFERENCE_PRECISIONS

# The fewest optimizer steps a trial runs (a warm-up step and the window's minimum): with a
# predicted step time, the least a trial can cost.
LEAST_TRIAL_STEPS = 4
# ... under the trial's cap (`Deadline.trial_cap_s`, `measure/steps.py`): a warm-up step that
# reaches half of it and a timed step that reaches all of it end the trial, so a step of half
# the cap or more costs two steps, not four.
CAPPED_TRIAL_STEPS = 2
# A compiled trial's steps before the cap's clock starts (`Steps._warm_compiled`): one that
# compiles at least and the steady one after it, whose step times `compile_s` leaves out.
COMPILE_WARMUP_STEPS = 2
# A full-precision (fp32, no TF32) step over a 16-bit one, before a full-precision trial has
# said: on a GPU its matmuls leave the tensor cores (H100 dense: 67 against 990 TFLOP/s); GPT-2
# small measured 6.5x on an H100 (32-true with 6 of 12 blocks checkpointed against bf16-mixed:
# benchmarks/results/2026-11-28-h100-gpu-check-a6c9ec0.json), 5x without the recompute. A CPU
# runs 16 bits no faster than 32: no prior (1); one with no unit that multiplies a 16-bit
# dtype (`Timing.slow_16_bit`) runs that dtype's precisions `CPU_16_BIT_SLOWDOWN` times slower.
FULL_PRECISION_SLOWDOWN = {"cuda": 5.0}
# A 16-bit step over 32-true's on a CPU with no unit that multiplies its dtype, the least
# measured (an AMD EPYC with AVX2, 2 cores): the README's tiny GPT 6.5x (bf16-mixed) and 8x
# (16-mixed), a 4-layer Gemma-2-style model's bf16-mixed 6.8-7.1x, a 4-layer 256-wide
# encoder stack 22-27x (`benchmarks/results/2026-11-29-cpu-16-bit.md`).
CPU_16_BIT_SLOWDOWN = 6.0
# The precisions each 16-bit dtype (as `device.probe.cpu_16_bit_units` names them) computes in.
PRECISIONS_OF_16_BIT = {"bf16": ("bf16-mixed", "bf16-true"), "fp16": ("16-mixed",)}


def slow_16_bit(units: frozenset[str] | None) -> frozenset[str]:
    """The 16-bit precisions a CPU with these 16-bit multiply `units` has none for (`Timing.slow_16_bit`);
    none where its units are unknown (None: no prior)."""
    if units is None:
        return frozenset()
    return frozenset(p for dtype, precisions in PRECISIONS_OF_16_BIT.items() if dtype not in units for p in precisions)


# What a compiled trial's compiling costs before one of this search has compiled (then: the
# longest it measured). Inductor compiles a transformer's training step from a cold cache in
# tens of seconds (30-40 s per graph on a 2-core CPU, docs/benchmarks.md); a compile twin
# started with less left than this runs past the search's share into validation's time.
COMPILE_PRIOR_S = 30.0
# The trials whose dearest round sizes a refinement twin's last moment (`last_chance`), and the
# margin on it: the next round may cost more than any of the last (its plan's estimates; on
# the compiled landscape 11.4 s after rounds of 7.4-8.0 s let the last moment pass).
LAST_CHANCE_TRIALS = 3
LAST_CHANCE_MARGIN = 1.5


def compile_cost_s(records: list[TrialRecord]) -> float:
    """What compiling a config is expected to cost: the longest compile this search measured
    (a new micro batch is a new graph, mostly compiled afresh), else `COMPILE_PRIOR_S`."""
    measured = [r.measurement.compile_s for r in records
                if r.config.compile and r.measurement is not None and r.measurement.compile_s is not None]
    return max(measured, default=COMPILE_PRIOR_S)


def affordable(timing: Timing, space: SearchSpace, config: TrainConfig, records: list[TrialRecord], *,
               looks_down: bool = False, spare_s: float = 0.0, left_s: float | None = None,
               capped: bool = False) -> bool:
    """The least a trial of `config` can cost fits in the search's time left:
    `LEAST_TRIAL_STEPS` steps (`capped`: as its cap takes them, `least_steps_s`, and a
    compiled config's `COMPILE_WARMUP_STEPS` before the cap's clock) at a step time predicted
    from the measured trials that predict it (`speeds_alike`: its speed class's, else another
    class's moved by the device's prior; the fastest of their samples/s, scaled down in
    proportion where `config`'s micro batch is smaller than theirs,
    unless it is the look from below: `looks_down`, priced as its cap takes its steps), and
    a compiled config's compiling (`compile_cost_s`), with `spare_s` more left over (of
    `left_s`, the search's time left by default). A trial that runs past the search's share
    eats the time the re-measures and validation need; one that runs past the budget gives
    nothing. Without a measured trial, or without a budget, any config is affordable."""
    deadline = timing.deadline
    search_s = deadline.search_s()
    if search_s is None or (timing.searching_since is None and left_s is None):
        return True
    left_s = (search_s - deadline.elapsed_s() if left_s is None else left_s) - spare_s
    # A smaller micro batch is predicted slower in proportion (a GPU's way), but for the look
    # from below a slow micro step (`plan._look_down`): that step may be slow for its size.

    def scale(r: TrialRecord) -> float:
        return 1.0 if looks_down else min(1.0, config.micro_batch_size / r.config.micro_batch_size)

    speeds = speeds_alike(timing, config.precision, records, scale)
    if not speeds:
        return True
    step_s = space.global_batch_size / max(speeds)
    least_s = LEAST_TRIAL_STEPS * step_s
    # The look from below is priced at the slow step it looks away from, as its trial's cap
    # takes its steps (two of a step past half the cap, on a CPU after the tracked two): at
    # four, gen-2026-00's look (a 21.6 s step, 60 s left of a 180 s budget's search) was never
    # taken and an unmeasured precision's seed at the slow micro batch was, 0.13 of the
    # optimum where the look found 0.70. A look slower a step than that runs over by as much.
    if capped or looks_down:
        least_s = least_steps_s(timing, step_s) + (COMPILE_WARMUP_STEPS * step_s if config.compile else 0.0)
    return least_s + (compile_cost_s(records) if config.compile else 0.0) <= left_s


def least_steps_s(timing: Timing, step_s: float) -> float:
    """The least a trial's steps take at `step_s` a step, as `measure.steps.Steps` takes them:
    `LEAST_TRIAL_STEPS` steps, or under the trial's cap (`Deadline.trial_cap_s`) the whole
    steps that reach it, `CAPPED_TRIAL_STEPS` at least. Pricing a slow step at four steps
    where its trial takes two left a 1.3B decoder's 11 s steps unaffordable with 28 s left.
    Under the cap, the steps before its clock come on top: on a CPU the tracked steps
    (`Timing.steps_before_cap`), so there a capped price never falls below the uncapped four,
    which leave them out too; and a compiled trial's (`affordable`)."""
    least_s = LEAST_TRIAL_STEPS * step_s
    cap_s = timing.deadline.trial_cap_s()
    if cap_s is None:
        return least_s
    capped_s = max(CAPPED_TRIAL_STEPS, math.ceil(cap_s / step_s)) * step_s
    return min(least_s, timing.steps_before_cap * step_s + capped_s)


def speeds_alike(timing: Timing, precision: str, records: list[TrialRecord],
                 scale: Callable[[TrialRecord], float] = lambda r: 1.0) -> list[float]:
    """The measured speeds that predict a trial's in `precision`, each scaled by `scale` and
    moved by the device's priors (`over_full`) where it is another precision's. Its speed
    class's trials (`seeding.speed_class`: the 16-bit precisions together, each full precision
    alone, as tf32 may be 2x 32-true), those under its own prior first (a CPU with a unit for
    bf16 and none for fp16 holds the two apart: a measurement beats a prior). A full precision
    with none of its own is predicted from the 16-bit trials (those with a unit first); a
    16-bit precision with none, from the fastest trial of each full precision, the slower of
    those (unpriced, a CPU's first bf16 trial, 7x slower than 32-true there, started with 15 s
    of the search left and ran 56 s, into validation's time). [] where nothing predicts it."""
    def speeds_of(alike: Callable[[str], bool]) -> list[float]:
        return [r.samples_per_s * scale(r) * over_full(timing, precision) / over_full(timing, r.config.precision)
                for r in records if r.status == "ok" and r.samples_per_s > 0 and alike(r.config.precision)]

    def in_class(p: str) -> bool:
        return seeding.speed_class(p) == seeding.speed_class(precision)

    def sixteen(p: str) -> bool:
        return seeding.speed_class(p) == seeding.SIXTEEN_BIT

    def unit(p: str) -> bool:  # multiplied natively where `precision` is (a full precision always is)
        return (p in timing.slow_16_bit) == (precision in timing.slow_16_bit)

    speeds = speeds_of(lambda p: in_class(p) and unit(p)) or speeds_of(in_class)
    if speeds:
        return speeds
    if precision in REFERENCE_PRECISIONS:
        return speeds_of(lambda p: sixteen(p) and unit(p)) or speeds_of(sixteen)
    fastest = [max(found) for full in REFERENCE_PRECISIONS for found in [speeds_of(lambda p: p == full)] if found]
    return [min(fastest)] if fastest else []


def over_full(timing: Timing, precision: str) -> float:
    """A step's speed in `precision` over a full precision's, where a trial of one predicts the
    other (two 16-bit precisions: the ratio of theirs): 1 for a full precision; for a 16-bit
    one, `full_precision_slowdown` (a GPU's tensor cores), or 1/`CPU_16_BIT_SLOWDOWN` where
    this CPU has no unit that multiplies its dtype (`Timing.slow_16_bit`)."""
    if precision in REFERENCE_PRECISIONS:
        return 1.0
    return 1 / CPU_16_BIT_SLOWDOWN if precision in timing.slow_16_bit else timing.full_precision_slowdown


def least_trial_s(timing: Timing, space: SearchSpace, records: list[TrialRecord]) -> float | None:
    """The least any trial can cost (`LEAST_TRIAL_STEPS` steps at the fastest speed measured or
    predicted, `speeds_alike`), where it is more than the search's time left: no config is
    affordable (`affordable` prices each from the same speeds, never faster), and planning more would
    spend estimates (fake steps of device time) on proposals that cannot run. Else None."""
    search_s = timing.deadline.search_s()
    speeds = [speeds_alike(timing, p, records) for p in space.precisions]
    if search_s is None or timing.searching_since is None or not all(speeds):
        return None  # a precision nothing predicts may be affordable
    least_s = LEAST_TRIAL_STEPS * space.global_batch_size / max(max(s) for s in speeds)
    return least_s if least_s > search_s - timing.deadline.elapsed_s() else None


def last_chance(timing: Timing, space: SearchSpace, config: TrainConfig, records: list[TrialRecord], *,
                looks_down: bool = False) -> bool:
    """`config` is affordable now, but would not be after one more round (its planning, its
    estimates and its trial) costing `LAST_CHANCE_MARGIN` times the dearest of the last
    `LAST_CHANCE_TRIALS` (a median would let a dearer trial started just before the last
    moment pass it): the search's last moment to measure it."""
    if not timing.trial_costs_s:
        return False
    spare_s = LAST_CHANCE_MARGIN * max(timing.trial_costs_s[-LAST_CHANCE_TRIALS:])
    return (affordable(timing, space, config, records, looks_down=looks_down)
            and not affordable(timing, space, config, records, looks_down=looks_down, spare_s=spare_s))


def trials_within(timing: Timing, step_s: float) -> float:
    """How many trials of the least cost (`LEAST_TRIAL_STEPS` steps of `step_s`) the search's
    share of the time budget holds; infinite without a budget."""
    search_s = timing.deadline.search_s()
    return math.inf if search_s is None else search_s / (LEAST_TRIAL_STEPS * step_s)


def affordable_after_search(timing: Timing, space: SearchSpace, config: TrainConfig,
                            records: list[TrialRecord], after_s: float = 0.0, reference: bool = False) -> bool:
    """After the search (a `reference`, one more trial of the best's shape moved): its least cost
    fits in half of the budget's time left (the rest re-measures and validates), `after_s` from
    now. The move is priced as its cap takes its steps (`least_steps_s`; on a CPU, four): it
    was chosen for its gain, and four steps of a slow step left a move predicted 1.4x
    unmeasured with its three affordable. A reference runs its three steps whatever the cap
    (`tuning._trials.run_reference`), at a full precision's speed that is the prior's until one
    ran: priced at `LEAST_TRIAL_STEPS` (at three, TinyLlama's 32-true reference at 240 s ran
    114 s, past the search's share). With a budget and nothing measured, none is: a
    reference's losses would judge nothing, and its slow steps would spend what a floor needs."""
    if timing.deadline.budget_s is None:
        return True
    left_s = timing.deadline.left_s() - after_s
    return any(r.status == "ok" for r in records) and affordable(timing, space, config, records, left_s=left_s / 2,
                                                                 capped=not reference)


def gated(timing: Timing, estimate: Callable[[TrainConfig], int]) -> Callable[[TrainConfig], int]:
    """`estimate`, refused (`SearchTimeUp`) once the search loop's time is up: an estimate
    is a fake step that costs device time, and a loop that plans past its share would
    spend what the re-measures and validation need."""
    def gate(config: TrainConfig) -> int:
        if timing.searching_since is not None and timed_out(timing, timing.searching_since):
            raise SearchTimeUp
        if timing.estimates_until is not None and timing.deadline.clock() + timing.dearest_estimate_s > timing.estimates_until:
            raise SearchTimeUp
        if first_trial_waits(timing) or timing.blind:
            raise EstimateDeferred
        began = timing.deadline.clock()
        try:
            return estimate(config)
        finally:
            timing.dearest_estimate_s = max(timing.dearest_estimate_s, timing.deadline.clock() - began)
    return gate


def unknown_peak(config: TrainConfig) -> int:
    """No estimate at all (`_floors.floor_when_nothing_ran`): the fit then knows only the OOMs measured."""
    raise EstimateDeferred


def first_trial_waits(timing: Timing) -> bool:
    """Before the study's first trial, one more estimate (as dear as the dearest so far)
    would take the tune past `Deadline.first_estimates_s`: it is deferred, so the first
    trial starts within the first quarter of any budget."""
    deadline = timing.deadline
    share_s = deadline.first_estimates_s()
    if not timing.awaiting_first_trial or share_s is None:
        return False
    waits = deadline.elapsed_s() + timing.dearest_estimate_s > share_s
    if waits and not timing.said_deferred:
        timing.said_deferred = True
        logger.info("estimates deferred until the first trial: {:.0f}s of the {:g}s budget spent before it "
                    "(estimates up to {:.1f}s each)", deadline.elapsed_s(), deadline.budget_s,
                    timing.dearest_estimate_s)
    return waits


def halted(timing: Timing) -> bool:
    """A stop was asked for, or the tune's time budget is spent: measure nothing more."""
    return timing.should_stop() or timing.deadline.expired()


def timed_out(timing: Timing, start: float) -> bool:
    """The search loop's time is up: `timeout_s` since it started, or its share of the tune's budget."""
    search_s = timing.deadline.search_s()
    return ((timing.timeout_s is not None and timing.deadline.clock() - start >= timing.timeout_s)
            or (search_s is not None and timing.deadline.elapsed_s() >= search_s))


def stop_text(timing: Timing) -> str:
    """Why a stop came: the time budget (a tune may set its stop at the deadline), else a stop request."""
    return f"time budget of {timing.deadline.budget_s:g}s spent" if timing.deadline.expired() else "stopped"


def timeout_text(timing: Timing, start: float) -> str:
    if timing.timeout_s is not None and timing.deadline.clock() - start >= timing.timeout_s:
        return f"timeout {timing.timeout_s:g}s"
    return (f"the search's share of the {timing.deadline.budget_s:g}s time budget spent "
            f"({timing.deadline.search_s():.0f}s); the rest re-measures and validates")
