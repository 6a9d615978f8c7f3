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

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from autofit.base.errors import SpecError
from autofit.workload import chunked, hf, text
from autofit.workload.data import (Batch, batch_size_of, batch_to, check_kwargs, dataset_source, DatasetData,
                                   DataSource, InputSpec, load_callable, split_batch, SyntheticData, TokenFileData,
                                   user_code)
from autofit.workload.text import text_lm_loss, TextData
from autofit.workload.zoo import builtin_inputs, BUILTIN_MODELS

__all__ = [
    "BUILTIN_MODELS", "Batch", "DataSource", "InputSpec", "TextData", "Workload",
    "batch_size_of", "batch_to", "build_workload", "split_batch",
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

    def data_assumptions(self) -> dict:
        """What a profile's peak and speed assume of varying-length data (empty otherwise):
        the longest sample, padding, packing."""
        return self.data.describe() if isinstance(self.data, TextData) else {}


def build_workload(spec) -> Workload:
    """Model source x data source of a ModelSpec; incompatible pairs raise SpecError."""
    source, data = spec.model, spec.data
    if source.kind == "builtin":
        inputs = builtin_inputs(source.target, source.args)
        if data.seq_len is not None:
            if inputs.seq_len is None:
                raise SpecError(f"data.seq_len: only for language models; {source.target} takes "
                                f"{inputs.sample_shape}")
            if data.seq_len > inputs.seq_len:
                raise SpecError(f"data.seq_len: at most model.args.seq_len ({inputs.seq_len}), got {data.seq_len}")
            inputs = inputs.with_seq_len(data.seq_len)
        build_model = functools.partial(BUILTIN_MODELS[source.target], dict(source.args))
        loss_fn = _lm_loss if inputs.task == "causal_lm" else _classify_loss
        chunkable = inputs.task == "causal_lm" and chunked.available()
        where = f"model.builtin {source.target}"
    elif source.kind == "hf":
        resolved = hf.resolve(source.target, dict(source.args), seq_len=data.seq_len)
        inputs, build_model = resolved.inputs, resolved.build
        # Python datasets may give tuple batches; the generic loss handles both kinds.
        loss_fn = hf.loss if data.kind != "python" else _generic_loss
        chunkable = inputs.task == "causal_lm" and data.kind != "python" and chunked.hf_chunkable(resolved.config)
        where = f"model.hf {source.target}"
    elif source.kind == "python":
        fn = load_callable(source.target, "model.python", spec.source_dir)
        check_kwargs(fn, source.args, "model.args", source.target)
        inputs = None  # unknown until the user's model runs
        build_model = functools.partial(_build_python, fn, dict(source.args), source.target)
        loss_fn = functools.partial(_user_loss, source.target)
        chunkable = False  # autofit cannot find the head of a model it did not build
        where = f"model.python {source.target}"
    else:
        raise SpecError(f"model: unknown source kind {source.kind!r}; allowed: builtin, hf, python")

    if data.kind == "synthetic":
        if inputs is None:
            raise SpecError(f"data.kind: synthetic data needs a builtin or hf model to know the input "
                            f"shapes; {where} needs data.kind python (or tokens for a causal LM)")
        source_data = SyntheticData(inputs)
        tokens_per_sample, sample_shape = inputs.seq_len, inputs.sample_shape
    elif data.kind == "tokens":
        if inputs is None:
            if data.seq_len is None:
                raise SpecError(f"data.seq_len: required with data.kind tokens and {where} "
                                f"(autofit cannot read the sequence length from a python model)")
            inputs = InputSpec(task="causal_lm", seq_len=data.seq_len)
        if inputs.task != "causal_lm":
            raise SpecError(f"data.kind: tokens data is next-token windows for causal language models; "
                            f"{where} is a {inputs.task.replace('_', ' ')} model (use synthetic or python)")
        source_data = TokenFileData(data.path, inputs)
        tokens_per_sample, sample_shape = inputs.seq_len, inputs.sample_shape
    elif data.kind == "text":
        source_data = _text_source(spec, inputs, where)
        loss_fn, tokens_per_sample = text_lm_loss, None  # tokens are counted per step: lengths vary
        chunked_loss_fn = chunked.chunked_text_lm_loss if chunkable else None
        sample_shape = f"tokens[<={source_data.longest_tokens}]"
    elif data.kind == "python":
        source_data = dataset_source(data.factory, data.args, spec.source_dir)
        sample_shape = source_data.describe()
        tokens_per_sample = _dataset_seq_len(source_data) if inputs is not None and inputs.seq_len else None
    else:
        raise SpecError(f"data.kind: unknown kind {data.kind!r}; allowed: synthetic, tokens, python, text")

    if data.kind != "text":
        chunked_loss_fn = chunked.chunked_lm_loss if chunkable and data.kind != "python" else None
    return Workload(name=spec.name, build_model=build_model, data=source_data, loss_fn=loss_fn,
                    tokens_per_sample=tokens_per_sample, sample_shape=sample_shape, chunked_loss_fn=chunked_loss_fn)


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


def _build_python(fn: Callable, args: dict, target: str) -> nn.Module:
    with user_code("model.python", target, "building the model"):
        model = fn(**args)
    if not isinstance(model, nn.Module):
        raise SpecError(f"model.python: {target} must return a torch.nn.Module, got {type(model).__name__}")
    return model


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


def _user_loss(target: str, model: nn.Module, batch: Batch) -> torch.Tensor:
    """The user's model's forward (and its loss), with their exceptions named as theirs."""
    with user_code("model.python", target, "running forward"):
        return _generic_loss(model, batch)


def _generic_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """User models: dict batches are keyword inputs; in a tuple batch the last tensor is the
    target and the rest are inputs (a one-tensor batch is all input)."""
    if isinstance(batch, dict):
        out = model(**batch)
    else:
        out = model(*batch[:-1]) if len(batch) > 1 else model(*batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is not None:
        return loss
    if isinstance(out, torch.Tensor) and out.ndim == 0:
        return out
    if isinstance(out, torch.Tensor) and isinstance(batch, tuple) and len(batch) > 1:
        # Logits [..., classes] against integer targets [...]: LMs and classifiers alike.
        return F.cross_entropy(out.float().flatten(0, -2), batch[-1].flatten())
    raise SpecError("model: cannot compute a loss: the model returned neither `.loss` nor a scalar, "
                    "and the batch has no target (a tuple batch's last tensor)")
