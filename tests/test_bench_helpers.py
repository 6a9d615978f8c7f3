"""The benchmark suite's pure helpers (benchmarks/metrics.py): MFU arithmetic, the GPU peak
table, the batch-size-doubling baseline, the quick grid and the tables. No trials run."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "metrics.py"
_spec = importlib.util.spec_from_file_location("bench_metrics", _PATH)
metrics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(metrics)


# ---- MFU -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, family", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 SXM5 80GB", "H100 SXM"),
    ("NVIDIA H100 PCIe", None),
    ("NVIDIA H100 NVL", None),
    ("NVIDIA H200", "H200"),
    ("NVIDIA H200 NVL", None),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100 80GB PCIe", "A100"),
    ("NVIDIA GeForce RTX 4090", None),
    ("AMD EPYC (2 cores)", None),
])
def test_gpu_family_matches_nvml_names(name, family):
    assert metrics.gpu_family(name) == family


def test_peak_tflops_per_precision():
    assert metrics.peak_tflops("NVIDIA H100 80GB HBM3", "bf16-mixed") == 989.4
    assert metrics.peak_tflops("NVIDIA H200", "16-mixed") == 989.4
    assert metrics.peak_tflops("NVIDIA H200", "bf16-true") == 989.4
    assert metrics.peak_tflops("NVIDIA H100 80GB HBM3", "tf32") == 494.7
    assert metrics.peak_tflops("NVIDIA H100 80GB HBM3", "32-true") == 66.9
    assert metrics.peak_tflops("NVIDIA A100-SXM4-40GB", "bf16-mixed") == 312.0
    assert metrics.peak_tflops("NVIDIA A100-SXM4-40GB", "tf32") == 156.0
    assert metrics.peak_tflops("NVIDIA A100-SXM4-40GB", "32-true") == 19.5
    assert metrics.peak_tflops("AMD EPYC (2 cores)", "bf16-mixed") is None


def test_gpt2_small_flops_per_token():
    # GPT-2 small with an untied 50304-word head: 85.0M block + 38.6M head matmul parameters.
    n_layer, n_embd, vocab, seq = 12, 768, 50304, 1024
    blocks = n_layer * (12 * n_embd**2 + 13 * n_embd)  # qkv, proj, 2 MLP matrices, biases, 2 norms
    n_params = blocks + 2 * n_embd + vocab * n_embd  # final norm + head
    per_token = metrics.gpt_flops_per_token(n_params=n_params, n_layer=n_layer, n_embd=n_embd, seq_len=seq)
    assert per_token == 6 * n_params + 12 * 12 * 768 * 1024
    assert 0.85e9 < per_token < 0.87e9  # the ~0.86 GFLOP/token usually quoted (with attention)


def test_mfu_on_a_known_gpu_and_on_an_unknown_one():
    r = metrics.mfu(tokens_per_s=500_000, flops_per_token=10**9, device_name="NVIDIA H100 80GB HBM3",
                    precision="bf16-mixed")
    assert r["achieved_tflops"] == pytest.approx(500.0)
    assert r["peak_tflops"] == 989.4
    assert r["mfu"] == pytest.approx(500.0 / 989.4)
    cpu = metrics.mfu(tokens_per_s=1000, flops_per_token=10**9, device_name="AMD EPYC (2 cores)",
                      precision="32-true")
    assert cpu["achieved_tflops"] == pytest.approx(1.0)
    assert cpu["peak_tflops"] is None and cpu["mfu"] is None
    assert metrics.mfu(tokens_per_s=None, flops_per_token=1, device_name="NVIDIA H200",
                       precision="bf16-mixed")["mfu"] is None
    assert metrics.mfu_rows({"gpt": {"grid best": cpu}})[0][-2:] == ["unknown", "unknown"]


# ---- the doubling baseline -----------------------------------------------------------------


def _fits_up_to(limit: int, calls: list):
    def fits(micro: int) -> bool:
        calls.append(micro)
        return micro <= limit
    return fits


def test_doubling_stops_at_the_first_failure_and_keeps_the_last_fit():
    calls = []
    best, tried = metrics.doubling_search([1, 2, 4, 8, 16, 32, 64], _fits_up_to(12, calls))
    assert best == 8
    assert tried == [(1, True), (2, True), (4, True), (8, True), (16, False)]
    assert calls == [1, 2, 4, 8, 16]  # nothing after the first failure is measured


def test_doubling_uses_only_divisors_of_the_global_batch():
    # global batch 48: after 16 the next size at least twice as large is 48 itself (32 does not divide).
    sizes = [m for m in range(1, 49) if 48 % m == 0]
    best, tried = metrics.doubling_search(sizes, _fits_up_to(48, []))
    assert [m for m, _ in tried] == [1, 2, 4, 8, 16, 48]
    assert best == 48
    # global batch 12: 1, 2, 4, then 12 (8 does not divide; 6 is not twice 4).
    best, tried = metrics.doubling_search([1, 2, 3, 4, 6, 12], _fits_up_to(6, []))
    assert [m for m, _ in tried] == [1, 2, 4, 12] and best == 4


def test_doubling_when_nothing_fits_and_when_everything_fits():
    assert metrics.doubling_search([1, 2, 4], _fits_up_to(0, [])) == (None, [(1, False)])
    assert metrics.doubling_search([4, 1, 2], _fits_up_to(99, []))[0] == 4  # order of `sizes` does not matter


# ---- grid, budget, estimator ---------------------------------------------------------------


def test_quick_grid_is_the_documented_corner():
    points = metrics.quick_grid_points(precisions=("32-true", "16-mixed", "bf16-mixed", "bf16-true"),
                                       micro_batch_sizes=(1, 2, 4, 8, 16, 32, 64), global_batch_size=64,
                                       max_checkpoint_blocks=12)
    assert sorted(points) == sorted((p, m, c) for p in ("32-true", "bf16-mixed") for m in (64, 16) for c in (0, 12))
    # No bf16 (a V100): 32-true alone; a model without blocks: no checkpointing axis.
    assert metrics.quick_grid_points(precisions=("32-true", "16-mixed"), micro_batch_sizes=(1, 2, 3, 6),
                                     global_batch_size=6, max_checkpoint_blocks=0) == [
        ("32-true", 6, 0), ("32-true", 1, 0)]


def test_measurement_order_and_implied_ooms():
    points = [("32-true", m, c, 0) for m in (8, 2) for c in (0, 2)]
    ordered = metrics.measurement_order(points)
    assert ordered == [("32-true", 2, 2, 0), ("32-true", 2, 0, 0), ("32-true", 8, 2, 0), ("32-true", 8, 0, 0)]
    failed = [("32-true", 2, 0, 0)]
    assert metrics.implied_oom(("32-true", 8, 0, 0), failed)  # larger micro batch, same checkpointing
    assert not metrics.implied_oom(("32-true", 8, 2, 0), failed)  # more checkpointing may fit
    assert not metrics.implied_oom(("bf16-mixed", 8, 0, 0), failed)  # another precision


def test_auto_budget_and_estimator_errors():
    assert metrics.auto_budget_bytes(1000) == 600
    assert metrics.relative_error(110, 100) == pytest.approx(0.10)
    assert metrics.relative_error(None, 100) is None
    stats = metrics.error_stats([0.01, -0.02, 0.30, None])
    assert stats == {"n": 3, "median_abs": pytest.approx(0.02), "worst": pytest.approx(0.30)}
    assert metrics.error_stats([])["median_abs"] is None


def test_summary_table_shows_ratios_and_why_a_baseline_has_none():
    model = {
        "grid_summary": {"feasible": 5, "configs": 8, "subset": True, "wall_s": 100.0,
                         "best": {"config": "bf16-mixed mb=16x4", "samples_per_s": 200.0}},
        "tune": {"winner": "bf16-mixed mb=16x4", "winner_samples_per_s": 198.0, "validated_samples_per_s": 199.0,
                 "throughput_vs_grid_best": 0.99, "wall_vs_grid_wall": 0.25, "oom": 1, "pruned": 3,
                 "winner_grid_rank": "#1 of 5", "wall_s": 25.0},
        "baselines": {"plain_32_true": {"fits": False, "reason": "needs 90 GiB > budget 75 GiB"},
                      "doubling_32_true": {"fits": True, "samples_per_s": 99.0, "micro_batch_size": 16},
                      "doubling_bf16_mixed": {"unsupported": True, "fits": False}},
        "estimator": {"median_abs": 0.031, "worst": -0.12},
        "budget": {"text": "75.00 GiB"},
    }
    table = metrics.markdown_table(metrics.SUMMARY_HEADER, metrics.summary_rows({"gpt-small": model}))
    row = table.splitlines()[2]
    assert "| 5/8 (quick subset) | 0.99 | 0.25 |" in row
    assert "doesn't fit (needs 90 GiB > budget 75 GiB)" in row
    assert "2.00x (mb=16)" in row and "n/a (precision unsupported)" in row
    assert "3.1% / -12.0%" in row and "1 (3 pruned)" in row
    assert metrics.summary_rows({"x": {"error": "boom"}})[0][1] == "failed: boom"
    assert "#1 of 5" in metrics.detail_rows({"gpt-small": model})[0]


def test_results_md_sections_are_replaced_in_place():
    text = "# Benchmark results\n\nintro\n"
    once = metrics.replace_section(text, "cpu-quick", "table v1\n")
    assert once.startswith(text) and "<!-- results:cpu-quick -->\ntable v1\n<!-- /results:cpu-quick -->" in once
    both = metrics.replace_section(once, "nvidia-h200-quick", "gpu table\n")
    again = metrics.replace_section(both, "cpu-quick", "table v2\n")
    assert "table v1" not in again and again.count("table v2") == 1
    assert again.index("table v2") < again.index("gpu table")  # the section keeps its place


def test_repeat_noise_compares_configs_measured_twice():
    a, b = {"precision": "32-true", "micro_batch_size": 2}, {"precision": "bf16-mixed", "micro_batch_size": 2}
    grid = [{"config": a, "status": "ok", "samples_per_s": 100.0}, {"config": b, "status": "ok", "samples_per_s": 50.0}]
    tune = [{"config": a, "status": "ok", "samples_per_s": 110.0}, {"config": b, "status": "oom", "samples_per_s": 0},
            {"config": {"precision": "32-true", "micro_batch_size": 4}, "status": "ok", "samples_per_s": 1.0}]
    assert metrics.repeat_noise(grid, tune) == {"n": 1, "median": pytest.approx(0.1), "max": pytest.approx(0.1)}
    assert metrics.repeat_noise([], tune)["median"] is None


# ---- with and without the new knobs (benchmarks/knobs_bench.py) -------------------------------


def _knobs_bench():
    path = _PATH.with_name("knobs_bench.py")
    spec = importlib.util.spec_from_file_location("bench_knobs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_knobs_bench_adds_what_the_model_can_use_and_says_why_not_the_rest():
    from autofit.device.probe import cpu_device
    from autofit.config.spec import parse_spec
    from conftest import REPO, tiny_gpt_dict

    knobs_bench = _knobs_bench()
    convnet = tiny_gpt_dict(model={"builtin": "convnet", "args": {"in_channels": 3, "image_size": 8, "channels": 8,
                                                                  "n_blocks": 2, "n_classes": 4}})
    spec, added, skipped = knobs_bench.with_new_knobs(parse_spec(convnet, source_dir=REPO), cpu_device())
    assert added["checkpoint_policies"] == ("full", "selective") and added["compile"] == (False, True)
    assert spec.search.compile == (False, True) and spec.search.checkpoint_policies == ("full", "selective")
    assert "language-model" in skipped["chunked_loss"]  # a classifier has no LM head to chunk


def test_knobs_bench_table_compares_the_head_to_head_medians():
    knobs_bench = _knobs_bench()
    tune = {"winner": "32-true mb=2x4 ckpt=0 freeze=0", "validated_samples_per_s": 100.0, "compile_s": None,
            "measured": 6, "statuses": {"ok": 5, "oom": 1}, "noise": 0.05,
            "head_to_head_samples_per_s": [90.0, 100.0, 110.0]}
    compiled = dict(tune, winner="32-true mb=2x4 ckpt=0 freeze=0 compiled", compile_s=12.0,
                    head_to_head_samples_per_s=[140.0, 150.0, 160.0])
    report = {"device": {"name": "cpu"}, "torch": "2.13", "date": "2026-11-23T16:00:00+00:00", "cpu_count": 2,
              "load_average": {"start": [4.0], "end": [5.0]}, "command": "python benchmarks/suite.py --knobs",
              "json_path": "benchmarks/results/x.json",
              "models": {"m": {"budget_bytes": 6 * 2**20, "without": tune, "with": compiled, "added": {"compile": [False, True]}, "skipped": {}}}}
    table = knobs_bench.render([report])
    assert "| m (6.00 MiB) | with / without | | | 1.500 |" in table
    assert "150.0 (140–160)" in table and "| 12.0 |" in table and "6 (5 ok, 1 oom)" in table
