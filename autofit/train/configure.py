"""Applying a `TrainConfig`: block-stack discovery, activation checkpointing (whole blocks,
or selective per op), freezing, the knobs' hook objects (`KnobHook`: model, optimizer and
batch entries) with `prepare_batch`, the one way a micro batch reaches the step; and the
micro-batch floor of models whose layers normalise over the batch."""

import contextlib
import os

import torch
from torch import nn
from loguru import logger
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autofit.base.errors import SpecError
from autofit.config.knobs import CHECKPOINT_POLICIES, KNOBS
from autofit.config.train_config import MicroBatchFloor, TrainConfig
from autofit.device.alloc_conf import ALLOC_CONF_ENV, set_expandable_segments
from autofit.device.compiler_cache import use_inductor_cache
from autofit.train.offload import offload_activations, offload_optimizer
from autofit.workload import Batch, batch_to
from autofit.workload.blocks import Blocks, find_block_stack

__all__ = ["find_block_stack"]  # re-exported: FSDP2's units and the estimator's shards cut the same stack

# CHECKPOINT_POLICIES: what a checkpointed block keeps for backward. `full`: only its input
# (the whole block is recomputed); `selective`: also the outputs of its matmul and attention
# ops (SAVE_MATMUL_ATTENTION), so backward recomputes only the cheap ops between them.

# The one place a private torch API is used: the checkpoint wrapper that torchtitan and
# FSDP use. It keeps state_dict keys unchanged, which plain torch.utils.checkpoint in a
# hand-made wrapper would not. tests/test_knobs.py fails loudly if torch moves it.
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: E402
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)


def block_count(model: nn.Module) -> int:
    stack = find_block_stack(model)
    return 0 if stack is None else len(stack[1])


def _require_stack(model: nn.Module, what: str) -> tuple[str, Blocks]:
    stack = find_block_stack(model)
    if stack is None:
        raise SpecError(f"{what}: this model has no block stack (same-type blocks in an nn.ModuleList or "
                        f"nn.Sequential; model.blocks names one), so {what} cannot be applied; set it to 0")
    return stack


