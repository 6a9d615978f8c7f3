"""Command line: argument parsing only. Each subcommand calls one plain function.

    autofit train examples/tiny-gpt.yaml --steps 60
    autofit tune examples/tiny-gpt.yaml --memory-budget 64MiB

Exit codes: 0 success, 2 bad input, 3 nothing fits / no usable result, 1 anything unexpected.
"""

import argparse
import json
import math
import os
import signal
import sys
import threading
from pathlib import Path

from autofit import stopping
from autofit.errors import AutofitError, SpecError
from autofit.logs import configure as configure_logging


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

    if args.metrics_out is not None:  # checked before the run, not after it
        _check_output_file(args.metrics_out, "--metrics-out")
    metrics = train_command(args.spec, profile=args.profile, steps=args.steps, resume=args.resume,
                            overwrite=args.overwrite, device=args.device, checkpoint_dir=args.checkpoint_dir,
                            memory_budget=args.memory_budget, progress=not args.no_progress)
    if metrics.get("rank", 0) != 0:
        return 0  # under torchrun the metrics are rank 0's to report
    metrics = _finite(metrics)  # JSON has no NaN: a diverged loss is written as null
    _write_json(args.metrics_out, metrics)
    summary = {k: metrics[k] for k in ("steps", "first_loss", "final_loss", "samples_per_s", "compile_s",
                                       "peak_memory_bytes") if k in metrics}
    print(json.dumps(summary))
    if metrics["final_loss"] is None and metrics["steps"]:
        print(f"autofit: error: the loss diverged at step {metrics['steps'] - 1} (NaN/inf); "
              f"lower optimizer.lr or use a profile with a healthy precision", file=sys.stderr)
        return 3
    return 0


