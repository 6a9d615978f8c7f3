"""benchmarks/gpu_check.py end to end at tiny scale on the CPU (`--tiny`): the parts' plan, a
memory-bound part (hand loops under the tune's cap, the tune, the loss check, the training
run) and its resume."""

import json

import pytest

from conftest import REPO, run_cli

SCRIPT = REPO / "benchmarks/gpu_check.py"


def test_plan_lists_the_parts_in_order_of_value_and_what_fits():
    result = run_cli("--plan", "1800", script=SCRIPT)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert [row[-3] for row in rows][:3] == ["gpt2-xl", "llama-1b-gqa", "qwen2-0.5b-4k"]  # memory-bound first
    assert rows[0][0] == "fits" and rows[-1][:3] == ["does", "not", "fit"]
    bad = run_cli("--parts", "nope", script=SCRIPT)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_memory_bound_part_runs_end_to_end_on_the_cpu_and_resumes(tmp_path):
    record_path = tmp_path / "record.json"
    result = run_cli("--tiny", "--parts", "llama-1b-gqa", "--record", record_path, script=SCRIPT, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    part = json.loads(record_path.read_text())["parts"]["llama-1b-gqa"]
    assert part["done"] and part["cap_bytes"] < 16 * 2**20
    one_liner, fallback = part["hand one-liner"], part["hand fallback"]
    assert one_liner["status"] == "oom" and one_liner["tried_micro_batches"] == [16]  # its OOM, recorded
    assert fallback["status"] == "ok" and fallback["micro_batch_size"] < 16  # halved until a step fit
    assert fallback["peak_tracked_bytes"] <= part["cap_bytes"]
    assert part["tune"]["profile_path"] and part["tune_over_fallback"] is not None  # a profile written
    assert all(t["measured_bytes"] for t in part["tune"]["estimator_error_pct"])
    assert part["losses_vs_32_true"]["status"] == "ok" and part["train"]["rc"] == 0
    again = run_cli("--tiny", "--parts", "llama-1b-gqa", "--record", record_path, script=SCRIPT, timeout=300)
    assert again.returncode == 0 and "in the record already" in again.stderr
