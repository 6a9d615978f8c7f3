"""Shared fixtures: tiny specs written to tmp folders, and a CLI runner; and the session's
own check that nothing of ours outlives it (no `autofit-trial-*` folder, no process)."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"

TINY_GPT_ARGS = {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 64, "seq_len": 16}


def tiny_gpt_dict(**sections) -> dict:
    """A 2-layer GPT spec as a dict; keyword arguments replace or extend sections."""
    spec = {
        "schema": 1,
        "name": "tiny",
        "model": {"builtin": "gpt", "args": dict(TINY_GPT_ARGS)},
        "data": {"kind": "synthetic"},
        "optimizer": {"name": "adamw", "lr": 1e-3},
        "train": {"global_batch_size": 8, "steps": 10, "seed": 0, "checkpoint_every": 5, "log_every": 5},
        # frontier_points 1: no extra validation runs per tune (each is a child process);
        # tests/test_frontier.py covers the frontier.
        # window_s 0: exactly measure_steps timed steps (a 2 s window per trial would slow the suite).
        # time_budget: the tests' tunes keep the 5 minutes they were written for (a spec with
        # train.steps and no budget is sized to its training: tests/test_anytime_tune.py).
        "search": {"trials": 12, "warmup_steps": 1, "measure_steps": 2, "window_s": 0, "validate_steps": 3,
                   "frontier_points": 1, "time_budget": "5min"},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


def write_spec(folder: Path, spec: dict, name: str = "model.yaml") -> Path:
    path = Path(folder) / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture
def one_thread():
    # Tiny ops on several OpenMP threads wait on each other on a small shared machine (the
    # doctor's CPU children run with OMP_NUM_THREADS=1 for the same reason).
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def cpu_without_16_bit_units(monkeypatch):
    """The tunes run in this process price a CPU's 16-bit trials as on the machine the tests
    were written on (AVX2, no bf16 or fp16 unit: `_timing.CPU_16_BIT_SLOWDOWN`), whatever this
    host's flags say: a CI runner with `avx512_bf16` would price them otherwise."""
    monkeypatch.setattr("autofit.tuning._prepare.cpu_16_bit_units", lambda: frozenset())


@pytest.fixture
def tiny_spec_path(tmp_path) -> Path:
    return write_spec(tmp_path, tiny_gpt_dict())


TEST_TIME_BUDGET = "6h"


