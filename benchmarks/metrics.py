"""Pure helpers of the benchmark suite: no torch, no child processes, no clock.

MFU arithmetic and the GPU peak table, the batch-size-doubling baseline given any `fits`
function, the quick grid's subset rule, the memory-budget rule, estimator error statistics,
the markdown tables and RESULTS.md's per-device sections. `tests/test_bench_helpers.py`
covers them in well under a second.
"""

import json
import math
import statistics
from collections.abc import Callable, Iterable, Sequence

# Dense (no 2:4 sparsity) peak TFLOP/s from NVIDIA's data sheets, per precision family.
# Only SXM H100 and H200 are listed: the PCIe and NVL parts run lower clocks and power.
PEAK_TFLOPS = {
    "H100 SXM": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
}
# Which tensor-core family a precision's matmuls run on.
PRECISION_FAMILY = {"32-true": "fp32", "tf32": "tf32", "16-mixed": "fp16", "bf16-mixed": "bf16",
                    "bf16-true": "bf16"}

# --quick measures this corner of the search space (see quick_grid).
QUICK_PRECISIONS = ("32-true", "bf16-mixed")
# --memory-budget auto on a CPU: this share of the predicted peak of the plain-PyTorch
# config (32-true, micro batch = global batch), so the default config does not fit and
# the search has something to decide.
AUTO_BUDGET_FRACTION = 0.6


# ---- MFU -----------------------------------------------------------------------------------


def gpu_family(device_name: str) -> str | None:
    """The PEAK_TFLOPS row of an NVML device name, or None when it is not in the table.

    `NVIDIA H100 80GB HBM3` is the SXM part (the PCIe card has HBM2e, the NVL card says NVL).
    """
    name = device_name.upper()
    if "NVL" in name:
        return None
    if "H200" in name:
        return "H200"
    if "H100" in name and ("SXM" in name or "HBM3" in name):
        return "H100 SXM"
    if "A100" in name:
        return "A100"
    return None


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Peak dense TFLOP/s of `device_name` for the matmuls of `precision`; None: unknown
    (any device not in PEAK_TFLOPS, the CPU included)."""
    family = gpu_family(device_name)
    if family is None or precision not in PRECISION_FAMILY:
        return None
    return PEAK_TFLOPS[family][PRECISION_FAMILY[precision]]


def gpt_flops_per_token(*, n_params: int, n_layer: int, n_embd: int, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), as nanoGPT and the PaLM paper count
    them: 6 per matmul parameter, plus 12 * layers * width * sequence for the attention
    scores and their weighted sum. `n_params` leaves out embedding tables (lookups, not
    matmuls); recomputation by activation checkpointing is not model FLOPs and not counted."""
    return 6 * n_params + 12 * n_layer * n_embd * seq_len


def mfu(*, tokens_per_s: float | None, flops_per_token: int, device_name: str, precision: str) -> dict:
    """Achieved model FLOP/s and their share of the device's peak for `precision`."""
    achieved = None if tokens_per_s is None else tokens_per_s * flops_per_token
    peak = peak_tflops(device_name, precision)
    return {
        "precision": precision,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token,
        "achieved_tflops": None if achieved is None else achieved / 1e12,
        "peak_tflops": peak,
        "mfu": None if achieved is None or peak is None else achieved / (peak * 1e12),
    }


# ---- baselines -----------------------------------------------------------------------------


def doubling_search(sizes: Sequence[int], fits: Callable[[int], bool]) -> tuple[int | None, list[tuple[int, bool]]]:
    """Lightning's batch-size finder ("power" mode) restricted to divisors of the global batch:
    start at the smallest size, double while the trial fits, keep the last one that did.

    `sizes` are the allowed micro batch sizes, ascending. After a size that fits, the next one
    tried is the smallest allowed size at least twice as large. Returns (the last size that
    fit or None, every (size, fitted) tried in order)."""
    sizes = sorted(sizes)
    tried: list[tuple[int, bool]] = []
    best = None
    candidate = sizes[0] if sizes else None
    while candidate is not None:
        ok = bool(fits(candidate))
        tried.append((candidate, ok))
        if not ok:
            break
        best = candidate
        candidate = next((s for s in sizes if s >= 2 * candidate), None)
    return best, tried


