"""Training a model autofit did not write: its batch bound to `forward` by the signature, and
its loss taken from what `forward` returns, as Hugging Face's Trainer binds label names.

    loss_fn = ModelLoss(key_path="model.python", target="model:GPT")
    loss = loss_fn(model, (idx, targets))     # nanoGPT: forward(idx, targets=...) -> (logits, loss)

Binding. A dict batch's keys go to the parameters of those names (all of them with
`**kwargs`); a key `forward` does not take that is a target name (`targets`, `labels`, `y`,
`target`) is kept as the targets. In a tuple batch the last tensor is the target and the
rest are inputs: the target goes to a parameter of a target name, or as the last positional
argument when `forward` requires as many as the batch has parts; else it is kept.

The loss, in this order: `.loss`, `["loss"]`, a scalar, the one scalar of a tuple; else the
logits (`["logits"]`, `.logits`, a tuple's first tensor, the tensor itself) with
cross-entropy against the targets. When none applies, the error names what came back and
the three ways to fix it.
"""

import contextlib
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from autofit.base.errors import SpecError
from autofit.workload.data import Batch, user_code

TARGET_NAMES = ("targets", "labels", "y", "target")
IGNORE_INDEX = -100  # cross-entropy's default: labels of padding, as Hugging Face writes them

_FIXES = ("return the loss from forward (`.loss`, `[\"loss\"]`, a scalar, or a tuple with one scalar); "
          "give forward its targets (a parameter named targets, labels, y or target; a tuple batch's last "
          "tensor is the target) so that autofit takes cross-entropy of the logits; or name your own loss "
          "(`loss: {python: \"module:function\"}`, fn(model, micro_batch) -> scalar)")


@dataclass(frozen=True)
class _Signature:
    names: tuple[str, ...]  # every named parameter
    positional: tuple[str, ...]  # those that can be given by position, in order
    required: int  # positional parameters without a default
    var_positional: bool
    var_keyword: bool


@functools.lru_cache(maxsize=64)
def _signature(forward_owner: type) -> _Signature:
    try:
        params = list(inspect.signature(forward_owner.forward).parameters.values())[1:]  # not self
    except (TypeError, ValueError):  # no signature to read: take everything
        return _Signature((), (), 0, True, True)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return _Signature(
        names=tuple(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)),
        positional=tuple(p.name for p in positional),
        required=sum(p.default is p.empty for p in positional),
        var_positional=any(p.kind is p.VAR_POSITIONAL for p in params),
        var_keyword=any(p.kind is p.VAR_KEYWORD for p in params),
    )


