"""`autofit tune`: search, validate the winner in a longer run, write the profile and report.

    autofit tune examples/tiny-gpt.yaml
    autofit tune model.yaml --device 0 --memory-budget 24GiB --trials 60 --storage postgresql://…
"""

import contextlib
import dataclasses
import os
import socket
import statistics
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from loguru import logger

from autofit import __version__
from autofit.device.probe import DeviceInfo, usable_budget_bytes, with_memory_budget
from autofit.errors import DeviceError, NothingFitsError, ProfileError, SpecError, TrialError, TrialTimeoutError
from autofit.estimate import EstimateError, estimate_memory
from autofit.frontier import build_frontier, median_run, total_peak
from autofit.knobs import block_count, micro_batch_floor
from autofit.precision import supported_precisions, unsupported_reason
from autofit.profile import Profile, ProfileModel, SearchSummary, TrainingSetup, device_from_info, utc_now
from autofit.redact import redact_url
from autofit.report import format_trial_line, trials_table, write_html_report
from autofit.search import SearchResult, SearchSpace, TrialRecord, Tuner, make_study
from autofit.search.health import LossCurveCheck
from autofit.search.shared import StudyLocks, profiles_written, record_profile, shared_profile
from autofit.sizes import format_bytes
from autofit.spec import ModelSpec, divisors
from autofit.store import ProfileStore, default_root, read_demotions
from autofit.trial import Measurement, measure, raise_input_error
from autofit.workload import TextData, build_workload


def default_state_dir() -> Path:
    """Where studies live: $AUTOFIT_STATE_DIR, else $XDG_STATE_HOME/autofit (~/.local/state/autofit)."""
    if os.environ.get("AUTOFIT_STATE_DIR"):
        return Path(os.environ["AUTOFIT_STATE_DIR"])
    return Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "autofit"


def study_name(spec: ModelSpec, device: DeviceInfo, emulated_budget_bytes: int | None = None) -> str:
    """One study per (spec, device kind[, emulated budget]): a rerun of the same command
    resumes it. The measured budget is not part of the key: other processes' memory moves
    it a little between runs, and measured peaks stay true whatever the budget."""
    name = f"{spec.name}-{spec.spec_hash.removeprefix('sha256:')[:12]}-{device.fingerprint}"
    return name if emulated_budget_bytes is None else f"{name}-budget{emulated_budget_bytes}"


def device_for_ranks(device: DeviceInfo, nproc: int) -> DeviceInfo:
    """The device a profile for `nproc` ranks is keyed by. A profile for N ranks is not one
    for a single process: its own fingerprint and file name (`…-x8`), so the store keeps
    both and never hands one out for the other."""
    if nproc == 1:
        return device
    return dataclasses.replace(device, fingerprint=f"{device.fingerprint}-x{nproc}", slug=f"{device.slug}-x{nproc}")


