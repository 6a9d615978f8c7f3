"""Never disturb a job: the GPUs of a running tune are watched on every tick, and any compute
process that is not one the service launched stops the tune within a second.

Which processes are ours. NVML names a GPU's compute processes by pid, but in the pid
namespace of the host: inside a container the pid NVML gives for our own trial child is
not a pid we know. So the service does not compare NVML's pids with its own; it asks its
children. A trial child, before it touches CUDA, lists the pids NVML shows on its GPU,
writes a `claiming` note into its trial folder, creates its CUDA context, lists them
again and writes the pids that appeared (`claim_cuda_context`). On a GPU being tuned, a
pid is ours when it is

1. a pid a running trial child claimed (the one new pid after its context was created;
   its own pid when NVML shows pids as we see them);
2. the service's own pid, or one of its descendants, unless a claim has shown that NVML
   uses another pid namespace (then our pids mean nothing to NVML, and a host pid that
   happens to equal one of them must not pass for ours).

Every other pid is another job, and the tune is stopped, except while a trial child is
between its two lists (at most `CLAIM_GRACE_S`): then a pid that appears cannot be told
apart yet. If more than one pid appeared while a child created its context, it claims
none of them: the tune is stopped rather than risk someone else's job. Claims last as long
as the trial child: a pid the host reuses later is not ours.

Limits: a job whose CUDA context appears in the same instant as our child's is caught only
as an ambiguous claim (the tune stops, it does not go unnoticed); a process on the GPU that
NVML does not list (some drivers in some containers list none) is invisible to this rule,
as it is to the idle rule. The service's trial children are the only CUDA users it starts.
"""

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from loguru import logger

from autofit.base.errors import AutofitError
from autofit.measure.claims import CLAIM_GLOB
from autofit.service.inventory import descendant_pids

GUARD_TICK_S = 0.25  # NVML is read this often for each GPU being tuned; the kill follows within 0.1 s
CLAIM_GRACE_S = 1.5  # a trial child's context creation, between its two lists of NVML's pids
_READ_FAILURES_S = 2.0  # unreadable process lists for this long stop the tune: we cannot see


class PidRule:
    """What the service has learnt about NVML's pids, shared by every guard: whether they
    are in our pid namespace (None until a trial child's claim shows it)."""

    def __init__(self):
        self.shared_namespace: bool | None = None

    def learn(self, claim: dict) -> None:
        if claim.get("nvml_pids"):
            shared = claim.get("pid") in claim["nvml_pids"]
            if shared != self.shared_namespace:
                logger.info("NVML lists {} pids{}", "this namespace's" if shared else "another pid namespace's",
                            "" if shared else " (a container): the service's own processes are known by "
                                              "what its trial children claim")
            self.shared_namespace = shared

    def base_pids(self) -> set[int]:
        """Ours without a claim: the service, and its process tree where NVML's pids are ours."""

        pids = {os.getpid()}
        if self.shared_namespace is not False:
            pids |= descendant_pids()
        return pids


class TrialGuard:
    """The watch over one tune's GPUs. `trial_started`/`trial_ended` are called by
    `autofit.measure.trial.measure` for each child it launches; `run` is the guard's own thread,
    which calls `stop(reason)` once when another job appears."""

    def __init__(self, inventory, gpus, stop: Callable[[str], None], *, rule: PidRule | None = None,
                 tick_s: float = GUARD_TICK_S):
        self.inventory, self.gpus, self._stop = inventory, tuple(gpus), stop
        self.rule = rule or PidRule()
        self.tick_s = tick_s
        self._trials: dict[int, Path] = {}  # pid of a running trial child -> its trial folder
        self._lock = threading.Lock()
        self._unreadable_since_s: float | None = None

    # --- called by measure() -------------------------------------------------------------

    def trial_started(self, pid: int, folder: Path) -> None:
        with self._lock:
            self._trials[pid] = Path(folder)

    def trial_ended(self, pid: int) -> None:
        with self._lock:
            self._trials.pop(pid, None)

    # --- the watch ------------------------------------------------------------------------

    def claims(self) -> list[dict]:
        """The notes of the running trial children (torchrun's ranks write one each)."""
        with self._lock:
            folders = list(self._trials.values())
        out = []
        for folder in folders:
            for path in folder.glob(CLAIM_GLOB):
                with contextlib.suppress(OSError, ValueError):  # the trial ended while we read
                    out.append(json.loads(path.read_text()))
        return out

    def own_pids(self, claims: list[dict]) -> set[int]:
        for claim in claims:
            self.rule.learn(claim)
        return self.rule.base_pids() | {pid for c in claims for pid in c.get("nvml_pids", ())}

    def check(self, now_unix_s: float | None = None) -> str | None:
        """Why the tune must stop now (another process on one of its GPUs), or None."""

        now_unix_s = time.time() if now_unix_s is None else now_unix_s
        claims = self.claims()
        own = self.own_pids(claims)
        foreign: dict[str, tuple[int, ...]] = {}
        try:
            for gpu in self.gpus:
                pids = self.inventory.activity(gpu, own).foreign_pids
                if pids:
                    foreign[gpu.slot] = pids
        except AutofitError as exc:
            # A passing NVML error is no reason to stop; being blind for long is.
            self._unreadable_since_s = self._unreadable_since_s or now_unix_s
            if now_unix_s - self._unreadable_since_s >= _READ_FAILURES_S:
                return f"cannot see the GPU's processes: {exc}"
            return None
        self._unreadable_since_s = None
        if not foreign:
            return None
        if any(c.get("phase") == "claiming" and now_unix_s - c.get("since_unix_s", 0) < CLAIM_GRACE_S
               for c in claims):
            return None  # our child is creating its context: its claim will tell
        ambiguous = sorted({pid for c in claims for pid in c.get("ambiguous", ())})
        why = (f"; pids {', '.join(map(str, ambiguous))} appeared while our trial child created its CUDA "
               f"context, and it cannot tell which is its own" if ambiguous else "")
        where = "; ".join(f"{slot} (pid {', '.join(map(str, pids))})" for slot, pids in foreign.items())
        return f"another process appeared on {where}{why}"

    def run(self, done: threading.Event) -> None:
        """Check every tick until `done`; stop the tune at the first foreign process."""
        while not done.wait(self.tick_s):
            try:
                reason = self.check()
            except Exception:  # a bug here must not leave the tune unwatched silently
                logger.exception("the GPU guard failed; stopping the tune")
                reason = "the GPU guard failed"
            if reason is not None:
                self._stop(reason)
                return
