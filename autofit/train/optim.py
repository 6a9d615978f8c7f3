"""The optimizer a run builds, and the name of its implementation.

Every run builds its optimizer here: `Runner`, the estimator, `profile.apply`. A profile
records `implementation(optimizer)`, so a plan can tell whether the optimizer a user
built is the one that was measured (a foreach AdamW holds temporaries the size of all
parameters that the fused one does not).

Weights in fp32 (every precision but `bf16-true`) get PyTorch's own optimizer: fused on
CUDA, one parameter at a time on a CPU. `bf16-true` weights get torch-optimi's optimizer
with Kahan summation: a bf16 weight cannot take an update below half its ulp (an AdamW
step of 3e-4 to a LayerNorm gain of 1.0 rounds away), and the compensation buffer keeps
the lost low bits and adds them back. docs/precision.md has the measurements behind the
choice (against torchao's stochastic rounding and against the plain bf16 update).

`optimizer_bits=8` gets bitsandbytes' AdamW8bit/Adam8bit: both moments quantized blockwise
to 8 bits (256 values per block share an fp32 scale), about 2 bytes per parameter instead of
8. Tensors under 4096 elements keep fp32 moments (the library's default). docs/precision.md
has the measurement behind choosing it over torchao's AdamW8bit.
"""

import importlib.util
import logging

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from autofit.base.errors import AutofitError, SpecError
from autofit.config.spec import OptimizerSpec
from autofit.config.train_config import TrainConfig
from autofit.device.precision import get_policy
from autofit.workload.optimizer import load_user_optimizer


class OptimizerMissingError(AutofitError):
    """An optional optimizer library is not installed."""


def param_groups(spec: OptimizerSpec, params: list[nn.Parameter]) -> list[dict]:
    """Weight decay on matrices only (not biases and norms), as nanoGPT and most LLM recipes do."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": spec.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(spec: OptimizerSpec, params: list[nn.Parameter], *, config: TrainConfig,
                    device: torch.device, user=None) -> torch.optim.Optimizer:
    """The optimizer `config` runs with on `device`, over the trainable `params`. The user's
    own (`spec.python`; `user`: its factory, loaded already) is built as it is, whatever the
    precision: its update and state are theirs."""
    if spec.python is not None or user is not None:
        return (user or load_user_optimizer(spec.python, spec.args, None))(params)
    groups = param_groups(spec, params)
    if config.optimizer_bits == 8:
        return _eight_bit(spec, groups)
    if get_policy(config.precision).param_dtype != torch.float32:
        return _compensated(spec, groups, torch.device("cpu") if config.fsdp_offload else device)
    # On CUDA the fused kernels: fastest, and no foreach temporaries the size of all
    # gradients. On a CPU one tensor at a time: the foreach path's temporaries would count
    # against the budget for no speed-up there.
    # (Under fsdp_offload the shards it steps are on the host.)
    on_card = device.type == "cuda" and not config.fsdp_offload
    impl = {"fused": True} if on_card else {"foreach": False}
    if spec.name == "adamw":
        return torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas, **impl)
    if spec.name == "adam":
        return torch.optim.Adam(groups, lr=spec.lr, betas=spec.betas, **impl)
    assert spec.name == "sgd", spec.name
    return torch.optim.SGD(groups, lr=spec.lr, momentum=spec.momentum, **impl)


def _compensated(spec: OptimizerSpec, groups: list[dict], device: torch.device) -> torch.optim.Optimizer:
    """torch-optimi's optimizer with Kahan summation on, stated rather than left to its
    dtype-based default, so the profile's record cannot drift with a library default."""
    try:
        import optimi
    except ImportError:
        raise OptimizerMissingError("bf16-true needs torch-optimi for its compensated (Kahan) updates: "
                                    "pip install torch-optimi") from None
    # On CUDA optimi's Triton kernels (one pass per tensor, no foreach temporaries) where
    # Triton is installed, else its foreach path; on a CPU one tensor at a time.
    triton = device.type == "cuda" and triton_available()
    impl = {"kahan_sum": True, "triton": triton, "foreach": device.type == "cuda" and not triton,
            "eps": 1e-8}  # torch's AdamW eps (optimi's default is 1e-6): the same update as 32-true's
    if spec.name == "adamw":
        optimizer = optimi.AdamW([{**g, _KAHAN_DECAY: g["weight_decay"], "weight_decay": 0.0} for g in groups],
                                 lr=spec.lr, betas=spec.betas, **impl)
        optimizer.register_step_pre_hook(_decay_into_compensation)
        return optimizer
    # Adam's and SGD's weight decay is an L2 term in the gradient: inside the compensated sum.
    if spec.name == "adam":
        return optimi.Adam(groups, lr=spec.lr, betas=spec.betas, **impl)
    assert spec.name == "sgd", spec.name
    impl.pop("eps")
    return optimi.SGD(groups, lr=spec.lr, momentum=spec.momentum, **impl)


