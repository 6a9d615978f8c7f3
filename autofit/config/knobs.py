"""The knob registry: every option knob of a `TrainConfig` is one row of `KNOBS`.

A row says what the knob is (its `TrainConfig` field, type and allowed values, the default
first), how a user opts in (the spec's `search.<choices>` key), where it cannot run (its
rules), how it reads in `TrainConfig.short()`, what it does to memory, and where the
training side applies it. Everything else is derived from the rows: `TrainConfig`'s field,
the spec's `search:` key and its parsing, `SearchSpace`'s allowed values, the Optuna
parameter, the short tag, the memory model's order and the table in docs/design.md.

To add a knob: one row here, its apply hook (`autofit.train.knobs.APPLY_HOOKS`, or the
module `applied_by` names), and tests. Its memory rule is the row's `holds_more` (or
`calibrated_apart`); the estimator traces the applied knob on fake tensors like any other.
`tests/test_knob_registry.py` fails when a list of knob names is written anywhere else.

The structural dimensions (precision, micro batch and accumulation, checkpointed and frozen
blocks) and the data-parallel strategy with its own knobs are the space's axes and stay in
`TrainConfig` and `SearchSpace` by name.
"""

from dataclasses import dataclass, field
from typing import Any

from autofit.base.errors import SpecError

CHECKPOINT_POLICIES = ("full", "selective")  # what a checkpointed block keeps (train/knobs.py)
# A vocabulary this large makes the logits (and their gradient) a large share of a step's
# memory: the chunked loss is tried on the leaders of such LM heads (GPT-2's 50257 is one).
LARGE_VOCAB_TOKENS = 32768
DEVICE_KINDS = ("cpu", "cuda")  # where trials run (`DeviceInfo.kind`)


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
    after: str | None = None  # the TrainConfig field it follows (a profile's key order); None: at the end
    # The knob acts only where this structural field is non-zero (TrainConfig resets it to its
    # default elsewhere, and the space declares it only when that axis exists).
    active_with: str | None = None
    # "memory": a memory knob (its own seed group; seeds try its frugal value where the plain
    # one cannot fit); "twin": speed scales about alike at every batch, so planned configs
    # keep it; "refine": tried only as a refinement of the leading configs (the sampler never
    # proposes it, seeds and planned configs never hold it: each try costs a compile or a
    # process-wide setting, and it pays about alike at every shape); "plain": an ordinary dimension.
    role: str = "plain"
    # The device kinds where it acts; elsewhere it is inert and never searched.
    devices: tuple[str, ...] = DEVICE_KINDS
    # The device kinds where the space searches it when the spec names no values (the spec's
    # `[false]` forbids it, `[false, true]` opts in anywhere it acts); none: opt-in only.
    default_on: tuple[str, ...] = ()
    # The model fact (a key of the analysis, `autofit.measure.tasks.analysis`) it needs to be
    # searched by default: convolutions for cuDNN's autotuner, a large vocabulary head for the
    # chunked loss.
    needs: str | None = None
    # Memory rule: the values from the one that holds most to the one that holds least (the
    # memory model orders configs by it); None with `calibrated_apart`: the estimator's
    # calibration is fitted per value; None without it: configs must match on it.
    holds_more: tuple | None = None
    calibrated_apart: bool = False
    rules: tuple[Rule, ...] = ()
    tags: dict = field(default_factory=dict)  # value -> word in TrainConfig.short(); none at the default
    applied_by: str  # "module:function" of the training side that applies it (tests resolve it)
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


