"""Device inventory: the CPU always, GPUs through NVML (faked here with fabricated facts)."""

import json
import os
import sys
import types

import pytest

from autofit.device import probe
from autofit.device.probe import (
    DeviceInfo,
    emulated_device,
    fingerprint,
    probe_devices,
    select_device,
    usable_budget_bytes,
)
from autofit.base.errors import DeviceError
from conftest import run_cli

GiB = 2**30
CHILD_PID = 987654  # a fabricated trial child of this process
H100 = dict(name="NVIDIA H100 80GB HBM3", memory_total_bytes=85520809984, mig_profile=None,
            driver_version="580.159.04", torch_version="2.11.0+cu130")


def test_cli_probe_json_lists_the_cpu():
    result = run_cli("probe", "--json")
    assert result.returncode == 0, result.stderr
    devices = json.loads(result.stdout)["devices"]
    cpu = devices[-1]
    assert cpu["kind"] == "cpu" and cpu["index"] is None
    assert cpu["memory_total_bytes"] >= cpu["memory_free_bytes"] > 0
    for key in ("index", "kind", "name", "memory_total_bytes", "memory_free_bytes", "fingerprint"):
        assert all(key in d for d in devices)
    assert DeviceInfo.from_dict(cpu).to_dict() == cpu


def test_cli_probe_table():
    result = run_cli("probe")
    assert result.returncode == 0, result.stderr
    assert "fingerprint" in result.stdout and "cpu" in result.stdout


def test_fingerprint_is_stable_across_calls():
    assert [d.fingerprint for d in probe_devices()] == [d.fingerprint for d in probe_devices()]


def test_fingerprint_same_for_identical_cards_different_otherwise():
    base = fingerprint(**H100)
    assert base == "nvidia-h100-80gb-hbm3-80gib-nomig-drv580-torch2.11"
    # Same card kind: a few MiB of reserved memory, a driver patch release, a torch build tag.
    assert fingerprint(**H100 | {"memory_total_bytes": H100["memory_total_bytes"] - 50 * 2**20}) == base
    assert fingerprint(**H100 | {"driver_version": "580.65.06"}) == base
    assert fingerprint(**H100 | {"torch_version": "2.11.1+cu128"}) == base
    different = [
        H100 | {"name": "NVIDIA H100 PCIe"},
        H100 | {"memory_total_bytes": 94 * GiB},
        H100 | {"mig_profile": "3g.40gb"},
        H100 | {"driver_version": "570.86.15"},
        H100 | {"torch_version": "2.10.0"},
    ]
    prints = {fingerprint(**facts) for facts in different}
    assert len(prints) == len(different) and base not in prints


# ---- a fabricated NVML --------------------------------------------------------------------


class _NVMLError(Exception):
    pass


