"""autofit.workload: built-in models, hf models, data sources, batch helpers, example data."""

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from autofit.base.errors import SpecError
from autofit.config.spec import parse_spec
from autofit.workload import batch_size_of, batch_to, build_workload, BUILTIN_MODELS, split_batch
from autofit.workload.data import MASKED_FRACTION

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "examples" / "data"
TINY = {
    "gpt": {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 256, "seq_len": 16},
    "mlp": {"in_features": 12, "hidden": 16, "n_layer": 3, "n_classes": 4},
    "convnet": {"image_size": 8, "channels": 8, "n_blocks": 2, "n_classes": 5},
}
TINY_GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 32}
TINY_BERT = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
             "vocab_size": 128, "max_position_embeddings": 32}


def make_spec(model: dict, data: dict | None = None, source_dir: Path = REPO):
    raw = {"name": "test", "model": model, "train": {"global_batch_size": 4}}
    if data is not None:
        raw["data"] = data
    return parse_spec(raw, source_dir=source_dir)


def builtin(name: str, data: dict | None = None, **args):
    return build_workload(make_spec({"builtin": name, "args": TINY[name] | args}, data))


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_trains(workload, batch_size: int = 4) -> float:
    torch.manual_seed(0)
    model = workload.build_model()
    loss = workload.loss_fn(model, workload.data.batch(batch_size, gen()))
    assert loss.ndim == 0 and math.isfinite(loss.item())
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    return loss.item()


# ---- built-in models -----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_builtin_builds_and_trains(name):
    workload = builtin(name)
    assert_trains(workload)
    model = workload.build_model()
    assert isinstance(model.blocks, nn.ModuleList) and len({type(b) for b in model.blocks}) == 1
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())


def test_builtin_shapes_are_described():
    assert builtin("gpt").sample_shape == "tokens[16]" and builtin("gpt").tokens_per_sample == 16
    assert builtin("mlp").sample_shape == "features[12]" and builtin("mlp").tokens_per_sample is None
    assert builtin("convnet").sample_shape == "image[3x8x8]"


def test_gpt_build_is_deterministic_and_head_untied():
    workload = builtin("gpt")
    torch.manual_seed(3)
    a = workload.build_model()
    torch.manual_seed(3)
    b = workload.build_model()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert a.lm_head.weight.data_ptr() != a.wte.weight.data_ptr()


def test_unknown_arg_suggests_the_close_one():
    with pytest.raises(SpecError) as err:
        builtin("gpt", n_lyer=2)
    assert str(err.value).startswith("model.args.n_lyer: unknown key; allowed: n_layer, n_head")
    assert str(err.value).endswith("did you mean n_layer?")


def test_n_head_must_divide_n_embd():
    with pytest.raises(SpecError, match=r"^model\.args\.n_head: must divide n_embd \(768\), got 5$"):
        builtin("gpt", n_embd=768, n_head=5)


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "2"])
def test_layer_count_must_be_positive_int(bad):
    with pytest.raises(SpecError, match=r"^model\.args\.n_layer: must be a positive integer"):
        builtin("mlp", n_layer=bad)


def test_missing_arg_and_unknown_model():
    with pytest.raises(SpecError, match=r"^model\.args\.vocab_size: required key is missing"):
        args = {"n_layer": 1, "n_head": 1, "n_embd": 8, "seq_len": 8}
        build_workload(make_spec({"builtin": "gpt", "args": args}))
    with pytest.raises(SpecError, match=r"^model\.builtin: unknown model 'gtp'.*did you mean gpt\?"):
        build_workload(make_spec({"builtin": "gtp"}))


def test_data_seq_len_override():
    workload = builtin("gpt", {"kind": "synthetic", "seq_len": 8})
    x, y = workload.data.batch(2, gen())
    assert x.shape == (2, 8) and workload.tokens_per_sample == 8
    with pytest.raises(SpecError, match=r"^data\.seq_len: at most model\.args\.seq_len \(16\), got 32"):
        builtin("gpt", {"kind": "synthetic", "seq_len": 32})


# ---- data sources --------------------------------------------------------------------------


