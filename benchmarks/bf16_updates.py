"""bf16-true's weight update: which library keeps it as good as fp32's, at what cost.

    python benchmarks/bf16_updates.py                         # examples/tiny-gpt.yaml, lr 3e-4, 300 steps
    python benchmarks/bf16_updates.py --steps 300 --lr 3e-4 --json benchmarks/results/bf16_updates-cpu.json

Trains the same model from the same initial weights on the same batches with:

- `32-true`: fp32 weights, PyTorch AdamW (the reference);
- `bf16-plain`: bf16 weights, PyTorch AdamW (the old bf16-true update);
- `bf16-kahan`: bf16 weights, torch-optimi AdamW with Kahan summation (its own decay, which
  rounds away on bf16 weights);
- `bf16-true`: what autofit builds for bf16-true (`autofit.train.optim.build_optimizer`): the same,
  with the decoupled weight decay added to the compensation buffer;
- `bf16-sr`: bf16 weights, torchao's AdamW with bf16 stochastic rounding.

The variants step in turn within each step (one step of each, then the next step), so
load from other processes falls on all of them alike; the step times are medians.
Reported per variant: final loss (mean of the last 10 steps) against 32-true's, the
trainable tensors left bit-identical, optimizer state bytes per parameter, step time.
"""

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from autofit.config.train_config import TrainConfig  # noqa: E402
from metrics import emit_json  # noqa: E402
from autofit.train.runner import Runner  # noqa: E402
from autofit.config.spec import load_spec  # noqa: E402
from autofit.workload import build_workload  # noqa: E402

VARIANTS = ("32-true", "bf16-plain", "bf16-kahan", "bf16-true", "bf16-sr")


def _optimizer(variant: str, runner: Runner) -> torch.optim.Optimizer:
    """The variant's optimizer over the runner's parameter groups (decay on matrices only)."""
    from autofit.train.optim import param_groups

    spec = runner.spec.optimizer
    groups = param_groups(spec, runner.params)
    if variant == "bf16-true":
        return runner.optimizer  # the runner built it: what a bf16-true run trains with
    if variant in ("32-true", "bf16-plain"):
        return torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas, foreach=False)
    if variant == "bf16-kahan":
        import optimi

        return optimi.AdamW(groups, lr=spec.lr, betas=spec.betas, kahan_sum=True, foreach=False)
    assert variant == "bf16-sr", variant
    # torchao 0.18 exposes the bf16 stochastic-rounding AdamW only as `_AdamW` (its
    # public AdamW8bit/4bit/Fp8 quantise the state instead).
    from torchao.optim import _AdamW

    return _AdamW(groups, lr=spec.lr, betas=spec.betas, bf16_stochastic_round=True)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def run(spec_path: Path, *, steps: int, lr: float, variants: tuple[str, ...], threads: int) -> dict:
    torch.set_num_threads(threads)
    spec = load_spec(spec_path)
    spec = dataclasses.replace(spec, optimizer=dataclasses.replace(spec.optimizer, lr=lr))
    workload = build_workload(spec)
    runners, initial, losses, times = {}, {}, {}, {}
    for variant in variants:
        precision = "32-true" if variant == "32-true" else "bf16-true"
        config = TrainConfig(precision=precision, micro_batch_size=spec.train.global_batch_size)
        runner = Runner(spec, workload, config, device=torch.device("cpu"))
        runner.optimizer = _optimizer(variant, runner)
        runners[variant] = runner
        initial[variant] = {n: p.detach().clone() for n, p in runner.model.named_parameters() if p.requires_grad}
        losses[variant], times[variant] = [], []
    for step in range(steps):
        for variant, runner in runners.items():  # interleaved: noise hits every variant alike
            batch = runner.global_batch(step)
            started = time.perf_counter()
            loss = runner.step(batch).loss.item()
            times[variant].append(time.perf_counter() - started)
            losses[variant].append(loss)
    out = {"spec": str(spec_path), "steps": steps, "lr": lr, "threads": threads, "torch": torch.__version__,
           "variants": {}}
    ref_final = statistics.fmean(losses["32-true"][-10:]) if "32-true" in losses else None
    for variant, runner in runners.items():
        named = dict(runner.model.named_parameters())
        frozen = [n for n, p0 in initial[variant].items() if torch.equal(named[n].detach(), p0)]
        n_params = sum(p.numel() for p in runner.params)
        final = statistics.fmean(losses[variant][-10:])
        out["variants"][variant] = {
            "optimizer": f"{type(runner.optimizer).__module__}.{type(runner.optimizer).__name__}",
            "final_loss": round(final, 4),
            "vs_32_true": None if ref_final is None else round(final / ref_final - 1, 4),
            "unchanged_tensors": frozen,
            "trainable_tensors": len(initial[variant]),
            "optimizer_state_bytes_per_param": round(_state_bytes(runner.optimizer) / n_params, 2),
            "weight_bytes_per_param": runner.params[0].element_size(),
            "median_step_s": round(statistics.median(times[variant][10:]), 5),
        }
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=REPO / "examples" / "tiny-gpt.yaml")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: less noise)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    result = run(args.spec, steps=args.steps, lr=args.lr, variants=tuple(args.variants.split(",")),
                 threads=args.threads)
    emit_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
