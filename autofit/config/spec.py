"""model.yaml (schema 1) -> frozen dataclasses.

Every error names the key path and what is allowed, e.g.
`train.global_batch_size: must be a positive integer, got -4`. Unknown keys are rejected,
with a "did you mean" when one is close.
"""

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autofit.base.documents import read_yaml
from autofit.base.errors import SpecError
from autofit.base.sizes import parse_duration
from autofit.config.knobs import choice_fields, spec_knobs
from autofit.config.reader import choice_error, MISSING, Reader, shorten

SCHEMA_VERSION = 1
PRECISIONS = ("32-true", "tf32", "16-mixed", "bf16-mixed", "bf16-true")
MODEL_SOURCES = ("builtin", "hf", "python")
# A model handed to `autofit.tune()` as a Python object: its spec names the class and a
# fingerprint of its structure (model.args) and is never read from a file.
OBJECT_SOURCE = "object"
DATA_KINDS = ("synthetic", "tokens", "python", "text")
TEXT_FORMATS = ("jsonl", "txt")
TEXT_PADDINGS = ("dynamic", "max_length")
# Keys only data.kind text reads; left out of other kinds' normalised spec (and hash).
_TEXT_KEYS = ("format", "field", "tokenizer", "max_length", "padding", "packing", "pad_to_multiple_of")
OPTIMIZERS = ("adamw", "adam", "sgd")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # fullmatch: `$` would let a trailing newline through
# The name heads file names the store makes: `.<name>--<slug>.demotions.json.XXXXXXXX.tmp`
# at the longest (an atomic write's temp file: 31 characters besides name and slug). A GPU
# name is at most 96 characters (NVML's buffer; an inventory file's names are held to it),
# so a slug with its `-budget-…`, `-emulated` and `-xN` tags stays under 128. 255 bytes is
# the file-name limit of ext4, xfs, btrfs and APFS alike: 255 - 31 - 128 = 96.
MAX_NAME_CHARS = 96
# Upper bounds where a huge value would hang or allocate before any check could stop it:
# the global batch is materialised on the host every step, and every trial is a process.
MAX_GLOBAL_BATCH_SIZE = 1 << 20
MAX_STEPS = 10**9
MAX_TRIALS = 10_000
MAX_TRIAL_STEPS = 100_000
MAX_SEQ_LEN = 1 << 20
MAX_TIMEOUT_S = 7 * 24 * 3600.0
DEFAULT_TIME_BUDGET_S = 300.0  # a tune's whole wall time unless the spec or --time-budget says otherwise
MAX_BATCH_DIM = 7  # where a model takes its batch (model.batch_dim): a tensor has at most a few dims
MAX_NESTING = 8  # constructors inside model.args (a config object inside a model class)
# The one line said when `unsplit_skips_probe`: min micro batch, global batch.
PROBE_SKIPPED = ("independence probe skipped: search.min_micro_batch_size {} is the whole global batch ({}), so no "
                 "batch is ever split and samples that depend on each other are harmless")
