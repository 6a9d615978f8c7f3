"""What is trained: a model factory, a batch source and a loss, built from a ModelSpec.

    from autofit.config.spec import load_spec
    from autofit.workload import build_workload
    workload = build_workload(load_spec("model.yaml"))
    model = workload.build_model()
    batch = workload.data.batch(8, torch.Generator().manual_seed(0))
    workload.loss_fn(model, batch).backward()

Everything is checked here, before any model is built: a model source and data source that
cannot work together, or a bad argument, is a `SpecError` naming the key.
"""

import copy
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from autofit.base.errors import SpecError
from autofit.config.spec import OBJECT_SOURCE
from autofit.workload import chunked, hf, text
from autofit.workload.binding import ModelLoss, UserLoss
from autofit.workload.blocks import declare_blocks
from autofit.workload.optimizer import load_user_optimizer
from autofit.workload.data import (Batch, batch_size_of, batch_to, BatchFn, check_kwargs, dataset_source, DatasetData,
                                   DataSource, describe_batch, FunctionData, InputSpec, load_callable, split_batch,
                                   SyntheticData, TokenFileData, user_code)
from autofit.workload.text import text_lm_loss, TextData
from autofit.workload.zoo import builtin_inputs, BUILTIN_MODELS

__all__ = [
    "BUILTIN_MODELS", "Batch", "DataSource", "InputSpec", "TextData", "Workload",
    "batch_size_of", "batch_to", "build_workload", "make_workload", "split_batch",
]


@dataclass(frozen=True, kw_only=True)
class Workload:
    name: str
    build_model: Callable[[], nn.Module]  # on CPU in fp32; deterministic given torch's RNG state
    data: DataSource  # .batch(batch_size, generator) -> Batch of CPU tensors
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor]  # scalar mean over the batch
    tokens_per_sample: int | None  # seq_len for token models, None otherwise
    sample_shape: str  # e.g. "tokens[1024]", "image[3x32x32]"
    # The same loss with the LM head and cross-entropy chunked (`chunked_loss`); None where
    # the model has no LM head autofit can chunk.
    chunked_loss_fn: Callable[[nn.Module, Batch], torch.Tensor] | None = None
    # What a micro batch's loss is a mean over (its labelled tokens), so that a step weighs
    # its micro batches by them and the loss is the global batch's token mean at any micro
    # batch size; None (or a None answer): micro batches weigh alike.
    loss_items: Callable[[nn.Module, Batch], torch.Tensor | None] | None = None
    # False: the loss couples the samples of a batch (in-batch negatives): one micro batch per step.
    per_sample: bool = True
    # Where the model takes the batch, when declared (inputs are moved there); None: dim 0.
    batch_dim: int | None = None
    # A model autofit did not write whose batch dimension nobody declared: `batch_dim.check_batch_dim`
    # checks it before training.
    probe_batch_dim: bool = False
    # The user's own optimizer (`optimizer.python`, `autofit.tune(optimizer=...)`):
    # params -> torch.optim.Optimizer; None: the spec's built-in one (train.optim).
    optimizer: Callable[[list], torch.optim.Optimizer] | None = None

    def data_assumptions(self) -> dict:
        """What a profile's peak and speed assume of varying-length data (empty otherwise):
        the longest sample, padding, packing."""
        return self.data.describe() if isinstance(self.data, TextData) else {}


