"""Hugging Face models built from a config mapping: no download, random weights.

    model:
      hf: {class: GPT2LMHeadModel, config: {n_layer: 12, n_embd: 768, n_head: 12}}

The class name picks the task: `*LMHeadModel` / `*ForCausalLM` train as causal LMs,
`*ForMaskedLM` as masked LMs, `*ForSequenceClassification` as classifiers. In every case
the model computes its own loss from the batch's `labels`. transformers is an optional
extra (`pip install 'autofit[hf]'`); nothing here imports it until an hf model is used.
"""

import copy
import difflib
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from autofit.base.errors import SpecError
from autofit.workload.data import InputSpec

_TASK_SUFFIXES = {"LMHeadModel": "causal_lm", "ForCausalLM": "causal_lm",
                  "ForMaskedLM": "masked_lm", "ForSequenceClassification": "classify"}
# Keys every config accepts that a default config's to_dict() does not list.
_COMMON_CONFIG_KEYS = {"num_labels", "attn_implementation", "name_or_path"}


def _transformers():
    try:
        import transformers
    except ImportError:
        raise SpecError("model.hf: the hf source needs transformers: pip install 'autofit[hf]'") from None
    return transformers


def _dtype_kwarg() -> str:
    import transformers

    # transformers 4.56 renamed torch_dtype to dtype; the old name only warns after that.
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def task_of(class_name: str) -> str | None:
    return next((task for suffix, task in _TASK_SUFFIXES.items() if class_name.endswith(suffix)), None)


@dataclass(frozen=True)
class HFModel:
    """A resolved hf model source: the class, its validated config, and what it eats."""

    cls: type
    config: Any  # a transformers PreTrainedConfig
    inputs: InputSpec

    def build(self) -> nn.Module:
        # _from_config writes dtype and attention choices into the config: give each model its own.
        config = copy.deepcopy(self.config)
        attn = "sdpa" if getattr(self.cls, "_supports_sdpa", False) else "eager"
        # fp32 whatever dtype the config names: precision is the tuner's knob, applied later.
        return self.cls._from_config(config, attn_implementation=attn, **{_dtype_kwarg(): torch.float32})


def resolve(class_name: str, config: dict, *, seq_len: int | None = None) -> HFModel:
    """Check the class and config without building real weights; `seq_len` overrides the config's."""
    transformers = _transformers()
    task = task_of(class_name)
    try:
        cls = getattr(transformers, class_name, None)
    except (ImportError, RuntimeError) as exc:  # lazy import of a model whose own extras are missing
        raise SpecError(f"model.hf.class: {class_name} cannot be imported: {exc}") from None
    if not isinstance(cls, type) or task is None:
        trainable = [n for n in dir(transformers) if task_of(n)]
        close = difflib.get_close_matches(class_name, trainable, n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        kinds = ", ".join("*" + s for s in _TASK_SUFFIXES)
        what = "is not a class in transformers" if not isinstance(cls, type) else "is not a trainable head"
        raise SpecError(f"model.hf.class: {class_name!r} {what} (autofit trains {kinds}){hint}")
    hf_config = _config(cls, config, task)
    # A config that builds the wrong model (a typo'd size, heads not dividing the width)
    # often fails only in the model's __init__: build once on the meta device, which
    # allocates nothing, so the user hears about it now and in one line.
    try:
        with torch.device("meta"):
            HFModel(cls, hf_config, None).build()
    except (ValueError, TypeError, AssertionError) as exc:
        raise SpecError(f"model.hf.config: {class_name} cannot be built from this config: {exc}") from None
    except Exception:  # noqa: BLE001 - an op this model cannot run on meta; the real build will tell
        pass
    return HFModel(cls, hf_config, _inputs(class_name, task, hf_config, seq_len))


def _config(cls: type, config: dict, task: str) -> Any:
    config_class = cls.config_class
    try:
        hf_config = config_class(**config)
    except (ValueError, TypeError) as exc:
        raise SpecError(f"model.hf.config: {config_class.__name__} rejects this config: {exc}") from None
    # HF keeps a key it does not know as a plain attribute, so `n_lyer: 2` would silently
    # give the default depth. Such a key shows up in to_dict() while a default config has
    # no such attribute; keys the class consumes (aliases, legacy names) do not.
    default_keys = set(config_class().to_dict())
    known = (default_keys | set(getattr(config_class, "attribute_map", {}))
             | set(inspect.signature(config_class.__init__).parameters) | _COMMON_CONFIG_KEYS) - {"self", "kwargs"}
    kept = hf_config.to_dict()
    for key in config:
        if key in kept and key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise SpecError(f"model.hf.config.{key}: unknown key for {config_class.__name__}{hint}")
    if hasattr(hf_config, "use_cache"):
        # The key/value cache only serves generation; in training it is memory for nothing.
        hf_config.use_cache = False
    if task == "classify" and getattr(hf_config, "pad_token_id", 0) is None:
        # Decoder classifiers pool the last non-pad token and refuse batches > 1 without a
        # pad id. Random ids that happen to equal 0 only move the pooled position.
        hf_config.pad_token_id = 0
    return hf_config


def _inputs(class_name: str, task: str, config: Any, seq_len: int | None) -> InputSpec:
    max_positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if seq_len is None:
        if max_positions is None:
            raise SpecError(f"data.seq_len: required for {class_name}: its config has neither "
                            f"n_positions nor max_position_embeddings")
        seq_len = max_positions
    elif max_positions is not None and seq_len > max_positions:
        raise SpecError(f"data.seq_len: at most the model's {max_positions} positions, got {seq_len}")
    n_classes = config.num_labels if task == "classify" else None
    return InputSpec(task=task, hf=True, seq_len=seq_len, vocab_size=config.vocab_size, n_classes=n_classes)


def loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch).loss
