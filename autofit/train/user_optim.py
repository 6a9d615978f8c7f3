"""The memory of the user's own optimizer's state, counted rather than simulated.

The estimator runs the training step on fake tensors; a user's optimizer may run kernels
that must never see one (Triton or fused extension ops on raw pointers, `.item()`), so it
is not run there. Instead `count_state` builds it over a small real stand-in of every
trainable parameter (the same dtype and number of dims, each dim capped at a distinct small
size), takes one real step on the CPU, and scales each state tensor it created back to its
parameter's real shape: a tensor the size of the stand-in (a moment, flattened or not) to the
parameter's size, a dim equal to a stand-in dim (a factored row or column statistic) to that
dim's real size, anything else (a step count) as it is. `CountedState` then holds those bytes
in the fake run, where the optimizer's state would be.
"""

import math
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _disable_current_modes

from autofit.base.errors import AutofitError

# Distinct sizes per dim, so a state dim tells which parameter dim it follows.
_STAND_IN_DIMS = (13, 17, 19, 23, 29, 31, 37, 41)


class OptimizerStateError(AutofitError):
    """The user's optimizer could not take a step on the CPU stand-in: its state is not counted."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StateCount:
    bytes_per_param: tuple[int, ...]  # the state bytes of each trainable parameter, in order
    how: str  # how they were counted, for the estimate's reader

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_param)


def stand_in_shape(shape) -> tuple[int, ...]:
    return tuple(min(d, _STAND_IN_DIMS[i % len(_STAND_IN_DIMS)]) for i, d in enumerate(shape))


def scaled_bytes(state: torch.Tensor, small: tuple[int, ...], real: tuple[int, ...]) -> int:
    """The bytes `state` (made for a parameter of shape `small`) takes for one of shape `real`."""
    if small and state.numel() == math.prod(small):
        return math.prod(real) * state.element_size()
    dims = []
    for i, size in enumerate(state.shape):
        same_place = i < len(small) and small[i] == size
        j = i if same_place else next((k for k, s in enumerate(small) if s == size and s != real[k]), None)
        dims.append(real[j] if j is not None else size)
    return math.prod(dims) * state.element_size()


def count_state(factory, params: list[torch.Tensor], target: str) -> StateCount:
    """Per-parameter state bytes of the optimizer `factory(params)` builds, from one real step
    on CPU stand-ins of `params` (real or fake tensors: only their shapes and dtypes are read)."""
    shapes = [tuple(p.shape) for p in params]
    # Out of every dispatch mode (fake tensors, the estimator's byte tracker): these tensors
    # are real, small and not the run's.
    with _disable_current_modes(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        small = [torch.nn.Parameter(torch.randn(stand_in_shape(s)).to(p.dtype)) for s, p in zip(shapes, params)]
        for p in small:
            p.grad = torch.randn(p.shape).to(p.dtype)
        try:
            optimizer = factory(small)
            optimizer.step()
        except AutofitError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever stops it, its state is not counted
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise OptimizerStateError(f"optimizer.python: {target} could not take a step on a CPU stand-in of "
                                      f"the parameters ({type(exc).__name__}: {first}); its state is measured "
                                      f"by a trial instead") from exc
        counted = tuple(sum(scaled_bytes(t, tuple(p.shape), shape) for t in optimizer.state.get(p, {}).values()
                            if isinstance(t, torch.Tensor)) for p, shape in zip(small, shapes))
    how = (f"{target}'s state counted from one real step on a CPU stand-in of each parameter (each dim at most "
           f"{max(_STAND_IN_DIMS)}), scaled to the real shapes; not run on fake tensors")
    return StateCount(bytes_per_param=counted, how=how)


class CountedState(torch.optim.Optimizer):
    """Stands in for the user's optimizer in the estimator's fake run: its first step
    allocates, per parameter, the state bytes counted for it; it updates nothing."""

    def __init__(self, params, count: StateCount | None = None):
        params = list(params)
        super().__init__(params, {})
        self.count = count

    @torch.no_grad()
    def step(self, closure=None):
        if self.count is None:
            return None
        for p, n_bytes in zip(self.param_groups[0]["params"], self.count.bytes_per_param):
            if n_bytes and "counted" not in self.state[p]:
                self.state[p]["counted"] = torch.empty(n_bytes, dtype=torch.uint8, device=p.device)
        return None
