"""The knob registry: every option knob of a `TrainConfig` is one row of `KNOBS`.

A row says what the knob is (its `TrainConfig` field, type and allowed values, the default
first), how a user opts in (the spec's `search:<choices>` key), where it cannot run (its
rules), how it reads in `TrainConfig.short()`, what it does to memory, whether it changes the
math, what each exporter writes for it, and where the training side applies it. Everything
else loops over the rows: the spec's `search:` key and its parsing, `SearchSpace`'s allowed
values, the Optuna parameter, the short tag, the memory model's order, the exports
(`autofit.profiles.export`), the validation's reference and the table in docs/design.md.

To add a knob: one row here, its `TrainConfig` field (written out, at its default: a test
checks the two agree), its hook object (`autofit.train.configure.HOOKS`: entries for the model,
the batch and the optimizer; or the module `applied_by` names), and tests. Its memory rule
is the row's `holds_more` (or `calibrated_apart`); the estimator traces the applied knob on
fake tensors like any other. `tests/test_knob_registry.py` fails when a list of knob names is
written anywhere else.

The structural dimensions (precision, micro batch and accumulation, checkpointed and frozen
blocks) and the data-parallel strategy with its own knobs are the space's axes and stay in
`TrainConfig` and `SearchSpace` by name.
"""

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from autofit.base.errors import SpecError

CHECKPOINT_POLICIES = ("full", "selective")  # what a checkpointed block keeps (train/configure.py)
# A vocabulary this large makes the logits (and their gradient) a large share of a step's
# memory: the chunked loss is tried on the leaders of such LM heads (GPT-2's 50257 is one).
LARGE_VOCAB_TOKENS = 32768
DEVICE_KINDS = ("cpu", "cuda")  # where trials run (`DeviceInfo.kind`)

# The structural `TrainConfig` fields a knob may follow in a profile (`KnobDef.after`) or act
# with (`KnobDef.active_with`); tests/test_knob_registry.py checks each is a field.
Axis = Literal["precision", "micro_batch_size", "grad_accum_steps", "checkpoint_blocks", "freeze_blocks"]


class Role(StrEnum):
    """A knob's part in the search (a str: `k.role == "memory"` reads as before)."""

    PLAIN = "plain"  # an ordinary dimension
    # Its own seed group; seeds try its frugal value where the plain one cannot fit.
    MEMORY = "memory"
    TWIN = "twin"  # speed scales about alike at every batch, so planned configs keep it
    # Tried only as a refinement of the leading configs (the sampler never proposes it, seeds
    # and planned configs never hold it): each try costs a compile or a process-wide setting,
    # and it pays about alike at every shape.
    REFINE = "refine"


class ModelFact(StrEnum):
    """The facts of the model analysis (`autofit.measure.messages.Analysis`, a bool field of
    the same name) a knob may need to be searched by default; the registry test checks each."""

    CONVOLUTIONAL = "convolutional"  # convolutions in it
    LARGE_VOCAB_HEAD = "large_vocab_head"  # a chunkable LM head of LARGE_VOCAB_TOKENS or more


@dataclass(frozen=True, kw_only=True, slots=True)
class Exports:
    """What each exporter (`autofit.profiles.export`) writes for a knob away from its default.
    Text is `str.format`ted with `config` (the `TrainConfig`) and, for Hugging Face, `ckpt_key`
    (the installed `TrainingArguments`' checkpointing keyword)."""

    # The environment variable `to_env` sets (required: None where a job's environment has
    # nothing to set); its text is `env_text[value]`, else "1" for true, else the value.
    env: str | None
    env_text: dict = field(default_factory=dict)
    hf_args: dict = field(default_factory=dict)  # value -> `TrainingArguments` keywords
    hf_note: str | None = None  # what `TrainingArguments` cannot say, and how to get it anyway
    lightning_note: str | None = None
    # Applied to the model by `autofit.train.configure.apply_config`: Lightning's note on
    # `configure_model()` names it with checkpointing and freezing.
    model_setup: bool = False
    # It chooses the optimizer's implementation: where the profile recorded the implementation
    # it measured (or the user's own optimizer), the exports name that instead of `hf_args`
    # and `lightning_note`.
    names_optimizer: bool = False

    def env_value(self, value) -> str:
        return self.env_text.get(value, "1" if value is True else str(value))


