"""The validate and frontier stages: the 32-true loss reference, the best configs for longer,
the winner against the floor in interleaved pairs (never slower than it), and the smaller
points of the frontier, validated like the winner; where the tune was halted first, the best
config measured so far (`unvalidated`)."""

from functools import partial

from loguru import logger

from autofit.base.errors import TrialTimeoutError
from autofit.base.sizes import format_bytes
from autofit.config.train_config import TrainConfig
from autofit.measure.measurement import Measurement
from autofit.search import choice, SearchResult, TrialRecord
from autofit.search.trial_health import health_problem, reference_for
from autofit.tuning._halting import halt_reason, halted
from autofit.tuning._trials import run_long
from autofit.tuning._tune_state import Chosen, passed, TuneState
from autofit.tuning.frontier import build_frontier, median_run
from autofit.tuning.speedup import BUSY_CORES, foreign_load, keeps_winner, measure_speedup
from autofit.tuning.validation import (baseline_record, floor_kind, host_load, LOADED_HOST, reference_record,
                                       REFERENCE_STEPS, run_timeout_s, run_validation, steps_within,
                                       validate as validate_best, validation_steps)


def validate(state: TuneState, result: SearchResult) -> Chosen:
    spec, runs = state.spec, partial(run_long, state)
    state.searched = {r.config: r for r in result.records if r.status == "ok"}
    # The floor: the faster of the one-liner (on the CPU 32-true at the largest micro batch
    # that fits) and the expert's fallback, where the one-liner did not fit the global batch.
    baseline = baseline_record(result, state.demoted)
    state.floor = floor_kind(result, baseline)
    loss_reference(state, result, baseline)
    winner, winner_m = validate_best(spec, result, runs, demoted=state.demoted, done=state.validations)
    load = host_load()
    if baseline is not None and state.validations.get(baseline.config) and not passed(state, baseline.config):
        baseline = None  # it ran and did not validate: no speed-up to claim
    speedup, note = None, ""
    if baseline is not None and baseline.config != winner.config:
        winner, baseline, speedup, note = _against_the_one_liner(state, winner, winner_m, baseline)
    if winner.config == getattr(baseline, "config", None) and not note:
        note = (f"nothing measured beat the {state.floor} {winner.config.short()} (search stopped: "
                f"{result.stop_reason}; {result.count('ok')} configs measured): the profile is the {state.floor}")
    if note:
        logger.warning(note)
    baseline_runs = passed(state, baseline.config) if baseline is not None else []
    return Chosen(winner=winner, winner_runs=passed(state, winner.config), baseline=baseline,
                  baseline_runs=baseline_runs, speedup=speedup, note=note, host_load=load)


def _against_the_one_liner(state: TuneState, winner: TrialRecord, winner_m: Measurement,
                           baseline: TrialRecord) -> tuple:
    """The winner and the one-liner in interleaved pairs: (the profile's config, the
    baseline or None where none of its runs passed, the speed-up, the note). The pairs
    validate the one-liner too where nothing did before (a GPU: its loss reference is a
    short 32-true run, not the one-liner)."""
    spec, floor = state.spec, state.floor
    validated_before = bool(passed(state, baseline.config))
    speedup = measure_speedup(spec, winner, baseline, partial(run_long, state), partial(halted, state),
                              winner_run=winner_m)
    state.paired = (winner.config, baseline.config, speedup, len(passed(state, baseline.config)))
    if not passed(state, baseline.config):
        return winner, None, None, ""  # none of its runs passed: nothing to claim against
    logger.info("speed-up of {} over the {} {}: {}", winner.config.short(), floor, baseline.config.short(),
                speedup.text())
    kept, note = keeps_winner(speedup), ""
    if not speedup.measurable and kept:
        note = (f"{speedup.why_no_claim()} ({speedup.text()}); by the median of the pairs the profile is "
                f"the search's winner, but its figures are no claim: tune again on a quiet host to know it")
    elif not speedup.measurable:
        note = (f"the search's winner {winner.config.short()} was not measurably faster than the {floor} "
                f"({speedup.text()}): the profile is the {floor}")
    elif not kept:
        note = (f"the search's winner {winner.config.short()} validated slower than the {floor} "
                f"({speedup.text()}): the profile is the {floor}")
    if kept:
        return winner, baseline, speedup, note
    if not validated_before:  # its runs were the pairs' short windows: now a validation's
        run_validation(spec, baseline, partial(run_long, state))
    return baseline, baseline, speedup, note


