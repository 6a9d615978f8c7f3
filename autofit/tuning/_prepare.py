"""The tune's first stage: the trial worker, the study (resumed if it exists) and its locks,
the model's analysis and search space, the starts (training's demotions, a warm start) and
the tuner that searches them."""

import contextlib
from functools import partial

from loguru import logger

from autofit.base.sizes import format_bytes
from autofit.device.probe import cpu_16_bit_units
from autofit.measure import asks
from autofit.measure.measurement import TRACKED_STEPS
from autofit.measure.trial import trial_worker
from autofit.search import FULL_PRECISION_SLOWDOWN, slow_16_bit, Tuner
from autofit.search.shared import profiles_written, StudyLocks
from autofit.search.warm_start import warm_starts
from autofit.profiles.demotions import read_demotions
from autofit.tuning._halting import halted
from autofit.tuning._trials import predict, report_trial, run_reference, run_trial
from autofit.tuning._tune_state import TuneState
from autofit.tuning.space import search_space, study_name

# The one-liner's precision, first found first: the fastest 16-bit autocast on a GPU (bf16
# where the device has it: the space holds only what it supports); 32-true on the CPU.
ONE_LINER_CUDA = ("bf16-mixed", "16-mixed")
ONE_LINER_CPU = ("32-true",)


def prepare(state: TuneState, cleanup: contextlib.ExitStack) -> None:
    setup, spec, device = state.setup, state.spec, state.device
    # The user's code (model module, data, forward) runs only in the worker's children.
    state.trial_worker = cleanup.enter_context(
        setup.trial_worker or trial_worker(spec, "cpu" if device.kind == "cpu" else state.execute_on,
                                           objects=setup.objects))
    # The study first, while the worker starts (its torch import, the model's build).
    name = study_name(spec, device, setup.budget.requested_bytes)
    state.study = state.seams.make_study(study_name=name, storage=setup.storage, seed=spec.train.seed)
    state.locks = cleanup.enter_context(StudyLocks(setup.storage, name))
    state.written_before = profiles_written(state.study)
    # A model autofit did not write: is its batch where autofit splits it? (In a child: it
    # runs the user's forward.)
    asks.probe_batch_dim(state.trial_worker, spec, stop_event=state.halt)
    state.analysis = asks.analyze(state.trial_worker, spec, setup.nproc, stop_event=state.halt)
    state.space = search_space(spec, device, setup.nproc, state.analysis)
    logger.info("tuning {} on {} ({}): budget {}, {} configs in the space, up to {} trials",
                spec.name, device.name, state.execute_on, format_bytes(state.budget.usable_bytes), state.space.size,
                state.max_trials)
    if state.space.micro_batch_floor is not None:
        logger.info("micro batches {}: {}", list(state.space.micro_batch_sizes),
                    state.space.micro_batch_floor.describe())
    state.tuner = Tuner(state.space, study=state.study, budget=state.budget,
                        measure=partial(run_trial, state), estimate=partial(predict, state),
                        max_trials=state.max_trials, patience=spec.search.patience, timeout_s=setup.budget.time_s,
                        on_trial=partial(report_trial, state), should_stop=partial(halted, state),
                        starts=_starts(state), locks=state.locks, worker=state.worker, deadline=state.deadline,
                        one_liner=ONE_LINER_CUDA if device.kind == "cuda" else ONE_LINER_CPU,
                        measure_reference=partial(run_reference, state),
                        full_precision_slowdown=FULL_PRECISION_SLOWDOWN.get(device.kind, 1.0),
                        slow_16_bit=slow_16_bit(cpu_16_bit_units()) if device.kind == "cpu" else frozenset(),
                        steps_before_cap=TRACKED_STEPS if device.kind == "cpu" else 0)
    # A resumed study may hold an answer already: then no trial gets the first one's grace.
    state.answered = any(r.status == "ok" for r in state.tuner.records())


def _starts(state: TuneState) -> tuple:
    """The configs the search measures first: where training went on after running out of
    memory, then another GPU kind's (a warm start), never a config training left."""
    starts = _read_demotions(state)
    warm = tuple(c for c in warm_starts(state.setup.warm, state.space, partial(predict, state), state.budget)
                 if c not in state.demoted)  # where training ran out of memory is never a start
    state.warm_from = _warm_from(state.study, state.setup.warm.from_kind if warm else "")
    return tuple(dict.fromkeys(starts + warm))


WARM_ATTR = "autofit_warm_start_from"


def _warm_from(study, kind: str) -> str:
    """The kind the study's warm start came from: `kind` where its starts are planned now (kept
    in the study), else the one an earlier run on it planned. A resumed study gets no warm start
    (the service retries a stopped tune on the study it left), yet its first trials were that
    kind's: its profile said it started cold."""
    if kind:
        study.set_user_attr(WARM_ATTR, kind)
        return kind
    return str(study.user_attrs.get(WARM_ATTR, ""))


def _read_demotions(state: TuneState) -> tuple:
    """Training that ran out of memory under an earlier profile demoted its micro batch: the
    search starts from where it went on, and never picks the config it left again."""
    spec = state.spec
    demotions = read_demotions(state.out_dir / f"{spec.name}--{state.device.slug}.yaml", spec_hash=spec.spec_hash)
    state.demoted = {d.from_config for d in demotions}
    starts = tuple(dict.fromkeys(d.to_config for d in reversed(demotions) if d.to_config not in state.demoted))
    if demotions:
        logger.info("{} out-of-memory demotion(s) recorded in training: starting from {}; not choosing {}",
                    len(demotions), ", ".join(c.short() for c in starts) or "-",
                    ", ".join(c.short() for c in state.demoted))
    return starts

