"""Command line: parsing and dispatch only. Each subcommand runs one module's `main(args)`.

    autofit train examples/tiny-gpt.yaml --steps 60
    autofit tune examples/tiny-gpt.yaml --memory-budget 16MiB

Exit codes: 0 success, 2 bad input, 3 nothing fits / no usable result, 1 anything unexpected,
128+N stopped by signal N. Nothing here imports torch or optuna: `autofit --help` and an
argument error answer at once; a command's module is imported when it runs.
"""

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
import traceback

from autofit.base import stopping
from autofit.base.errors import AutofitError, EXIT_INCOMPLETE
from autofit.base.resources import exhausted
from autofit.base.logs import configure as configure_logging
from autofit.base.output import reserved_stdout
from autofit.base.version import VERSION
from autofit.doctor.names import CHECK_NAMES

# The commands that run a user's code (a model that prints its size, a library's banner):
# their stdout is their answer alone, everything else goes to stderr (base/output.py).
ANSWERING = {"train", "tune", "trial", "estimate"}

# Each command's module, imported only when that command runs (most import torch: seconds).
HANDLERS = {
    "train": "autofit.commands.train",
    "tune": "autofit.commands.tune",
    "probe": "autofit.commands.probe",
    "trial": "autofit.commands.trial",
    "estimate": "autofit.commands.estimate",
    "doctor": "autofit.doctor.run",
    "profiles": "autofit.commands.profiles",
    "serve": "autofit.service.daemon",
    "status": "autofit.service.status",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # One line, exit 2: the same contract as every other bad input.
        self.exit(2, f"{self.prog}: error: {message}\n")


# --- the subcommands' arguments ----------------------------------------------------------

def _common_options() -> dict[str, argparse.ArgumentParser]:
    """The options several commands share, each declared once (argparse parents)."""
    device = argparse.ArgumentParser(add_help=False)
    device.add_argument("--device", help="a GPU index or cpu (default: the first GPU, else the CPU)")
    budget = argparse.ArgumentParser(add_help=False)
    budget.add_argument("--memory-budget",
                        help="24GiB, 0.8 (of the device's memory) or bytes: a smaller card emulated on this one "
                             "(tune, trial; on the CPU enforced), the budget an estimate or a run is held to, and "
                             "for a profile the one tuned under it and its fastest point that fits "
                             "(default: the whole device)")
    return {"device": device, "budget": budget}


COMMON = _common_options()
BOTH = [COMMON["device"], COMMON["budget"]]

def _add_train(sub) -> None:
    p = sub.add_parser("train", parents=BOTH, help="train a model.yaml with the built-in AMP runner")
    p.add_argument("spec", help="model.yaml")
    p.add_argument("--profile", help="a profile from `autofit tune`: a model name (the store's profile for this "
                                     "device), a file in the store, or a path")
    p.add_argument("--steps", type=int, help="optimizer steps (default: train.steps)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier run's checkpoint in the checkpoint folder (default: refuse)")
    p.add_argument("--metrics-out", help="write the final metrics JSON here")
    p.add_argument("--checkpoint-dir", help="default: runs/<name>")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_tune(sub) -> None:
    p = sub.add_parser("tune", parents=BOTH, help="search for the fastest config that fits and write a profile")
    p.add_argument("spec", help="model.yaml")
    p.add_argument("--nproc", type=int, default=1,
                   help="tune for N ranks (one per GPU, or N CPU processes): DDP or FSDP2, trials through "
                        "torchrun; budgets are per rank (default: 1)")
    p.add_argument("--trials", type=int, help="most configurations to consider (default: search.trials)")
    p.add_argument("--time-budget", metavar="DURATION",
                   help="the whole tune's wall time: 90s, 5min, 1h or seconds (default: search.time_budget, else 3%% of "
                        "train.steps at the one-liner's speed within 1-20min, else 5min); "
                        "at its end (or on Ctrl-C / SIGTERM) the best config measured so far is the profile, "
                        "validated if there was time; exit 5 when it was not")
    p.add_argument("--host-memory-budget", metavar="SIZE",
                   help="8GiB, 0.5 (of the host's available memory) or bytes: what offloaded configs may pin in host "
                        "memory, a smaller host emulated (default: the available memory, less a reserve)")
    p.add_argument("--timeout", type=float, help="stop the search loop (not validation) after this many seconds; "
                                                 "--time-budget bounds the whole tune")
    p.add_argument("--storage", help="Optuna storage URL shared by several workers (default: SQLite in the state folder)")
    p.add_argument("--state-dir", help="state folder (default: $AUTOFIT_STATE_DIR or ~/.local/state/autofit)")
    p.add_argument("--out", help="profile store folder (default: $AUTOFIT_STORE or ./profiles)")
    p.add_argument("--no-report", action="store_true", help="skip the HTML report")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of the profile path")


def _add_probe(sub) -> None:
    p = sub.add_parser("probe", help="list the GPUs (through NVML, no CUDA context) and the CPU")
    p.add_argument("--json", action="store_true", help='print {"devices": [...]} as JSON')


def _add_trial(sub) -> None:
    p = sub.add_parser("trial", parents=BOTH, help="measure one configuration in a child process")
    p.add_argument("spec", help="model.yaml")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="a TrainConfig field: precision, micro_batch_size, grad_accum_steps, checkpoint_blocks, "
                        "freeze_blocks (repeatable)")
    p.add_argument("--timeout", type=float, help="seconds before the child is killed (default: search.trial_timeout_s)")
    p.add_argument("--warmup-steps", type=int, help="default: search.warmup_steps")
    p.add_argument("--measure-steps", type=int, help="timed optimizer steps (default: search.measure_steps)")
    p.add_argument("--json", action="store_true", help="print the measurement as JSON")


