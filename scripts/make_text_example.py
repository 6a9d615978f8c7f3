"""Regenerate the text example: a jsonl corpus of speeches of varying length and a small
byte-level BPE tokenizer trained on it, both under examples/data/.

    python scripts/make_text_example.py            # writes speeches.jsonl and tokenizer.json

The corpus is the first `--speeches` speeches of Hamlet in examples/data/shakespeare.txt
(one record per speech: {"speaker": ..., "text": ...}), so it ships with the repository and
needs no download. Speeches run from one word to a soliloquy: the long tail of lengths that
makes dynamic padding pay, and that sets peak memory. The tokenizer is trained with the
`tokenizers` library on those texts; both files are rewritten byte for byte by this script.
"""

import argparse
import json
import os
import re
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "data"
SPECIAL_TOKENS = ["<pad>", "<|endoftext|>"]  # ids 0 and 1
_SPEAKER = re.compile(r"^([A-Z][A-Za-z]*\.)$")  # "Hor.", "Ham.": a speaker line of the Globe text


def speeches(text: str, limit: int) -> list[dict]:
    """Blocks that start with a speaker line, in order, up to `limit`."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line.rstrip() for line in block.strip().splitlines()]
        if len(lines) < 2 or not _SPEAKER.match(lines[0]):
            continue
        out.append({"speaker": lines[0].rstrip("."), "text": "\n".join(lines[1:])})
        if len(out) == limit:
            break
    return out


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=EXAMPLES / "shakespeare.txt")
    parser.add_argument("--out-dir", type=Path, default=EXAMPLES)
    parser.add_argument("--speeches", type=int, default=400, help="records in the corpus")
    parser.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary, special tokens included")
    args = parser.parse_args(argv)
    records = speeches(args.source.read_text(encoding="utf-8"), args.speeches)
    if len(records) < args.speeches:
        print(f"only {len(records)} speeches in {args.source}", file=sys.stderr)
        return 1
    # The BPE trainer's merges are deterministic for one input order and vocabulary size.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    tokenizer = train_tokenizer([r["text"] for r in records], args.vocab_size)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    _write(args.out_dir / "speeches.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    _write(args.out_dir / "tokenizer.json", tokenizer.to_str(pretty=True) + "\n")
    lengths = sorted(len(tokenizer.encode(r["text"]).ids) for r in records)
    print(f"{len(records)} speeches, tokens per speech: min {lengths[0]}, median {lengths[len(lengths) // 2]}, "
          f"max {lengths[-1]}; vocabulary {tokenizer.get_vocab_size()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
