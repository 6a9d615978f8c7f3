"""autofit.yaml: the configuration of `autofit serve` (example: systemd/autofit.yaml).

    models_dir: models            # *.yaml model specs; every one is kept tuned
    store_dir: /var/lib/autofit/profiles
    state_dir: /var/lib/autofit   # lock, state.json, the default SQLite study storage
    poll_interval_s: 30
    idle: {max_utilization: 5, min_idle_s: 120}
    multi_gpu: true               # also tune over all GPUs of a kind (DDP/FSDP2) where there are several
    worker_name: node-a           # how its trials are labelled in studies shared on PostgreSQL (default: host name)
    metrics_address: 127.0.0.1:9851   # /metrics and /healthz over HTTP; `off`: none

Relative paths are relative to the config file, so a config and its models folder can be
moved together. Errors name the key, as model.yaml errors do, and exit with code 2.
"""

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from autofit.base.documents import read_yaml
from autofit.base.errors import SpecError
from autofit.base.paths import sqlite_storage
from autofit.base.redact import redact_text, redact_url
from autofit.config.reader import Reader
from autofit.config.spec import MAX_TIMEOUT_S, MAX_TRIALS
from autofit.service.endpoint import DEFAULT_METRICS_ADDRESS, parse_address

DEFAULT_CONFIG = Path("/etc/autofit/autofit.yaml")
CONFIG_ENV = "AUTOFIT_CONFIG"


@dataclass(frozen=True, kw_only=True, slots=True)
class IdleRule:
    """When a GPU counts as free for tuning: no other compute process on it, and its
    utilisation below `max_utilization` percent for `min_idle_s` seconds in a row."""

    max_utilization: float = 5.0  # percent, as NVML reports it (0-100)
    min_idle_s: float = 120.0


@dataclass(frozen=True, kw_only=True, slots=True)
class ServiceConfig:
    path: Path  # the config file itself, absolute
    models_dir: Path  # *.yaml model specs
    store_dir: Path  # the profile store the service writes into
    state_dir: Path  # lock file, state.json, default study storage
    storage: str | None = None  # Optuna storage URL; None: SQLite in state_dir
    poll_interval_s: float = 30.0
    memory_headroom: float | None = None  # None: each spec's search.memory_headroom
    idle: IdleRule = IdleRule()
    trials: int | None = None  # per tune; None: each spec's search.trials
    # A host with N > 1 GPUs of one kind also gets each model's N-rank profile (DDP or
    # FSDP2 through torchrun), tuned when all N are idle.
    multi_gpu: bool = True
    # Labels this service's trials and profiles in studies shared with other hosts.
    worker_name: str = ""  # "": the host name
    # Where /metrics and /healthz are served, as written ("off": nowhere); None: not set, the
    # loopback default, which the service may do without should its port be taken.
    metrics_address: str | None = None

    @property
    def metrics_listen(self) -> tuple[str, int] | None:
        """(host, port) to serve metrics on, or None when off."""
        return parse_address(self.metrics_address or DEFAULT_METRICS_ADDRESS, "metrics_address")

    @property
    def worker(self) -> str:
        return self.worker_name or socket.gethostname()

    @property
    def storage_url(self) -> str:
        return self.storage or sqlite_storage(self.state_dir)

    def to_dict(self) -> dict:
        return {"path": str(self.path), "models_dir": str(self.models_dir), "store_dir": str(self.store_dir),
                "state_dir": str(self.state_dir), "storage": redact_url(self.storage_url),
                "poll_interval_s": self.poll_interval_s, "memory_headroom": self.memory_headroom,
                "idle": {"max_utilization": self.idle.max_utilization, "min_idle_s": self.idle.min_idle_s},
                "trials": self.trials, "multi_gpu": self.multi_gpu, "worker_name": self.worker,
                "metrics_address": self.metrics_address or DEFAULT_METRICS_ADDRESS}


def resolve_config_path(path: str | Path | None) -> Path:
    """--config, else $AUTOFIT_CONFIG, else /etc/autofit/autofit.yaml."""
    return Path(path or os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG)


def load_service_config(path: str | Path | None) -> ServiceConfig:
    """Read and validate the service config; a SpecError names the file and the key."""
    path = resolve_config_path(path)
    if not path.is_file():
        raise SpecError(f"{path}: no such config file" if not path.exists() else f"{path}: not a file")
    raw = read_yaml(path, error=SpecError)  # bounded: aliases, nesting, size
    try:
        return _parse(raw, path.resolve())
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from None


def _parse(raw, path: Path) -> ServiceConfig:
    top = Reader(raw, "")
    base = path.parent

    def folder(key: str, default: str) -> Path:
        text = top.get(key, str, default=default)
        if not text.strip():
            raise SpecError(f"{key}: must be a folder path, got an empty string")
        return (base / Path(text).expanduser()).resolve()

    models_dir = folder("models_dir", "models")
    store_dir = folder("store_dir", "profiles")
    state_dir = folder("state_dir", "state")
    storage = top.get("storage", str, default=None, nullable=True)
    if storage is not None and "://" not in storage:
        raise SpecError(f"storage: an Optuna storage URL such as sqlite:///path.db or "
                        f"postgresql://user@host/db, got {redact_text(repr(storage))}")
    poll_interval_s = top.number("poll_interval_s", default=30.0, minimum=0.0, exclusive=True, maximum=MAX_TIMEOUT_S)
    headroom = top.get("memory_headroom", float, default=None, nullable=True)
    if headroom is not None and not 0.0 <= headroom < 0.5:  # NaN fails this too
        raise SpecError(f"memory_headroom: a fraction in [0, 0.5), or null for each spec's own, got {headroom}")
    trials = top.get("trials", int, default=None, nullable=True)
    if trials is not None and not 0 < trials <= MAX_TRIALS:
        raise SpecError(f"trials: an integer in [1, {MAX_TRIALS}], or null for each spec's search.trials, "
                        f"got {trials}")
    idle_reader = top.section("idle", required=False)
    max_utilization = idle_reader.number("max_utilization", default=5.0, minimum=0.0)
    if max_utilization > 100:
        raise SpecError(f"idle.max_utilization: a percentage in [0, 100], got {max_utilization}")
    idle = IdleRule(max_utilization=max_utilization,
                    min_idle_s=idle_reader.number("min_idle_s", default=120.0, minimum=0.0, maximum=MAX_TIMEOUT_S))
    idle_reader.finish()
    multi_gpu = top.get("multi_gpu", bool, default=True)
    worker_name = top.get("worker_name", str, default="")
    if worker_name and not re.fullmatch(r"[A-Za-z0-9._:-]{1,64}", worker_name):
        raise SpecError(f"worker_name: letters, digits, '.', '_', ':' and '-', at most 64, got {worker_name!r}")
    if top.raw.get("metrics_address") is False:  # YAML 1.1 reads an unquoted `off` as false
        top.raw["metrics_address"] = "off"
    metrics_address = top.get("metrics_address", str, default=None, nullable=True)
    if metrics_address is not None:
        parse_address(metrics_address, "metrics_address")  # checked here: a bad one is a config error
    top.finish()
    return ServiceConfig(path=path, models_dir=models_dir, store_dir=store_dir, state_dir=state_dir,
                         storage=storage, poll_interval_s=poll_interval_s,
                         memory_headroom=None if headroom is None else float(headroom), idle=idle, trials=trials,
                         multi_gpu=multi_gpu, worker_name=worker_name, metrics_address=metrics_address)
