"""Nothing a user types crashes autofit, hangs it or leaves a process behind (issue 10).

The hostile-input table runs the public commands in this process (`run_main`): every row
must end with its exit code and exactly one line on stderr, no traceback, within 30 s, and
before any trial where it would launch a tune. Signals and a SIGKILLed parent are process
matters, so those tests start real `autofit` processes.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import autofit
from autofit.device.probe import cpu_device, emulated_device, with_memory_budget
from autofit.base.errors import ProfileError
from autofit.config.train_config import TrainConfig
from autofit.base.sizes import parse_size
from autofit.config.spec import divisors, parse_spec
from autofit.profiles.store import ProfileStore
from conftest import alive, FIXTURES, left_behind, REPO, run_main, start_cli, tiny_gpt_dict, write_spec
from postgres import wait_until
from test_profile import make_profile

CASE_LIMIT_S = 30.0


def _spec(folder: Path, file_name: str = "model.yaml", **sections) -> Path:
    return write_spec(folder, tiny_gpt_dict(**sections), file_name)


def _user_code_spec(folder: Path, model: str = "faulty:dataset", factory: str = "faulty:dataset") -> Path:
    """A spec whose `python:` model and data factory come from tests/fixtures/faulty.py."""
    shutil.copy(FIXTURES / "faulty.py", folder / "faulty.py")
    spec = tiny_gpt_dict(name="user", data={"kind": "python", "factory": factory})
    spec["model"] = {"python": model}
    return write_spec(folder, spec, f"user-{model.partition(':')[2]}-{factory.partition(':')[2]}.yaml")


# Each row: (command line with {tmp}/{spec}/... placeholders, files to make, exit code, words the line holds)
HOSTILE = {
    # --- tune: every case fails before a trial is started
    "tune-huge-global-batch": ("tune {gbs}", 2, "train.global_batch_size: at most"),
    "tune-budget-1.5": ("tune {spec} --device cpu --memory-budget 1.5", 2, "neither a fraction"),
    "tune-budget-1e400": ("tune {spec} --device cpu --memory-budget 1e400", 2, "larger than any device"),
    "tune-budget-above-device": ("tune {spec} --device cpu --memory-budget 1024TiB", 2, "more than this device"),
    "tune-budget-zero": ("tune {spec} --device cpu --memory-budget 0", 2, "at least 1 byte"),
    "tune-name-newline": ("tune {newline_name}", 2, "name: letters"),
    "tune-name-300-chars": ("tune {long_name}", 2, "name: at most 96 characters"),
    "tune-lr-nan": ("tune {lr_nan}", 2, "optimizer.lr: must be a finite number"),
    "tune-weight-decay-inf": ("tune {wd_inf}", 2, "optimizer.weight_decay: must be a finite number"),
    "tune-headroom-nan": ("tune {headroom_nan}", 2, "search.memory_headroom: must be a finite number"),
    "tune-trial-timeout-inf": ("tune {timeout_inf}", 2, "search.trial_timeout_s: must be a finite number"),
    "tune-timeout-nan": ("tune {spec} --device cpu --timeout nan", 2, "--timeout: must be a positive finite"),
    "tune-trials-0": ("tune {spec} --device cpu --trials 0", 2, "--trials: must be a positive integer"),
    "tune-trials-huge": ("tune {spec} --device cpu --trials 1000000000", 2, "--trials: at most"),
    "tune-only-tf32-on-cpu": ("tune {tf32_only} --device cpu", 2, "tf32 needs an NVIDIA GPU"),
    "tune-builder-raises": ("tune {build_raises} --device cpu", 2,
                            "model.python: faulty:broken_build raised RuntimeError: weights file missing"),
    "tune-builder-exits": ("tune {build_exits} --device cpu", 2, "faulty:exit_build called sys.exit(7)"),
    "tune-forward-raises": ("-q tune {forward_raises} --device cpu", 2,
                            "faulty:raise_ raised ValueError: expected 4 features while running forward"),
    "tune-factory-raises": ("tune {factory_raises} --device cpu", 2,
                            "data.factory: faulty:broken_dataset raised KeyError"),
    "tune-spec-is-a-folder": ("tune {tmp}", 2, "is a folder, not a model.yaml"),
    "tune-huge-layers": ("tune {huge_layers} --device cpu", 2, "model.args.n_layer: at most"),
    # --- train
    "train-huge-global-batch": ("train {gbs} --device cpu", 2, "train.global_batch_size: at most"),
    "train-steps-0": ("train {spec} --device cpu --steps 0", 2, "--steps: must be a positive integer"),
    "train-steps-huge": ("train {spec} --device cpu --steps 10000000000000", 2, "--steps: at most"),
    "train-budget-1.5": ("train {spec} --device cpu --memory-budget 1.5", 2, "neither a fraction"),
    "train-builder-raises": ("train {build_raises} --device cpu", 2, "faulty:broken_build raised RuntimeError"),
    "train-builder-exits": ("train {build_exits} --device cpu", 2,
                            "model.python: faulty:exit_build called sys.exit(7) while building the model"),
    "train-forward-raises": ("-q train {forward_raises} --device cpu --checkpoint-dir {tmp}/run-fwd", 2,
                             "faulty:raise_ raised ValueError"),
    "train-profile-not-in-store": ("train {spec} --device cpu --profile nosuch --checkpoint-dir {tmp}/r", 2,
                                   "no profile of model 'nosuch'"),
    "train-profile-is-a-folder": ("train {spec} --device cpu --profile {tmp}/ --checkpoint-dir {tmp}/r", 2,
                                  "is a folder, not a profile file"),
    "train-metrics-out-folder": ("train {spec} --device cpu --metrics-out {tmp}", 2, "--metrics-out"),
    "train-resume-and-overwrite": ("train {spec} --device cpu --resume --overwrite", 2, "choose one"),
    "train-existing-run": ("train {spec} --device cpu --checkpoint-dir {old_run}", 2, "already holds a run"),
    "train-tf32-profile-on-cpu": ("-q train {spec} --device cpu --profile {tf32_profile} --checkpoint-dir {tmp}/r2",
                                  2, "tf32 needs an NVIDIA GPU"),
    "train-token-path-folder": ("train {tokens_folder} --device cpu --checkpoint-dir {tmp}/r3", 2,
                                "data.path: is a folder"),
    # --- estimate
    "estimate-huge-global-batch": ("estimate {gbs} --device cpu", 2, "train.global_batch_size: at most"),
    "estimate-tf32-on-cpu": ("estimate {spec} --device cpu --set precision=tf32", 2, "tf32 needs an NVIDIA GPU"),
    "estimate-micro-not-dividing": ("estimate {spec} --device cpu --set micro_batch_size=3", 2, "must divide"),
    "estimate-micro-not-a-number": ("estimate {spec} --device cpu --set micro_batch_size=x", 2, "integer"),
    "estimate-budget-1e400": ("estimate {spec} --device cpu --memory-budget 1e400", 2, "larger than any device"),
    "estimate-forward-raises": ("estimate {forward_raises} --device cpu", 2, "faulty:raise_ raised ValueError"),
    "estimate-factory-raises": ("estimate {factory_raises} --device cpu", 2, "faulty:broken_dataset raised"),
    # --- trial (a child process: its errors come back as one line, exit 2)
    "trial-tf32-on-cpu": ("trial {spec} --device cpu --set precision=tf32", 2, "tf32 needs an NVIDIA GPU"),
    "trial-timeout-nan": ("trial {spec} --device cpu --timeout nan", 2, "--timeout: must be a positive finite"),
    "trial-measure-steps-0": ("trial {spec} --device cpu --measure-steps 0", 2, "--measure-steps"),
    "trial-budget-1.5": ("trial {spec} --device cpu --memory-budget 1.5", 2, "neither a fraction"),
    "trial-forward-raises": ("trial {forward_raises} --device cpu", 2, "faulty:raise_ raised ValueError"),
    # --- profiles
    "profiles-show-missing-name": ("profiles show nosuch --store {store} --device cpu", 2, "no profile of model"),
    "profiles-show-folder": ("profiles show {tmp}/ --store {store}", 2, "is a folder, not a profile file"),
    "profiles-show-budget-1.5": ("profiles show tiny --store {store} --device cpu --memory-budget 1.5", 2,
                                 "neither a fraction"),
    "profiles-show-emulated-only": ("profiles show tiny --store {budget_store} --device cpu", 2,
                                    "emulated card"),
    "profiles-export-n-blocks": ("profiles export tiny --store {store} --device cpu --format hf --n-blocks -1", 2,
                                 "--n-blocks"),
    # --- serve: its config, and the inventory it is pointed at
    "serve-poll-nan": ("serve --config {serve_poll_nan}", 2, "poll_interval_s: must be a finite number"),
    "serve-trials-0": ("serve --config {serve_trials_0}", 2, "trials: an integer in"),
    "serve-idle-inf": ("serve --config {serve_idle_inf}", 2, "idle.min_idle_s: must be a finite number"),
    "serve-headroom-nan": ("serve --config {serve_headroom_nan}", 2, "memory_headroom"),
    "serve-config-folder": ("serve --config {tmp}", 2, "not a file"),
    "serve-inventory-folder": ("serve --config {serve_ok} --inventory {tmp}", 2, "is a folder"),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """Every file the table's rows name, made once."""
    tmp = tmp_path_factory.mktemp("hostile")
    f = {"tmp": str(tmp), "spec": _spec(tmp)}
    broken = {
        "gbs": {"train": {"global_batch_size": 10**12}},
        "newline_name": {"name": "evil\n"},
        "long_name": {"name": "x" * 300},
        "lr_nan": {"optimizer": {"lr": math.nan}},
        "wd_inf": {"optimizer": {"weight_decay": math.inf}},
        "headroom_nan": {"search": {"memory_headroom": math.nan}},
        "timeout_inf": {"search": {"trial_timeout_s": math.inf}},
        "tf32_only": {"search": {"precisions": ["tf32"]}},
        "huge_layers": {"model": {"builtin": "gpt", "args": {**tiny_gpt_dict()["model"]["args"], "n_layer": 10**9}}},
        "tokens_folder": {"data": {"kind": "tokens", "path": str(tmp)}},
    }
    for key, changes in broken.items():
        f[key] = _spec(tmp, f"{key}.yaml", **changes)
    f["build_raises"] = _user_code_spec(tmp, model="faulty:broken_build")
    f["build_exits"] = _user_code_spec(tmp, model="faulty:exit_build")
    f["forward_raises"] = _user_code_spec(tmp, model="faulty:raise_")
    f["factory_raises"] = _user_code_spec(tmp, model="faulty:raise_", factory="faulty:broken_dataset")
    old_run = tmp / "old-run"
    old_run.mkdir()
    (old_run / "checkpoint.pt").write_bytes(b"an earlier run")
    f["old_run"] = old_run
    spec = parse_spec(tiny_gpt_dict(), source_dir=tmp)
    f["tf32_profile"] = make_profile(spec, TrainConfig(precision="tf32", micro_batch_size=8)).save(tmp / "tf32.yaml")
    store = ProfileStore(tmp / "store")
    store.save(make_profile(spec, TrainConfig(micro_batch_size=8)))
    f["store"] = store.root
    budget_store = ProfileStore(tmp / "budget-store")
    budget_store.save(_budget_profile(spec))
    f["budget_store"] = budget_store.root
    service = {"models_dir": "models", "store_dir": "profiles", "state_dir": "state"}
    for key, changes in {"serve_ok": {}, "serve_poll_nan": {"poll_interval_s": math.nan},
                         "serve_trials_0": {"trials": 0}, "serve_idle_inf": {"idle": {"min_idle_s": math.inf}},
                         "serve_headroom_nan": {"memory_headroom": math.nan}}.items():
        path = tmp / f"{key}.yaml"
        path.write_text(yaml.safe_dump({**service, **changes}))
        f[key] = path
    return {k: str(v) for k, v in f.items()}