def _check_output_file(path: str, what: str) -> None:
    if Path(path).is_dir():
        raise SpecError(f"{what}: {path} is a folder; give a file name")


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a model.yaml with the built-in AMP runner")
    p.add_argument("spec", help="model.yaml")
    p.add_argument("--profile", help="a profile from `autofit tune`: a model name (the store's profile for this "
                                     "device), a file in the store, or a path")
    p.add_argument("--steps", type=int, help="optimizer steps (default: train.steps)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier run's checkpoint in the checkpoint folder (default: refuse)")
    p.add_argument("--metrics-out", help="write the final metrics JSON here")
    p.add_argument("--device", help="cuda index or cpu (default: cuda:0 if present, else cpu)")
    p.add_argument("--checkpoint-dir", help="default: runs/<name>")
    p.add_argument("--memory-budget", help="cap memory (24GiB, 0.8, bytes); on CPU it is enforced. With "
                                           "--profile NAME: the profile tuned under this budget if the store has "
                                           "one; the fastest frontier point whose peak fits it "
                                           "(default: the GPU's free memory now)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)


def cmd_tune(args) -> int:
    from autofit.tune import tune_command

    outcome = tune_command(args.spec, device=args.device, memory_budget=args.memory_budget, trials=args.trials,
                           timeout_s=args.timeout, storage=args.storage, out_dir=args.out,
                           state_dir=args.state_dir, report=not args.no_report, nproc=args.nproc)
    if args.json:
        print(json.dumps(outcome.summary(), default=str))
    else:
        print(outcome.profile_path)  # the last line of stdout, for scripts
    return 0


def _add_tune(sub) -> None:
    p = sub.add_parser("tune", help="search for the fastest config that fits and write a profile")
    p.add_argument("spec", help="model.yaml")
    p.add_argument("--device", help="cuda index or cpu (default: the first GPU, else the CPU)")
    p.add_argument("--memory-budget", help="emulate a smaller device: 24GiB, 0.8 (of total), bytes")
    p.add_argument("--nproc", type=int, default=1,
                   help="tune for N ranks (one per GPU, or N CPU processes): DDP or FSDP2, trials through "
                        "torchrun; budgets are per rank (default: 1)")
    p.add_argument("--trials", type=int, help="most configurations to consider (default: search.trials)")
    p.add_argument("--timeout", type=float, help="stop searching after this many seconds")
    p.add_argument("--storage", help="Optuna storage URL shared by several workers (default: SQLite in the state folder)")
    p.add_argument("--state-dir", help="state folder (default: $AUTOFIT_STATE_DIR or ~/.local/state/autofit)")
    p.add_argument("--out", help="profile store folder (default: $AUTOFIT_STORE or ./profiles)")
    p.add_argument("--no-report", action="store_true", help="skip the HTML report")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of the profile path")
    p.set_defaults(func=cmd_tune)


_COMMANDS = [_add_train, _add_tune]


# --- profiler: probe, trial, estimate ----------------------------------------------------

def cmd_probe(args) -> int:
    from autofit.device.probe import probe_devices
    from autofit.sizes import format_bytes

    devices = probe_devices()
    if args.json:
        print(json.dumps({"devices": [d.to_dict() for d in devices]}, indent=2))
        return 0
    for d in devices:
        where = "cpu" if d.index is None else f"cuda:{d.index}"
        cc = "" if d.compute_capability is None else f"  sm_{d.compute_capability[0]}{d.compute_capability[1]}"
        precisions = ",".join(k for k, ok in d.supports.items() if ok)
        print(f"{where:<7} {d.name}  {format_bytes(d.memory_total_bytes)} total, {format_bytes(d.memory_free_bytes)} "
              f"free, {format_bytes(d.memory_used_by_others_bytes)} used by others{cc}  [{precisions}]")
        print(f"        fingerprint {d.fingerprint}")
    return 0


def _add_probe(sub) -> None:
    p = sub.add_parser("probe", help="list the GPUs (through NVML, no CUDA context) and the CPU")
    p.add_argument("--json", action="store_true", help='print {"devices": [...]} as JSON')
    p.set_defaults(func=cmd_probe)


def cmd_trial(args) -> int:
    from autofit.sizes import format_bytes
    from autofit.trial import trial_command

    measurement, device = trial_command(args.spec, overrides=_parse_sets(args.set), device=args.device,
                                        memory_budget=args.memory_budget, timeout_s=args.timeout,
                                        warmup_steps=args.warmup_steps, measure_steps=args.measure_steps)
    m = measurement
    if args.json:
        print(json.dumps({**m.to_dict(), "device": device["name"]}, indent=2))
    else:
        line = f"{m.status}  {m.config.short()}  peak {format_bytes(m.peak_memory_bytes)}"
        if m.samples_per_s is not None:
            line += f"  {m.samples_per_s:.1f} samples/s  step {m.step_time_s * 1000:.1f} ms"
        if m.compile_s is not None:  # apart from the step time it never enters
            line += f"  compile {m.compile_s:.1f} s"
        print(line + (f"  ({m.reason})" if m.reason else ""))
    # Not ok is a usable answer printed in full, but no usable measurement: exit 3.
    return 0 if m.ok else 3


def _add_trial(sub) -> None:
    p = sub.add_parser("trial", help="measure one configuration in a child process")
    p.add_argument("spec", help="model.yaml")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="a TrainConfig field: precision, micro_batch_size, grad_accum_steps, checkpoint_blocks, "
                        "freeze_blocks (repeatable)")
    p.add_argument("--device", help="GPU index or cpu (default: the first GPU, else cpu)")
    p.add_argument("--memory-budget", help="emulate a smaller device: 24GiB, 0.8 (of total), bytes")
    p.add_argument("--timeout", type=float, help="seconds before the child is killed (default: search.trial_timeout_s)")
    p.add_argument("--warmup-steps", type=int, help="default: search.warmup_steps")
    p.add_argument("--measure-steps", type=int, help="timed optimizer steps (default: search.measure_steps)")
    p.add_argument("--json", action="store_true", help="print the measurement as JSON")
    p.set_defaults(func=cmd_trial)


