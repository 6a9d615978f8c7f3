"""`autofit estimate`: the peak memory of a configuration without running it (fake tensors).

    autofit estimate examples/tiny-gpt.yaml --set precision=bf16-true --memory-budget 24GiB --json
"""

import json

from autofit.base import stopping
from autofit.base.output import answer
from autofit.base.sizes import format_bytes
from autofit.config.spec import load_spec
from autofit.config.train_config import TrainConfig, with_overrides
from autofit.device.budget import budget_for
from autofit.device.probe import select_device
from autofit.device.support import require_supported
from autofit.measure import asks
from autofit.measure.trial import trial_worker
from autofit.commands.args import parse_sets


def estimate_command(spec_path, *, overrides: dict[str, str] | None = None, memory_budget: str | None = None,
                     device: str | None = None) -> dict:
    """`autofit estimate`: the predicted peak of the spec's default config with `--set`
    overrides, and with a budget the largest micro batch that fits it."""
    spec = load_spec(spec_path)
    config = with_overrides(TrainConfig.default_for(spec), overrides or {},
                            global_batch_size=spec.train.global_batch_size)
    info = select_device(device)
    require_supported(config.precision, info)
    # What `tune` would allow under the same budget: search.memory_headroom is kept free.
    given = budget_for(info, memory_budget, headroom=spec.search.memory_headroom)
    requested, budget = given.requested_bytes, given.usable_bytes if given.emulated else None
    # The user's model runs (on fake tensors) in a child, as in a tune: never in this process.
    with trial_worker(spec, "cpu") as worker:
        capability = None if info.compute_capability is None else "{}.{}".format(*info.compute_capability)
        estimate, max_micro = asks.estimate(worker, spec, config, device_kind=info.kind, budget_bytes=budget,
                                            stop_event=stopping.requested, compute_capability=capability)
    out = {"config": config.to_dict(), "device_kind": info.kind, **estimate.to_dict()}
    if budget is not None:
        out["requested_budget_bytes"] = requested
        out["budget_bytes"] = budget
        out["fits"] = estimate.fit_bytes <= budget
        out["max_micro_batch_size"] = max_micro
    return out


def main(args) -> int:
    """The CLI's `estimate`: the parts and the peak; exit 3 when not even a micro batch of 1 fits."""
    out = estimate_command(args.spec, overrides=parse_sets(args.set), memory_budget=args.memory_budget,
                           device=args.device)
    if args.json:
        answer(json.dumps(out, indent=2))
    else:
        per_rank = f", per rank of {out['world_size']}" if out.get("per_rank") else ""
        answer(f"{out['parameters']:,} parameters ({out['trainable_parameters']:,} trainable), "
               f"{out['device_kind']} estimate{per_rank}")
        for part, n_bytes in out["bytes"].items():
            answer(f"  {part:<14} {format_bytes(n_bytes):>12}")
        if out.get("note"):
            answer(f"note: {out['note']}")
        if out.get("allocator_retries"):
            answer(f"allocator retries under the budget: {out['allocator_retries']} (cached segments freed to fit; "
                   f"the cap is near)")
        answer(f"model state {format_bytes(out['model_state_bytes'])}: {out['model_state_bytes_per_param']:.2f} "
               f"bytes per parameter (weights, gradients, optimizer state)")
        if "max_micro_batch_size" in out:
            answer(f"budget {format_bytes(out['budget_bytes'])}: fits={out['fits']}, "
                   f"largest micro batch that fits: {out['max_micro_batch_size']}")
    return 3 if out.get("max_micro_batch_size", 1) is None else 0