def inner_model(model: nn.Module) -> nn.Module:
    """The user's module inside DDP (`.module`) or torch.compile (`._orig_mod`): its forward
    has the signature; the wrapper is what is called."""
    while True:
        inner = getattr(model, "_orig_mod", None) or (model.module if type(model).__name__ ==
                                                      "DistributedDataParallel" else None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


@dataclass(frozen=True)
class Call:
    """How one micro batch is given to forward."""

    args: tuple
    kwargs: dict
    targets: torch.Tensor | None  # the batch's targets, whether forward took them or not
    targets_to_forward: bool  # forward took the targets (so it may compute its own loss)


def bind(model: nn.Module, batch: Batch, *, batch_dim: int = 0) -> Call:
    """The call of `model` on `batch`, by its forward's signature. `batch_dim`: where the
    model takes the batch; autofit's batches hold it in dim 0, so inputs are moved there."""
    sig = _signature(type(inner_model(model)))
    if isinstance(batch, dict):
        call = _bind_dict(model, sig, batch)
    else:
        call = _bind_tuple(sig, tuple(batch))
    if batch_dim:
        call = Call(args=tuple(_to_batch_dim(t, batch_dim) for t in call.args),
                    kwargs={k: _to_batch_dim(v, batch_dim) for k, v in call.kwargs.items()},
                    targets=call.targets, targets_to_forward=call.targets_to_forward)
    return call


def _bind_dict(model: nn.Module, sig: _Signature, batch: dict) -> Call:
    taken = {k: v for k, v in batch.items() if sig.var_keyword or k in sig.names}
    target_key = next((k for k in TARGET_NAMES if k in batch), None)
    left = [k for k in batch if k not in taken and k != target_key]
    if left:
        raise SpecError(f"model: {type(inner_model(model)).__name__}.forward({', '.join(sig.names)}) takes no "
                        f"parameter {left[0]!r}, a key of the batch (keys a model does not take may only be "
                        f"its targets: {', '.join(TARGET_NAMES)})")
    targets = batch[target_key] if target_key is not None else None
    return Call(args=(), kwargs=taken, targets=targets, targets_to_forward=target_key in taken)


def _bind_tuple(sig: _Signature, parts: tuple) -> Call:
    if len(parts) == 1:
        return Call(args=parts, kwargs={}, targets=None, targets_to_forward=False)
    inputs, target = parts[:-1], parts[-1]
    name = next((n for n in TARGET_NAMES if n in sig.names and n not in sig.positional[:len(inputs)]), None)
    if name is not None:
        return Call(args=inputs, kwargs={name: target}, targets=target, targets_to_forward=True)
    if sig.required == len(parts):  # forward(x, y) needs every part: the target is its last argument
        return Call(args=parts, kwargs={}, targets=target, targets_to_forward=True)
    return Call(args=inputs, kwargs={}, targets=target, targets_to_forward=False)


def _to_batch_dim(value: Any, batch_dim: int) -> Any:
    if isinstance(value, torch.Tensor) and value.ndim > batch_dim:
        return value.movedim(0, batch_dim).contiguous()
    return value


# ---- the loss from what forward returned ----------------------------------------------------


def loss_of(output: Any, call: Call, *, batch_dim: int = 0, model_name: str = "the model") -> torch.Tensor:
    """The loss in `output`, or cross-entropy of its logits against the call's targets."""
    loss = _own_loss(output)
    if loss is not None:
        return loss
    logits = _logits(output)
    if logits is not None and call.targets is not None:
        if batch_dim:
            logits = logits.movedim(batch_dim, 0)
        targets = call.targets
        if not targets.is_floating_point() and logits.shape[:-1] == targets.shape:
            # fp32 for the softmax: a bf16 log-softmax over a large vocabulary is off by ~1 %.
            return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX)
        why = (f"; the logits {_describe(logits)} do not fit the targets {_describe(targets)} "
               f"(cross-entropy needs [..., classes] logits and integer [...] targets)")
    elif logits is not None:
        why = "; the batch has no targets for its logits"
    else:
        why = ""
    raise SpecError(f"model: cannot compute a loss: {model_name}.forward returned {_describe(output)}{why}. "
                    f"Fix it one of three ways: {_FIXES}")


def _own_loss(output: Any) -> torch.Tensor | None:
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor) and output.ndim == 0:
        return output
    if isinstance(output, (tuple, list)):
        scalars = [t for t in output if isinstance(t, torch.Tensor) and t.ndim == 0]
        if len(scalars) == 1:
            return scalars[0]
    return None


def _logits(output: Any) -> torch.Tensor | None:
    if isinstance(output, dict):
        logits = output.get("logits")
    elif isinstance(output, (tuple, list)):
        logits = output[0] if output else None
    elif isinstance(output, torch.Tensor):
        logits = output
    else:
        logits = getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) and logits.ndim >= 1 and logits.is_floating_point() else None


def _describe(value: Any, depth: int = 0) -> str:
    """What a model returned, short: `tuple(Tensor[2, 16, 64], None)`."""
    if isinstance(value, torch.Tensor):
        return f"Tensor[{', '.join(map(str, value.shape))}]" if value.ndim else "Tensor(scalar)"
    if depth > 1:
        return type(value).__name__
    if isinstance(value, dict):
        items = ", ".join(f"{k}: {_describe(v, depth + 1)}" for k, v in list(value.items())[:6])
        return f"{type(value).__name__}{{{items}}}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(_describe(v, depth + 1) for v in value[:6])})"
    return "None" if value is None else type(value).__name__


# ---- the default loss of a model autofit did not write --------------------------------------


