"""What the records already say, for the `Tuner` (search/tuner.py): which configs are known
under this budget, which trials count against its limits, and the best so far. Pure
functions of the records and the budget.
"""

from autofit.config.train_config import TrainConfig
from autofit.search import _finish
from autofit.search.memory_model import record_budget
from autofit.search.study import TrialRecord
from autofit.search.trial_health import health_problem

BUDGET_RTOL = 0.02  # budgets this close are the same budget


def known(config: TrainConfig, records: list[TrialRecord], budget_bytes: int) -> TrialRecord | None:
    """A record of `config` whose result holds under this budget: a measurement, an OOM
    under a budget at least this one, or a second timeout (one timeout is retried: it
    may have been the machine, not the config). A pruned record is never one: pruning
    is re-decided every time."""
    timeouts = 0
    for r in records:
        if r.status == "compile_error" and config.compile:
            # The model did not compile: no compiled config of it is measured again.
            return r
        if (r.status == "error" and r.measurement is not None and r.measurement.precision_dropped
                and r.config.precision == config.precision):
            # The model's code cannot run in this precision: none of its configs is measured.
            return r
        if r.config != config or r.repeat:
            continue
        if r.status in ("ok", "unhealthy", "error"):
            return r
        if r.status == "oom" and (record_budget(r) or 0) >= budget_bytes:
            return r
        if r.status == "timeout":
            timeouts += 1
            if timeouts >= 2:
                return r
    return None


def spent(records: list[TrialRecord], budget_bytes: int) -> int:
    """Trials that count against `max_trials`: measurements taken under this budget.
    Pruned proposals and repeats do not."""
    return sum(1 for r in records if holds(r, budget_bytes))


def holds(r: TrialRecord, budget_bytes: int) -> bool:
    """A search measurement taken under this budget (what other processes leave free
    moves it by a little between runs). Measurements under another budget still inform
    the model and are not repeated, but a larger budget opens configs the old trials
    could not reach: they do not spend this budget's trials or patience."""
    budget = record_budget(r)
    return (r.measurement is not None and not r.repeat
            and (budget is None or abs(budget - budget_bytes) <= BUDGET_RTOL * budget_bytes))


def best(records: list[TrialRecord], budget_bytes: int) -> TrialRecord | None:
    """The fastest feasible trial whose health holds against the references measured by now:
    a low-precision trial measured before its reference is judged again, so a drifting one
    never stays the best the search refines around."""
    feasible = [r for r in records if r.feasible(budget_bytes) and not r.repeat and health_problem(r, records) is None]
    return max(feasible, key=lambda r: r.samples_per_s, default=None)


def judged(records: list[TrialRecord]) -> list[TrialRecord]:
    """The records with each trial's health judged against every reference measured by the
    end: a low-precision trial measured before its reference may turn out unhealthy."""
    out = []
    for r in records:
        problem = health_problem(r, records) if r.status == "ok" else None
        out.append(r.replace(status="unhealthy", reason=problem) if problem else r)
    return out


def ages(records: list[TrialRecord], now: float) -> str:
    """How old the measurements read back are: `; measured 2.5 h to 10 min ago`."""
    times = [r.measured_at for r in records if r.measured_at is not None and r.measurement is not None]
    if not times:
        return ""
    return (f"; measured {_finish.age_text(now - min(times))} to {_finish.age_text(now - max(times))} ago, under that "
            f"time's load: the leaders are measured again before their figures decide")
