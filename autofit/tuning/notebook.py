"""`autofit.tune` and `autofit.train_model` for a model that lives in Python (a notebook, a script),
not in a spec file.

    options = autofit.TuneOptions(global_batch_size=32, memory_budget="8GiB")
    profile = autofit.tune(model, batch_fn, loss_fn, options)   # or its fields as keywords:
    # profile = autofit.tune(model, batch_fn, loss_fn, global_batch_size=32, memory_budget="8GiB")
    with profile.apply(model, device="cuda") as plan:
        for step in range(1000):
            plan.step(batch=batch_fn(32, generator), loss_fn=loss_fn)

Trials run in a pre-loaded worker like any tune's: a fresh interpreter that forks a child
per trial. The model (or its factory), `batch_fn` and `loss_fn` reach it **pickled by value**
(cloudpickle), not by forking this process: a process that has run a parallel CPU op cannot
be forked safely (libgomp), and one that holds a CUDA context cannot give it to a child. So
what they need must be picklable and self-contained at the time of the call: no open
files, sockets, locks, threads or CUDA tensors in them or their closures, nothing that
only this process's later state would make right. Tensors and modules they reference are
copied with them: pass a factory (`lambda: GPT(config)`) rather than a large model, whose
weights would be pickled.
"""

import dataclasses
import hashlib
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import cloudpickle
import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from autofit.base.errors import SpecError
from autofit.base.logs import adopt_default_handler
from autofit.base.paths import default_state_dir, default_store_dir, sqlite_storage
from autofit.config.arguments import check_count, check_seconds
from autofit.config.spec import MAX_TRIALS, ModelSpec, OBJECT_SOURCE, parse_spec
from autofit.device.budget import budget_for
from autofit.device.probe import select_device
from autofit.workload.data import FunctionData
from autofit.workload.optimizer import from_object
from autofit.device.compiler_cache import use_inductor_cache
from autofit.profiles.profile import Profile
from autofit.tuning.tune import tune as tune_spec, TuneSetup
from autofit.tuning.training import train_module

OBJECTS_FILE = "objects.pkl"


@dataclass(frozen=True, kw_only=True, slots=True)
class TuneOptions:
    """How `autofit.tune` tunes a model that lives in Python: the settings a spec file would
    give (the spec's `train:`, `optimizer:` and `search:`), the device and budget the CLI's
    flags would, and where the study and the profile live. Each is also a keyword of
    `autofit.tune` itself."""

    global_batch_size: int  # the user's hyperparameter: micro batch x accumulation = this, never changed
    device: str | int | None = None  # "cpu" or a CUDA index, as --device; None: the first GPU, else the CPU
    memory_budget: str | int | None = None  # "8GiB" or bytes, as --memory-budget; None: what the card has free
    trials: int | None = None  # most trials, as --trials; None: search.trials
    # The spec's `optimizer:` section ({"name": "adamw", "lr": 3e-4, ...}), or your own optimizer:
    # a `torch.optim.Optimizer` class or a function fn(params, **optimizer_args) (or a
    # functools.partial of one), pickled with the model and used unchanged.
    optimizer: dict | Callable | type | None = None
    optimizer_args: dict | None = None  # your own optimizer's arguments (a built-in one takes them in its dict)
    name: str | None = None  # in the profile's file name; None: the model's class (or factory's) name
    per_sample: bool = True  # False: the loss couples a batch's samples (in-batch negatives): no batch is split
    batch_dim: int | None = None  # where `forward` takes the batch; None: 0, probed
    blocks: str | Sequence[str] | None = None  # dotted paths of the block stack; None: found
    max_grad_norm: float | None = 1.0  # the spec's train.max_grad_norm: trials clip as training will
    search: dict | None = None  # the spec's `search:` section (precisions, trials, validate_steps, ...)
    timeout_s: float | None = None  # the search's time, as --timeout; None: until its trials are done
    out_dir: str | Path | None = None  # the profile store; None: ./profiles
    state_dir: str | Path | None = None  # the study (resumed when the same cell runs again); None: the default
    report: bool = True  # the HTML report beside the profile

    def __post_init__(self) -> None:
        check_seconds("timeout_s", self.timeout_s)  # as `autofit tune --timeout`: before any work
        check_count("trials", self.trials, maximum=MAX_TRIALS)


_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(TuneOptions))