@dataclass(frozen=True)
class ModelLoss:
    """fn(model, micro_batch) -> loss for a model autofit did not write: bound by signature,
    the loss from its output. Module level and plain data, so a Workload pickles."""

    key_path: str = "model"  # how errors name the model: the spec key, or the API argument
    target: str = "model"  # `module:function`, or the class name
    batch_dim: int = 0
    # Where the model's own loss is a mean over labelled tokens (Hugging Face), the shift of
    # its labels (1: causal LMs predict the next token); None: a loss the model returns is
    # its micro batch's mean, and micro batches weigh alike.
    label_shift: int | None = None
    # The model is the user's code: what its forward raises is their input error (exit 2).
    # Not for a Hugging Face class, where an error may belong to one config (a precision).
    users_code: bool = True

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        call = bind(model, batch, batch_dim=self.batch_dim)
        with user_code(self.key_path, self.target, "running forward") if self.users_code else _nothing():
            output = model(*call.args, **call.kwargs)
        return loss_of(output, call, batch_dim=self.batch_dim, model_name=type(inner_model(model)).__name__)

    def items(self, model: nn.Module, batch: Batch) -> torch.Tensor | None:
        """What this micro batch's loss is a mean over (its labelled targets), so a step
        weighs micro batches by them; None: micro batches weigh alike."""
        call = bind(model, batch, batch_dim=0)
        targets = call.targets
        if targets is None or targets.is_floating_point():
            return None
        if call.targets_to_forward:  # the model may compute its loss: only a known one is counted
            if self.label_shift is None:
                return None
            targets = targets[..., self.label_shift:]
        return (targets != IGNORE_INDEX).sum()


_nothing = contextlib.nullcontext


@dataclass(frozen=True)
class UserLoss:
    """The spec's `loss.python` (or the API's loss_fn): fn(model, micro_batch, **args) -> scalar."""

    fn: Callable
    args: dict
    key_path: str = "loss.python"
    target: str = "loss_fn"

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        with user_code(self.key_path, self.target, "computing the loss"):
            loss = self.fn(model, batch, **self.args)
        return check_loss(loss, self)


# ---- the one check of a loss before its backward ---------------------------------------------

def check_loss(loss: Any, loss_fn: Callable | str) -> torch.Tensor:
    """`loss` if it can train: a scalar floating-point tensor attached to the autograd graph.
    Else one SpecError naming the loss function and what is wrong, rather than torch's own
    error from inside `backward` (or an AttributeError on a float). Attribute reads only:
    no device sync in the step."""
    problem = _loss_problem(loss)
    if problem is not None:
        raise SpecError(f"{loss_source(loss_fn)} must return a scalar floating-point tensor attached to the "
                        f"autograd graph (the micro batch's mean loss); got {problem}")
    return loss


def loss_source(loss_fn: Callable | str) -> str:
    """How errors name a loss: the spec key and function, or the API's `loss_fn`."""
    if isinstance(loss_fn, str):
        return loss_fn
    if isinstance(loss_fn, ModelLoss):
        return f"{loss_fn.key_path}: the loss of {loss_fn.target}"
    if isinstance(loss_fn, UserLoss):
        return f"{loss_fn.key_path}: {loss_fn.target}"
    return f"loss_fn: {getattr(loss_fn, '__qualname__', type(loss_fn).__name__)}"


def _loss_problem(loss: Any) -> str | None:
    if not isinstance(loss, torch.Tensor):
        number = isinstance(loss, (int, float)) and not isinstance(loss, bool)
        return f"a Python {type(loss).__name__} ({loss!r}), which has no gradient" if number else _describe(loss)
    if loss.ndim != 0:
        return f"a tensor of shape [{', '.join(map(str, loss.shape))}] (not a scalar: reduce it, e.g. .mean())"
    if not loss.is_floating_point():
        return f"a {str(loss.dtype).removeprefix('torch.')} tensor (not floating-point: it has no gradient)"
    # Where the caller turned gradients off (the batch-dimension probe, an evaluation) no loss
    # can be attached; under the step's grad mode a detached loss is the loss's own fault.
    if not loss.requires_grad and torch.is_grad_enabled():
        return ("a tensor detached from the autograd graph (computed under torch.no_grad(), .detach()ed, "
                "or from no trainable parameter)")
    return None
