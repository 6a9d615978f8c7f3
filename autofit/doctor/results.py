"""A doctor check's result (ok, fail, skip), running a check so that an exception is its
failure, and the fault a test injects (AUTOFIT_DOCTOR_FAULT). No torch here: the doctor's own
process reads and writes results without it."""

import os
import time
import traceback

FAULT_ENV = "AUTOFIT_DOCTOR_FAULT"


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


def run_check(name: str, function, ctx) -> dict:
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
