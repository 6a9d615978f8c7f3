"""Which GPUs the service sees, and whether each is free to tune on.

Two sources with the same two methods, `gpus()` and `activity(gpu, own_pids)`:

- `NvmlInventory`: the host's GPUs through NVML (no CUDA context), other processes'
  compute work on each, and its utilisation.
- `FileInventory`: emulation. A YAML/JSON file `{"gpus": [{"name": ..., "memory_total_bytes":
  ..., "compute_capability": "9.0", "processes": [4242]}]}` lists GPU kinds that are not
  here; their trials run on the CPU under each card's memory budget, so the whole service
  can be exercised on a machine without a GPU. The GPUs are re-read every poll and each
  card's `processes` (the compute processes NVML would list: other jobs) whenever its
  activity is read, which for a card being tuned is every guard tick. An emulated card has
  no utilisation: it is free once it has no processes for the idle period.

Which of a card's processes are the service's own is not decided here: `own_pids` comes
from `autofit.service.guard`, which knows what the service launched.
"""

import os
from dataclasses import dataclass
from pathlib import Path

from autofit.base.documents import read_yaml
from autofit.base.errors import DeviceError
from autofit.base.sizes import parse_size
from autofit.device.probe import DeviceInfo, emulated_device, MAX_DEVICE_NAME_CHARS, probe_devices
from autofit.service.config import IdleRule


@dataclass(frozen=True, kw_only=True, slots=True)
class Gpu:
    slot: str  # "gpu0": its place in the inventory, as status lines name it
    device: DeviceInfo

    @property
    def label(self) -> str:
        """`gpu0 H100 80GB HBM3`: short enough for a systemd STATUS line."""
        return f"{self.slot} {self.device.name.removeprefix('NVIDIA ')}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Activity:
    foreign_pids: tuple[int, ...] = ()  # compute processes on the GPU that are not ours
    utilization_percent: float | None = None  # None: NVML cannot say (MIG slices, some drivers)


class NvmlInventory:
    emulated = False
    description = "NVML"

    def gpus(self) -> list[Gpu]:
        return [Gpu(slot=f"gpu{d.index}", device=d) for d in probe_devices() if d.kind == "cuda"]

    def activity(self, gpu: Gpu, own_pids: set[int]) -> Activity:
        import pynvml as nvml

        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise DeviceError(f"NVML: {exc}") from None
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(gpu.device.uuid)
            try:
                processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except nvml.NVMLError:
                processes = []
            try:
                utilization = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except nvml.NVMLError:
                utilization = None
        except nvml.NVMLError as exc:
            raise DeviceError(f"NVML, {gpu.label}: {exc}") from None
        finally:
            nvml.nvmlShutdown()
        # Our own trial children show up as compute processes too; they are not a reason to stop.
        foreign = tuple(sorted({p.pid for p in processes} - own_pids - {os.getpid()}))
        return Activity(foreign_pids=foreign, utilization_percent=utilization)


