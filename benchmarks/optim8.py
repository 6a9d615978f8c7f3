"""optimizer_bits=8: which library's 8-bit AdamW, measured against fp32 AdamW.

    python benchmarks/optim8.py                                   # examples/tiny-gpt.yaml, 200 steps
    python benchmarks/optim8.py --steps 200 --json benchmarks/results/optim8-cpu.json

Trains the same model (fp32 weights) from the same initial weights on the same batches with:

- `adamw-32`: PyTorch AdamW, fp32 moments (the reference);
- `bnb-8bit`: bitsandbytes `AdamW8bit` (blockwise 8-bit moments);
- `torchao-8bit`: torchao `AdamW8bit` (blockwise 8-bit moments as a tensor subclass, its
  step compiled with `torch.compile`).

The variants step in turn within each step, so load from other processes falls on all of
them alike. Reported per variant: optimizer state bytes per parameter (the inner tensors of
a tensor subclass, block scales and maps included), the first step's time (torchao compiles
there), the median step time after it, and the final loss (mean of the last 10 steps)
against fp32's.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from autofit.config.train_config import TrainConfig  # noqa: E402
from metrics import emit_json  # noqa: E402
from autofit.train.optim import param_groups  # noqa: E402
from autofit.train.runner import Runner  # noqa: E402
from autofit.config.spec import load_spec  # noqa: E402
from autofit.workload import build_workload  # noqa: E402

VARIANTS = ("adamw-32", "bnb-8bit", "torchao-8bit")


def _optimizer(variant: str, runner: Runner) -> torch.optim.Optimizer:
    spec = runner.spec.optimizer
    groups = param_groups(spec, runner.params)
    if variant == "adamw-32":
        return torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas, foreach=False)
    if variant == "bnb-8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(groups, lr=spec.lr, betas=spec.betas, eps=1e-8)
    assert variant == "torchao-8bit", variant
    from torchao.optim import AdamW8bit

    return AdamW8bit(groups, lr=spec.lr, betas=spec.betas, eps=1e-8)


def _storages(t: torch.Tensor):
    """The plain tensors holding `t`'s bytes: a tensor subclass's inner tensors."""
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        yield t
        return
    names, _ = t.__tensor_flatten__()
    for name in names:
        yield from _storages(getattr(t, name))


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            for t in _storages(value):
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:  # a map shared by every tensor counts once
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
    return total


def run(spec_path: Path, *, steps: int, variants: tuple[str, ...], threads: int) -> dict:
    torch.set_num_threads(threads)
    spec = load_spec(spec_path)
    workload = build_workload(spec)
    config = TrainConfig(precision="32-true", micro_batch_size=spec.train.global_batch_size)
    runners, losses, times = {}, {}, {}
    for variant in variants:
        runner = Runner(spec, workload, config, device=torch.device("cpu"))
        runner.optimizer = _optimizer(variant, runner)
        runners[variant], losses[variant], times[variant] = runner, [], []
    for step in range(steps):
        for variant, runner in runners.items():  # interleaved: noise hits every variant alike
            batch = runner.global_batch(step)
            started = time.perf_counter()
            losses[variant].append(runner.step(batch).loss.item())
            times[variant].append(time.perf_counter() - started)
    out = {"spec": str(spec_path), "steps": steps, "lr": spec.optimizer.lr, "threads": threads,
           "torch": torch.__version__, "variants": {}}
    reference = statistics.fmean(losses["adamw-32"][-10:]) if "adamw-32" in losses else None
    for variant, runner in runners.items():
        n_params = sum(p.numel() for p in runner.params)
        final = statistics.fmean(losses[variant][-10:])
        out["variants"][variant] = {
            "optimizer": f"{type(runner.optimizer).__module__}.{type(runner.optimizer).__name__}",
            "optimizer_state_bytes_per_param": round(_state_bytes(runner.optimizer) / n_params, 3),
            "first_step_s": round(times[variant][0], 3),
            "median_step_s": round(statistics.median(times[variant][1:]), 5),
            "final_loss": round(final, 4),
            "vs_adamw_32": None if reference is None else round(final / reference - 1, 4),
        }
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=REPO / "examples" / "tiny-gpt.yaml")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: less noise)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    result = run(args.spec, steps=args.steps, variants=tuple(args.variants.split(",")), threads=args.threads)
    emit_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
