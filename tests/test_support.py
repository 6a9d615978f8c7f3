"""What this host can run, decided before any trial (autofit/device/support.py)."""

import sys

from conftest import run_main, tiny_gpt_dict, write_spec


def test_8_bit_without_bitsandbytes_is_refused_before_the_search(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed: its import fails
    spec_path = write_spec(tmp_path, tiny_gpt_dict(search={"optimizer_bits": [32, 8]}))
    state = tmp_path / "state"
    code, out, err = run_main(capsys, "tune", spec_path, "--device", "cpu", "--out", tmp_path / "profiles",
                              "--state-dir", state)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "bitsandbytes" in err and "optimizer_bits" in err
    assert not list(tmp_path.rglob("*.db")) and not list((tmp_path / "profiles").rglob("*.yaml"))  # no study