_TARGET = re.compile(r"[\w.]+:\w+")  # "module.path:function" (fullmatch)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSource:
    kind: str  # "builtin" | "hf" | "python" | "object" (autofit.tune's model object)
    target: str  # builtin name, HF class name, or "module.path:function" (a function or a class)
    # builtin args / HF config dict / kwargs for the python callable; in a python source a
    # value `{python: "module:Callable", args: {...}}` is built first (a config object).
    args: dict
    # Where the block stack is (dotted paths of nn.ModuleList / nn.Sequential modules, in
    # forward order); None: found (train.configure.find_block_stack).
    blocks: tuple[str, ...] | None = None
    # The dimension of its inputs and outputs where the model takes the batch; None: 0,
    # checked by a probe before training (workload.batch_dim).
    batch_dim: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class LossSpec:
    """The training loss: the model's own (None) or `python: "module:function"`, called as
    fn(model, micro_batch, **args) -> scalar tensor."""

    python: str | None = None
    args: dict = field(default_factory=dict)
    # False: the loss couples the samples of a batch (in-batch negatives), so a micro batch
    # is the whole batch: no accumulation.
    per_sample: bool = True

    @property
    def is_default(self) -> bool:
        return self.python is None and self.per_sample


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSpec:
    kind: str = "synthetic"  # "synthetic" | "tokens" | "python" | "text"
    path: Path | None = None  # tokens: flat uint16 token file; text: the corpus (absolute)
    factory: str | None = None  # python: "module.path:function" returning a Dataset
    seq_len: int | None = None  # overrides the model's sequence length
    args: dict = field(default_factory=dict)  # kwargs for the factory
    # text only:
    format: str | None = None  # "jsonl" (one JSON object a line) | "txt" (one sample a line)
    field: str | None = None  # jsonl: the key holding the text
    tokenizer: Path | None = None  # a `tokenizers` tokenizer.json (absolute)
    max_length: int | None = None  # tokens per sample after truncation; default: the model's positions
    padding: str = "dynamic"  # "dynamic" (to each micro batch's longest) | "max_length"
    packing: bool = False  # documents joined and cut into max_length windows: no padding
    pad_to_multiple_of: int = 1  # dynamic padding rounds the length up to a multiple of this


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSpec:
    name: str = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    momentum: float = 0.0  # sgd only
    # The user's own optimizer: "module.path:function" (or an Optimizer class) called as
    # fn(params, **args) -> torch.optim.Optimizer; name is then "python" and args holds its
    # hyperparameters (lr, betas, ... as that optimizer names them).
    python: str | None = None
    args: dict = field(default_factory=dict)


    def to_dict(self) -> dict:
        """As a spec writes it; a built-in optimizer's keys as before the user's existed, so
        its specs keep their hash (and their profiles)."""
        if self.python is not None:
            return {"python": self.python, "args": dict(self.args)}
        return {"name": self.name, "lr": self.lr, "weight_decay": self.weight_decay, "betas": list(self.betas),
                "momentum": self.momentum}


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSpec:
    global_batch_size: int  # fixed: micro batch x accumulation = this
    steps: int = 100
    max_grad_norm: float | None = 1.0  # None: no clipping
    seed: int = 0
    checkpoint_every: int = 50  # optimizer steps between checkpoints; 0: final only
    log_every: int = 10