def test_synthetic_lm_targets_are_next_tokens():
    x, y = builtin("gpt").data.batch(3, gen())
    assert x.shape == y.shape == (3, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_token_windows_are_shifted_and_deterministic():
    workload = builtin("gpt", {"kind": "tokens", "path": str(DATA / "train.bin")})
    tokens = np.memmap(DATA / "train.bin", dtype="<u2", mode="r")
    x, y = workload.data.batch(8, gen(1))
    assert x.shape == y.shape == (8, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    windows = np.lib.stride_tricks.sliding_window_view(tokens, 17)
    for row_x, row_y in zip(x.numpy(), y.numpy()):
        assert (windows == np.concatenate([row_x, row_y[-1:]])).all(axis=1).any()
    again = workload.data.batch(8, gen(1))
    assert torch.equal(x, again[0]) and torch.equal(y, again[1])
    assert not torch.equal(x, workload.data.batch(8, gen(2))[0])
    assert_trains(workload)


def write_tokens(path: Path, ids) -> Path:
    np.asarray(ids, dtype="<u2").tofile(path)
    return path


@pytest.mark.parametrize("case, pattern", [
    ("missing", r"^data\.path: no such file"),
    ("short", r"^data\.path: .* holds 10 tokens; one window of seq_len \+ 1 = 17"),
    ("vocab", r"^data\.path: .* has token id 300 at position 20, not below the model's vocab_size \(256\)"),
])
def test_bad_token_files(tmp_path, case, pattern):
    path = tmp_path / "tokens.bin"
    if case == "short":
        write_tokens(path, range(10))
    elif case == "vocab":
        write_tokens(path, [1] * 20 + [300] + [2] * 50)
    with pytest.raises(SpecError, match=pattern):
        builtin("gpt", {"kind": "tokens", "path": str(path)})


def test_tokens_need_a_causal_lm(tmp_path):
    path = write_tokens(tmp_path / "tokens.bin", range(100))
    with pytest.raises(SpecError, match=r"^data\.kind: tokens data .* causal language models; model\.builtin mlp"):
        builtin("mlp", {"kind": "tokens", "path": str(path)})


def test_batch_helpers():
    x, y = torch.arange(12).view(6, 2), torch.arange(6)
    parts = split_batch((x, y), 2)
    assert len(parts) == 3 and all(batch_size_of(p) == 2 for p in parts)
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    parts = split_batch({"input_ids": x, "labels": y}, 3)
    assert [sorted(p) for p in parts] == [["input_ids", "labels"]] * 2
    assert torch.equal(parts[1]["labels"], y[3:])
    with pytest.raises(AssertionError):
        split_batch((x, y), 4)
    moved = batch_to({"a": x}, torch.device("cpu"))
    assert torch.equal(moved["a"], x) and batch_size_of((x, y)) == 6


# ---- python sources ------------------------------------------------------------------------


USER_MODULE = '''
import torch, torch.nn as nn
class Squares(torch.utils.data.Dataset):
    def __init__(self, n, dim): self.x = torch.randn(n, dim, generator=torch.Generator().manual_seed(0))
    def __len__(self): return len(self.x)
    def __getitem__(self, i): return self.x[i], int(self.x[i].sum() > 0)
def make_data(n=20, dim=6): return Squares(n, dim)
def make_model(dim=6): return nn.Sequential(nn.Linear(dim, 8), nn.ReLU(), nn.Linear(8, 2))
'''


def test_python_model_and_dataset(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "user_mod_a.py").write_text(USER_MODULE)
    spec = make_spec({"python": "user_mod_a:make_model", "args": {"dim": 6}},
                     {"kind": "python", "factory": "user_mod_a:make_data", "args": {"n": 10}}, tmp_path)
    workload = build_workload(spec)
    assert workload.sample_shape == "x[6] y[]" and workload.tokens_per_sample is None
    assert torch.equal(workload.data.batch(4, gen(5))[0], workload.data.batch(4, gen(5))[0])
    assert_trains(workload)


def test_python_source_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "user_mod_b.py").write_text(USER_MODULE)
    with pytest.raises(SpecError, match=r"^model\.python: cannot import module 'no_such_mod'"):
        build_workload(make_spec({"python": "no_such_mod:build"}, source_dir=tmp_path))
    with pytest.raises(SpecError, match=r"^data\.factory: module 'user_mod_b' has no function 'nope'"):
        build_workload(make_spec({"python": "user_mod_b:make_model"},
                                 {"kind": "python", "factory": "user_mod_b:nope"}, tmp_path))
    with pytest.raises(SpecError, match=r"^model\.args: user_mod_b:make_model cannot take these arguments"):
        build_workload(make_spec({"python": "user_mod_b:make_model", "args": {"width": 3}},
                                 {"kind": "python", "factory": "user_mod_b:make_data"}, tmp_path))
    with pytest.raises(SpecError, match=r"^data\.kind: synthetic data needs a builtin or hf model"):
        build_workload(make_spec({"python": "user_mod_b:make_model"}, source_dir=tmp_path))


# ---- Hugging Face --------------------------------------------------------------------------


def hf_workload(cls: str, config: dict, data: dict | None = None):
    return build_workload(make_spec({"hf": {"class": cls, "config": config}}, data))


def test_hf_gpt2_on_shipped_tokens():
    pytest.importorskip("transformers")
    workload = hf_workload("GPT2LMHeadModel", TINY_GPT2, {"kind": "tokens", "path": str(DATA / "train.bin")})
    batch = workload.data.batch(2, gen())
    assert torch.equal(batch["input_ids"], batch["labels"]) and batch["input_ids"].shape == (2, 32)
    assert workload.tokens_per_sample == 32
    assert_trains(workload, batch_size=2)
    model = workload.build_model()
    assert model.config.use_cache is False and isinstance(model.transformer.h, nn.ModuleList)


def test_hf_bert_masked_lm():
    pytest.importorskip("transformers")
    workload = hf_workload("BertForMaskedLM", TINY_BERT)
    batch = workload.data.batch(4, gen())
    labelled = batch["labels"] != -100
    # Same count in every row, so equal micro batches average exactly to the whole batch.
    assert labelled.sum(dim=1).tolist() == [round(MASKED_FRACTION * 32)] * 4
    assert torch.equal(batch["labels"][labelled], batch["input_ids"][labelled])
    assert torch.equal(batch["labels"], workload.data.batch(4, gen())["labels"])
    assert_trains(workload)
    assert isinstance(workload.build_model().bert.encoder.layer, nn.ModuleList)


def test_hf_sequence_classification():
    pytest.importorskip("transformers")
    workload = hf_workload("GPT2ForSequenceClassification", TINY_GPT2 | {"num_labels": 3})
    labels = workload.data.batch(16, gen())["labels"]
    assert labels.shape == (16,) and 0 <= labels.min() and labels.max() < 3
    assert_trains(workload)


def test_hf_errors(monkeypatch):
    pytest.importorskip("transformers")
    with pytest.raises(SpecError, match=r"^model\.hf\.class: BertModel has no head that computes a loss .* "
                                        r"give data\.kind python"):
        hf_workload("BertModel", TINY_BERT)
    with pytest.raises(SpecError, match=r"^model\.hf\.class: 'GPT2LMHeadModl' is not a class.*GPT2LMHeadModel"):
        hf_workload("GPT2LMHeadModl", TINY_GPT2)
    with pytest.raises(SpecError, match=r"^model\.hf\.config\.n_lyer: unknown key .* did you mean n_layer"):
        hf_workload("GPT2LMHeadModel", TINY_GPT2 | {"n_lyer": 3})
    with pytest.raises(SpecError, match=r"^data\.kind: tokens data .* masked lm"):
        hf_workload("BertForMaskedLM", TINY_BERT, {"kind": "tokens", "path": str(DATA / "train.bin")})
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(SpecError, match=r"^model\.hf: the hf source needs transformers: pip install"):
        hf_workload("GPT2LMHeadModel", TINY_GPT2)


# ---- shipped example data ------------------------------------------------------------------


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_tokens_decode_to_the_text():
    tokenize = load_script("tokenize_bytes")
    train = np.memmap(DATA / "train.bin", dtype="<u2", mode="r")
    val = np.memmap(DATA / "val.bin", dtype="<u2", mode="r")
    assert 200_000 <= len(train) + len(val) <= 1_500_000 and len(val) > 0
    text = tokenize.decode(np.concatenate([train, val]))
    assert text == (DATA / "shakespeare.txt").read_text()
    assert text.startswith("HAMLET, PRINCE OF DENMARK")


def test_tokenize_script_round_trip(tmp_path):
    tokenize = load_script("tokenize_bytes")
    (tmp_path / "t.txt").write_text("To be, or not to be: that is the question. — ¶\n" * 10)
    assert tokenize.main([str(tmp_path / "t.txt"), "--val-fraction", "0.2"]) == 0
    parts = [np.fromfile(tmp_path / f, dtype="<u2") for f in ("train.bin", "val.bin")]
    assert len(parts[1]) == int(0.2 * (len(parts[0]) + len(parts[1])))
    assert tokenize.decode(np.concatenate(parts)) == (tmp_path / "t.txt").read_text()