def search_space(spec: ModelSpec, device: DeviceInfo, nproc: int = 1) -> SearchSpace:
    precisions = supported_precisions(spec.search.precisions, device_kind=device.kind,
                                      compute_capability=device.compute_capability)
    if not precisions:  # the spec asks for what this device cannot do: the user's input
        reasons = "; ".join(unsupported_reason(p, device_kind=device.kind, compute_capability=device.compute_capability)
                            for p in spec.search.precisions)
        raise DeviceError(f"search.precisions: none runs on {device.name}: {reasons}")
    # The block count comes from a model built on the meta device: no memory, any size.
    # Only the model: a data source may sample real batches while it is built.
    workload = build_workload(spec)
    rank_batch = spec.train.global_batch_size // nproc  # micro x accumulation x ranks = global
    with torch.device("meta"):
        model = workload.build_model()
    n_blocks = block_count(model)
    # A knob that changes the math is bounded: BatchNorm normalizes over each micro batch.
    floor = micro_batch_floor(model, rank_batch, spec.search.min_micro_batch_size)
    data = workload.data
    # Sorting a step by length only changes dynamically padded micro batches of mixed lengths.
    bucketing = (isinstance(data, TextData) and data.padding == "dynamic" and not data.packing
                 and spec.train.global_batch_size > 1)
    chunked = spec.search.chunked_loss
    if True in chunked and workload.chunked_loss_fn is None:
        raise SpecError(f"search.chunked_loss: only for language-model heads autofit can chunk (builtin gpt, "
                        f"hf *ForCausalLM with synthetic, tokens or text data); {spec.name} has none; use [false]")
    if True in chunked and nproc > 1:
        logger.warning("search.chunked_loss: runs in one process only; not searched with --nproc {}", nproc)
        chunked = (False,)
    return SearchSpace(
        global_batch_size=spec.train.global_batch_size, precisions=tuple(precisions),
        micro_batch_sizes=tuple(d for d in divisors(rank_batch) if floor is None or d >= floor.size),
        micro_batch_floor=floor, world_size=nproc,
        max_checkpoint_blocks=n_blocks if spec.search.activation_checkpointing else 0,
        max_freeze_blocks=min(spec.search.max_freeze_blocks, n_blocks),
        length_bucketing=(False, True) if bucketing else (False,),
        checkpoint_policies=spec.search.checkpoint_policies,
        optimizer_bits=spec.search.optimizer_bits, chunked_loss=chunked,
        compile=spec.search.compile,
    )


@dataclass(kw_only=True)
class TuneOutcome:
    profile: Profile
    profile_path: Path
    report_path: Path | None
    result: SearchResult
    validated: Measurement

    def summary(self) -> dict:
        return {
            "profile_path": str(self.profile_path),
            "report_path": None if self.report_path is None else str(self.report_path),
            "best": self.validated.to_dict(),
            "search": _asdict(self.profile.search),
            "trials": [_record_dict(r) for r in self.result.records],
        }


def _asdict(obj) -> dict:
    import dataclasses

    return dataclasses.asdict(obj)


def _record_dict(r: TrialRecord) -> dict:
    return {"number": r.number, "config": r.config.to_dict(), "status": r.status, "reason": r.reason,
            "predicted_peak_bytes": r.predicted_peak_bytes, "peak_memory_bytes": r.peak_memory_bytes,
            "samples_per_s": r.samples_per_s if r.measurement is not None else None}


def tune(spec: ModelSpec, *, device: DeviceInfo, budget_bytes: int, out_dir: Path, storage: str | None,
         execute_on: str | None = None, trials: int | None = None, timeout_s: float | None = None,
         emulated_budget_bytes: int | None = None, stop_event: threading.Event | None = None,
         on_trial: Callable[[TrialRecord, TrialRecord | None, int], None] | None = None,
         report: bool = True, nproc: int = 1, guard=None,
         worker: str | None = None) -> TuneOutcome:
    """Search, validate and save. `execute_on` is where trials run ("cpu" or a CUDA index;
    default: the device itself; an emulated GPU runs on the CPU under its budget).
    `emulated_budget_bytes` (from --memory-budget) keys a study apart from the full card's.
    `nproc` > 1 tunes data-parallel jobs over that many ranks (DDP or FSDP2, each trial
    launched through torchrun); `budget_bytes` is then each rank's. `guard` (the service's
    `service.guard.TrialGuard`) watches every trial child.
    `worker` names this worker in a study it shares with others (default: the host name).
    Raises NothingFitsError when no configuration fits or none gives a usable result."""
    with contextlib.ExitStack() as cleanup:  # the study's locks are released however it ends
        return _tune(spec, device=device, budget_bytes=budget_bytes, out_dir=out_dir, storage=storage,
                     execute_on=execute_on, trials=trials, timeout_s=timeout_s,
                     emulated_budget_bytes=emulated_budget_bytes, stop_event=stop_event, on_trial=on_trial,
                     report=report, nproc=nproc, guard=guard, worker=worker or socket.gethostname(), cleanup=cleanup)


