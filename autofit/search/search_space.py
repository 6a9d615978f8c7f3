"""The search space: every knob's allowed values, declared in one place (`SearchSpace.knobs`).

The option knobs come from the registry (`autofit.config.knobs.KNOBS`): adding a row there
gives `SearchSpace` its field of allowed values and declares its `Knob`; their roles and
rules decide seeds, planned twins and coherence. Suggesting, enqueueing, the grid, its size
and the neighbours all follow from the declarations.
"""

import itertools
from dataclasses import dataclass

import optuna

from autofit.config.knobs import choice_fields, coherent, KNOBS
from autofit.config.train_config import MicroBatchFloor, TrainConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class Knob:
    """One dimension of the space.

    `field` is the `TrainConfig` field it sets; `param` the Optuna parameter name (stored in
    studies: renaming it orphans every stored study). An ordered knob is suggested as an
    integer (the value itself when `values` is 0..n, else its index), so TPE models its
    order; an unordered one as a categorical. `steps` are the one-knob moves tried around a
    config, nearest first."""

    field: str
    param: str
    values: tuple
    ordered: bool = True
    steps: tuple[int, ...] = (1, -1)

    @property
    def by_value(self) -> bool:
        """Suggested as the value itself (values are exactly 0, 1, ..., n)."""
        return self.ordered and self.values == tuple(range(len(self.values)))

    def suggest(self, trial: optuna.Trial):
        if not self.ordered:
            return trial.suggest_categorical(self.param, self.values)
        index = trial.suggest_int(self.param, 0, len(self.values) - 1)
        return self.values[index]

    def encode(self, value):
        """The Optuna parameter value for `value`."""
        return self.values.index(value) if self.ordered and not self.by_value else value


