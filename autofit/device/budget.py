"""The budget of a run as one value: parsed once where the user gives it (the CLI,
`autofit.tune()`, the service, a profile lookup) and handed on whole.

    budget = budget_for(device, "24GiB", headroom=0.05, time_s=600)
    budget.usable_bytes    # what a job may use: the request (or the device) less others, less headroom
    budget.emulated        # True: a smaller card is emulated here, with its own study and profile
"""

import dataclasses
from dataclasses import dataclass

from autofit.base.errors import SpecError
from autofit.base.sizes import parse_budget
from autofit.device.host import host_available_bytes, host_budget_bytes
from autofit.device.probe import DeviceInfo, usable_budget_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class Budget:
    """What a run may spend: memory, and time when there is a limit."""

    usable_bytes: int  # what a training job may really use (per rank)
    requested_bytes: int | None = None  # --memory-budget as given, in bytes; None: the whole device
    time_s: float | None = None  # a tune's search time (--timeout); None: until its trials are done
    # The whole tune's wall time (--time-budget): probe, estimates, trials, validation,
    # writing; None: the spec's search.time_budget.
    tune_time_s: float | None = None
    # The pinned host bytes offloaded configs may keep (`autofit.device.host`); None: not checked.
    host_bytes: int | None = None

    @property
    def emulated(self) -> bool:
        """A smaller card emulated on this one (`--memory-budget`): the trial child caps its
        allocator there, and the study and profile are that card's."""
        return self.requested_bytes is not None

    def to_dict(self) -> dict:
        """In JSON types, as it crosses to a trial child (`measure.messages.TrialRequest`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "Budget":
        return cls(**raw)


def budget_for(device: DeviceInfo, memory_budget: str | int | None, *, headroom: float, time_s: float | None = None,
               tune_time_s: float | None = None, what: str = "--memory-budget", above_total: bool = False,
               error: type = SpecError, host_memory_budget: str | int | None = None) -> Budget:
    """The one edge parser: `memory_budget` (`24GiB`, `0.8` of the device, bytes, or None)
    on `device`, less other processes' memory and `headroom`. A budget above the device is
    refused (emulating a larger card measures nothing) unless `above_total` (a profile
    lookup: one tuned for a larger card is chosen from here); errors are `error`s naming `what`."""
    requested = parse_budget(None if memory_budget is None else str(memory_budget),
                             total_bytes=device.memory_total_bytes, device_name=device.name, what=what,
                             above_total=above_total, error=error)
    return Budget(usable_bytes=usable_budget_bytes(device, headroom=headroom, memory_budget=requested),
                  requested_bytes=requested, time_s=time_s,
                  tune_time_s=tune_time_s, host_bytes=_host_bytes(device, host_memory_budget, error))


def _host_bytes(device: DeviceInfo, host_memory_budget: str | int | None, error: type) -> int | None:
    """The host budget (`autofit.device.host`): read where offloading acts (CUDA) or where one
    is asked for; None elsewhere (on the CPU the card's budget is the host's)."""
    if host_memory_budget is None and device.kind != "cuda":
        return None
    available_bytes = host_available_bytes()
    requested = parse_budget(None if host_memory_budget is None else str(host_memory_budget),
                             total_bytes=available_bytes, device_name="the host's available memory",
                             what="--host-memory-budget", error=error)
    return host_budget_bytes(requested, available_bytes)
