"""Which precisions a device can run, from plain facts (device kind and compute capability,
read through NVML or torch): the parent decides without touching CUDA or importing torch."""

import importlib.util
import sys

from autofit.base.errors import DeviceError, SpecError
from autofit.config.spec import ModelSpec, PRECISIONS


def unsupported_reason(name: str, *, device_kind: str, compute_capability: tuple[int, int] | None) -> str | None:
    """Why `name` cannot run on this hardware, or None when it can.

    Takes plain facts (from NVML or torch) so the parent can decide without touching CUDA.
    """
    _known(name)
    if device_kind == "cpu":
        # On a CPU "tf32" is the same computation as 32-true; searching it would only
        # measure noise twice.
        return "tf32 needs an NVIDIA GPU (compute capability 8.0+); on a CPU it is 32-true" if name == "tf32" else None
    if compute_capability is None:
        return None
    major, minor = compute_capability
    if name in ("tf32", "bf16-mixed", "bf16-true") and major < 8:
        return f"{name} needs compute capability 8.0+ (Ampere or newer), this GPU has {major}.{minor}"
    if name == "16-mixed" and major < 6:
        return f"16-mixed needs compute capability 6.0+, this GPU has {major}.{minor}"
    return None


def supported_precisions(candidates, *, device_kind: str, compute_capability: tuple[int, int] | None) -> list[str]:
    return [p for p in candidates
            if unsupported_reason(p, device_kind=device_kind, compute_capability=compute_capability) is None]


def require_supported(name: str, device) -> None:
    """The command-line check (train, trial, estimate), from a probed `DeviceInfo` without
    touching CUDA: a DeviceError saying why `name` cannot run there. tf32 on a CPU is
    refused here as `tune` refuses to search it: it would run as 32-true under another name."""
    reason = unsupported_reason(name, device_kind=device.kind, compute_capability=device.compute_capability)
    if reason is not None:
        raise DeviceError(f"precision: {reason}")


def require_opt_in_packages(spec: ModelSpec) -> None:
    """A searched opt-in whose package is not installed here is refused before any trial:
    otherwise every trial of it ends in an error. The trial children import from the same
    environment as this process, so a look at its import path (no import) decides."""
    if 8 in spec.search.optimizer_bits and not _installed("bitsandbytes"):
        raise SpecError("search.optimizer_bits: 8 needs bitsandbytes, which is not installed here: "
                        "pip install 'autofit[optim8]' (or pip install bitsandbytes), or search [32] only")


def _installed(package: str) -> bool:
    if package in sys.modules:  # None there: imports of it are blocked
        return sys.modules[package] is not None
    return importlib.util.find_spec(package) is not None


# Precisions whose fp32 matmuls and convolutions may use TF32 tensor cores.
TF32_PRECISIONS = ("tf32",)
# Precisions that hold tensors of the same sizes, each named by the first of them in
# PRECISIONS' order: tf32 changes only the matmuls' internal math, and fp16 and bf16 autocast
# keep copies of one size. Their memory is one, so is their estimate (`device.precision`
# checks this table against the policies' dtypes when it is imported).
SAME_TENSORS = {"32-true": "32-true", "tf32": "32-true", "16-mixed": "16-mixed", "bf16-mixed": "16-mixed",
                "bf16-true": "bf16-true"}


def same_tensors(name: str) -> str:
    """The first precision that holds tensors of the same sizes as `name` (SAME_TENSORS)."""
    _known(name)
    return SAME_TENSORS[name]


def _known(name: str) -> None:
    if name not in PRECISIONS:
        raise DeviceError(f"precision: must be one of {', '.join(PRECISIONS)}, got {name!r}")
