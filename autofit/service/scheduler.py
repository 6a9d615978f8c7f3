"""The service's running tunes: which GPU each holds (a job on N GPUs under each of its slots),
which GPUs are free for one, starting queued pairs on idle GPUs, stopping a tune whose GPU
got another job, and recording how each tune ended on its pair.

The main thread (`daemon.py`) owns this; each tune's worker thread only writes its own job's
fields (`job.py`).
"""

import contextlib
import os
import signal
import time
from collections.abc import Callable

from loguru import logger

from autofit.base.errors import AutofitError
from autofit.base.sizes import format_bytes
from autofit.config.spec import ModelSpec
from autofit.device.budget import budget_for
from autofit.service.config import ServiceConfig
from autofit.service.guard import PidRule, TrialGuard
from autofit.service.inventory import descendant_pids, Gpu, IdleTracker
from autofit.service.job import TuneJob
from autofit.service.state import PairState

STOP_JOIN_S = 20.0  # wait for a stopped tune this long; systemd/autofit.service allows 60 s


class Scheduler:
    def __init__(self):
        self.tunes: dict[str, TuneJob] = {}  # by GPU slot (a job on N GPUs under each of its slots)
        self.gpu_busy: dict[str, str | None] = {}  # slot -> why it cannot take a tune now (None: free)
        self.idle = IdleTracker()
        self.pid_rule = PidRule()  # which of NVML's pids are ours: learnt from trial children's claims

    def jobs(self) -> list[TuneJob]:
        """The running tunes, each once."""
        return list({id(job): job for job in self.tunes.values()}.values())

    def watch(self, gpus: list[Gpu], specs: dict, inventory, config: ServiceConfig) -> None:
        """Which GPUs are free; stop tunes whose GPU got another job, left, or whose spec changed."""
        now_s = time.monotonic()
        present = {g.slot: g for g in gpus}
        for slot, job in self.tunes.items():
            gpu = present.get(slot)
            current = specs.get(job.spec.name)
            if gpu is None or gpu.device.fingerprint != job.gpu.device.fingerprint:
                job.stop("the GPU left the inventory", retry=True)
            elif current is None or current[1].spec_hash != job.spec.spec_hash:
                job.stop("its model spec changed or was removed")
        for job in self.jobs():
            # Its guard checks every tick; this is the same check, should its thread be gone.
            reason = job.guard.check() if job.guard is not None else None
            if reason is not None:
                job.stop(reason, retry=True)  # never disturb another job: the study keeps what was measured
        own_pids = self.pid_rule.base_pids()  # no tune on these GPUs: no trial child of ours is on them
        for gpu in gpus:
            if gpu.slot in self.tunes:
                self.gpu_busy[gpu.slot] = "tuning"
                continue
            try:
                activity = inventory.activity(gpu, own_pids)
            except AutofitError as exc:
                self.gpu_busy[gpu.slot] = f"cannot read its activity: {exc}"
                self.idle.reset(gpu)
                continue
            self.gpu_busy[gpu.slot] = self.idle.check(gpu, activity, config.idle, now_s)

    def schedule(self, queue: list[str], pairs: dict[str, PairState], gpus: list[Gpu], *, emulated: bool,
                 start: Callable[[PairState, list[Gpu]], None]) -> None:
        """Start each queued pair whose GPUs are idle (`start(pair, gpus)`); say why the others wait."""
        for key in list(queue):
            if emulated and self.tunes:
                break  # every emulated card's trials share the one CPU: measuring two at once would skew both
            pair = pairs[key]
            free = [g for g in gpus if g.device.fingerprint == pair.gpu_fingerprint and g.slot not in self.tunes]
            idle = [g for g in free if self.gpu_busy.get(g.slot) is None]
            if len(idle) < pair.world_size:
                reasons = ("; ".join(f"{g.slot} {self.gpu_busy.get(g.slot)}" for g in free if g not in idle)
                           or "its GPUs are tuning")
                need = "an idle GPU" if pair.world_size == 1 else f"{pair.world_size} idle GPUs"
                pair.detail = f"waiting for {need}: {reasons}"
                continue
            start(pair, idle[:pair.world_size])
            queue.remove(key)

    def start(self, pair: PairState, gpus: list[Gpu], spec: ModelSpec, *, config: ServiceConfig, inventory,
              headroom: float, on_record: Callable | None = None) -> TuneJob:
        # The budget is each rank's: every GPU of a kind has the same memory.
        job = TuneJob(key=pair.key, gpu=gpus[0], gpus=tuple(gpus), spec=spec,
                      trials=config.trials or spec.search.trials,
                      budget=budget_for(gpus[0].device, None, headroom=headroom),
                      worker=config.worker, on_record=on_record)
        # Checked on every tick of the tune, not only at the next poll: a job that starts
        # while a trial holds most of the card would run out of memory.
        job.guard = TrialGuard(inventory, gpus, lambda reason: job.stop(reason, retry=True), rule=self.pid_rule)
        pair.tunes += 1
        pair.status, pair.detail = "tuning", None
        pair.last_tune = {"gpu": "+".join(g.slot for g in gpus), "started": job.started, "ended": None,
                          "result": None}
        for gpu in gpus:
            self.tunes[gpu.slot] = job
            self.gpu_busy[gpu.slot] = "tuning"
        logger.info("{}: tuning {} (tune #{} of this pair), budget {}{}", job.label, spec.name, pair.tunes,
                    format_bytes(job.budget.usable_bytes), f" per rank, {job.nproc} ranks" if job.nproc > 1 else "")
        job.start(store_dir=config.store_dir, storage=config.storage_url)
        return job

    def reap(self, pairs: dict[str, PairState], *, headroom: Callable[[ModelSpec], float],
             spec_file: Callable[[str], str]) -> bool:
        """Record the tunes that ended on their pairs; True if any did."""
        ended = [job for job in self.jobs() if not job.alive]
        for job in ended:
            for gpu in job.gpus:
                self.tunes.pop(gpu.slot)
                if job.stop_event.is_set():
                    self.idle.reset(gpu)  # whatever stopped it may still be there: wait a full idle period
            result = job.settle(pairs[job.key], headroom=headroom(job.spec))
            # One line; the traceback of an unexpected error only with --debug (autofit.base.logs).
            logger.opt(exception=job.traceback_error).bind(summarised=True).log(
                "INFO" if job.outcome is not None else "WARNING", "{}: {} ({}): {}", job.label, job.spec.name,
                spec_file(job.spec.name), result)
        return bool(ended)

    def stop_all(self, reason: str) -> None:
        """Stop every tune and wait for them (at most STOP_JOIN_S); trial processes of a worker
        stuck past that are killed, so none outlives the service."""
        for job in self.jobs():
            job.stop(reason)
        deadline_s = time.monotonic() + STOP_JOIN_S
        for job in self.jobs():
            job.thread.join(timeout=max(0.0, deadline_s - time.monotonic()))

    def kill_stragglers(self) -> list[TuneJob]:
        """The jobs still running after `stop_all`; their trial processes are killed."""
        stuck = self.jobs()
        if stuck:
            logger.warning("{} tune(s) did not stop within {:.0f} s; killing their trial processes", len(stuck),
                           STOP_JOIN_S)
            for pid in descendant_pids():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        return stuck
