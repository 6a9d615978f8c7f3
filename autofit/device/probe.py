"""Device inventory through NVML, with the CPU as a device of its own.

    autofit probe            # a table
    autofit probe --json     # {"devices": [...]}

The parent process never initialises CUDA: a CUDA context costs hundreds of MiB on every
GPU it touches and would be inherited by nothing but the tuner itself. NVML reads the
same facts (names, memory, capability, other processes) without one. Only trial children,
which die after each measurement, create CUDA contexts.
"""

import dataclasses
import functools
import importlib.metadata
import os
import platform
import re
from dataclasses import dataclass

from autofit.base.errors import DeviceError
from autofit.base.sizes import format_bytes
from autofit.device.support import unsupported_reason


@functools.cache
def torch_version() -> str:
    """The installed torch's version, read from its package metadata: probing and reading
    profiles never import torch (seconds) just for its version string."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        import torch  # a torch without metadata (a source build on sys.path)

        return str(torch.__version__)


_TORCH_VERSION = torch_version()
MAX_DEVICE_NAME_CHARS = 96  # NVML_DEVICE_NAME_V2_BUFFER_SIZE
EMULATED_SUFFIX = "-emulated"  # ends an inventory-emulated card's fingerprint and slug


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceInfo:
    """What a device offers a training job, read without creating a CUDA context."""

    index: int | None  # CUDA ordinal the trial child uses; None for the CPU
    kind: str  # "cuda" | "cpu" (where trials run)
    name: str  # as NVML reports it, e.g. "NVIDIA H100 80GB HBM3"
    uuid: str | None
    memory_total_bytes: int
    memory_free_bytes: int
    memory_used_bytes: int
    memory_used_by_others_bytes: int  # used, but not by us or our trial children: never usable by a trial
    compute_capability: tuple[int, int] | None
    mig_mode: str | None  # "enabled" | "disabled" | None (not a MIG-capable GPU)
    driver_version: str | None
    cuda_version: str | None  # the highest CUDA version the driver supports
    torch_version: str
    supports: dict  # {"bf16": bool, "tf32": bool, "fp8": bool, "fp16": bool}
    fingerprint: str  # equal for identical cards, different otherwise: the profile store key
    slug: str  # short file-name-safe name
    emulated: bool = False  # a GPU kind whose trials run on the CPU (inventory emulation)
    emulated_budget_bytes: int | None = None  # a smaller card emulated on this one (--memory-budget)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["compute_capability"] = (None if self.compute_capability is None
                                     else f"{self.compute_capability[0]}.{self.compute_capability[1]}")
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceInfo":
        d = dict(d)
        cc = d.get("compute_capability")
        if isinstance(cc, str):
            major, minor = cc.split(".")
            d["compute_capability"] = (int(major), int(minor))
        elif cc is not None:
            d["compute_capability"] = tuple(cc)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def slugify(text: str) -> str:
    """`NVIDIA H100 80GB HBM3` -> `nvidia-h100-80gb-hbm3`."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def fingerprint(*, name: str, memory_total_bytes: int, mig_profile: str | None, driver_version: str | None,
                torch_version: str, kind: str = "cuda") -> str:
    """Identity of a device kind for the profile store.

    Memory is rounded to GiB because two cards of one model report totals that differ by a
    few MiB of reserved memory. Only the driver's major version counts: patch releases do
    not change kernels' speed, a major release can. Torch's major.minor likewise.
    """
    memory_gib = round(memory_total_bytes / 2**30)
    parts = [slugify(name), f"{memory_gib}gib"]
    if kind == "cuda":
        parts.append(slugify(mig_profile) if mig_profile else "nomig")
    if driver_version:
        parts.append(f"drv{driver_version.split('.')[0]}")
    torch_mm = ".".join(torch_version.split("+")[0].split(".")[:2])
    parts.append(f"torch{torch_mm}")
    return "-".join(parts)