def run_cli(*args: str, cwd: Path | None = None, timeout: float | None = None, env: dict | None = None,
            script: Path | None = None):
    """Run `python -m autofit ARGS` as a user would (or `python SCRIPT ARGS`, a fixture that
    runs autofit with a seam set); returns the CompletedProcess."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if args and args[0] == "tune" and "--time-budget" not in args and "--help" not in args:
        # A tune's default time budget (5 min) is a wall clock that a loaded test host can
        # spend before validating: the tests of the budget give their own.
        args = (*args, "--time-budget", TEST_TIME_BUDGET)
    if timeout is None:
        # A hang guard. A real tune on a loaded 2-core host (CI) may re-measure and pair its
        # leaders for several minutes: its figures decide how many runs it takes.
        timeout = 900 if args and args[0] == "tune" else 300
    program = [str(script)] if script else ["-m", "autofit"]
    return subprocess.run([sys.executable, *program, *map(str, args)], cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout, env=full_env)


# `autofit tune` wrote its profile: 0, or 4 where the host was too busy for the speed-up to be
# measured (autofit/tuning/speedup.py). On a loaded test machine either is right.
TUNED = (0, 4)


def assert_tuned(result) -> None:
    assert result.returncode in TUNED, result.stderr[-4000:]


def start_cli(tmp_path: Path, *args) -> tuple[subprocess.Popen, Path]:
    """`autofit ARGS` started (not waited for) with a TMPDIR of its own, so its children's
    folders and processes are known: (the process, that TMPDIR)."""
    tmp = Path(tmp_path) / "tmp"
    tmp.mkdir(exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "autofit", *map(str, args)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"})
    return proc, tmp


def alive(pid: int) -> bool:
    """The process runs (a zombie, exited but not reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def run_cli_json(*args: str, **kwargs) -> dict:
    result = run_cli(*args, **kwargs)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture
def journal():
    """`journal(debug=False)` sends the log, as `autofit serve` writes it, into a buffer it
    returns; loguru's default handler is put back after the test."""
    import io

    from loguru import logger

    from autofit.base import logs

    buffer = io.StringIO()

    def setup(*, debug: bool = False) -> io.StringIO:
        logs.configure("INFO", debug=debug, one_line=True, sink=buffer)
        return buffer

    yield setup
    logger.remove()
    logger.add(sys.stderr)


FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture
def read_only():
    """`read_only(folder)`: a folder this process can no longer create, rename or remove files
    in, as a read-only mount would be, undone after the test. An ordinary user gets mode
    0555; root ignores modes, so it gets the immutable flag (`chattr +i`: ext4, xfs, btrfs).
    Skips where neither holds."""
    undo = []

    def make(folder: Path) -> Path:
        folder = Path(folder)
        if os.geteuid() != 0:
            folder.chmod(0o555)
            undo.append(lambda: folder.chmod(0o755))
        elif shutil.which("chattr") and subprocess.run(["chattr", "+i", str(folder)],
                                                       capture_output=True).returncode == 0:
            undo.append(lambda: subprocess.run(["chattr", "-i", str(folder)], capture_output=True))
        else:
            pytest.skip("cannot make a folder read-only here (root, and no chattr +i on this file system)")
        try:
            (folder / ".probe").write_text("x")
        except OSError:
            return folder
        (folder / ".probe").unlink()
        pytest.skip(f"{folder} is still writable after making it read-only")

    yield make
    for step in reversed(undo):
        step()


def faulty_spec(folder: Path, fault: str) -> Path:
    """A spec whose `python:` model misbehaves (tests/fixtures/faulty.py: crash, hang, nan,
    item), written to `folder` with the fixture module beside it."""
    import shutil

    shutil.copy(FIXTURES / "faulty.py", Path(folder) / "faulty.py")
    spec = tiny_gpt_dict(name=f"faulty-{fault}", data={"kind": "python", "factory": "faulty:dataset"})
    # batch_dim declared: no batch-dimension probe runs the model before the trials these
    # tests are about (it would meet the same crash or hang first).
    spec["model"] = {"python": f"faulty:{fault}", "batch_dim": 0}
    return write_spec(folder, spec)


def run_main(capsys, *args) -> tuple[int, str, str]:
    """`autofit ARGS` in this process (no interpreter start-up): (exit code, stdout, stderr)."""
    from autofit.cli import main

    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:  # argparse's own exits
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


# ---- nothing left behind -------------------------------------------------------------------
# The session gets a temp folder of its own (TMPDIR, inherited by every child), so the check
# sees only what this run left, however many other runs share the machine; and a marker in
# the environment, which every process started from the tests inherits, even one orphaned.

_SESSION_MARKER = "AUTOFIT_TEST_SESSION"
_LEFT_BEHIND_WAIT_S = 10.0  # a killed child may take a moment to go


def pytest_configure(config):
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker is not None and _SESSION_MARKER in os.environ:
        # An xdist worker (`-n 2`, pyproject's addopts) gets a TMPDIR of its own inside the
        # session's: a test that compares the trial folders before and after it sees its own
        # worker's alone, and the session's check below still finds whatever either left.
        folder = Path(os.environ[_SESSION_MARKER]) / worker
        folder.mkdir(exist_ok=True)
        os.environ["TMPDIR"] = str(folder)
        tempfile.tempdir = None
        return
    if _SESSION_MARKER in os.environ:
        return
    folder = tempfile.mkdtemp(prefix="autofit-tests-")
    os.environ["TMPDIR"] = folder
    os.environ[_SESSION_MARKER] = folder
    tempfile.tempdir = None  # recomputed from TMPDIR
    config._autofit_session_tmp = folder
    config._autofit_hogs = _start_cpu_hogs(config.getoption("cpu_hogs"))


# ---- a busy host ------------------------------------------------------------------------------
# `--cpu-hogs N` runs N CPU-burning processes beside the tests (as .ci/run does for the files
# marked `timing`): a test that passes only on an idle machine fails there, not in a user's CI.
# Each hog polls its parent, so one outlives no pytest, however it ended.

_HOG = "import os, sys\nwhile os.getppid() == int(sys.argv[1]):\n    sum(range(100_000))\n"


def pytest_addoption(parser):
    parser.addoption("--cpu-hogs", type=int, default=0, metavar="N",
                     help="run N CPU-burning processes beside the tests (a busy host)")


def pytest_report_header(config):
    count = config.getoption("cpu_hogs")
    return f"{count} CPU-burning processes beside the tests" if count else None


def _start_cpu_hogs(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", _HOG, str(os.getpid())], stdin=subprocess.DEVNULL)
            for _ in range(count)]


def _stop_cpu_hogs(config) -> None:
    for hog in getattr(config, "_autofit_hogs", []):
        hog.kill()
        hog.wait()


def _our_processes(marker: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"{_SESSION_MARKER}={marker}".encode() in environ.split(b"\0") and state != "Z":
            found.append(f"pid {proc.name}: {cmdline[:120]}")
    return found


def left_behind(folder: str, wait_s: float = _LEFT_BEHIND_WAIT_S) -> list[str]:
    """Trial, worker and doctor folders and processes this test session left; empty when clean."""
    deadline = time.monotonic() + wait_s
    while True:
        folders = sorted(str(p.relative_to(folder)) for prefix in ("autofit-trial-*", "autofit-worker-*",
                                                                   "autofit-doctor-*")
                         for where in ("", "gw*/") for p in Path(folder).glob(where + prefix))
        processes = _our_processes(folder) if Path("/proc/self/environ").exists() else []
        if not (folders or processes) or time.monotonic() > deadline:
            return [f"folder {folder}/{name}" for name in folders] + processes
        time.sleep(0.5)


def pytest_sessionfinish(session, exitstatus):
    _stop_cpu_hogs(session.config)
    folder = getattr(session.config, "_autofit_session_tmp", None)
    if folder is None:
        return
    left = left_behind(folder)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = "the test session left behind:\n  " + "\n  ".join(left)
        if reporter is not None:
            reporter.write_line(message, red=True)
        else:
            print(message, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    else:
        shutil.rmtree(folder, ignore_errors=True)