@dataclass(frozen=True, kw_only=True, slots=True)
@choice_fields(spec=True)
class SearchSpec:
    """The spec's `search:` section. Besides the fields below, one field per knob of the
    registry a user opts in to (`autofit.config.knobs.spec_knobs`, named by its `choices`),
    holding the values searched: the default alone unless opted in."""

    precisions: tuple[str, ...] = PRECISIONS  # the allowed set; unsupported ones are skipped
    max_freeze_blocks: int = 0  # freezing changes what is trained: opt-in
    activation_checkpointing: bool = True
    memory_headroom: float = 0.05  # fraction of usable memory left free
    trials: int = 40  # most configurations measured (pruned proposals and repeats do not count)
    patience: int = 12  # stop after this many measured trials without a better one
    warmup_steps: int = 5  # most warm-up steps before timing, per trial: they stop once a step takes what the one before took
    # The fewest timed optimizer steps per trial (the window runs on to `window_s`): a median of
    # 3 outvotes one odd step, and a fast step's window holds many more anyway.
    measure_steps: int = 3
    # A trial's timed window in seconds: after warm-up it times steps until they took this
    # long, at least `measure_steps` of them, so a slow step's trial costs about what a fast
    # one's does. 0: exactly `measure_steps` steps.
    window_s: float = 2.0
    validate_steps: int = 50  # optimizer steps of the final validation run
    frontier_points: int = 4  # most points the profile keeps, winner included; each other costs a validation
    trial_timeout_s: float = 600.0
    # The whole tune's wall time (`search.time_budget`, `autofit tune --time-budget`): probe,
    # estimates, trials, re-measures, validation, frontier and writing. At its end the best
    # config measured so far is the profile (validated if there was time). None (a spec that
    # gives train.steps and no time_budget): sized to that training once the one-liner's speed
    # is measured (`search.deadline.sized_to_training`).
    time_budget_s: float | None = DEFAULT_TIME_BUDGET_S
    # The smallest micro batch searched. None: 16 (at most the global batch) for a model with
    # BatchNorm, whose statistics are the micro batch's, else no floor. A value at or above
    # the global batch excludes accumulation (the exact math of one batch).
    min_micro_batch_size: int | None = None
    # Validation: a low-precision run's loss curve (5-step medians) may leave the 32-true
    # baseline's over the same batches by this fraction.
    loss_curve_rtol: float = 0.01


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    name: str
    model: ModelSource
    data: DataSpec
    optimizer: OptimizerSpec
    train: TrainSpec
    search: SearchSpec
    source_dir: Path  # folder of the yaml: relative paths and python: imports resolve here
    loss: LossSpec = field(default_factory=LossSpec)
    schema: int = SCHEMA_VERSION

    def to_dict(self) -> dict:
        """The normalised spec, as plain YAML/JSON types (paths relative to the spec's folder)."""
        out = {"schema": self.schema, "name": self.name}
        model = {self.model.kind: self.model.target, "args": dict(self.model.args)}
        if self.model.kind == "hf":
            model = {"hf": {"class": self.model.target, "config": dict(self.model.args)}}
        # Only when given: specs without them keep their hash (and their profiles).
        if self.model.blocks is not None:
            model["blocks"] = list(self.model.blocks)
        if self.model.batch_dim is not None:
            model["batch_dim"] = self.model.batch_dim
        out["model"] = model
        if not self.loss.is_default:
            out["loss"] = dataclasses.asdict(self.loss)
        data = dataclasses.asdict(self.data)
        if self.data.kind != "text":
            data = {k: v for k, v in data.items() if k not in _TEXT_KEYS}
        for key in ("path", "tokenizer"):
            if data.get(key) is not None:
                data[key] = _relative(data[key], self.source_dir)
        out["data"] = data
        out["optimizer"] = self.optimizer.to_dict()
        out["train"] = dataclasses.asdict(self.train)
        out["search"] = dataclasses.asdict(self.search) | {
            name: list(getattr(self.search, name))
            for name in ("precisions", *(k.choices for k in spec_knobs()))}
        for k in spec_knobs():  # none named: the device decides, and the key stays absent
            if not out["search"][k.choices]:
                del out["search"][k.choices]
        time_budget_s = out["search"].pop("time_budget_s")
        if time_budget_s is not None:  # None: sized to train.steps, as a spec without the key reads
            out["search"]["time_budget"] = time_budget_s  # the key a spec writes
        return out

    @property
    def spec_hash(self) -> str:
        """Hash of what the best configuration depends on. Train length, seed, logging
        cadence and the search's budget do not change it, so editing them keeps profiles valid."""
        d = self.to_dict()
        # The search's space, not how long it runs: trials, patience, step counts and
        # timeouts change the cost of a tune, not which config wins.
        space = {k: d["search"][k] for k in ("precisions", "max_freeze_blocks", "activation_checkpointing",
                                            "memory_headroom")}
        # Opt-in knobs join the hash only when opted in: specs without them keep their hash
        # (and their profiles).
        space |= {k: d["search"][k] for k, default in _OPT_IN_DEFAULTS.items() if d["search"].get(k, default) != default}
        relevant = {
            "model": d["model"], "data": d["data"], "optimizer": d["optimizer"],
            **({"loss": d["loss"]} if "loss" in d else {}),
            "global_batch_size": d["train"]["global_batch_size"],
            "max_grad_norm": d["train"]["max_grad_norm"], "search": space,
        }
        blob = json.dumps(_str_keys(relevant), sort_keys=True, separators=(",", ":"), default=str)
        return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()

    @property
    def probes_batch_dim(self) -> bool:
        """A model autofit did not write, whose batch dimension nobody declared and whose
        loss is per sample: the batch-dimension probe runs before it trains."""
        return self.model.kind in ("python", OBJECT_SOURCE) and self.model.batch_dim is None and self.loss.per_sample \
            and not self.unsplit_skips_probe

    @property
    def unsplit_skips_probe(self) -> bool:
        """The probe is not run because no batch is ever split: every allowed micro batch is
        the whole batch (`search.min_micro_batch_size` at the global batch), so samples that
        depend on each other are harmless."""
        floor = self.search.min_micro_batch_size
        return self.model.kind in ("python", OBJECT_SOURCE) and floor is not None \
            and floor >= self.train.global_batch_size

    def micro_batch_sizes(self) -> list[int]:
        """Micro batch sizes that divide the global batch: the only candidates."""
        return divisors(self.train.global_batch_size)