def make_workload(model: nn.Module | Callable[[], nn.Module], batch_fn: BatchFn | DataSource,
                  loss_fn: Callable[[nn.Module, Batch], torch.Tensor] | None = None, *, name: str = "model",
                  per_sample: bool = True, batch_dim: int | None = None, blocks: str | Sequence[str] | None = None,
                  tokens_per_sample: int | None = None, sample_shape: str | None = None,
                  chunked_loss_fn: Callable | None = None, loss_items: Callable | None = None,
                  probe_batch_dim: bool | None = None, key_path: str = "model", target: str | None = None,
                  optimizer: Callable[[list], torch.optim.Optimizer] | None = None) -> Workload:
    """A Workload from Python objects; the spec path (`build_workload`) ends here too.

    `model`: an `nn.Module` (each build is a deep copy: the object itself is never changed)
    or a factory `() -> nn.Module` (called once per build, under torch's seeded RNG).
    `batch_fn(batch_size, generator)`: a batch of CPU tensors (a tensor, tuple/list or dict
    of tensors, batch in dim 0), the same for the same generator state; or a `DataSource`.
    `loss_fn(model, micro_batch) -> scalar tensor`: the micro batch's mean loss; None: the
    model's own (`binding.ModelLoss`: the batch bound to forward by its signature, the loss
    from its output, else cross-entropy of its logits against the targets).
    `per_sample=False`: the loss couples the samples of a batch (in-batch negatives), so
    every step runs the whole batch as one micro batch. `batch_dim`: where forward takes the
    batch (autofit's batches hold it in dim 0 and move it there); None: dim 0, checked by a
    probe (`batch_dim.check_batch_dim`) unless `probe_batch_dim=False`. `blocks`: the dotted
    paths of the block stack's containers (else found). The rest is what a spec also knows:
    names for errors (`key_path`, `target`), token counts, the chunked loss, `loss_items`,
    and the user's own optimizer (`optimizer`: params -> torch.optim.Optimizer).
    """
    target = target or (type(model).__name__ if isinstance(model, nn.Module) else getattr(model, "__name__", "model"))
    build = _Build(model, tuple([blocks] if isinstance(blocks, str) else blocks or ()) or None, key_path, target)
    data = batch_fn if hasattr(batch_fn, "batch") else FunctionData(batch_fn)
    if loss_fn is None:
        default = ModelLoss(key_path=key_path, target=target, batch_dim=batch_dim or 0)
        loss_fn, loss_items = default, loss_items or default.items
    if probe_batch_dim is None:
        probe_batch_dim = batch_dim is None and per_sample
    return Workload(name=name, build_model=build, data=data, loss_fn=loss_fn, tokens_per_sample=tokens_per_sample,
                    sample_shape=sample_shape or (data.describe() if hasattr(data, "describe") else "unknown"),
                    chunked_loss_fn=chunked_loss_fn,
                    loss_items=loss_items, per_sample=per_sample, batch_dim=batch_dim, probe_batch_dim=probe_batch_dim,
                    optimizer=optimizer)


class _Build:
    """`Workload.build_model`: the model (a copy of an object, or the factory's), with its
    block stack declared when named. Plain data, so a Workload pickles."""

    def __init__(self, model, blocks: tuple[str, ...] | None, key_path: str, target: str):
        self.model, self.blocks, self.key_path, self.target = model, blocks, key_path, target

    def __call__(self) -> nn.Module:
        if isinstance(self.model, nn.Module):
            model = copy.deepcopy(self.model)
        else:
            with user_code(self.key_path, self.target, "building the model"):
                model = self.model()
            if not isinstance(model, nn.Module):
                raise SpecError(f"{self.key_path}: {self.target} must return a torch.nn.Module, "
                                f"got {type(model).__name__}")
        return declare_blocks(model, self.blocks)


@dataclass(frozen=True, kw_only=True, slots=True)
class _ModelSource:
    """What a spec's model source gives the workload before the data is known."""
    inputs: InputSpec | None  # None: unknown until the user's model runs
    factory: Callable[[], nn.Module]
    loss_fn: Callable | None  # None: the model's own, bound by its signature (binding.ModelLoss)
    loss_items: Callable | None
    chunkable: bool  # whether autofit can chunk the LM head's loss
    where: str  # the source in words, for errors


def build_workload(spec) -> Workload:
    """Model source x data source x loss of a ModelSpec; incompatible pairs raise SpecError."""
    source, data = spec.model, spec.data
    if source.kind == OBJECT_SOURCE:
        raise SpecError(f"model.object: {source.target} was given to autofit.tune() as a Python object; a spec file "
                        f"names a model with model.python: \"module.path:function\" (or builtin, hf)")
    if source.kind != "python" and source.batch_dim not in (None, 0):
        raise SpecError(f"model.batch_dim: only for python models; {source.kind} models take the batch in dim 0")
    if source.kind == "builtin":
        model = _builtin_source(source, data)
    elif source.kind == "hf":
        model = _hf_source(source, data)
    elif source.kind == "python":
        model = _python_source(source, spec.source_dir)
    else:
        raise SpecError(f"model: unknown source kind {source.kind!r}; allowed: builtin, hf, python")
    source_data, tokens_per_sample, sample_shape = _data_source(spec, model.inputs, model.where)
    loss_fn, loss_items, chunked_loss_fn = _losses(spec, model)
    optimizer = None
    if spec.optimizer.python is not None:
        optimizer = load_user_optimizer(spec.optimizer.python, spec.optimizer.args, spec.source_dir)
    return make_workload(model.factory, source_data, loss_fn, name=spec.name, per_sample=spec.loss.per_sample,
                         batch_dim=source.batch_dim if source.kind == "python" else 0, blocks=source.blocks,
                         tokens_per_sample=tokens_per_sample, sample_shape=sample_shape,
                         chunked_loss_fn=chunked_loss_fn, loss_items=loss_items,
                         probe_batch_dim=spec.probes_batch_dim,
                         key_path=f"model.{source.kind}", target=source.target, optimizer=optimizer)


