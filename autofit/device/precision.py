"""The precision policy: autocast dtype, GradScaler, parameter dtype, matmul precision.

Names follow Lightning's `Trainer(precision=...)`, so a profile maps onto it one to one.
"""

import contextlib
from dataclasses import dataclass

import torch

from autofit.base.errors import DeviceError
from autofit.config.spec import PRECISIONS
from autofit.device.support import SAME_TENSORS, TF32_PRECISIONS, unsupported_reason


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionPolicy:
    name: str
    autocast_dtype: torch.dtype | None  # None: no autocast
    param_dtype: torch.dtype  # dtype the weights (and so grads and optimizer state) live in
    use_scaler: bool  # fp16 needs loss scaling; bf16 has fp32's exponent range and does not
    tf32: bool  # allow TF32 tensor cores for fp32 matmuls and convolutions

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)

    def make_scaler(self, device_type: str) -> torch.amp.GradScaler:
        # A disabled scaler is a pass-through, so the training step has one code path.
        return torch.amp.GradScaler(device_type, enabled=self.use_scaler)

    def set_matmul_precision(self) -> None:
        """Process-wide: trials and training runs each live in their own process."""
        torch.backends.cuda.matmul.allow_tf32 = self.tf32
        torch.backends.cudnn.allow_tf32 = self.tf32
        torch.set_float32_matmul_precision("high" if self.tf32 else "highest")


def process_flags() -> dict:
    """The process-wide flags that change a run's speed or math, as a profile records them."""
    return {"cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            # On a CPU a figure holds for the intra-op threads it was measured with.
            "cpu_threads": torch.get_num_threads()}


def set_process_flags(flags: dict) -> None:
    """Set the flags `process_flags` reads (keys it does not name are an error)."""
    unknown = set(flags) - set(process_flags())
    assert not unknown, unknown
    if "cuda_matmul_allow_tf32" in flags:
        torch.backends.cuda.matmul.allow_tf32 = flags["cuda_matmul_allow_tf32"]
    if "cudnn_allow_tf32" in flags:
        torch.backends.cudnn.allow_tf32 = flags["cudnn_allow_tf32"]
    if "cudnn_benchmark" in flags:
        torch.backends.cudnn.benchmark = flags["cudnn_benchmark"]
    if "float32_matmul_precision" in flags:
        torch.set_float32_matmul_precision(flags["float32_matmul_precision"])
    if flags.get("cpu_threads"):
        torch.set_num_threads(flags["cpu_threads"])


_POLICIES = {
    "32-true": PrecisionPolicy(name="32-true", autocast_dtype=None, param_dtype=torch.float32,
                               use_scaler=False, tf32=False),
    "tf32": PrecisionPolicy(name="tf32", autocast_dtype=None, param_dtype=torch.float32,
                            use_scaler=False, tf32=True),
    "16-mixed": PrecisionPolicy(name="16-mixed", autocast_dtype=torch.float16, param_dtype=torch.float32,
                                use_scaler=True, tf32=False),
    "bf16-mixed": PrecisionPolicy(name="bf16-mixed", autocast_dtype=torch.bfloat16, param_dtype=torch.float32,
                                  use_scaler=False, tf32=False),
    "bf16-true": PrecisionPolicy(name="bf16-true", autocast_dtype=None, param_dtype=torch.bfloat16,
                                 use_scaler=False, tf32=False),
}
assert tuple(_POLICIES) == PRECISIONS


def _tensor_sizes(p: PrecisionPolicy) -> tuple:
    return p.param_dtype.itemsize, None if p.autocast_dtype is None else p.autocast_dtype.itemsize


assert tuple(n for n, p in _POLICIES.items() if p.tf32) == TF32_PRECISIONS, "device.support.TF32_PRECISIONS is out of date"
# The torch-free table the search reads (`support.SAME_TENSORS`) holds for these dtypes.
assert SAME_TENSORS == {name: next(other for other in PRECISIONS if _tensor_sizes(_POLICIES[other]) == _tensor_sizes(policy))
                        for name, policy in _POLICIES.items()}, "device.support.SAME_TENSORS is out of date"


def get_policy(name: str) -> PrecisionPolicy:
    if name not in _POLICIES:
        raise DeviceError(f"precision: must be one of {', '.join(PRECISIONS)}, got {name!r}")
    return _POLICIES[name]


def check_supported(name: str, device: torch.device) -> PrecisionPolicy:
    """The policy for `name` on `device`, or a DeviceError saying why it cannot run there."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    reason = unsupported_reason(name, device_kind=device.type, compute_capability=capability)
    if reason is not None and not (device.type == "cpu" and name == "tf32"):
        raise DeviceError(f"precision: {reason}")
    # tf32 on a CPU runs as 32-true: allowed when asked for explicitly, never searched.
    return get_policy(name)