def _str_keys(value):
    """`value` with every mapping key a string, as JSON writes them (an HF config's
    `id2label: {0: neg}`): sorting keys of mixed types would raise. Depth is bounded by the
    document reader."""
    if isinstance(value, dict):
        return {str(k): _str_keys(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_str_keys(v) for v in value]
    return value


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending, in O(sqrt(n)) steps (not n: a global batch of 10**8
    would take seconds)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.relative_to(base))
    except ValueError:
        return str(path)


def load_spec(path: str | Path) -> ModelSpec:
    """Read and validate a model.yaml."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: no such file" if not path.exists() else
                        f"{path}: is a folder, not a model.yaml" if path.is_dir() else f"{path}: not a file")
    raw = read_yaml(path, error=SpecError)  # bounded: aliases, nesting, size
    if raw is None:
        raise SpecError(f"{path}: the file is empty; see examples/tiny-gpt.yaml for a complete spec")
    try:
        return parse_spec(raw, source_dir=path.resolve().parent)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from None


def parse_spec(raw: Any, *, source_dir: Path) -> ModelSpec:
    """Validate an already-parsed mapping."""
    top = Reader(raw, "")
    schema = top.get("schema", int, default=SCHEMA_VERSION)
    if schema != SCHEMA_VERSION:
        raise SpecError(f"schema: this autofit reads schema {SCHEMA_VERSION}, got {schema}")
    name = top.get("name", str)
    if not _NAME.fullmatch(name):
        raise SpecError(f"name: letters, digits, '.', '_' and '-', starting with a letter or digit "
                        f"(it names profile files), got {shorten(name)!r}")
    if len(name) > MAX_NAME_CHARS:
        raise SpecError(f"name: at most {MAX_NAME_CHARS} characters (it names profile files), "
                        f"got {len(name)}")
    spec = ModelSpec(
        name=name,
        model=_model(top.section("model")),
        data=_data(top.section("data", required=False), source_dir),
        optimizer=parse_optimizer(top.section("optimizer", required=False)),
        train=_train(train := top.section("train")),
        # A training length given and no time budget: the tune's budget is sized to it.
        search=_search(top.section("search", required=False),
                       time_budget_default=None if "steps" in train.raw else DEFAULT_TIME_BUDGET_S),
        source_dir=source_dir,
        loss=_loss(top.section("loss", required=False)),
        schema=schema,
    )
    top.finish()
    if 8 in spec.search.optimizer_bits and spec.optimizer.name not in ("adamw", "adam"):
        raise SpecError(f"search.optimizer_bits: 8-bit state is for adam and adamw, got optimizer.name "
                        f"{spec.optimizer.name}; use [32]")
    if spec.data.kind == "python" and spec.data.factory is None:
        raise SpecError("data.factory: required when data.kind is python (\"module.path:function\")")
    if spec.data.kind == "tokens" and spec.data.path is None:
        raise SpecError("data.path: required when data.kind is tokens (a flat uint16 token file)")
    if spec.data.kind == "text":
        if spec.data.path is None:
            raise SpecError("data.path: required when data.kind is text (a .jsonl or .txt corpus)")
        if spec.data.tokenizer is None:
            raise SpecError("data.tokenizer: required when data.kind is text (a tokenizers tokenizer.json)")
        if spec.data.seq_len is not None:
            raise SpecError("data.seq_len: not for data.kind text; data.max_length sets the sample length")
    return spec


def _model(r: "Reader") -> ModelSource:
    given = [k for k in (*MODEL_SOURCES, OBJECT_SOURCE) if k in r.raw]
    if len(given) != 1:
        what = "none" if not given else " and ".join(given)
        raise SpecError(f"model: exactly one source of {', '.join(MODEL_SOURCES)} is needed, got {what}")
    kind = given[0]
    if kind == "hf":
        hf = r.section("hf")
        target, args = hf.get("class", str), hf.kwargs("config")
        hf.finish()
    else:
        target = r.get(kind, str)
        if kind == "python" and not _TARGET.fullmatch(target):
            raise SpecError(f"model.python: expected \"module.path:function\" (or a class), got {target!r}")
        args = r.kwargs("args")
        if kind == "python":
            _check_constructors(args, "model.args", depth=0)
    source = ModelSource(kind=kind, target=target, args=args, blocks=_blocks(r),
                         batch_dim=r.nonnegative_int("batch_dim", default=None, maximum=MAX_BATCH_DIM))
    r.finish()
    return source


def _blocks(r: "Reader") -> tuple[str, ...] | None:
    value = r.get("blocks", (str, list), default=None)
    if value is None:
        return None
    paths = [value] if isinstance(value, str) else value
    for i, path in enumerate(paths):
        if not isinstance(path, str) or not re.fullmatch(r"[\w]+(\.[\w]+)*", path):
            where = "model.blocks" if isinstance(value, str) else f"model.blocks[{i}]"
            raise SpecError(f"{where}: a dotted module path such as transformer.h, got {path!r}")
    if not paths:
        raise SpecError("model.blocks: at least one module path is needed")
    return tuple(paths)


def _check_constructors(args: dict, key_path: str, depth: int) -> None:
    """A value `{python: "module:Callable", args: {...}}` in a python model's args is built
    before the model (nanoGPT's GPT takes a GPTConfig object): check its form here."""
    for key, value in args.items():
        if not (isinstance(value, dict) and "python" in value):
            continue
        where = f"{key_path}.{key}"
        if depth >= MAX_NESTING:
            raise SpecError(f"{where}: constructors nest at most {MAX_NESTING} deep")
        nested = Reader(value, where)
        target = nested.get("python", str)
        if not _TARGET.fullmatch(target):
            raise SpecError(f"{where}.python: expected \"module.path:Callable\", got {target!r}")
        _check_constructors(nested.kwargs("args"), f"{where}.args", depth + 1)
        nested.finish()


def _loss(r: "Reader") -> LossSpec:
    target = r.get("python", str, default=None)
    if target is not None and not _TARGET.fullmatch(target):
        raise SpecError(f"loss.python: expected \"module.path:function\", got {target!r}")
    args = r.kwargs("args")
    if args and target is None:
        raise SpecError("loss.args: only with loss.python (the arguments of your loss function)")
    loss = LossSpec(python=target, args=args, per_sample=r.get("per_sample", bool, default=True))
    r.finish()
    return loss


def _data(r: "Reader", source_dir: Path) -> DataSpec:
    kind = r.choice("kind", DATA_KINDS, default="synthetic")
    path = r.get("path", str, default=None)
    factory = r.get("factory", str, default=None)
    if factory is not None and not _TARGET.fullmatch(factory):
        raise SpecError(f"data.factory: expected \"module.path:function\", got {factory!r}")
    data = DataSpec(
        kind=kind,
        path=(source_dir / path).resolve() if path is not None else None,
        factory=factory,
        seq_len=r.positive_int("seq_len", default=None, maximum=MAX_SEQ_LEN),
        args=r.kwargs("args"),
        **_text_options(r, kind, path, source_dir),
    )
    r.finish()
    return data


def _text_options(r: "Reader", kind: str, path: str | None, source_dir: Path) -> dict:
    if kind != "text":
        given = [k for k in _TEXT_KEYS if r.raw.get(k) is not None]
        if given:
            raise SpecError(f"data.{given[0]}: only for data.kind text, not {kind}")
        r.used.update(_TEXT_KEYS)
        return {}
    suffix = Path(path).suffix.lstrip(".") if path else ""
    fmt = r.choice("format", TEXT_FORMATS, default=suffix if suffix in TEXT_FORMATS else MISSING)
    tokenizer = r.get("tokenizer", str, default=None)
    max_length = r.positive_int("max_length", default=None)
    if max_length is not None and max_length < 2:
        raise SpecError(f"data.max_length: at least 2 (one input token and its target), got {max_length}")
    field_name = r.get("field", str, default=None)
    if fmt == "txt" and field_name is not None:
        raise SpecError("data.field: only for format jsonl (a txt corpus is one sample a line)")
    return {
        "format": fmt,
        "field": (field_name or "text") if fmt == "jsonl" else None,
        "tokenizer": (source_dir / tokenizer).resolve() if tokenizer is not None else None,
        "max_length": max_length,
        "padding": r.choice("padding", TEXT_PADDINGS, default="dynamic"),
        "packing": r.get("packing", bool, default=False),
        "pad_to_multiple_of": r.positive_int("pad_to_multiple_of", default=1),
    }


def parse_optimizer(r: "Reader") -> OptimizerSpec:
    """The `optimizer` section (a profile's `training.optimizer` too)."""
    if "python" in r.raw:
        return _python_optimizer(r)
    betas = r.get("betas", list, default=[0.9, 0.999])
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                                  for b in betas):
        raise r.error(f"{r.prefix}.betas: two numbers in [0, 1), got {shorten(repr(betas))}")
    name = r.get("name", str, default="adamw")
    if name not in OPTIMIZERS:
        raise r.error(f"{r.prefix}.name: {choice_error(name, OPTIMIZERS)}; your own optimizer is "
                      f"python: \"module.path:function\" with args: {{...}}")
    opt = OptimizerSpec(
        name=name,
        lr=r.number("lr", default=3e-4, minimum=0.0, exclusive=True),
        weight_decay=r.number("weight_decay", default=0.0, minimum=0.0),
        betas=(float(betas[0]), float(betas[1])),
        momentum=r.number("momentum", default=0.0, minimum=0.0),
    )
    r.finish()
    return opt