def spread_indices(n_blocks: int, n_chosen: int, first: int = 0) -> list[int]:
    """`n_chosen` block indices spread evenly over blocks `first`..`n_blocks - 1`, starting
    at `first` (the first trainable blocks' activations live longest, so they are the best
    ones to drop; frozen blocks before `first` save no activations to drop)."""
    if n_chosen <= 0:
        return []
    span = n_blocks - first
    return sorted({first + (i * span) // n_chosen for i in range(n_chosen)})


# The selective policy, after torchtitan's op-level SAC: the outputs of these ops are saved,
# everything else in a checkpointed block is recomputed in backward. Matmuls and attention
# are nearly all of a block's FLOPs; the norms, activation functions, dropout and residual
# adds between them cost little to redo, and what they would keep is what selective frees.
SAVE_MATMUL_ATTENTION = frozenset({
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten.convolution.default,  # a convnet's matmuls: without it its blocks would save nothing
})


def save_matmul_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """`selective`'s policy for `create_selective_checkpoint_contexts`: keep matmul, attention
    (and convolution) outputs, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVE_MATMUL_ATTENTION else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(save_matmul_attention)


@contextlib.contextmanager
def _running_stats_kept(norms: list[nn.Module]):
    """Around a checkpointed block's recomputation: its BatchNorm layers update scratch
    copies of their running statistics, so a step updates them once, as without
    checkpointing. The ops and what they save are the forward's (a norm without running
    statistics would save other tensors, which the checkpoint refuses)."""
    kept = [(norm, {name: getattr(norm, name) for name in _RUNNING_STATS if getattr(norm, name) is not None})
            for norm in norms]
    for norm, buffers in kept:
        for name, buffer in buffers.items():
            setattr(norm, name, buffer.clone())
    try:
        yield
    finally:
        for norm, buffers in kept:
            for name, buffer in buffers.items():
                setattr(norm, name, buffer)


_RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")


def _context_fn(block: nn.Module, policy: str):
    """The checkpoint's (forward, recompute) contexts for `block`: the selective policy's,
    and BatchNorm's statistics kept from a second update. None: torch's default."""
    norms = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not norms:
        return _selective_contexts if policy == "selective" else None

    def contexts():
        forward, recompute = (_selective_contexts() if policy == "selective"
                              else (contextlib.nullcontext(), contextlib.nullcontext()))
        # The copies are made before the selective policy's recompute mode replays ops.
        return forward, _joined(_running_stats_kept(norms), recompute)

    return contexts


@contextlib.contextmanager
def _joined(*contexts):
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def apply_checkpointing(model: nn.Module, n_blocks: int, *, first_block: int = 0, policy: str = "full") -> list[int]:
    """Wrap `n_blocks` blocks of the stack in non-reentrant activation checkpointing, spread
    over the blocks from `first_block` on (pass the frozen block count: a frozen block keeps
    no activations for backward, so checkpointing it would save nothing). `policy` is what
    each wrapped block keeps: `full` (its input) or `selective` (its matmul and attention
    outputs too, `save_matmul_attention`)."""
    if policy not in CHECKPOINT_POLICIES:
        raise SpecError(f"checkpoint_policy: must be one of {', '.join(CHECKPOINT_POLICIES)}, got {policy!r}")
    if n_blocks == 0:
        return []
    name, stack = _require_stack(model, "checkpoint_blocks")
    if n_blocks > len(stack) - first_block:
        frozen = f" after the {first_block} frozen ones" if first_block else ""
        raise SpecError(f"checkpoint_blocks: this model has {len(stack) - first_block} blocks{frozen} "
                        f"in {name} to checkpoint, got {n_blocks}")
    chosen = spread_indices(len(stack), n_blocks, first_block)
    for i in chosen:
        if not isinstance(stack[i], CheckpointWrapper):
            # The contexts are made afresh for every forward (the checkpoint calls context_fn
            # each time): the selective policy's hold that forward's saved outputs.
            context_fn = _context_fn(stack[i], policy)
            extra = {"context_fn": context_fn} if context_fn is not None else {}
            stack[i] = checkpoint_wrapper(stack[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT, **extra)
    return chosen


def apply_freezing(model: nn.Module, n_blocks: int) -> int:
    """Freeze every embedding plus the first `n_blocks` blocks; returns frozen parameter count.

    Embeddings are the model's input layers; a head whose weight is tied to an embedding
    (HF GPT-2) is frozen with it, since it is the same tensor.
    """
    if n_blocks == 0:
        return 0
    name, stack = _require_stack(model, "freeze_blocks")
    if n_blocks > len(stack):
        raise SpecError(f"freeze_blocks: this model has {len(stack)} blocks in {name}, got {n_blocks}")
    frozen: list[nn.Module] = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    frozen += list(stack[:n_blocks])
    count = 0
    for module in frozen:
        for p in module.parameters():
            if p.requires_grad:
                p.requires_grad_(False)
                count += p.numel()
    return count


# inductor: what `torch.compile` uses by default, and what runs on a GPU; on a CPU it needs
# a C++ compiler (g++ on a Debian-like machine). AUTOFIT_COMPILE_BACKEND names another
# torch.compile backend: `aot_eager` traces the same graphs with no code generation (where
# no compiler is at hand, and in the tests, where inductor's compile takes tens of seconds).
COMPILE_BACKEND_ENV = "AUTOFIT_COMPILE_BACKEND"


def prepare_process(config: TrainConfig, state_dir=None) -> None:
    """The process-wide part of `config`, set before CUDA starts (`autofit train`,
    `profile.apply`, the trial child): the allocator's expandable segments (read once, when
    CUDA starts: set later it is ignored, and said so), and for a compiled config inductor's
    cache in the state folder, so the graphs the tune compiled are loaded, not compiled again."""
    if set_expandable_segments(config.expandable_segments):
        logger.warning("expandable_segments={}: CUDA had started, so the allocator keeps its setting; set "
                       "{} before CUDA starts (as `autofit train` does)", config.expandable_segments, ALLOC_CONF_ENV)
    if config.compile:
        use_inductor_cache(state_dir)


def compile_backend() -> str:
    return os.environ.get(COMPILE_BACKEND_ENV) or "inductor"


def compile_count() -> int:
    """Graphs compiled in this process so far: Dynamo's captured graphs and inductor's
    compiled (or cache-loaded) forward and backward graphs. A step that raises it compiled
    something, so its time is not steady-state time. torch's own counters (a private
    structure; tests/test_knobs.py fails loudly if torch changes it)."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return counters["stats"]["unique_graphs"] + sum(inductor[f"fxgraph_cache_{k}"] for k in ("miss", "hit", "bypass"))