def _supports(kind: str, compute_capability: tuple[int, int] | None) -> dict:
    """What the precisions need, from the same rules `precision.py` applies."""
    def ok(precision: str) -> bool:
        return unsupported_reason(precision, device_kind=kind, compute_capability=compute_capability) is None
    fp8 = kind == "cuda" and compute_capability is not None and compute_capability >= (8, 9)
    return {"bf16": ok("bf16-mixed"), "tf32": ok("tf32"), "fp8": fp8, "fp16": ok("16-mixed")}


# ---- CPU ---------------------------------------------------------------------------------------


def _meminfo_bytes() -> tuple[int, int]:
    """(total, available) host RAM; MemAvailable counts reclaimable page cache as free."""
    values = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                values[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    if "MemTotal" in values:
        return values["MemTotal"], values.get("MemAvailable", values.get("MemFree", 0))
    pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return pages * page_size, os.sysconf("SC_AVPHYS_PAGES") * page_size


def _cpuinfo_value(key: str, cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The first processor's `key` line in `cpuinfo`, after its colon; None where there is none
    or the file cannot be read."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(key):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return None


def _cpu_name() -> str:
    return _cpuinfo_value("model name") or platform.processor() or platform.machine() or "cpu"


# The x86 flags of units that multiply 16-bit floats (oneDNN's fast bf16 and fp16 paths), by
# dtype; without one, a 16-bit step runs several times slower than fp32's (torch converts, or
# on AVX-512 without `avx512_bf16` emulates: about 3-4x, and counted as none here).
SIXTEEN_BIT_CPU_FLAGS = {"bf16": frozenset({"avx512_bf16", "amx_bf16"}),
                         "fp16": frozenset({"avx512_fp16", "amx_fp16"})}


def cpu_16_bit_units(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The 16-bit dtypes ("bf16", "fp16") this x86 CPU has a multiply unit for, by the first
    processor's flags (`SIXTEEN_BIT_CPU_FLAGS`); None where there is no x86 `flags` line (an Arm
    CPU lists its `bf16` under `Features`: not judged here) or the file cannot be read."""
    flags = _cpuinfo_value("flags", cpuinfo)
    if flags is None:
        return None
    return frozenset(dtype for dtype, names in SIXTEEN_BIT_CPU_FLAGS.items() if names & set(flags.split()))


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_device() -> DeviceInfo:
    total, available = _meminfo_bytes()
    cores = _cpu_count()
    name = f"{_cpu_name()} ({cores} cores)"
    return DeviceInfo(
        index=None, kind="cpu", name=name, uuid=None,
        memory_total_bytes=total, memory_free_bytes=available, memory_used_bytes=total - available,
        memory_used_by_others_bytes=total - available, compute_capability=None, mig_mode=None,
        driver_version=None, cuda_version=None, torch_version=_TORCH_VERSION,
        supports=_supports("cpu", None),
        # Core count is part of a CPU's identity: throughput scales with it.
        fingerprint=fingerprint(name=f"cpu-{_cpu_name()}-{cores}c", memory_total_bytes=total, mig_profile=None,
                                driver_version=None, torch_version=_TORCH_VERSION, kind="cpu"),
        slug="cpu",
    )


# ---- NVML --------------------------------------------------------------------------------------


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _visible_nvml_indices(count: int, uuids: list[str]) -> list[int]:
    """NVML indices in the order CUDA numbers them for a child.

    Trial children run with CUDA_DEVICE_ORDER=PCI_BUS_ID, which is NVML's order; a
    CUDA_VISIBLE_DEVICES list (indices or UUID prefixes) then selects and renumbers.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    chosen = []
    for item in (s.strip() for s in visible.split(",")):
        if not item:
            break
        if item.isdigit():
            index = int(item)
        else:
            index = next((i for i, u in enumerate(uuids) if u.startswith(item)), None)
        # CUDA stops at the first invalid entry; so does this.
        if index is None or index >= count or index in chosen:
            break
        chosen.append(index)
    return chosen


def _parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])  # the name in () may hold spaces
    except (OSError, ValueError, IndexError):
        return None


