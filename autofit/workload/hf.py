"""Hugging Face models built from a config mapping: no download, random weights.

    model:
      hf: {class: T5ForConditionalGeneration, config: {num_layers: 2, d_model: 64, ...}}

Any model class of transformers. What it trains comes from the class, not from its name:
an encoder-decoder with an LM head learns target sequences (`seq2seq`); an LM head that can
generate predicts the next token (`causal_lm`), one that cannot the masked tokens
(`masked_lm`); a head that takes `labels` and returns a label per sample or per token is a
classifier (`classify`, `token_classify`), of images when it takes `pixel_values`. That
decides autofit's synthetic and token batches; with `data.kind: python` the batches are
yours and any model that computes a loss from them trains. In every case the model computes
its own loss from the batch's `labels`. transformers is an optional extra (`pip install
'autofit[hf]'`); nothing here imports it until an hf model is used.
"""

import copy
import difflib
import functools
import inspect
import re
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from autofit.base.errors import SpecError
from autofit.workload.data import InputSpec

# Keys every config accepts that a default config's to_dict() does not list: what
# PreTrainedConfig takes through **kwargs.
_COMMON_CONFIG_KEYS = {"num_labels", "attn_implementation", "name_or_path", "tie_word_embeddings",
                       "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
                       "output_attentions", "experts_implementation", "torch_dtype", "is_decoder",
                       "add_cross_attention", "tie_encoder_decoder", "cross_attention_hidden_size"}
# `config.name` and `getattr(config, "name"...)` in a model's source: the keys it reads.
_READS = re.compile(r"\bconfig\.([A-Za-z_]\w*)|getattr\(\s*(?:self\.)?config\s*,\s*[\"'](\w+)[\"']")
_PROBE_BATCH, _PROBE_TOKENS = 2, 8  # the meta-device forward that tells a classifier's kind


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


@dataclass(frozen=True)
class HFModel:
    """A resolved hf model source: the class, its validated config, what it trains and eats."""

    cls: type
    config: Any  # a transformers PreTrainedConfig
    inputs: InputSpec | None  # None: no synthetic batches (a python dataset feeds it)
    task: str | None = None  # one of data.TASKS; None: the batches say (python data)

    def build(self) -> nn.Module:
        # _from_config writes dtype and attention choices into the config: give each model its own.
        config = copy.deepcopy(self.config)
        attn = "sdpa" if getattr(self.cls, "_supports_sdpa", False) else "eager"
        # fp32 whatever dtype the config names: precision is the tuner's knob, applied later.
        return self.cls._from_config(config, attn_implementation=attn, **{_dtype_kwarg(): torch.float32})

    @property
    def label_shift(self) -> int:
        """How far the model shifts `labels` before its token loss (causal LMs predict the next)."""
        return 1 if self.task == "causal_lm" else 0


