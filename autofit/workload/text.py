"""Text data: a jsonl or txt corpus tokenized with a `tokenizers` tokenizer.json, cached on
disk, and served as dynamically padded, padded-to-max_length or packed causal-LM batches.

    data: {kind: text, path: data/speeches.jsonl, format: jsonl, field: text,
           tokenizer: data/tokenizer.json, max_length: 128, padding: dynamic, packing: false}

Tokenizing happens once per (corpus, tokenizer, format, field) content: the token ids go to
`$AUTOFIT_CACHE_DIR/text/<sha256>.npz`, and every trial child, validation run and `autofit
train` loads that file instead of tokenizing again.

The loss is the mean over samples of each sample's mean token loss (see `text_lm_loss`), so
neither the padding nor how a global batch is cut into micro batches changes the math:
halving the micro batch after an out-of-memory error, or sorting a batch by length, trains
the same model.
"""

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from loguru import logger
from torch import nn

from autofit.base.atomic import atomic_write
from autofit.base.errors import AutofitError, SpecError
from autofit.base.paths import default_cache_dir

IGNORE_INDEX = -100  # cross_entropy's default ignore_index: pad positions carry no target
PADDINGS = ("dynamic", "max_length")
FORMATS = ("jsonl", "txt")
_CACHE_VERSION = 1  # bump when the cached arrays change meaning
# Tokens that end a document, tried in order, to separate packed documents.
_EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "[SEP]", "<|end_of_text|>")
_PAD_TOKENS = ("<pad>", "[PAD]", "<|padding|>", "<|pad|>")


def cache_root() -> Path:
    """$AUTOFIT_CACHE_DIR, else $XDG_CACHE_HOME/autofit (~/.cache/autofit)."""
    return default_cache_dir()


@dataclass(frozen=True, kw_only=True)
class TokenizedCorpus:
    """Every document's token ids, concatenated: document i is ids[offsets[i]:offsets[i+1]]."""

    ids: np.ndarray  # int32
    offsets: np.ndarray  # int64, n_documents + 1
    vocab_size: int
    pad_id: int
    eos_id: int | None

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def highest_id(self) -> int:
        """The largest id a batch can hold (padding included): what the embedding must take.
        A tokenizer's vocabulary size does not bound it (ids may leave gaps)."""
        return max(int(self.ids.max()) if len(self.ids) else 0, self.pad_id, self.eos_id or 0)


def _read_documents(path: Path, fmt: str, field: str | None) -> list[str]:
    """The corpus's texts; every way a file can be unusable is a SpecError naming the line."""
    if not path.is_file():
        raise SpecError(f"data.path: no such file: {path}")
    texts = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise SpecError(f"data.path: {path} line {number} is not UTF-8 "
                                f"(byte 0x{raw[exc.start]:02x} at column {exc.start + 1})") from None
            if not line.strip():
                continue
            if fmt == "txt":
                texts.append(line.rstrip("\r\n"))
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SpecError(f"data.path: {path} line {number} is not JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise SpecError(f"data.path: {path} line {number} is a JSON {type(record).__name__}, "
                                f"expected an object with a {field!r} field")
            if field not in record:
                keys = ", ".join(map(str, record)) or "none"
                raise SpecError(f"data.field: {path} line {number} has no field {field!r} (its keys: {keys})")
            if not isinstance(record[field], str):
                raise SpecError(f"data.field: {path} line {number}: {field!r} is a "
                                f"{type(record[field]).__name__}, expected a string")
            texts.append(record[field])
    if not any(t.strip() for t in texts):
        raise SpecError(f"data.path: {path} is an empty corpus (no text in it)")
    return texts