def tune(model: nn.Module | Callable[[], nn.Module], batch_fn: Callable, loss_fn: Callable | None = None,
         options: TuneOptions | None = None, **keywords) -> Profile:
    """Tune `model` as `autofit tune` tunes a spec's, and return the profile it wrote.

    `model`: an `nn.Module` on the CPU (each trial trains its own copy; the object itself is
    never changed) or a factory `() -> nn.Module`. `batch_fn(batch_size, generator)`: a batch
    of CPU tensors (a tensor, a tuple/list or a dict of them, batch in dim 0), the same for
    the same generator state. `loss_fn(model, micro_batch) -> scalar tensor`: the micro
    batch's mean loss; None: the model's own (`.loss`, `["loss"]`, a scalar, else
    cross-entropy of its logits against the batch's targets, bound to `forward` by name).
    `options`: a `TuneOptions` (its fields say what each setting does); or its fields as
    keywords (`global_batch_size=32, memory_budget="8GiB"`), not both. The optimizer a user
    gives as an object is recorded in the profile as `{python: "module:name", args: ...}`.

    The study (state_dir) and the profile (out_dir, default ./profiles) are keyed by the
    model's class, the shapes of its parameters and of a sample batch, so running the same
    cell again resumes the study instead of measuring again."""
    options = _options(options, keywords)
    adopt_default_handler()  # the CLI's log lines, not loguru's default ones
    spec, objects = _spec(model, batch_fn, loss_fn, options)
    info = select_device(None if options.device is None else str(options.device))
    budget = budget_for(info, options.memory_budget, headroom=spec.search.memory_headroom, time_s=options.timeout_s)
    state = Path(options.state_dir) if options.state_dir is not None else default_state_dir()
    state.mkdir(parents=True, exist_ok=True)
    use_inductor_cache(state)  # beside the study: a re-tune and the validation load its graphs
    out = Path(options.out_dir) if options.out_dir is not None else default_store_dir()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="autofit-objects-") as folder:
        path = Path(folder) / OBJECTS_FILE
        _pickle(objects, path)
        outcome = tune_spec(TuneSetup(spec=spec, device=info, budget=budget, out_dir=out,
                                      storage=sqlite_storage(state), trials=options.trials, report=options.report,
                                      objects=path))
    return outcome.profile


def _options(options: TuneOptions | None, keywords: dict) -> TuneOptions:
    """The options given, or those the keywords make (the keywords `autofit.tune` has always
    taken); both at once is a mistake said in one line."""
    unknown = sorted(set(keywords) - _OPTION_NAMES)
    if unknown:
        raise TypeError(f"autofit.tune() got unexpected keyword argument(s) {', '.join(unknown)}; its settings are "
                        f"the fields of autofit.TuneOptions")
    if options is None:
        if "global_batch_size" not in keywords:
            raise TypeError("autofit.tune() needs global_batch_size=N (or options=autofit.TuneOptions(...))")
        return TuneOptions(**keywords)
    if keywords:
        raise TypeError(f"autofit.tune() takes options or keywords, not both: put {', '.join(sorted(keywords))} in "
                        f"the TuneOptions (dataclasses.replace(options, ...))")
    if not isinstance(options, TuneOptions):
        raise TypeError(f"autofit.tune(): options must be an autofit.TuneOptions, got {type(options).__name__}")
    return options


def _spec(model, batch_fn: Callable, loss_fn: Callable | None, options: TuneOptions) -> tuple[ModelSpec, dict]:
    """The spec the options make for the model, and the objects the trial worker loads: the
    model, `batch_fn`, `loss_fn` and a user's own optimizer."""
    objects = {"model": model, "batch_fn": batch_fn, "loss_fn": loss_fn}
    optimizer, optimizer_args, blocks, batch_dim = (options.optimizer, options.optimizer_args, options.blocks,
                                                    options.batch_dim)
    optimizer_section = optimizer or {}
    if optimizer is not None and not isinstance(optimizer, dict):
        objects["optimizer"], target, args = from_object(optimizer, optimizer_args)
        optimizer_section = {"python": target, "args": args}
    elif optimizer_args is not None:
        raise SpecError("autofit.tune: optimizer_args are the arguments of your own optimizer (optimizer=Class "
                        "or a function); a built-in one takes them in the optimizer dict")
    model_section = {OBJECT_SOURCE: _target(model),
                     "args": {"fingerprint": _fingerprint(model, batch_fn, loss_fn, batch_dim)},
                     **({"blocks": [blocks] if isinstance(blocks, str) else list(blocks)} if blocks else {}),
                     **({"batch_dim": batch_dim} if batch_dim is not None else {})}
    spec = parse_spec({"name": options.name or _default_name(model), "model": model_section,
                       "optimizer": optimizer_section,
                       "train": {"global_batch_size": options.global_batch_size,
                                 "max_grad_norm": options.max_grad_norm},
                       "loss": {"per_sample": options.per_sample}, "search": options.search or {}},
                      source_dir=Path.cwd())
    return spec, objects