def loss_reference(state: TuneState, result: SearchResult, baseline: TrialRecord | None) -> None:
    """The 32-true loss curve the validation runs are held to, over the same batches. Where
    the one-liner is 32-true (the CPU) its validation run is it; else a short 32-true run
    of the search's reference config (its losses are needed, not its throughput, so a slow
    precision's long run never decides the wall time), or where 32-true ran only
    checkpointed, the losses of a full-numerics search trial (`health.reference_for`,
    the winner's freezing depth first)."""
    if baseline is not None and baseline.config.precision == "32-true":
        steps = steps_within(state.spec, state.searched.get(baseline.config), validation_steps(state.spec, baseline),
                             state.deadline.left_s())  # as `run_long` will cut them
        logger.info("validating the {} {} over {} steps (its losses are the 32-true reference)", state.floor,
                    baseline.config.short(), steps)
        state.curve.set_reference(run_validation(state.spec, baseline, partial(run_long, state)))
        return
    reference = reference_record(result, state.demoted)
    if reference is not None:
        steps = min(state.spec.search.validate_steps, REFERENCE_STEPS)
        state.curve.set_reference(run_long(state, reference.config, steps,
                                           run_timeout_s(state.spec, reference, steps), keep=False))
        return
    # 32-true ran only checkpointed (GPT-2 small on the H100: micro batch 64 with 6 blocks,
    # 1.3 s a step): its search trial's losses, from step 0 over the same batches, are the
    # curve, at no cost. Its freezing depth as the winner's where one has it.
    best = result.ranked[0].config if result.ranked else None
    searched = ((best is not None and reference_for(best, result.records, same_freeze=True))
                or reference_for(None, result.records, same_freeze=False))  # full numerics: 32-true or tf32
    if searched:
        state.curve.set_reference(searched.measurement)


def unvalidated(state: TuneState, result: SearchResult) -> tuple[Chosen, tuple]:
    """A halted tune's profile (the budget ran out, or a stop came): the best config measured
    so far, by its validation runs where it has passing ones, else by the figure the search
    ranks it by; never below the floor's figure, and the floor where the pairs against it
    ended and did not keep the winner. Configs whose validation failed are passed over."""
    why = halt_reason(state)
    failed = {c for c, runs in state.validations.items() if runs and not passed(state, c)}
    candidates = [r for r in result.ranked if r.config not in state.demoted and r.config not in failed]
    if not candidates:
        raise TrialTimeoutError(f"{why} before a config passed validation; rerun to resume the study")
    baseline = baseline_record(result, state.demoted)
    state.floor = floor_kind(result, baseline)
    if baseline is not None and baseline.config in failed:
        baseline = None  # it ran and did not validate: it holds nothing, as in `validate`
    winner = _not_below_the_floor(state, result, candidates[0], baseline)
    paired = None
    if baseline is not None and state.paired is not None and state.paired[1] == baseline.config:
        # The pairs ended and did not keep their winner (kept, no run follows them): the budget
        # ran out in the floor's own validation, and the floor is the profile, as in `validate`.
        winner, paired = baseline, state.paired
    runs = passed(state, winner.config)
    validated = bool(runs)
    note = halted_note(why, state.floor, validated=validated, profile=winner.config,
                       searched=paired[0] if paired else candidates[0].config,
                       baseline=baseline.config if baseline is not None else None,
                       pairs=paired[2].text() if paired else "",
                       validated_after_pairs=paired is not None and len(runs) > paired[3])
    logger.warning("{}: the profile is {}, {}", why, winner.config.short(), note)
    chosen = Chosen(winner=winner, winner_runs=runs or _ranked_runs(result, winner.config) or [winner.measurement],
                    baseline=baseline,
                    baseline_runs=passed(state, baseline.config) if baseline is not None else [], speedup=None,
                    note=note, host_load=host_load(), validated=validated, unvalidated="" if validated else why,
                    halted=True)
    point = build_frontier(result, winner, chosen.winner_runs, max_points=1,
                           validate_steps=state.spec.search.validate_steps if validated else 0,
                           validations=state.validations, run_validation=lambda record: None)
    return chosen, point