def _load_tokenizer(path: Path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise SpecError("data.kind text needs the tokenizers package: pip install 'autofit[text]'") from None
    if not path.is_file():
        raise SpecError(f"data.tokenizer: no such file: {path}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a plain Exception for a bad file
        first = (str(exc).strip().splitlines() or [""])[0]
        raise SpecError(f"data.tokenizer: {path} is not a tokenizers tokenizer.json ({first})") from None


def _special_id(tokenizer, candidates: tuple[str, ...]) -> int | None:
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    return None


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def tokenize(path: Path, fmt: str, field: str | None, tokenizer_path: Path) -> TokenizedCorpus:
    """The corpus's token ids, from the cache when this corpus and tokenizer were seen before."""
    tokenizer = _load_tokenizer(tokenizer_path)  # checked first: a missing tokenizer is the likelier slip
    if not path.is_file():
        raise SpecError(f"data.path: no such file: {path}")
    key = hashlib.sha256(json.dumps([_CACHE_VERSION, _file_sha256(path), _file_sha256(tokenizer_path), fmt, field])
                         .encode()).hexdigest()
    cache_path = cache_root() / "text" / f"{key}.npz"
    if cache_path.is_file():
        try:
            return _read_cache(cache_path)
        except Exception as exc:  # a truncated or damaged zip (BadZipFile), odd arrays: rebuilt below
            logger.warning("text cache {} is unreadable ({}: {}); tokenizing again", cache_path,
                           type(exc).__name__, (str(exc).splitlines() or [""])[0][:200])
    texts = _read_documents(path, fmt, field)
    # encode_batch runs in the Rust thread pool; special tokens the tokenizer's post-processor
    # adds (BOS/EOS for some) are kept, as the model will see them at inference.
    encodings = tokenizer.encode_batch(texts)
    lengths = np.array([len(e.ids) for e in encodings], dtype=np.int64)
    corpus = TokenizedCorpus(
        ids=np.fromiter((i for e in encodings for i in e.ids), dtype=np.int32, count=int(lengths.sum())),
        offsets=np.concatenate([[0], np.cumsum(lengths)]),
        vocab_size=tokenizer.get_vocab_size(),
        # Right padding under causal attention: no real token attends to a pad and pads carry
        # no target, so the pad id only has to be a valid id.
        pad_id=_special_id(tokenizer, _PAD_TOKENS) or 0,
        eos_id=_special_id(tokenizer, _EOS_TOKENS),
    )
    logger.info("tokenized {} documents ({} tokens) of {}; cached at {}", len(texts), len(corpus.ids), path,
                cache_path)
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        np.savez(buffer, ids=corpus.ids, offsets=corpus.offsets, vocab_size=corpus.vocab_size,
                 pad_id=corpus.pad_id, eos_id=-1 if corpus.eos_id is None else corpus.eos_id)
        atomic_write(cache_path, lambda f: f.write(buffer.getvalue()))
    except (OSError, AutofitError) as exc:  # a read-only or full cache costs speed, not correctness
        logger.warning("cannot write the text cache {}: {}", cache_path, exc)
    return corpus


def _read_cache(path: Path) -> TokenizedCorpus:
    """A cached corpus, checked as a document is: arrays of the kinds and shapes written,
    offsets that cut `ids` into documents, ids inside the vocabulary. ValueError otherwise."""
    with np.load(path, allow_pickle=False) as z:
        ids, offsets = z["ids"], z["offsets"]
        vocab_size, pad_id, eos_id = (int(z[k]) for k in ("vocab_size", "pad_id", "eos_id"))
    if ids.ndim != 1 or ids.dtype != np.int32 or offsets.ndim != 1 or offsets.dtype != np.int64:
        raise ValueError(f"arrays of {ids.dtype}{list(ids.shape)} and {offsets.dtype}{list(offsets.shape)}")
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != len(ids) or (np.diff(offsets) < 0).any():
        raise ValueError("its offsets do not cut its ids into documents")
    if len(ids) and int(ids.min()) < 0 or pad_id < 0:
        raise ValueError("negative token ids")
    return TokenizedCorpus(ids=ids, offsets=offsets, vocab_size=vocab_size, pad_id=pad_id,
                           eos_id=None if eos_id < 0 else eos_id)


class TextData:
    """Causal-LM samples of a tokenized corpus and the batches of each optimizer step.

    Step `s` takes the next `global_batch_size` samples of a per-epoch shuffle seeded by
    (seed, epoch), so `steps_per_epoch` steps see every sample once (the remainder of an
    epoch is dropped), whatever the micro batch. Each micro batch is padded on its own:
    to its longest sample (`dynamic`, rounded up to `pad_to_multiple_of`) or to
    `max_length`. Packed samples are `max_length`-token windows of the documents joined by
    the end-of-text token, so they never need padding.
    """

    def __init__(self, corpus: TokenizedCorpus, *, max_length: int, padding: str, packing: bool,
                 pad_to_multiple_of: int, hf: bool, path: Path):
        assert padding in PADDINGS, padding
        self.max_length, self.padding, self.packing = max_length, padding, packing
        self.pad_to_multiple_of, self.hf, self.pad_id = pad_to_multiple_of, hf, corpus.pad_id
        lengths = corpus.lengths
        if packing:
            if corpus.eos_id is None:
                raise SpecError(f"data.packing: the tokenizer has no end-of-text token ({', '.join(_EOS_TOKENS)}) "
                                f"to separate packed documents")
            # Every document followed by the end-of-text token, then cut into full windows.
            ends = corpus.offsets[1:] + np.arange(1, len(lengths) + 1)
            stream = np.full(int(ends[-1]), corpus.eos_id, dtype=np.int32)
            keep = np.ones(len(stream), dtype=bool)
            keep[ends - 1] = False
            stream[keep] = corpus.ids
            n_windows = len(stream) // max_length
            self.tokens = stream
            self.starts = np.arange(n_windows, dtype=np.int64) * max_length
            self.lengths = np.full(n_windows, max_length, dtype=np.int64)
            what = f"{len(stream)} tokens, less than one packed window of max_length {max_length}"
        else:
            # A sample needs two tokens: one input and its next-token target.
            usable = lengths >= 2
            self.tokens = corpus.ids
            self.starts = corpus.offsets[:-1][usable]
            self.lengths = np.minimum(lengths[usable], max_length)
            what = "no document of two tokens or more"
        if len(self.lengths) == 0:
            raise SpecError(f"data.path: {path} has {what}: nothing to train on")
        self.truncated = int((lengths > max_length).sum()) if not packing else 0

    @property
    def n_samples(self) -> int:
        return len(self.lengths)

    @property
    def longest_tokens(self) -> int:
        return int(self.lengths.max())

    def steps_per_epoch(self, global_batch_size: int) -> int:
        return self.n_samples // global_batch_size

    def check_global_batch(self, global_batch_size: int) -> None:
        if self.steps_per_epoch(global_batch_size) == 0:
            raise SpecError(f"train.global_batch_size: {global_batch_size} is more than the corpus's "
                            f"{self.n_samples} samples")

    def describe(self) -> dict:
        """The length assumptions a profile measured on this data is valid for."""
        return {"kind": "text", "samples": self.n_samples, "longest_tokens": self.longest_tokens,
                "mean_tokens": round(float(self.lengths.mean()), 1), "max_length": self.max_length,
                "padding": "none (packed)" if self.packing else self.padding, "packing": self.packing,
                "pad_to_multiple_of": self.pad_to_multiple_of}

    # ---- batches -------------------------------------------------------------------------

    def padded_length(self, lengths: np.ndarray) -> int:
        if self.packing or self.padding == "max_length":
            return self.max_length
        # The multiple is of the model's input positions: the built-in GPT reads one token
        # fewer than a sample holds (the last is only a target).
        shift, multiple = (0 if self.hf else 1), self.pad_to_multiple_of
        positions = -(-(int(lengths.max()) - shift) // multiple) * multiple
        return min(self.max_length, positions + shift)

    def collate(self, indices: np.ndarray):
        """Samples `indices` as one right-padded micro batch."""
        lengths = self.lengths[indices]
        width = self.padded_length(lengths)
        rows = np.full((len(indices), width), self.pad_id, dtype=np.int64)
        real = np.arange(width)[None, :] < lengths[:, None]
        for row, start, length in zip(rows, self.starts[indices], lengths):
            row[:length] = self.tokens[start:start + length]
        ids = torch.from_numpy(rows)
        labels = torch.from_numpy(np.where(real, rows, IGNORE_INDEX))
        if self.hf:  # HF causal LMs shift inside; the mask keeps padding out of attention
            return {"input_ids": ids, "attention_mask": torch.from_numpy(real.astype(np.int64)), "labels": labels}
        return (ids[:, :-1], labels[:, 1:].contiguous())

    def step_indices(self, step: int, seed: int, global_batch_size: int) -> np.ndarray:
        epoch, k = divmod(step, self.steps_per_epoch(global_batch_size))
        order = np.random.default_rng([seed, epoch]).permutation(self.n_samples)
        return order[k * global_batch_size:(k + 1) * global_batch_size]

    def step_batches(self, step: int, seed: int, global_batch_size: int, micro_batch_size: int,
                     length_bucketing: bool = False) -> list:
        """The micro batches of optimizer step `step`. Bucketing sorts the step's samples by
        length first, so each micro batch holds similar lengths and pads less; the step
        still trains on the same samples, so the update is the same."""
        indices = self.step_indices(step, seed, global_batch_size)
        if length_bucketing:
            indices = indices[np.argsort(-self.lengths[indices], kind="stable")]
        return [self.collate(indices[i:i + micro_batch_size]) for i in range(0, len(indices), micro_batch_size)]

    def worst_case_batches(self, global_batch_size: int, micro_batch_size: int) -> list:
        """The corpus's longest samples, longest first: the first micro batch is the largest
        input any real step can give at this micro batch, so the peak measured on this step
        bounds every step's. The samples do not depend on the micro batch, so every config
        sees the same step (and the same loss)."""
        longest = np.argsort(-self.lengths, kind="stable")[:global_batch_size]
        return [self.collate(longest[i:i + micro_batch_size]) for i in range(0, len(longest), micro_batch_size)]

    def batch(self, batch_size: int, generator: torch.Generator):
        """Random samples padded as the longest would be: the `DataSource` contract (every
        batch of the largest input size), for callers that know nothing of lengths."""
        indices = torch.randint(self.n_samples, (batch_size,), generator=generator).numpy()
        rows = self.collate(indices)
        width = self.padded_length(self.lengths)
        if isinstance(rows, dict):
            return {k: F.pad(v, (0, width - v.shape[1]), value=self.pad_id if k == "input_ids" else
                             (0 if k == "attention_mask" else IGNORE_INDEX)) for k, v in rows.items()}
        x, y = rows
        return (F.pad(x, (0, width - 1 - x.shape[1]), value=self.pad_id),
                F.pad(y, (0, width - 1 - y.shape[1]), value=IGNORE_INDEX))


def count_tokens(micro_batches: list) -> int:
    """Tokens trained on (positions with a target): the non-pad tokens of the step."""
    total = 0
    for batch in micro_batches:
        labels = batch["labels"][:, 1:] if isinstance(batch, dict) else batch[1]
        total += int((labels != IGNORE_INDEX).sum())
    return total


def text_lm_loss(model: nn.Module, batch) -> torch.Tensor:
    """Mean over samples of each sample's mean next-token loss.

    Per sample, not per token: a micro batch's mean is then an unweighted mean of its
    samples, so the mean over equal micro batches is the global batch's, whatever the
    padding, the micro batch size or the order of samples (a token mean would weight each
    micro batch by its own token count).
    """
    if isinstance(batch, dict):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        logits, targets = out.logits[:, :-1], batch["labels"][:, 1:]
    else:
        x, targets = batch
        logits = model(x)
    # fp32 softmax, as the built-in LM loss: bf16 over a vocabulary is off by ~1 %.
    token_loss = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(),
                                 ignore_index=IGNORE_INDEX, reduction="none").view(targets.shape)
    counts = (targets != IGNORE_INDEX).sum(dim=1).clamp(min=1)
    return (token_loss.sum(dim=1) / counts).mean()
