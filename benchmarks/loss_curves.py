"""How far apart validation loss curves are: what `search.loss_curve_rtol` has to allow.

    python benchmarks/loss_curves.py                          # examples/tiny-gpt.yaml at its lr, 30 steps
    python benchmarks/loss_curves.py --steps 30 --json benchmarks/results/loss_curves-cpu.json

Each variant is measured as a validation run is: the trial child's own steps (in this
process, so the plain-bf16 fixture can be swapped in), from the same initial weights over
the same batches. Reported per variant: the largest gap of its 5-step medians to 32-true's
(what validation compares), of 5-step means and of single steps (what it does not, and why);
and the stagnation check's figures over the timed steps: the share of trainable elements
left bit-identical and the tensors never changed.
"""

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import autofit.train.runner as runner_module  # noqa: E402
from autofit.measure.child import run_request  # noqa: E402
from autofit.config.train_config import TrainConfig  # noqa: E402
from autofit.train.optim import build_optimizer  # noqa: E402
from autofit.search.trial_health import LOSS_CURVE_WINDOW_STEPS, loss_curve_gap  # noqa: E402
from autofit.config.spec import load_spec  # noqa: E402
from autofit.measure.trial import trial_request  # noqa: E402


def _plain_bf16(spec, params, *, config, device):
    """The old bf16-true update (no compensation): what the curve should tell apart."""
    return torch.optim.AdamW(params, lr=spec.lr, betas=spec.betas, foreach=False)


def _mean_gap(mine: list[float], ref: list[float], window: int) -> float:
    n = min(len(mine), len(ref))
    return max(abs(statistics.fmean(mine[s:s + window]) - statistics.fmean(ref[s:s + window]))
               / statistics.fmean(ref[s:s + window]) for s in range(0, n, window))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default=str(REPO / "examples" / "tiny-gpt.yaml"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=None, help="default: the spec's")
    parser.add_argument("--json", help="write the raw curves and gaps here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = load_spec(args.spec)
    if args.lr is not None:
        spec = dataclasses.replace(spec, optimizer=dataclasses.replace(spec.optimizer, lr=args.lr))
    n = spec.train.global_batch_size
    variants = {
        "32-true": (TrainConfig(micro_batch_size=n), build_optimizer),
        "32-true, 4 micro batches": (TrainConfig(micro_batch_size=n // 4, grad_accum_steps=4), build_optimizer),
        "bf16-mixed": (TrainConfig(precision="bf16-mixed", micro_batch_size=n), build_optimizer),
        "bf16-true (Kahan)": (TrainConfig(precision="bf16-true", micro_batch_size=n), build_optimizer),
        "bf16, plain AdamW": (TrainConfig(precision="bf16-true", micro_batch_size=n), _plain_bf16),
    }
    curves, stagnation = {}, {}
    for name, (config, optimizer) in variants.items():
        runner_module.build_optimizer = optimizer
        result = run_request(trial_request(spec, config, warmup_steps=1, measure_steps=args.steps))
        assert result.ok, result
        curves[name] = result.losses
        stagnation[name] = {"unchanged_share": round(result.unchanged_share, 5),
                            "stalled_params": result.stalled_params}
    runner_module.build_optimizer = build_optimizer
    ref = curves["32-true"]
    rows = {name: {"median_gap": round(loss_curve_gap(c, ref), 5),
                   "mean_gap": round(_mean_gap(c, ref, LOSS_CURVE_WINDOW_STEPS), 5),
                   "step_gap": round(loss_curve_gap(c, ref, 1), 5), **stagnation[name]} for name, c in curves.items()}
    print(f"{spec.name}, lr {spec.optimizer.lr:g}, {len(ref)} steps; largest gap to 32-true over windows of "
          f"{LOSS_CURVE_WINDOW_STEPS} steps")
    print(f"{'variant':28s} {'medians':>8s} {'means':>8s} {'single steps':>13s} {'unchanged':>10s}  never changed")
    for name, row in rows.items():
        print(f"{name:28s} {row['median_gap']:8.2%} {row['mean_gap']:8.2%} {row['step_gap']:13.2%} "
              f"{row['unchanged_share']:10.2%}  {len(row['stalled_params'])}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "spec": str(args.spec), "lr": spec.optimizer.lr, "steps": len(ref), "torch": torch.__version__,
            "window_steps": LOSS_CURVE_WINDOW_STEPS, "gaps": rows, "curves": curves}, indent=2) + "\n")


if __name__ == "__main__":
    main()
