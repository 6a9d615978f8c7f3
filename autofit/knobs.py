"""`TrainConfig` and applying it to a model: block-stack discovery, activation
checkpointing (whole blocks, or selective per op) and freezing."""

import dataclasses
import os
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autofit.errors import SpecError
from autofit.spec import CHECKPOINT_POLICIES, PRECISIONS, ModelSpec

PARALLELISMS = ("none", "ddp", "fsdp")  # one process; DistributedDataParallel; FSDP2 fully_shard
OPTIMIZER_BITS = (32, 8)  # the optimizer's moments in fp32, or blockwise 8-bit (bitsandbytes)
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


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """One point of the search space; what a profile records and a run applies."""

    precision: str = "32-true"  # 32-true | tf32 | 16-mixed | bf16-mixed | bf16-true
    micro_batch_size: int  # samples per forward/backward
    grad_accum_steps: int = 1  # micro batches per optimizer step
    checkpoint_blocks: int = 0  # blocks of the block stack with activation checkpointing
    checkpoint_policy: str = "full"  # full | selective: what each checkpointed block keeps (see CHECKPOINT_POLICIES)
    freeze_blocks: int = 0  # embeddings + the first k blocks frozen (0: nothing frozen)
    # Text data: each step's samples sorted by length before the micro batches are cut, so
    # dynamic padding pads less. The step trains on the same samples: the update is the same.
    length_bucketing: bool = False
    # Data parallelism over `world_size` ranks (one process per GPU, launched by torchrun).
    # The defaults are one process, so profiles written before these fields load unchanged.
    parallelism: str = "none"  # none | ddp | fsdp
    world_size: int = 1  # ranks; each runs micro_batch_size x grad_accum_steps samples per step
    reshard_after_forward: bool = True  # fsdp: free the gathered weights after forward (ZeRO-3) or keep them (ZeRO-2)
    bucket_cap_mb: int = 25  # ddp: gradient bucket size, MiB (torch's default)
    gradient_as_bucket_view: bool = False  # ddp: gradients are views into the buckets (one copy fewer)
    # Memory knobs that change numerics or the loss's code path; opt-in in `search`. The
    # defaults are what every run did before them, so older profiles load unchanged.
    optimizer_bits: int = 32  # 32: the moments in fp32; 8: blockwise 8-bit moments (bitsandbytes AdamW8bit)
    chunked_loss: bool = False  # LM heads: head + cross-entropy in chunks, the full logits never exist
    # torch.compile of each block (the whole model without a block stack); compile time is
    # measured apart from throughput.
    compile: bool = False

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise SpecError(f"precision: must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.parallelism not in PARALLELISMS:
            raise SpecError(f"parallelism: must be one of {', '.join(PARALLELISMS)}, got {self.parallelism!r}")
        if self.checkpoint_policy not in CHECKPOINT_POLICIES:
            raise SpecError(f"checkpoint_policy: must be one of {', '.join(CHECKPOINT_POLICIES)}, "
                            f"got {self.checkpoint_policy!r}")
        for name in ("reshard_after_forward", "gradient_as_bucket_view"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        for name in ("micro_batch_size", "grad_accum_steps", "world_size", "bucket_cap_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(f"{name}: must be a positive integer, got {value!r}")
        for name in ("checkpoint_blocks", "freeze_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SpecError(f"{name}: must be an integer >= 0, got {value!r}")
        for name in ("length_bucketing", "chunked_loss", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.optimizer_bits, bool) or self.optimizer_bits not in OPTIMIZER_BITS:
            raise SpecError(f"optimizer_bits: must be 32 or 8, got {self.optimizer_bits!r}")
        if self.optimizer_bits == 8 and self.precision == "bf16-true":
            # bf16 weights need the Kahan-compensated update (torch-optimi), which has no
            # 8-bit state; bitsandbytes' update to a bf16 weight rounds small steps away.
            raise SpecError("optimizer_bits: 8-bit state needs fp32 weights; bf16-true keeps bf16 weights "
                            "(use optimizer_bits 32 with bf16-true, or another precision)")
        if self.optimizer_bits == 8 and self.parallelism == "fsdp":
            raise SpecError("optimizer_bits: 8-bit state does not run under FSDP2 (bitsandbytes' update takes no "
                            "DTensor shards); use parallelism ddp or optimizer_bits 32")
        if self.chunked_loss and self.parallelism != "none":
            # The chunked loss reads the head's weight outside the model's forward, where
            # DDP's and FSDP2's hooks do not see it.
            raise SpecError(f"chunked_loss: runs in one process only, got parallelism {self.parallelism}")
        # Inert knobs are reset to their defaults, so configs that differ only there are one
        # config (equal, one hash, measured once): the policy of no checkpointed block, and
        # another strategy's knobs.
        if self.checkpoint_blocks == 0:
            object.__setattr__(self, "checkpoint_policy", "full")
        if self.parallelism != "fsdp":
            object.__setattr__(self, "reshard_after_forward", True)
        if self.parallelism != "ddp":
            object.__setattr__(self, "bucket_cap_mb", 25)
            object.__setattr__(self, "gradient_as_bucket_view", False)
        if self.parallelism == "none" and self.world_size != 1:
            raise SpecError(f"world_size: parallelism none runs one process, got world_size={self.world_size}; "
                            f"set parallelism to ddp or fsdp")

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.world_size

    @property
    def rank_batch_size(self) -> int:
        """Samples one rank processes per optimizer step."""
        return self.micro_batch_size * self.grad_accum_steps

    @property
    def distributed(self) -> bool:
        return self.parallelism != "none"

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        # Knobs at their defaults are left out: a profile mentions what it changes, and the
        # records of configs that never had these knobs stay as they were.
        for name, default in (("length_bucketing", False), ("optimizer_bits", 32), ("chunked_loss", False),
                              ("checkpoint_policy", "full"), ("compile", False)):
            if out[name] == default:
                del out[name]
        # A strategy's own knobs are written only with that strategy: a one-process profile
        # does not list DDP bucket sizes it never used.
        if self.parallelism != "fsdp":
            del out["reshard_after_forward"]
        if self.parallelism != "ddp":
            del out["bucket_cap_mb"], out["gradient_as_bucket_view"]
        return out

    @classmethod
    def from_dict(cls, raw: dict, *, where: str = "config") -> "TrainConfig":
        if not isinstance(raw, dict):
            raise SpecError(f"{where}: expected a mapping, got {raw!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - fields)
        if unknown:
            raise SpecError(f"{where}.{unknown[0]}: unknown key; allowed: {', '.join(sorted(fields))}")
        try:
            return cls(**raw)
        except SpecError as exc:
            raise SpecError(f"{where}.{exc}") from None
        except TypeError as exc:  # a required field missing
            raise SpecError(f"{where}: {exc}") from None

    @classmethod
    def default_for(cls, spec: ModelSpec) -> "TrainConfig":
        """What a plain PyTorch job does: fp32, the whole global batch in one micro batch."""
        return cls(precision="32-true", micro_batch_size=spec.train.global_batch_size)

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def short(self) -> str:
        text = (f"{self.precision} mb={self.micro_batch_size}x{self.grad_accum_steps} "
                f"ckpt={self.checkpoint_blocks}{'sel' if self.checkpoint_policy == 'selective' else ''} "
                f"freeze={self.freeze_blocks}"
                + (" bucketed" if self.length_bucketing else "")
                + (" adam8bit" if self.optimizer_bits == 8 else "")
                + (" chunked-ce" if self.chunked_loss else "")
                + (" compiled" if self.compile else ""))
        if self.parallelism == "fsdp":
            text += f" fsdp x{self.world_size}" + ("" if self.reshard_after_forward else " keep-gathered")
        elif self.parallelism == "ddp":
            text += f" ddp x{self.world_size}" + (" bucket-view" if self.gradient_as_bucket_view else "")
        return text


def with_overrides(config: TrainConfig, overrides: dict[str, str], *, global_batch_size: int) -> TrainConfig:
    """Apply `--set key=value` pairs; micro batch and accumulation stay consistent with the
    fixed global batch (giving one derives the other)."""
    fields = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    values = config.to_dict()
    for key, text in overrides.items():
        if key not in fields:
            raise SpecError(f"--set {key}: unknown key; allowed: {', '.join(fields)}")
        if fields[key] is str:
            values[key] = text
        elif fields[key] is bool:
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise SpecError(f"--set {key}: must be true or false, got {text!r}")
            values[key] = text.lower() in ("true", "1", "yes")
        else:
            try:
                values[key] = int(text)
            except ValueError:
                raise SpecError(f"--set {key}: must be an integer, got {text!r}") from None
    if "world_size" in overrides and "parallelism" not in overrides and values["world_size"] > 1 \
            and values["parallelism"] == "none":
        values["parallelism"] = "ddp"  # several ranks and no strategy named: plain data parallel
    # Each rank's share of the global batch; micro batch x accumulation must fill it.
    world = values["world_size"] if isinstance(values["world_size"], int) and values["world_size"] > 0 else 1
    if global_batch_size % world:
        raise SpecError(f"--set world_size: must divide the global batch size {global_batch_size}, got {world}")
    rank_batch = global_batch_size // world
    if "micro_batch_size" in overrides and "grad_accum_steps" not in overrides:
        micro = values["micro_batch_size"]
        if micro < 1 or rank_batch % micro:
            raise SpecError(f"--set micro_batch_size: must divide the per-rank batch size "
                            f"{rank_batch} (global {global_batch_size} / world size {world}), got {micro}")
        values["grad_accum_steps"] = rank_batch // micro
    elif "grad_accum_steps" in overrides and "micro_batch_size" not in overrides:
        accum = values["grad_accum_steps"]
        if accum < 1 or rank_batch % accum:
            raise SpecError(f"--set grad_accum_steps: must divide the per-rank batch size "
                            f"{rank_batch}, got {accum}")
        values["micro_batch_size"] = rank_batch // accum
    elif "world_size" in overrides and "micro_batch_size" not in overrides:
        # Keep the micro batch where it can; the accumulation makes up the rest.
        micro = values["micro_batch_size"] if rank_batch % values["micro_batch_size"] == 0 else rank_batch
        values["micro_batch_size"], values["grad_accum_steps"] = micro, rank_batch // micro
    new = TrainConfig.from_dict(values)
    check_global_batch(new, global_batch_size)
    return new


def check_global_batch(config: TrainConfig, global_batch_size: int) -> None:
    if config.global_batch_size != global_batch_size:
        if config.world_size > 1:
            raise SpecError(
                f"micro_batch_size x grad_accum_steps x world_size must equal train.global_batch_size "
                f"({global_batch_size}), got {config.micro_batch_size} x {config.grad_accum_steps} x "
                f"{config.world_size} = {config.global_batch_size}")
        raise SpecError(
            f"micro_batch_size x grad_accum_steps must equal train.global_batch_size ({global_batch_size}), "
            f"got {config.micro_batch_size} x {config.grad_accum_steps} = {config.global_batch_size}")


def find_block_stack(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The largest `nn.ModuleList` whose modules all share one type: GPT blocks,
    `transformer.h` in GPT-2, `bert.encoder.layer` in BERT."""
    best = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        inner = [_unwrap(m) for m in module]
        if len({type(m) for m in inner}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or (len(module), size) > (len(best[1]), best[2]):
            best = (name, module, size)
    return None if best is None else (best[0], best[1])


def block_count(model: nn.Module) -> int:
    stack = find_block_stack(model)
    return 0 if stack is None else len(stack[1])


def _unwrap(module: nn.Module) -> nn.Module:
    return module._checkpoint_wrapped_module if isinstance(module, CheckpointWrapper) else module


def _require_stack(model: nn.Module, what: str) -> tuple[str, nn.ModuleList]:
    stack = find_block_stack(model)
    if stack is None:
        raise SpecError(f"{what}: this model has no block stack (an nn.ModuleList of same-type "
                        f"modules), so {what} cannot be applied; set it to 0")
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
    # The selective policy's contexts are made afresh for every forward (the checkpoint
    # calls context_fn each time): they hold that forward's saved outputs.
    extra = {"context_fn": _selective_contexts} if policy == "selective" else {}
    for i in chosen:
        if not isinstance(stack[i], CheckpointWrapper):
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
    stack = find_block_stack(model)
    targets = [(f"{stack[0]}.{i}", block) for i, block in enumerate(stack[1])] if stack else [("", model)]
    for _, module in targets:
        module.compile(backend=compile_backend(), fullgraph=True)
    return [name for name, _ in targets]


def apply_config(model: nn.Module, config: TrainConfig) -> nn.Module:
    """Freezing, checkpointing and compiling, in place; returns the model for chaining."""
    apply_freezing(model, config.freeze_blocks)
    apply_checkpointing(model, config.checkpoint_blocks, first_block=config.freeze_blocks,
                        policy=config.checkpoint_policy)
    if config.compile:  # last: a checkpointed block is compiled with its checkpointing
        apply_compile(model)
    return model


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


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatchFloor:
    """The smallest micro batch a model may run, and why."""

    size: int
    excludes_accumulation: bool  # the floor is the whole (per-rank) batch: one micro batch per step
    reason: str

    def describe(self) -> str:
        rule = "accumulation excluded" if self.excludes_accumulation else f"micro batch >= {self.size}"
        return f"{rule}: {self.reason}"

    def to_dict(self) -> dict:
        return {"size": self.size, "excludes_accumulation": self.excludes_accumulation, "reason": self.reason}


def micro_batch_floor(model: nn.Module, rank_batch_size: int, requested: int | None) -> MicroBatchFloor | None:
    """The floor for `model` whose ranks each take `rank_batch_size` samples a step:
    `requested` (search.min_micro_batch_size) when set, else BATCHNORM_MIN_MICRO_BATCH for a
    model with batch-statistics layers, else none. Never above the rank's batch."""
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

