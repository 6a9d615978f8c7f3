"""Command line: argument parsing only. Each subcommand calls one plain function.

    autofit train examples/tiny-gpt.yaml --steps 60
    autofit tune examples/tiny-gpt.yaml --memory-budget 64MiB

Exit codes: 0 success, 2 bad input, 3 nothing fits / no usable result, 1 anything unexpected.
"""

import argparse
import json
import sys
from pathlib import Path

from loguru import logger

from autofit.errors import AutofitError, SpecError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # One line, exit 2: the same contract as every other bad input.
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parse_sets(pairs: list[str] | None) -> dict[str, str]:
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key or not value:
            raise SpecError(f"--set: expected KEY=VALUE, got {pair!r}")
        out[key.strip()] = value.strip()
    return out


def _write_json(path: str | None, payload: dict) -> None:
    if path is None:
        return
    from autofit._io import atomic_write_text

    atomic_write_text(Path(path), json.dumps(payload, indent=2, default=str) + "\n")


# --- subcommands: each parses nothing, calls one plain function -------------------------

def cmd_train(args) -> int:
    from autofit.commands import train_command

    metrics = train_command(args.spec, profile=args.profile, steps=args.steps, resume=args.resume,
                            device=args.device, checkpoint_dir=args.checkpoint_dir,
                            memory_budget=args.memory_budget, progress=not args.no_progress)
    _write_json(args.metrics_out, metrics)
    summary = {k: metrics[k] for k in ("steps", "first_loss", "final_loss", "samples_per_s", "peak_memory_bytes")}
    print(json.dumps(summary))
    return 0


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a model.yaml with the built-in AMP runner")
    p.add_argument("spec", help="model.yaml")
    p.add_argument("--profile", help="training profile (YAML) from `autofit tune`")
    p.add_argument("--steps", type=int, help="optimizer steps (default: train.steps)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--metrics-out", help="write the final metrics JSON here")
    p.add_argument("--device", help="cuda index or cpu (default: cuda:0 if present, else cpu)")
    p.add_argument("--checkpoint-dir", help="default: runs/<name>")
    p.add_argument("--memory-budget", help="cap memory (24GiB, 0.8, bytes); on CPU it is enforced")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)


_COMMANDS = [_add_train]


def build_parser() -> argparse.ArgumentParser:
    from autofit import __version__

    parser = _Parser(prog="autofit", description="Make PyTorch training fit the GPU and run as fast as it allows.")
    parser.add_argument("--version", action="version", version=f"autofit {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logger.remove()
    level = "DEBUG" if args.verbose else "WARNING" if args.quiet else "INFO"
    logger.add(sys.stderr, level=level, format="<green>{time:HH:mm:ss}</green> {level: <7} {message}")
    try:
        return args.func(args)
    except AutofitError as exc:
        print(f"autofit: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("autofit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