@dataclass(frozen=True, kw_only=True, slots=True)
class Rule:
    """`value` of a knob does not run with these precisions or parallelisms; `why` says so
    (a SpecError, formatted with `precision` and `parallelism`)."""

    value: Any
    precisions: tuple[str, ...] = ()
    parallelisms: tuple[str, ...] = ()
    why: str

    def refuses(self, value, precision: str, parallelism: str) -> bool:
        return value == self.value and (precision in self.precisions or parallelism in self.parallelisms)


@dataclass(frozen=True, kw_only=True, slots=True)
class KnobDef:
    """One option knob. `name` is the `TrainConfig` field and the Optuna parameter (stored in
    studies: renaming it orphans every stored study)."""

    name: str
    type: type  # bool | int | str
    values: tuple  # allowed values; the first is the default, what every run did before the knob
    choices: str  # the SearchSpec / SearchSpace field holding the values searched (spec `search.<choices>`)
    in_spec: bool = True  # False: the space chooses (length bucketing follows the data), no spec key
    after: Axis | None = None  # the TrainConfig field it follows (a profile's key order); None: at the end
    # The knob acts only where this structural field is non-zero (TrainConfig resets it to its
    # default elsewhere, and the space declares it only when that axis exists).
    active_with: Axis | None = None
    role: Role = Role.PLAIN
    # The device kinds where it acts; elsewhere it is inert and never searched.
    devices: tuple[str, ...] = DEVICE_KINDS
    # The device kinds where the space searches it when the spec names no values (the spec's
    # `[false]` forbids it, `[false, true]` opts in anywhere it acts); none: opt-in only.
    default_on: tuple[str, ...] = ()
    # The model fact it needs to be searched by default: convolutions for cuDNN's autotuner,
    # a large vocabulary head for the chunked loss.
    needs: ModelFact | None = None
    # Memory rule: the values from the one that holds most to the one that holds least (the
    # memory model orders configs by it); None with `calibrated_apart`: the estimator's
    # calibration is fitted per value; None without it: configs must match on it.
    holds_more: tuple | None = None
    calibrated_apart: bool = False
    # A memory knob that costs speed wherever it acts (host traffic: offloading). The device
    # turning it on (`default_on`) makes it a seed group of its own, never a refinement of
    # leaders that fit without it: a lean group's seeds are only the points no plain seed
    # reaches (`autofit.search.seeding.lazy_seed_lists`), so it is tried where nothing else fits.
    last_resort: bool = False
    # False: the estimator's fake step runs it at its default (its library needs a CUDA stream
    # or process group) and its memory is moved from its layout (`autofit.measure.host_estimate`).
    fake_step: bool = True
    # Away from its default the trained weights differ from a plain job's (other numerics or
    # another loss computation): the validation's plain reference keeps it at its default.
    changes_math: bool
    rules: tuple[Rule, ...] = ()
    tags: dict = field(default_factory=dict)  # value -> word in TrainConfig.short(); none at the default
    exports: Exports
    # "module:function" of the training side that applies it (tests resolve it; config/ sits
    # below train/, so the row names its hook rather than holding it).
    applied_by: str
    doc: str  # one line for the docs table

    @property
    def default(self):
        return self.values[0]

    @property
    def spec_default(self) -> tuple:
        """The spec's `search.<choices>` when it names none: () lets the device decide."""
        return () if self.default_on else (self.default,)

    @property
    def lean(self):
        """The value that holds least memory (memory knobs)."""
        return None if self.holds_more is None else self.holds_more[-1]

    def check(self, value) -> None:
        """SpecError unless `value` is one of the allowed values, of the knob's type."""
        if isinstance(value, bool) != (self.type is bool) or value not in self.values:
            raise SpecError(f"{self.name}: must be {self.allowed_text()}, got {value!r}")

    def allowed_text(self) -> str:
        if self.type is bool:
            return "true or false"
        if self.type is int:
            return " or ".join(map(str, self.values))
        return f"one of {', '.join(self.values)}"

    def refusal(self, value, precision: str, parallelism: str) -> str | None:
        """Why `value` cannot run with `precision` and `parallelism`; None when it can."""
        for rule in self.rules:
            if rule.refuses(value, precision, parallelism):
                return f"{self.name}: " + rule.why.format(precision=precision, parallelism=parallelism)
        return None


