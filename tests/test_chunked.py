"""`chunked_loss=true`: the LM head and cross-entropy in chunks (workload/chunked.py). Its
gradients against the plain loss's, and the peak it removes as the estimator predicts it."""

import pytest
import torch

from autofit.base.errors import SpecError
from autofit.config.spec import load_spec, parse_spec
from autofit.config.train_config import TrainConfig
from autofit.workload import build_workload
from autofit.workload.chunked import chunked_lm_loss, chunked_text_lm_loss, hf_chunkable
from autofit.workload.text import IGNORE_INDEX, text_lm_loss
from autofit.train.runner import Runner
from autofit.measure.fake_step import estimate_memory
from conftest import assert_tuned, REPO, tiny_gpt_dict, write_spec
from test_estimate import _tracked_peak

# A vocabulary 16x the width: the logits dominate the temporaries, as in a real LM.
LM = {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 512, "seq_len": 32}


@pytest.fixture
def lm_spec(tmp_path):
    return load_spec(write_spec(tmp_path, tiny_gpt_dict(model={"builtin": "gpt", "args": LM})))


def _grads(spec, precision: str, chunked: bool) -> list[torch.Tensor]:
    runner = Runner(spec, build_workload(spec), TrainConfig(precision=precision, micro_batch_size=8,
                                                            chunked_loss=chunked), device=torch.device("cpu"))
    with runner.policy.autocast("cpu"):
        loss = runner.loss_fn(runner.model, runner.global_batch(0)[0])
    loss.backward()
    return [p.grad.float() for p in runner.params]


def _error(grads, reference) -> float:
    return max(((g - r).norm() / r.norm()).item() for g, r in zip(grads, reference))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true"])
def test_gradients_match_the_plain_loss_within_the_precision_s_own_error(lm_spec, precision, one_thread):
    fp32 = _grads(lm_spec, "32-true", False)
    plain, chunked = _grads(lm_spec, precision, False), _grads(lm_spec, precision, True)
    if precision == "32-true":
        assert _error(chunked, plain) < 1e-5
    else:
        # 16-bit math is off fp32 by its rounding; the chunked loss may differ from the plain
        # one by rounding too (other summation order), not by more than twice that.
        assert _error(chunked, fp32) < 2 * _error(plain, fp32) + 1e-3


def test_the_peak_drops_by_the_logits_and_their_gradient_as_predicted(lm_spec, one_thread):
    plain, chunked = TrainConfig(micro_batch_size=8), TrainConfig(micro_batch_size=8, chunked_loss=True)
    estimates = {c: estimate_memory(lm_spec, c) for c in (plain, chunked)}
    peaks = {c: _tracked_peak(lm_spec, c) for c in (plain, chunked)}
    assert estimates[chunked].peak_bytes == pytest.approx(peaks[chunked], rel=0.01)
    predicted, measured = (estimates[plain].peak_bytes - estimates[chunked].peak_bytes,
                           peaks[plain] - peaks[chunked])
    assert measured == pytest.approx(predicted, rel=0.02)
    logits_bytes = 8 * LM["seq_len"] * LM["vocab_size"] * 4  # fp32 [micro batch x tokens, vocabulary]
    assert measured >= 2 * logits_bytes  # neither the logits nor their gradient is held any more
    assert estimates[chunked].temporaries_bytes < logits_bytes


def test_hf_causal_lm_and_text_losses_match_their_plain_forms(one_thread):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=16,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    assert hf_chunkable(config) and not hf_chunkable(transformers.Gemma2Config(final_logit_softcapping=30.0))
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(256, (4, 16))
    labels = ids.clone()
    mask = torch.ones_like(ids)
    labels[0, 10:], mask[0, 10:] = IGNORE_INDEX, 0  # a padded sample
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    plain = model(**batch).loss
    plain_grads = torch.autograd.grad(plain, list(model.parameters()))
    chunked = chunked_lm_loss(model, batch)
    chunked_grads = torch.autograd.grad(chunked, list(model.parameters()))
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)
    assert _error(chunked_grads, plain_grads) < 1e-5
    # Text data: the mean over samples of each sample's mean token loss, padding ignored.
    assert chunked_text_lm_loss(model, batch).item() == pytest.approx(text_lm_loss(model, batch).item(), rel=1e-6)