def _python_optimizer(r: "Reader") -> OptimizerSpec:
    """`optimizer: {python: "module:function", args: {...}}`: the user's own optimizer. Its
    hyperparameters are its own, in args; the built-in keys beside python would be ignored."""
    target = r.get("python", str)
    if not _TARGET.fullmatch(target):
        raise r.error(f"{r.prefix}.python: \"module.path:function\" (a function or an optimizer class "
                      f"called as fn(params, **args)), got {shorten(target)!r}")
    args = r.kwargs("args")
    r.finish()
    return OptimizerSpec(name="python", python=target, args=dict(args))


def _train(r: "Reader") -> TrainSpec:
    clip = r.get("max_grad_norm", (int, float), default=1.0, nullable=True)
    if clip is not None and not (math.isfinite(clip) and clip > 0):
        raise SpecError(f"train.max_grad_norm: must be a positive finite number or null (no clipping), got {clip}")
    train = TrainSpec(
        global_batch_size=r.positive_int("global_batch_size", maximum=MAX_GLOBAL_BATCH_SIZE),
        steps=r.positive_int("steps", default=100, maximum=MAX_STEPS),
        max_grad_norm=None if clip is None else float(clip),
        seed=_seed(r),
        checkpoint_every=r.nonnegative_int("checkpoint_every", default=50, maximum=MAX_STEPS),
        log_every=r.positive_int("log_every", default=10, maximum=MAX_STEPS),
    )
    r.finish()
    return train