def _add_estimate(sub) -> None:
    p = sub.add_parser("estimate", parents=BOTH,
                       help="predict peak memory without running (fake tensors, no GPU needed)")
    p.add_argument("spec", help="model.yaml")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="a TrainConfig field (repeatable)")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")


def _add_doctor(sub) -> None:
    p = sub.add_parser("doctor", parents=[COMMON["device"]], help="check that autofit's device paths hold on this device (run it first on a "
                                      "new GPU): exit 0 when every check holds, 1 when one fails")
    p.add_argument("--check", action="append", metavar="NAME",
                   help=f"run only this check (repeatable): {', '.join(CHECK_NAMES)}")
    p.add_argument("--timeout", type=float, help="seconds before one check's process is killed (default: 300)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")


def _add_profiles(sub) -> None:
    p = sub.add_parser("profiles", help="list, show and export tuned profiles")
    actions = p.add_subparsers(dest="profiles_command", metavar="ACTION", parser_class=_Parser)
    actions.required = True
    store_help = "profile folder (default: $AUTOFIT_STORE, else ./profiles)"
    which = "a model name (picks the profile for this device), a file in the store, or a path"
    ls = actions.add_parser("list", help="a table of the store's profiles, with staleness")
    ls.add_argument("--store", help=store_help)
    ls.add_argument("--spec", action="append", metavar="MODEL_YAML",
                    help="also check profiles of this model.yaml's name against its spec hash (repeatable)")
    ls.add_argument("--json", action="store_true", help="print the rows as JSON")
    show = actions.add_parser("show", parents=BOTH, help="print one profile")
    show.add_argument("profile", metavar="NAME_OR_PATH", help=which)
    show.add_argument("--store", help=store_help)
    export = actions.add_parser("export", parents=BOTH, help="one profile as yaml, json, HF TrainingArguments, Lightning or env")
    export.add_argument("profile", metavar="NAME_OR_PATH", help=which)
    export.add_argument("--format", default="yaml", choices=("yaml", "json", "hf", "lightning", "env"))
    export.add_argument("--store", help=store_help)
    export.add_argument("--n-blocks", type=int, help="hf: the model's layer count, so partial checkpointing "
                                                     "can be exported as every_n_layers")


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="keep every model in a folder tuned for every kind of GPU here (a service)")
    p.add_argument("--config", help="service config (default: $AUTOFIT_CONFIG, else /etc/autofit/autofit.yaml)")
    p.add_argument("--inventory", metavar="FILE",
                   help="emulation: read GPU kinds from this YAML/JSON file ({\"gpus\": [{\"name\": ..., "
                        "\"memory_total_bytes\": ...}]}) instead of NVML; trials run on the CPU under each "
                        "card's memory")
    p.add_argument("--metrics-address", metavar="HOST:PORT",
                   help="serve Prometheus metrics (/metrics) and the health check (/healthz) here, or `off` "
                        "(default: the config's metrics_address, else 127.0.0.1:9851)")


