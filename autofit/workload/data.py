"""Data sources (synthetic, token file, Python dataset factory) and batch helpers.

A data source has one method, `batch(batch_size, generator) -> Batch`, returning CPU
tensors. The same (batch_size, generator state) always gives the same batch, and every batch
has the same, largest, input size: the tuner measures memory on these batches, so a shorter
batch during tuning would hide an out-of-memory error in training.
"""

import contextlib
import errno
import importlib
import inspect
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch
from torch.utils.data import default_collate

from autofit.base.errors import AutofitError, SpecError, UserCodeError
from autofit.base.resources import exhausted
from autofit.device.oom import is_oom

Batch = dict[str, torch.Tensor] | tuple[torch.Tensor, ...]

# What a batch trains: next tokens, masked tokens, a label per sample, a label per token,
# or target sequences for an encoder-decoder.
TASKS = ("causal_lm", "masked_lm", "classify", "token_classify", "seq2seq")
MASKED_FRACTION = 0.15  # BERT's share of positions that carry a masked-LM label
TOKEN_DTYPE = np.dtype("<u2")  # flat little-endian uint16, as scripts/tokenize_bytes.py writes
_SCAN_LIMIT_TOKENS = 1 << 28  # 512 MiB of tokens checked up front; larger files are checked per batch
_SCAN_CHUNK_TOKENS = 1 << 24


class DataSource(Protocol):
    def batch(self, batch_size: int, generator: torch.Generator) -> Batch: ...


BatchFn = Callable[[int, torch.Generator], Any]  # (batch_size, generator) -> a batch of CPU tensors


@dataclass(frozen=True, kw_only=True)
class InputSpec:
    """What a model eats, known without building it (a large model costs GiBs to build)."""

    task: str  # one of TASKS
    hf: bool = False  # Hugging Face style: dict batch with input_ids/labels, loss from outputs.loss
    seq_len: int | None = None  # token inputs: tokens per sample
    vocab_size: int | None = None  # token inputs: ids are drawn below this
    feature_shape: tuple[int, ...] | None = None  # float inputs: per-sample shape
    n_classes: int | None = None  # classify: labels are drawn below this

    def __post_init__(self):
        assert self.task in TASKS, self.task
        assert (self.seq_len is None) == (self.feature_shape is not None), "tokens or features, not both"

    @property
    def sample_shape(self) -> str:
        if self.seq_len is not None:
            return f"tokens[{self.seq_len}]"
        name = "image" if len(self.feature_shape) == 3 else "features"
        return f"{name}[{'x'.join(map(str, self.feature_shape))}]"

    def with_seq_len(self, seq_len: int) -> "InputSpec":
        return replace(self, seq_len=seq_len)


# ---- sources -------------------------------------------------------------------------------


class SyntheticData:
    """Random inputs of the model's full size; enough to measure speed and memory."""

    def __init__(self, inputs: InputSpec):
        self.inputs = inputs

    def batch(self, batch_size: int, generator: torch.Generator) -> Batch:
        spec = self.inputs
        if spec.seq_len is None:
            x = torch.randn((batch_size, *spec.feature_shape), generator=generator)
            y = torch.randint(spec.n_classes, (batch_size,), generator=generator)
            return {"pixel_values": x, "labels": y} if spec.hf else (x, y)
        if spec.task == "causal_lm" and not spec.hf:
            window = torch.randint(spec.vocab_size, (batch_size, spec.seq_len + 1), generator=generator)
            return shifted(window)
        ids = torch.randint(spec.vocab_size, (batch_size, spec.seq_len), generator=generator)
        return hf_batch(ids, spec, generator)


class TokenFileData:
    """Random windows of a flat uint16 token file (nanoGPT's train.bin)."""

    def __init__(self, path: Path, inputs: InputSpec):
        assert inputs.task == "causal_lm" and inputs.seq_len is not None
        self.path, self.inputs = Path(path), inputs
        if not self.path.is_file():
            what = "is a folder, not a token file" if self.path.is_dir() else "no such file"
            raise SpecError(f"data.path: {what}: {self.path}")
        n_bytes = self.path.stat().st_size
        if n_bytes % TOKEN_DTYPE.itemsize:
            raise SpecError(f"data.path: {self.path} is not a flat uint16 token file (odd size, {n_bytes} bytes)")
        self.n_tokens = n_bytes // TOKEN_DTYPE.itemsize
        window = inputs.seq_len + 1
        if self.n_tokens < window:
            raise SpecError(f"data.path: {self.path} holds {self.n_tokens} tokens; "
                            f"one window of seq_len + 1 = {window} tokens is needed")
        self.tokens = np.memmap(self.path, dtype=TOKEN_DTYPE, mode="r")
        self._checked_all = self._check_vocab(self.tokens[:_SCAN_LIMIT_TOKENS], offset=0)

    def _check_vocab(self, tokens: np.ndarray, offset: int) -> bool:
        vocab = self.inputs.vocab_size
        if vocab is None or vocab > np.iinfo(TOKEN_DTYPE).max:
            return True
        for start in range(0, len(tokens), _SCAN_CHUNK_TOKENS):
            chunk = tokens[start:start + _SCAN_CHUNK_TOKENS]
            if int(chunk.max()) >= vocab:
                pos = offset + start + int(np.argmax(chunk >= vocab))
                raise SpecError(f"data.path: {self.path} has token id {int(self.tokens[pos])} at position {pos}, "
                                f"not below the model's vocab_size ({vocab})")
        return len(tokens) == self.n_tokens

    def batch(self, batch_size: int, generator: torch.Generator) -> Batch:
        seq_len = self.inputs.seq_len
        starts = torch.randint(self.n_tokens - seq_len, (batch_size,), generator=generator).tolist()
        windows = np.stack([self.tokens[s:s + seq_len + 1] for s in starts]).astype(np.int64)
        if not self._checked_all:
            for s, w in zip(starts, windows):
                self._check_vocab(w, offset=s)
        window = torch.from_numpy(windows)
        if self.inputs.hf:
            return hf_batch(window[:, :-1].contiguous(), self.inputs, generator)
        return shifted(window)