def _seed(r: "Reader") -> int:
    seed = r.get("seed", int, default=0)
    if not 0 <= seed < 2**32:  # torch and Optuna's samplers take 32-bit unsigned seeds
        raise SpecError(f"train.seed: an integer in [0, 2**32), got {seed}")
    return seed


_OPT_IN_DEFAULTS = {"min_micro_batch_size": None, "loss_curve_rtol": 0.01} | {
    k.choices: list(k.spec_default) for k in spec_knobs()}


def _search(r: "Reader", *, time_budget_default: float | None = DEFAULT_TIME_BUDGET_S) -> SearchSpec:
    precisions = r.get("precisions", list, default=list(PRECISIONS))
    for i, p in enumerate(precisions):
        if p not in PRECISIONS:
            raise SpecError(f"search.precisions[{i}]: {choice_error(p, PRECISIONS)}")
    if not precisions:
        raise SpecError(f"search.precisions: at least one of {', '.join(PRECISIONS)} is needed")
    headroom = r.number("memory_headroom", default=0.05, minimum=0.0)
    if headroom >= 0.5:
        raise SpecError(f"search.memory_headroom: a fraction below 0.5, got {headroom}")
    search = SearchSpec(
        precisions=tuple(dict.fromkeys(precisions)),
        max_freeze_blocks=r.nonnegative_int("max_freeze_blocks", default=0, maximum=MAX_TRIAL_STEPS),
        activation_checkpointing=r.get("activation_checkpointing", bool, default=True),
        memory_headroom=headroom,
        trials=r.positive_int("trials", default=40, maximum=MAX_TRIALS),
        patience=r.positive_int("patience", default=12, maximum=MAX_TRIALS),
        warmup_steps=r.nonnegative_int("warmup_steps", default=5, maximum=MAX_TRIAL_STEPS),
        measure_steps=r.positive_int("measure_steps", default=3, maximum=MAX_TRIAL_STEPS),
        window_s=r.number("window_s", default=2.0, minimum=0.0, maximum=MAX_TIMEOUT_S),
        validate_steps=r.positive_int("validate_steps", default=50, maximum=MAX_TRIAL_STEPS),
        frontier_points=r.positive_int("frontier_points", default=4, maximum=MAX_TRIALS),
        trial_timeout_s=r.number("trial_timeout_s", default=600.0, minimum=0.0, exclusive=True,
                                 maximum=MAX_TIMEOUT_S),
        min_micro_batch_size=r.positive_int("min_micro_batch_size", default=None, maximum=MAX_GLOBAL_BATCH_SIZE),
        **{k.choices: _choices(r, k.choices, k.values, default=k.spec_default) for k in spec_knobs()},
        time_budget_s=_duration(r, "time_budget", default=time_budget_default),
        loss_curve_rtol=r.number("loss_curve_rtol", default=0.01, minimum=0.0, exclusive=True, maximum=1.0),
    )
    r.finish()
    return search


def _duration(r: "Reader", key: str, *, default: float | None) -> float | None:
    value = r.get(key, (str, float), default=default)
    if value is None:
        return None
    try:
        return parse_duration(value, what=r._path(key))
    except ValueError as exc:
        raise SpecError(str(exc)) from None


def _choices(r: "Reader", key: str, allowed: tuple, *, default: tuple) -> tuple:
    """A non-empty list of distinct values from `allowed`, in the given order; `default` when
    absent. A yes/no knob also takes one boolean: `false` forbids it, `true` searches both."""
    values = r.get(key, (list, bool) if allowed == (False, True) else list, default=None)
    if values is None:
        return default
    if isinstance(values, bool):
        values = [False, True] if values else [False]
    for i, value in enumerate(values):
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            names = tuple(str(a).lower() if isinstance(a, bool) else str(a) for a in allowed)  # YAML spelling
            raise SpecError(f"search.{key}[{i}]: {choice_error(value, names)}")
    if not values:
        raise SpecError(f"search.{key}: at least one value is needed")
    return tuple(dict.fromkeys(values))
