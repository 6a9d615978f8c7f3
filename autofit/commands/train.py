"""`autofit train`: train a model.yaml with the built-in AMP runner, at the spec's defaults or
at a tuned profile's fastest point that fits now (the pipeline: `autofit.tuning.training`).

    autofit train examples/tiny-gpt.yaml --steps 60
    autofit train examples/tiny-gpt.yaml --profile tiny-gpt --memory-budget 8MiB --resume
    torchrun --standalone --nproc-per-node 2 -m autofit train model.yaml --profile model--cpu-x2.yaml
"""

import json
import sys
from pathlib import Path

from autofit.base import stopping
from autofit.base.atomic import finite, write_json
from autofit.base.errors import SpecError
from autofit.base.output import answer
from autofit.config.spec import load_spec, MAX_STEPS
from autofit.tuning.training import train_spec, TrainSetup
from autofit.commands.args import check_count, check_output_file, check_run_folder


def train_command(spec_path: str | Path, *, profile: str | Path | None = None, steps: int | None = None,
                  resume: bool = False, overwrite: bool = False, device: str | None = None,
                  checkpoint_dir: str | Path | None = None, memory_budget: str | None = None,
                  progress: bool = True) -> dict:
    """`autofit train`: the spec's defaults, or a tuned profile's config (a file, or a model
    name looked up in the store for this device, as every other command takes it); the
    command line checked here, the run in `autofit.tuning.training.train_spec`."""
    spec = load_spec(spec_path)
    check_count("--steps", steps, maximum=MAX_STEPS)
    if resume and overwrite:
        raise SpecError("--resume and --overwrite: choose one (continue the run, or replace it)")
    ckpt_dir = Path(checkpoint_dir) if checkpoint_dir is not None else Path("runs") / spec.name
    check_run_folder(ckpt_dir, resume=resume, overwrite=overwrite)
    return train_spec(TrainSetup(spec=spec, spec_path=Path(spec_path), checkpoint_dir=ckpt_dir, profile=profile,
                                 steps=steps, resume=resume, device=device, memory_budget=memory_budget,
                                 progress=progress))


def main(args) -> int:
    """The CLI's `train`: the run's summary as one JSON line on stdout; exit 3 on a diverged loss."""
    check_output_file(args.metrics_out, "--metrics-out")  # checked before the run, not after it
    metrics = train_command(args.spec, profile=args.profile, steps=args.steps, resume=args.resume,
                            overwrite=args.overwrite, device=args.device, checkpoint_dir=args.checkpoint_dir,
                            memory_budget=args.memory_budget, progress=not args.no_progress)
    if metrics.get("rank", 0) != 0 or stopping.requested.is_set():
        return 0  # under torchrun the metrics are rank 0's to report; a stopped run's exit is the stop's
    metrics = finite(metrics)  # JSON has no NaN: a diverged loss is written as null
    if args.metrics_out is not None:
        write_json(args.metrics_out, metrics)
    summary = {k: metrics[k] for k in ("steps", "first_loss", "final_loss", "samples_per_s", "compile_s",
                                       "peak_memory_bytes") if k in metrics}
    answer(json.dumps(summary))
    if metrics["final_loss"] is None and metrics["steps"]:
        print(f"autofit: error: the loss diverged at step {metrics['steps'] - 1} (NaN/inf); "
              f"lower optimizer.lr or use a profile with a healthy precision", file=sys.stderr)
        return 3
    return 0
