"""Hand-written training loops, as a user types them, under the tune's memory cap.

    python benchmarks/hand_loops.py SPEC LOOP [--budget-bytes N] [--window-s S]   # one JSON line

LOOP is one of:
  fp32, tf32            the plain loop, at the largest micro batch of the global batch that runs
  one-liner             bf16 autocast (fp16 without bf16; fp32 on a CPU, as the tune's one-liner)
                        and fused AdamW at micro batch = global batch; an OOM is its result
  one-liner+compile     the same under torch.compile
  fallback              what a skilled user types after that OOM: every block checkpointed
                        (`gradient_checkpointing_enable()` for a Hugging Face model,
                        torch.utils.checkpoint around each block otherwise), the micro batch
                        halved until a step fits (Accelerate's find_executable_batch_size),
                        accumulation keeping the global batch
  fallback+8bit         the fallback with bitsandbytes' AdamW8bit (skipped, with the reason,
                        where bitsandbytes is not installed)

Each loop runs in its own process (gpu_check.py starts one per loop), on the spec's data and
global batch. Between attempts of one loop everything is freed and the peak statistics reset,
so the peak reported is the attempt that ran. The cap: on CUDA the allocator's
(`set_per_process_memory_fraction`), as a tune's trial child caps it; on a CPU the live-bytes
tracker the CPU trials use.
"""

import argparse
import contextlib
import gc
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from autofit.config.spec import load_spec  # noqa: E402
from autofit.device.memory import cap_cuda_memory, LiveBytesTracker  # noqa: E402
from autofit.workload import build_workload  # noqa: E402
from autofit.workload.blocks import find_block_stack  # noqa: E402

LOOPS = ("fp32", "tf32", "one-liner", "one-liner+compile", "fallback", "fallback+8bit")
WARMUP_STEPS = 2
MIN_STEPS = 3


def run_loop(spec_path: Path, name: str, *, budget_bytes: int | None, window_s: float) -> dict:
    spec = load_spec(spec_path)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if name == "fallback+8bit" and not _bitsandbytes():
        return {"status": "skipped", "reason": "bitsandbytes is not installed"}
    if cuda and budget_bytes:
        cap_cuda_memory(device, budget_bytes)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = name == "tf32"
    global_batch = spec.train.global_batch_size
    sizes = [m for m in range(global_batch, 0, -1) if global_batch % m == 0]
    if name.startswith("one-liner"):
        sizes = [global_batch]  # the one-liner as typed: the whole batch at once
    elif name.startswith("fallback"):
        sizes = [global_batch // 2**k for k in range(global_batch.bit_length()) if global_batch % 2**k == 0]
    tried = []
    for micro in sizes:
        try:
            out = _timed(spec, device, name, micro, global_batch // micro, window_s, budget_bytes)
            return out | {"tried_micro_batches": tried + [micro]}
        except torch.OutOfMemoryError as exc:
            tried.append(micro)
            last = str(exc).splitlines()[0][:300]
            _free(device)
    return {"status": "oom", "tried_micro_batches": tried, "reason": last}


@contextlib.contextmanager
def _cap(device: torch.device, budget_bytes: int | None):
    if device.type == "cuda" or not budget_bytes:
        yield None
        return
    with LiveBytesTracker(budget_bytes) as tracker:  # raises torch.OutOfMemoryError over the budget
        yield tracker


def _free(device: torch.device) -> None:
    # The failed attempt's model, optimizer and activations go before the next one starts.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _timed(spec, device, name: str, micro: int, accum: int, window_s: float, budget_bytes: int | None) -> dict:
    torch.manual_seed(spec.train.seed)
    workload = build_workload(spec)
    with torch.device(device):  # as the runner builds (random init on a GPU: seconds, not a minute)
        model = workload.build_model().to(device).train()
    if name.startswith("fallback"):
        _checkpoint_every_block(model)
    optimizer = _optimizer(spec, model, device, eight_bit=name.endswith("8bit"))
    stepper = torch.compile(model) if name.endswith("compile") else model
    dtype = _autocast_dtype(name, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    generator = torch.Generator().manual_seed(spec.train.seed)
    batches = [_to(workload.data.batch(micro, generator), device) for _ in range(accum)]

    def step() -> float:
        total = 0.0
        for batch in batches:
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = workload.loss_fn(stepper, batch) / accum
            scaler.scale(loss).backward()
            total += loss.detach().float()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.train.max_grad_norm or 1e9)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return float(total)  # a host sync: the step is done

    started = time.monotonic()
    # Warm-up (compile, allocator, cuDNN autotuning) under the cap. On a CPU the tracker that
    # holds it slows every op, so as in a CPU trial only these steps are tracked, not the timed.
    with _cap(device, budget_bytes) as tracker:
        if tracker is not None:  # made before the tracker: counted as a capped card holds them
            tracker.track([*model.parameters(), *model.buffers(), *(t for b in batches for t in tree_leaves(b))])
        losses = [step() for _ in range(WARMUP_STEPS)]
    warmup_s = time.monotonic() - started
    times = []
    while sum(times) < window_s or len(times) < MIN_STEPS:
        t = time.monotonic()
        losses.append(step())
        times.append(time.monotonic() - t)
    step_s = sorted(times)[len(times) // 2]
    out = {"status": "ok", "micro_batch_size": micro, "grad_accum_steps": accum,
           "samples_per_s": round(micro * accum / step_s, 2), "step_time_s": round(step_s, 4), "steps": len(times),
           "warmup_s": round(warmup_s, 1), "losses": [round(x, 5) for x in losses]}
    if tracker is not None:
        out["peak_tracked_bytes"] = tracker.peak_bytes
    if device.type == "cuda":
        out |= {"peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    return out


def _checkpoint_every_block(model: torch.nn.Module) -> None:
    if getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    found = find_block_stack(model)
    for block in found[1] if found else []:
        forward = block.forward
        block.forward = lambda *a, _f=forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)


def _optimizer(spec, model, device, *, eight_bit: bool):
    opt = spec.optimizer
    kwargs = {"lr": opt.lr, "weight_decay": opt.weight_decay or 0.0}
    if getattr(opt, "betas", None):
        kwargs["betas"] = tuple(opt.betas)
    if eight_bit:
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(model.parameters(), **kwargs)
    return torch.optim.AdamW(model.parameters(), fused=device.type == "cuda", **kwargs)


def _autocast_dtype(name: str, device: torch.device):
    if not (name.startswith("one-liner") or name.startswith("fallback")) or device.type != "cuda":
        return None  # the CPU's one-liner is fp32, as the tune's (tuning/tune.py ONE_LINER_CPU)
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def _bitsandbytes() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    return True


def _to(batch, device):
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    return tuple(v.to(device) for v in batch)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", type=Path)
    parser.add_argument("loop", choices=LOOPS)
    parser.add_argument("--budget-bytes", type=int, help="the memory cap (default: none)")
    parser.add_argument("--window-s", type=float, default=8.0, help="timed window after warm-up")
    args = parser.parse_args(argv)
    print(json.dumps(run_loop(args.spec, args.loop, budget_bytes=args.budget_bytes, window_s=args.window_s)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
