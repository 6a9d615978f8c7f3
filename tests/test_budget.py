"""The budget as one value (`autofit.device.budget`), parsed once at the edge."""

import ast
import dataclasses
from pathlib import Path

import pytest
from conftest import tiny_gpt_dict, write_spec

from autofit.base.errors import SpecError
from autofit.commands import tune as tune_module
from autofit.device.budget import Budget, budget_for
from autofit.device.probe import cpu_device

GiB = 2**30
ROOT = Path(__file__).resolve().parents[1]


def card(total_bytes: int, used_by_others_bytes: int = 0):
    return dataclasses.replace(cpu_device(), memory_total_bytes=total_bytes,
                               memory_used_by_others_bytes=used_by_others_bytes)


def test_a_request_is_an_emulated_card_less_headroom():
    budget = budget_for(card(8 * GiB), "2GiB", headroom=0.5, time_s=60.0)
    assert budget == Budget(usable_bytes=GiB, requested_bytes=2 * GiB, time_s=60.0)
    assert budget.emulated


def test_no_request_is_the_device_less_other_processes():
    budget = budget_for(card(8 * GiB, used_by_others_bytes=2 * GiB), None, headroom=0.0)
    assert budget == Budget(usable_bytes=6 * GiB) and not budget.emulated
    assert budget_for(card(8 * GiB), "0.5", headroom=0.0).requested_bytes == 4 * GiB


def test_a_request_above_the_device_is_one_error_naming_the_option():
    with pytest.raises(SpecError, match="^--memory-budget: 9GiB is more than this device's 8.00 GiB"):
        budget_for(card(8 * GiB), "9GiB", headroom=0.0)


def test_tune_hands_one_setup_with_one_budget_to_the_pipeline(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(tune_module, "tune", lambda setup, **hooks: seen.append(setup))
    tune_module.tune_command(write_spec(tmp_path, tiny_gpt_dict()), device="cpu", memory_budget="64MiB",
                             timeout_s=30.0, state_dir=tmp_path / "state", out_dir=tmp_path / "profiles")
    budget = seen[0].budget
    assert budget.requested_bytes == 64 * 2**20 and budget.time_s == 30.0 and budget.usable_bytes < 64 * 2**20
    assert seen[0].storage == f"sqlite:///{(tmp_path / 'state').resolve() / 'studies.db'}"


def test_the_common_options_are_declared_once():
    declared = [node.args[0].value for node in ast.walk(ast.parse((ROOT / "autofit" / "cli.py").read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
                and node.args and isinstance(node.args[0], ast.Constant)]
    assert declared.count("--device") == 1 and declared.count("--memory-budget") == 1


def test_only_the_edge_parses_a_budget_string():
    callers = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "autofit").rglob("*.py")
                     if "parse_budget(" in path.read_text() and path.name != "sizes.py")
    # budget_for alone: a profile lookup's memory_budget, which may be above the device (another
    # machine's), goes through it too (`above_total`)
    assert callers == ["autofit/device/budget.py"]
