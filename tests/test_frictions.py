"""Small frictions a new user met (issue 36): a store of budgeted profiles answers `profiles
show NAME` with the budgets it has, `profiles list` has a budget column, `profiles export`
does not say it runs anything, the missing-reference warning is said once, and
`autofit.tune()` logs as the CLI does."""

import dataclasses
import subprocess
import sys
import textwrap
import types

from loguru import logger

from autofit.config.spec import parse_spec
from autofit.config.train_config import TrainConfig
from autofit.device.budget import Budget
from autofit.device.probe import cpu_device
from autofit.profiles.profile import device_from_info
from autofit.profiles.store import ProfileStore
from autofit.search import _finish as finish
from autofit.tuning.space import search_space
from conftest import FIXTURES, REPO, run_main, tiny_gpt_dict
from test_profile import make_profile


def budgeted_store(tmp_path):
    spec = parse_spec(tiny_gpt_dict(), source_dir=tmp_path)
    here = device_from_info(cpu_device())
    profile = make_profile(spec, TrainConfig(micro_batch_size=8), emulated=True,
                           fingerprint=f"{here.fingerprint}-budget-256_00mib", slug=f"{here.slug}-budget-256_00mib")
    ProfileStore(tmp_path / "store").save(profile)
    return tmp_path / "store"


def test_show_lists_the_budgets_a_name_has_and_list_has_a_budget_column(tmp_path, capsys):
    store = budgeted_store(tmp_path)
    code, out, err = run_main(capsys, "profiles", "show", "tiny", "--store", store)
    assert code == 2 and out == ""
    line = err.strip().splitlines()[-1]
    assert "tuned under --memory-budget 256.00MiB" in line and "profiles show tiny --memory-budget 256.00MiB" in line
    assert len(line.replace(str(store), "STORE")) < 300  # not the whole store listed
    code, out, err = run_main(capsys, "profiles", "show", "tiny", "--store", store, "--memory-budget", "256.00MiB")
    assert code == 0, err
    code, out, _ = run_main(capsys, "profiles", "list", "--store", store)
    header, row = out.splitlines()[:2]
    assert "BUDGET" in header.split() and "256.00MiB" in row.split()
    code, out, err = run_main(capsys, "profiles", "export", "tiny", "--store", store, "--memory-budget", "256.00MiB",
                              "--format", "hf")
    assert code == 0, err
    assert "running" not in err and "exporting the winner" in err


def test_the_missing_reference_warning_is_said_once(tmp_path):
    spec = parse_spec(tiny_gpt_dict(), source_dir=tmp_path)
    tuner = types.SimpleNamespace(space=search_space(spec, cpu_device()), budget=Budget(usable_bytes=1), session_start=0.0,
                                  records=lambda: [], fits=lambda records: (lambda config: False),
                                  warned_no_reference=set(), affordable_after_search=lambda config, records, reference=False: True)
    said: list[str] = []
    sink = logger.add(lambda m: said.append(str(m)), level="WARNING")
    try:
        finish.ensure_reference(tuner)  # before the contenders' race
        finish.ensure_reference(tuner)  # and after it
    finally:
        logger.remove(sink)
    assert sum("no full-precision reference" in m for m in said) == 1


def test_autofit_tune_logs_as_the_cli_does_unless_the_caller_set_up_logging():
    script = textwrap.dedent("""
        import sys
        from loguru import logger
        from autofit.base.logs import adopt_default_handler
        if sys.argv[1] == "own":
            logger.remove()
            logger.add(sys.stderr, format="OWN {message}")
        adopt_default_handler()
        logger.info("hello")
    """)
    fresh = subprocess.run([sys.executable, "-c", script, "fresh"], capture_output=True, text=True, cwd=REPO)
    assert fresh.stderr.strip().split(" ", 1)[1] == "INFO    hello", fresh.stderr  # HH:MM:SS LEVEL message
    own = subprocess.run([sys.executable, "-c", script, "own"], capture_output=True, text=True, cwd=REPO)
    assert own.stderr.strip() == "OWN hello", own.stderr