def test_offered_only_where_the_workload_is_a_language_model(tmp_path):
    from autofit.device.probe import cpu_device
    from autofit.tuning.space import search_space

    mlp = tiny_gpt_dict(model={"builtin": "mlp", "args": {"in_features": 8, "hidden": 16, "n_layer": 2,
                                                          "n_classes": 4}},
                        search={"chunked_loss": [False, True]})
    spec = parse_spec(mlp, source_dir=REPO)
    assert build_workload(spec).chunked_loss_fn is None
    with pytest.raises(SpecError, match="search.chunked_loss: only for language-model heads"):
        search_space(spec, cpu_device())
    with pytest.raises(SpecError, match="chunked_loss: only for language-model heads"):
        Runner(spec, build_workload(spec), TrainConfig(micro_batch_size=8, chunked_loss=True),
               device=torch.device("cpu"))
    gpt = parse_spec(tiny_gpt_dict(search={"chunked_loss": [False, True]}), source_dir=REPO)
    assert "chunked_loss" in [k.field for k in search_space(gpt, cpu_device()).knobs()]
    with pytest.raises(SpecError, match="chunked_loss: runs in one process only"):
        TrainConfig(micro_batch_size=4, world_size=2, parallelism="ddp", chunked_loss=True)


@pytest.mark.slow  # a tune (child processes), autofit train and a plain loop: ~1 minute
def test_a_budget_only_the_chunked_loss_meets_is_tuned_trained_and_applied(tmp_path):
    """An LM whose vocabulary is 256x its width under 4 MiB: no config without the chunked
    loss fits (checkpointing leaves the logits where they are; the estimator says so, so no
    trial is spent on them), so the tune must pick it, and the profile trains through
    `autofit train` and through `profile.apply`."""
    import json

    import autofit
    from autofit.device.memory import LiveBytesTracker
    from autofit.profiles.profile import Profile
    from conftest import run_cli

    args = {"n_layer": 2, "n_head": 2, "n_embd": 16, "vocab_size": 4096, "seq_len": 64}
    search = {"precisions": ["32-true"], "chunked_loss": [False, True], "trials": 2, "patience": 2,
              "warmup_steps": 0, "measure_steps": 1, "validate_steps": 2, "frontier_points": 1,
              "memory_headroom": 0.0}
    spec_path = write_spec(tmp_path, tiny_gpt_dict(model={"builtin": "gpt", "args": args}, search=search,
                                                   train={"global_batch_size": 4, "steps": 3}))
    spec, budget = load_spec(spec_path), 4 * 2**20
    smallest_plain = estimate_memory(spec, TrainConfig(micro_batch_size=1, grad_accum_steps=4, checkpoint_blocks=2))
    assert smallest_plain.peak_bytes > budget  # the premise: nothing without the knob fits

    result = run_cli("tune", spec_path, "--device", "cpu", "--memory-budget", "4MiB", "--out", tmp_path / "profiles",
                     "--state-dir", tmp_path / "state", "--json", cwd=tmp_path)
    assert_tuned(result)
    profile_path = json.loads(result.stdout)["profile_path"]
    profile = Profile.load(profile_path)
    assert profile.config.chunked_loss and profile.measured.peak_memory_bytes <= budget
    assert "chunked_loss: true" in profile.to_yaml()

    metrics_path = tmp_path / "metrics.json"
    trained = run_cli("train", spec_path, "--profile", profile_path, "--steps", "3", "--no-progress",
                      "--memory-budget", "4MiB", "--checkpoint-dir", tmp_path / "ckpt",
                      "--metrics-out", metrics_path, cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    metrics = json.loads(metrics_path.read_text())
    assert metrics["config"]["chunked_loss"] is True and metrics["peak_memory_bytes"] <= budget

    # A plain loop: the user's model, the plan, the chunked loss, under the same budget.
    workload = build_workload(spec)
    torch.manual_seed(0)
    with LiveBytesTracker(budget_bytes=int(budget)) as tracker:
        with profile.apply(workload.build_model(), memory_budget="4MiB") as plan:
            losses = [plan.step(batch=workload.data.batch(4, torch.Generator().manual_seed(step)),
                                loss_fn=autofit.chunked_lm_loss) is not None and plan.last_loss.item()
                      for step in range(3)]
    assert plan.config.chunked_loss and all(torch.isfinite(torch.tensor(losses)))
    assert tracker.peak_bytes <= budget
