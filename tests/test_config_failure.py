"""A failure of the user's code that depends on the config (issue 36): a char-LSTM with no
kernel under CPU autocast (tests/fixtures/own_code.py) tunes to a profile, each autocast
precision that failed recorded as that trial's `error` with its reason in one line; only a
failure in every precision is the user's code (exit 2)."""

import pytest
import yaml

from autofit.base.errors import SpecError
from autofit.config.spec import parse_spec
from conftest import assert_tuned, FIXTURES, REPO, run_cli, write_spec

TOKENS = str(REPO / "examples" / "data" / "train.bin")
REASON = ("dropped for this model: model.python: own_code:char_lstm raised RuntimeError: could not create a "
          "primitive descriptor for the LSTM forward propagation primitive")


def lstm_spec(folder, precisions: list[str]):
    (folder / "own_code.py").write_text((FIXTURES / "own_code.py").read_text())
    return write_spec(folder, {
        "schema": 1, "name": "char-lstm", "model": {"python": "own_code:char_lstm", "args": {"vocab_size": 256}},
        "data": {"kind": "tokens", "path": TOKENS, "seq_len": 16},
        "train": {"global_batch_size": 4, "steps": 3},
        "search": {"precisions": precisions, "trials": 3, "patience": 3, "warmup_steps": 1, "measure_steps": 1,
                   "validate_steps": 2, "frontier_points": 1}})


def test_a_precision_the_model_cannot_run_is_dropped_and_the_tune_goes_on(tmp_path):
    # No 32-true: on a CPU with no bf16 unit (this one) no bf16 config is tried once 32-true ran.
    spec = lstm_spec(tmp_path, ["bf16-true", "bf16-mixed"])
    result = run_cli("tune", spec, "--out", tmp_path / "profiles", "--state-dir", tmp_path / "state",
                     "--memory-budget", "256MiB", "--no-report", cwd=tmp_path)
    assert_tuned(result)
    assert result.stderr.count("bf16-mixed " + REASON) == 1  # said once, in one line
    lines = [line for line in result.stderr.splitlines() if REASON in line]
    assert len(lines) == 1 and " error " in lines[0]
    [path] = (tmp_path / "profiles").glob("*.yaml")
    assert yaml.safe_load(path.read_text())["config"]["precision"] == "bf16-true"


def test_a_failure_in_every_precision_is_the_users_code(tmp_path):
    spec = lstm_spec(tmp_path, ["16-mixed", "bf16-mixed"])
    result = run_cli("tune", spec, "--out", tmp_path / "profiles", "--state-dir", tmp_path / "state",
                     "--memory-budget", "256MiB", "--no-report", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        "autofit: error: model.python: own_code:char_lstm raised RuntimeError: could not create a primitive")


def test_a_typo_of_a_required_key_gets_its_did_you_mean():
    raw = {"schema": 1, "name": "x", "model": {"builtin": "mlp"}, "train": {"global_batchsize": 8}}
    with pytest.raises(SpecError, match=r"^train\.global_batch_size: required key is missing; did you mean "
                                        r"global_batch_size \(the file has global_batchsize\)\?$"):
        parse_spec(raw, source_dir=FIXTURES)