def apply_compile(model: nn.Module) -> list[str]:
    """`torch.compile` each block of the block stack in place, or the whole model when it has
    no stack; returns the names compiled. In place (`nn.Module.compile`): state_dict keys and
    checkpoint wrappers stay as they are. Per block, as torchtitan does: the blocks share one
    compiled graph (their parameters are its inputs), so compiling costs one block's time, not
    the model's. `fullgraph`: a graph break in a block is a compile failure, since what it
    leaves eager is the time compiling was meant to save. Compiling happens at the first
    forward (and backward), not here."""
    use_inductor_cache()
    stack = find_block_stack(model)
    targets = list(zip(stack[1].names, stack[1])) if stack else [("", model)]
    for _, module in targets:
        module.compile(backend=compile_backend(), fullgraph=True)
    return [name for name, _ in targets]


class KnobHook:
    """The training side of one registry knob (`autofit.config.knobs.KNOBS`), after
    torchtitan's `ModelConverter`: one object owns every point where the knob acts. For a
    config whose value of the knob is not its default, in this order:

    1. `model(model, value)`: once, in place, after freezing and checkpointing and before the
       model is placed on its device (and wrapped by DDP or FSDP2), in registry order;
    2. `optimizer(optimizer, value)`: once, on the optimizer built over the trainable
       parameters (`autofit.train.optim.build_optimizer`, or a plan's factory); returns the
       optimizer the step uses (the same one, or one that wraps it);
    3. `batch(batch, value)`: every micro batch, once it is on the device and in the weights'
       dtype, before the forward (`prepare_batch`, the runner's and the plan's alike).

    Each entry does nothing by default; a hook overrides the entries where its knob acts. Its
    memory rule is the row's (`holds_more`, `calibrated_apart`), its exports the row's `exports`."""

    def model(self, model: nn.Module, value) -> None:
        pass

    def optimizer(self, optimizer: torch.optim.Optimizer, value) -> torch.optim.Optimizer:
        return optimizer

    def batch(self, batch, value):
        return batch


class _Compile(KnobHook):
    def model(self, model: nn.Module, value) -> None:
        apply_compile(model)


class _CudnnBenchmark(KnobHook):
    def model(self, model: nn.Module, value) -> None:
        apply_cudnn_benchmark(value)


class _OffloadActivations(KnobHook):
    def model(self, model: nn.Module, value) -> None:
        # After checkpointing (apply_config): the checkpointed blocks keep their inputs only.
        _, stack = _require_stack(model, "offload_activations")
        offload_activations(model, [i for i, b in enumerate(stack) if isinstance(b, CheckpointWrapper)])


class _OffloadOptimizer(KnobHook):
    def optimizer(self, optimizer: torch.optim.Optimizer, value) -> torch.optim.Optimizer:
        return offload_optimizer(optimizer)


# The hook objects of the registry's knobs applied here, keyed by knob name. A knob applied
# elsewhere (the optimizer's implementation, the loss, the data, the allocator) names its
# place in its row's `applied_by`.
HOOKS: dict[str, KnobHook] = {
    "offload_activations": _OffloadActivations(),
    "offload_optimizer": _OffloadOptimizer(),
    "compile": _Compile(),  # last of the model entries: a checkpointed block is compiled with it
    "cudnn_benchmark": _CudnnBenchmark(),
}


def _active_hooks(config: TrainConfig) -> list[tuple[KnobHook, object]]:
    """(hook, value) of each hooked knob away from its default, in registry order."""
    return [(HOOKS[knob.name], value) for knob in KNOBS.values()
            if knob.name in HOOKS and (value := getattr(config, knob.name)) != knob.default]