def _tune(spec: ModelSpec, *, device: DeviceInfo, budget_bytes: int, out_dir: Path, storage: str | None,
          execute_on: str | None, trials: int | None, timeout_s: float | None, emulated_budget_bytes: int | None,
          stop_event: threading.Event | None, on_trial: Callable[[TrialRecord, TrialRecord | None, int], None] | None,
          report: bool, nproc: int, guard, worker: str, cleanup: contextlib.ExitStack) -> TuneOutcome:
    execute_on = execute_on or ("cpu" if device.kind == "cpu" else str(device.index))
    if emulated_budget_bytes is not None:
        device = with_memory_budget(device, emulated_budget_bytes)
    device = device_for_ranks(device, nproc)
    space = search_space(spec, device, nproc)
    max_trials = trials or spec.search.trials
    name = study_name(spec, device, emulated_budget_bytes)
    study = make_study(study_name=name, storage=storage, seed=spec.train.seed)
    locks = cleanup.enter_context(StudyLocks(storage, name))
    written_before = profiles_written(study)
    logger.info("tuning {} on {} ({}): budget {}, {} configs in the space, up to {} trials",
                spec.name, device.name, execute_on, format_bytes(budget_bytes), space.size, max_trials)
    if space.micro_batch_floor is not None:
        logger.info("micro batches {}: {}", list(space.micro_batch_sizes), space.micro_batch_floor.describe())

    timeouts: dict = {}  # config -> timeouts so far: a retry gets twice the time

    def run_trial(config) -> Measurement:
        limit_s = spec.search.trial_timeout_s * 2 ** timeouts.get(config, 0)
        m = measure(spec, config, device=execute_on, budget_bytes=budget_bytes, stop_event=stop_event,
                    timeout_s=limit_s, guard=guard)
        if m.status == "timeout":
            timeouts[config] = timeouts.get(config, 0) + 1
        raise_input_error(m)  # the user's code raised: every other config would fail alike
        return m

    def predict(config) -> int:
        """Predicted peak; 0 (unknown: measure it) for a config the estimator cannot run."""
        try:
            return estimate_memory(spec, config, device_kind="cuda" if device.kind == "cuda" else "cpu").peak_bytes
        except EstimateError as exc:
            logger.warning("{}; {} is measured without a prediction", exc, config.short())
            return 0

    def report_trial(record: TrialRecord, best: TrialRecord | None, considered: int) -> None:
        logger.info(format_trial_line(record, best, considered, max_trials, budget_bytes))
        if on_trial is not None:
            on_trial(record, best, considered)

    # Training that ran out of memory under an earlier profile demoted its micro batch: the
    # search starts from where it went on, and never picks the config it left again.
    demotions = read_demotions(Path(out_dir) / f"{spec.name}--{device.slug}.yaml", spec_hash=spec.spec_hash)
    demoted = {d.from_config for d in demotions}
    starts = tuple(dict.fromkeys(d.to_config for d in reversed(demotions) if d.to_config not in demoted))
    if demotions:
        logger.info("{} out-of-memory demotion(s) recorded in training: starting from {}; not choosing {}",
                    len(demotions), ", ".join(c.short() for c in starts) or "-",
                    ", ".join(c.short() for c in demoted))
    tuner = Tuner(space, study=study, budget_bytes=budget_bytes, measure=run_trial, estimate=predict,
                  max_trials=max_trials, patience=spec.search.patience, timeout_s=timeout_s,
                  on_trial=report_trial, should_stop=(stop_event.is_set if stop_event else None), starts=starts,
                  locks=locks, worker=worker)
    searched = tuner.search()
    # Workers sharing the study: the first to end its search validates and writes the
    # profile; the others wait here (the lock is held until tune() returns), then hand out
    # the same profile.
    locks.finish(should_stop=stop_event.is_set if stop_event else None)
    shared = shared_profile(study, since=written_before)
    result = tuner.result(searched) if shared else tuner.finish(searched)
    logger.info("search stopped: {}; {} trials ({} measured, {} pruned, {} oom) in {:.0f}s",
                result.stop_reason, len(result.records), result.measured, result.count("pruned"),
                result.count("oom"), result.wall_s)
    if stop_event is not None and stop_event.is_set():
        raise InterruptedError("tune stopped before validation; rerun to resume the study")
    if shared is not None:
        return _shared_outcome(*shared, result=result, out_dir=Path(out_dir))
    if not result.ranked:
        # "Nothing fits" is a verdict only when every trial was measured: one that timed out
        # or crashed might have fitted, and a rerun resumes the study to find out.
        if result.count("timeout"):
            raise TrialTimeoutError(f"{result.count('timeout')} trial(s) timed out (search.trial_timeout_s is "
                                    f"{spec.search.trial_timeout_s:g}s, doubled on retry), and none fitted; "
                                    f"rerun to resume the study, or raise search.trial_timeout_s")
        if result.count("error"):
            first = next(r.reason for r in result.records if r.status == "error")
            raise TrialError(f"{result.count('error')} trial(s) crashed and none fitted; the first: {first}")
        raise NothingFitsError(_nothing_fits_message(result, tuner, space))

    validations: dict = {}  # config -> its validation runs, which the frontier reuses
    # Every validation run trains the same batches from the same weights: a low-precision
    # one is held to the 32-true baseline's loss curve, not to one short mean.
    curve = LossCurveCheck(spec.search.loss_curve_rtol)

    def run_long(config, steps: int, timeout_s: float) -> Measurement:
        m = curve.check(measure(spec, config, device=execute_on, budget_bytes=budget_bytes, stop_event=stop_event,
                                measure_steps=steps, timeout_s=timeout_s, guard=guard))
        validations.setdefault(config, []).append(m)
        return m

    baseline = _baseline(result, demoted)
    # The speed-up compares like with like: the baseline re-measured over as many steps as
    # the winner's validation, so one noisy short trial cannot make or break it. It runs
    # first: its loss curve is the reference the others are checked against.
    baseline_m, note = None, ""
    if baseline is not None:
        baseline_m = _run_validation(spec, baseline, run_long)
        curve.set_reference(baseline_m)
    winner, validated = validate(spec, result, run_long, demoted=demoted, done=validations)
    host_load = _host_load()
    if baseline_m is not None and (baseline_m.status != "ok" or not baseline_m.samples_per_s):
        baseline_m = None
    if baseline_m is not None and baseline.config != winner.config:
        winner, validated, baseline_m, note = never_worse(spec, (winner, validated), (baseline, baseline_m), run_long)
    if winner.config == getattr(baseline, "config", None) and not note:
        note = (f"nothing measured beat the 32-true baseline (search stopped: {result.stop_reason}; "
                f"{result.count('ok')} configs measured): the profile is the baseline")
    if note:
        logger.warning(note)
    winner_runs = [validated]  # a frontier point that validates as fast as the winner has it validated again
    frontier = build_frontier(result, winner, winner_runs, max_points=spec.search.frontier_points,
                              validate_steps=spec.search.validate_steps, validations=validations,
                              run_validation=lambda record: _run_validation(spec, record, run_long), demoted=demoted,
                              should_stop=stop_event.is_set if stop_event else None)
    validated = median_run(winner_runs)
    if baseline is not None and baseline.config == winner.config and baseline_m is not None:
        baseline_m = validated  # one config, one figure
    logger.info("frontier: {}", "; ".join(f"{p.config.short()} peak {format_bytes(p.measured.peak_memory_bytes)} "
                                          f"{p.measured.samples_per_s:.4g} samples/s" for p in frontier))
    if host_load is not None and host_load > LOADED_HOST:
        logger.warning("the host was loaded while validating (load {:.1f} per core): throughput figures are "
                       "noisy; re-run on a quiet machine to trust the speed-up", host_load)
    profile = Profile(
        model=ProfileModel(name=spec.name, spec_hash=spec.spec_hash),
        device=device_from_info(device),
        budget_bytes=budget_bytes,
        config=winner.config,
        measured=frontier[-1].measured,  # the winner's validation
        search=SearchSummary(
            trials=len(result.records), measured=result.measured, pruned=result.count("pruned"),
            oom=result.count("oom"), unhealthy=result.count("unhealthy"),
            failed=result.count("error") + result.count("timeout") + result.count("compile_error"),
            wall_s=round(result.wall_s, 1),
            sampler=type(study.sampler).__name__, storage=redact_url(storage or "in-memory"),
            baseline={} if baseline_m is None else {"config": baseline.config.to_dict(),
                                                    "samples_per_s": baseline_m.samples_per_s},
            speedup=None if baseline_m is None else round(validated.samples_per_s / baseline_m.samples_per_s, 3),
            stop_reason=result.stop_reason, choice=result.choice,
            noise=None if result.noise is None else round(result.noise, 4),
            host_load=None if host_load is None else round(host_load, 2), note=note,
            micro_batch_floor={} if space.micro_batch_floor is None else space.micro_batch_floor.to_dict(),
            loss_curve=curve.summary(winner.config),
            workers=_workers(result.records), validated_by=worker,
        ),
        created=utc_now(),
        autofit=__version__,
        data=data_assumptions(spec),
        frontier=frontier,
        training=TrainingSetup(optimizer=spec.to_dict()["optimizer"], max_grad_norm=spec.train.max_grad_norm),
    )
    profile_path = ProfileStore(Path(out_dir)).save(profile)
    record_profile(study, profile.to_dict(), worker)  # for the workers waiting on this study
    report_path = None
    if report:
        report_path = write_html_report(profile_path.with_suffix(".report.html"), profile, result, winner)
    logger.info("\n{}", trials_table(result, winner))
    if baseline_m is not None:
        logger.info("speed-up over {} (32-true, largest micro batch that fits; both validated): {:.2f}x",
                    baseline.config.short(), profile.search.speedup)
    return TuneOutcome(profile=profile, profile_path=profile_path, report_path=report_path, result=result,
                       validated=validated)


