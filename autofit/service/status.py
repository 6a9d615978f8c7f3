"""`autofit status`: what `autofit serve` sees, queues, runs and has tuned, read from its state
file (the service need not be running).

    autofit status --config /etc/autofit/autofit.yaml [--json]
"""

import json
import os
import sys
import time
from pathlib import Path

from autofit.base.errors import AutofitError
from autofit.base.sizes import format_bytes
from autofit.service.config import load_service_config
from autofit.service.metrics import age_s
from autofit.service.state import read_state


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user (the service's): it exists
        return True
    return True


def status_command(config_path: str | Path | None, *, as_json: bool = False) -> str:
    """`autofit status`: the state file of the service that uses this config."""
    config = load_service_config(config_path)
    state = read_state(config.state_dir)
    if state is None:
        raise AutofitError(f"no service state in {config.state_dir}: `autofit serve --config {config.path}` "
                           f"has not run with this config yet")
    service = state.setdefault("service", {})
    # "running" is what the service last wrote; a kill -9 leaves it true with a dead pid.
    service["alive"] = bool(service.get("running")) and _alive(service.get("pid"))
    if as_json:
        return json.dumps(state, indent=2) + "\n"
    return render_status(state)


def render_status(state: dict) -> str:
    service = state.get("service", {})
    if service.get("alive"):
        health = "healthy" if service.get("healthy") else "UNHEALTHY (no watchdog pings)"
        head = f"autofit serve: running, pid {service.get('pid')}, {health}"
    else:
        head = f"autofit serve: not running (last pid {service.get('pid')})"
    lines = [f"{head}; state updated {service.get('updated')}", f"  {service.get('status', '')}",
             _metrics_text(service.get("metrics"))]
    inventory = state.get("inventory", {})
    lines.append(f"GPUs ({inventory.get('source')}):")
    if inventory.get("error"):
        lines.append(f"  inventory error: {inventory['error']}")
    for gpu in inventory.get("gpus", []):
        lines.append(f"  {gpu['slot']:<6} {gpu['name']:<28} {format_bytes(gpu['memory_total_bytes']):>10}  "
                     f"{gpu['state']}")
    if not inventory.get("gpus"):
        lines.append("  none")
    queue = state.get("queue", [])
    lines.append("queue: " + (", ".join(f"{q['model']} on {q['device']}" for q in queue) or "empty"))
    for tune in state.get("running", []):
        stopping = f" (stopping: {tune['stopping']})" if tune.get("stopping") else ""
        lines.append(f"running: {tune['gpu']}: {tune['model']}, trial {tune['trial']}/{tune['trials']}, "
                     f"since {tune['started']}{stopping}")
    lines.append("profiles per (model, GPU kind):")
    rows = [("MODEL", "GPU KIND", "STATUS", "TUNES", "AGE", "PROFILE")]
    now_unix_s = time.time()
    for pair in state.get("pairs", []):
        rows.append((pair["model"], pair["device"], _status_text(pair), str(pair["tunes"]),
                     _age_text(age_s((pair.get("profile") or {}).get("created"), now_unix_s)), _profile_text(pair)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    errors_by_pair = [(p, _last_error(p)) for p in state.get("pairs", []) if _last_error(p)]
    if errors_by_pair:
        lines.append("last errors:")
        lines += [f"  {p['model']} on {p['device']}: {error}" for p, error in errors_by_pair]
    errors = state.get("spec_errors", [])
    if errors:
        lines.append("spec errors (skipped):")
        lines += [f"  {e['error']}" for e in errors]
    return "\n".join(lines) + "\n"


def _metrics_text(metrics: dict | None) -> str:
    """Where an operator's Prometheus scrapes this service."""
    metrics = metrics or {}
    if metrics.get("url"):
        return f"metrics: {metrics['url']} (health: {metrics['healthz']})"
    if metrics.get("error"):
        return f"metrics: not served: {metrics['error']}"
    return "metrics: off" if metrics.get("address") == "off" else "metrics: not served"


def _age_text(age_s: float | None) -> str:
    """`-`, `45 s`, `12 min`, `5.2 h`, `3.1 d`: how old a profile is, at a glance."""
    if age_s is None:
        return "-"
    for unit_s, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if age_s >= unit_s:
            return f"{age_s / unit_s:.1f} {unit}" if unit != "min" else f"{age_s / unit_s:.0f} {unit}"
    return f"{max(age_s, 0):.0f} s"


def _last_error(pair: dict) -> str | None:
    """The pair's last failed tune, on one line (its error can be a whole traceback's message)."""
    failure = pair.get("failure") or {}
    if not failure.get("error"):
        return None
    line = f"{failure.get('kind', 'error')}: {' '.join(str(failure['error']).split())}"
    return line if len(line) <= 160 else line[:157] + "..."


def _status_text(pair: dict) -> str:
    """`retrying 2/5`, `failed (final)`, `nothing fits (final)`, `queued (stale)`: what happens next, at a glance."""
    status, failure = pair["status"], pair.get("failure") or {}
    if status == "queued" and (pair.get("profile") or {}).get("stale"):
        return "queued (stale)"
    if status == "retrying" and failure.get("kind") != "interrupted":
        return f"retrying {failure.get('attempts', 1)}/{failure.get('max_attempts', '?')}"
    if status in ("failed", "nothing fits"):
        return f"{status} (final)"
    return status


def _profile_text(pair: dict) -> str:
    profile = pair.get("profile")
    detail = f" [{pair['detail']}]" if pair.get("detail") else ""
    if not profile:
        return "-" + detail
    stale = f", stale: {'; '.join(profile['stale'])}" if profile.get("stale") else ""
    workers = profile.get("workers") or {}
    by = (f", trials by {', '.join(f'{w} {n}' for w, n in workers.items())}; validated by {profile.get('validated_by')}"
          if len(workers) > 1 else "")  # a study shared by several hosts
    return (f"{Path(profile['path']).name} ({profile['config']}, {profile['samples_per_s']:.1f} samples/s{by}{stale})"
            f"{detail}")


def main(args) -> int:
    sys.stdout.write(status_command(args.config, as_json=args.json))
    return 0
