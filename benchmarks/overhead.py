"""Runner overhead: autofit's `Runner.step` against a minimal hand-written PyTorch AMP loop.

    python benchmarks/overhead.py benchmarks/specs/gpt-small.yaml --device 0 \
        --config '{"precision": "bf16-mixed", "micro_batch_size": 16, "grad_accum_steps": 4}'

Both loops train the same model (same seed, the config's checkpointing and freezing
applied the same way) on the same pre-built batches, in one process. They run in
alternating blocks of steps (A B A B ...) so clock drift, thermal throttling and other
load fall on both alike; the ratio of median step times is the runner's cost. The suite
runs this as a child so the suite's own process never holds a CUDA context.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from autofit.config.train_config import TrainConfig
from autofit.train.configure import apply_config
from autofit.train.runner import resolve_device, Runner
from autofit.config.spec import load_spec
from autofit.workload import build_workload

_AUTOCAST = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


class HandLoop:
    """What a user writes from the PyTorch AMP recipe: autocast, GradScaler, accumulation,
    clipping, AdamW, zero_grad. Nothing else."""

    def __init__(self, spec, workload, config: TrainConfig, device: torch.device):
        torch.manual_seed(spec.train.seed)
        model = apply_config(workload.build_model(), config)
        dtype = torch.bfloat16 if config.precision == "bf16-true" else torch.float32
        self.model = model.to(device=device, dtype=dtype).train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        opt = spec.optimizer
        self.optimizer = torch.optim.AdamW(self.params, lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay,
                                           fused=device.type == "cuda" or None)
        self.scaler = torch.amp.GradScaler(device.type, enabled=config.precision == "16-mixed")
        self.amp_dtype = _AUTOCAST.get(config.precision)
        self.loss_fn, self.device, self.max_norm = workload.loss_fn, device, spec.train.max_grad_norm

    def step(self, micro_batches: list) -> torch.Tensor:
        n = len(micro_batches)
        for batch in micro_batches:
            with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                loss = self.loss_fn(self.model, batch)
            self.scaler.scale(loss / n).backward()
        if self.max_norm is not None:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare(spec_path: str, config: TrainConfig, *, device: str, blocks: int, steps_per_block: int,
            warmup_steps: int, n_batches: int = 4) -> dict:
    spec = load_spec(spec_path)
    workload = build_workload(spec)
    torch_device = resolve_device(device)
    runner = Runner(spec, workload, config, device=torch_device)  # also sets the matmul precision
    hand = HandLoop(spec, workload, config, torch_device)
    batches = [runner.global_batch(i) for i in range(n_batches)]
    loops = {"runner": lambda b: runner.step(b).loss, "hand": hand.step}
    for name, step in loops.items():
        for i in range(warmup_steps):
            step(batches[i % n_batches])
        _sync(torch_device)
    times = {name: [] for name in loops}
    block_medians = {name: [] for name in loops}
    for block in range(blocks):
        for name, step in loops.items():  # A B A B ...: drift hits both alike
            these = []
            for i in range(steps_per_block):
                batch = batches[(block * steps_per_block + i) % n_batches]
                _sync(torch_device)
                started = time.perf_counter()
                step(batch).item()
                _sync(torch_device)
                these.append(time.perf_counter() - started)
            times[name] += these
            block_medians[name].append(statistics.median(these))
    runner_s, hand_s = statistics.median(times["runner"]), statistics.median(times["hand"])
    return {
        "spec": spec.name, "config": config.to_dict(), "config_short": config.short(), "device": str(torch_device),
        "blocks": blocks, "steps_per_block": steps_per_block, "warmup_steps": warmup_steps,
        "runner_median_step_s": runner_s, "hand_median_step_s": hand_s, "ratio": runner_s / hand_s,
        "block_medians_s": block_medians, "step_times_s": times,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("--config", required=True, help="a TrainConfig as JSON")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--steps-per-block", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--out", help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    result = compare(args.spec, TrainConfig.from_dict(json.loads(args.config)), device=args.device,
                     blocks=args.blocks, steps_per_block=args.steps_per_block, warmup_steps=args.warmup_steps)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    print(f"runner {result['runner_median_step_s'] * 1e3:.2f} ms/step, hand-written {result['hand_median_step_s'] * 1e3:.2f}"
          f" ms/step: ratio {result['ratio']:.3f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