def apply_cudnn_benchmark(on: bool) -> None:
    """cuDNN's autotuner for this process: each convolution's algorithm is timed at its first
    shape and the fastest kept. Process-wide, so the profile's flags record it (`process_flags`)
    and `autofit train` / `profile.apply` set it again."""
    torch.backends.cudnn.benchmark = on


def apply_config(model: nn.Module, config: TrainConfig) -> nn.Module:
    """Freezing, checkpointing and the knobs' model entries (compiling), in place; returns the
    model for chaining."""
    apply_freezing(model, config.freeze_blocks)
    apply_checkpointing(model, config.checkpoint_blocks, first_block=config.freeze_blocks,
                        policy=config.checkpoint_policy)
    for hook, value in _active_hooks(config):
        hook.model(model, value)
    return model


def apply_optimizer_hooks(optimizer: torch.optim.Optimizer, config: TrainConfig) -> torch.optim.Optimizer:
    """The knobs' optimizer entries on a freshly built `optimizer`; the optimizer to step."""
    for hook, value in _active_hooks(config):
        optimizer = hook.optimizer(optimizer, value)
    return optimizer


def prepare_batch(batch: Batch, config: TrainConfig, param_dtype: torch.dtype, device: torch.device) -> Batch:
    """A micro batch as the step takes it, the runner's and a plan's alike: on `device`, its
    float inputs in `param_dtype` (bf16 weights cannot multiply fp32 activations; token ids
    stay integers), then the knobs' batch entries."""
    if param_dtype != torch.float32:
        batch = cast_floats(batch, param_dtype)
    batch = batch_to(batch, device)
    for hook, value in _active_hooks(config):
        batch = hook.batch(batch, value)
    return batch


def cast_floats(batch, dtype: torch.dtype):
    if isinstance(batch, dict):
        return {k: cast_floats(v, dtype) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(cast_floats(v, dtype) for v in batch)
    return batch.to(dtype) if batch.is_floating_point() else batch


def trainable_parameters(model: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# ---- knobs that change the math ------------------------------------------------------------

# Layers whose output for one sample depends on the other samples of its micro batch: their
# statistics are the micro batch's, so the micro batch size changes the gradients, not only
# the speed, and accumulation is not exact.
BATCH_STATISTICS_LAYERS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
                           nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d)
# Below 16 samples BatchNorm's statistics are noisy enough to change what is learned (Wu &
# He, "Group Normalization", 2018: its error rises as the batch per device shrinks below 16).
BATCHNORM_MIN_MICRO_BATCH = 16


def micro_batch_floor(model: nn.Module, rank_batch_size: int, requested: int | None, *,
                      per_sample: bool = True) -> MicroBatchFloor | None:
    """The floor for `model` whose ranks each take `rank_batch_size` samples a step: the
    whole batch when the loss couples its samples (`per_sample` false: in-batch negatives),
    else `requested` (search.min_micro_batch_size) when set, else BATCHNORM_MIN_MICRO_BATCH
    for a model with batch-statistics layers, else none. Never above the rank's batch."""
    if not per_sample:
        return MicroBatchFloor(size=rank_batch_size, excludes_accumulation=True,
                               reason="loss.per_sample is false: the loss couples the samples of a batch (in-batch "
                                      "negatives), so a micro batch is the whole batch")
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, BATCH_STATISTICS_LAYERS):
            counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    layers = ", ".join(f"{count} {name}" for name, count in counts.items())
    if requested is not None:
        reason = f"search.min_micro_batch_size is {requested}" + (f" (the model has {layers})" if layers else "")
    elif counts:
        reason = (f"the model has {layers}: each micro batch normalizes over its own samples, so a smaller micro "
                  f"batch changes the gradients, not only the speed; set search.min_micro_batch_size to change "
                  f"the floor of {BATCHNORM_MIN_MICRO_BATCH}")
    else:
        return None
    size = min(requested or BATCHNORM_MIN_MICRO_BATCH, rank_batch_size)
    return MicroBatchFloor(size=size, excludes_accumulation=size >= rank_batch_size, reason=reason)
