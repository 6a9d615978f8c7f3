"""The choice among a profile's frontier points when a job starts: the fastest point whose
measured peak fits the memory available now. `autofit train --profile`, `Profile.apply`
and the exports all choose here.

The memory available is an explicit budget as given, else a GPU's memory left by other
processes (read through NVML) less the headroom, else (a CPU without a budget) nothing to
choose by: the winner runs.
"""

import sys
from typing import Any, Protocol, Self, TypeVar

from loguru import logger

from autofit.base.errors import NothingFitsError, ProfileError
from autofit.base.sizes import format_bytes
from autofit.config.spec import SearchSpec
from autofit.config.train_config import TrainConfig
from autofit.device.budget import Budget, budget_for
from autofit.device.probe import DeviceInfo, select_device


class Frontier(Protocol):
    """What the choice reads of a `Profile` (`autofit.profiles.profile` imports this module,
    so this one types a profile by what it reads)."""

    config: TrainConfig
    device: Any  # the profile's device record: its `name`

    @property
    def points(self) -> tuple: ...  # FrontierPoints (config, measured), smallest peak first; the winner last

    @property
    def file_name(self) -> str: ...

    def at(self, point) -> Self: ...


Profile = TypeVar("Profile", bound=Frontier)  # the profile type chosen from is the type handed back


def memory_available(info: DeviceInfo, budget: Budget, *, headroom: float) -> tuple[int | None, str]:
    """(bytes a job may use now, where that figure comes from), from `budget` as
    `budget_for(info, ..., headroom=headroom)` read it. None: no limit to choose by (a CPU
    without a budget), so the winner runs. An explicit budget is used as given
    (`requested_bytes`); a GPU's is its memory less what other processes hold now (NVML),
    less `headroom` (`usable_bytes`)."""
    if budget.requested_bytes is not None:
        return budget.requested_bytes, f"the memory budget of {format_bytes(budget.requested_bytes)}"
    if info.kind != "cuda":
        return None, "no memory budget given on the CPU"
    free = budget.usable_bytes
    return free, (f"{format_bytes(free)} free on {info.name} ({format_bytes(info.memory_used_by_others_bytes)} "
                  f"held by other processes, {headroom:.0%} headroom)")


def choose(profile: Profile, available_bytes: int | None, why: str, *, name: str | None = None,
           doing: str = "running") -> Profile:
    """`profile` running the fastest of its points whose measured peak fits `available_bytes`
    (None: the winner). Logs which and why (`doing`: "exporting" where nothing runs); raises
    NothingFitsError (exit 3) when none fits."""
    name = name or profile.file_name
    points = profile.points
    winner = points[-1]  # the frontier ends with the winner, whichever point `profile` runs now
    if available_bytes is None:
        logger.info("profile {}: {} the winner {} ({})", name, doing, winner.config.short(), why)
        return profile.at(winner)
    fitting = [p for p in points if p.measured.peak_memory_bytes <= available_bytes]
    if not fitting:
        smallest = min(points, key=lambda p: p.measured.peak_memory_bytes)
        raise NothingFitsError(
            f"profile {name}: none of its {len(points)} point(s) fits {why}: the smallest, "
            f"{smallest.config.short()}, peaked at {format_bytes(smallest.measured.peak_memory_bytes)}; "
            f"{format_bytes(available_bytes)} is available")
    point = max(fitting, key=lambda p: p.measured.samples_per_s)
    figures = (f"peak {format_bytes(point.measured.peak_memory_bytes)}, "
               f"{point.measured.samples_per_s:.4g} samples/s")
    if point is winner:
        logger.info("profile {}: {} the winner {} ({}): it fits {}", name, doing, point.config.short(), figures,
                    why)
    else:
        logger.warning("profile {}: {} frontier point {} of {}, {} ({}), not the winner {} (peak {}, {:.4g} "
                       "samples/s): the fastest point that fits {}", name, doing, points.index(point) + 1, len(points),
                       point.config.short(), figures, winner.config.short(),
                       format_bytes(winner.measured.peak_memory_bytes), winner.measured.samples_per_s, why)
    return profile.at(point)


def default_headroom() -> float:
    """The spec's default `search.memory_headroom`, for callers without a model.yaml."""
    return SearchSpec.__dataclass_fields__["memory_headroom"].default


def fit_now(profile: Profile, *, memory_budget: int | str | None = None, device=None,
            memory_headroom: float | None = None, name: str | None = None, export: bool = False) -> Profile:
    """`profile` at the fastest point that fits the memory available now on `device` (a
    `DeviceInfo`, GPU index, "cpu", a torch.device, or None: the first GPU, else the CPU),
    read through NVML; or within `memory_budget` (bytes, "24GiB", or a fraction of the
    device's memory) when given. An `export` may be made on another machine than the one
    that trains (a login node): there this GPU's free memory only chooses when it is the
    profile's kind of GPU."""
    torch = sys.modules.get("torch")  # not imported: `device` is no torch.device (the tune's parent has none)
    if torch is not None and isinstance(device, torch.device):
        device = "cpu" if device.type == "cpu" else (device.index or 0)
    info = device if isinstance(device, DeviceInfo) else select_device(device)
    headroom = default_headroom() if memory_headroom is None else memory_headroom
    if not 0.0 <= headroom < 0.5:
        raise ProfileError(f"memory_headroom: a fraction in [0, 0.5), got {headroom!r}")
    # A budget above this device is allowed: a profile tuned for a larger card is looked up here.
    budget = budget_for(info, memory_budget, headroom=headroom, what="memory_budget", above_total=True,
                        error=ProfileError)
    if budget.requested_bytes is None and profile.config.world_size > 1:
        # Each rank reads its own GPU; ranks that chose apart would not train one job.
        available, why = None, (f"a profile for {profile.config.world_size} ranks: only a memory budget (the "
                                f"same on every rank) chooses a smaller point")
    elif export and budget.requested_bytes is None and info.name != profile.device.name:
        available, why = None, (f"exporting for {profile.device.name} from {info.name}: memory_budget "
                                f"chooses a smaller point")
    else:
        available, why = memory_available(info, budget, headroom=headroom)
    return choose(profile, available, why, name=name, doing="exporting" if export else "running")