def _others_bytes(nvml, handle, memory_used_bytes: int) -> int:
    """Used memory that is not ours: everything but this process and its trial children.

    Counting from "used" rather than summing other processes' entries keeps the memory the
    driver reserves, and processes NVML cannot attribute (inside a container), on the
    others' side, where they belong: none of it is usable by a trial."""
    try:
        processes = list(nvml.nvmlDeviceGetComputeRunningProcesses(handle))
        processes += list(nvml.nvmlDeviceGetGraphicsRunningProcesses(handle))
    except nvml.NVMLError:
        return memory_used_bytes
    me, ours, seen = os.getpid(), 0, set()
    for p in processes:
        if p.pid in seen or p.usedGpuMemory is None:
            continue
        seen.add(p.pid)
        if p.pid == me or _parent_pid(p.pid) == me:
            ours += p.usedGpuMemory
    return max(0, memory_used_bytes - ours)


def _mig(nvml, handle) -> tuple[str | None, str | None, object]:
    """(mig mode, MIG profile of the first instance, the handle whose memory a process gets)."""
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError:
        return None, None, handle
    if current != nvml.NVML_DEVICE_MIG_ENABLE:
        return "disabled", None, handle
    # A process on a MIG GPU sees one instance; its size is what a job can use.
    try:
        instance = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
        profile = _text(nvml.nvmlDeviceGetName(instance)).rsplit(" ", 1)[-1]  # "... MIG 1g.10gb"
        return "enabled", profile, instance
    except nvml.NVMLError:
        return "enabled", "mig", handle


def _nvml_devices() -> list[DeviceInfo]:
    try:
        import pynvml as nvml
    except ImportError:
        return []
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:  # no driver, no GPU: the CPU is the device
        return []
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        try:
            cuda_int = nvml.nvmlSystemGetCudaDriverVersion()
            cuda_version = f"{cuda_int // 1000}.{(cuda_int % 1000) // 10}"
        except nvml.NVMLError:
            cuda_version = None
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
        devices = []
        for cuda_index, nvml_index in enumerate(_visible_nvml_indices(len(handles), uuids)):
            devices.append(_nvml_device(nvml, handles[nvml_index], cuda_index, uuids[nvml_index], driver,
                                        cuda_version))
        return devices
    finally:
        nvml.nvmlShutdown()


def _nvml_device(nvml, handle, cuda_index: int, uuid: str, driver: str, cuda_version: str | None) -> DeviceInfo:
    name = _text(nvml.nvmlDeviceGetName(handle))
    mig_mode, mig_profile, memory_handle = _mig(nvml, handle)
    memory = nvml.nvmlDeviceGetMemoryInfo(memory_handle)
    try:
        capability = tuple(nvml.nvmlDeviceGetCudaComputeCapability(handle))
    except nvml.NVMLError:
        capability = None
    others = _others_bytes(nvml, handle, memory.used)
    return DeviceInfo(
        index=cuda_index, kind="cuda", name=name, uuid=uuid,
        memory_total_bytes=memory.total, memory_free_bytes=memory.free, memory_used_bytes=memory.used,
        memory_used_by_others_bytes=others, compute_capability=capability, mig_mode=mig_mode,
        driver_version=driver, cuda_version=cuda_version, torch_version=_TORCH_VERSION,
        supports=_supports("cuda", capability),
        fingerprint=fingerprint(name=name, memory_total_bytes=memory.total, mig_profile=mig_profile,
                                driver_version=driver, torch_version=_TORCH_VERSION),
        slug=slugify(name) if mig_profile is None else f"{slugify(name)}-{slugify(mig_profile)}",
    )


# ---- public ------------------------------------------------------------------------------------


def probe_devices() -> list[DeviceInfo]:
    """Every GPU NVML sees (in CUDA's numbering), then the CPU, last."""
    return [*_nvml_devices(), cpu_device()]


