"""A 16-bit training step against 32-true's on this CPU: the evidence for the search's prior
on a CPU with no 16-bit multiply unit (`autofit.search._timing.CPU_16_BIT_SLOWDOWN`).

    python benchmarks/cpu_16_bit.py [--width 256] [--layers 4] [--rounds 6]

A stack of `torch.nn.TransformerEncoderLayer`s, forward and backward over one batch, in
32-true, bf16 autocast, fp16 autocast and bf16 weights, interleaved round by round so other
load falls on each alike; the first round (first-use work) is left out. Prints each
precision's median step and its ratio to 32-true, and which 16-bit dtypes the CPU's flags name a
multiply unit for (`autofit.device.probe.cpu_16_bit_units`).
"""

import argparse
import statistics
import time

import torch

from autofit.device.probe import cpu_16_bit_units

VARIANTS = {"32-true": (None, torch.float32), "bf16-mixed": (torch.bfloat16, torch.float32),
            "16-mixed": (torch.float16, torch.float32), "bf16-true": (None, torch.bfloat16)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.seq, args.width)
    models = {}
    for name, (_, dtype) in VARIANTS.items():
        layer = torch.nn.TransformerEncoderLayer(args.width, 4, 4 * args.width, batch_first=True, dropout=0.0)
        models[name] = torch.nn.TransformerEncoder(layer, args.layers).to(dtype)
    times_s: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for round_ in range(args.rounds):
        for name, (autocast, dtype) in VARIANTS.items():
            began = time.perf_counter()
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                y = models[name](x.to(dtype))
            y.float().square().mean().backward()
            if round_:
                times_s[name].append(time.perf_counter() - began)
    print(f"16-bit multiply units: {sorted(cpu_16_bit_units() or []) or 'none'}; {torch.get_num_threads()} threads; "
          f"width {args.width}, {args.layers} layers, batch {args.batch}x{args.seq}")
    base_s = statistics.median(times_s["32-true"])
    for name, steps in times_s.items():
        median_s = statistics.median(steps)
        print(f"{name:10s} {median_s:7.3f} s  {median_s / base_s:6.2f}x 32-true  "
              f"(range {min(steps):.3f}-{max(steps):.3f})")


if __name__ == "__main__":
    main()