# The chunked loss's note in the Hugging Face and Lightning exports (each adds where the loss goes).
_CHUNKED_NOTE = ("chunked_loss: the peak was measured with the LM head and cross-entropy computed in chunks "
                 "(torch.nn.functional.linear_cross_entropy), so the full logits never exist: compute the loss "
                 "with autofit.chunked_lm_loss(model, batch)")

KNOBS: dict[str, KnobDef] = {k.name: k for k in (
    KnobDef(name="length_bucketing", type=bool, values=(False, True), choices="length_bucketing", in_spec=False,
            after="freeze_blocks", tags={True: "bucketed"}, changes_math=False,
            # No variable: the job's own loader cuts its batches. The exporter spells the
            # keyword as the installed transformers does (train_sampling_strategy from 5 on).
            exports=Exports(env=None, hf_args={True: {"group_by_length": True}},
                            hf_note="length bucketing: autofit sorts each global batch by length before cutting "
                                    "micro batches; the Trainer's group_by_length groups similar lengths across "
                                    "the dataset, which cuts padding the same way but changes which samples "
                                    "share a step"),
            applied_by="autofit.workload.text:TextData.step_batches",
            doc="text data: each step's samples sorted by length before the micro batches are cut "
                "(the same samples: the update is the same); searched where the data has lengths"),
    KnobDef(name="optimizer_bits", type=int, values=(32, 8), choices="optimizer_bits", role=Role.MEMORY,
            holds_more=(32, 8), tags={8: "adam8bit"}, changes_math=True,
            rules=(Rule(value=8, precisions=("bf16-true",),
                        # bf16 weights need the Kahan-compensated update (torch-optimi), which has
                        # no 8-bit state; bitsandbytes' update to a bf16 weight rounds small steps away.
                        why="8-bit state needs fp32 weights; bf16-true keeps bf16 weights "
                            "(use optimizer_bits 32 with bf16-true, or another precision)"),
                   Rule(value=8, parallelisms=("fsdp",),
                        why="8-bit state does not run under FSDP2 (bitsandbytes' update takes no DTensor "
                            "shards); use parallelism ddp or optimizer_bits 32")),
            exports=Exports(env="AUTOFIT_OPTIMIZER_BITS", hf_args={8: {"optim": "adamw_bnb_8bit"}}, names_optimizer=True,
                            lightning_note="optimizer_bits=8: return bitsandbytes.optim.AdamW8bit(...) from "
                                           "configure_optimizers(), the 8-bit state autofit measured"),
            applied_by="autofit.train.optim:build_optimizer",
            doc="the optimizer's moments in fp32 or blockwise 8-bit (bitsandbytes AdamW8bit); "
                "changes numerics: opt-in"),
    KnobDef(name="chunked_loss", type=bool, values=(False, True), choices="chunked_loss", role=Role.MEMORY,
            holds_more=(False, True), tags={True: "chunked-ce"}, default_on=("cuda",),
            needs=ModelFact.LARGE_VOCAB_HEAD, changes_math=True,
            # The chunked loss reads the head's weight outside the model's forward, where
            # DDP's and FSDP2's hooks do not see it.
            rules=(Rule(value=True, parallelisms=("ddp", "fsdp"),
                        why="runs in one process only, got parallelism {parallelism}"),),
            exports=Exports(env="AUTOFIT_CHUNKED_LOSS",
                            hf_note=_CHUNKED_NOTE + "; in the Trainer, override compute_loss with it "
                                    "(use_liger_kernel=True chunks too, on a GPU with liger-kernel, but is not "
                                    "what autofit measured)",
                            lightning_note=_CHUNKED_NOTE + " in training_step"),
            applied_by="autofit.train.runner:Runner.__init__",
            doc="LM heads: head + cross-entropy in chunks, the full logits never exist; on CUDA a "
                "refinement of the leaders for heads of 32768+ tokens, elsewhere opt-in"),
    # Offloading (autofit.train.offload): each moves memory from the card to pinned host
    # memory, which the host budget holds (autofit.measure.host_estimate); inert on the CPU,
    # where host and device are one memory.
    KnobDef(name="offload_activations", type=bool, values=(False, True), choices="offload_activations",
            role=Role.MEMORY, devices=("cuda",), default_on=("cuda",), last_resort=True,
            holds_more=(False, True), tags={True: "offload-act"}, changes_math=False,
            exports=Exports(env="AUTOFIT_OFFLOAD_ACTIVATIONS", model_setup=True,
                            hf_note="offload_activations: the activations each block not checkpointed saves for "
                                    "backward were kept in pinned host memory (torch.autograd.graph.save_on_cpu("
                                    "pin_memory=True) around the block's forward); TrainingArguments has no slot: "
                                    "call autofit.train.configure.apply_config(model, profile.config) (freezing, "
                                    "checkpointing and offloading as measured) before building the Trainer",
                            lightning_note="offload_activations: each block not checkpointed keeps its saved "
                                           "activations in pinned host memory (save_on_cpu)"),
            applied_by="autofit.train.configure:offload_activations",
            doc="the activations of the blocks not checkpointed kept in pinned host memory (save_on_cpu), "
                "so a config checkpoints some blocks and offloads the others; on CUDA where nothing "
                "fits without it"),
    KnobDef(name="offload_optimizer", type=bool, values=(False, True), choices="offload_optimizer",
            role=Role.MEMORY, devices=("cuda",), default_on=("cuda",), last_resort=True, fake_step=False,
            holds_more=(False, True), tags={True: "offload-opt"}, changes_math=False,
            # torchao's CPUOffloadOptimizer holds one process's plain tensors; FSDP2 has its own
            # (fsdp_offload), and DDP's buckets are not what it hooks.
            rules=(Rule(value=True, parallelisms=("ddp", "fsdp"),
                        why="the CPU-offloaded optimizer runs in one process only, got parallelism "
                            "{parallelism} (under fsdp use fsdp_offload)"),
                   # torchao copies each gradient to the host on a side stream as backward makes
                   # it; GradScaler's unscale reads the host gradients before those copies are
                   # waited for (in torchao's step).
                   Rule(value=True, precisions=("16-mixed",),
                        why="GradScaler would unscale the host gradients before their copies land; "
                            "use bf16-mixed or bf16-true with offload_optimizer")),
            exports=Exports(env="AUTOFIT_OFFLOAD_OPTIMIZER", names_optimizer=True,
                            hf_note="offload_optimizer: the optimizer's state and its step were on the CPU "
                                    "(torchao.optim.CPUOffloadOptimizer); TrainingArguments has no slot: pass "
                                    "optimizers=(CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, "
                                    "lr=...), None) to the Trainer",
                            lightning_note="offload_optimizer: return torchao.optim.CPUOffloadOptimizer("
                                           "self.parameters(), torch.optim.AdamW, lr=...) from "
                                           "configure_optimizers(), the CPU step autofit measured"),
            applied_by="autofit.train.configure:offload_optimizer",
            doc="the optimizer's state and its step on the CPU (torchao CPUOffloadOptimizer), one "
                "process; on CUDA where nothing fits without it"),
    KnobDef(name="fsdp_offload", type=bool, values=(False, True), choices="fsdp_offload",
            role=Role.MEMORY, devices=("cuda",), default_on=("cuda",), last_resort=True, fake_step=False,
            holds_more=(False, True), tags={True: "fsdp-offload"}, changes_math=False,
            rules=(Rule(value=True, parallelisms=("none", "ddp"),
                        why="CPUOffloadPolicy is FSDP2's, got parallelism {parallelism}"),),
            exports=Exports(env="AUTOFIT_FSDP_OFFLOAD",
                            hf_note="fsdp_offload: FSDP2 ran with CPUOffloadPolicy (sharded parameters, "
                                    "gradients and the optimizer step on the CPU); with the Trainer set "
                                    "fsdp_config={{'offload_params': True}} under FSDP2",
                            lightning_note="fsdp_offload: FSDPStrategy(cpu_offload=True), or fully_shard(..., "
                                           "offload_policy=CPUOffloadPolicy()) in configure_model()"),
            applied_by="autofit.train.distributed:wrap_model",
            doc="under FSDP2, CPUOffloadPolicy: sharded parameters, gradients and the optimizer step on "
                "the CPU; on CUDA where nothing fits without it"),
    KnobDef(name="checkpoint_policy", type=str, values=CHECKPOINT_POLICIES, choices="checkpoint_policies",
            after="checkpoint_blocks", active_with="checkpoint_blocks", calibrated_apart=True,
            tags={"selective": "sel"}, changes_math=False,
            # Lightning's note names it with checkpoint_blocks (`active_with`). TrainingArguments'
            # checkpointing kwargs reach torch.utils.checkpoint, but the selective policy is a
            # context_fn (a function): JSON-serialised arguments cannot hold it.
            exports=Exports(env="AUTOFIT_CHECKPOINT_POLICY",
                            hf_note="checkpoint_policy=selective: the profile keeps each checkpointed block's "
                                    "matmul and attention outputs and recomputes only the rest; TrainingArguments "
                                    "can only recompute whole layers, which fits in no more memory but is slower. "
                                    "For the exact choice, apply it to the model (autofit.train.configure."
                                    "apply_checkpointing(model, {config.checkpoint_blocks}, "
                                    "first_block={config.freeze_blocks}, policy='selective')) and set "
                                    "{ckpt_key}=False"),
            applied_by="autofit.train.configure:apply_checkpointing",
            doc="what each checkpointed block keeps: its input (full) or also its matmul and "
                "attention outputs (selective); opt-in"),
    KnobDef(name="compile", type=bool, values=(False, True), choices="compile", role=Role.REFINE,
            default_on=("cuda",), calibrated_apart=True, tags={True: "compiled"}, changes_math=False,
            # The Trainer compiles the whole model at once; autofit compiled each block with
            # fullgraph=True (what was measured), and the whole model only without a block stack.
            exports=Exports(env="AUTOFIT_COMPILE", hf_args={True: {"torch_compile": True}}, model_setup=True,
                            hf_note="compile: torch_compile=True compiles the whole model, and a graph break "
                                    "outside the blocks leaves that part eager; autofit measured each block "
                                    "compiled (fullgraph) with inductor. For the exact setup call "
                                    "autofit.train.configure.apply_compile(model) before building the Trainer and "
                                    "leave torch_compile=False"),
            applied_by="autofit.train.configure:apply_compile",
            doc="torch.compile of each block (the whole model without a block stack), tried on the "
                "leaders only; compile time measured apart from throughput, inductor's cache in the "
                "state folder; on CUDA by default, on the CPU opt-in"),
    # A setting of the CUDA caching allocator, read once when CUDA starts: set in the trial
    # child's environment, and by `autofit train` / `profile.apply` before CUDA starts.
    KnobDef(name="expandable_segments", type=bool, values=(False, True), choices="expandable_segments",
            role=Role.REFINE, devices=("cuda",), default_on=("cuda",), tags={True: "expseg"},
            # Fragmentation is not what the fake-tensor trace sees: the calibration per value learns it.
            calibrated_apart=True, changes_math=False,
            # The allocator's own variable (`autofit.device.alloc_conf`): a job that loads the file gets it.
            exports=Exports(env="PYTORCH_CUDA_ALLOC_CONF", env_text={True: "expandable_segments:True"}),
            applied_by="autofit.device.alloc_conf:set_expandable_segments",
            doc="CUDA allocator's expandable segments (less fragmentation near the cap), tried on "
                "the leaders; CUDA only"),
    KnobDef(name="cudnn_benchmark", type=bool, values=(False, True), choices="cudnn_benchmark",
            role=Role.REFINE, devices=("cuda",), default_on=("cuda",), needs=ModelFact.CONVOLUTIONAL,
            tags={True: "cudnn-bench"}, changes_math=False,
            calibrated_apart=True,  # the autotuner may pick algorithms with larger workspaces
            # Process-wide: `Profile.apply` sets it from the profile's recorded flags.
            exports=Exports(env="AUTOFIT_CUDNN_BENCHMARK"),
            applied_by="autofit.train.configure:apply_cudnn_benchmark",
            doc="cuDNN's autotuner picks each convolution's fastest algorithm, tried on the leaders "
                "of models with convolutions; CUDA only"),
)}


