"""The plain functions behind the CLI's subcommands: typed arguments in, results out.
Called from Python they raise `AutofitError`s; the CLI turns those into one line."""

from pathlib import Path

from autofit.errors import AutofitError, SpecError
from autofit.knobs import TrainConfig, check_global_batch
from autofit.sizes import parse_size
from autofit.spec import load_spec


def parse_budget(text: str | None, *, total_bytes: int | None = None) -> int | None:
    if text is None:
        return None
    try:
        return parse_size(text, total_bytes=total_bytes, what="--memory-budget")
    except ValueError as exc:
        raise SpecError(str(exc)) from None


def train_command(spec_path: str | Path, *, profile: str | Path | None = None, steps: int | None = None,
                  resume: bool = False, device: str | None = None, checkpoint_dir: str | Path | None = None,
                  memory_budget: str | None = None, progress: bool = True) -> dict:
    """`autofit train`: the spec's defaults, or a tuned profile's config."""
    from autofit.runner import resolve_device, train
    from autofit.workload import build_workload

    spec = load_spec(spec_path)
    if steps is not None and steps < 1:
        raise SpecError(f"--steps: must be a positive integer, got {steps}")
    config = TrainConfig.default_for(spec)
    if profile is not None:
        from autofit.profile import Profile

        loaded = Profile.load(profile)
        loaded.check_spec(spec)
        config = loaded.config
    check_global_batch(config, spec.train.global_batch_size)
    try:
        torch_device = resolve_device(device)
    except ValueError:
        raise SpecError(f"--device: expected a CUDA index or cpu, got {device!r}") from None
    workload = build_workload(spec)
    ckpt_dir = Path(checkpoint_dir) if checkpoint_dir is not None else Path("runs") / spec.name
    try:
        return train(spec, workload, config, device=torch_device, steps=steps, checkpoint_dir=ckpt_dir,
                     resume=resume, progress=progress, memory_budget_bytes=parse_budget(memory_budget))
    except ValueError as exc:  # e.g. every parameter frozen
        raise AutofitError(str(exc)) from None