def cmd_estimate(args) -> int:
    from autofit.estimate import estimate_command
    from autofit.sizes import format_bytes

    out = estimate_command(args.spec, overrides=_parse_sets(args.set), memory_budget=args.memory_budget,
                           device=args.device)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        per_rank = f", per rank of {out['world_size']}" if out.get("per_rank") else ""
        print(f"{out['parameters']:,} parameters ({out['trainable_parameters']:,} trainable), "
              f"{out['device_kind']} estimate{per_rank}")
        for part, n_bytes in out["bytes"].items():
            print(f"  {part:<12} {format_bytes(n_bytes):>12}")
        print(f"model state {format_bytes(out['model_state_bytes'])}: {out['model_state_bytes_per_param']:.2f} "
              f"bytes per parameter (weights, gradients, optimizer state)")
        if "max_micro_batch_size" in out:
            print(f"budget {format_bytes(out['budget_bytes'])}: fits={out['fits']}, "
                  f"largest micro batch that fits: {out['max_micro_batch_size']}")
    return 3 if out.get("max_micro_batch_size", 1) is None else 0


def _add_estimate(sub) -> None:
    p = sub.add_parser("estimate", help="predict peak memory without running (fake tensors, no GPU needed)")
    p.add_argument("spec", help="model.yaml")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="a TrainConfig field (repeatable)")
    p.add_argument("--memory-budget", help="also find the largest micro batch that fits: 24GiB, 0.8, bytes")
    p.add_argument("--device", help="GPU index or cpu: the kind of device predicted for, and the total a "
                                    "fractional budget refers to (default: the first GPU, else cpu)")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.set_defaults(func=cmd_estimate)


def cmd_doctor(args) -> int:
    from autofit.doctor import run_doctor
    from autofit.doctor.report import format_summary

    progress = None if args.json else lambda line: print(line, flush=True)
    report = run_doctor(device=args.device, checks=args.check, timeout_s=args.timeout, progress=progress)
    print(json.dumps(report, indent=2) if args.json else format_summary(report))
    return 0 if report["ok"] else 1


def _add_doctor(sub) -> None:
    from autofit.doctor import CHECK_NAMES

    p = sub.add_parser("doctor", help="check that autofit's device paths hold on this device (run it first on a "
                                      "new GPU): exit 0 when every check holds, 1 when one fails")
    p.add_argument("--device", help="GPU index or cpu (default: the first GPU, else the CPU)")
    p.add_argument("--check", action="append", metavar="NAME",
                   help=f"run only this check (repeatable): {', '.join(CHECK_NAMES)}")
    p.add_argument("--timeout", type=float, help="seconds before one check's process is killed (default: 300)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    p.set_defaults(func=cmd_doctor)


_COMMANDS += [_add_probe, _add_trial, _add_estimate, _add_doctor]


# --- profiles: the store -------------------------------------------------------------------

def cmd_profiles(args) -> int:
    from autofit.store import export_command, list_command, show_command

    if args.profiles_command == "list":
        text = list_command(store=args.store, spec_paths=tuple(args.spec or ()), as_json=args.json)
    elif args.profiles_command == "show":
        text = show_command(args.profile, store=args.store, device=args.device, memory_budget=args.memory_budget)
    else:
        text = export_command(args.profile, args.format, store=args.store, device=args.device,
                              n_blocks=args.n_blocks, memory_budget=args.memory_budget)
    sys.stdout.write(text)
    return 0


def _add_profiles(sub) -> None:
    p = sub.add_parser("profiles", help="list, show and export tuned profiles")
    actions = p.add_subparsers(dest="profiles_command", metavar="ACTION", parser_class=_Parser)
    actions.required = True
    store_help = "profile folder (default: $AUTOFIT_STORE, else ./profiles)"
    which = "a model name (picks the profile for this device), a file in the store, or a path"
    device_help = "match profiles for this GPU index or cpu (default: the first GPU, else the CPU)"
    ls = actions.add_parser("list", help="a table of the store's profiles, with staleness")
    ls.add_argument("--store", help=store_help)
    ls.add_argument("--spec", action="append", metavar="MODEL_YAML",
                    help="also check profiles of this model.yaml's name against its spec hash (repeatable)")
    ls.add_argument("--json", action="store_true", help="print the rows as JSON")
    show = actions.add_parser("show", help="print one profile")
    show.add_argument("profile", metavar="NAME_OR_PATH", help=which)
    show.add_argument("--store", help=store_help)
    show.add_argument("--device", help=device_help)
    show.add_argument("--memory-budget", help="the profile tuned under this emulated budget "
                                              "(as given to `autofit tune --memory-budget`)")
    export = actions.add_parser("export", help="one profile as yaml, json, HF TrainingArguments, Lightning or env")
    export.add_argument("profile", metavar="NAME_OR_PATH", help=which)
    export.add_argument("--format", default="yaml", choices=("yaml", "json", "hf", "lightning", "env"))
    export.add_argument("--store", help=store_help)
    export.add_argument("--device", help=device_help)
    export.add_argument("--memory-budget", help="the profile tuned under this emulated budget if the store has one, "
                                                "and the fastest frontier point whose peak fits it "
                                                "(24GiB, 0.8, bytes; default: the GPU's free memory now)")
    export.add_argument("--n-blocks", type=int, help="hf: the model's layer count, so partial checkpointing "
                                                     "can be exported as every_n_layers")
    p.set_defaults(func=cmd_profiles)


_COMMANDS += [_add_profiles]


# --- the service: serve, status ----------------------------------------------------------

def cmd_serve(args) -> int:
    from autofit.service.daemon import serve_command

    return serve_command(args.config, inventory_path=args.inventory)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="keep every model in a folder tuned for every kind of GPU here (a service)")
    p.add_argument("--config", help="service config (default: $AUTOFIT_CONFIG, else /etc/autofit/autofit.yaml)")
    p.add_argument("--inventory", metavar="FILE",
                   help="emulation: read GPU kinds from this YAML/JSON file ({\"gpus\": [{\"name\": ..., "
                        "\"memory_total_bytes\": ...}]}) instead of NVML; trials run on the CPU under each "
                        "card's memory")
    p.set_defaults(func=cmd_serve)


