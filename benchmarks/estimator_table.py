"""The estimator against the card: predicted vs measured allocated and reserved peaks.

On a CUDA box, one command (rows are written as they come; run again with the same --json,
a run cut off by a time limit goes on from the rows it has):

    python benchmarks/estimator_table.py --device 0 --json benchmarks/results/estimator-h100.json

GPT-2 small, BERT-base and the ConvNet spec (benchmarks/specs/) at micro batches 8, 32 and 64
in 32-true, bf16-mixed and bf16-true: for each, the estimate (`device_kind="cuda"`, the card's
compute capability: the caching allocator's allocated and reserved peaks of the fake step,
cuBLAS/cuBLASLt workspaces included) and a trial child's `torch.cuda` peaks. A config the
estimate says cannot fit the card is still tried, and its OOM recorded. Without a GPU,
`--estimate-only` writes the predicted columns (the fake step needs no card).

    python benchmarks/estimator_table.py --estimate-only --json benchmarks/results/estimator-predicted.json

The older use, the search's calibrated prediction from a stored benchmark run:

    python benchmarks/estimator_table.py benchmarks/results/2026-11-22-cpu-quick.json

The memory model is fitted on the first two configs of each model's grid, as the search
would be after its first two trials, and predicts every config of the grid.
"""

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from autofit.base.atomic import write_json  # noqa: E402
from autofit.search.memory_model import fit_points  # noqa: E402

MiB = 2**20
GiB = 2**30
SPECS = {"gpt-small": "benchmarks/specs/gpt-small.yaml", "bert-base": "benchmarks/specs/bert-base.yaml",
         "convnet": "benchmarks/specs/convnet.yaml"}
MICRO_BATCHES = (8, 32, 64)
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
TOLERANCE = 0.10  # the search's margin before any trial calibrates it


def table(results: dict) -> str:
    rows = ["| model | config | estimate (MiB) | calibrated (MiB) | measured (MiB) | calibrated error |",
            "|---|---|---:|---:|---:|---:|"]
    for name, model in results["models"].items():
        grid = [e for e in model["grid"] if e["status"] == "ok" and e.get("predicted_peak_bytes")]
        fit = fit_points([(e["predicted_peak_bytes"], e["total_peak_bytes"]) for e in grid[:2]])
        for e in grid:
            calibrated = fit.predict(e["predicted_peak_bytes"])
            error = calibrated / e["total_peak_bytes"] - 1
            rows.append(f"| {name} | {e['short']} | {e['predicted_peak_bytes'] / MiB:.2f} | {calibrated / MiB:.2f} "
                        f"| {e['total_peak_bytes'] / MiB:.2f} | {error:+.1%} |")
    return "\n".join(rows)


def _error(predicted: int | None, measured: int | None) -> float | None:
    return None if not predicted or not measured else round(100 * (predicted / measured - 1), 2)


def card_row(spec, config, *, device: str | None, capability: str | None, memory_bytes: int | None) -> dict:
    """One config: the estimate, and on a card the trial child's peaks beside it."""
    from autofit.measure.fake_step import estimate_memory, EstimateError
    from autofit.measure.trial import measure

    row = {"model": spec.name, "precision": config.precision, "micro_batch_size": config.micro_batch_size}
    started = time.perf_counter()
    try:
        e = estimate_memory(spec, config, device_kind="cuda", compute_capability=capability,
                            capacity_bytes=memory_bytes or None)
        row |= {"predicted_allocated_bytes": e.allocated_peak_bytes, "predicted_reserved_bytes": e.reserved_peak_bytes,
                "predicted_tensor_peak_bytes": e.peak_bytes, "predicted_activations_bytes": e.activations_bytes,
                "workspace_bytes": e.workspace_bytes, "note": e.note}
        if memory_bytes:  # judged as a run on the card would go: reserved under it, with the allocator's retry
            row["predicted_fits_card"] = e.fit_bytes <= memory_bytes
            row["predicted_allocator_retries"] = e.allocator_retries
    except EstimateError as exc:
        row["estimate_error"] = str(exc)
    row["estimate_s"] = round(time.perf_counter() - started, 1)
    if device is None:
        return row
    m = measure(spec, config, device=device, warmup_steps=1, measure_steps=1, timeout_s=240)
    row |= {"status": m.status, "reason": m.reason, "measured_allocated_bytes": m.peak_allocated_bytes,
            "measured_reserved_bytes": m.peak_memory_bytes, "overhead_bytes": m.overhead_bytes,
            "allocator_retries": m.allocator_retries}
    row["allocated_error_pct"] = _error(row.get("predicted_allocated_bytes"), m.peak_allocated_bytes)
    row["reserved_error_pct"] = _error(row.get("predicted_reserved_bytes"), m.peak_memory_bytes)
    return row


