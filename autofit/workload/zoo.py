"""Built-in models: `gpt` (nanoGPT-style causal LM), `mlp` and `convnet` (classifiers).

Each keeps its repeated blocks in `self.blocks`, an `nn.ModuleList` of one module type:
that is the stack `knobs.py` checkpoints and freezes. Arguments arrive as the spec's
`model.args` mapping and are checked here, so a typo is a one-line error, not a traceback.
"""

import difflib
import math
from dataclasses import MISSING, dataclass, fields
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from autofit.base.errors import SpecError
from autofit.workload.data import InputSpec

_ARGS = "model.args"
_LAYER_COUNTS = ("n_layer", "n_blocks")
_MAX_LAYERS = 10_000
_MAX_WIDTH = 1 << 24


def _from_args(cls, args: dict):
    """Build a config dataclass from user args: unknown keys, missing keys and types checked."""
    allowed = [f.name for f in fields(cls)]
    for key in args:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise SpecError(f"{_ARGS}.{key}: unknown key; allowed: {', '.join(allowed)}{hint}")
    for f in fields(cls):
        if f.name not in args:
            if f.default is MISSING:
                raise SpecError(f"{_ARGS}.{f.name}: required key is missing (allowed: {', '.join(allowed)})")
            continue
        value = args[f.name]
        # YAML's `true` is an int to Python, but never a valid layer count.
        if f.type is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise SpecError(f"{_ARGS}.{f.name}: must be a positive integer, got {value!r}")
        # Bounds far above any real model, below what hangs a build (a million layers on the
        # meta device) or overflows a shape.
        limit = _MAX_LAYERS if f.name in _LAYER_COUNTS else _MAX_WIDTH
        if f.type is int and value > limit:
            raise SpecError(f"{_ARGS}.{f.name}: at most {limit:,}, got {value:,}")
        if f.type is float and (isinstance(value, bool) or not isinstance(value, (int, float))
                                or not math.isfinite(value)):
            raise SpecError(f"{_ARGS}.{f.name}: must be a finite number, got {value!r}")
        if f.type is bool and not isinstance(value, bool):
            raise SpecError(f"{_ARGS}.{f.name}: must be true or false, got {value!r}")
    return cls(**args)


# ---- gpt -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    seq_len: int  # longest sequence: size of the learned position table
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm, as GPT-2

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise SpecError(f"{_ARGS}.n_head: must divide n_embd ({self.n_embd}), got {self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise SpecError(f"{_ARGS}.dropout: must be in [0, 1), got {self.dropout}")

    def inputs(self) -> InputSpec:
        return InputSpec(task="causal_lm", seq_len=self.seq_len, vocab_size=self.vocab_size)


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = c.n_head, c.dropout
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.resid_dropout = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class GPTBlock(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.mlp = nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias), nn.GELU(),
                                 nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias), nn.Dropout(c.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = c = config
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.seq_len, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(GPTBlock(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd, bias=c.bias)
        # Not tied to wte: freezing the embeddings must leave the output head trainable.
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.apply(_init_normal)
        # GPT-2: residual projections scaled down so the residual stream does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("attn.c_proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layer))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                return_hidden: bool = False) -> torch.Tensor:
        # `targets` is accepted for nanoGPT-style callers; the workload's loss_fn owns the loss.
        # `return_hidden`: the states before the head, for the chunked loss (workload/chunked.py),
        # through forward so that wrappers of the model's call still see the pass.
        T = idx.shape[1]
        assert T <= self.config.seq_len, f"sequence of {T} tokens, position table holds {self.config.seq_len}"
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return x if return_hidden else self.lm_head(x)


def _init_normal(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


# ---- mlp -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    in_features: int
    hidden: int
    n_layer: int  # residual blocks of width `hidden`
    n_classes: int

    def inputs(self) -> InputSpec:
        return InputSpec(task="classify", feature_shape=(self.in_features,), n_classes=self.n_classes)


class MLPBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(self.norm(x)))


class MLP(nn.Module):
    def __init__(self, config: MLPConfig):
        super().__init__()
        self.config = c = config
        self.stem = nn.Linear(c.in_features, c.hidden)
        self.blocks = nn.ModuleList(MLPBlock(c.hidden) for _ in range(c.n_layer))
        self.head = nn.Linear(c.hidden, c.n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# ---- convnet -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ConvNetConfig:
    in_channels: int = 3
    image_size: int = 32  # square inputs of image_size x image_size pixels
    channels: int = 64
    n_blocks: int = 4
    n_classes: int = 10

    def inputs(self) -> InputSpec:
        shape = (self.in_channels, self.image_size, self.image_size)
        return InputSpec(task="classify", feature_shape=shape, n_classes=self.n_classes)


class ConvBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn(self.conv(x)))


class ConvNet(nn.Module):
    def __init__(self, config: ConvNetConfig):
        super().__init__()
        self.config = c = config
        self.stem = nn.Sequential(nn.Conv2d(c.in_channels, c.channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(c.channels), nn.ReLU())
        self.blocks = nn.ModuleList(ConvBlock(c.channels) for _ in range(c.n_blocks))
        self.head = nn.Linear(c.channels, c.n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


# ---- registry ------------------------------------------------------------------------------


def gpt(args: dict) -> GPT:
    return GPT(_from_args(GPTConfig, args))


def mlp(args: dict) -> MLP:
    return MLP(_from_args(MLPConfig, args))


def convnet(args: dict) -> ConvNet:
    return ConvNet(_from_args(ConvNetConfig, args))


BUILTIN_MODELS: dict[str, Callable[[dict], nn.Module]] = {"gpt": gpt, "mlp": mlp, "convnet": convnet}
_CONFIGS = {"gpt": GPTConfig, "mlp": MLPConfig, "convnet": ConvNetConfig}


def builtin_inputs(name: str, args: dict) -> InputSpec:
    """What the built-in model `name` eats, from its args alone (validates them too)."""
    if name not in _CONFIGS:
        close = difflib.get_close_matches(name, list(_CONFIGS), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise SpecError(f"model.builtin: unknown model {name!r}; available: {', '.join(_CONFIGS)}{hint}")
    return _from_args(_CONFIGS[name], args).inputs()