class FileInventory:
    emulated = True

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @property
    def description(self) -> str:
        return f"{self.path} (emulated GPUs: trials run on the CPU)"

    def gpus(self) -> list[Gpu]:
        return [Gpu(slot=f"gpu{i}", device=self._device(i, entry)) for i, entry in enumerate(self._entries())]

    def _entries(self) -> list:
        try:
            raw = read_yaml(self.path, error=DeviceError)  # YAML reads JSON too; bounded
        except DeviceError as exc:
            raise DeviceError(f"inventory {exc}") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("gpus"), list) or set(raw) != {"gpus"}:
            raise DeviceError(f"inventory {self.path}: expected {{\"gpus\": [{{\"name\": ..., "
                              f"\"memory_total_bytes\": ...}}, ...]}}")
        return raw["gpus"]

    def _device(self, i: int, entry) -> DeviceInfo:
        where = f"inventory {self.path}: gpus[{i}]"
        if not isinstance(entry, dict):
            raise DeviceError(f"{where}: expected a mapping, got {entry!r}")
        unknown = sorted(set(entry) - {"name", "memory_total_bytes", "compute_capability", "processes"})
        if unknown:
            raise DeviceError(f"{where}.{unknown[0]}: unknown key; allowed: name, memory_total_bytes, "
                              f"compute_capability, processes")
        name = entry.get("name")
        if not isinstance(name, str) or not name.strip():
            raise DeviceError(f"{where}.name: must be a GPU name such as \"NVIDIA H100 80GB HBM3\", got {name!r}")
        if len(name) > MAX_DEVICE_NAME_CHARS:  # it makes profile file names
            raise DeviceError(f"{where}.name: at most {MAX_DEVICE_NAME_CHARS} characters, as NVML's, got {len(name)}")
        try:
            memory_total_bytes = parse_size(entry.get("memory_total_bytes"), what=f"{where}.memory_total_bytes")
        except ValueError as exc:
            raise DeviceError(str(exc)) from None
        _processes(entry, where)
        return emulated_device(name, memory_total_bytes, _capability(entry.get("compute_capability"), where))

    def activity(self, gpu: Gpu, own_pids: set[int]) -> Activity:
        entries = self._entries()
        index = int(gpu.slot.removeprefix("gpu"))
        entry = entries[index] if index < len(entries) and isinstance(entries[index], dict) else {}
        pids = _processes(entry, f"inventory {self.path}: gpus[{index}]")
        return Activity(foreign_pids=tuple(sorted(pids - own_pids)), utilization_percent=0.0)


def _processes(entry: dict, where: str) -> set[int]:
    pids = entry.get("processes", [])
    if not isinstance(pids, list) or not all(isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in pids):
        raise DeviceError(f"{where}.processes: a list of pids (the card's other compute processes), got {pids!r}")
    return set(pids)


def _capability(value, where: str) -> tuple[int, int] | None:
    if value is None:
        return None
    parts = value.split(".") if isinstance(value, str) else value
    if (isinstance(parts, (list, tuple)) and len(parts) == 2
            and all(isinstance(p, int) or (isinstance(p, str) and p.isdigit()) for p in parts)):
        return int(parts[0]), int(parts[1])
    raise DeviceError(f"{where}.compute_capability: expected \"major.minor\" such as \"9.0\", got {value!r}")


def descendant_pids(root_pid: int | None = None) -> set[int]:
    """Every process below `root_pid` (default: us), from /proc: the trial children and
    whatever they started. Trial children run in their own sessions, so the tree is the
    only link back to us."""
    root_pid = os.getpid() if root_pid is None else root_pid
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:  # exited while we looked
            continue
        # The command name is in parentheses and may itself contain ") "; fields after the
        # last ')' are: state, ppid, ...
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root_pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


class IdleTracker:
    """How long each GPU has been free by the idle rule; a busy moment restarts the clock."""

    def __init__(self):
        self._free_since_s: dict[str, float] = {}

    def check(self, gpu: Gpu, activity: Activity, rule: IdleRule, now_s: float) -> str | None:
        """None when `gpu` may be tuned on now, else why not."""
        busy = None
        if activity.foreign_pids:
            busy = f"in use by pid {', '.join(map(str, activity.foreign_pids))}"
        elif activity.utilization_percent is not None and activity.utilization_percent > rule.max_utilization:
            busy = f"utilisation {activity.utilization_percent:.0f}% > {rule.max_utilization:g}%"
        if busy is not None:
            self._free_since_s.pop(gpu.slot, None)
            return busy
        free_s = now_s - self._free_since_s.setdefault(gpu.slot, now_s)
        if free_s < rule.min_idle_s:
            return f"idle for {free_s:.0f} of {rule.min_idle_s:g} s"
        return None

    def reset(self, gpu: Gpu) -> None:
        self._free_since_s.pop(gpu.slot, None)
