"""Hostile input, round 3 (issue 47): a host at its limits, an operator's signals, a
caller's mistakes. Each class is fixed at its root; each test here failed before the fix."""

import errno
import fcntl
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

import autofit

from autofit import load_profile
from autofit.base.atomic import atomic_write_text, temp_prefix
from autofit.base.errors import AutofitError, ProfileError, SpecError, UserCodeError
from autofit.base.resources import ResourceError
from autofit.workload.data import user_code
from autofit.cli import main as cli_main
from autofit.config.spec import parse_spec
from autofit.config.train_config import TrainConfig
from autofit.search.study import make_study, storage_errors, StorageError
from autofit.service.job import MAX_ATTEMPTS, TuneJob
from autofit.service.state import PairState, StateLock
import postgres
from conftest import REPO, tiny_gpt_dict, write_spec
from test_profile import make_profile

WAIT_S = 120  # serve starts in a few seconds; a busy host needs the margin


def _serve(tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    """`autofit serve` on an emulated inventory with no models: it polls and idles."""
    (tmp_path / "models").mkdir()
    config = tmp_path / "autofit.yaml"
    config.write_text(yaml.safe_dump({"models_dir": "models", "store_dir": "profiles", "state_dir": "state",
                                      "poll_interval_s": 0.2}))
    inventory = tmp_path / "gpus.json"
    inventory.write_text(json.dumps({"gpus": []}))
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "autofit", "serve", "--config", str(config),
                             "--inventory", str(inventory)], cwd=REPO, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, tmp_path / "state", log


