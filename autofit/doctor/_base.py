"""What every doctor check shares: its context, its result, the injected fault, the example model."""

import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from autofit.config.spec import parse_spec

FAULT_ENV = "AUTOFIT_DOCTOR_FAULT"
# examples/tiny-gpt.yaml's model and optimizer on synthetic tokens: the doctor checks the device,
# not learning, and must run from a plain `pip install` where examples/ is not shipped.
EXAMPLE_SPEC = {
    "schema": 1, "name": "doctor-tiny-gpt",
    "model": {"builtin": "gpt", "args": {"n_layer": 4, "n_head": 4, "n_embd": 64, "vocab_size": 256, "seq_len": 64}},
    "data": {"kind": "synthetic"},
    "optimizer": {"name": "adamw", "lr": 3.0e-3, "weight_decay": 0.1},
    "train": {"global_batch_size": 16, "steps": 200, "max_grad_norm": 1.0, "seed": 0},
}
MIB = 2**20


@dataclass(frozen=True, kw_only=True, slots=True)
class Context:
    device: torch.device  # where the check runs: cpu, or the CUDA index as the child numbers it
    fault: bool = False  # inject this check's fault (AUTOFIT_DOCTOR_FAULT)


def fault_mode(name: str, env: dict | None = None) -> str | None:
    """None, "fault", "crash" or "hang": what AUTOFIT_DOCTOR_FAULT asks of check `name`."""
    for item in (env if env is not None else os.environ).get(FAULT_ENV, "").split(","):
        check, _, mode = item.strip().partition(":")
        if check == name:
            return mode or "fault"
    return None


def ok(values: dict, summary: str) -> dict:
    return {"status": "ok", "reason": None, "values": values, "advice": None, "summary": summary}


def fail(values: dict, reason: str, advice: str, summary: str = "") -> dict:
    return {"status": "fail", "reason": reason, "values": values, "advice": advice, "summary": summary or reason}


def skip(reason: str, values: dict | None = None) -> dict:
    return {"status": "skip", "reason": reason, "values": values or {}, "advice": None, "summary": reason}


def example_spec():
    """The example GPT (EXAMPLE_SPEC): the model every training check runs (seconds on a CPU)."""

    return parse_spec(EXAMPLE_SPEC, source_dir=Path.cwd())


def run_check(name: str, function, ctx: Context) -> dict:
    """`function(ctx)` as a result dict with its name and `check_s` (the check's own time, the
    process's start-up left out); an exception is the check's failure, with its type and message."""
    started = time.perf_counter()
    try:
        out = function(ctx)
    except Exception as exc:  # noqa: BLE001 - any error is this check's result
        first = (str(exc).strip().splitlines() or [""])[0]
        out = fail({"traceback": traceback.format_exc()[-4000:]}, f"{type(exc).__name__}: {first}",
                   f"unexpected error in the check: its traceback is in the values of "
                   f"`autofit doctor --check {name} --json`; report it with them")
    return {"name": name, **out, "check_s": round(time.perf_counter() - started, 3)}