def train_model(model: nn.Module, batch_fn: Callable, loss_fn: Callable | None = None, *, profile: Profile, steps: int,
                device: str | int | None = None, seed: int = 0, memory_budget: str | int | None = None,
                log_every: int = 10, on_step: Callable[[int, float], None] | None = None,
                optimizer: Callable | type | None = None, optimizer_args: dict | None = None) -> nn.Module:
    """Train `model` for `steps` optimizer steps with `profile` (the point of its frontier that
    fits now), on batches of `batch_fn` drawn from a generator seeded with `seed`; returns
    the trained model (the plan's: `model` itself, moved to `device` and cast as the profile
    says). `on_step(step, loss)` hears each step's mean loss. `optimizer`: your own, as
    `autofit.tune` took it (default: the one the profile records, imported by its name). A loop of your own is
    `with profile.apply(model) as plan: plan.step(batch=..., loss_fn=...)`."""
    return train_module(model, batch_fn, loss_fn, profile=profile, steps=steps, device=device, seed=seed,
                        memory_budget=memory_budget, log_every=log_every, on_step=on_step, optimizer=optimizer,
                        optimizer_args=optimizer_args)


def _default_name(model) -> str:
    raw = type(model).__name__ if isinstance(model, nn.Module) else getattr(model, "__name__", "model")
    cleaned = "".join(c if c.isalnum() or c in "._-" else "-" for c in raw).strip("-._")
    return (cleaned or "model")[:64]


def _target(model) -> str:
    kind = type(model) if isinstance(model, nn.Module) else model
    return f"{getattr(kind, '__module__', '?')}.{getattr(kind, '__qualname__', type(kind).__name__)}"


def _fingerprint(model, batch_fn, loss_fn, batch_dim) -> str:
    """What the tuning depends on and a resumed study must share: the model's structure
    (class, module tree, parameter and buffer shapes and dtypes), a sample batch's shapes
    and dtypes, and the loss by name. Weights are not in it: training them changes nothing
    a profile says."""
    built = _meta_model(model)
    digest = hashlib.sha256()
    digest.update(repr(built).encode())
    for key, tensor in (*built.named_parameters(), *built.named_buffers()):
        digest.update(f"{key}:{tuple(tensor.shape)}:{tensor.dtype}:{tensor.requires_grad};".encode())
    sample = FunctionData(batch_fn).batch(2, torch.Generator().manual_seed(0))  # checked: one line if wrong
    for leaf in tree_leaves(sample):
        if isinstance(leaf, torch.Tensor):
            digest.update(f"{tuple(leaf.shape)}:{leaf.dtype};".encode())
    loss_name = "model" if loss_fn is None else getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
    digest.update(f"loss={loss_name};batch_dim={batch_dim}".encode())
    return "sha256:" + digest.hexdigest()[:32]


def _meta_model(model) -> nn.Module:
    if isinstance(model, nn.Module):
        where = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
        off = sorted(str(d) for d in where if d.type != "cpu")
        if off:
            raise SpecError(f"autofit.tune: the model's tensors are on {', '.join(off)}; pass it on the CPU (each "
                            f"trial trains a copy on the device it measures) or pass a factory, () -> model")
        return model
    if not callable(model):
        raise SpecError(f"autofit.tune: model must be a torch.nn.Module or a factory () -> nn.Module, "
                        f"got {type(model).__name__}")
    with torch.device("meta"):
        built = model()
    if not isinstance(built, nn.Module):
        raise SpecError(f"autofit.tune: the model factory must return a torch.nn.Module, got {type(built).__name__}")
    return built


def _pickle(objects: dict, path: Path) -> None:
    """Pickle by value what the worker needs, once; where that fails, one line naming the
    object that cannot be pickled."""
    try:
        data = cloudpickle.dumps(objects)
    except Exception as exc:  # noqa: BLE001 - any pickling error is the caller's object's
        key = next((k for k, v in objects.items() if not _pickles(v)), "an object")
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise SpecError(f"autofit.tune: {key} cannot be sent to the trial worker ({type(exc).__name__}: "
                        f"{first}); it and what it refers to must pickle: no open files, locks, threads, "
                        f"generators or CUDA tensors") from None
    path.write_bytes(data)


def _pickles(value) -> bool:
    try:
        cloudpickle.dumps(value)
    except Exception:  # noqa: BLE001 - only whether it pickles matters here
        return False
    return True
