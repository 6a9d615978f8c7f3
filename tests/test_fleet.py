"""Studies shared across hosts on a real PostgreSQL server (tests/postgres.py): workers
that start together, see each other's trials, never measure a config twice, and leave one
profile between them; a worker killed mid-trial leaves its trial to the other."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import optuna
import pytest
import yaml
from loguru import logger

from autofit.device.budget import Budget
from autofit.profiles.profile import Profile
from conftest import FIXTURES, REPO, run_main, tiny_gpt_dict, write_spec
from postgres import postgres_server, postgres_url, wait_until  # noqa: F401  (fixtures)

_OPEN_TOGETHER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from autofit.search.study import make_study

    folder = Path(sys.argv[2])
    (folder / f"ready-{sys.argv[3]}").touch()
    while not (folder / "go").exists():  # every worker opens the storage at the same moment
        time.sleep(0.005)
    make_study(study_name="race", storage=sys.argv[1])
""")


def start_together(script: str, args: list[list[str]], folder: Path) -> list[tuple[int, str]]:
    """Run `python -c script ARGS FOLDER I` for each ARGS; each waits (after its imports)
    until all are ready. Returns each one's (exit code, stderr)."""
    workers = [subprocess.Popen([sys.executable, "-c", script, *a, str(folder), str(i)], cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
               for i, a in enumerate(args)]
    wait_until(lambda: len(list(folder.glob("ready-*"))) == len(args) or any(w.poll() is not None for w in workers),
               120, "the workers' imports")
    (folder / "go").touch()
    results = []
    for w in workers:
        _, err = w.communicate(timeout=120)
        results.append((w.returncode, err))
    return results


def test_workers_opening_an_empty_database_at_once_all_get_the_study(postgres_url, tmp_path):
    """Optuna creates its tables on first use; several workers doing it at the same moment
    collide in PostgreSQL's catalog (UniqueViolation on pg_type_typname_nsp_index)."""
    results = start_together(_OPEN_TOGETHER, [[postgres_url]] * 3, tmp_path)
    assert [rc for rc, _ in results] == [0] * 3, "\n".join(err[-1500:] for _, err in results)
    assert optuna.get_all_study_names(postgres_url) == ["race"]


def test_a_missing_database_driver_names_the_pip_install_that_fixes_it(tmp_path, capsys, monkeypatch):
    spec = write_spec(tmp_path, tiny_gpt_dict())
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as on a machine without the extra
    for url, fix in [("postgresql://u:secret@db.example/autofit", "pip install 'autofit[postgres]'"),
                     ("postgresql+psycopg2://u:secret@db.example/autofit", "pip install psycopg2-binary")]:
        code, out, err = run_main(capsys, "tune", spec, "--device", "cpu", "--storage", url, "--out", tmp_path)
        assert code == 2 and err.count("\n") == 1, err
        assert fix in err and "secret" not in err


# --- two `autofit tune` workers on one study (simulated trials: tests/fixtures/simulated_cli.py) ---

SIMULATED_CLI = FIXTURES / "simulated_cli.py"
FLEET_SEARCH = {"precisions": ["32-true", "bf16-mixed"], "trials": 12, "patience": 12, "frontier_points": 1,
                "warmup_steps": 0, "measure_steps": 1, "validate_steps": 2}


class Workers:
    """`autofit tune` processes with simulated trials, started together on one study."""

    def __init__(self, tmp_path: Path, url: str, count: int, *, trials: int, env: dict | None = None,
                 env_of: dict | None = None):
        self.log, self.barrier, self.store = tmp_path / "trials.jsonl", tmp_path / "barrier", tmp_path / "profiles"
        self.barrier.mkdir()
        spec = write_spec(tmp_path, tiny_gpt_dict(search={**FLEET_SEARCH, "trials": trials}))
        args = ["tune", spec, "--device", "cpu", "--storage", url, "--out", self.store, "--no-report", "--json"]
        self.procs = []
        for i in range(count):
            full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "SIM_LOG": str(self.log),
                        "SIM_BARRIER": str(self.barrier), **(env or {}), **((env_of or {}).get(i, {}))}
            self.procs.append(subprocess.Popen([sys.executable, str(SIMULATED_CLI), *map(str, args)], cwd=tmp_path,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                               env=full_env))
        wait_until(lambda: len(list(self.barrier.glob("ready-*"))) == count
                   or any(p.poll() is not None for p in self.procs), 120, "the workers' imports")
        (self.barrier / "go").touch()

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def finish(self, i: int) -> tuple[int, str, str]:
        out, err = self.procs[i].communicate(timeout=180)
        return self.procs[i].returncode, out, err

    def kill_all(self) -> list[str]:
        """Kill those still running; each one's stderr (what was not read yet)."""
        errs = []
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            errs.append(p.communicate()[1] or "")
        return errs


