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

import contextlib
import dataclasses
import json
import os
import signal
import time
from pathlib import Path

from loguru import logger

from autofit.device.probe import DeviceInfo, usable_budget_bytes
from autofit.errors import AutofitError, SpecError
from autofit.service.inventory import FileInventory, Gpu, IdleTracker, NvmlInventory, descendant_pids
from autofit.service.notify import Notifier
from autofit.profile import utc_now
from autofit.service.config import ServiceConfig, load_service_config, resolve_config_path
from autofit.service.guard import PidRule, TrialGuard
from autofit.service.job import TuneJob, retry_text
from autofit.service.state import STATE_SCHEMA, PairState, StateLock, pair_key, read_state, write_state
from autofit.sizes import format_bytes
from autofit.spec import ModelSpec, load_spec
from autofit.store import ProfileStore
from autofit.tune import device_for_ranks

_TICK_S = 0.1  # how often the main loop looks at signals, finished tunes and the watchdog
_HEARTBEAT_S = 10.0  # state.json is rewritten at least this often, so `status` sees a live service
_STOP_JOIN_S = 20.0  # wait for a stopped tune this long; systemd/autofit.service allows 60 s


class Service:
    def __init__(self, config_path: str | Path | None, *, inventory_path: str | Path | None = None):
        self.config_path = resolve_config_path(config_path).resolve()
        self.config: ServiceConfig = load_service_config(self.config_path)
        if inventory_path is not None and not Path(inventory_path).is_file():
            # Re-read every poll, but a path that is not a file at all is a typo: say so now.
            what = "is a folder, not a file" if Path(inventory_path).is_dir() else "no such file"
            raise SpecError(f"--inventory {inventory_path}: {what}")
        self.inventory = FileInventory(inventory_path) if inventory_path else NvmlInventory()
        self.notifier = Notifier()
        self.idle = IdleTracker()
        self.pid_rule = PidRule()  # which of NVML's pids are ours: learnt from trial children's claims
        self.pairs: dict[str, PairState] = {}
        self.tunes: dict[str, TuneJob] = {}  # by GPU slot (a job on N GPUs under each of its slots)
        self.gpus: list[Gpu] = []
        self.gpu_busy: dict[str, str | None] = {}  # slot -> why it cannot take a tune now (None: free)
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

    # --- the main loop -----------------------------------------------------------------------

    def run(self) -> int:
        self._lock.acquire()
        try:
            self._load_state()
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
                self.notifier.watchdog(healthy=self.healthy)
                time.sleep(_TICK_S)
            self._shutdown()
        finally:
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
            self._watch_gpus()
            self._plan()
            self._schedule()
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

    def _watch_gpus(self) -> None:
        """Which GPUs are free; stop tunes whose GPU got another job, left, or whose spec changed."""
        now_s = time.monotonic()
        present = {g.slot: g for g in self.gpus}
        for slot, job in self.tunes.items():
            gpu = present.get(slot)
            current = self.specs.get(job.spec.name)
            if gpu is None or gpu.device.fingerprint != job.gpu.device.fingerprint:
                job.stop("the GPU left the inventory", retry=True)
            elif current is None or current[1].spec_hash != job.spec.spec_hash:
                job.stop("its model spec changed or was removed")
        for job in self._jobs():
            # Its guard checks every tick; this is the same check, should its thread be gone.
            reason = job.guard.check() if job.guard is not None else None
            if reason is not None:
                job.stop(reason, retry=True)  # never disturb another job: the study keeps what was measured
        own_pids = self.pid_rule.base_pids()  # no tune on these GPUs: no trial child of ours is on them
        for gpu in self.gpus:
            if gpu.slot in self.tunes:
                self.gpu_busy[gpu.slot] = "tuning"
                continue
            try:
                activity = self.inventory.activity(gpu, own_pids)
            except AutofitError as exc:
                self.gpu_busy[gpu.slot] = f"cannot read its activity: {exc}"
                self.idle.reset(gpu)
                continue
            self.gpu_busy[gpu.slot] = self.idle.check(gpu, activity, self.config.idle, now_s)

    # --- what to do ---------------------------------------------------------------------------

    def _headroom(self, spec: ModelSpec) -> float:
        return spec.search.memory_headroom if self.config.memory_headroom is None else self.config.memory_headroom

    def _plan(self) -> None:
        """Each pair's status, and the queue: pairs with no valid profile and nothing holding them back."""
        store = ProfileStore(self.config.store_dir)
        profiles = store.list()  # one read of the store per poll
        devices = [g.device for g in self.gpus]
        tuning = {job.key for job in self.tunes.values()}
        queue, active = [], set()
        for name, (_, spec) in sorted(self.specs.items()):
            for fingerprint, device, world_size in self._kinds(spec):
                key = pair_key(name, fingerprint)
                active.add(key)
                pair = self.pairs.setdefault(key, PairState(model=name, fingerprint=fingerprint, device=device.name,
                                                            world_size=world_size))
                pair.spec_hash = spec.spec_hash
                mine = sorted((item for item in profiles if item[1].model.name == name
                               and item[1].device.fingerprint == fingerprint),
                              key=lambda item: item[1].created, reverse=True)
                stale = store.stale_reasons(mine[0][1], spec, devices=devices) if mine else []
                pair.profile = _profile_summary(*mine[0], stale) if mine else None
                nothing = pair.nothing_fits
                failure = pair.failure
                if key in tuning:
                    pair.status = "tuning"
                elif mine and not stale:
                    pair.status, pair.detail = "ready", None
                elif nothing and nothing["spec_hash"] == spec.spec_hash and nothing["headroom"] == self._headroom(spec):
                    pair.status, pair.detail = "nothing fits", nothing["message"]
                elif failure and failure.get("spec_hash") == spec.spec_hash and (
                        failure.get("final") or (failure.get("retry_after_unix_s") or 0) > time.time()):
                    # Final after MAX_ATTEMPTS timeouts or crashes; else waiting out its back-off.
                    pair.status = "failed" if failure.get("final") else "retrying"
                    pair.detail = retry_text(failure)
                else:
                    if failure and failure.get("spec_hash") == spec.spec_hash:
                        pair.status, pair.detail = "queued", f"back-off over, to retry after: {retry_text(failure)}"
                    elif pair.status != "interrupted":  # keep saying why it stopped until it runs again
                        pair.status = "queued"
                        pair.detail = ("stale: " + "; ".join(stale)) if stale else "no profile for this GPU kind"
                    queue.append(key)
        for key, pair in self.pairs.items():
            if key not in active:
                pair.status, pair.detail = "inactive", "the model or this GPU kind is not present now"
        self.queue = queue

    def _spec_file(self, name: str) -> str:
        path = self.specs.get(name, (None,))[0]
        return "removed" if path is None else path.name

    def _kinds(self, spec: ModelSpec) -> list[tuple[str, DeviceInfo, int]]:
        """(fingerprint, device, ranks) of each profile `spec` should have on this host: one per
        GPU kind, and with `multi_gpu` one over all N > 1 GPUs of a kind whose global batch
        splits N ways."""
        by_kind: dict[str, list[Gpu]] = {}
        for gpu in self.gpus:
            by_kind.setdefault(gpu.device.fingerprint, []).append(gpu)
        kinds = [(fingerprint, gpus[0].device, 1) for fingerprint, gpus in by_kind.items()]
        if self.config.multi_gpu:
            kinds += [(device_for_ranks(gpus[0].device, len(gpus)).fingerprint, gpus[0].device, len(gpus))
                      for gpus in by_kind.values()
                      if len(gpus) > 1 and spec.train.global_batch_size % len(gpus) == 0]
        return kinds

    def _jobs(self) -> list[TuneJob]:
        """The running tunes, each once (a job on N GPUs is under each of its slots)."""
        return list({id(job): job for job in self.tunes.values()}.values())

    def _schedule(self) -> None:
        for key in list(self.queue):
            if self.inventory.emulated and self.tunes:
                break  # every emulated card's trials share the one CPU: measuring two at once would skew both
            pair = self.pairs[key]
            free = [g for g in self.gpus if g.device.fingerprint == pair.gpu_fingerprint and g.slot not in self.tunes]
            idle = [g for g in free if self.gpu_busy.get(g.slot) is None]
            if len(idle) < pair.world_size:
                reasons = ("; ".join(f"{g.slot} {self.gpu_busy.get(g.slot)}" for g in free if g not in idle)
                           or "its GPUs are tuning")
                need = "an idle GPU" if pair.world_size == 1 else f"{pair.world_size} idle GPUs"
                pair.detail = f"waiting for {need}: {reasons}"
                continue
            self._start(pair, idle[:pair.world_size])

    def _start(self, pair: PairState, gpus: list[Gpu]) -> None:
        spec = self.specs[pair.model][1]
        # The budget is each rank's: every GPU of a kind has the same memory.
        job = TuneJob(key=pair.key, gpu=gpus[0], gpus=tuple(gpus), spec=spec,
                      trials=self.config.trials or spec.search.trials,
                      budget_bytes=usable_budget_bytes(gpus[0].device, headroom=self._headroom(spec)),
                      worker=self.config.worker)
        # Checked on every tick of the tune, not only at the next poll: a job that starts
        # while a trial holds most of the card would run out of memory.
        job.guard = TrialGuard(self.inventory, gpus, lambda reason: job.stop(reason, retry=True), rule=self.pid_rule)
        pair.tunes += 1
        pair.status, pair.detail = "tuning", None
        pair.last_tune = {"gpu": "+".join(g.slot for g in gpus), "started": job.started, "ended": None,
                          "result": None}
        for gpu in gpus:
            self.tunes[gpu.slot] = job
            self.gpu_busy[gpu.slot] = "tuning"
        self.queue.remove(pair.key)
        logger.info("{}: tuning {} (tune #{} of this pair), budget {}{}", job.label, spec.name, pair.tunes,
                    format_bytes(job.budget_bytes), f" per rank, {job.nproc} ranks" if job.nproc > 1 else "")
        job.start(store_dir=self.config.store_dir, storage=self.config.storage_url)

    def _reap(self) -> bool:
        """Record the tunes that ended; True if any did."""
        ended = [job for job in self._jobs() if not job.alive]
        for job in ended:
            for gpu in job.gpus:
                self.tunes.pop(gpu.slot)
                if job.stop_event.is_set():
                    self.idle.reset(gpu)  # whatever stopped it may still be there: wait a full idle period
            result = job.settle(self.pairs[job.key], headroom=self._headroom(job.spec))
            # One line; the traceback of an unexpected error only with --debug (autofit.logs).
            logger.opt(exception=job.traceback_error).bind(summarised=True).log(
                "INFO" if job.outcome is not None else "WARNING", "{}: {} ({}): {}", job.label, job.spec.name,
                self._spec_file(job.spec.name), result)
        return bool(ended)

    def _shutdown(self) -> None:
        logger.info("stopping: {} running tune(s) will be interrupted and resume on restart", len(self._jobs()))
        self.notifier.stopping("stopping")
        for job in self._jobs():
            job.stop("the service is stopping")
        deadline_s = time.monotonic() + _STOP_JOIN_S
        for job in self._jobs():
            job.thread.join(timeout=max(0.0, deadline_s - time.monotonic()))
        self._reap()
        if self.tunes:
            # A worker stuck past the deadline: its trial children must not outlive us.
            logger.warning("{} tune(s) did not stop within {:.0f} s; killing their trial processes",
                           len(self._jobs()), _STOP_JOIN_S)
            for pid in descendant_pids():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            for job in self._jobs():
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
                        "status": "stopped" if self._stopping else self.status_line()},
            "config": self.config.to_dict(),
            "inventory": {"source": self.inventory.description, "error": self.inventory_error, "gpus": [
                {"slot": g.slot, "name": g.device.name, "fingerprint": g.device.fingerprint,
                 "memory_total_bytes": g.device.memory_total_bytes, "emulated": g.device.emulated,
                 "state": self.gpu_busy.get(g.slot) or "idle"} for g in self.gpus]},
            "models": [{"name": n, "path": str(p), "spec_hash": s.spec_hash} for n, (p, s) in self.specs.items()],
            "spec_errors": self.spec_errors,
            "queue": [{"model": self.pairs[k].model, "device": self.pairs[k].device,
                       "fingerprint": self.pairs[k].fingerprint} for k in self.queue],
            "running": [job.to_dict() for job in self._jobs()],
            "pairs": [p.to_dict() for p in self.pairs.values()],
        }

    def _save_state(self, *, force: bool = False) -> None:
        state = self._state()
        same = json.dumps({**state, "service": {**state["service"], "updated": None}}, sort_keys=True, default=str)
        if not force and same == self._last_state and time.monotonic() - self._last_write_s < _HEARTBEAT_S:
            return
        try:
            write_state(self.config.state_dir, state)
            self._state_ok = True
        except OSError as exc:  # a full or read-only disk: unhealthy, so systemd's watchdog steps in
            if self._state_ok:
                logger.error("cannot write the state file in {}: {}", self.config.state_dir, exc)
            self._state_ok = False
            return
        self._last_state, self._last_write_s = same, time.monotonic()

    def _load_state(self) -> None:
        try:
            state = read_state(self.config.state_dir) or {}
        except AutofitError as exc:
            # The state is a record; what matters (profiles, studies) lives elsewhere.
            logger.warning("starting without the last run's state: {}", exc)
            state = {}
        for raw in state.get("pairs", []):
            try:
                pair = PairState.from_dict(raw)
            except (TypeError, AssertionError):
                continue
            if pair.status == "tuning":  # the last run ended (or died) mid-tune
                pair.status, pair.detail = "interrupted", "the service stopped during this tune; resumes from its study"
            self.pairs[pair.key] = pair
        if self.pairs:
            logger.info("state: {} (model, GPU kind) pairs from the last run", len(self.pairs))


def _profile_summary(path: Path, profile, stale: list[str]) -> dict:
    return {"path": str(path), "spec_hash": profile.model.spec_hash, "config": profile.config.short(),
            "samples_per_s": profile.measured.samples_per_s, "created": profile.created, "stale": stale,
            # Which hosts sharing the study measured its trials, and which one validated it.
            "workers": profile.search.workers, "validated_by": profile.search.validated_by}


def serve_command(config_path: str | Path | None, *, inventory_path: str | Path | None = None) -> int:
    """`autofit serve`: run until SIGTERM; 0 on a clean stop."""
    return Service(config_path, inventory_path=inventory_path).run()