@dataclass(frozen=True, kw_only=True, slots=True)
@choice_fields(spec=False)
class SearchSpace:
    """Every knob's allowed values. micro batch x accumulation is always the global batch.
    Besides the fields below, one field per registry knob (named by its `KnobDef.choices`)
    holding its allowed values: declared as a knob only with a choice; a single value is
    what every config runs."""

    global_batch_size: int
    precisions: tuple[str, ...]
    micro_batch_sizes: tuple[int, ...]  # divisors of the global batch, ascending
    max_checkpoint_blocks: int
    max_freeze_blocks: int
    # Ranks (`--nproc`). Above 1 the strategy and its memory knobs join the space, and the
    # micro batches divide each rank's share of the global batch.
    world_size: int = 1
    parallelisms: tuple[str, ...] = ("ddp", "fsdp")
    # Why `micro_batch_sizes` starts where it does (a model with BatchNorm); None: every divisor.
    micro_batch_floor: MicroBatchFloor | None = None
    # Memory knobs the device turned on rather than the spec (the chunked loss of a large
    # vocabulary head on CUDA): tried as refinements of the leaders, like the "refine" rows,
    # not as seed groups of their own.
    refined: tuple[str, ...] = ()

    def knobs(self) -> tuple[Knob, ...]:
        """The knobs, in the order Optuna suggests them. Add a new knob here."""
        knobs = (
            Knob(field="precision", param="precision", values=self.precisions, ordered=False),
            Knob(field="micro_batch_size", param="micro_batch_index", values=self.micro_batch_sizes),
            Knob(field="checkpoint_blocks", param="checkpoint_blocks",
                 values=tuple(range(self.max_checkpoint_blocks + 1)), steps=(-1, 1)),
            Knob(field="freeze_blocks", param="freeze_blocks", values=tuple(range(self.max_freeze_blocks + 1))),
        )
        # Option knobs are declared only where they have a choice (and the axis they act on
        # exists): studies without them keep their parameters.
        axes = {"checkpoint_blocks": self.max_checkpoint_blocks}
        knobs += tuple(Knob(field=k.name, param=k.name, values=getattr(self, k.choices), ordered=False)
                       for k in KNOBS.values()
                       if len(getattr(self, k.choices)) > 1 and (k.active_with is None or axes[k.active_with]))
        if self.world_size == 1:
            return knobs
        # A strategy's knob is inert under the other strategy (TrainConfig resets it), so
        # those pairs are one config and are measured once.
        return knobs + (
            Knob(field="parallelism", param="parallelism", values=self.parallelisms, ordered=False),
            Knob(field="reshard_after_forward", param="reshard_after_forward", values=(True, False), ordered=False),
            Knob(field="gradient_as_bucket_view", param="gradient_as_bucket_view", values=(True, False),
                 ordered=False),
        )

    def strategies(self) -> list[dict]:
        """The strategies seeds start from, each with its leaner memory setting (FSDP2
        resharding after forward, DDP gradients as bucket views)."""
        if self.world_size == 1:
            return [{}]
        lean = {"ddp": {"gradient_as_bucket_view": True}, "fsdp": {"reshard_after_forward": True}}
        return [{"parallelism": p, **lean[p]} for p in self.parallelisms]

    def kept(self, config: TrainConfig) -> dict:
        """What the configs planned around `config` keep of it besides precision, micro batch,
        checkpointing and freezing: its strategy, its memory knobs and its "twin" knobs. Not
        its refinement knobs (compile, ...): those are tried on the leaders only."""
        return (self.strategy_of(config) | self.memory_knobs_of(config)
                | {k.name: getattr(config, k.name) for k in self._searched("twin")})

    def strategy_of(self, config: TrainConfig) -> dict:
        """`config`'s strategy and its memory knobs ({} on one rank)."""
        if self.world_size == 1:
            return {}
        return {name: getattr(config, name) for name in ("parallelism", "reshard_after_forward",
                                                         "gradient_as_bucket_view")}

    def lean(self, precision: str, strategy: dict | None = None) -> dict:
        """The memory knobs at their most frugal that `precision` and `strategy` allow ({}
        when the space has no choice): where seeds look for micro batches the plain settings
        cannot fit."""
        parallelism = (strategy or {}).get("parallelism", "none")
        return {k.name: k.lean for k in self._searched("memory")
                if k.lean in getattr(self, k.choices) and k.refusal(k.lean, precision, parallelism) is None}

    def seed_group(self, config: TrainConfig) -> tuple:
        """The seeds `config` counts for: its precision, its strategy and its memory knobs.
        Each group's seed is measured before another's best is refined."""
        return (config.precision, tuple(self.strategy_of(config).items()),
                tuple(self.memory_knobs_of(config).items()))

    def memory_knobs_of(self, config: TrainConfig) -> dict:
        """`config`'s searched memory knobs ({} when none is searched)."""
        return {k.name: getattr(config, k.name) for k in self._searched("memory")}

    def _searched(self, role: str) -> list:
        """The registry's knobs of `role` with a choice in this space (refined ones apart)."""
        return [k for k in KNOBS.values() if k.role == role and len(getattr(self, k.choices)) > 1
                and k.name not in self.refined]

    def refine_knobs(self) -> list:
        """The knobs tried only on the leaders (`seeding.refinements`): the "refine" rows and
        the `refined` memory knobs with a choice in this space. The sampler never proposes them."""
        return [k for k in KNOBS.values() if len(getattr(self, k.choices)) > 1
                and (k.role == "refine" or k.name in self.refined)]

    def config(self, precision: str, micro_batch_size: int, checkpoint_blocks: int = 0,
               freeze_blocks: int = 0, **other) -> TrainConfig:
        rank_batch = self.global_batch_size // self.world_size
        if self.world_size > 1:
            other = {"parallelism": self.parallelisms[0], **other, "world_size": self.world_size}
        # A memory knob's first allowed value is the default (the plain one when both are
        # allowed), where the precision and strategy let it run.
        parallelism = other.get("parallelism", "none")
        other = {k.name: first if k.refusal(first := getattr(self, k.choices)[0], precision, parallelism) is None
                 else k.default for k in KNOBS.values() if k.role == "memory"} | other
        return TrainConfig(precision=precision, micro_batch_size=micro_batch_size,
                           grad_accum_steps=rank_batch // micro_batch_size,
                           checkpoint_blocks=checkpoint_blocks, freeze_blocks=freeze_blocks, **other)

    def _from_values(self, values: dict) -> TrainConfig:
        return self.config(**values)

    def checkpointable(self, freeze_blocks: int) -> int:
        """Blocks that can be checkpointed: only trainable ones. A frozen block (the first
        `freeze_blocks`) saves no activations for backward, so checkpointing it changes nothing."""
        return max(0, self.max_checkpoint_blocks - freeze_blocks)

    def valid(self, config: TrainConfig) -> bool:
        """In the space and not equivalent to another point of it."""
        return config.checkpoint_blocks <= self.checkpointable(config.freeze_blocks)

    def policies(self) -> tuple[str, ...]:
        """The checkpoint policies searched (one when the spec did not opt in)."""
        return self.checkpoint_policies if self.max_checkpoint_blocks else ("full",)

    def suggest(self, trial: optuna.Trial, fixed: dict | None = None) -> TrainConfig:
        """The config of `trial`. `fixed`: the params the queue set (an enqueued trial's); a
        refinement knob is read only from them, so the sampler never proposes it."""
        refine = {k.name for k in self.refine_knobs()}
        values = {k.field: k.suggest(trial) for k in self.knobs() if k.field not in refine or k.param in (fixed or {})}
        # Checkpointing beyond the trainable blocks is the same point as checkpointing all of them.
        values["checkpoint_blocks"] = min(values["checkpoint_blocks"], self.checkpointable(values["freeze_blocks"]))
        for k in KNOBS.values():  # e.g. bf16 weights and FSDP2 shards keep 32-bit optimizer state
            if k.name in values and k.refusal(values[k.name], values["precision"], values.get("parallelism", "none")):
                values[k.name] = k.default
        return self._from_values(values)

    def config_of(self, params: dict) -> TrainConfig:
        """The config a trial with these Optuna params measures (`suggest`'s reading of them:
        a sampled trial's raw params may differ from `params(config)`, e.g. checkpointing
        beyond the trainable blocks, or a policy with no block checkpointed)."""
        return self.suggest(optuna.trial.FixedTrial(params), fixed=params)

    def params(self, config: TrainConfig) -> dict:
        """Optuna parameters of `config` (for enqueueing). A refinement knob at its default is
        left out, as a sampled trial leaves it (the same config, the same params)."""
        at_default = {k.name for k in self.refine_knobs() if getattr(config, k.name) == k.default}
        return {k.param: k.encode(getattr(config, k.field)) for k in self.knobs() if k.field not in at_default}

    def grid(self) -> list[TrainConfig]:
        knobs = self.knobs()
        combos = (dict(zip((k.field for k in knobs), combo)) for combo in itertools.product(*(k.values for k in knobs)))
        configs = (self._from_values(v) for v in combos if coherent(v))
        # No checkpointed block has no policy: those configs come once (TrainConfig resets it).
        return list(dict.fromkeys(c for c in configs if self.valid(c)))

    @property
    def size(self) -> int:
        """len(grid()), without building it."""
        size = 1
        # Checkpointing (with the knobs acting on it) and freezing are counted below; the
        # precision with the knobs whose rules depend on it, as the coherent combinations.
        ruled = [k for k in self.knobs() if k.field in KNOBS and KNOBS[k.field].rules]
        axes = {k.field for k in self.knobs() if k.field in KNOBS and KNOBS[k.field].active_with}
        for k in self.knobs():
            if k.field not in ("checkpoint_blocks", "freeze_blocks", "precision", *axes) and k not in ruled:
                size *= len(k.values)
        size *= sum(coherent(dict(zip(("precision", *(k.field for k in ruled)), combo)))
                    for combo in itertools.product(self.precisions, *(k.values for k in ruled)))
        policies = len(self.policies())
        return size * sum(policies * self.checkpointable(f) + 1 for f in range(self.max_freeze_blocks + 1))

    def neighbours(self, config: TrainConfig) -> list[TrainConfig]:
        """Configs one step away along one knob, plus one more micro batch paid for by one
        more checkpointed block: where to look after a duplicate proposal."""
        out = []
        ordered = [k for k in self.knobs() if k.ordered]
        moves = [{k.field: step} for k in ordered[:2] for step in k.steps]
        moves.append({"micro_batch_size": 1, "checkpoint_blocks": 1})
        moves += [{k.field: step} for k in ordered[2:] for step in k.steps]
        by_field = {k.field: k for k in ordered}
        for move in moves:
            moved = self._step(config, move, by_field)
            if moved is not None and self.valid(moved):
                out.append(moved)
        refine = {k.name for k in self.refine_knobs()}  # tried on the leaders only, not as a neighbour
        for k in self.knobs():
            if not k.ordered and k.field not in refine:
                # A policy without checkpointed blocks is inert: no neighbour there. No 8-bit
                # state with bf16 weights.
                out += [c for v in k.values if v != getattr(config, k.field)
                        and coherent({**self.memory_knobs_of(config), "precision": config.precision,
                                      "parallelism": config.parallelism, k.field: v})
                        if (c := config.replace(**{k.field: v})) != config]
        return out

    def _step(self, config: TrainConfig, move: dict, by_field: dict) -> TrainConfig | None:
        values = {k.field: getattr(config, k.field) for k in self.knobs()}
        for name, step in move.items():
            knob = by_field.get(name)
            if knob is None:
                return None
            index = knob.values.index(values[name]) + step
            if not 0 <= index < len(knob.values):
                return None
            values[name] = knob.values[index]
        return self._from_values(values)

