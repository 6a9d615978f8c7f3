"""The search stage (the ask/tell loop; workers sharing the study wait for the first to
finish) and its verdict where nothing measured fits: why (nothing fits, every trial timed
out, crashed)."""

from loguru import logger

from autofit.base.errors import NothingFitsError, OutOfTimeError, TrialError, TrialTimeoutError
from autofit.base.sizes import format_bytes
from autofit.search import SearchResult, SearchSpace, Tuner
from autofit.search.shared import shared_profile
from autofit.tuning._halting import halt_reason, halted, stopped
from autofit.tuning._tune_state import TuneState


def search(state: TuneState) -> tuple[SearchResult, tuple[dict, str] | None]:
    """(the search's result, the profile another worker of the study wrote, if one did)."""
    searched = state.tuner.search()
    # Workers sharing the study: the first to end its search validates and writes the
    # profile; the others wait here (the lock is held until tune() returns), then hand out
    # the same profile.
    state.locks.finish(should_stop=lambda: halted(state))
    shared = shared_profile(state.study, since=state.written_before)
    result = state.tuner.result(searched) if shared else state.tuner.finish(searched)
    searched = sum(r.measurement is not None and not r.repeat for r in result.records)
    logger.info("search stopped: {}; {} trials run ({} oom), {} re-measures, {} pruned without running, in {:.0f}s",
                result.stop_reason, searched, result.count("oom"), result.measured - searched,
                result.count("pruned"), result.wall_s)
    if halted(state) and not result.ranked:
        if stopped(state):
            raise InterruptedError("tune stopped before any config was measured; rerun to resume the study")
        raise OutOfTimeError(f"{halt_reason(state)} before any config was measured; rerun to resume the "
                             f"study, or give more time (--time-budget, search.time_budget)")
    return result, shared


def verdict(state: TuneState, result: SearchResult) -> None:
    """Nothing measured fits: raise why. "Nothing fits" is a verdict only when every trial
    was measured: one that timed out or crashed might have fitted, and a rerun resumes."""
    if result.ranked:
        return
    if result.count("timeout"):
        raise TrialTimeoutError(f"{result.count('timeout')} trial(s) timed out (search.trial_timeout_s is "
                                f"{state.spec.search.trial_timeout_s:g}s, doubled on retry), and none fitted; "
                                f"rerun to resume the study, or raise search.trial_timeout_s")
    if result.count("error"):
        first = next(r.reason for r in result.records if r.status == "error")
        raise TrialError(f"{result.count('error')} trial(s) crashed and none fitted; the first: {first}")
    raise NothingFitsError(_nothing_fits_message(result, state.tuner, state.space))


def _nothing_fits_message(result: SearchResult, tuner: Tuner, space: SearchSpace) -> str:
    peaks = [(r.peak_memory_bytes or r.predicted_peak_bytes or 0, r) for r in result.records
             if r.status in ("oom", "ok", "pruned")]
    smallest = min(peaks, key=lambda p: p[0], default=None)
    frugal = space.config(min(space.precisions, key=lambda p: ("bf16-true", "bf16-mixed", "16-mixed").index(p)
                              if p in ("bf16-true", "bf16-mixed", "16-mixed") else 9),
                          space.micro_batch_sizes[0], space.checkpointable(space.max_freeze_blocks),
                          space.max_freeze_blocks)
    frugal = frugal.replace(**space.lean(frugal.precision, space.strategy_of(frugal)))
    needed = tuner.memory.corrected_peak(frugal, result.records)
    unhealthy = sum(result.count(s) for s in ("unhealthy", "error", "timeout", "compile_error"))
    seen = (f"; the smallest peak seen was {format_bytes(smallest[0])} ({smallest[1].config.short()})"
            if smallest else "")
    extra = f"; {unhealthy} trials failed or were unhealthy" if unhealthy else ""
    return (f"nothing fits the budget of {format_bytes(result.budget_bytes)}{seen}; the smallest "
            f"configuration ({frugal.short()}) needs about {format_bytes(needed)}{extra}")