def _workers(records: list[TrialRecord]) -> dict[str, int]:
    """Search trials measured per worker sharing the study (empty before workers were named)."""
    counts: dict[str, int] = {}
    for r in records:
        if r.measurement is not None and not r.repeat and r.worker:
            counts[r.worker] = counts.get(r.worker, 0) + 1
    return dict(sorted(counts.items()))


def _shared_outcome(profile_dict: dict, worker: str, *, result: SearchResult, out_dir: Path) -> TuneOutcome:
    """The profile another worker of the study validated and wrote: the same file here (a
    store of its own gets a copy), and this tune's outcome."""
    profile = Profile.from_dict(profile_dict, where=f"the profile {worker} wrote")
    path = out_dir / profile.file_name
    try:
        same = Profile.load(path) == profile
    except ProfileError:
        same = False
    if not same:  # this worker's store is not the one it was written to
        path = ProfileStore(out_dir).save(profile)
    logger.info("{} validated the winner of this study and wrote the profile: {}", worker, path)
    m = profile.measured
    validated = Measurement(status="ok", config=profile.config, samples_per_s=m.samples_per_s,
                            tokens_per_s=m.tokens_per_s, peak_memory_bytes=m.peak_memory_bytes,
                            step_time_s=m.step_time_s)
    return TuneOutcome(profile=profile, profile_path=path, report_path=None, result=result, validated=validated)