# ---- the grid and the budget ---------------------------------------------------------------


def quick_micro_batch_sizes(global_batch_size: int, allowed: Sequence[int]) -> list[int]:
    """The global batch and a quarter of it (the largest allowed size at most a quarter)."""
    quarter = max((s for s in allowed if s <= global_batch_size // 4), default=min(allowed))
    return sorted({global_batch_size, quarter}, reverse=True)


def quick_grid_points(*, precisions: Sequence[str], micro_batch_sizes: Sequence[int], global_batch_size: int,
                      max_checkpoint_blocks: int) -> list[tuple[str, int, int]]:
    """(precision, micro batch, checkpointed blocks) of the --quick grid: precisions
    {32-true, bf16-mixed} (those the space has; else its first), micro batch {global,
    global/4}, checkpointing {none, every block}, no freezing."""
    chosen = [p for p in precisions if p in QUICK_PRECISIONS] or list(precisions[:1])
    micros = quick_micro_batch_sizes(global_batch_size, micro_batch_sizes)
    blocks = sorted({0, max_checkpoint_blocks})
    return [(p, m, c) for p in chosen for m in micros for c in blocks]


def measurement_order(points: Iterable[tuple[str, int, int, int]]) -> list[tuple[str, int, int, int]]:
    """Grid order: per precision, micro batch ascending and checkpointing descending, so
    the smallest-memory configs run first and an out-of-memory result can imply others."""
    return sorted(points, key=lambda p: (p[0], p[1], -p[2], -p[3]))


def implied_oom(point: tuple[str, int, int, int], failed: Iterable[tuple[str, int, int, int]]) -> bool:
    """A config needs at least the memory of one that ran out of memory when it has the same
    precision, a micro batch as large, and no more checkpointed or frozen blocks."""
    p, m, c, f = point
    return any(p == fp and m >= fm and c <= fc and f <= ff for fp, fm, fc, ff in failed)


def auto_budget_bytes(predicted_plain_peak_bytes: int, fraction: float = AUTO_BUDGET_FRACTION) -> int:
    """The CPU budget rule: `fraction` of the predicted peak of 32-true at micro batch =
    global batch."""
    assert 0 < fraction <= 1, fraction
    return int(predicted_plain_peak_bytes * fraction)


# ---- estimator accuracy --------------------------------------------------------------------


def relative_error(predicted: int | None, measured: int | None) -> float | None:
    """(predicted - measured) / measured: positive when the estimator over-predicts."""
    if not predicted or not measured:
        return None
    return (predicted - measured) / measured


def error_stats(errors: Iterable[float | None]) -> dict:
    """Median absolute error and the worst error (signed) over the configs that have one."""
    values = [e for e in errors if e is not None and math.isfinite(e)]
    if not values:
        return {"n": 0, "median_abs": None, "worst": None}
    return {"n": len(values), "median_abs": statistics.median(abs(e) for e in values),
            "worst": max(values, key=abs)}


def repeat_noise(grid_entries: Iterable[dict], tune_records: Iterable[dict]) -> dict:
    """How much a measurement moves when it is repeated: |tune's / the grid's samples/s - 1|
    over the configs both measured ok. A ratio closer to 1 than this is a tie."""
    grid = {tuple(sorted(e["config"].items())): e["samples_per_s"] for e in grid_entries
            if e.get("status") == "ok" and e.get("samples_per_s")}
    diffs = [abs(r["samples_per_s"] / grid[key] - 1) for r in tune_records
             if r.get("status") == "ok" and r.get("samples_per_s")
             and (key := tuple(sorted(r["config"].items()))) in grid]
    return {"n": len(diffs), "median": statistics.median(diffs) if diffs else None,
            "max": max(diffs) if diffs else None}


# ---- formatting ----------------------------------------------------------------------------


def fmt_ratio(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def fmt_pct(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.1%}" if signed else f"{value:.1%}"


def fmt_speedup(tuned: float | None, baseline: dict | None) -> str:
    """`1.83x (32-true mb=16x4)`, or why there is no ratio."""
    if baseline is None:
        return "-"
    if baseline.get("unsupported"):
        return "n/a (precision unsupported)"
    if not baseline.get("fits"):
        return f"doesn't fit ({baseline.get('reason') or 'over budget'})"
    rate = baseline.get("samples_per_s")
    if not tuned or not rate:
        return "-"
    return f"{tuned / rate:.2f}x (mb={baseline['micro_batch_size']})"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def summary_rows(models: dict) -> list[list[str]]:
    """One row per model of the main table, from the suite's per-model result dicts."""
    rows = []
    for name, m in models.items():
        if m.get("error"):
            rows.append([name, f"failed: {m['error']}"] + ["-"] * 8)
            continue
        grid, tune, base, est = m["grid_summary"], m["tune"], m["baselines"], m["estimator"]
        tuned = tune.get("winner_samples_per_s")
        rows.append([
            name,
            f"{grid['feasible']}/{grid['configs']}" + (" (quick subset)" if grid.get("subset") else ""),
            fmt_ratio(tune.get("throughput_vs_grid_best")),
            fmt_ratio(tune.get("wall_vs_grid_wall")),
            fmt_speedup(tuned, base.get("plain_32_true")),
            fmt_speedup(tuned, base.get("doubling_32_true")),
            fmt_speedup(tuned, base.get("doubling_bf16_mixed")),
            f"{fmt_pct(est['median_abs'])} / {fmt_pct(est['worst'], signed=True)}",
            f"{tune.get('oom', '-')} ({tune.get('pruned', '-')} pruned)",
        ])
    return rows


SUMMARY_HEADER = ("model", "grid fits/configs", "tune / grid best (>= 0.98)", "tune wall / grid wall (<= 0.3)",
                  "vs 32-true full batch", "vs 32-true doubling", "vs bf16-mixed doubling",
                  "estimator median / worst", "OOMs while tuning")


def detail_rows(models: dict) -> list[list[str]]:
    rows = []
    for name, m in models.items():
        if m.get("error"):
            continue
        best, tune = m["grid_summary"].get("best"), m["tune"]
        noise = repeat_noise(m.get("grid", []), tune.get("records", []))
        rows.append([
            name,
            "-" if best is None else f"{best['config']} @ {best['samples_per_s']:.4g}/s",
            "-" if not tune.get("winner") else f"{tune['winner']} @ {tune['winner_samples_per_s']:.4g}/s",
            "-" if tune.get("validated_samples_per_s") is None else f"{tune['validated_samples_per_s']:.4g}/s",
            tune.get("winner_grid_rank") or "-",
            "-" if not noise["n"] else f"{noise['median']:.0%} / {noise['max']:.0%} ({noise['n']})",
            f"{m['grid_summary']['wall_s']:.0f} s",
            "-" if tune.get("wall_s") is None else f"{tune['wall_s']:.0f} s",
            m["budget"]["text"],
        ])
    return rows


DETAIL_HEADER = ("model", "grid best", "tune winner (search trial)", "tune validated", "winner's grid rank",
                 "repeat noise median / max (n)", "grid wall", "tune wall", "budget")


def mfu_rows(mfu_results: dict) -> list[list[str]]:
    rows = []
    for name, entries in mfu_results.items():
        for which, e in entries.items():
            rows.append([name, which, e["precision"],
                         "-" if e["achieved_tflops"] is None else f"{e['achieved_tflops']:.4g}",
                         "unknown" if e["peak_tflops"] is None else f"{e['peak_tflops']:g}",
                         "unknown" if e["mfu"] is None else f"{e['mfu']:.1%}"])
    return rows


MFU_HEADER = ("model", "config", "precision", "achieved TFLOP/s", "peak TFLOP/s", "MFU")


# ---- RESULTS.md -----------------------------------------------------------------------------


def render_markdown(reports: list[dict]) -> str:
    """The RESULTS.md section of one device: one run, or several runs of model subsets
    (a GPU's 10-minute sittings) merged into one table."""
    report = reports[0]
    dev = report["device"]
    cpu = dev["kind"] == "cpu"
    models = {name: m for r in reports for name, m in r["models"].items()}
    mfu = {name: m for r in reports for name, m in r.get("mfu", {}).items()}
    overhead = next((r["runner_overhead"] for r in reports if r.get("runner_overhead")), None)
    note = " — CPU numbers: a check of the pipeline, not GPU performance" if cpu else ""
    wall_s = sum(r["wall_s"] for r in reports)
    sittings = sum(r.get("sittings", 1) for r in reports)
    lines = [
        f"### {dev['name']}{note}",
        "",
        f"- date: {', '.join(sorted({r['date'] for r in reports}))}; mode: "
        f"{'quick' if report['quick'] else 'full grid'}{' with the tiny CPU specs' if report['tiny'] else ''}; "
        f"suite wall time {wall_s / 60:.1f} min{f' over {sittings} sittings' if sittings > 1 else ''}",
        *(f"- command: `{r['command']}`" for r in reports),
        f"- torch {report['torch']}, driver {report['driver'] or '-'}, CUDA {report['cuda'] or '-'}, "
        f"autofit {report['autofit']} ({report['git'] or 'unknown revision'}), Python {report['python']}",
    ]
    if cpu:
        lines.append(f"- torch threads per trial: {report['cpu_threads'] or 'torch default'}; load average at start "
                     f"{report['load_average']['start']}, at end {report['load_average']['end']} (a shared machine)")
    budgets = sorted({m["budget"]["rule"] for m in models.values() if not m.get("error")})
    if budgets:
        lines.append(f"- memory budget: {'; '.join(budgets)}; less the spec's headroom (5%)")
    lines += ["", markdown_table(SUMMARY_HEADER, summary_rows(models)), "",
              markdown_table(DETAIL_HEADER, detail_rows(models)), ""]
    if overhead and not overhead.get("error"):
        lines.append(f"Runner overhead ({overhead['spec']}, {overhead['config_short']}, "
                     f"{overhead['blocks']} alternating blocks of {overhead['steps_per_block']} steps per loop): "
                     f"`Runner.step` {overhead['runner_median_step_s'] * 1e3:.2f} ms/step vs a hand-written AMP loop "
                     f"{overhead['hand_median_step_s'] * 1e3:.2f} ms/step: ratio **{overhead['ratio']:.3f}** "
                     f"(target 0.98-1.02).")
    elif overhead:
        lines.append(f"Runner overhead: {overhead['error']}.")
    if mfu:
        rows = mfu_rows({name: m["entries"] for name, m in mfu.items()})
        lines += ["", markdown_table(MFU_HEADER, rows)]
    notes = ("Repeat noise: configs that both the grid and tune measured, |tune's / grid's samples/s - 1|; "
             "ratios closer to 1 than that are ties. ")
    quick_note = ("Quick mode: the grid is a subset (docs/benchmarks.md), so `tune / grid best` can exceed 1 when "
                  "tune finds a config outside it, and `tune wall / grid wall` is not the full-grid ratio its "
                  "target is about. " if report["quick"] else "")
    files = ", ".join(f"`{r['json_path']}`" for r in reports)
    lines += ["", f"{notes}{quick_note}Throughputs are samples/s of trial measurements (the spec's warm-up and measured "
                  f"steps); every measurement is in {files}."]
    return "\n".join(lines) + "\n"


def replace_section(text: str, key: str, section: str) -> str:
    """RESULTS.md with the section of `key` (between its markers) replaced, or appended."""
    begin, end = f"<!-- results:{key} -->", f"<!-- /results:{key} -->"
    block = f"{begin}\n{section}{end}\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        return head + block + rest.split(end, 1)[1].lstrip("\n")
    return text.rstrip("\n") + "\n\n" + block


def emit_json(result: dict, path=None) -> None:
    """A benchmark's result on stdout, and also in `path` (a pathlib.Path) when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