def cmd_status(args) -> int:
    from autofit.service.state import status_command

    sys.stdout.write(status_command(args.config, as_json=args.json))
    return 0


def _add_status(sub) -> None:
    p = sub.add_parser("status", help="what `autofit serve` sees, queues, runs and has tuned")
    p.add_argument("--config", help="service config (default: $AUTOFIT_CONFIG, else /etc/autofit/autofit.yaml)")
    p.add_argument("--json", action="store_true", help="print the service's state file as JSON")
    p.set_defaults(func=cmd_status)


_COMMANDS += [_add_serve, _add_status]


def build_parser() -> argparse.ArgumentParser:
    from autofit import __version__

    parser = _Parser(prog="autofit", description="Make PyTorch training fit the GPU and run as fast as it allows.")
    parser.add_argument("--version", action="version", version=f"autofit {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of an error (in your code or ours) after its one-line message")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for add in _COMMANDS:
        add(sub)
    return parser


def _install_stop_handlers(command: str) -> dict:
    """The previous handlers, to put back. `serve` has its own (SIGHUP reloads it)."""
    if command == "serve" or threading.current_thread() is not threading.main_thread():
        return {}
    return stopping.install()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = "DEBUG" if args.verbose else "WARNING" if args.quiet else "INFO"
    # The service's log is a journal: one line per event there.
    configure_logging(level, debug=args.debug, one_line=args.command == "serve")
    previous = _install_stop_handlers(args.command)
    try:
        return args.func(args)
    except AutofitError as exc:
        if args.debug:
            _print_traceback(exc)
        print(f"autofit: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        print(f"autofit: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:
        # The reader (`| head`) went away: not an error of ours. Point stdout at devnull so
        # the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _print_traceback(exc: AutofitError) -> None:
    """The user's own traceback where there is one (from a trial child, or the exception
    their code raised), else ours."""
    import traceback

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
    distributed = sys.modules.get("autofit.distributed")
    (distributed.exit_process if distributed is not None else sys.exit)(code)


if __name__ == "__main__":
    run()
