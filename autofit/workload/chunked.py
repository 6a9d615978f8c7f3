"""The chunked LM loss (`chunked_loss=true`): the head's matmul and the cross-entropy run
over chunks of tokens, so the full logits and their gradient never exist at once.

    loss = autofit.chunked_lm_loss(model, (inputs, targets))         # built-in gpt
    loss = autofit.chunked_lm_loss(model, {"input_ids": ..., "labels": ...})   # HF causal LM

The chunking is PyTorch's own `torch.nn.functional.linear_cross_entropy` with
`LinearCrossEntropyOptions` (torch >= 2.13): it computes each chunk's logits, their softmax
gradient and the chunk's share of the input and weight gradients during the forward, and
keeps only those gradients. The model runs without its head (the built-in GPT's
`return_hidden=True`, an HF model's `base_model`), and the head's weight goes to the loss.
The losses equal the plain path's: fp32 softmax, the same shift and ignore index.
"""

import torch
import torch.nn.functional as F
from torch import nn

from autofit.base.errors import SpecError
from autofit.workload.text import IGNORE_INDEX

# HF config attributes that transform the logits after the head (soft-capping, scaling):
# the chunked op computes plain head logits, so such models are not offered the knob.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def available() -> bool:
    """This torch has the chunked op (2.13 and later)."""
    return hasattr(F, "linear_cross_entropy") and hasattr(nn, "LinearCrossEntropyOptions")


def hf_chunkable(hf_config) -> bool:
    """An HF causal LM whose logits are its head's output, unchanged."""
    return available() and not any(getattr(hf_config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS)


def token_losses(hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor) -> torch.Tensor:
    """cross_entropy(head(hidden).float(), targets, reduction="none") without the logits, in
    fp32: `hidden` [..., C], `targets` [...] (IGNORE_INDEX: no target, loss 0)."""
    return _chunked(hidden, head, targets, "none").float().view(targets.shape)


def mean_loss(hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor) -> torch.Tensor:
    """The mean over the targets (IGNORE_INDEX left out), as cross_entropy's "mean"."""
    if _compute_dtype(hidden) == torch.float32:
        # The op's own mean: its gradients are computed in the forward, nothing is recomputed.
        return _chunked(hidden, head, targets, "mean")
    # With 16-bit inputs the op returns its reductions in 16 bits (a mean of 6.30 comes back
    # as 6.41 in bf16): reduce the per-token losses in fp32 instead.
    return token_losses(hidden, head, targets).sum() / (targets != IGNORE_INDEX).sum().clamp(min=1)


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    device_type = hidden.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype


def _chunked(hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    # Under autocast the head runs in the autocast dtype, as `head(hidden)` would (the op is
    # not on autocast's lists); its softmax accumulates in fp32 either way.
    dtype = _compute_dtype(hidden)
    weight, bias = head.weight.to(dtype), None if head.bias is None else head.bias.to(dtype)
    return F.linear_cross_entropy(hidden.to(dtype).flatten(0, -2), weight, targets.flatten(), linear_bias=bias,
                                  reduction=reduction, ignore_index=IGNORE_INDEX,
                                  options=nn.LinearCrossEntropyOptions())


def hidden_and_targets(model: nn.Module, batch) -> tuple[torch.Tensor, nn.Linear, torch.Tensor]:
    """The final hidden states before the head, the head, and the targets they predict:
    a tuple batch is the built-in GPT's (inputs, next tokens); a dict batch an HF causal
    LM's (labels are the inputs, shifted here as HF shifts them inside the model)."""
    if isinstance(batch, dict):
        labels = batch["labels"]
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        hidden = model.base_model(**inputs).last_hidden_state[:, :-1]
        return hidden, _head(model.get_output_embeddings()), labels[:, 1:]
    x, targets = batch
    return model(x, return_hidden=True), _head(getattr(model, "lm_head", None)), targets


def chunked_lm_loss(model: nn.Module, batch) -> torch.Tensor:
    """The mean next-token loss over the batch's targets, as the plain LM loss computes it
    (the built-in GPT's and HF's `outputs.loss`), with the head and cross-entropy chunked."""
    hidden, head, targets = hidden_and_targets(model, batch)
    return mean_loss(hidden, head, targets)


def chunked_text_lm_loss(model: nn.Module, batch) -> torch.Tensor:
    """`text.text_lm_loss` chunked: the mean over samples of each sample's mean token loss."""
    hidden, head, targets = hidden_and_targets(model, batch)
    token_loss = token_losses(hidden, head, targets)
    counts = (targets != IGNORE_INDEX).sum(dim=1).clamp(min=1)
    return (token_loss.sum(dim=1) / counts).mean()


def _head(module) -> nn.Linear:
    if not isinstance(module, nn.Linear):
        raise SpecError(f"chunked_loss: the model's output head is {type(module).__name__}, not a Linear layer; "
                        f"set chunked_loss false")
    return module
