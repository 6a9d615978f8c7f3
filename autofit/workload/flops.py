"""Training FLOPs per sample of a transformer stack, for model FLOPs utilisation (MFU).

The convention of PaLM (appendix B) and nanoGPT's `estimate_mfu`: a token's forward and
backward cost 6 FLOPs per matmul weight plus 12·L·d·T for attention's scores and values
(L layers, width d, T tokens per sample). Recomputation by activation checkpointing is not
counted: MFU measures the model's useful work, so checkpointing lowers it as it should.

Known only where the model says what it is: a decoder-only or encoder-only transformer whose
config names its depth and width (autofit's `gpt`, nanoGPT-style `config.n_layer/n_embd`,
Hugging Face's `num_hidden_layers/hidden_size`). Anything else (an encoder-decoder, a
ConvNet, a model without such a config) has no figure, rather than a guessed one.
"""

from torch import nn

_DEPTH_KEYS = ("n_layer", "num_hidden_layers", "num_layers")
_WIDTH_KEYS = ("n_embd", "hidden_size", "d_model")


def matmul_parameters(model: nn.Module) -> int:
    """Weights a token multiplies by: every matrix of a module other than an embedding table
    (a lookup costs no FLOPs), counted once (a head tied to the token embedding is a matmul)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        for p in module.parameters(recurse=False):
            if p.dim() >= 2:
                seen[id(p)] = p.numel()
    return sum(seen.values())


def _config_int(config, keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def transformer_shape(model: nn.Module) -> tuple[int, int] | None:
    """(layers, width) from the model's own config; None for a model that names neither, or
    an encoder-decoder (its cross-attention is not in the formula)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return None
    depth, width = _config_int(config, _DEPTH_KEYS), _config_int(config, _WIDTH_KEYS)
    return None if depth is None or width is None else (depth, width)


def train_flops_per_sample(model: nn.Module, tokens_per_sample: int | None) -> float | None:
    """A sample's forward-and-backward FLOPs: (6·N + 12·L·d·T)·T; None where not known."""
    shape = transformer_shape(model)
    if shape is None or not tokens_per_sample:
        return None
    layers, width = shape
    per_token = 6 * matmul_parameters(model) + 12 * layers * width * tokens_per_sample
    return float(per_token * tokens_per_sample)