def _budget_profile(spec):
    """The profile `tune --memory-budget 16MiB` writes on this CPU."""
    return make_profile(spec, TrainConfig(micro_batch_size=1, grad_accum_steps=8),
                        device=with_memory_budget(cpu_device(), 16 * 2**20))


def test_the_table_covers_every_command():
    commands = {line.removeprefix("-q ").split()[0] for line, _, _ in HOSTILE.values()}
    assert commands == {"tune", "train", "estimate", "trial", "profiles", "serve"}
    assert len(HOSTILE) >= 40


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_input_is_one_line_and_its_exit_code(case, files, capsys, monkeypatch, tmp_path):
    line, expected_code, words = HOSTILE[case]
    monkeypatch.chdir(tmp_path)  # train's default runs/ folder, if a case got that far
    monkeypatch.setenv("AUTOFIT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("AUTOFIT_STORE", str(tmp_path / "profiles"))
    trial_folders = set(Path(os.environ["TMPDIR"]).glob("autofit-trial-*"))
    args = [part.format(**files) for part in line.split()]
    started = time.monotonic()
    code, _out, err = run_main(capsys, *args)
    took_s = time.monotonic() - started
    lines = err.strip().splitlines()
    assert code == expected_code, err
    assert len(lines) == 1 and lines[0].startswith("autofit: error: "), err
    assert words in lines[0] and "Traceback" not in err
    assert took_s < CASE_LIMIT_S
    if args[0] == "tune":  # failed before any trial: no trial folder was ever made
        assert set(Path(os.environ["TMPDIR"]).glob("autofit-trial-*")) == trial_folders
        assert not (tmp_path / "profiles").exists() or not list((tmp_path / "profiles").iterdir())


# ---- 1. validation at the edge --------------------------------------------------------------


def test_micro_batch_sizes_are_the_divisors_without_walking_the_range():
    for n in (1, 2, 12, 36, 97, 1024, 5040):
        assert divisors(n) == [m for m in range(1, n + 1) if n % m == 0]
    started = time.monotonic()
    assert len(divisors(2**40)) == 41  # 10**12 steps of range(1, n + 1) would take hours
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("text,total,expected", [
    ("24GiB", None, 24 * 2**30), ("0.5", 1000, 500), ("1.0", 1000, 1000), ("1e9", None, 10**9),
    ("2048", None, 2048), ("1.5GiB", None, 3 * 2**29),
])
def test_sizes_parse_strictly(text, total, expected):
    assert parse_size(text, total_bytes=total) == expected


@pytest.mark.parametrize("text", ["1.5", "1e400", "0", "nan", "inf", "1e400GiB", "0.0000001KiB", "2.5e0"])
def test_sizes_that_are_not_sizes_are_errors(text):
    with pytest.raises(ValueError):
        parse_size(text, total_bytes=1000)


@pytest.mark.parametrize("name,ok", [("gpt-small.v2", True), ("evil\n", False), ("a" * 96, True), ("a" * 97, False),
                                     ("-leading-dash", False), ("a/b", False)])
def test_spec_names_fit_a_file_name(name, ok, tmp_path):
    from autofit.base.errors import SpecError

    if ok:
        from autofit.base.atomic import atomic_write_text
        from autofit.device.probe import MAX_DEVICE_NAME_CHARS, slugify
        from autofit.profiles.demotions import demotions_path

        spec = parse_spec(tiny_gpt_dict(name=name), source_dir=tmp_path)
        # The longest file the store writes: the demotions record of a profile tuned under a
        # budget over 16 ranks on a GPU with the longest name NVML gives, written atomically.
        slug = slugify("N" * MAX_DEVICE_NAME_CHARS) + "-budget-1023_99gib-x16"
        atomic_write_text(demotions_path(tmp_path / f"{spec.name}--{slug}.yaml"), "{}")  # no ENAMETOOLONG
    else:
        with pytest.raises(SpecError, match="^name: "):
            parse_spec(tiny_gpt_dict(name=name), source_dir=tmp_path)


def test_estimate_keeps_the_specs_memory_headroom_free(tmp_path, capsys):
    from autofit.measure.fake_step import estimate_memory
    from autofit.config.spec import load_spec

    path = _spec(tmp_path, train={"global_batch_size": 2}, search={"memory_headroom": 0.2})
    peak = estimate_memory(load_spec(path), TrainConfig(micro_batch_size=2)).peak_bytes
    # Room for the peak, but not once 20 % of it is kept free, as tune would keep it.
    code, out, err = run_main(capsys, "estimate", path, "--device", "cpu", "--memory-budget", int(peak / 0.9),
                              "--json")
    result = json.loads(out)
    assert code in (0, 3), err  # 3: not even a micro batch of 1 fits the smaller budget
    assert result["fits"] is False and result["budget_bytes"] == int(int(peak / 0.9) * 0.8)


# ---- 2. the user's own code -----------------------------------------------------------------


def test_debug_shows_the_users_traceback(tmp_path, capsys):
    path = _user_code_spec(tmp_path, model="faulty:broken_build")
    code, _, err = run_main(capsys, "--debug", "estimate", path, "--device", "cpu")
    assert code == 2
    assert "Traceback" in err and "faulty.py" in err and "weights file missing" in err
    assert err.strip().splitlines()[-1].startswith("autofit: error: model.python: faulty:broken_build")


def test_a_trial_childs_user_error_keeps_its_traceback_for_debug(tmp_path, capsys):
    """The child's side in this process (the table runs a real child): the user's error is
    marked as input, with their traceback, and the parent prints it under --debug."""
    from autofit.measure.child import run_request
    from autofit.cli import _print_traceback
    from autofit.base.errors import InputError
    from autofit.config.spec import load_spec
    from autofit.measure.trial import raise_input_error

    spec = load_spec(_user_code_spec(tmp_path, model="faulty:raise_"))
    out = run_request({"spec": spec.to_dict(), "source_dir": str(spec.source_dir), "device": "cpu",
                       "config": TrainConfig(micro_batch_size=8).to_dict(), "budget": None,
                       "warmup_steps": 0, "measure_steps": 1, "timeout_s": 60})
    assert out.input_error is True and out.status == "error"
    with pytest.raises(InputError) as raised:
        raise_input_error(out)
    assert str(raised.value).startswith("model.python: faulty:raise_ raised ValueError: expected 4 features")
    _print_traceback(raised.value)
    assert 'raise ValueError("expected 4 features")' in capsys.readouterr().err


# ---- 3. signals and children ----------------------------------------------------------------


def _trial_children(folder: Path) -> list[int]:
    """Pids of trial children whose request lies under `folder` (a test's own TMPDIR)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        # The trial worker and the children it forks (which share its command line), or a
        # spawned trial child.
        if ("autofit.measure.worker_main" in cmdline or "autofit.measure.child" in cmdline) \
                and str(folder) in cmdline and state != "Z":
            pids.append(int(proc.name))
    return pids


@pytest.mark.parametrize("command,sig", [("trial", signal.SIGHUP), ("tune", signal.SIGTERM)])
def test_a_signal_stops_the_trial_child_and_removes_its_folder(tmp_path, command, sig):
    # A trial that would run for 10 minutes: only the signal can end it in time. (Not a
    # sleeping `python:` forward: both commands run it once on fake tensors before a trial.)
    path = _spec(tmp_path, "slow.yaml", train={"global_batch_size": 1},
                 search={"trial_timeout_s": 600, "measure_steps": 10**5, "precisions": ["32-true"],
                         "activation_checkpointing": False})
    extra = ["--out", tmp_path / "profiles", "--state-dir", tmp_path / "state"] if command == "tune" else []
    proc, tmp = start_cli(tmp_path, command, path, "--device", "cpu", *extra)
    try:
        children = wait_until(lambda: _trial_children(tmp), 120, "the trial child")
        proc.send_signal(sig)
        proc.wait(timeout=30)
        _, err = proc.communicate()
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + sig, err
    assert err.strip().splitlines()[-1] == f"autofit: stopped by {signal.Signals(sig).name}"
    assert not _trial_children(tmp) and not any(alive(pid) for pid in children)
    assert list(tmp.glob("autofit-trial-*")) == []


@pytest.mark.parametrize("where", ["trial", "doctor"])
def test_a_signal_while_the_child_is_being_started_still_kills_it(tmp_path, monkeypatch, where):
    """A stop signal inside `subprocess.Popen`, after the fork (here the trial worker's or
    the doctor's): the stop is a flag, never an exception thrown into Popen, so the child's
    handle is never lost; the child is killed and reaped, and its folder removed. Sent here,
    deterministically, from within Popen just after the child exists."""
    import tempfile

    from autofit.base import stopping
    from autofit.doctor import run as doctor_run
    from autofit.measure.trial import measure

    started, real_popen = [], subprocess.Popen

    def popen_then_signal(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        started.append(proc)
        os.kill(os.getpid(), signal.SIGTERM)  # handled at the next bytecode: still inside Popen
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen_then_signal)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    previous = stopping.install()
    try:
        if where == "doctor":
            outcome = doctor_run.run_one("probe", "cpu", timeout_s=60)
            assert outcome["status"] == "fail" and "stopped" in outcome["reason"]
        else:
            m = measure(parse_spec(tiny_gpt_dict(), source_dir=REPO), TrainConfig(micro_batch_size=8), device="cpu")
            assert (m.status, m.reason) == ("error", "stopped")
        assert stopping.requested.is_set() and stopping.signum == signal.SIGTERM
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stopping.reset()
        for proc in started:  # what the code under test failed to kill, so the session stays clean
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                pytest.fail("the child outlived the signal")
    assert len(started) == 1 and started[0].returncode is not None  # killed and reaped by the code under test
    assert list(tmp_path.iterdir()) == []  # its folder removed


def test_the_session_check_reports_what_is_left(tmp_path):
    (tmp_path / "autofit-trial-123-abc").mkdir()
    assert left_behind(str(tmp_path), wait_s=0) == [f"folder {tmp_path}/autofit-trial-123-abc"]
    (tmp_path / "autofit-trial-123-abc").rmdir()
    assert left_behind(str(tmp_path), wait_s=0) == []


# ---- 5. checkpoints are never silently replaced ---------------------------------------------


def test_train_refuses_an_earlier_run_without_resume_or_overwrite(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the quick start's default folder, runs/<name>
    path = _spec(tmp_path)

    def train(*extra):
        return run_main(capsys, "-q", "train", path, "--device", "cpu", "--steps", "1", "--no-progress", *extra)

    assert train()[0] == 0
    checkpoint = tmp_path / "runs" / "tiny" / "checkpoint.pt"
    before = checkpoint.stat()
    code, _, err = train()
    assert code == 2 and err.count("\n") == 1 and "already holds a run" in err
    assert checkpoint.stat() == before  # not even rewritten with the same bytes
    assert train("--overwrite")[0] == 0 and checkpoint.stat().st_ino != before.st_ino  # atomically replaced
    assert train("--resume", "--steps", "2")[0] == 0


# ---- 6. emulated is never real ---------------------------------------------------------------


def test_a_budget_profile_is_used_only_when_its_budget_is_asked_for(tmp_path, capsys):
    spec = parse_spec(tiny_gpt_dict(), source_dir=tmp_path)
    store = ProfileStore(tmp_path / "profiles")
    budget_path = store.save(_budget_profile(spec))
    assert budget_path.name == "tiny--cpu-budget-16_00mib.yaml"
    with pytest.raises(ProfileError, match="emulated card"):
        autofit.load_profile("tiny", store=store, device="cpu")
    assert autofit.load_profile("tiny", store=store, device="cpu", memory_budget="16MiB").config.micro_batch_size == 1
    assert autofit.load_profile(budget_path).device.is_emulated  # by its file name
    real_path = store.save(make_profile(spec, TrainConfig(micro_batch_size=8)))
    assert autofit.load_profile("tiny", store=store, device="cpu").config.micro_batch_size == 8
    code, out, err = run_main(capsys, "profiles", "show", "tiny", "--store", store.root, "--device", "cpu")
    assert code == 0 and out.startswith(f"# {real_path}\n"), err


def test_an_emulated_gpus_profile_never_takes_a_real_gpus_name_or_fingerprint():
    real_name = "NVIDIA H100 80GB HBM3"
    fake = emulated_device(real_name, 85520809984, (9, 0))
    assert fake.slug == "nvidia-h100-80gb-hbm3-emulated" and fake.fingerprint.endswith("-emulated")
    spec = parse_spec(tiny_gpt_dict(), source_dir=REPO)
    profile = make_profile(spec, TrainConfig(micro_batch_size=8), device=fake)
    assert profile.file_name == "tiny--nvidia-h100-80gb-hbm3-emulated.yaml" and profile.device.emulated
    real = with_memory_budget(cpu_device(), 2**30)
    assert real.fingerprint != cpu_device().fingerprint and real.slug != cpu_device().slug


# ---- smaller items ---------------------------------------------------------------------------


def test_train_takes_a_store_name_for_its_profile(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec_path = _spec(tmp_path)
    store = ProfileStore(tmp_path / "profiles")  # ./profiles: the default store
    store.save(make_profile(parse_spec(tiny_gpt_dict(), source_dir=tmp_path),
                            TrainConfig(micro_batch_size=4, grad_accum_steps=2)))
    code, _, err = run_main(capsys, "-q", "train", spec_path, "--device", "cpu", "--profile", "tiny", "--steps", "1",
                            "--no-progress", "--metrics-out", tmp_path / "metrics.json")
    assert code == 0, err
    config = json.loads((tmp_path / "metrics.json").read_text())["config"]
    assert (config["micro_batch_size"], config["grad_accum_steps"]) == (4, 2)