def spec_knobs() -> list[KnobDef]:
    """The knobs a user opts in to in the spec's `search:` section."""
    return [k for k in KNOBS.values() if k.in_spec]


def coherent(values: dict) -> bool:
    """No knob in `values` refuses its value with `values`' precision and parallelism."""
    return not any(k.refusal(values[k.name], values["precision"], values.get("parallelism", "none"))
                   for k in KNOBS.values() if k.name in values)


def add_fields(cls: type, fields: list[tuple[str, type, Any]]) -> type:
    """`cls` (not yet a dataclass) with `fields` (name, annotation, default) added at its end.
    Applied under `@dataclass`, so the registry's choices become ordinary dataclass fields."""
    for name, _, default in fields:
        setattr(cls, name, default)
    cls.__annotations__ = cls.__dict__.get("__annotations__", {}) | {name: t for name, t, _ in fields}
    return cls


def choice_fields(*, spec: bool) -> "callable":
    """Decorator: one field per knob holding the values searched, the default alone unless
    opted in (`spec`: only the knobs the spec's `search:` section has, where a knob the
    device decides defaults to ())."""
    knobs = spec_knobs() if spec else list(KNOBS.values())
    return lambda cls: add_fields(cls, [(k.choices, tuple[k.type, ...], k.spec_default if spec else (k.default,))
                                        for k in knobs])


def knob_table() -> str:
    """The docs table of the knobs (docs/design.md holds it; a test checks it is current)."""
    def spell(value):
        return str(value).lower() if isinstance(value, bool) else str(value)

    def by_default(k: KnobDef) -> str:
        if not k.default_on:
            return "opt-in" if k.in_spec else "-"
        return f"on {', '.join(k.default_on)}" + (f" where `{k.needs}`" if k.needs else "")

    rows = ["| knob | values (default first) | spec `search:` key | searched by default | role | rules | applied by "
            "| what |",
            "|---|---|---|---|---|---|---|---|"]
    for k in KNOBS.values():
        rules = "; ".join(f"{spell(r.value)} not with {', '.join(r.precisions + r.parallelisms)}" for r in k.rules)
        if k.devices != DEVICE_KINDS:
            rules = "; ".join(filter(None, (rules, f"acts on {', '.join(k.devices)} only")))
        rows.append(f"| `{k.name}` | {', '.join(spell(v) for v in k.values)} | "
                    f"{f'`{k.choices}`' if k.in_spec else '(the data decides)'} | {by_default(k)} | {k.role} | "
                    f"{rules or '-'} | `{k.applied_by}` | {k.doc} |")
    return "\n".join(rows) + "\n"