class DatasetData:
    """Samples of a map-style Dataset drawn with replacement, collated by torch's default."""

    def __init__(self, dataset: Any, factory: str):
        self.dataset, self.factory = dataset, factory
        if not hasattr(type(dataset), "__len__"):
            raise SpecError(f"data.factory: {factory} must return a map-style Dataset (with __len__), "
                            f"got {type(dataset).__name__}")
        with user_code("data.factory", factory, "taking the dataset's len()"):
            self.n_samples = len(dataset)
        if self.n_samples == 0:
            raise SpecError(f"data.factory: {factory} returned an empty dataset")

    def batch(self, batch_size: int, generator: torch.Generator) -> Batch:
        indices = torch.randint(self.n_samples, (batch_size,), generator=generator).tolist()
        with user_code("data.factory", self.factory, "reading a sample"):
            samples = [self.dataset[i] for i in indices]
        try:
            batch = default_collate(samples)
        except RuntimeError as exc:
            # Usually samples of different lengths; padding is the dataset's job because the
            # tuner must see the largest batch the data can produce.
            raise SpecError(f"data.factory: samples of {self.factory} cannot be stacked into a batch "
                            f"(they must all have one size): {exc}") from None
        if isinstance(batch, torch.Tensor):
            return (batch,)
        return tuple(batch) if isinstance(batch, list) else batch

    def describe(self) -> str:
        """Shape of one sample, e.g. `x[3x32x32] y[]`, for logs and profiles."""
        return describe_batch(self.batch(1, torch.Generator().manual_seed(0)))


def shifted(window: torch.Tensor) -> Batch:
    """(inputs, next tokens) of token windows, each its own contiguous tensor: a model may
    call `targets.view(-1)` (nanoGPT does), which a slice of the window refuses."""
    return (window[:, :-1].contiguous(), window[:, 1:].contiguous())


class FunctionData:
    """Batches from a function, `batch_fn(batch_size, generator)` (the Python API's data):
    a tensor, a tuple or list, or a dict of CPU tensors with the batch in dim 0."""

    def __init__(self, batch_fn: BatchFn, key_path: str = "batch_fn"):
        self.batch_fn, self.key_path = batch_fn, key_path
        self.target = getattr(batch_fn, "__name__", type(batch_fn).__name__)

    def batch(self, batch_size: int, generator: torch.Generator) -> Batch:
        with user_code(self.key_path, self.target, "making a batch"):
            batch = self.batch_fn(batch_size, generator)
        if isinstance(batch, torch.Tensor):
            batch = (batch,)
        elif isinstance(batch, list):
            batch = tuple(batch)
        tensors = list(batch.values()) if isinstance(batch, dict) else list(batch) if isinstance(batch, tuple) else None
        if not tensors or not all(isinstance(t, torch.Tensor) and t.ndim >= 1 for t in tensors):
            raise SpecError(f"{self.key_path}: {self.target} must return a tensor, a tuple/list or a dict of tensors "
                            f"with the batch in dim 0, got {type(batch).__name__}")
        sizes = sorted({len(t) for t in tensors})
        if sizes != [batch_size]:
            raise SpecError(f"{self.key_path}: {self.target}({batch_size}, generator) returned tensors of "
                            f"{', '.join(map(str, sizes))} samples in dim 0, not {batch_size}")
        if any(t.device.type != "cpu" for t in tensors):
            raise SpecError(f"{self.key_path}: {self.target} must return CPU tensors (autofit moves them)")
        return batch

    def describe(self) -> str:
        return describe_batch(self.batch(1, torch.Generator().manual_seed(0)))