KNOBS: dict[str, KnobDef] = {k.name: k for k in (
    KnobDef(name="length_bucketing", type=bool, values=(False, True), choices="length_bucketing", in_spec=False,
            after="freeze_blocks", tags={True: "bucketed"},
            applied_by="autofit.workload.text:TextData.step_batches",
            doc="text data: each step's samples sorted by length before the micro batches are cut "
                "(the same samples: the update is the same); searched where the data has lengths"),
    KnobDef(name="optimizer_bits", type=int, values=(32, 8), choices="optimizer_bits", role="memory",
            holds_more=(32, 8), tags={8: "adam8bit"},
            rules=(Rule(value=8, precisions=("bf16-true",),
                        # bf16 weights need the Kahan-compensated update (torch-optimi), which has
                        # no 8-bit state; bitsandbytes' update to a bf16 weight rounds small steps away.
                        why="8-bit state needs fp32 weights; bf16-true keeps bf16 weights "
                            "(use optimizer_bits 32 with bf16-true, or another precision)"),
                   Rule(value=8, parallelisms=("fsdp",),
                        why="8-bit state does not run under FSDP2 (bitsandbytes' update takes no DTensor "
                            "shards); use parallelism ddp or optimizer_bits 32")),
            applied_by="autofit.train.optim:build_optimizer",
            doc="the optimizer's moments in fp32 or blockwise 8-bit (bitsandbytes AdamW8bit); "
                "changes numerics: opt-in"),
    KnobDef(name="chunked_loss", type=bool, values=(False, True), choices="chunked_loss", role="memory",
            holds_more=(False, True), tags={True: "chunked-ce"}, default_on=("cuda",), needs="large_vocab_head",
            # The chunked loss reads the head's weight outside the model's forward, where
            # DDP's and FSDP2's hooks do not see it.
            rules=(Rule(value=True, parallelisms=("ddp", "fsdp"),
                        why="runs in one process only, got parallelism {parallelism}"),),
            applied_by="autofit.train.runner:Runner.__init__",
            doc="LM heads: head + cross-entropy in chunks, the full logits never exist; on CUDA a "
                "refinement of the leaders for heads of 32768+ tokens, elsewhere opt-in"),
    KnobDef(name="checkpoint_policy", type=str, values=CHECKPOINT_POLICIES, choices="checkpoint_policies",
            after="checkpoint_blocks", active_with="checkpoint_blocks", calibrated_apart=True,
            tags={"selective": "sel"},
            applied_by="autofit.train.knobs:apply_checkpointing",
            doc="what each checkpointed block keeps: its input (full) or also its matmul and "
                "attention outputs (selective); opt-in"),
    KnobDef(name="compile", type=bool, values=(False, True), choices="compile", role="refine",
            default_on=("cuda",), calibrated_apart=True, tags={True: "compiled"},
            applied_by="autofit.train.knobs:apply_compile",
            doc="torch.compile of each block (the whole model without a block stack), tried on the "
                "leaders only; compile time measured apart from throughput, inductor's cache in the "
                "state folder; on CUDA by default, on the CPU opt-in"),
    # A setting of the CUDA caching allocator, read once when CUDA starts: set in the trial
    # child's environment, and by `autofit train` / `profile.apply` before CUDA starts.
    KnobDef(name="expandable_segments", type=bool, values=(False, True), choices="expandable_segments",
            role="refine", devices=("cuda",), default_on=("cuda",), tags={True: "expseg"},
            # Fragmentation is not what the fake-tensor trace sees: the calibration per value learns it.
            calibrated_apart=True,
            applied_by="autofit.device.alloc_conf:set_expandable_segments",
            doc="CUDA allocator's expandable segments (less fragmentation near the cap), tried on "
                "the leaders; CUDA only"),
    KnobDef(name="cudnn_benchmark", type=bool, values=(False, True), choices="cudnn_benchmark",
            role="refine", devices=("cuda",), default_on=("cuda",), needs="convolutional",
            tags={True: "cudnn-bench"},
            calibrated_apart=True,  # the autotuner may pick algorithms with larger workspaces
            applied_by="autofit.train.knobs:apply_cudnn_benchmark",
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


def add_fields(cls: type, fields: list[tuple[str, type, Any]], *, after: dict[str, str | None] | None = None) -> type:
    """`cls` (not yet a dataclass) with `fields` (name, annotation, default) added, each after
    the field `after` names for it (else at the end). Applied under `@dataclass`, so the
    registry's knobs become ordinary dataclass fields."""
    after = after or {}
    annotations = {}
    for name, annotation in cls.__dict__.get("__annotations__", {}).items():
        annotations[name] = annotation
        annotations |= {f: t for f, t, _ in fields if after.get(f) == name}
    annotations |= {f: t for f, t, _ in fields if f not in annotations}
    for name, _, default in fields:
        setattr(cls, name, default)
    cls.__annotations__ = annotations
    return cls


def config_fields(cls: type) -> type:
    """Decorator: one `TrainConfig` field per knob, at its default."""
    return add_fields(cls, [(k.name, k.type, k.default) for k in KNOBS.values()],
                      after={k.name: k.after for k in KNOBS.values()})


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