def _add_status(sub) -> None:
    p = sub.add_parser("status", help="what `autofit serve` sees, queues, runs and has tuned")
    p.add_argument("--config", help="service config (default: $AUTOFIT_CONFIG, else /etc/autofit/autofit.yaml)")
    p.add_argument("--json", action="store_true", help="print the service's state file as JSON")


_COMMANDS = [_add_train, _add_tune, _add_probe, _add_trial, _add_estimate, _add_doctor, _add_profiles, _add_serve,
             _add_status]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autofit", description="Make PyTorch training fit the GPU and run as fast as it allows.")
    parser.add_argument("--version", action="version", version=f"autofit {VERSION}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of an error (in your code or ours) after its one-line message")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for add in _COMMANDS:
        add(sub)
    return parser


def _install_handlers(command: str) -> dict:
    """The previous handlers, to put back. `serve` has its own stop handlers (SIGHUP reloads it)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    # A file-size limit (ulimit -f) kills the process with SIGXFSZ by default, mid-write and
    # with no word. Ignored, the write fails with EFBIG and is one line (base/atomic.py);
    # trial children inherit the disposition across exec.
    previous = {signal.SIGXFSZ: signal.signal(signal.SIGXFSZ, signal.SIG_IGN)}
    if command != "serve":
        previous |= stopping.install()
    return previous


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = "DEBUG" if args.verbose else "WARNING" if args.quiet else "INFO"
    # The service's log is a journal: one line per event there.
    configure_logging(level, debug=args.debug, one_line=args.command == "serve")
    previous = _install_handlers(args.command)
    try:
        code = _dispatch(args)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if previous and stopping.requested.is_set():
        # However the command ended once a stop was asked for (a trial cut short, a tune
        # interrupted), the stop is what happened; a tune that wrote its best config so far
        # says that with its own code.
        signum = stopping.signum or signal.SIGINT
        print(f"autofit: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return code if code == EXIT_INCOMPLETE else 128 + signum
    return code


def _dispatch(args) -> int:
    """The command's exit code; an `AutofitError` is one line on stderr."""
    try:
        with reserved_stdout() if args.command in ANSWERING else contextlib.nullcontext():
            return importlib.import_module(HANDLERS[args.command]).main(args)
    except AutofitError as exc:
        if args.debug:
            _print_traceback(exc)
        if not stopping.requested.is_set():
            print(f"autofit: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except (KeyboardInterrupt, InterruptedError) as exc:
        # Ctrl-C where no handler is ours (a thread other than the main one), or a command
        # that stopped at a safe point after the stop flag was set.
        signum = getattr(exc, "signum", None) or stopping.signum or signal.SIGINT
        if not stopping.requested.is_set():
            print(f"autofit: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:
        # The reader (`| head`) went away: not an error of ours. Point stdout at devnull so
        # the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (OSError, ImportError, RuntimeError, MemoryError) as exc:
        # The host at its limits in this process (no address space for torch's libraries, no
        # thread): one line naming the limit, exit 1. Anything else keeps its traceback.
        error = exhausted(exc, f"autofit {args.command}")
        if error is None:
            raise
        print(f"autofit: error: {error}", file=sys.stderr)
        return error.exit_code


def _print_traceback(exc: AutofitError) -> None:
    """The user's own traceback where there is one (from a trial child, or the exception
    their code raised), else ours."""
    child = getattr(exc, "traceback_text", None)
    if child:
        sys.stderr.write(child.rstrip("\n") + "\n")
    else:
        traceback.print_exception(exc.__cause__ or exc, file=sys.stderr)


def run() -> None:
    """The `autofit` command and `python -m autofit`: main, then the end of the process. A rank
    of a torchrun job ends through the distributed module (its exit skips a finalization
    that gloo's threads can abort); a command that never imported it started no group."""
    code = main()
    distributed = sys.modules.get("autofit.train.distributed")
    (distributed.exit_process if distributed is not None else sys.exit)(code)


if __name__ == "__main__":
    run()