def data_assumptions(spec: ModelSpec, workload=None) -> dict:
    """What the profile's peak and speed assume of varying-length data (empty otherwise)."""
    data = (workload or build_workload(spec)).data
    return data.describe() if isinstance(data, TextData) else {}


# 1-minute load average per core above which throughput measured on a CPU is flagged.
LOADED_HOST = 0.8
VALIDATION_ATTEMPTS = 2  # a validation that times out is retried once with twice the time


def run_timeout_s(spec: ModelSpec, record: TrialRecord, steps: int) -> float:
    """The time a run of `steps` timed steps of `record`'s config may take: the trial's own
    start-up (its wall time less its steps) plus warm-up and `steps` at its measured step
    time, three times over, and never less than one trial's timeout. The trial timeout is
    meant for a few steps; a 50-step validation of a slow config needs more."""
    m, search = record.measurement, spec.search
    if m is None or not m.step_time_s:
        return search.trial_timeout_s * max(1.0, steps / search.measure_steps)
    startup_s = max(0.0, m.wall_s - (search.warmup_steps + search.measure_steps) * m.step_time_s)
    return max(search.trial_timeout_s, 3 * (startup_s + (search.warmup_steps + steps) * m.step_time_s))


def _run_validation(spec: ModelSpec, record: TrialRecord, run_long) -> Measurement:
    """One validation run; a timeout (the machine, not the config) is retried with twice the time."""
    steps = spec.search.validate_steps
    limit_s = run_timeout_s(spec, record, steps)
    for attempt in range(VALIDATION_ATTEMPTS):
        m = run_long(record.config, steps, limit_s * 2 ** attempt)
        if m.status != "timeout":
            return m
        logger.warning("validation of {} timed out after {:.0f}s{}", record.config.short(), limit_s * 2 ** attempt,
                       "; retrying with twice the time" if attempt + 1 < VALIDATION_ATTEMPTS else "")
    return m