def halted_note(why: str, floor: str, *, validated: bool, profile: TrainConfig, searched: TrainConfig,
                baseline: TrainConfig | None, pairs: str = "", validated_after_pairs: bool = False) -> str:
    """What a halted tune's profile lacks (`why`: the halt). A profile that is the floor needs
    no speed-up over itself: what was cut is the comparison with the search's choice, where
    that is another config, or (`pairs`: that comparison's figures, where it ended) the
    floor's own validation after it, unless that ended too (`validated_after_pairs`)."""
    if not validated:
        note = f"not validated: {why} first; its figures are the search's (rerun to validate)"
    elif profile != baseline:
        note = f"validated, but {why} before its speed-up over the {floor} was measured"
    elif pairs and validated_after_pairs:
        note = (f"validated, after the search's choice {searched.short()} was measured against it in pairs and "
                f"not kept ({pairs}); {why} after that")
    elif pairs:
        note = (f"validated in pairs only: {why} during its own validation, after the search's choice "
                f"{searched.short()} was measured against it in pairs and not kept ({pairs})")
    elif searched != profile:
        note = (f"validated, but {why} before the search's choice {searched.short()} was measured against the "
                f"{floor} in pairs; by their figures so far it is not faster")
    else:
        note = f"validated, but {why} before validation was done"
    if profile == baseline:
        note += f"; nothing measured beat the {floor}: the profile is the {floor}"
    return note


def _not_below_the_floor(state: TuneState, result: SearchResult, winner: TrialRecord,
                         baseline: TrialRecord | None) -> TrialRecord:
    """The search's choice (its ranking weighs the noise it saw), held by the floor to the
    one-liner in like figures: validation runs where both have them, else the figures the
    search ranks them by (`choice.figure_of`, as the floor was chosen)."""
    if baseline is None or baseline.config == winner.config:
        return winner
    ours, theirs = passed(state, winner.config), passed(state, baseline.config)
    if ours and theirs:
        slower = median_run(ours).samples_per_s < median_run(theirs).samples_per_s
    else:
        slower = _ranked_figure(result, winner.config) < _ranked_figure(result, baseline.config)
    return baseline if slower else winner


def _ranked_figure(result: SearchResult, config: TrainConfig) -> float:
    """`config`'s figure from its runs within the budget, as the search ranks it."""
    runs = _feasible_runs(result, config)
    return choice.figure_of(runs, result.session_start).samples_per_s if runs else 0.0


def _ranked_runs(result: SearchResult, config: TrainConfig) -> list[Measurement]:
    """The measurements the search ranks `config` by (its figure's runs: an unvalidated
    profile's figure is their median run, not its first quiet trial's)."""
    return [r.measurement for r in choice.figure_runs(_feasible_runs(result, config), result.session_start)]


def _feasible_runs(result: SearchResult, config: TrainConfig) -> list[TrialRecord]:
    """`config`'s runs as `choice.rank` takes them: within the budget, numerics not in doubt."""
    return [r for r in result.records if r.config == config and r.feasible(result.budget_bytes)
            and health_problem(r, result.records) is None]


def frontier(state: TuneState, result: SearchResult, chosen: Chosen, *, runs: bool = True) -> tuple:
    """The validated frontier; `runs` False: of the points validated already (the tune was
    halted during a point's run: the winner and its speed-up stand)."""
    spec = state.spec
    points = build_frontier(result, chosen.winner, chosen.winner_runs, max_points=spec.search.frontier_points,
                            validate_steps=spec.search.validate_steps, validations=state.validations,
                            run_validation=lambda record: run_validation(spec, record, partial(run_long, state)),
                            demoted=state.demoted, should_stop=partial(halted, state) if runs else lambda: True)
    logger.info("frontier: {}", "; ".join(f"{p.config.short()} peak {format_bytes(p.measured.peak_memory_bytes)} "
                                          f"{p.measured.samples_per_s:.4g} samples/s" for p in points))
    busy = loaded(chosen)
    if busy:
        logger.warning("the host was loaded while validating ({}): throughput figures are noisy; re-run on a "
                       "quiet machine to trust them", busy)
    return points


def loaded(chosen: Chosen) -> str:
    """Other work on the host while validating, as measured: the validation runs' foreign
    cores (the pairs', else the winner's), else the load average, which counts this tune's own
    children too; "" when quiet. Seen on the CPU: "load 0.9 per core" was blamed on a host
    whose only work was the tune."""
    pairs = chosen.speedup.winner_runs + chosen.speedup.baseline_runs if chosen.speedup is not None else []
    busy, cores = foreign_load(pairs or chosen.winner_runs)
    if busy is not None:
        return f"{busy:.1f} of {cores} cores busy with other work" if busy >= BUSY_CORES else ""
    if chosen.host_load is not None and chosen.host_load > LOADED_HOST:
        return f"load {chosen.host_load:.1f} per core"
    return ""
