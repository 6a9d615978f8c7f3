"""The write stage: the profile (atomically), the HTML report, the trials table and the
speed-up; or, where another worker of the study wrote the profile, that one."""

from functools import partial

from loguru import logger

from autofit.base.errors import ProfileError
from autofit.base.redact import redact_url
from autofit.base.version import VERSION
from autofit.device.peak import mfu
from autofit.measure.measurement import Measurement
from autofit.search import SearchResult, TrialRecord
from autofit.search.shared import record_profile
from autofit.profiles.profile import device_from_info, Profile, ProfileModel, SearchSummary, TrainingSetup, utc_now
from autofit.profiles.store import ProfileStore
from autofit.tuning._trials import host_bytes
from autofit.tuning._tune_state import Chosen, passed, TuneState
from autofit.tuning.ablation import knob_shares
from autofit.tuning.frontier import median_run
from autofit.tuning.offload_record import offload_record
from autofit.tuning.report import trials_table, write_html_report
from autofit.tuning.tune_values import TuneOutcome
from autofit.tuning.validation import over_32_true


def write(state: TuneState, result: SearchResult, chosen: Chosen, frontier: tuple) -> TuneOutcome:
    profile = _profile(state, result, chosen, frontier)
    profile_path = ProfileStore(state.out_dir).save(profile)
    record_profile(state.study, profile.to_dict(), state.worker)  # for the workers waiting on this study
    report_path = None
    if state.setup.report:
        report_path = write_html_report(profile_path.with_suffix(".report.html"), profile, result, chosen.winner)
    validated = {c: median_run(passed(state, c)) for c in state.validations if passed(state, c)}
    logger.info("\n{}", trials_table(result, chosen.winner, validated))
    if chosen.speedup is not None:
        logger.info("speed-up over the {} {} (interleaved validation runs): {}", state.floor,
                    chosen.baseline.config.short(), chosen.speedup.text())
    return TuneOutcome(profile=profile, profile_path=profile_path, report_path=report_path, result=result,
                       validated=chosen.validated_m, speedup=chosen.speedup,
                       incomplete=chosen.note if chosen.halted else "")


def shared_outcome(state: TuneState, profile_dict: dict, worker: str, *, result: SearchResult) -> TuneOutcome:
    """The profile another worker of the study validated and wrote: the same file here (a
    store of its own gets a copy), and this tune's outcome."""
    profile = Profile.from_dict(profile_dict, where=f"the profile {worker} wrote")
    path = state.out_dir / profile.file_name
    try:
        same = Profile.load(path) == profile
    except ProfileError:
        same = False
    if not same:  # this worker's store is not the one it was written to
        path = ProfileStore(state.out_dir).save(profile)
    logger.info("{} validated the winner of this study and wrote the profile: {}", worker, path)
    m = profile.measured
    validated = Measurement(status="ok", config=profile.config, samples_per_s=m.samples_per_s,
                            tokens_per_s=m.tokens_per_s, peak_memory_bytes=m.peak_memory_bytes,
                            step_time_s=m.step_time_s)
    return TuneOutcome(profile=profile, profile_path=path, report_path=None, result=result, validated=validated)


def _worth(state: TuneState, result: SearchResult, chosen: Chosen, samples_per_s: float) -> dict:
    """The profile's MFU and each changed knob's share, from figures already measured."""
    winner = chosen.winner.config
    utilisation = mfu(state.analysis.flops_per_sample, samples_per_s / max(1, winner.world_size),
                      state.device.name, winner.precision)
    measured = [(r.config, r.samples_per_s) for r in result.records if r.status == "ok" and r.samples_per_s]
    shares = knob_shares(winner, getattr(chosen.baseline, "config", None), measured)
    if utilisation is not None or shares:
        logger.info("worth: {}{}", "" if utilisation is None else f"MFU {utilisation:.1%}; ",
                    ", ".join(f"{k} {'unmeasured' if v is None else f'{v:.2f}x'}" for k, v in shares.items())
                    or "no knob changed from the baseline")
    return {"mfu": None if utilisation is None else round(utilisation, 4), "knob_shares": shares}