def hf_batch(input_ids: torch.Tensor, inputs: InputSpec, generator: torch.Generator) -> Batch:
    """Hugging Face keyword batch with labels for the task (the model computes its loss)."""
    if inputs.task in ("causal_lm", "seq2seq"):
        # HF shifts the labels inside the model, so labels are the inputs themselves; an
        # encoder-decoder learns to copy its input (its decoder reads the labels shifted).
        return {"input_ids": input_ids, "labels": input_ids.clone()}
    if inputs.task in ("classify", "token_classify"):
        shape = input_ids.shape if inputs.task == "token_classify" else input_ids.shape[:1]
        return {"input_ids": input_ids, "labels": torch.randint(inputs.n_classes, shape, generator=generator)}
    # Masked LM: the same number of labelled positions in every row, so the mean loss of
    # equal micro batches averages exactly to the mean loss of the whole batch.
    batch_size, seq_len = input_ids.shape
    n_labelled = max(1, round(MASKED_FRACTION * seq_len))
    positions = torch.rand((batch_size, seq_len), generator=generator).argsort(dim=1)[:, :n_labelled]
    labels = torch.full_like(input_ids, -100)
    labels.scatter_(1, positions, input_ids.gather(1, positions))
    return {"input_ids": input_ids, "labels": labels}


# ---- Python factories ----------------------------------------------------------------------


@contextlib.contextmanager
def user_code(key_path: str, target: str, doing: str):
    """Around a call into the user's own code: whatever it raises (sys.exit() included)
    becomes one `UserCodeError` naming the spec key, the function and the exception, so
    every command reports it the same way. Out-of-memory errors stay themselves: running
    out is a result for the search, not a bug in the model."""
    try:
        yield
    except AutofitError:
        raise
    except SystemExit as exc:
        raise UserCodeError(f"{key_path}: {target} called sys.exit({exc.code!r}) while {doing}") from exc
    except Exception as exc:
        if is_oom(exc):
            raise
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
            # The host's limit reached inside their code (a full disk, ulimit -v): not their bug.
            # (A MemoryError is out of memory, a result: is_oom above.)
            exhaustion = exhausted(exc, f"{key_path} {target} ({doing})")
            if exhaustion is not None:
                raise exhaustion from exc
        message = (str(exc).strip().splitlines() or [""])[0][:300]
        raise UserCodeError(f"{key_path}: {target} raised {type(exc).__name__}"
                            f"{': ' + message if message else ''} while {doing}") from exc


def load_callable(target: str, key_path: str, source_dir: Path | None) -> Callable:
    """Import "module.path:function", with the spec's folder first on sys.path."""
    module_name, _, attr = target.partition(":")
    if source_dir is not None and str(source_dir) not in sys.path:
        sys.path.insert(0, str(source_dir))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        where = f" (searched the spec's folder {source_dir} and sys.path)" if source_dir else ""
        raise SpecError(f"{key_path}: cannot import module {module_name!r}{where}: {exc}") from None
    except (Exception, SystemExit) as exc:  # the user's module raised while importing: still their input
        with user_code(key_path, target, f"importing {module_name!r}"):
            raise exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise SpecError(f"{key_path}: module {module_name!r} has no function {attr!r}")
    return fn


def check_kwargs(fn: Callable, kwargs: dict, key_path: str, target: str, *, positional: int = 0) -> None:
    """Reject arguments the function cannot take (after `positional` ones autofit passes)
    before anything is built."""
    try:
        inspect.signature(fn).bind(*[None] * positional, **kwargs)
    except TypeError as exc:
        raise SpecError(f"{key_path}: {target} cannot take these arguments: {exc}") from None
    except ValueError:  # no signature (a C function): let the call itself complain
        pass


def dataset_source(factory: str, args: dict, source_dir: Path | None) -> DatasetData:
    fn = load_callable(factory, "data.factory", source_dir)
    check_kwargs(fn, args, "data.args", factory)
    with user_code("data.factory", factory, "building the dataset"):
        dataset = fn(**args)
    return DatasetData(dataset, factory)


# ---- batch helpers -------------------------------------------------------------------------


def _tensors(batch: Batch) -> list[torch.Tensor]:
    return list(batch.values()) if isinstance(batch, dict) else list(batch)


def batch_size_of(batch: Batch) -> int:
    sizes = {len(t) for t in _tensors(batch)}
    assert len(sizes) == 1, f"tensors of one batch disagree on its size: {sorted(sizes)}"
    return sizes.pop()


def split_batch(batch: Batch, micro_batch_size: int) -> list[Batch]:
    """Equal micro batches along dim 0, in order (accumulating them reproduces the batch)."""
    n = batch_size_of(batch)
    assert micro_batch_size > 0 and n % micro_batch_size == 0, f"{n} samples, micro batch {micro_batch_size}"
    if isinstance(batch, dict):
        parts = {k: v.split(micro_batch_size) for k, v in batch.items()}
        return [{k: parts[k][i] for k in batch} for i in range(n // micro_batch_size)]
    return list(zip(*(t.split(micro_batch_size) for t in batch)))


def batch_to(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, dict):
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    return tuple(t.to(device, non_blocking=True) for t in batch)


def describe_batch(batch: Batch) -> str:
    def shape(t: torch.Tensor) -> str:
        return "x".join(map(str, t.shape[1:]))
    if isinstance(batch, dict):
        return " ".join(f"{k}[{shape(v)}]" for k, v in batch.items())
    names = ["x", "y"] if len(batch) == 2 else [f"t{i}" for i in range(len(batch))]
    return " ".join(f"{n}[{shape(t)}]" for n, t in zip(names, batch))
