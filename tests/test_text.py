"""data.kind text: tokenizing and its cache, padding, packing, epochs, the loss's invariance
to how a step is cut, and bad corpora."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from autofit.config.spec import parse_spec
from autofit.device.budget import Budget
from autofit.workload import build_workload, text
from conftest import EXAMPLES, run_main, tiny_gpt_dict, write_spec

CORPUS = EXAMPLES / "data" / "speeches.jsonl"
TOKENIZER = EXAMPLES / "data" / "tokenizer.json"
TEXT_GPT_ARGS = {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 512, "seq_len": 32}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))


def text_spec_dict(data: dict | None = None, **sections) -> dict:
    """A 2-layer GPT on the shipped corpus, samples of up to 33 tokens; `data` adds data keys."""
    return tiny_gpt_dict(name="tiny-text", model={"builtin": "gpt", "args": dict(TEXT_GPT_ARGS)},
                         data={"kind": "text", "path": str(CORPUS), "tokenizer": str(TOKENIZER),
                               "max_length": 33, **(data or {})}, **sections)


def workload(tmp_path, **data):
    return build_workload(parse_spec(text_spec_dict(data), source_dir=tmp_path))


def test_tokenizes_once_then_reads_the_cache(tmp_path, monkeypatch):
    first = workload(tmp_path).data
    assert first.n_samples == 400 and first.longest_tokens == 33
    assert list((tmp_path / "cache" / "text").glob("*.npz"))

    def no_tokenizing(*args):
        raise AssertionError("tokenized again")
    monkeypatch.setattr(text, "_read_documents", no_tokenizing)
    again = workload(tmp_path, max_length=20).data  # the cache holds whole documents
    assert np.array_equal(again.lengths, np.minimum(first.lengths, 20))


def test_dynamic_padding_pads_each_micro_batch_to_its_longest(tmp_path):
    data = workload(tmp_path).data
    steps = [data.step_batches(step, 0, 8, 2) for step in range(data.steps_per_epoch(8))]
    widths = []
    for micro_batches in steps:
        for x, y in micro_batches:
            real = (y != text.IGNORE_INDEX).sum(dim=1)
            assert x.shape[1] == y.shape[1] == int(real.max())  # no column of padding only
            widths.append(x.shape[1])
    assert min(widths) < 8 and max(widths) == 32
    fixed = workload(tmp_path, padding="max_length").data
    assert {x.shape[1] for x, _ in fixed.step_batches(0, 0, 8, 2)} == {32}
    multiple = workload(tmp_path, pad_to_multiple_of=8).data
    assert all(x.shape[1] % 8 == 0 for x, _ in multiple.step_batches(0, 0, 8, 2))


def test_an_epoch_sees_every_sample_once(tmp_path):
    data = workload(tmp_path).data
    spe = data.steps_per_epoch(8)
    seen = np.concatenate([data.step_indices(step, 0, 8) for step in range(spe)])
    assert len(seen) == len(set(seen.tolist())) == spe * 8 == 400
    assert not np.array_equal(data.step_indices(0, 0, 8), data.step_indices(spe, 0, 8))  # reshuffled


def test_bucketing_sorts_a_step_without_changing_its_samples(tmp_path):
    data = workload(tmp_path).data
    plain, bucketed = data.step_batches(3, 0, 8, 2), data.step_batches(3, 0, 8, 2, length_bucketing=True)
    assert sum(x.numel() for x, _ in bucketed) < sum(x.numel() for x, _ in plain)
    assert text.count_tokens(plain) == text.count_tokens(bucketed)


def test_worst_case_is_the_longest_samples(tmp_path):
    data = workload(tmp_path).data
    worst = data.worst_case_batches(8, 4)
    assert len(worst) == 2 and worst[0][0].shape == (4, 32) and (worst[0][1] != text.IGNORE_INDEX).all()
    # The same samples at every micro batch: configs are compared on one step.
    assert text.count_tokens(data.worst_case_batches(8, 1)) == text.count_tokens(worst)


def test_packing_fills_every_window(tmp_path):
    data = workload(tmp_path, packing=True).data
    corpus_tokens = 24913  # the shipped corpus, plus one end-of-text token per speech
    assert data.n_samples == (corpus_tokens + 400) // 33
    for x, y in data.step_batches(0, 0, 8, 4):
        assert x.shape == (4, 32) and (y != text.IGNORE_INDEX).all()


def test_loss_is_the_same_however_a_step_is_cut(tmp_path):
    """Per-sample mean: 1 x 8, 4 x 2 and a length-sorted 4 x 2 give one gradient."""
    w = workload(tmp_path)
    grads = []
    for micro, bucketed in ((8, False), (2, False), (2, True)):
        torch.manual_seed(0)
        model = w.build_model()
        micro_batches = w.data.step_batches(5, 0, 8, micro, bucketed)
        for mb in micro_batches:
            (w.loss_fn(model, mb) / len(micro_batches)).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0], rtol=1e-5, atol=1e-6)


def _bad_corpus(tmp_path: Path, fault: str) -> dict:
    corpus = tmp_path / "corpus.jsonl"
    tokenizer = tmp_path / "tokenizer.json"
    shutil.copy(TOKENIZER, tokenizer)
    lines = [json.dumps({"text": "To be, or not to be"}).encode(), json.dumps({"text": "that is the question"}).encode()]
    if fault == "empty corpus":
        lines = [b"", b"  "]
    elif fault == "non-UTF-8 line":
        lines[1] = b'{"text": "caf\xe9"}'
    elif fault == "missing field":
        lines[1] = json.dumps({"body": "that is the question"}).encode()
    elif fault == "missing tokenizer":
        tokenizer.unlink()
    corpus.write_bytes(b"\n".join(lines) + b"\n")
    return {"path": str(corpus), "tokenizer": str(tokenizer)}


@pytest.mark.parametrize(("fault", "message"), [
    ("missing tokenizer", "data.tokenizer: no such file: "),
    ("empty corpus", "is an empty corpus"),
    ("non-UTF-8 line", "line 2 is not UTF-8 (byte 0xe9 at column 14)"),
    ("missing field", "data.field: "),
])
def test_bad_corpus_is_one_line_and_exit_2(tmp_path, capsys, fault, message):
    path = write_spec(tmp_path, text_spec_dict(_bad_corpus(tmp_path, fault)))
    code, _, err = run_main(capsys, "train", path, "--steps", "1", "--no-progress",
                            "--checkpoint-dir", tmp_path / "run")
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and message in err, err
    if fault == "missing field":
        assert "line 2 has no field 'text' (its keys: body)" in err


@pytest.mark.slow
def test_tune_fits_the_longest_batch_and_an_epoch_stays_within_budget(tmp_path):
    """A tune with dynamic padding measures each trial's peak on the corpus's longest samples;
    a whole epoch trained with its profile stays within the budget and under that peak (the
    CPU tracker watches every step wider than any before it, so it sees the epoch's largest).
    A demotion recorded beside the profile is where the tune starts, and the config it left
    is not chosen again."""
    from autofit.device.probe import select_device
    from autofit.measure.fake_step import estimate_memory
    from autofit.config.train_config import TrainConfig
    from autofit.train.recover import Demotion
    from autofit.train.loop import train
    from autofit.profiles.demotions import record_demotion
    from autofit.tuning.tune import tune, TuneSetup

    spec = parse_spec(text_spec_dict(train={"global_batch_size": 16}, search={
        "precisions": ["32-true", "bf16-mixed"], "trials": 4, "patience": 3, "warmup_steps": 0,
        "measure_steps": 1, "validate_steps": 2, "memory_headroom": 0.0}), source_dir=tmp_path)
    full = estimate_memory(spec, TrainConfig(micro_batch_size=16)).peak_bytes
    budget = int(full * 0.75)  # the whole batch at once does not fit its longest samples
    left, resumed_at = TrainConfig(micro_batch_size=8, grad_accum_steps=2), TrainConfig(micro_batch_size=4,
                                                                                       grad_accum_steps=4)
    record_demotion(tmp_path / "store" / "tiny-text--cpu.yaml", Demotion(
        step=7, from_config=left, to_config=resumed_at, reason="out of memory", time="2026-11-22T00:00:00Z"),
        spec_hash=spec.spec_hash)
    outcome = tune(TuneSetup(spec=spec, device=select_device("cpu"), budget=Budget(usable_bytes=budget),
                             out_dir=tmp_path / "store", storage=None, report=False))
    profile = outcome.profile
    assert outcome.result.records[0].config == resumed_at and profile.config != left
    assert profile.data["longest_tokens"] == 33 and profile.data["padding"] == "dynamic"
    assert outcome.validated.peak_memory_bytes <= budget

    workload = build_workload(spec)
    epoch = workload.data.steps_per_epoch(16)
    metrics = train(spec, workload, profile.config, device=torch.device("cpu"), steps=epoch, progress=False,
                    memory_budget_bytes=budget)
    assert metrics["steps"] == epoch and not metrics["demotions"]
    assert metrics["peak_memory_bytes"] <= outcome.validated.peak_memory_bytes <= budget
    assert 0 < metrics["tokens_per_s"] < metrics["samples_per_s"] * 32  # non-pad tokens only


def test_bucketing_is_searched_only_where_it_can_help(tmp_path):
    from autofit.device.probe import select_device
    from autofit.tuning.space import search_space

    cpu = select_device("cpu")
    for data, searched in (({}, True), ({"padding": "max_length"}, False), ({"packing": True}, False)):
        space = search_space(parse_spec(text_spec_dict(data), source_dir=tmp_path), cpu)
        assert ("length_bucketing" in {k.field for k in space.knobs()}) == searched


def test_hf_causal_lm_trains_on_text_with_an_attention_mask(tmp_path):
    pytest.importorskip("transformers")
    raw = text_spec_dict({"max_length": 32})
    raw["model"] = {"hf": {"class": "GPT2LMHeadModel", "config": {"n_layer": 1, "n_embd": 32, "n_head": 2,
                                                                 "vocab_size": 512, "n_positions": 32,
                                                                 # no dropout: its masks differ by batch shape
                                                                 "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                                                 "attn_pdrop": 0.0}}}
    w = build_workload(parse_spec(raw, source_dir=tmp_path))
    grads = []
    for micro in (8, 2):
        torch.manual_seed(0)
        model = w.build_model()
        micro_batches = w.data.step_batches(2, 0, 8, micro)
        assert set(micro_batches[0]) == {"input_ids", "attention_mask", "labels"}
        for mb in micro_batches:
            (w.loss_fn(model, mb) / len(micro_batches)).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