def _profile(state: TuneState, result: SearchResult, chosen: Chosen, frontier: tuple) -> Profile:
    spec = state.spec
    return Profile(
        model=ProfileModel(name=spec.name, spec_hash=spec.spec_hash),
        device=device_from_info(state.device),
        budget_bytes=state.budget.usable_bytes,
        config=chosen.winner.config,
        measured=frontier[-1].measured,  # the winner's validation
        search=_summary(state, result, chosen, frontier),
        created=utc_now(),
        autofit=VERSION,
        data=state.analysis.data_assumptions,
        frontier=frontier,
        training=TrainingSetup(optimizer=spec.to_dict()["optimizer"], max_grad_norm=spec.train.max_grad_norm,
                               loss=spec.to_dict().get("loss")),
    )


def _summary(state: TuneState, result: SearchResult, chosen: Chosen, frontier: tuple) -> SearchSummary:
    """The profile's `search:` section: what the search did, what validation found, what it is worth."""
    baseline, baseline_m = chosen.baseline, chosen.baseline_m
    floor = state.space.micro_batch_floor
    return SearchSummary(
        trials=len(result.records), measured=result.measured, pruned=result.count("pruned"),
        oom=result.count("oom"), unhealthy=result.count("unhealthy"),
        failed=result.count("error") + result.count("timeout") + result.count("compile_error"),
        wall_s=round(result.wall_s, 1),
        sampler=type(state.study.sampler).__name__, storage=redact_url(state.setup.storage or "in-memory"),
        baseline={} if baseline_m is None else {"config": baseline.config.to_dict(),
                                                "samples_per_s": baseline_m.samples_per_s},
        **_speedup_fields(chosen),
        stop_reason=result.stop_reason, choice=result.choice,
        noise=None if result.noise is None else round(result.noise, 4),
        host_load=None if chosen.host_load is None else round(chosen.host_load, 2), note=chosen.note,
        micro_batch_floor={} if floor is None else floor.to_dict(),
        loss_curve=state.curve.summary(chosen.winner.config),
        workers=_workers(result.records), validated_by=state.worker,
        validated=chosen.validated, unvalidated=chosen.unvalidated, baseline_kind=state.floor,
        speedup_over_32_true=over_32_true(result, chosen.winner, state.demoted), warm_start_from=state.warm_from,
        time_budget_s=round(state.deadline.budget_s, 1), time_budget_why=state.budget_why,
        **_worth(state, result, chosen, frontier[-1].measured.samples_per_s),
        offload=offload_record(chosen.winner.config, frontier[-1].measured.step_time_s, result.records,
                               partial(host_bytes, state)),
    )


def _speedup_fields(chosen: Chosen) -> dict:
    """The profile's speed-up: the pairs' median ratio and interval; 1.0 where the profile is
    the baseline itself; None where no baseline validated or the host was too busy to say."""
    speedup = chosen.speedup
    if chosen.baseline_m is None:
        return {"speedup": None}
    if chosen.winner.config == chosen.baseline.config:
        return {"speedup": 1.0, "speedup_interval": [1.0, 1.0], "speedup_pairs": 0}
    if speedup is None:  # halted (the time budget, a stop) before the pairs ran
        return {"speedup": None}
    return {"speedup": None if speedup.ratio is None else round(speedup.ratio, 3),
            "speedup_interval": None if speedup.low is None else [round(speedup.low, 3), round(speedup.high, 3)],
            "speedup_pairs": speedup.pairs, "foreign_cores": speedup.foreign_cores}


def _workers(records: list[TrialRecord]) -> dict[str, int]:
    """Search trials measured per worker sharing the study (empty before workers were named)."""
    counts: dict[str, int] = {}
    for r in records:
        if r.measurement is not None and not r.repeat and r.worker:
            counts[r.worker] = counts.get(r.worker, 0) + 1
    return dict(sorted(counts.items()))