# optimi applies AdamW's decoupled decay as `param *= 1 - lr * wd`, outside the Kahan sum. On
# a bf16 weight a factor that close to 1 rounds back to the weight (lr 3e-4, wd 0.1: 3e-5 a
# step, far below half a bf16 ulp, 2**-9 of the weight): the decay vanished, and weights with
# no gradient never moved (76% of the example GPT's embedding). So the decay is taken out of
# optimi's group and added to the compensation buffer before each step, where optimi's own
# Kahan sum carries it into the weight: p - lr*wd*p - lr*update, as torch's AdamW does.
_KAHAN_DECAY = "kahan_weight_decay"  # the group's decoupled weight decay, applied by the hook


@torch.no_grad()
def _decay_into_compensation(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        decay = group.get(_KAHAN_DECAY, 0.0)
        if not decay:
            continue
        for p in group["params"]:
            if p.grad is None:  # as torch's AdamW: no gradient, no step, no decay
                continue
            state = optimizer.state[p]
            if "kahan_comp" not in state:
                # optimi makes its state lazily at the first step; the buffer is needed now.
                # tests/test_optim.py fails loudly if optimi renames either.
                optimizer._init_state(group, state, p)
            compensation = state["kahan_comp"]
            if compensation is None or compensation.dtype != p.dtype:  # no Kahan buffer: an fp32 weight
                p.mul_(1 - group["lr"] * decay)
            else:
                compensation.add_(p, alpha=-group["lr"] * decay)


def triton_available() -> bool:
    """Whether optimi can use its Triton kernels here (a seam: tests make it say yes on a CPU box)."""
    return importlib.util.find_spec("triton") is not None


def _eight_bit(spec: OptimizerSpec, groups: list[dict]) -> torch.optim.Optimizer:
    """bitsandbytes' 8-bit Adam(W): the same update rule with quantized moments. The same
    class on CUDA and on a CPU (its CPU kernels), so a CPU trial measures the real state."""
    if spec.name not in ("adamw", "adam"):
        raise SpecError(f"optimizer_bits: 8-bit state is for adam and adamw, got optimizer.name {spec.name}")
    # Its CPU backend warns at import about a 4-bit matmul kernel package that 8-bit
    # optimizers never use; that line would only confuse a tune's log.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except ImportError:
        raise OptimizerMissingError("optimizer_bits 8 needs bitsandbytes: pip install 'autofit[optim8]' "
                                    "(or pip install bitsandbytes)") from None
    cls = bitsandbytes.optim.AdamW8bit if spec.name == "adamw" else bitsandbytes.optim.Adam8bit
    # Its quantization map (a 256-entry table of constants) is computed from Python values;
    # under the estimator's fake tensors there are none, so the table is built as real tensors.
    with unset_fake_temporarily():
        return cls(groups, lr=spec.lr, betas=spec.betas, eps=1e-8)


def implementation(optimizer: torch.optim.Optimizer) -> str:
    """`library.Class/kernel[+kahan]`: e.g. `torch.AdamW/fused`, `torch.AdamW/foreach`,
    `torch.AdamW/per-parameter`, `optimi.AdamW/triton+kahan`. Two optimizers with the same
    name run the same update with the same memory."""
    cls = type(optimizer)
    library = cls.__module__.split(".")[0]
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if group.get("fused"):
        kernel = "fused"
    elif group.get("triton"):
        kernel = "triton"
    elif group.get("foreach") is None and library == "torch":
        # torch decides at the first step: foreach when every parameter is on a GPU.
        on_gpu = all(p.device.type == "cuda" for g in optimizer.param_groups for p in g["params"])
        kernel = "foreach" if on_gpu and not group.get("differentiable") else "per-parameter"
    else:
        kernel = "foreach" if group.get("foreach") else "per-parameter"
    compensation = "+kahan" if any(g.get("kahan_sum") for g in optimizer.param_groups) else ""
    return f"{library}.{cls.__name__}/{kernel}{compensation}"

