"""The host as a budget: the pinned memory offloading may take (`--host-memory-budget`,
else the host's available memory as /proc/meminfo's MemAvailable reads it), parsed by the
same size parser as `--memory-budget`.

    host_budget_bytes(8 << 30, host_available_bytes())   # what offloaded configs may pin
    host_budget_bytes(None, host_available_bytes())      # the available memory less the reserve

A tune never takes the host down: the out-of-memory killer is not a result, it takes the tune
(and whatever else runs here) with it. So a config over this budget is refused before it runs
(`autofit.measure.host_fit.host_refusal`), and the budget keeps a reserve back.
"""

from autofit.base.errors import SpecError
from autofit.base.sizes import format_bytes
from autofit.device.probe import _meminfo_bytes

# Left to the system, the page cache and the tune's own processes: MemAvailable counts
# reclaimable cache as free, and a host pinned to its last page swaps or kills.
HOST_RESERVE_FRACTION = 0.1


def host_available_bytes() -> int:
    """The host memory a new allocation can take without swapping (MemAvailable)."""
    return _meminfo_bytes()[1]


def resident_bytes() -> int:
    """This process's resident set (VmRSS): a trial child holds at least as much (the same
    interpreter and autofit, torch besides)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def host_budget_bytes(requested_bytes: int | None, available_bytes: int, *,
                      what: str = "--host-memory-budget") -> int:
    """The pinned host bytes a config may keep: `requested_bytes` (`--host-memory-budget`, parsed
    by `autofit.device.budget.budget_for` against `available_bytes`) or, when None, the available
    memory; less HOST_RESERVE_FRACTION either way. One that cannot hold a trial process at all
    is refused."""
    floor_bytes = resident_bytes()
    if requested_bytes is not None and requested_bytes < floor_bytes:
        raise SpecError(f"{what}: {format_bytes(requested_bytes)} cannot hold even one trial process (this one "
                        f"holds {format_bytes(floor_bytes)} resident, a trial that and torch besides); give more, or "
                        f"leave it out to use the host's available memory ({format_bytes(available_bytes)})")
    return int((available_bytes if requested_bytes is None else requested_bytes) * (1.0 - HOST_RESERVE_FRACTION))
