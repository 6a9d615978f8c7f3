"""Byte-level tokenizer: text file -> flat little-endian uint16 token files (nanoGPT style).

Each byte of the UTF-8 input becomes one token id in 0..255, so the vocabulary is 256 and
no tokenizer package or download is needed. The last `--val-fraction` of the text goes to
the validation file; splitting at the end (not at random) keeps every window of the
validation set unseen during training.

    python scripts/tokenize_bytes.py examples/data/shakespeare.txt --out-dir examples/data

writes examples/data/train.bin and examples/data/val.bin. Read them back with
`np.memmap(path, dtype="<u2", mode="r")`; `decode` below turns ids back into text.
"""

import argparse
import os
import sys
from pathlib import Path

import numpy as np

VOCAB_SIZE = 256
TOKEN_DTYPE = np.dtype("<u2")  # little-endian uint16, what data.kind "tokens" reads


def encode(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).astype(TOKEN_DTYPE)


def decode(tokens: np.ndarray) -> str:
    assert int(tokens.max(initial=0)) < VOCAB_SIZE, "not a byte-level token file"
    return np.asarray(tokens, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")


def _write_atomic(path: Path, tokens: np.ndarray) -> None:
    # A half-written token file would still memmap fine and silently train on garbage.
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(tokens.astype(TOKEN_DTYPE, copy=False).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def tokenize(text_path: Path, out_dir: Path, val_fraction: float = 0.1) -> tuple[int, int]:
    """Write train.bin and val.bin; returns (train_tokens, val_tokens)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction: must be in [0, 1), got {val_fraction}")
    tokens = encode(text_path.read_bytes())
    n_val_tokens = int(len(tokens) * val_fraction)
    n_train_tokens = len(tokens) - n_val_tokens
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(out_dir / "train.bin", tokens[:n_train_tokens])
    _write_atomic(out_dir / "val.bin", tokens[n_train_tokens:])
    return n_train_tokens, n_val_tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("text", type=Path, help="input text file (any bytes; UTF-8 expected)")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: the text file's folder")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="tail share held out (default 0.1)")
    args = parser.parse_args(argv)
    if not args.text.is_file():
        print(f"{args.text}: no such file", file=sys.stderr)
        return 2
    out_dir = args.out_dir or args.text.parent
    n_train, n_val = tokenize(args.text, out_dir, args.val_fraction)
    print(f"{out_dir / 'train.bin'}: {n_train} tokens; {out_dir / 'val.bin'}: {n_val} tokens; vocab {VOCAB_SIZE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
