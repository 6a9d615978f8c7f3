"""Dynamic padding against padding to max_length, on the same text corpus, in one run.

    python benchmarks/padding.py examples/tiny-gpt-text.yaml --device cpu \
        --config '{"micro_batch_size": 4, "grad_accum_steps": 4}' --rounds 6 --steps 4

Both variants train the same model (same seed, same config) on the same steps of the
corpus: `data.padding` is the only difference. They run in alternating blocks of steps
(dynamic, max_length, dynamic, ...) so load from other processes falls on both alike. Each
block's rate is its non-pad tokens over its wall time; the table gives the median block
and the spread (min-max) over blocks, which is the noise of the measurement. Length
bucketing (sorting each step by length) is measured as a third variant of dynamic padding.
"""

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch

from autofit.config.train_config import TrainConfig
from autofit.train.runner import resolve_device, Runner
from autofit.config.spec import load_spec
from autofit.workload import build_workload

VARIANTS = {  # name: (data.padding, length_bucketing)
    "dynamic": ("dynamic", False),
    "max_length": ("max_length", False),
    "dynamic + bucketing": ("dynamic", True),
}


def make_runner(spec, padding: str, config: TrainConfig, device: torch.device) -> Runner:
    spec = dataclasses.replace(spec, data=dataclasses.replace(spec.data, padding=padding))
    return Runner(spec, build_workload(spec), config, device=device)


def block(runner: Runner, first_step: int, steps: int) -> tuple[float, int, int]:
    """(seconds, non-pad tokens, padded tokens) of `steps` real steps from `first_step`."""
    seconds, real, padded = 0.0, 0, 0
    for step in range(first_step, first_step + steps):
        batch = runner.global_batch(step)
        real += runner.tokens_in(batch)
        padded += sum(mb[1].numel() if isinstance(mb, tuple) else mb["input_ids"].numel() for mb in batch)
        runner.synchronize()
        started = time.perf_counter()
        runner.step(batch).loss.item()
        runner.synchronize()
        seconds += time.perf_counter() - started
    return seconds, real, padded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="a model.yaml with data.kind text")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--config", default="{}", help="TrainConfig fields as JSON (default: the whole batch at once)")
    parser.add_argument("--rounds", type=int, default=6, help="blocks per variant")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per block")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (a shared machine: 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = load_spec(args.spec)
    assert spec.data.kind == "text", "a data.kind text spec is needed"
    fields = {"micro_batch_size": spec.train.global_batch_size, **json.loads(args.config)}
    fields.setdefault("grad_accum_steps", spec.train.global_batch_size // fields["micro_batch_size"])
    device = resolve_device(args.device)
    runners = {name: make_runner(spec, padding, TrainConfig(**fields, length_bucketing=bucketing), device)
               for name, (padding, bucketing) in VARIANTS.items()}
    for runner in runners.values():  # warm-up: first-step allocations and lazy optimizer state
        block(runner, 0, 1)
    rates: dict[str, list[float]] = {name: [] for name in runners}
    totals = {name: [0, 0] for name in runners}
    for r in range(args.rounds):
        # Every variant runs the same steps in a round; rounds walk through the corpus.
        first = 1 + r * args.steps
        for name, runner in runners.items():
            seconds, real, padded = block(runner, first, args.steps)
            rates[name].append(real / seconds)
            totals[name][0] += real
            totals[name][1] += padded
    config = TrainConfig(**fields)
    print(f"{spec.name}: {config.short()}, {args.rounds} alternating blocks of {args.steps} steps per variant, "
          f"device {device}, torch threads {args.threads}")
    print("| variant | non-pad tokens/s (median block) | min-max over blocks | pad share of tokens |")
    print("|---|---|---|---|")
    for name, values in rates.items():
        real, padded = totals[name]
        print(f"| {name} | {statistics.median(values):.0f} | {min(values):.0f}-{max(values):.0f} | "
              f"{1 - real / padded:.0%} |")
    ratio = [d / m for d, m in zip(rates["dynamic"], rates["max_length"])]
    print(f"dynamic / max_length, per round: median {statistics.median(ratio):.2f}x "
          f"(min {min(ratio):.2f}x, max {max(ratio):.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
