"""The allocator model's retry against the card: tests/test_allocator.py's hand-made traces
run through torch.cuda's caching allocator under the same cap
(`set_per_process_memory_fraction`), beside what `autofit.device.allocator.replay` predicts.

    python benchmarks/allocator_retry_check.py            # on CUDA device 0; one JSON line per trace
    python benchmarks/allocator_retry_check.py --model    # the model's column only, no card needed

Each trace runs in a fresh allocator state (empty_cache, stats reset); no matmul runs, so no
cuBLAS workspace is in the way. Agreement: same OOM or not, same retries, same reserved peak
(where it ran)."""

import argparse
import json

from autofit.device.allocator import replay

MiB = 2**20
# (name, trace, cap): the cases tests/test_allocator.py checks by hand.
TRACES = [
    ("fits-thanks-to-retry", [("a", 11 * MiB), ("a", None), ("b", 13 * MiB)], 20 * MiB),
    ("small-segment-released", [("s", 100), ("s", None), ("a", 12 * MiB)], 12 * MiB),
    ("live-over-cap", [("a", 12 * MiB), ("b", 12 * MiB), ("c", 12 * MiB)], 20 * MiB),
    ("fragmentation-no-cure", [("a", 4 * MiB), ("b", 4 * MiB), ("a", None), ("c", 14 * MiB)], 30 * MiB),
]


def on_card(trace, cap_bytes: int) -> dict:
    import torch

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.reset_accumulated_memory_stats()
    # allowed_memory_maximum = fraction x total, truncated: half a byte over lands on the cap.
    torch.cuda.set_per_process_memory_fraction((cap_bytes + 0.5) / torch.cuda.get_device_properties(0).total_memory)
    live, oom = {}, False
    try:
        for key, n_bytes in trace:
            if n_bytes is None:
                del live[key]
            else:
                live[key] = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError:
        oom = True
    stats = torch.cuda.memory_stats()
    live.clear()
    torch.cuda.set_per_process_memory_fraction(1.0)
    return {"oom": oom, "retries": stats.get("num_alloc_retries", 0),
            "reserved_peak_bytes": stats.get("reserved_bytes.all.peak", 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="store_true", help="the model's predictions only, no card")
    args = parser.parse_args()
    for name, trace, cap in TRACES:
        p = replay(trace, capacity_bytes=cap)
        row = {"trace": name, "cap_bytes": cap,
               "model": {"oom": p.oom, "retries": p.retries, "reserved_peak_bytes": p.reserved_peak_bytes}}
        if not args.model:
            row["card"] = on_card(trace, cap)
            agree = row["card"]["oom"] == p.oom and row["card"]["retries"] == p.retries
            row["agree"] = agree and (p.oom or row["card"]["reserved_peak_bytes"] == p.reserved_peak_bytes)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
