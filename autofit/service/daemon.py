"""`autofit serve`: keep every registered model tuned for every kind of GPU on this host.

    autofit serve --config /etc/autofit/autofit.yaml
    autofit serve --config autofit.yaml --inventory gpus.yaml   # emulated GPUs, trials on the CPU
    autofit status --config /etc/autofit/autofit.yaml --json

Each poll reads the GPU inventory and the models folder. Every (model, GPU kind) pair
without a valid profile in the store is queued, and a queued pair is tuned on an idle GPU
of its kind, one tune per GPU, in a worker thread whose trials are child processes. A host
with N > 1 GPUs of one kind also keeps each model's N-rank profile (DDP or FSDP2 through
torchrun; `multi_gpu: false` turns it off), tuned when all N are idle. The
main thread never tunes: it keeps polling, pinging systemd's watchdog and answering
signals, and stops a tune when another job appears on its GPU; the pair is queued again
and resumes from its stored study. Installation: docs/service.md.
"""

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

from loguru import logger

from autofit.base import stopping
from autofit.base.atomic import sweep_stale_temps
from autofit.base.errors import AutofitError, SpecError
from autofit.base.paths import ensure_folder
from autofit.config.spec import load_spec, ModelSpec
from autofit.profiles.profile import utc_now

from autofit.service import pairs as pair_plan
from autofit.service.config import load_service_config, resolve_config_path, ServiceConfig
from autofit.service.endpoint import parse_address
from autofit.service.inventory import FileInventory, Gpu, NvmlInventory
from autofit.service.job import TuneJob
from autofit.service.monitor import Monitor
from autofit.service.notify import Notifier
from autofit.service.scheduler import Scheduler
from autofit.service.state import (DamagedState, PairState, read_state, set_aside, STATE_SCHEMA, StateLock,
                                   write_state)

_TICK_S = 0.1  # how often the main loop looks at signals, finished tunes and the watchdog
_HEARTBEAT_S = 10.0  # state.json is rewritten at least this often, so `status` sees a live service