def _builtin_source(source, data) -> _ModelSource:
    inputs = builtin_inputs(source.target, source.args)
    if data.seq_len is not None:
        if inputs.seq_len is None:
            raise SpecError(f"data.seq_len: only for language models; {source.target} takes "
                            f"{inputs.sample_shape}")
        if data.seq_len > inputs.seq_len:
            raise SpecError(f"data.seq_len: at most model.args.seq_len ({inputs.seq_len}), got {data.seq_len}")
        inputs = inputs.with_seq_len(data.seq_len)
    return _ModelSource(inputs=inputs, factory=functools.partial(BUILTIN_MODELS[source.target], dict(source.args)),
                        loss_fn=_lm_loss if inputs.task == "causal_lm" else _classify_loss, loss_items=None,
                        chunkable=inputs.task == "causal_lm" and chunked.available(),
                        where=f"model.builtin {source.target}")


def _hf_source(source, data) -> _ModelSource:
    resolved = hf.resolve(source.target, dict(source.args), seq_len=data.seq_len, synthetic=data.kind != "python")
    # Any batch: the model computes its loss from the labels, micro batches weighted by them.
    hf_loss = ModelLoss(key_path="model.hf", target=source.target, label_shift=resolved.label_shift,
                        users_code=False)
    return _ModelSource(inputs=resolved.inputs, factory=resolved.build, loss_fn=hf_loss, loss_items=hf_loss.items,
                        chunkable=(resolved.task == "causal_lm" and data.kind != "python"
                                   and chunked.hf_chunkable(resolved.config)),
                        where=f"model.hf {source.target}")


def _python_source(source, source_dir) -> _ModelSource:
    fn = load_callable(source.target, "model.python", source_dir)
    check_kwargs(fn, source.args, "model.args", source.target)
    _check_constructors(source.args, "model.args", source_dir)
    # autofit cannot find the head of a model it did not build: nothing to chunk.
    return _ModelSource(inputs=None, factory=functools.partial(_build_python, fn, dict(source.args), source.target,
                                                               source_dir),
                        loss_fn=None, loss_items=None, chunkable=False, where=f"model.python {source.target}")


def _losses(spec, model: _ModelSource) -> tuple[Callable | None, Callable | None, Callable | None]:
    """(loss, loss_items, chunked loss): the model source's, unless the data is text or the
    spec names its own loss."""
    data = spec.data
    loss_fn, loss_items = model.loss_fn, model.loss_items
    if data.kind == "text":
        loss_fn, loss_items = text_lm_loss, None  # a per-sample mean: micro batches weigh alike
        chunked_loss_fn = chunked.chunked_text_lm_loss if model.chunkable else None
    else:
        chunked_loss_fn = chunked.chunked_lm_loss if model.chunkable and data.kind != "python" else None
    if spec.loss.python is not None:
        fn = load_callable(spec.loss.python, "loss.python", spec.source_dir)
        check_kwargs(fn, spec.loss.args, "loss.args", spec.loss.python, positional=2)  # fn(model, micro_batch, ...)
        loss_fn, loss_items, chunked_loss_fn = UserLoss(fn, dict(spec.loss.args), "loss.python", spec.loss.python), \
            None, None
    return loss_fn, loss_items, chunked_loss_fn


def _data_source(spec, inputs: InputSpec | None, where: str) -> tuple[DataSource, int | None, str]:
    """The spec's data source, checked against the model: (source, tokens per sample, sample shape)."""
    data = spec.data
    if data.kind == "synthetic":
        if inputs is None:
            raise SpecError(f"data.kind: synthetic data needs a builtin or hf model to know the input "
                            f"shapes; {where} needs data.kind python (or tokens for a causal LM)")
        return SyntheticData(inputs), inputs.seq_len, inputs.sample_shape
    if data.kind == "tokens":
        if inputs is None:
            if data.seq_len is None:
                raise SpecError(f"data.seq_len: required with data.kind tokens and {where} "
                                f"(autofit cannot read the sequence length from a python model)")
            inputs = InputSpec(task="causal_lm", seq_len=data.seq_len)
        if inputs.task != "causal_lm":
            raise SpecError(f"data.kind: tokens data is next-token windows for causal language models; "
                            f"{where} is a {inputs.task.replace('_', ' ')} model (use synthetic or python)")
        return TokenFileData(data.path, inputs), inputs.seq_len, inputs.sample_shape
    if data.kind == "text":
        source = _text_source(spec, inputs, where)
        return source, None, f"tokens[<={source.longest_tokens}]"  # tokens are counted per step: lengths vary
    if data.kind == "python":
        source = dataset_source(data.factory, data.args, spec.source_dir)
        tokens_per_sample = _dataset_seq_len(source) if inputs is not None and inputs.seq_len else None
        return source, tokens_per_sample, source.describe()
    raise SpecError(f"data.kind: unknown kind {data.kind!r}; allowed: synthetic, tokens, python, text")