def card_table(rows: list[dict]) -> str:
    def mib(v):
        return "" if v is None else f"{v / MiB:,.0f}"

    def pct(v):
        return "" if v is None else f"{v:+.1f}%"

    out = ["| model | precision | micro | predicted allocated | measured allocated | error | predicted reserved "
           "| measured reserved | error | status |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['precision']} | {r['micro_batch_size']} "
                   f"| {mib(r.get('predicted_allocated_bytes'))} | {mib(r.get('measured_allocated_bytes'))} "
                   f"| {pct(r.get('allocated_error_pct'))} | {mib(r.get('predicted_reserved_bytes'))} "
                   f"| {mib(r.get('measured_reserved_bytes'))} | {pct(r.get('reserved_error_pct'))} "
                   f"| {r.get('status', 'estimate only') if not r.get('estimate_error') else 'estimate error'} |")
    return "\n".join(out) + "\n\n(MiB; allocated and reserved as torch.cuda.memory_stats names them)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="?", help="a stored benchmark run: print its calibrated table")
    parser.add_argument("--device", help="the CUDA index to measure on")
    parser.add_argument("--estimate-only", action="store_true", help="predicted columns only, no card needed")
    parser.add_argument("--compute-capability", help="for --estimate-only: the card's (default Hopper's, 9.0)")
    parser.add_argument("--models", default=",".join(SPECS), help=f"names ({', '.join(SPECS)}) or model.yaml paths")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--micro-batches", default=",".join(map(str, MICRO_BATCHES)))
    parser.add_argument("--json", help="write the rows here (after each row)")
    args = parser.parse_args(argv)
    if args.results:
        print(table(json.loads(Path(args.results).read_text())))
        return 0
    if (args.device is None) == (not args.estimate_only):
        print("estimator_table: give --device N (a CUDA index) or --estimate-only", file=sys.stderr)
        return 2

    from autofit.config.spec import load_spec
    from autofit.config.train_config import TrainConfig

    capability, memory_bytes, card = args.compute_capability, None, "none (estimate only)"
    if args.device is not None:
        from autofit.device.probe import select_device  # NVML: this process never initialises CUDA

        from autofit.base.errors import DeviceError

        try:
            info = select_device(args.device)
        except DeviceError as exc:
            print(f"estimator_table: {exc}", file=sys.stderr)
            return 2
        capability = None if info.compute_capability is None else "{}.{}".format(*info.compute_capability)
        memory_bytes, card = info.memory_total_bytes, info.name
    # A run cut off (a command's time limit) is taken up again: rows already in --json are kept.
    previous = json.loads(Path(args.json).read_text()).get("rows", []) if args.json and Path(args.json).exists() else []
    rows = [r for r in previous if r.get("status") or args.device is None]
    done = {(r["model"], r["precision"], r["micro_batch_size"]) for r in rows}
    for name in args.models.split(","):
        spec = load_spec(REPO / SPECS[name] if name in SPECS else name)  # a name, or a spec's path
        for precision in args.precisions.split(","):
            for micro in map(int, args.micro_batches.split(",")):
                if (spec.name, precision, micro) in done:
                    continue
                config = TrainConfig.default_for(spec).replace(
                    precision=precision, micro_batch_size=micro,
                    grad_accum_steps=spec.train.global_batch_size // micro)
                rows.append(card_row(spec, config, device=args.device, capability=capability,
                                     memory_bytes=memory_bytes))
                print(json.dumps(rows[-1]), flush=True)
                if args.json:
                    write_json(args.json, {"card": card, "compute_capability": capability,
                                           "memory_bytes": memory_bytes, "rows": rows})
    print(card_table(rows))
    judged = [abs(r[k]) for r in rows for k in ("allocated_error_pct", "reserved_error_pct")
              if r.get(k) is not None]
    if judged:
        print(f"\nworst error {max(judged):.1f}% over {len(judged)} figures (limit {TOLERANCE:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