class Service:
    def __init__(self, config_path: str | Path | None, *, inventory_path: str | Path | None = None,
                 metrics_address: str | None = None):
        self.config_path = resolve_config_path(config_path).resolve()
        self.config: ServiceConfig = load_service_config(self.config_path)
        if metrics_address is not None:  # --metrics-address wins over the config's
            parse_address(metrics_address, "--metrics-address")
            self.config = dataclasses.replace(self.config, metrics_address=metrics_address)
        if inventory_path is not None and not Path(inventory_path).is_file():
            # Re-read every poll, but a path that is not a file at all is a typo: say so now.
            what = "is a folder, not a file" if Path(inventory_path).is_dir() else "no such file"
            raise SpecError(f"--inventory {inventory_path}: {what}")
        self.inventory = FileInventory(inventory_path) if inventory_path else NvmlInventory()
        self.notifier = Notifier()
        self.monitor = Monitor(self.config)  # /metrics, /healthz, and the judgement behind WATCHDOG=1
        self.scheduler = Scheduler()
        self.pairs: dict[str, PairState] = {}
        self.gpus: list[Gpu] = []
        self.specs: dict[str, tuple[Path, ModelSpec]] = {}
        self.spec_errors: list[dict] = []
        self.inventory_error: str | None = None
        self.queue: list[str] = []
        self.started = utc_now()
        self._poll_ok = self._state_ok = True
        self._stopping = self._reload = False
        self._lock = StateLock(self.config.state_dir)
        self._last_state, self._last_write_s = "", float("-inf")

    @property
    def healthy(self) -> bool:
        return self._poll_ok and self._state_ok

    def _unhealthy_reason(self) -> str:
        return "; ".join(why for ok, why in ((self._poll_ok, "the last poll failed (see the log)"),
                                             (self._state_ok, f"cannot write the state file in {self.config.state_dir}"))
                         if not ok)

    @property
    def tunes(self) -> dict[str, TuneJob]:
        return self.scheduler.tunes

    # --- the main loop -----------------------------------------------------------------------

    def run(self) -> int:
        # Folders it cannot write are a config error (exit 2, not restarted by the unit), found
        # now rather than when the first tune's profile or state write fails.
        for folder, key in ((self.config.state_dir, "state_dir"), (self.config.store_dir, "store_dir")):
            ensure_folder(folder, key)
        self._lock.acquire()
        try:
            # A write the last run was killed in (SIGKILL, a power cut) left its temp file.
            for folder in (self.config.state_dir, self.config.store_dir):
                for path in sweep_stale_temps(folder):
                    logger.info("removed {}, left by an interrupted write", path)
            self._load_state()
            self.monitor.start()
            signal.signal(signal.SIGTERM, self._on_stop)
            signal.signal(signal.SIGINT, self._on_stop)
            signal.signal(signal.SIGHUP, self._on_reload)
            logger.info("autofit serve: pid {}, inventory {}, config {}", os.getpid(), self.inventory.description,
                        self.config.to_dict())
            self._poll()
            self._save_state(force=True)
            self.notifier.ready(self.status_line())
            next_poll_s = time.monotonic() + self.config.poll_interval_s
            while not self._stopping:
                if self._reload:
                    self._reload_config()
                    next_poll_s = 0.0
                if self._reap():
                    next_poll_s = 0.0  # a GPU came free: schedule the next pair now, not a poll later
                if time.monotonic() >= next_poll_s:
                    self._poll()
                    next_poll_s = time.monotonic() + self.config.poll_interval_s
                self._save_state()
                self.notifier.status(self.status_line())
                self.monitor.turned(ok=self.healthy, why=self._unhealthy_reason())
                self.notifier.watchdog(healthy=self.monitor.healthy())
                time.sleep(_TICK_S)
            self._shutdown()
            # Our children are gone and the state is written: an operator's further
            # SIGTERMs (or systemd's, or a Ctrl-C storm) must not turn the clean stop into
            # 143 on the way out. Not earlier: a child started now would inherit SIG_IGN.
            stopping.absorb_until_exit()
        finally:
            self.monitor.stop()  # the HTTP thread must not outlive the command
            self._lock.release()
        return 0

    def _on_stop(self, signum, frame) -> None:
        # Only flags here: the main loop does the work between ticks, outside any lock.
        self._stopping = True

    def _on_reload(self, signum, frame) -> None:
        self._reload = True

    def _reload_config(self) -> None:
        self._reload = False
        try:
            config = load_service_config(self.config_path)
        except AutofitError as exc:
            logger.error("SIGHUP: {}; keeping the running config", exc)
            return
        if config.state_dir != self.config.state_dir:
            logger.warning("SIGHUP: state_dir cannot move while the service holds its lock there; "
                           "keeping {} until a restart", self.config.state_dir)
            config = dataclasses.replace(config, state_dir=self.config.state_dir)
        if config.metrics_address != self.config.metrics_address:
            logger.warning("SIGHUP: the metrics endpoint stays where it is until a restart")
            config = dataclasses.replace(config, metrics_address=self.config.metrics_address)
        self.config = config
        given_up = [pair for pair in self.pairs.values() if (pair.failure or {}).get("final")]
        for pair in given_up:  # the operator's way to say "try again"
            pair.failure = None
        logger.info("SIGHUP: reloaded config {}; re-reading the models folder{}", config.to_dict(),
                    f"; retrying {len(given_up)} pair(s) given up on" if given_up else "")

    def _poll(self) -> None:
        try:
            self._read_models()
            self._read_inventory()
            self.scheduler.watch(self.gpus, self.specs, self.inventory, self.config)
            self.queue = pair_plan.plan(self.pairs, self.specs, self.gpus, store_dir=self.config.store_dir,
                                        tuning={job.key for job in self._jobs()}, multi_gpu=self.config.multi_gpu,
                                        headroom=self._headroom)
            self.scheduler.schedule(self.queue, self.pairs, self.gpus, emulated=self.inventory.emulated,
                                    start=self._start)
            self._poll_ok = True
        except Exception:  # a bug must not kill the service; no watchdog pings make systemd restart it
            logger.exception("poll failed")
            self._poll_ok = False

    # --- what is there -----------------------------------------------------------------------

    def _read_models(self) -> None:
        specs, errors = {}, []
        folder = self.config.models_dir
        paths = sorted(p for p in folder.glob("*.y*ml") if p.suffix in (".yaml", ".yml")
                       and not p.name.startswith(".")) if folder.is_dir() else []
        if not folder.is_dir():
            errors.append({"path": str(folder), "error": f"models_dir {folder}: no such folder"})
        for path in paths:
            try:
                spec = load_spec(path)
            except (AutofitError, OSError) as exc:
                errors.append({"path": str(path), "error": str(exc)})
                continue
            if spec.name in specs:
                errors.append({"path": str(path), "error": f"{path}: name {spec.name!r} is already used by "
                                                          f"{specs[spec.name][0].name}"})
                continue
            specs[spec.name] = (path, spec)
        for error in errors:
            if error not in self.spec_errors:  # once per new error, not once per poll
                logger.error("skipping model spec: {}", error["error"])
        hashes = {name: spec.spec_hash for name, (_, spec) in specs.items()}
        if hashes != {name: spec.spec_hash for name, (_, spec) in self.specs.items()}:
            logger.info("models: {}", ", ".join(f"{name} ({h.removeprefix('sha256:')[:12]})"
                                                for name, h in hashes.items()) or "none")
        self.specs, self.spec_errors = specs, errors

    def _read_inventory(self) -> None:
        try:
            gpus = self.inventory.gpus()
        except AutofitError as exc:
            # Keep the last good inventory: a file being rewritten or a passing NVML error
            # should not look like every GPU leaving.
            if str(exc) != self.inventory_error:
                logger.error("inventory: {}", exc)
            self.inventory_error = str(exc)
            return
        self.inventory_error = None
        if [(g.slot, g.device.fingerprint) for g in gpus] != [(g.slot, g.device.fingerprint) for g in self.gpus]:
            logger.info("inventory ({}): {}", self.inventory.description,
                        "; ".join(f"{g.slot} {g.device.name} [{g.device.fingerprint}]" for g in gpus) or "no GPUs")
        self.gpus = gpus

    # --- what to do ---------------------------------------------------------------------------

    def _headroom(self, spec: ModelSpec) -> float:
        return spec.search.memory_headroom if self.config.memory_headroom is None else self.config.memory_headroom

    def _spec_file(self, name: str) -> str:
        path = self.specs.get(name, (None,))[0]
        return "removed" if path is None else path.name

    def _jobs(self) -> list[TuneJob]:
        return self.scheduler.jobs()

    def _start(self, pair: PairState, gpus: list[Gpu]) -> None:
        spec = self.specs[pair.model][1]
        self.scheduler.start(pair, gpus, spec, config=self.config, inventory=self.inventory,
                             headroom=self._headroom(spec),
                             on_record=lambda record: self.monitor.count_trial(pair.model, pair.fingerprint,
                                                                               record.status))

    def _reap(self) -> bool:
        """Record the tunes that ended; True if any did."""
        return self.scheduler.reap(self.pairs, headroom=self._headroom, spec_file=self._spec_file)

    def _shutdown(self) -> None:
        logger.info("stopping: {} running tune(s) will be interrupted and resume on restart", len(self._jobs()))
        self.notifier.stopping("stopping")
        self.scheduler.stop_all("the service is stopping")
        self._reap()
        for job in self.scheduler.kill_stragglers():  # its trial children must not outlive us
            pair = self.pairs[job.key]
            pair.status, pair.detail = "interrupted", "the service stopped during this tune; resumes from its study"
        self._save_state(force=True)
        logger.info("stopped")

    # --- state and status ------------------------------------------------------------------

    def status_line(self) -> str:
        parts = [t.line for t in self._jobs()]
        ready = sum(p.status == "ready" for p in self.pairs.values())
        if self.queue:
            parts.append(f"{len(self.queue)} queued")
        if not parts:
            parts.append(f"idle: {ready} profiles ready for {len(self.specs)} models on "
                         f"{len({g.device.fingerprint for g in self.gpus})} GPU kinds")
        if self.spec_errors:
            parts.append(f"{len(self.spec_errors)} spec errors")
        return "; ".join(parts)

    def _state(self) -> dict:
        return {
            "schema": STATE_SCHEMA,
            "service": {"pid": os.getpid(), "running": not self._stopping, "healthy": self.healthy,
                        "started": self.started, "updated": utc_now(),
                        "status": "stopped" if self._stopping else self.status_line(),
                        "metrics": self.monitor.to_dict()},
            "config": self.config.to_dict(),
            "inventory": {"source": self.inventory.description, "error": self.inventory_error, "gpus": [
                {"slot": g.slot, "name": g.device.name, "fingerprint": g.device.fingerprint,
                 "memory_total_bytes": g.device.memory_total_bytes, "emulated": g.device.emulated,
                 "state": self.scheduler.gpu_busy.get(g.slot) or "idle"} for g in self.gpus]},
            "models": [{"name": n, "path": str(p), "spec_hash": s.spec_hash} for n, (p, s) in self.specs.items()],
            "spec_errors": self.spec_errors,
            "queue": [{"model": self.pairs[k].model, "device": self.pairs[k].device,
                       "fingerprint": self.pairs[k].fingerprint} for k in self.queue],
            "running": [job.to_dict() for job in self._jobs()],
            "pairs": [p.to_dict() for p in self.pairs.values()],
        }

    def _save_state(self, *, force: bool = False) -> None:
        state = self._state()
        self.monitor.publish(state)
        same = json.dumps({**state, "service": {**state["service"], "updated": None}}, sort_keys=True, default=str)
        if not force and same == self._last_state and time.monotonic() - self._last_write_s < _HEARTBEAT_S:
            return
        try:
            write_state(self.config.state_dir, state)
            self._state_ok = True
        except (OSError, AutofitError) as exc:  # a full or read-only disk: unhealthy, so systemd's watchdog steps in
            if self._state_ok:
                logger.error("cannot write the state file in {}: {}", self.config.state_dir, exc)
            self._state_ok = False
            return
        self._last_state, self._last_write_s = same, time.monotonic()

    def _load_state(self) -> None:
        try:
            state = read_state(self.config.state_dir) or {}
        except DamagedState as exc:
            # The state is a record; what matters (profiles, studies) lives elsewhere. Set
            # aside, not overwritten: exiting instead would make systemd restart into it.
            aside = set_aside(self.config.state_dir)
            logger.warning("starting without the last run's state: {}; kept as {}", exc, aside)
            state = {}
        for raw in state.get("pairs", []):
            pair = PairState.from_dict(raw)  # checked by read_state
            if pair.status == "tuning":  # the last run ended (or died) mid-tune
                pair.status, pair.detail = "interrupted", "the service stopped during this tune; resumes from its study"
            self.pairs[pair.key] = pair
        if self.pairs:
            logger.info("state: {} (model, GPU kind) pairs from the last run", len(self.pairs))


def serve_command(config_path: str | Path | None, *, inventory_path: str | Path | None = None,
                  metrics_address: str | None = None) -> int:
    """`autofit serve`: run until SIGTERM; 0 on a clean stop."""
    return Service(config_path, inventory_path=inventory_path, metrics_address=metrics_address).run()


def main(args) -> int:
    """The CLI's `serve`."""
    return serve_command(args.config, inventory_path=args.inventory, metrics_address=args.metrics_address)