def validate(spec: ModelSpec, result: SearchResult, run_long,
             demoted: set = frozenset(), done: dict | None = None) -> tuple[TrialRecord, Measurement]:
    """Re-run the best configs longer in fresh children; the first that stays ok and inside
    the budget wins. Short trials can miss slow leaks and late allocator growth. Configs
    that ran out of memory in training (`demoted`) are passed over.
    `run_long(config, steps, timeout_s)` measures one config; `done` (config -> validation
    runs already taken, e.g. the baseline's) are used rather than run again."""
    ranked = [r for r in result.ranked if r.config not in demoted]
    if not ranked:
        raise NothingFitsError("every configuration that fits in the search ran out of memory in training "
                               "(see the .demotions.json beside the profile)")
    failures, crashes = [], []
    for record in ranked[:5]:
        logger.info("validating {} over {} steps", record.config.short(), spec.search.validate_steps)
        m = (done or {}).get(record.config, [None])[-1] or _run_validation(spec, record, run_long)
        if m.status == "ok" and total_peak(m) <= result.budget_bytes:
            return record, m
        failures.append(m.status if m.status != "ok" else "over budget")
        if m.status == "error":
            crashes.append(f"{record.config.short()}: {m.reason}")
        logger.warning("validation of {} failed: {} ({}); trying the next best", record.config.short(),
                       m.status, m.reason or f"peak {format_bytes(total_peak(m))} over budget")
    # Not "nothing fits" unless every longer run was measured to fail: a timeout is the
    # machine being too slow or too busy, a crash is not a verdict on memory; a rerun resumes.
    if "timeout" in failures:
        every = "every validation run" if all(f == "timeout" for f in failures) else (
            f"{failures.count('timeout')} of {len(failures)} validation runs")
        raise TrialTimeoutError(f"{every} timed out (search.trial_timeout_s is "
                                f"{spec.search.trial_timeout_s:g}s); rerun, or raise search.trial_timeout_s")
    if "error" in failures:
        raise TrialError(f"{failures.count('error')} of {len(failures)} validation runs crashed: {crashes[0]}")
    raise NothingFitsError(f"no configuration passed validation: the best {len(failures)} all failed their "
                           f"longer run ({', '.join(sorted(set(failures)))})")