def resolve(class_name: str, config: dict, *, seq_len: int | None = None, synthetic: bool = True) -> HFModel:
    """Check the class and config without building real weights; `seq_len` overrides the
    config's. `synthetic`: autofit makes the batches (synthetic, tokens or text data), so
    the model's task must be one it can make batches for."""
    transformers = _transformers()
    try:
        cls = getattr(transformers, class_name, None)
    except (ImportError, RuntimeError) as exc:  # lazy import of a model whose own extras are missing
        raise SpecError(f"model.hf.class: {class_name} cannot be imported: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        close = difflib.get_close_matches(class_name, [n for n in dir(transformers) if n[:1].isupper()], n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        what = "is not a class in transformers" if not isinstance(cls, type) else "is not a model class"
        raise SpecError(f"model.hf.class: {class_name!r} {what}{hint}")
    hf_config = _config(cls, config)
    model = _meta_model(cls, hf_config, class_name)
    task, why = _task(cls, hf_config, model)
    if task == "classify" and getattr(hf_config, "pad_token_id", 0) is None:
        # Decoder classifiers pool the last non-pad token and refuse batches > 1 without a
        # pad id. Random ids that happen to equal 0 only move the pooled position.
        hf_config.pad_token_id = 0
    if task is None and synthetic:
        raise SpecError(f"model.hf.class: {class_name} {why}, so autofit cannot make its batches; give "
                        f"data.kind python with batches it takes (and loss.python if it computes no loss)")
    inputs = None
    if task is not None:
        try:
            inputs = _inputs(class_name, task, hf_config, seq_len, model)
        except SpecError:
            if synthetic:
                raise
    return HFModel(cls, hf_config, inputs, task)


def _meta_model(cls: type, hf_config: Any, class_name: str) -> nn.Module | None:
    # A config that builds the wrong model (a typo'd size, heads not dividing the width)
    # often fails only in the model's __init__: build once on the meta device, which
    # allocates nothing, so the user hears about it now and in one line.
    try:
        with torch.device("meta"):
            return HFModel(cls, hf_config, None).build()
    except (ValueError, TypeError, AssertionError) as exc:
        raise SpecError(f"model.hf.config: {class_name} cannot be built from this config: {exc}") from None
    except Exception:  # noqa: BLE001 - an op this model cannot run on meta; the real build will tell
        return None


def _task(cls: type, hf_config: Any, model: nn.Module | None) -> tuple[str | None, str]:
    """What the class trains, from its head: (task, "") or (None, why not)."""
    if model is None:
        return None, "cannot be built on the meta device to see its head"
    head = model.get_output_embeddings()
    if head is not None:
        if getattr(hf_config, "is_encoder_decoder", False):
            return "seq2seq", ""
        return ("causal_lm" if cls.can_generate() else "masked_lm"), ""
    if "labels" not in inspect.signature(model.forward).parameters:
        return None, "has no head that computes a loss (its forward takes no labels)"
    if model.main_input_name == "pixel_values":
        return "classify", ""
    if model.main_input_name != "input_ids":
        return None, f"takes {model.main_input_name}, not input_ids or pixel_values"
    # A label per sample or per token: the class's Auto mapping says which (a sequence
    # classifier's pooling reads token values, which the meta device does not have) ...
    registered = _registered_classifier(cls.__name__)
    if registered is not None:
        return registered, ""
    # ... else the logits' shape.
    config = copy.deepcopy(hf_config)
    if getattr(config, "pad_token_id", 0) is None:
        config.pad_token_id = 0
    try:
        with torch.device("meta"), torch.no_grad():
            logits = HFModel(cls, config, None).build()(
                input_ids=torch.zeros(_PROBE_BATCH, _PROBE_TOKENS, dtype=torch.long)).logits
    except Exception as exc:  # noqa: BLE001 - an op with no meta kernel: say so, do not guess
        return None, f"cannot run on the meta device to see its head ({type(exc).__name__})"
    return ("token_classify" if logits.ndim == 3 else "classify"), ""


def _registered_classifier(class_name: str) -> str | None:
    """`classify` or `token_classify` for a class transformers' Auto classes map to it."""
    from transformers.models.auto import modeling_auto

    for mapping, task in (("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "classify"),
                          ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "token_classify")):
        for names in getattr(modeling_auto, mapping, {}).values():
            if class_name in ((names,) if isinstance(names, str) else tuple(names)):
                return task
    return None


def _config(cls: type, config: dict) -> Any:
    config_class = cls.config_class
    try:
        hf_config = config_class(**config)
    except (ValueError, TypeError) as exc:
        raise SpecError(f"model.hf.config: {config_class.__name__} rejects this config: {exc}") from None
    # HF keeps a key it does not know as a plain attribute, so `n_lyer: 2` would silently
    # give the default depth. Such a key shows up in to_dict() while a default config has
    # no such attribute; keys the class consumes (aliases, legacy names) do not. A key the
    # config stores as given is still valid when the model's code reads it (T5's
    # decoder_start_token_id, which it shifts the labels behind).
    default_keys = set(config_class().to_dict())
    known = (default_keys | set(getattr(config_class, "attribute_map", {}))
             | set(inspect.signature(config_class.__init__).parameters) | _COMMON_CONFIG_KEYS
             | _keys_read(cls)) - {"self", "kwargs"}
    kept = hf_config.to_dict()
    for key in config:
        if key in kept and key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise SpecError(f"model.hf.config.{key}: unknown key for {config_class.__name__}{hint}")
    if hasattr(hf_config, "use_cache"):
        # The key/value cache only serves generation; in training it is memory for nothing.
        hf_config.use_cache = False
    if getattr(hf_config, "is_encoder_decoder", False) and getattr(hf_config, "decoder_start_token_id", None) is None:
        # The decoder reads the labels shifted right behind this token; transformers 5 moved
        # it to the generation config, and T5 documents it as the pad token.
        hf_config.decoder_start_token_id = getattr(hf_config, "pad_token_id", None)
    return hf_config


def _keys_read(cls: type) -> frozenset[str]:
    """The config keys the model class's code (its module and its transformers bases') reads."""
    keys: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("transformers."):
            keys |= _module_reads(klass.__module__)
    return frozenset(keys)


@functools.cache
def _module_reads(module_name: str) -> frozenset[str]:
    try:
        source = inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):  # no source shipped: nothing read that we can see
        return frozenset()
    return frozenset(a or b for a, b in _READS.findall(source))


def _inputs(class_name: str, task: str, config: Any, seq_len: int | None, model: nn.Module) -> InputSpec:
    n_classes = config.num_labels if task in ("classify", "token_classify") else None
    if model.main_input_name == "pixel_values":
        if seq_len is not None:
            raise SpecError(f"data.seq_len: {class_name} takes images, not token sequences")
        size = config.image_size
        size = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        return InputSpec(task=task, hf=True, feature_shape=(config.num_channels, *size), n_classes=n_classes)
    max_positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if seq_len is None:
        if max_positions is None:
            raise SpecError(f"data.seq_len: required for {class_name}: its config has neither "
                            f"n_positions nor max_position_embeddings")
        seq_len = max_positions
    elif max_positions is not None and seq_len > max_positions:
        raise SpecError(f"data.seq_len: at most the model's {max_positions} positions, got {seq_len}")
    return InputSpec(task=task, hf=True, seq_len=seq_len, vocab_size=config.vocab_size, n_classes=n_classes)
