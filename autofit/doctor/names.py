"""The doctor's checks by name, in the order they run (the CLI lists them in its help
without importing the checks, which import torch)."""

CHECK_NAMES = ("probe", "overhead", "memory-cap", "precisions", "kernels", "estimator", "distributed")
# Checks that cannot apply on a CPU, and why: the parent skips them without starting a child.
CPU_SKIPS = {"overhead": "a CPU has no CUDA context or library workspaces: trials count 0 bytes of overhead"}
