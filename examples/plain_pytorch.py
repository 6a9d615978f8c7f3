"""Train the tiny GPT of examples/tiny-gpt.yaml in your own PyTorch loop, with a tuned profile.

    autofit tune examples/tiny-gpt.yaml                     # once: profiles/tiny-gpt--<device>.yaml
    python examples/plain_pytorch.py                        # the store's profile for this device
    python examples/plain_pytorch.py --profile profiles/tiny-gpt--cpu.yaml --steps 100

The loop is ordinary PyTorch: your model, your data, your loss. The profile decides the
precision, the micro batch and accumulation, and which blocks are checkpointed or frozen;
the plan it returns steps exactly as `autofit train --profile` does.
"""

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import autofit
from autofit.train.plan import TrainingPlan
from autofit.workload.zoo import gpt

HERE = Path(__file__).resolve().parent


def windows(tokens: np.ndarray, batch_size: int, seq_len: int, generator: torch.Generator):
    """Random (input, next-token target) windows of a flat token array."""
    starts = torch.randint(len(tokens) - seq_len - 1, (batch_size,), generator=generator)
    rows = np.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()]).astype(np.int64)
    window = torch.from_numpy(rows)
    return window[:, :-1], window[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="a profile file or model name (default: tiny-gpt from the store)")
    parser.add_argument("--store", help="profile folder (default: $AUTOFIT_STORE, else ./profiles)")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--device", help="cuda index or cpu (default: the first GPU, else the CPU)")
    args = parser.parse_args()

    spec = autofit.load_spec(HERE / "tiny-gpt.yaml")
    torch.manual_seed(spec.train.seed)
    model = gpt(spec.model.args)

    def optimizer(params):
        return torch.optim.AdamW(params, lr=spec.optimizer.lr, weight_decay=spec.optimizer.weight_decay)

    try:
        profile = autofit.load_profile(args.profile or spec.name, store=args.store, device=args.device)
        plan = profile.apply(model, optimizer, device=args.device, max_grad_norm=spec.train.max_grad_norm)
    except autofit.ProfileError as exc:
        if args.profile:  # asked for by name: a miss is an error, not a silent default
            raise SystemExit(f"error: {exc}") from None
        # Not tuned yet: what a plain PyTorch job does (fp32, the whole batch at once).
        print(f"no tuned profile ({exc}); using the untuned default")
        plan = TrainingPlan(model, autofit.TrainConfig.default_for(spec), optimizer, device=args.device,
                            max_grad_norm=spec.train.max_grad_norm)
    print("plan:", plan.describe())

    tokens = np.memmap(spec.data.path, dtype=np.uint16, mode="r")
    seq_len = spec.model.args["seq_len"]
    t0 = time.perf_counter()
    for step in range(args.steps):
        # One global batch per optimizer step, fed to the model in the plan's micro batches.
        x, y = windows(tokens, spec.train.global_batch_size, seq_len, torch.Generator().manual_seed(step))
        losses = []
        for xm, ym in zip(x.split(plan.micro_batch_size), y.split(plan.micro_batch_size)):
            xm, ym = plan.to_device((xm, ym))
            with plan.autocast():
                logits = plan.model(xm)
            # The loss in fp32, outside autocast: a bf16 softmax over the vocabulary is lossy.
            loss = F.cross_entropy(logits.float().flatten(0, 1), ym.flatten())
            plan.backward(loss)
            losses.append(loss.item())
        plan.step()
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {sum(losses) / len(losses):.4f}")
    elapsed_s = time.perf_counter() - t0
    print(f"{args.steps} steps in {elapsed_s:.1f} s, "
          f"{args.steps * spec.train.global_batch_size / elapsed_s:.1f} samples/s, "
          f"{plan.skipped_steps} skipped by the GradScaler")


if __name__ == "__main__":
    main()
