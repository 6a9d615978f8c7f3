"""The batch-dimension probe (autofit/workload/batch_dim.py) in two cases of issue 36: skipped
with one info line when no batch is ever split (every micro batch is the whole batch), and a
non-finite loss in it reported as such (which call, which input), exit 3 as training's."""

import shutil
import sys

import pytest

from autofit.base.errors import NonFiniteLossError, SpecError
from autofit.config.spec import parse_spec, PROBE_SKIPPED
from autofit.workload import build_workload
from autofit.workload.batch_dim import check_batch_dim
from conftest import FIXTURES, run_main, tiny_gpt_dict, write_spec

COUPLED = {"python": "byom_models:contrastive_loss", "args": {"temperature": 0.1}}  # per_sample left true


@pytest.fixture(autouse=True)
def _fixture_modules(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))


def two_tower(**search) -> dict:
    return tiny_gpt_dict(name="two-tower", model={"python": "byom_models:TwoTower"},
                         data={"kind": "python", "factory": "byom_models:pairs"}, loss=COUPLED,
                         search=search) | {"model": {"python": "byom_models:TwoTower"}}


def test_a_coupled_loss_is_probed_where_batches_are_split_and_skipped_where_none_is(tmp_path, capsys):
    with pytest.raises(SpecError, match="the samples of a micro batch are not independent"):
        check_batch_dim(build_workload(parse_spec(two_tower(), source_dir=FIXTURES)))
    whole = parse_spec(two_tower(min_micro_batch_size=8), source_dir=FIXTURES)
    assert whole.unsplit_skips_probe and not whole.probes_batch_dim
    check_batch_dim(build_workload(whole))  # nothing to refuse: no split is possible
    shutil.copy(FIXTURES / "byom_models.py", tmp_path)
    path = write_spec(tmp_path, two_tower(min_micro_batch_size=8))
    code, out, err = run_main(capsys, "train", path, "--steps", "2", "--no-progress", "--checkpoint-dir",
                              tmp_path / "run")
    assert code == 0, err
    skipped = PROBE_SKIPPED.format(8, 8)
    assert err.count(skipped) == 1


def test_a_nan_in_the_probe_is_a_non_finite_loss_not_coupling(tmp_path, capsys):
    raw = tiny_gpt_dict(name="nan-third", data={"kind": "python", "factory": "faulty:dataset"}) | {
        "model": {"python": "own_code:NanOnThirdCall"}}
    with pytest.raises(NonFiniteLossError, match=r"^model: the loss is nan on call 3 of 3 of the batch-dimension "
                                                 r"probe, on its samples 1-2 ") as raised:
        check_batch_dim(build_workload(parse_spec(raw, source_dir=FIXTURES)))
    assert raised.value.exit_code == 3
    for name in ("own_code.py", "faulty.py"):
        shutil.copy(FIXTURES / name, tmp_path)
    path = write_spec(tmp_path, raw)
    code, out, err = run_main(capsys, "tune", path, "--out", tmp_path / "profiles", "--state-dir",
                              tmp_path / "state", "--no-report")
    assert code == 3, err
    assert err.strip().splitlines()[-1].startswith("autofit: error: model: the loss is nan on call 3 of 3")
