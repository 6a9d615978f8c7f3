"""A stop signal is a flag checked at safe points, never an exception thrown into whatever
runs: delivered at any moment of a tune (the worker starting, the model's analysis, an
estimate, a trial, validation), it ends the command with 128 + N and one line, kills every
child, removes every folder; a second signal ends it at once. `autofit train` stops between
steps with a checkpoint that `--resume` continues."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autofit.base import stopping
from autofit.base.errors import EXIT_INCOMPLETE
from conftest import start_cli, tiny_gpt_dict, write_spec

pytestmark = pytest.mark.slow


def _ours(folder: Path) -> list[int]:
    """Live processes started under `folder` (the test's TMPDIR is in their environment)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if f"TMPDIR={folder}".encode() in environ.split(b"\0") and state != "Z" and int(proc.name) != os.getpid():
            pids.append(int(proc.name))
    return pids


def _tune_spec(tmp_path: Path) -> Path:
    return write_spec(tmp_path, tiny_gpt_dict(search={"trials": 40, "warmup_steps": 1, "measure_steps": 2,
                                                      "validate_steps": 3, "frontier_points": 1}))


def _stopped_cleanly(proc: subprocess.Popen, tmp: Path, sig: int, within_s: float, *, anytime: bool = False) -> str:
    """`anytime`: a tune, which exits EXIT_INCOMPLETE (its best config so far written) where the
    stop came after a config was measured, 128 + the signal before."""
    try:
        _, err = proc.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"the command did not stop within {within_s} s of the signal")
    assert proc.returncode in ((128 + sig, EXIT_INCOMPLETE) if anytime else (128 + sig,)), err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    deadline = time.monotonic() + 10
    while (_ours(tmp) or list(tmp.glob("autofit-*"))) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _ours(tmp)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "a child outlived the stopped command"
    assert list(tmp.glob("autofit-*")) == []
    return err


@pytest.mark.parametrize("attempt", range(6))
def test_a_stop_at_any_moment_of_a_tune_ends_it_cleanly(tmp_path, attempt):
    """SIGINT at a random moment in the tune's first seconds: worker start-up, the model's
    analysis, estimates (the user's forward on fake tensors, where an exception thrown in used
    to be swallowed), trials. Six moments, each a fresh tune."""
    spec = _tune_spec(tmp_path)
    proc, tmp = start_cli(tmp_path, "tune", spec, "--device", "cpu", "--out", tmp_path / "profiles",
                       "--state-dir", tmp_path / "state")
    time.sleep(random.Random(attempt).uniform(0.5, 6.0))
    proc.send_signal(signal.SIGINT)
    err = _stopped_cleanly(proc, tmp, signal.SIGINT, within_s=60, anytime=True)
    assert err.strip().splitlines()[-1] == "autofit: stopped by SIGINT"


@pytest.mark.timing
def test_a_second_signal_ends_the_command_at_once(tmp_path):
    spec = _tune_spec(tmp_path)
    proc, tmp = start_cli(tmp_path, "tune", spec, "--device", "cpu", "--out", tmp_path / "profiles",
                       "--state-dir", tmp_path / "state")
    deadline = time.monotonic() + 120
    while not list(tmp.glob("autofit-trial-*")) and time.monotonic() < deadline:
        time.sleep(0.1)  # until a task runs: the first stop then waits for it to be killed
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    err = _stopped_cleanly(proc, tmp, signal.SIGTERM, within_s=15)
    assert "stopped by SIGTERM" in err.strip().splitlines()[-1]


def test_train_stops_between_steps_and_resumes(tmp_path):
    spec = write_spec(tmp_path, tiny_gpt_dict(train={"global_batch_size": 8, "steps": 100000, "seed": 0,
                                                     "checkpoint_every": 0, "log_every": 1}))
    run = tmp_path / "run"
    proc, tmp = start_cli(tmp_path, "train", spec, "--device", "cpu", "--checkpoint-dir", run, "--no-progress")
    for line in proc.stderr:  # the log says each step (log_every 1)
        if "step 3/100000" in line:
            break
    proc.send_signal(signal.SIGINT)
    err = _stopped_cleanly(proc, tmp, signal.SIGINT, within_s=60)
    assert "stopped after step" in err and (run / "checkpoint.pt").is_file()
    import torch

    saved = torch.load(run / "checkpoint.pt", weights_only=False)["step"]
    assert saved >= 3
    resumed = subprocess.run([sys.executable, "-m", "autofit", "train", str(spec), "--device", "cpu",
                              "--checkpoint-dir", str(run), "--resume", "--steps", str(saved + 2), "--no-progress"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stderr and json.loads(resumed.stdout.splitlines()[-1])["steps"] == saved + 2


@pytest.mark.timing
def test_the_flag_is_set_and_a_second_signal_forces_the_exit():
    """In process: the handler raises nothing; the second one calls the forced exit."""
    forced = []
    previous = stopping.install()
    real = stopping.force_exit
    try:
        stopping.force_exit = lambda signum: forced.append(signum)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs at the next bytecode: no exception here
        assert stopping.requested.is_set() and stopping.signum == signal.SIGTERM and forced == []
        with pytest.raises(stopping.Stopped):
            stopping.check()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert forced == [signal.SIGINT]
    finally:
        stopping.force_exit = real
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stopping.reset()



def test_a_stop_during_an_estimate_is_an_interruption_the_tune_can_catch(tmp_path):
    """A stop that lands while the resident child estimates (after a config was measured,
    the tune's best so far becomes the profile) reaches the tune as an InterruptedError, which
    `tuning._trials.predict` catches once halted; the stop flag's own `Stopped` (a KeyboardInterrupt)
    would unwind past the anytime write, to exit 143 with nothing written."""
    from autofit.base import stopping as flag
    from autofit.config.spec import load_spec
    from autofit.measure import asks
    from autofit.measure.worker import TaskOutcome

    spec = load_spec(_tune_spec(tmp_path))
    flag.requested.set()
    raised = None
    try:
        asks._answer(TaskOutcome(ended="stopped", result=None, returncode=None, log_tail="", wall_s=1.0), spec)
    except BaseException as exc:  # a KeyboardInterrupt must not end the test session: caught, then judged
        raised = exc
    finally:
        flag.reset()
    assert type(raised) is InterruptedError, repr(raised)
