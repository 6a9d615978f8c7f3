"""`TrainConfig`: one point of the search space, as plain data (no torch). What a profile
records, a trial measures and a run applies (`autofit.train.configure` applies it to a model).

    config = TrainConfig(precision="bf16-mixed", micro_batch_size=8, grad_accum_steps=4)
    config.short()                        # 'bf16-mixed mb=8x4 ckpt=0 freeze=0'
"""

import dataclasses
from dataclasses import dataclass

from autofit.base.errors import SpecError
from autofit.config.knobs import KNOBS
from autofit.config.reader import read_as
from autofit.config.spec import ModelSpec, PRECISIONS

PARALLELISMS = ("none", "ddp", "fsdp")  # one process; DistributedDataParallel; FSDP2 fully_shard


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """One point of the search space; what a profile records and a run applies. The knob
    fields are the registry's (`autofit.config.knobs.KNOBS`: their values, rules and docs are
    there), written out at their place in a profile and at their defaults;
    tests/test_knob_registry.py checks the two agree."""

    precision: str = "32-true"  # 32-true | tf32 | 16-mixed | bf16-mixed | bf16-true
    micro_batch_size: int  # samples per forward/backward
    grad_accum_steps: int = 1  # micro batches per optimizer step
    checkpoint_blocks: int = 0  # blocks of the block stack with activation checkpointing
    checkpoint_policy: str = "full"  # knob: what a checkpointed block keeps (full | selective)
    freeze_blocks: int = 0  # embeddings + the first k blocks frozen (0: nothing frozen)
    length_bucketing: bool = False  # knob: each step's samples sorted by length (text data)
    # Data parallelism over `world_size` ranks (one process per GPU, launched by torchrun).
    # The defaults are one process, so profiles written before these fields load unchanged.
    parallelism: str = "none"  # none | ddp | fsdp
    world_size: int = 1  # ranks; each runs micro_batch_size x grad_accum_steps samples per step
    reshard_after_forward: bool = True  # fsdp: free the gathered weights after forward (ZeRO-3) or keep them (ZeRO-2)
    bucket_cap_mb: int = 25  # ddp: gradient bucket size, MiB (torch's default)
    gradient_as_bucket_view: bool = False  # ddp: gradients are views into the buckets (one copy fewer)
    # The knobs without an axis to follow, in registry order.
    optimizer_bits: int = 32  # knob: the optimizer's moments in 32 or 8 bits
    chunked_loss: bool = False  # knob: LM head + cross-entropy in chunks
    offload_activations: bool = False  # knob: blocks not checkpointed save activations to pinned host memory
    offload_optimizer: bool = False  # knob: optimizer state and step on the CPU (torchao)
    fsdp_offload: bool = False  # knob: FSDP2's CPUOffloadPolicy
    compile: bool = False  # knob: torch.compile of each block
    expandable_segments: bool = False  # knob: the CUDA allocator's expandable segments
    cudnn_benchmark: bool = False  # knob: cuDNN's autotuner

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise SpecError(f"precision: must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.parallelism not in PARALLELISMS:
            raise SpecError(f"parallelism: must be one of {', '.join(PARALLELISMS)}, got {self.parallelism!r}")
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
        for knob in KNOBS.values():
            knob.check(getattr(self, knob.name))
        for knob in KNOBS.values():
            if (why := knob.refusal(getattr(self, knob.name), self.precision, self.parallelism)) is not None:
                raise SpecError(why)
        # Inert knobs are reset to their defaults, so configs that differ only there are one
        # config (equal, one hash, measured once): the policy of no checkpointed block, and
        # another strategy's knobs.
        for knob in KNOBS.values():
            if knob.active_with is not None and getattr(self, knob.active_with) == 0:
                object.__setattr__(self, knob.name, knob.default)
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
        for knob in KNOBS.values():
            if out[knob.name] == knob.default:
                del out[knob.name]
        # A strategy's own knobs are written only with that strategy: a one-process profile
        # does not list DDP bucket sizes it never used.
        if self.parallelism != "fsdp":
            del out["reshard_after_forward"]
        if self.parallelism != "ddp":
            del out["bucket_cap_mb"], out["gradient_as_bucket_view"]
        return out

    @classmethod
    def from_dict(cls, raw: dict, *, where: str = "config") -> "TrainConfig":
        """A config as written in a profile, a checkpoint or a study; SpecError naming the key path."""
        return read_as(raw, cls, path=where)

    @classmethod
    def default_for(cls, spec: ModelSpec) -> "TrainConfig":
        """What a plain PyTorch job does: fp32, the whole global batch in one micro batch."""
        return cls(precision="32-true", micro_batch_size=spec.train.global_batch_size)

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def short(self) -> str:
        # A knob acting on an axis reads with it (ckpt=4sel); the others follow in registry order.
        tag = {k.name: k.tags.get(getattr(self, k.name), "") for k in KNOBS.values()}
        joined = {k.active_with: tag.pop(k.name) for k in KNOBS.values() if k.active_with}
        text = (f"{self.precision} mb={self.micro_batch_size}x{self.grad_accum_steps} "
                f"ckpt={self.checkpoint_blocks}{joined.get('checkpoint_blocks', '')} "
                f"freeze={self.freeze_blocks}" + "".join(f" {t}" for t in tag.values() if t))
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


@dataclass(frozen=True, kw_only=True, slots=True)
class Demotion:
    """One recovery: what ran out of memory, at which step, and what runs from there on."""

    step: int  # the optimizer step that was done again
    from_config: TrainConfig
    to_config: TrainConfig
    reason: str  # the error's first line
    time: str  # UTC, ISO 8601

    def to_dict(self) -> dict:
        return {"step": self.step, "from_config": self.from_config.to_dict(), "to_config": self.to_config.to_dict(),
                "reason": self.reason, "time": self.time}

    @classmethod
    def from_dict(cls, raw: dict) -> "Demotion":
        return cls(step=int(raw["step"]), from_config=TrainConfig.from_dict(raw["from_config"]),
                   to_config=TrainConfig.from_dict(raw["to_config"]), reason=str(raw["reason"]),
                   time=str(raw["time"]))