def _wait_running(proc: subprocess.Popen, state_dir: Path, log: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            if json.loads((state_dir / "state.json").read_text())["service"]["running"]:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    pytest.fail(f"serve did not start:\n{log.read_text()}")


# --- 1. signal storms ------------------------------------------------------------------------

@pytest.mark.timing
@pytest.mark.slow
def test_a_signal_storm_on_serve_ends_it_with_exit_0(tmp_path):
    """SIGTERM, SIGHUP and SIGINT, again and again until it has exited: the first stops it,
    every later one (while stopping, and while the interpreter shuts down) is absorbed."""
    proc, state_dir, log = _serve(tmp_path)
    try:
        _wait_running(proc, state_dir, log)
        storm = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
        deadline = time.monotonic() + WAIT_S
        sent = 0
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                os.kill(proc.pid, storm[sent % len(storm)])
            except ProcessLookupError:
                break
            sent += 1
            time.sleep(0.002)
        rc = proc.wait(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert rc == 0, f"exit {rc} after {sent} signals:\n{text[-3000:]}"
    assert "stopped" in text and "Traceback" not in text
    assert json.loads((state_dir / "state.json").read_text())["service"]["running"] is False


# --- 8. the lock's owner ---------------------------------------------------------------------

def test_a_second_serve_reads_the_holders_pid_even_at_the_moment_it_locks(tmp_path, monkeypatch):
    """A contender that comes right after the holder's flock (before the holder has written
    anything) names the holder's pid, never "pid ?"."""
    real_flock, contenders, errors = fcntl.flock, [], []

    def flock(f, operation):
        real_flock(f, operation)
        if operation & fcntl.LOCK_EX and not contenders:
            contenders.append(StateLock(tmp_path))
            try:
                contenders[0].acquire()
            except AutofitError as exc:
                errors.append(str(exc))

    monkeypatch.setattr(fcntl, "flock", flock)
    holder = StateLock(tmp_path)
    try:
        holder.acquire()
    except AutofitError as exc:
        errors.append(str(exc))
    monkeypatch.setattr(fcntl, "flock", real_flock)
    assert len(errors) == 1 and f"another autofit serve (pid {os.getpid()})" in errors[0], errors
    for lock in (holder, *contenders):
        lock.release()
    assert not [p.name for p in tmp_path.iterdir() if p.name != "autofit.lock"]


def test_a_dead_holders_lock_is_taken_over_with_our_pid(tmp_path):
    (tmp_path / "autofit.lock").write_text("999999999\n")  # no such process holds it
    lock = StateLock(tmp_path)
    lock.acquire()
    assert (tmp_path / "autofit.lock").read_text() == f"{os.getpid()}\n"
    with pytest.raises(AutofitError, match=rf"another autofit serve \(pid {os.getpid()}\)"):
        StateLock(tmp_path).acquire()
    lock.release()
    StateLock(tmp_path).acquire()  # released: the next one takes it


# --- 2. names ----------------------------------------------------------------------------------

LONG_NAMES = {"5000 characters": "x" * 5000, "300-character .yaml": "p" * 295 + ".yaml",
              "a long folder": "a" * 300 + "/p.yaml", "a NUL": "tiny\0gpt", "a newline": "tiny\ngpt", "empty": ""}


@pytest.mark.parametrize("name", LONG_NAMES.values(), ids=LONG_NAMES.keys())
def test_a_name_too_long_or_malformed_is_a_profile_error(name, tmp_path):
    with pytest.raises(ProfileError, match=r"^profile: ") as caught:
        load_profile(name, store=tmp_path, device="cpu")
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 300


@pytest.mark.parametrize("name", ["x" * 5000, "p" * 295 + ".yaml"], ids=["5000", "300.yaml"])
def test_profiles_show_with_a_name_too_long_is_one_line_exit_2(name, tmp_path):
    result = subprocess.run([sys.executable, "-m", "autofit", "profiles", "show", name, "--store", str(tmp_path),
                             "--device", "cpu"], cwd=tmp_path, capture_output=True, text=True, timeout=WAIT_S)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "file name is at most 255" in result.stderr or "a path is at most" in result.stderr


# --- 3. a loss that cannot train ---------------------------------------------------------------

def _logits(model, batch):
    return model(batch[0])


BAD_LOSSES = {  # name: (loss_fn, what the one error says is wrong)
    "vector": (lambda m, b: (_logits(m, b) - b[1][:, None]).pow(2).mean(1), r"shape \[4\] \(not a scalar"),
    "detached": (lambda m, b: _logits(m, b).pow(2).mean().detach(), "detached from the autograd graph"),
    "integer": (lambda m, b: _logits(m, b).argmax(1).sum(), r"int64 tensor \(not floating-point"),
    "no_grad": (lambda m, b: _no_grad_loss(m, b), "detached from the autograd graph"),
    "float": (lambda m, b: 0.5, r"a Python float \(0\.5\), which has no gradient"),
    "None": (lambda m, b: None, "None$"),
}


def _no_grad_loss(model, batch):
    with torch.no_grad():
        return _logits(model, batch).pow(2).mean()


def _batch(n, generator):
    return torch.randn(n, 8, generator=generator), torch.randn(n, generator=generator)


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


@pytest.mark.parametrize("case", BAD_LOSSES)
def test_train_model_with_a_loss_that_cannot_train_is_one_spec_error(case):
    loss_fn, problem = BAD_LOSSES[case]
    spec = parse_spec(tiny_gpt_dict(), source_dir=REPO)
    profile = make_profile(spec, TrainConfig(micro_batch_size=4, grad_accum_steps=2))
    with pytest.raises(SpecError, match=rf"^loss_fn: .*must return a scalar floating-point tensor attached to the "
                                        rf"autograd graph .*; got .*{problem}"):
        autofit.train_model(_mlp(), _batch, loss_fn, profile=profile, steps=1, device="cpu", log_every=0)


LOSS_MODULE = '''
import torch

def _logits(model, batch):
    out = model(batch[0])
    return (out[0] if isinstance(out, tuple) else out).float()

def vector(model, batch):
    return _logits(model, batch).pow(2).mean(-1).flatten()

def detached(model, batch):
    return _logits(model, batch).pow(2).mean().detach()
'''


@pytest.mark.parametrize("case, problem", [("vector", "not a scalar"), ("detached", "detached from the autograd")])
def test_autofit_train_with_a_loss_that_cannot_train_is_one_line_exit_2(tmp_path, case, problem):
    (tmp_path / "losses47.py").write_text(LOSS_MODULE)
    spec = write_spec(tmp_path, tiny_gpt_dict(loss={"python": f"losses47:{case}"}))
    result = subprocess.run([sys.executable, "-m", "autofit", "train", str(spec),
                             "--steps", "1", "--checkpoint-dir", str(tmp_path / "run")], cwd=tmp_path,
                            capture_output=True, text=True, timeout=WAIT_S)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert lines == [line for line in lines if line.startswith("autofit: error: loss.python: losses47:")], lines
    assert len(lines) == 1 and problem in lines[0] and "Traceback" not in result.stderr


def _detached_loss(model, batch):
    return model(batch[0]).pow(2).mean().detach()


@pytest.mark.slow
def test_tune_with_a_detached_loss_says_the_same(tmp_path):
    # The trial child's SpecError comes back as an InputError: the same line, exit 2.
    with pytest.raises(AutofitError, match=r"^loss_fn: _detached_loss must return a scalar floating-point tensor "
                                           r"attached to the autograd graph .*; got a tensor detached") as caught:
        autofit.tune(_mlp, _batch, _detached_loss, global_batch_size=8, memory_budget="256MiB", trials=2,
                     device="cpu", search={"precisions": ["32-true"], "warmup_steps": 1, "measure_steps": 1},
                     out_dir=tmp_path / "profiles", state_dir=tmp_path / "state", report=False)
    assert caught.value.exit_code == 2


# --- 4. public API arguments -----------------------------------------------------------------

BAD_TIMEOUTS = {"nan": (float("nan"), "got nan"), "inf": (float("inf"), "got inf"), "True": (True, r"got True \(a bool\)"),
                "str": ("60", r"got '60' \(a str\)"), "zero": (0, "got 0"), "negative": (-1.0, "got -1.0")}


@pytest.mark.parametrize("case", BAD_TIMEOUTS)
def test_tune_refuses_a_timeout_as_the_cli_does_before_any_work(case, tmp_path, monkeypatch):
    value, said = BAD_TIMEOUTS[case]
    monkeypatch.setattr("autofit.tuning.notebook.tune_spec", lambda *a, **k: pytest.fail("tuned"))
    with pytest.raises(SpecError, match=rf"^timeout_s: must be a positive finite number of seconds, {said}$"):
        autofit.tune(_mlp, _batch, global_batch_size=8, device="cpu", timeout_s=value,
                     out_dir=tmp_path / "profiles", state_dir=tmp_path / "state", report=False)


def test_the_cli_says_the_same_of_its_timeout(tmp_path):
    spec = write_spec(tmp_path, tiny_gpt_dict())
    result = subprocess.run([sys.executable, "-m", "autofit", "tune", str(spec), "--timeout", "nan"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=WAIT_S)
    assert result.returncode == 2
    assert result.stderr == "autofit: error: --timeout: must be a positive finite number of seconds, got nan\n"


@pytest.mark.parametrize("call", ["tune", "train_model"])
@pytest.mark.parametrize("value, said", [(True, r"got True \(a bool\)"), ("3", r"got '3' \(a str\)"),
                                         (2.0, r"got 2.0 \(a float\)"), (0, "got 0")])
def test_counts_are_checked_as_the_cli_checks_them(call, value, said, tmp_path, monkeypatch):
    monkeypatch.setattr("autofit.tuning.notebook.tune_spec", lambda *a, **k: pytest.fail("tuned"))
    profile = make_profile(parse_spec(tiny_gpt_dict(), source_dir=REPO), TrainConfig(micro_batch_size=4))
    name, run = {"tune": ("trials", lambda: autofit.tune(_mlp, _batch, global_batch_size=8, device="cpu", trials=value,
                                                         out_dir=tmp_path, state_dir=tmp_path, report=False)),
                 "train_model": ("steps", lambda: autofit.train_model(_mlp(), _batch, profile=profile, steps=value,
                                                                      device="cpu"))}[call]
    with pytest.raises(SpecError, match=rf"^{name}: must be a positive integer, {said}$"):
        run()


# --- 6. interrupted writes leave no litter -----------------------------------------------------

FORCED_MID_WRITE = '''
import os, signal, sys
from autofit.base import stopping
from autofit.base.atomic import atomic_write

def write(f):
    f.write(b"x" * 4_000_000)
    os.kill(os.getpid(), signal.SIGINT)   # the first stop: a flag, the write goes on
    f.write(b"y" * 4_000_000)
    os.kill(os.getpid(), signal.SIGTERM)  # the second: a forced exit, here, mid-write
    f.write(b"z")

stopping.install()
atomic_write(sys.argv[1], write)
'''


def _ours(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_forced_exit_mid_write_removes_its_temp_file(tmp_path):
    target = tmp_path / "checkpoint.pt"
    result = subprocess.run([sys.executable, "-c", FORCED_MID_WRITE, str(target)], cwd=REPO, capture_output=True,
                            text=True, timeout=WAIT_S)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert "stopped by SIGTERM (forced)" in result.stderr
    assert _ours(tmp_path) == []


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _leftovers(folder: Path, name: str) -> dict[str, Path]:
    """What an interrupted write leaves: of a dead process on this host, of the naming before
    the pid was in it (an hour old), and two that must stay: a live writer's, and a fresh
    one of unknown owner."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"dead": folder / f"{temp_prefix(name).replace(str(os.getpid()), str(_dead_pid()))}abcd_123.tmp",
             "legacy": folder / f".{name}.q1w2e3r4.tmp",
             "live": folder / f"{temp_prefix(name)}live_123.tmp",
             "fresh": folder / f".{name}.fresh123.tmp"}
    for path in paths.values():
        path.write_bytes(b"partial")
    os.utime(paths["legacy"], (time.time() - 7200, time.time() - 7200))
    return paths


def test_the_next_write_sweeps_dead_writers_temp_files(tmp_path):
    paths = _leftovers(tmp_path, "checkpoint.pt")
    atomic_write_text(tmp_path / "checkpoint.pt", "new")
    assert _ours(tmp_path) == sorted(["checkpoint.pt", paths["live"].name, paths["fresh"].name])


@pytest.mark.slow
def test_serve_sweeps_its_state_folder_at_start(tmp_path):
    paths = _leftovers(tmp_path / "state", "state.json")
    proc, state_dir, log = _serve(tmp_path)
    try:
        _wait_running(proc, state_dir, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 0
    left = _ours(state_dir)
    assert paths["dead"].name not in left and paths["legacy"].name not in left, left
    assert paths["live"].name in left and "removed" in log.read_text()


@pytest.mark.slow
def test_train_sweeps_its_checkpoint_folder_at_start(tmp_path):
    paths = _leftovers(tmp_path / "run", "checkpoint.pt")
    spec = write_spec(tmp_path, tiny_gpt_dict())
    result = subprocess.run([sys.executable, "-m", "autofit", "train", str(spec), "--steps", "1", "--device", "cpu",
                             "--checkpoint-dir", str(tmp_path / "run")], cwd=tmp_path, capture_output=True,
                            text=True, timeout=WAIT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    left = _ours(tmp_path / "run")
    assert paths["dead"].name not in left and paths["legacy"].name not in left, left


# --- 7. storage outages ----------------------------------------------------------------------------

@pytest.fixture
def lost_database(tmp_path):
    """What a tune's storage call raises when its PostgreSQL server has gone away: a study is
    opened on a server of its own (the session's is shared), the server is stopped, and the
    study is asked for a trial."""
    reason = postgres.unavailable_reason()
    if reason:
        pytest.skip(f"PostgreSQL: {reason}")
    server = postgres.PostgresServer(postgres._server_bin()).start()
    try:
        study = make_study(study_name="outage", storage=server.database())
        server._run("pg_ctl", "-D", str(server.data), "-m", "immediate", "-w", "-t", "30", "stop")
        with pytest.raises(Exception) as caught:
            study.ask()
        yield caught.value
    finally:
        server.stop()


def test_a_storage_outage_is_named_and_never_gives_a_pair_up(lost_database):
    spec = parse_spec(tiny_gpt_dict(), source_dir=REPO)
    pair = PairState(model="tiny", fingerprint="cpu-x", device="CPU")
    for outage in range(1, MAX_ATTEMPTS + 3):  # longer than the attempts that fail a pair
        job = TuneJob(key=pair.key, gpu=None, spec=spec, budget=None, trials=3, error=lost_database)
        job.settle(pair, headroom=0.05)
        assert pair.status == "retrying", pair.detail
        assert pair.failure["attempts"] == 0 and pair.failure["kind"] == "storage unreachable"
        assert pair.detail.startswith(f"storage unreachable ({outage} in a row, not counted as an attempt): ")
        assert "invalid data" not in pair.detail
    backoff_s = pair.failure["retry_after_unix_s"] - time.time()
    assert backoff_s > 60 * 2 ** (MAX_ATTEMPTS - 1)  # backing off, as after crashes in a row
    # A real crash after the outage still counts from where it was: 1 of 5.
    TuneJob(key=pair.key, gpu=None, spec=spec, budget=None, trials=3, error=RuntimeError("boom")).settle(
        pair, headroom=0.05)
    assert pair.failure["attempts"] == 1 and pair.status == "retrying"


def test_autofit_tune_names_a_storage_outage(lost_database):
    with pytest.raises(StorageError, match=r"^--storage postgresql://postgres@127\.0\.0\.1:\d+/autofit_\w+: storage "
                                           r"unreachable: .*; the study keeps every finished trial") as caught:
        with storage_errors("postgresql://postgres@127.0.0.1:1/autofit_x"):
            raise lost_database
    assert "invalid data" not in str(caught.value)


# --- 5. the host at its limits ------------------------------------------------------------------

def _tune_spec(tmp_path: Path) -> Path:
    return write_spec(tmp_path, tiny_gpt_dict(search={"trials": 2, "precisions": ["32-true"], "warmup_steps": 1,
                                                      "measure_steps": 1, "window_s": 0, "validate_steps": 2,
                                                      "frontier_points": 1}))


def _tune(tmp_path: Path, *, limit_address_space_bytes: int | None = None,
          env: dict | None = None) -> subprocess.CompletedProcess:
    def limit():
        if limit_address_space_bytes is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_address_space_bytes, limit_address_space_bytes))

    return subprocess.run([sys.executable, "-m", "autofit", "tune", str(_tune_spec(tmp_path)), "--device", "cpu",
                           "--out", str(tmp_path / "profiles"), "--storage", f"sqlite:///{tmp_path}/study.db"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, preexec_fn=limit,
                          env={**os.environ, **(env or {})})


def _one_line(result: subprocess.CompletedProcess) -> str:
    errors = [line for line in result.stderr.splitlines() if line.startswith("autofit: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return errors[0]


@pytest.fixture
def tiny_tmpdir(tmp_path):
    """A TMPDIR with 8 KiB free: a tmpfs of that size (root only), else the test skips."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@pytest.mark.slow
def test_no_space_in_tmpdir_is_named_exit_1(tmp_path, tiny_tmpdir):
    result = _tune(tmp_path, env={"TMPDIR": str(tiny_tmpdir)})
    assert result.returncode == 1
    line = _one_line(result)
    assert f"no space left in {tiny_tmpdir} (TMPDIR) (" in line and "KiB free) for the trial worker" in line, line


@pytest.mark.slow
@pytest.mark.parametrize("limit_mib", [256, 400])
def test_no_address_space_is_named_exit_1(tmp_path, limit_mib):
    """At 256 MiB torch's own library cannot be mapped in the worker; at 400 MiB the worker
    dies building the model (MemoryError, bad_alloc, OpenBLAS): the host's limit either way,
    never "the model's or data's code"."""
    result = _tune(tmp_path, limit_address_space_bytes=limit_mib * 2**20)
    assert result.returncode == 1, result.stderr[-3000:]
    line = _one_line(result)
    assert f"ran out of address space (ulimit -v: {limit_mib}.00 MiB)" in line, line


def _refuse_fork(*args, **kwargs):
    raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")


def test_no_processes_left_is_named_exit_1(tmp_path, monkeypatch, capsys):
    """`ulimit -u` cannot bind root (the tests' user here): the fork's refusal is raised as
    Python raises it under the limit."""
    monkeypatch.setattr(subprocess, "Popen", _refuse_fork)
    code = cli_main(["tune", str(_tune_spec(tmp_path)), "--device", "cpu", "--out", str(tmp_path / "profiles"),
                     "--storage", f"sqlite:///{tmp_path}/study.db"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "autofit: error: cannot start the trial worker: no more processes or threads for this user (ulimit -u: " \
           in err and "Traceback" not in err, err


def test_no_threads_left_is_named_exit_1(tmp_path, monkeypatch, capsys):
    real_start = threading.Thread.start

    def start(thread):
        if thread.name.startswith("autofit-tune-deadline"):
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    code = cli_main(["tune", str(_tune_spec(tmp_path)), "--device", "cpu", "--out", str(tmp_path / "profiles"),
                     "--storage", f"sqlite:///{tmp_path}/study.db"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "cannot start the tune's deadline watcher (a thread): no more processes or threads" in err, err


def test_a_full_disk_in_the_users_code_is_the_hosts_limit(tmp_path):
    with pytest.raises(ResourceError, match=rf"^no space left in {tmp_path} \(.* free\) for data\.factory m:make "
                                            rf"\(building the dataset\)"):
        with user_code("data.factory", "m:make", "building the dataset"):
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "cache.bin"))
    with pytest.raises(UserCodeError):  # a non-blocking socket's EAGAIN stays theirs
        with user_code("data.factory", "m:make", "building the dataset"):
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")


def test_a_name_at_the_file_systems_limit_still_has_a_temp_file_and_a_sweep(tmp_path):
    name = "c" * 255  # the longest name the kernel takes: its temp file's name is cut to fit
    dead = tmp_path / f"{temp_prefix(name).replace(str(os.getpid()), str(_dead_pid()))}abcd_123.tmp"
    live = tmp_path / f"{temp_prefix(name)}live_123.tmp"
    for path in (dead, live):
        path.write_bytes(b"partial")
    atomic_write_text(tmp_path / name, "new")
    assert _ours(tmp_path) == sorted([name, live.name])