def select_device(selector: str | int | None) -> DeviceInfo:
    """None: the first GPU, else the CPU; "cpu"; a CUDA index ("0", 0, "cuda:0")."""
    devices = probe_devices()
    gpus = [d for d in devices if d.kind == "cuda"]
    if selector is None:
        return gpus[0] if gpus else devices[-1]
    text = str(selector).strip().lower()
    if text == "cpu":
        return devices[-1]
    index_text = text.removeprefix("cuda:").removeprefix("cuda")
    available = ", ".join([str(d.index) for d in gpus] + ["cpu"])
    if not index_text.isdigit():
        raise DeviceError(f"--device: expected a GPU index or cpu, got {selector!r}; available: {available}")
    index = int(index_text)
    for d in gpus:
        if d.index == index:
            return d
    found = f"{len(gpus)} GPU(s)" if gpus else "no GPU (no NVIDIA driver or device found)"
    raise DeviceError(f"--device: there is no GPU {index}: this machine has {found}; available: {available}")


def emulated_device(name: str, memory_total_bytes: int, compute_capability: tuple[int, int] | None = None
                    ) -> DeviceInfo:
    """A GPU kind that is not here, whose trials run on the CPU under its memory size.

    `kind` is "cpu" because that is where its trials run (so precisions are judged as the
    CPU runs them); name, memory and fingerprint are the emulated card's, with an
    `-emulated` suffix so its profiles never pass for ones measured on the real card.
    """
    if memory_total_bytes <= 0:
        raise DeviceError(f"emulated device {name!r}: memory must be positive, got {memory_total_bytes}")
    if not 0 < len(name) <= MAX_DEVICE_NAME_CHARS:  # as NVML's; the name makes profile file names
        raise DeviceError(f"emulated device name: 1 to {MAX_DEVICE_NAME_CHARS} characters, got {len(name)}")
    return DeviceInfo(
        index=None, kind="cpu", name=name, uuid=None,
        memory_total_bytes=memory_total_bytes, memory_free_bytes=memory_total_bytes, memory_used_bytes=0,
        memory_used_by_others_bytes=0, compute_capability=compute_capability, mig_mode=None,
        driver_version=None, cuda_version=None, torch_version=_TORCH_VERSION,
        supports=_supports("cpu", None),
        fingerprint=fingerprint(name=name, memory_total_bytes=memory_total_bytes, mig_profile=None,
                                driver_version=None, torch_version=_TORCH_VERSION) + EMULATED_SUFFIX,
        slug=slugify(name) + EMULATED_SUFFIX, emulated=True,
    )


def with_memory_budget(device: DeviceInfo, budget_bytes: int) -> DeviceInfo:
    """The smaller card `--memory-budget` emulates on `device`. A profile tuned under it is
    that card's, not this one's: its own fingerprint and file name (a real device's end in
    its torch version, never in `-budget-…`), so it never stands in for the full device."""
    tag = f"-budget-{format_bytes(budget_bytes).replace(' ', '').replace('.', '_').lower()}"
    return dataclasses.replace(device, fingerprint=device.fingerprint + tag, slug=device.slug + tag,
                               emulated_budget_bytes=budget_bytes)


def usable_budget_bytes(device: DeviceInfo, *, headroom: float, memory_budget: int | None = None,
                        overhead_bytes: int = 0) -> int:
    """Bytes a training job may really use: total (or the emulated `memory_budget`, if
    smaller) minus other processes' memory, minus the CUDA context and library workspaces
    (`overhead_bytes`, measured by a trial child), minus `headroom` of what is left."""
    assert 0.0 <= headroom < 1.0, headroom
    available = device.memory_total_bytes - device.memory_used_by_others_bytes
    if memory_budget is not None:
        available = min(available, memory_budget)
    return max(0, int((available - overhead_bytes) * (1.0 - headroom)))