def _text_source(spec, inputs: InputSpec | None, where: str) -> TextData:
    """The tokenized corpus, checked against what the model can take."""
    data = spec.data
    if inputs is None or inputs.task != "causal_lm":
        what = "a python model" if inputs is None else f"a {inputs.task.replace('_', ' ')} model"
        raise SpecError(f"data.kind: text data trains causal language models (builtin gpt or an hf causal LM); "
                        f"{where} is {what}")
    # The built-in GPT reads tokens[:-1] and predicts tokens[1:]; HF models shift inside.
    positions = inputs.seq_len + (0 if inputs.hf else 1)
    max_length = data.max_length or positions
    if max_length > positions:
        raise SpecError(f"data.max_length: at most {positions} tokens for {where} "
                        f"({inputs.seq_len} positions), got {max_length}")
    corpus = text.tokenize(data.path, data.format, data.field, data.tokenizer)
    if inputs.vocab_size is not None and corpus.vocab_size > inputs.vocab_size:
        raise SpecError(f"data.tokenizer: {data.tokenizer} has {corpus.vocab_size} tokens, more than the "
                        f"model's vocab_size ({inputs.vocab_size})")
    if inputs.vocab_size is not None and corpus.highest_id >= inputs.vocab_size:
        raise SpecError(f"data.tokenizer: {data.tokenizer} gives {data.path} token id {corpus.highest_id}, not "
                        f"below the model's vocab_size ({inputs.vocab_size})")
    source = TextData(corpus, max_length=max_length, padding=data.padding, packing=data.packing,
                      pad_to_multiple_of=data.pad_to_multiple_of, hf=inputs.hf, path=data.path)
    source.check_global_batch(spec.train.global_batch_size)
    return source


def _dataset_seq_len(data: DatasetData) -> int | None:
    batch = data.batch(1, torch.Generator().manual_seed(0))
    first = batch["input_ids"] if isinstance(batch, dict) and "input_ids" in batch else next(iter(
        batch.values() if isinstance(batch, dict) else batch))
    return first.shape[-1] if first.ndim == 2 else None


def _build_python(fn: Callable, args: dict, target: str, source_dir) -> nn.Module:
    with user_code("model.python", target, "building the model"):
        model = fn(**_construct(args, "model.args", source_dir))
    if not isinstance(model, nn.Module):
        raise SpecError(f"model.python: {target} must return a torch.nn.Module, got {type(model).__name__}")
    return model


def _constructors(args: dict, key_path: str):
    """(key path, target, its args) of every `{python: ..., args: ...}` value, outermost first."""
    for key, value in args.items():
        if isinstance(value, dict) and "python" in value:
            where = f"{key_path}.{key}"
            yield where, value["python"], value.get("args") or {}
            yield from _constructors(value.get("args") or {}, f"{where}.args")


def _check_constructors(args: dict, key_path: str, source_dir) -> None:
    """Every constructor in a python model's args imports and takes its arguments."""
    for where, target, kwargs in _constructors(args, key_path):
        check_kwargs(load_callable(target, f"{where}.python", source_dir), kwargs, f"{where}.args", target)


def _construct(args: dict, key_path: str, source_dir) -> dict:
    """The args with each `{python: "module:Callable", args: {...}}` built (innermost first):
    nanoGPT's `GPT(config)` gets a `GPTConfig`, built afresh for every model."""
    out = {}
    for key, value in args.items():
        if isinstance(value, dict) and "python" in value:
            where = f"{key_path}.{key}"
            fn = load_callable(value["python"], f"{where}.python", source_dir)
            with user_code(f"{where}.python", value["python"], "building an argument of the model"):
                value = fn(**_construct(value.get("args") or {}, f"{where}.args", source_dir))
        out[key] = value
    return out


# ---- losses: module level (not lambdas) so a Workload's parts can be pickled ---------------


def _lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    # fp32 for the softmax: under bf16-true, a bf16 log-softmax over a large vocabulary
    # is off by ~1 %, which would fail the precision health check for the wrong reason.
    return F.cross_entropy(logits.float().flatten(0, -2), y.flatten())


def _classify_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float(), y)