def never_worse(spec: ModelSpec, winner: tuple[TrialRecord, Measurement], baseline: tuple[TrialRecord, Measurement],
                run_long) -> tuple[TrialRecord, Measurement, Measurement, str]:
    """The profile is never slower than doing nothing. When the validated winner is slower
    than the validated baseline, both are measured again, interleaved: once, and a second
    time when that round disagrees with the first (noise larger than the gap); the medians
    decide. Returns (winner, its measurement, the baseline's, a note when the baseline won)."""
    (w, wm), (b, bm) = winner, baseline
    if wm.samples_per_s >= bm.samples_per_s:
        return w, wm, bm, ""
    logger.info("validated {} ({:.4g} samples/s) is slower than the baseline {} ({:.4g}): measuring both "
                "again, interleaved", w.config.short(), wm.samples_per_s, b.config.short(), bm.samples_per_s)
    runs = {w.config: [wm], b.config: [bm]}
    for _ in range(2):
        round_sps = {}
        for record in (w, b):
            m = _run_validation(spec, record, run_long)
            if m.status == "ok" and m.samples_per_s:
                runs[record.config].append(m)
                round_sps[record.config] = m.samples_per_s
        if round_sps.get(w.config, 0.0) < round_sps.get(b.config, 0.0):
            break  # this round agrees with the validation: the winner is slower
    w_med, b_med = (statistics.median(x.samples_per_s for x in runs[c]) for c in (w.config, b.config))
    w_best, b_best = median_run(runs[w.config]), median_run(runs[b.config])
    if w_med >= b_med:
        return w, w_best, b_best, ""
    note = (f"the search's winner {w.config.short()} validated at {w_med:.4g} samples/s, below the 32-true "
            f"baseline's {b_med:.4g} (medians of {len(runs[w.config])} and {len(runs[b.config])} interleaved "
            f"runs): the profile is the baseline")
    return b, b_best, b_best, note


def _host_load() -> float | None:
    """The 1-minute load average per CPU core (None where the OS has none)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (OSError, AttributeError):
        return None


def _baseline(result: SearchResult, demoted: set = frozenset()) -> TrialRecord | None:
    """What a user without autofit runs: 32-true, no checkpointing or freezing, the largest
    micro batch that fits (and did not run out of memory in training)."""
    plain = [r for r in result.records if r.config.precision == "32-true" and r.config.checkpoint_blocks == 0
             and r.config.freeze_blocks == 0 and r.config.optimizer_bits == 32 and not r.config.chunked_loss
             and r.feasible(result.budget_bytes) and r.config not in demoted]
    return max(plain, key=lambda r: r.config.micro_batch_size, default=None)


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


def tune_command(spec_path: str | Path, *, device: str | None = None, memory_budget: str | None = None,
                 trials: int | None = None, timeout_s: float | None = None, storage: str | None = None,
                 out_dir: str | Path | None = None, state_dir: str | Path | None = None,
                 report: bool = True, nproc: int = 1) -> TuneOutcome:
    """`autofit tune`: probe, budget, search, validate, save."""
    from autofit.commands import check_count, check_seconds, ensure_folder, parse_budget
    from autofit.device.probe import select_device
    from autofit.errors import SpecError
    from autofit.spec import MAX_TRIALS, load_spec

    spec = load_spec(spec_path)
    check_count("--trials", trials, maximum=MAX_TRIALS)
    check_seconds("--timeout", timeout_s)
    if nproc < 1 or spec.train.global_batch_size % nproc:
        raise SpecError(f"--nproc: must be a positive divisor of train.global_batch_size "
                        f"({spec.train.global_batch_size}), got {nproc}")
    info = select_device(device)
    emulated = parse_budget(memory_budget, total_bytes=info.memory_total_bytes, device_name=info.name)
    budget_bytes = usable_budget_bytes(info, headroom=spec.search.memory_headroom, memory_budget=emulated)
    if storage is None:
        folder = ensure_folder(Path(state_dir) if state_dir is not None else default_state_dir(), "--state-dir")
        storage = f"sqlite:///{folder.resolve() / 'studies.db'}"
    out_dir = ensure_folder(Path(out_dir) if out_dir is not None else default_root(), "--out")
    return tune(spec, device=info, budget_bytes=budget_bytes, out_dir=out_dir, storage=storage,
                trials=trials, timeout_s=timeout_s, report=report, emulated_budget_bytes=emulated, nproc=nproc)