def _fake_nvml(gpus: list[dict]) -> types.ModuleType:
    """A pynvml stand-in serving `gpus` (dicts of facts); handles are the dicts themselves."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = _NVMLError
    nvml.NVML_DEVICE_MIG_ENABLE = 1
    nvml.nvmlInit = lambda: None
    nvml.nvmlShutdown = lambda: None
    nvml.nvmlSystemGetDriverVersion = lambda: "580.159.04"
    nvml.nvmlSystemGetCudaDriverVersion = lambda: 13000
    nvml.nvmlDeviceGetCount = lambda: len(gpus)
    nvml.nvmlDeviceGetHandleByIndex = lambda i: gpus[i]
    nvml.nvmlDeviceGetUUID = lambda h: h["uuid"]
    nvml.nvmlDeviceGetName = lambda h: h["name"].encode()  # older pynvml returns bytes
    nvml.nvmlDeviceGetCudaComputeCapability = lambda h: h["cc"]

    def mig_mode(h):
        if "mig" not in h:
            raise _NVMLError("not supported")
        return (1, 1) if h["mig"] else (0, 0)

    nvml.nvmlDeviceGetMigMode = mig_mode
    nvml.nvmlDeviceGetMigDeviceHandleByIndex = lambda h, i: {**h, "name": h["name"] + " MIG 3g.40gb",
                                                             "total": h["total"] // 2, "used": 0}
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=h["total"], used=h["used"],
                                                                   free=h["total"] - h["used"])
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda h: [types.SimpleNamespace(pid=pid, usedGpuMemory=b)
                                                           for pid, b in h.get("procs", [])]
    nvml.nvmlDeviceGetGraphicsRunningProcesses = lambda h: []
    return nvml


def _gpu(uuid: str, name: str = "NVIDIA H100 80GB HBM3", **facts) -> dict:
    return {"uuid": uuid, "name": name, "cc": (9, 0), "total": 80 * GiB, "used": 1 * GiB, "mig": False} | facts


@pytest.fixture
def fake_gpus(monkeypatch):
    def install(gpus, visible=None):
        monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(gpus))
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        return probe_devices()
    return install


def test_nvml_gpus_then_the_cpu(fake_gpus, monkeypatch):
    monkeypatch.setattr(probe, "_parent_pid", lambda pid: os.getpid() if pid == CHILD_PID else 1)
    devices = fake_gpus([
        # 5 GiB used: 1 GiB by one of our trial children, the rest by others and the driver.
        _gpu("GPU-aaaa", procs=[(4242, 3 * GiB), (CHILD_PID, 1 * GiB)], used=5 * GiB),
        _gpu("GPU-bbbb"),
        _gpu("GPU-cccc", name="NVIDIA A100-SXM4-80GB", cc=(8, 0), mig=True),
        _gpu("GPU-dddd", name="Tesla V100-SXM2-16GB", cc=(7, 0), total=16 * GiB),
    ])
    h0, h1, a100, v100, cpu = devices
    assert [d.kind for d in devices] == ["cuda"] * 4 + ["cpu"]
    assert [d.index for d in devices] == [0, 1, 2, 3, None]
    assert h0.fingerprint == h1.fingerprint != a100.fingerprint
    torch_mm = ".".join(probe._TORCH_VERSION.split(".")[:2])
    assert h0.fingerprint == f"nvidia-h100-80gb-hbm3-80gib-nomig-drv580-torch{torch_mm}"
    assert h0.memory_used_by_others_bytes == 4 * GiB and h0.memory_free_bytes == 75 * GiB
    assert h1.memory_used_by_others_bytes == 1 * GiB  # no process entries: the driver's share
    assert h0.cuda_version == "13.0" and h0.compute_capability == (9, 0)
    assert h0.supports == {"bf16": True, "tf32": True, "fp8": True, "fp16": True}
    assert a100.mig_mode == "enabled" and a100.memory_total_bytes == 40 * GiB and "3g-40gb" in a100.fingerprint
    assert a100.supports["bf16"] and not a100.supports["fp8"]
    assert v100.mig_mode == "disabled" and not v100.supports["bf16"] and not v100.supports["tf32"]
    assert h0.slug == "nvidia-h100-80gb-hbm3"
    assert DeviceInfo.from_dict(json.loads(json.dumps(a100.to_dict()))) == a100
    assert select_device(None) == h0 and select_device("1") == h1 and select_device("cuda:3") == v100


def test_cuda_visible_devices_renumbers_like_cuda(fake_gpus):
    devices = fake_gpus([_gpu("GPU-aaaa"), _gpu("GPU-bbbb"), _gpu("GPU-cccc")], visible="2,GPU-bb")
    assert [(d.index, d.uuid) for d in devices[:-1]] == [(0, "GPU-cccc"), (1, "GPU-bbbb")]
    assert [d.kind for d in fake_gpus([_gpu("GPU-aaaa")], visible="")] == ["cpu"]


def test_no_nvml_means_the_cpu_alone(monkeypatch):
    nvml = _fake_nvml([])

    def no_driver():
        raise _NVMLError("NVML Shared Library Not Found")

    nvml.nvmlInit = no_driver
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert [d.kind for d in probe_devices()] == ["cpu"]
    assert select_device(None).kind == "cpu"


def test_select_device_errors_list_what_exists(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([_gpu("GPU-aaaa")]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert select_device("cpu").kind == "cpu" and select_device(0).index == 0
    with pytest.raises(DeviceError, match=r"no GPU 3: this machine has 1 GPU\(s\); available: 0, cpu"):
        select_device("3")
    with pytest.raises(DeviceError, match="expected a GPU index or cpu, got 'tpu'"):
        select_device("tpu")
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([]))
    with pytest.raises(DeviceError, match="no GPU"):
        select_device(0)


def test_usable_budget():
    gpu = emulated_device("NVIDIA L4", 24 * GiB)
    gpu = DeviceInfo.from_dict(gpu.to_dict() | {"memory_used_by_others_bytes": 4 * GiB})
    assert usable_budget_bytes(gpu, headroom=0.0) == 20 * GiB
    assert usable_budget_bytes(gpu, headroom=0.5, overhead_bytes=2 * GiB) == 9 * GiB
    assert usable_budget_bytes(gpu, headroom=0.0, memory_budget=8 * GiB, overhead_bytes=1 * GiB) == 7 * GiB
    assert usable_budget_bytes(gpu, headroom=0.0, memory_budget=64 * GiB) == 20 * GiB  # never more than is free


def test_emulated_device_runs_on_the_cpu_under_its_own_identity():
    l4 = emulated_device("NVIDIA L4", 24 * GiB, compute_capability=(8, 9))
    assert l4.kind == "cpu" and l4.emulated and l4.slug == "nvidia-l4-emulated"  # never a real L4's file name
    assert l4.fingerprint.endswith("-emulated") and l4.fingerprint != emulated_device("NVIDIA L4", 48 * GiB).fingerprint
    assert l4.memory_total_bytes == l4.memory_free_bytes == 24 * GiB
    with pytest.raises(DeviceError):
        emulated_device("broken", 0)


@pytest.mark.parametrize("flags, expected", [
    ("fpu sse2 avx2 f16c", frozenset()),  # AVX2 only: torch converts, a bf16 step is several times 32-true's
    ("fpu avx2 avx512f avx512_bf16", {"bf16"}),  # Cooper Lake, Zen 4: bf16, no fp16 unit
    ("fpu avx2 amx_tile amx_bf16", {"bf16"}),
    ("fpu avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_fp16", {"bf16", "fp16"}),
    (None, None),  # no x86 flags line (an Arm CPU's cpuinfo): unknown
])
def test_a_cpus_16_bit_multiply_units_are_told_by_its_flags(tmp_path, flags, expected):
    cpuinfo = tmp_path / "cpuinfo"
    processor = "processor\t: {}\nmodel name\t: Some CPU\n" + (f"flags\t\t: {flags}\n" if flags else "Features\t: fp asimd bf16\n")
    cpuinfo.write_text(processor.format(0) + "\n" + processor.format(1))
    assert probe.cpu_16_bit_units(str(cpuinfo)) == expected
    assert probe.cpu_16_bit_units(str(tmp_path / "absent")) is None