def search_records(url: str) -> list[dict]:
    """The study's search measurements (not pruned proposals, not noise repeats)."""
    (name,) = optuna.get_all_study_names(url)
    study = optuna.load_study(study_name=name, storage=url)
    records = [t.user_attrs["autofit"] for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
               if "autofit" in t.user_attrs]
    return [r for r in records if r["measurement"] is not None and not r["repeat"]]


def _story(url: str, config: dict, stderrs: list[str]) -> str:
    """For a failure's message: the trials of `config` (number, state, start, end, system
    attrs) and the workers' warnings of a live trial given up as stale."""
    (name,) = optuna.get_all_study_names(url)
    trials = [(t.number, t.state.name, t.datetime_start, t.datetime_complete, t.system_attrs)
              for t in optuna.load_study(study_name=name, storage=url).get_trials()
              if t.user_attrs.get("autofit", {}).get("config") == config]
    stale = [line for err in stderrs for line in err.splitlines() if "given up as stale" in line]
    return f"trials {trials}; stale {stale}"


def _key(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


@pytest.mark.slow
def test_tune_workers_share_one_study_and_take_over_a_killed_workers_trial(postgres_url, tmp_path):
    """Three `autofit tune` workers start together on one study. Worker 0 hangs in its
    second trial and is SIGKILLed there: its trial stops beating, is failed and queued
    again, and another worker measures it. Workers 1 and 2 finish with the union of all
    trials, no config measured twice, one profile, validated by one of them only."""
    # 1.2 s trials: the survivors are still searching (17 trials between two, about 10 s) when
    # the dead worker's trial goes stale, 3 s after its last heartbeat, however late under load
    # the kill comes (with 0.8 s trials, 1 run in 12 beside three CPU hogs ended first).
    workers = Workers(tmp_path, postgres_url, 3, trials=18, env={"SIM_TRIAL_S": "1.2"},
                      env_of={0: {"SIM_HANG_AT": "2"}})
    victim, *survivors = workers.procs
    try:
        starts = wait_until(lambda: [e for e in workers.events() if e["pid"] == victim.pid and e["event"] == "start"][1:],
                            120, "worker 0 to hang in its second trial")
        hung = _key(starts[0]["config"])
        victim.kill()
        results = [workers.finish(i) for i in (1, 2)]
    finally:
        victim_err = workers.kill_all()[0]
    assert [rc for rc, _, _ in results] == [0, 0], "\n".join(err[-3000:] for _, _, err in results)
    events = workers.events()
    done = {p.pid: {_key(e["config"]) for e in events if e["pid"] == p.pid and e["event"] == "done"
                    and not e["validation"]} for p in workers.procs}
    assert all(done.values()), f"a worker measured nothing before the end: {done}"

    records = search_records(postgres_url)
    configs = [_key(r["config"]) for r in records]
    twice = [(r["worker"], r["status"], r["config"]) for r in records if configs.count(_key(r["config"])) > 1]
    if twice:
        stderrs = [victim_err, *(err for _, _, err in results)]
        pytest.fail(f"a config was measured twice: {twice}; {_story(postgres_url, twice[0][2], stderrs)}")
    assert done[victim.pid] <= set(configs)  # the dead worker's finished trial counts
    assert len(configs) >= 18  # one trial budget for all of them
    stops = [line for _, _, err in results for line in err.splitlines() if "search stopped" in line]
    assert hung in configs and hung in done[survivors[0].pid] | done[survivors[1].pid], stops
    (name,) = optuna.get_all_study_names(postgres_url)
    retried = [t for t in optuna.load_study(study_name=name, storage=postgres_url).get_trials()
               if "failed_trial" in t.system_attrs]
    assert retried and retried[0].state == optuna.trial.TrialState.COMPLETE

    # Exactly one worker validated and wrote the profile; both survivors print it.
    assert len({e["pid"] for e in events if e["validation"]}) == 1
    paths = {json.loads(out)["profile_path"] for _, out, _ in results}
    assert len(paths) == 1 and [p.name for p in workers.store.glob("*.yaml")] == [Path(paths.pop()).name]
    assert sum("validated the winner of this study and wrote the profile" in err for _, _, err in results) == 1


# --- two services on one PostgreSQL database and one store folder (in this process) -------------

def _simulated(monkeypatch, log: Path):
    module_spec = importlib.util.spec_from_file_location("simulated_cli", SIMULATED_CLI)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    for target, name, value in module.patches():
        monkeypatch.setattr(target, name, value)
    monkeypatch.setenv("SIM_LOG", str(log))
    # Long enough that both services' tunes of a model are searching at once, however the
    # two threads' start-up interleaves.
    monkeypatch.setenv("SIM_TRIAL_S", "0.15")


def test_two_services_sharing_postgres_and_a_store_make_one_profile_per_model(postgres_url, tmp_path, monkeypatch):
    """Two hosts with the same (emulated) GPU kind: each service tunes each model, the two
    tunes of a model share one study, and one profile per model lands in the shared store;
    `autofit status` of either service says which hosts measured its trials."""
    from autofit.service.daemon import Service
    from autofit.service.status import status_command
    from test_daemon import H100, model, write_inventory

    _simulated(monkeypatch, tmp_path / "trials.jsonl")
    # Each service's first trial of a model waits for the other's: both tunes of a model are
    # then searching the shared study at once, however the two threads' start-up interleaves.
    import autofit.tuning.tune

    simulated, started, meet = autofit.tuning.tune.measure, set(), {"alpha": threading.Barrier(2), "beta": threading.Barrier(2)}

    def measure(spec, config, **kwargs):
        if (threading.get_ident(), spec.name) not in started:
            started.add((threading.get_ident(), spec.name))
            meet[spec.name].wait(timeout=60)
        return simulated(spec, config, **kwargs)

    monkeypatch.setattr(autofit.tuning.tune, "measure", measure)
    models = tmp_path / "models"
    models.mkdir()
    for name in ("alpha", "beta"):
        write_spec(models, model(name, trials=6, patience=6, precisions=["32-true", "bf16-mixed"]), f"{name}.yaml")
    inventory = write_inventory(tmp_path, H100)
    services = []
    for node in ("node-a", "node-b"):
        config = tmp_path / f"{node}.yaml"
        config.write_text(yaml.safe_dump({
            "models_dir": "models", "store_dir": "profiles", "state_dir": f"state-{node}", "storage": postgres_url,
            "worker_name": node, "poll_interval_s": 0.2, "idle": {"max_utilization": 5, "min_idle_s": 0}}))
        services.append(Service(config, inventory_path=inventory))

    def all_ready() -> bool:
        for service in services:
            service._reap()
            service._poll()
        return all(p.status == "ready" for s in services for p in s.pairs.values()) and all(
            len(s.pairs) == 2 for s in services)

    messages: list[str] = []
    sink = logger.add(messages.append, level="INFO")
    try:
        wait_until(all_ready, 120, "both models ready on both services", interval_s=0.1)
    finally:
        logger.remove(sink)
        for service in services:
            for job in service._jobs():
                job.stop("the test ends")
                job.thread.join(timeout=30)
    assert sorted(p.name for p in (tmp_path / "profiles").glob("*.yaml")) == [
        "alpha--nvidia-h100-80gb-hbm3-emulated.yaml", "beta--nvidia-h100-80gb-hbm3-emulated.yaml"]
    assert all(s.pairs[key].tunes == 1 for s in services for key in s.pairs)  # each took part once
    for service in services:
        service._save_state(force=True)
        text = status_command(service.config_path)
        for name in ("alpha", "beta"):
            line = next(line for line in text.splitlines() if line.strip().startswith(name))
            assert "trials by node-a" in line and "node-b" in line and "validated by node-" in line, text
    for path in (tmp_path / "profiles").glob("*.yaml"):
        search = Profile.load(path).search
        assert set(search.workers) == {"node-a", "node-b"} and search.validated_by in search.workers
    # For each model, one service validated; the other waited and took its profile.
    assert sum("validated the winner of this study and wrote the profile" in m for m in messages) == 2


@pytest.mark.timing
def test_a_trial_whose_heartbeat_stops_is_failed_and_queued_again(tmp_path, monkeypatch):
    """The heartbeat thread (the one place autofit uses Optuna's private `_storage` and
    `_trial_id`) keeps a trial alive; once it stops, the trial is failed and its config
    queued again. SQLite here: the mechanism is the storage's, not PostgreSQL's."""
    from autofit.search import study as study_module

    monkeypatch.setattr(study_module, "HEARTBEAT_INTERVAL_S", 1)
    # A grace of 3 beats: a loaded host that stalls this thread a second or two between the
    # beat and the check below must not make a beating trial look stale.
    monkeypatch.setattr(study_module, "GRACE_PERIOD_S", 3)
    study = study_module.make_study(study_name="beats", storage=f"sqlite:///{tmp_path / 'studies.db'}")
    trial = study_module.ask(study)
    trial.suggest_categorical("micro_batch_size", [1, 2, 4])
    storage, beats = study._storage, []
    record_heartbeat = storage.record_heartbeat
    monkeypatch.setattr(storage, "record_heartbeat", lambda trial_id: beats.append(record_heartbeat(trial_id)))
    with study_module.heartbeat(study, trial):
        # Just after its second beat (a second apart) the trial is still alive. (A fixed sleep
        # would race the beat: the database's timestamps have one-second resolution.)
        wait_until(lambda: len(beats) >= 2, 10, "the second heartbeat", interval_s=0.02)
        study_module.fail_stale_trials(study)  # beating: not stale
        assert study.trials[0].state == optuna.trial.TrialState.RUNNING

    def failed_after_the_grace() -> bool:  # the worker "died": no beat for longer than the grace
        study_module.fail_stale_trials(study)
        return study.trials[0].state == optuna.trial.TrialState.FAIL

    wait_until(failed_after_the_grace, 30, "the stale trial to be failed", interval_s=0.5)
    failed, queued = study.trials
    assert failed.state == optuna.trial.TrialState.FAIL
    assert queued.state == optuna.trial.TrialState.WAITING and queued.params == failed.params


def test_a_measurement_whose_trial_was_taken_over_is_kept():
    """A worker that stopped beating while alive (frozen, or cut off from the database)
    finds its trial failed by another worker: telling it must not crash the tune, and the
    measurement is kept as a trial of its own."""
    from autofit.search import _trial, Tuner, make_study, read_records
    from autofit.search.study import ask
    from simulated import LANDSCAPES

    landscape = LANDSCAPES[0]
    study = make_study(study_name="taken-over", storage=None)
    tuner = Tuner(landscape.space(), study=study, budget=Budget(usable_bytes=landscape.budget_bytes),
                  measure=landscape.measure, estimate=landscape.estimate, max_trials=1, patience=1)
    trial = ask(study)
    config = tuner.space.suggest(trial)
    study._storage.set_trial_state_values(trial._trial_id, state=optuna.trial.TrialState.FAIL)  # the takeover
    _trial.tell(tuner.trials, trial, _trial.evaluate(tuner.trials, tuner.timing, trial, config, []))
    (record,) = read_records(study)
    assert record.config == config and record.status == "ok"


def test_the_reference_another_worker_is_measuring_is_waited_for_not_measured_again(monkeypatch):
    """The finisher's 32-true reference is the config another worker may be measuring at
    that moment: it waits for that result instead of measuring the config a second time."""
    from autofit.search import _finish as finish, _trial, Tuner, make_study, read_records
    from autofit.search.study import ask
    from simulated import LANDSCAPES

    landscape = LANDSCAPES[0]
    study = make_study(study_name="reference", storage=None)

    def tuner(measure):
        return Tuner(landscape.space(), study=study, budget=Budget(usable_bytes=landscape.budget_bytes),
                     measure=measure, estimate=landscape.estimate, max_trials=1, patience=1)

    finisher_calls, other = [], tuner(landscape.measure)
    finisher = tuner(lambda config: finisher_calls.append(config) or landscape.measure(config))
    # What the finisher would measure as its reference, claimed by the other worker first.
    study.enqueue_trial(other.space.params(landscape.space().config("32-true", landscape.global_batch_size, 0, 0)))
    trial = ask(study)
    config = other.space.suggest(trial)
    waits = []

    def wait(seconds):  # the other worker's result lands while the finisher waits (no wall-clock race)
        waits.append(seconds)
        if len(waits) == 1:
            _trial.tell(other.trials, trial, _trial.evaluate(other.trials, other.timing, trial, config, []))

    monkeypatch.setattr(finish.time, "sleep", wait)
    finisher.ensure_reference()
    assert waits == [finish.BUSY_WAIT_S]
    assert finisher_calls == [] and [r.config for r in read_records(study)] == [config]
