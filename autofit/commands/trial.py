"""`autofit trial`: one configuration, measured once in an isolated child.

    autofit trial examples/tiny-gpt.yaml --set precision=bf16-mixed --set micro_batch_size=4 --json
"""

import json
from pathlib import Path

from autofit.base.output import answer
from autofit.base.sizes import format_bytes
from autofit.config.spec import load_spec, MAX_TRIAL_STEPS
from autofit.config.train_config import TrainConfig, with_overrides
from autofit.device.budget import budget_for
from autofit.device.probe import select_device
from autofit.device.support import require_supported
from autofit.measure.asks import probe_batch_dim
from autofit.measure.measurement import Measurement
from autofit.measure.trial import measure, raise_input_error, trial_worker
from autofit.commands.args import check_count, check_seconds, parse_sets


def trial_command(spec_path: str | Path, *, overrides: dict[str, str] | None = None, device: str | None = None,
                  memory_budget: str | None = None, timeout_s: float | None = None,
                  warmup_steps: int | None = None, measure_steps: int | None = None) -> tuple[Measurement, dict]:
    """`autofit trial`: the spec's default config with `--set` overrides, measured once.
    Returns the measurement and the device it ran on."""
    spec = load_spec(spec_path)
    config = with_overrides(TrainConfig.default_for(spec), overrides or {},
                            global_batch_size=spec.train.global_batch_size)
    check_seconds("--timeout", timeout_s)
    check_count("--warmup-steps", warmup_steps, minimum=0, maximum=MAX_TRIAL_STEPS)
    check_count("--measure-steps", measure_steps, maximum=MAX_TRIAL_STEPS)
    info = select_device(device)
    require_supported(config.precision, info)
    given = budget_for(info, memory_budget, headroom=0.0)
    # A CPU trial without a budget is held only by the machine's RAM; a GPU trial always
    # by what the other processes on the card leave free.
    budget = None if info.kind == "cpu" and not given.emulated else given
    device_arg = "cpu" if info.kind == "cpu" else str(info.index)
    with trial_worker(spec, device_arg) as worker:
        # A model autofit did not write: its batch where autofit splits it (checked once, in a child).
        probe_batch_dim(worker, spec, timeout_s=timeout_s)
        measurement = measure(spec, config, device=device_arg, budget=budget, warmup_steps=warmup_steps,
                              measure_steps=measure_steps, timeout_s=timeout_s, worker=worker)
    raise_input_error(measurement)
    return measurement, info.to_dict()


def main(args) -> int:
    """The CLI's `trial`: one line (or `--json`); exit 3 when the trial gave no usable measurement."""
    m, device = trial_command(args.spec, overrides=parse_sets(args.set), device=args.device,
                              memory_budget=args.memory_budget, timeout_s=args.timeout,
                              warmup_steps=args.warmup_steps, measure_steps=args.measure_steps)
    if args.json:
        answer(json.dumps({**m.to_dict(), "device": device["name"]}, indent=2))
    else:
        line = f"{m.status}  {m.config.short()}  peak {format_bytes(m.peak_memory_bytes)}"
        if m.samples_per_s is not None:
            line += f"  {m.samples_per_s:.1f} samples/s  step {m.step_time_s * 1000:.1f} ms"
        if m.compile_s is not None:  # apart from the step time it never enters
            line += f"  compile {m.compile_s:.1f} s"
        answer(line + (f"  ({m.reason})" if m.reason else ""))
    # Not ok is a usable answer printed in full, but no usable measurement: exit 3.
    return 0 if m.ok else 3
