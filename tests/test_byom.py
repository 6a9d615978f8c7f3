"""Bring your own model: models written in third-party styles (tests/fixtures/byom_models.py),
unchanged, trained from a spec. Each row of issue 25's table: a tuple model, a dict model,
logits only, a loss of the user's own, a Hugging Face encoder-decoder, blocks in
nn.Sequential, a sequence-first model refused; each trains 10 steps with a falling loss."""

import json
import shutil
import sys
import time

import pytest
import torch
import torch.nn as nn

from autofit.base.errors import SpecError, UserCodeError
from autofit.config.spec import parse_spec
from autofit.config.train_config import TrainConfig
from autofit.device.probe import cpu_device
from autofit.workload import build_workload, make_workload, split_batch
from autofit.workload.batch_dim import check_batch_dim
from autofit.train.configure import apply_checkpointing, find_block_stack
from autofit.train.runner import Runner
from autofit.tuning.space import search_space
from conftest import assert_tuned, FIXTURES, REPO, run_cli, run_main, write_spec

TOKENS = str(REPO / "examples" / "data" / "train.bin")
NANO_CONFIG = {"python": "byom_models:GPTConfig", "args": {"n_layer": 2, "n_embd": 32, "block_size": 32}}
TINY_T5 = {"num_layers": 2, "num_decoder_layers": 2, "d_model": 32, "d_ff": 64, "num_heads": 2, "d_kv": 16,
           "vocab_size": 64}
TINY_GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 32,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # no dropout: steps compare exactly


@pytest.fixture(autouse=True)
def _fixture_modules(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the spec's folder joins it; leave it as it was


def spec_dict(model: dict, data: dict, *, loss: dict | None = None, global_batch_size: int = 8,
              lr: float = 1e-2, **sections) -> dict:
    raw = {"schema": 1, "name": "byom", "model": model, "data": data, "optimizer": {"name": "adamw", "lr": lr},
           "train": {"global_batch_size": global_batch_size, "steps": 10, "seed": 0},
           "search": {"trials": 4, "warmup_steps": 1, "measure_steps": 1, "validate_steps": 2, "frontier_points": 1}}
    if loss is not None:
        raw["loss"] = loss
    return raw | sections


def make_spec(*args, **kwargs):
    return parse_spec(spec_dict(*args, **kwargs), source_dir=FIXTURES)


def train_steps(spec, steps: int = 10, **config) -> list[float]:
    """`steps` optimizer steps of the real runner (the probe first, as `autofit train` does)."""
    workload = build_workload(spec)
    check_batch_dim(workload)
    micro = config.pop("micro_batch_size", spec.train.global_batch_size)
    config = TrainConfig(micro_batch_size=micro, grad_accum_steps=spec.train.global_batch_size // micro, **config)
    runner = Runner(spec, workload, config, device=torch.device("cpu"))
    return [float(runner.step(runner.global_batch(step)).loss) for step in range(steps)]


def assert_falls(losses: list[float]) -> None:
    assert len(losses) == 10 and all(map(torch.isfinite, torch.tensor(losses))), losses
    assert sum(losses[-3:]) < sum(losses[:3]), losses


# ---- outputs and targets --------------------------------------------------------------------


def test_nanogpt_style_tuple_model_trains_from_a_config_object(one_thread):
    """GPT(GPTConfig): the spec builds the config object; forward(idx, targets) gets the targets
    by name and returns (logits, loss); its `targets.view(-1)` needs contiguous token batches."""
    spec = make_spec({"python": "byom_models:GPT", "args": {"config": NANO_CONFIG}},
                     {"kind": "tokens", "path": TOKENS, "seq_len": 32})
    model = build_workload(spec).build_model()
    assert model.config.n_layer == 2 and type(model.config).__name__ == "GPTConfig"
    assert find_block_stack(model)[0] == "transformer.h"
    assert_falls(train_steps(spec, micro_batch_size=2, checkpoint_blocks=1))


def test_token_batches_are_contiguous():
    spec = make_spec({"python": "byom_models:GPT", "args": {"config": NANO_CONFIG}},
                     {"kind": "tokens", "path": TOKENS, "seq_len": 32})
    x, y = build_workload(spec).data.batch(4, torch.Generator().manual_seed(0))
    assert x.is_contiguous() and y.is_contiguous()
    assert all(t.is_contiguous() for part in split_batch((x, y), 2) for t in part)


def test_dict_model_gets_its_labels_by_name():
    """forward(x, labels=None) -> {"loss", "logits"}, from (x, y) batches."""
    spec = make_spec({"python": "byom_models:DictClassifier"}, {"kind": "python", "factory": "byom_models:separable"})
    assert_falls(train_steps(spec))


def test_logits_get_cross_entropy_against_the_batch_targets():
    """forward(x) -> logits; the dict batch's `y` is not a parameter, so it is the target."""
    spec = make_spec({"python": "byom_models:LogitsNet"},
                     {"kind": "python", "factory": "byom_models:separable", "args": {"as_dict": True}})
    assert_falls(train_steps(spec, micro_batch_size=4))


def test_forward_that_requires_its_targets_gets_them_positionally():
    spec = make_spec({"python": "byom_models:NeedsItsTargets"}, {"kind": "python", "factory": "byom_models:separable"})
    assert_falls(train_steps(spec))


def test_an_output_without_a_loss_names_what_came_back_and_the_three_fixes():
    spec = make_spec({"python": "byom_models:ReturnsNothingUseful"},
                     {"kind": "python", "factory": "byom_models:separable"})
    with pytest.raises(SpecError) as err:
        train_steps(spec, steps=1)
    message = str(err.value)
    assert "ReturnsNothingUseful.forward returned dict{hidden: Tensor[3, 4]}" in message
    assert all(fix in message for fix in ("return the loss from forward", "give forward its targets",
                                          "name your own loss"))


# ---- a loss of the user's own ---------------------------------------------------------------


CONTRASTIVE = {"python": "byom_models:contrastive_loss", "args": {"temperature": 0.1}, "per_sample": False}


def test_own_loss_with_in_batch_negatives_trains_as_one_micro_batch():
    spec = make_spec({"python": "byom_models:TwoTower"}, {"kind": "python", "factory": "byom_models:pairs"},
                     loss=CONTRASTIVE)
    assert_falls(train_steps(spec))
    space = search_space(spec, cpu_device())
    assert space.micro_batch_sizes == (8,) and space.micro_batch_floor.excludes_accumulation
    assert "loss.per_sample is false" in space.micro_batch_floor.reason
    with pytest.raises(SpecError, match=r"^loss\.per_sample: .* --nproc 2"):
        search_space(spec, cpu_device(), nproc=2)
    # The spec hash covers the loss: a profile for another loss is another profile.
    assert spec.spec_hash != make_spec({"python": "byom_models:TwoTower"},
                                       {"kind": "python", "factory": "byom_models:pairs"},
                                       loss={**CONTRASTIVE, "args": {"temperature": 0.5}}).spec_hash


def test_train_refuses_a_profile_that_splits_a_batch_whose_loss_couples_samples(tmp_path, capsys):
    from test_profile import make_profile

    shutil.copy(FIXTURES / "byom_models.py", tmp_path)
    path = write_spec(tmp_path, spec_dict({"python": "byom_models:TwoTower"},
                                          {"kind": "python", "factory": "byom_models:pairs"}, loss=CONTRASTIVE))
    spec = parse_spec(spec_dict({"python": "byom_models:TwoTower"}, {"kind": "python", "factory": "byom_models:pairs"},
                                loss=CONTRASTIVE), source_dir=tmp_path)
    profile = make_profile(spec, TrainConfig(micro_batch_size=2, grad_accum_steps=4))
    profile_path = tmp_path / "split.yaml"
    profile.save(profile_path)
    code, out, err = run_main(capsys, "train", path, "--steps", "1", "--no-progress", "--profile", profile_path,
                              "--checkpoint-dir", tmp_path / "run")
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1].startswith("autofit: error: loss.per_sample: false couples the samples "
                                                   "of a batch; 32-true mb=2x4")
    code, out, err = run_main(capsys, "train", path, "--steps", "2", "--no-progress", "--checkpoint-dir",
                              tmp_path / "run2")
    assert code == 0 and json.loads(out)["steps"] == 2, err  # the default: the whole batch at once


def test_own_loss_errors_are_one_line():
    spec = make_spec({"python": "byom_models:TwoTower"}, {"kind": "python", "factory": "byom_models:pairs"},
                     loss={"python": "byom_models:contrastive_loss", "args": {"temp": 0.1}})
    with pytest.raises(SpecError, match=r"^loss\.args: byom_models:contrastive_loss cannot take these arguments"):
        build_workload(spec)
    spec = make_spec({"python": "byom_models:TwoTower"}, {"kind": "python", "factory": "byom_models:pairs"},
                     loss={"python": "byom_models:not_a_loss"})
    workload = build_workload(spec)
    with pytest.raises(SpecError, match=r"^loss\.python: byom_models:not_a_loss must return a scalar floating-point "
                                        r"tensor attached to the autograd graph \(the micro batch's mean loss\); "
                                        r"got list\(float\)"):
        workload.loss_fn(workload.build_model(), workload.data.batch(2, torch.Generator()))


# ---- Hugging Face, any model from a config --------------------------------------------------


def test_hf_encoder_decoder_trains_and_its_blocks_span_encoder_and_decoder():
    pytest.importorskip("transformers")
    spec = make_spec({"hf": {"class": "T5ForConditionalGeneration", "config": TINY_T5}},
                     {"kind": "synthetic", "seq_len": 8})
    workload = build_workload(spec)
    batch = workload.data.batch(2, torch.Generator().manual_seed(0))
    assert sorted(batch) == ["input_ids", "labels"] and batch["labels"].shape == (2, 8)
    name, blocks = find_block_stack(workload.build_model())
    assert name == "encoder.block, decoder.block" and len(blocks) == 4
    assert_falls(train_steps(spec, micro_batch_size=4, checkpoint_blocks=2))


def test_a_config_key_the_model_reads_is_valid_and_a_typo_still_gets_its_did_you_mean():
    """T5Config stores decoder_start_token_id as given (transformers 5 has no field for it),
    and T5 shifts its labels right behind it: the key is valid because the model reads it."""
    pytest.importorskip("transformers")
    config = TINY_T5 | {"decoder_start_token_id": 0, "tie_word_embeddings": False, "eos_token_id": 1}
    spec = make_spec({"hf": {"class": "T5ForConditionalGeneration", "config": config}},
                     {"kind": "synthetic", "seq_len": 8})
    assert build_workload(spec).build_model().config.decoder_start_token_id == 0
    assert_falls(train_steps(spec, micro_batch_size=4))
    for typo, meant in (("decoder_start_token_idd", "decoder_start_token_id"), ("num_lyers", "num_layers")):
        with pytest.raises(SpecError, match=rf"^model\.hf\.config\.{typo}: unknown key for T5Config; "
                                            rf"did you mean {meant}\?$"):
            build_workload(make_spec({"hf": {"class": "T5ForConditionalGeneration", "config": config | {typo: 2}}},
                                     {"kind": "synthetic", "seq_len": 8}))


@pytest.mark.parametrize("cls, config, labels_shape", [
    ("BertForTokenClassification", {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
                                    "intermediate_size": 64, "vocab_size": 128, "max_position_embeddings": 16,
                                    "num_labels": 5}, (4, 16)),
    ("ViTForImageClassification", {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
                                   "intermediate_size": 64, "image_size": 16, "patch_size": 8, "num_labels": 3}, (4,)),
])
def test_hf_task_comes_from_the_class_not_its_name(cls, config, labels_shape):
    pytest.importorskip("transformers")
    workload = build_workload(make_spec({"hf": {"class": cls, "config": config}}, {"kind": "synthetic"}))
    batch = workload.data.batch(4, torch.Generator().manual_seed(0))
    assert batch["labels"].shape == labels_shape
    loss = workload.loss_fn(workload.build_model(), batch)
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_token_losses_weigh_micro_batches_by_the_global_batch_labelled_tokens():
    """Padded labels (-100) of varying length: a per-micro-batch token mean would make the
    step's loss and gradients depend on the micro batch size; they do not."""
    pytest.importorskip("transformers")
    spec = make_spec({"hf": {"class": "GPT2LMHeadModel", "config": TINY_GPT2}},
                     {"kind": "python", "factory": "byom_models:padded_text"})
    results = {}
    for micro in (8, 2, 1):
        workload = build_workload(spec)
        runner = Runner(spec, workload, TrainConfig(micro_batch_size=micro, grad_accum_steps=8 // micro),
                        device=torch.device("cpu"))
        runner.optimizer.step = lambda *a, **k: None  # keep the gradients to compare them
        runner.optimizer.zero_grad = lambda *a, **k: None
        batches = runner.global_batch(0)
        loss = float(runner.step(batches).loss)
        results[micro] = loss, [p.grad.clone() for p in runner.model.parameters()]
        if micro == 2:  # what the unweighted mean of micro-batch means would have given
            with torch.no_grad():
                unweighted = sum(float(workload.loss_fn(runner.model, mb)) for mb in batches) / len(batches)
    assert results[8][0] == pytest.approx(results[2][0], rel=1e-6) == pytest.approx(results[1][0], rel=1e-6)
    assert abs(unweighted - results[8][0]) > 1e-4  # the data does make the difference
    for grads in (results[2][1], results[1][1]):
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(results[8][1], grads))


# ---- blocks found wherever they are ---------------------------------------------------------


def resnet_spec(**sections):
    return make_spec({"python": "byom_models:ResNetish"}, {"kind": "python", "factory": "byom_models:images"},
                     global_batch_size=16, **sections)


def test_resnet_stages_in_sequential_are_one_block_stack_that_tune_checkpoints():
    spec = resnet_spec()
    name, blocks = find_block_stack(build_workload(spec).build_model())
    assert name == "layer1, layer2, layer3" and len(blocks) == 6
    assert blocks.names[:3] == ["layer1.0", "layer1.1", "layer2.0"]
    space = search_space(spec, cpu_device())
    assert space.max_checkpoint_blocks == 6
    assert_falls(train_steps(spec, checkpoint_blocks=3))


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_checkpoint_recomputation_does_not_update_batchnorm_statistics_again(policy):
    workload = build_workload(resnet_spec())
    batch = workload.data.batch(16, torch.Generator().manual_seed(0))
    states = []
    for n_blocks in (0, 6):
        torch.manual_seed(0)
        model = workload.build_model()
        apply_checkpointing(model, n_blocks, policy=policy)
        workload.loss_fn(model, batch).backward()
        states.append({k.replace("._checkpoint_wrapped_module", ""): v for k, v in model.state_dict().items()})
    assert int(states[1]["layer2.0.bn1.num_batches_tracked"]) == 1
    for key, value in states[0].items():
        assert torch.allclose(value.float(), states[1][key].float(), atol=1e-6), key


def test_a_spec_names_the_block_stack(tmp_path):
    model = {"python": "byom_models:TwoStacks"}
    data = {"kind": "python", "factory": "byom_models:separable"}
    found = find_block_stack(build_workload(make_spec(model, data)).build_model())
    assert found[0] == "heads"  # the larger same-type list, which is not what the user means
    named = find_block_stack(build_workload(make_spec(model | {"blocks": "layers.encoder"}, data)).build_model())
    assert named[0] == "layers.encoder" and len(named[1]) == 2
    assert_falls(train_steps(make_spec(model | {"blocks": "layers.encoder"}, data), checkpoint_blocks=1,
                             freeze_blocks=1))
    with pytest.raises(SpecError, match=r"^model\.blocks: TwoStacks has no module 'layers.encodr'; .*layers.encoder"):
        find_block_stack(build_workload(make_spec(model | {"blocks": "layers.encodr"}, data)).build_model())


def test_torchvision_resnet18_is_tuned_with_checkpointing():
    """torchvision's own ResNet-18, where a torchvision matching this torch imports."""
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - the CUDA wheel on a CPU torch fails with RuntimeError
        pytest.skip(f"torchvision does not import with torch {torch.__version__}: {exc}")
    spec = make_spec({"python": "torchvision.models:resnet18", "args": {"num_classes": 3}},
                     {"kind": "python", "factory": "byom_models:images", "args": {"size": 32}}, global_batch_size=16)
    assert find_block_stack(build_workload(spec).build_model())[0] == "layer1, layer2, layer3, layer4"
    assert search_space(spec, cpu_device()).max_checkpoint_blocks == 8
    assert_falls(train_steps(spec, checkpoint_blocks=4))


# ---- the batch dimension --------------------------------------------------------------------


SEQ_FIRST = {"python": "byom_models:SeqFirstLM"}
TOKEN_DATA = {"kind": "tokens", "path": TOKENS, "seq_len": 32}


def test_sequence_first_model_is_refused_in_one_line(tmp_path, capsys):
    shutil.copy(FIXTURES / "byom_models.py", tmp_path)
    path = write_spec(tmp_path, spec_dict(SEQ_FIRST, TOKEN_DATA))
    code, out, err = run_main(capsys, "train", path, "--steps", "1", "--no-progress", "--checkpoint-dir",
                              tmp_path / "run")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "the samples of a micro batch are not independent" in lines[0]
    assert "model.batch_dim" in lines[0]


def test_declared_batch_dim_moves_the_batch_and_trains():
    spec = make_spec(SEQ_FIRST | {"batch_dim": 1}, TOKEN_DATA, lr=3e-3)
    workload = build_workload(spec)
    assert not workload.probe_batch_dim
    # The loss equals the model's own sequence-first computation.
    torch.manual_seed(0)
    model = workload.build_model().eval()
    x, y = workload.data.batch(3, torch.Generator().manual_seed(1))
    with torch.no_grad():
        by_hand = torch.nn.functional.nll_loss(model(x.T).flatten(0, 1), y.T.flatten())
        assert float(workload.loss_fn(model, (x, y))) == pytest.approx(float(by_hand), rel=1e-5)
    assert_falls(train_steps(spec, micro_batch_size=4))


def test_an_output_with_its_batch_elsewhere_is_refused():
    spec = make_spec({"python": "byom_models:TransposedOut"}, {"kind": "tokens", "path": TOKENS, "seq_len": 16})
    with pytest.raises(SpecError, match=r"^model: its output \[16, 3, 256\] follows the micro batch in dim 1"):
        check_batch_dim(build_workload(spec))


def test_batch_dim_only_for_python_models():
    with pytest.raises(SpecError, match=r"^model\.batch_dim: only for python models"):
        build_workload(parse_spec(spec_dict({"builtin": "mlp", "batch_dim": 1, "args": {
            "in_features": 4, "hidden": 8, "n_layer": 1, "n_classes": 2}}, {"kind": "synthetic"}), source_dir=REPO))


# ---- a Workload from Python objects (the notebook API's way in) -----------------------------


def test_make_workload_from_python_objects():
    from byom_models import contrastive_loss, Pairs, ResNetish, TwoTower

    sys.path.insert(0, str(FIXTURES))
    pairs = Pairs(64)

    def batch_fn(batch_size, generator):
        index = torch.randint(len(pairs), (batch_size,), generator=generator)
        return [pairs.q[index], pairs.d[index]]  # a list: taken as a tuple

    tower = TwoTower()
    workload = make_workload(tower, batch_fn, contrastive_loss, per_sample=False)
    built = workload.build_model()
    assert built is not tower and not workload.probe_batch_dim  # a copy; a coupled loss has no probe
    assert all(torch.equal(a, b) for a, b in zip(built.parameters(), tower.parameters()))
    batch = workload.data.batch(4, torch.Generator().manual_seed(0))
    assert isinstance(batch, tuple) and workload.sample_shape == "x[16] y[16]"
    assert workload.loss_fn(built, batch).ndim == 0

    # A factory, the model's own loss (logits against the tuple's last tensor), named blocks.
    images = __import__("byom_models").Images(32)
    workload = make_workload(ResNetish, lambda n, g: tuple(t[:n] for t in (images.x, images.y)),
                             blocks=["layer1", "layer2"])
    assert workload.probe_batch_dim
    check_batch_dim(workload)  # batch-first, samples independent in eval mode
    model = workload.build_model()
    assert find_block_stack(model)[0] == "layer1, layer2"
    assert workload.loss_fn(model, workload.data.batch(4, torch.Generator())).ndim == 0
    with pytest.raises(SpecError, match=r"^batch_fn: <lambda>\(1, generator\) returned tensors of 2 samples in dim 0, "
                                        r"not 1$"):  # checked as the workload is made
        make_workload(ResNetish, lambda n, g: (images.x[:2], images.y[:2]))
    with pytest.raises(UserCodeError, match=r"^model: boom raised RuntimeError: no while building the model"):
        def boom():
            raise RuntimeError("no")
        make_workload(boom, batch_fn).build_model()
    assert isinstance(make_workload(nn.Linear(2, 2), batch_fn).build_model(), nn.Linear)


# ---- user code cannot corrupt autofit's output ----------------------------------------------


def _noisy_spec(folder):
    shutil.copy(FIXTURES / "byom_models.py", folder)
    return write_spec(folder, spec_dict({"python": "byom_models:noisy_gpt", "args": {"config": NANO_CONFIG}},
                                        TOKEN_DATA))


@pytest.mark.slow
def test_prints_of_the_users_code_never_reach_stdout(tmp_path):
    """The model prints (Python), writes to fd 1 and starts a child that prints; `train`'s
    stdout is its JSON summary and `tune`'s the profile path, and nothing else."""
    path = _noisy_spec(tmp_path)
    result = run_cli("train", path, "--steps", "2", "--no-progress", "--checkpoint-dir", tmp_path / "run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert list(json.loads(result.stdout)) == ["steps", "first_loss", "final_loss", "samples_per_s",
                                               "peak_memory_bytes"]
    for noise in ("number of parameters", "written to fd 1", "a child process of the model"):
        assert noise in result.stderr and noise not in result.stdout
    result = run_cli("tune", path, "--trials", "2", "--memory-budget", "64MiB", "--out", tmp_path / "profiles",
                     "--state-dir", tmp_path / "state", "--no-report", cwd=tmp_path)
    assert_tuned(result)
    # The model's prints went to its trials' logs (shown when a trial fails), never to stdout.
    assert result.stdout.splitlines() == [str(tmp_path / "profiles" / "byom--cpu-budget-64_00mib.yaml")]


def test_a_profile_records_the_own_loss_and_the_exports_name_it(tmp_path):
    import dataclasses

    from autofit.profiles.export import hf_notes, lightning_notes
    from autofit.profiles.profile import Profile
    from test_profile import make_profile

    spec = make_spec({"python": "byom_models:TwoTower"}, {"kind": "python", "factory": "byom_models:pairs"},
                     loss=CONTRASTIVE)
    plain = make_profile(spec, TrainConfig(micro_batch_size=8))
    assert "loss" not in plain.to_dict()["training"]  # profiles without one read as before
    profile = dataclasses.replace(plain, training=dataclasses.replace(plain.training, loss=spec.to_dict()["loss"]))
    loaded = Profile.load(profile.save(tmp_path / "p.yaml"))
    assert loaded.training.loss == {"python": "byom_models:contrastive_loss", "args": {"temperature": 0.1},
                                    "per_sample": False}
    expected = ("loss: measured with your byom_models:contrastive_loss(model, micro_batch, temperature=0.1); it "
                "couples the samples of a batch (per_sample: false)")
    assert any(note.startswith(expected) for note in hf_notes(loaded))
    assert any(note.startswith(expected) for note in lightning_notes(loaded))


# ---- docs/byom.md's recipes -----------------------------------------------------------------


def _recipes() -> dict[str, str]:
    text = (REPO / "docs" / "byom.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```yaml\n")[1:]]
    return {b.splitlines()[0].removeprefix("# recipe: "): b for b in blocks if b.startswith("# recipe: ")}


def test_docs_have_the_recipes():
    assert sorted(_recipes()) == ["dict", "hf", "loss", "optimizer", "seq-first", "tuple", "vision"]


@pytest.mark.parametrize("name", sorted(_recipes()))
def test_docs_recipes_train(tmp_path, name):
    """Each recipe of docs/byom.md, as written, trains 10 steps with a falling loss."""
    import yaml

    if name == "hf":
        pytest.importorskip("transformers")
    raw = yaml.safe_load(_recipes()[name].replace("examples/data/train.bin", TOKENS))
    shutil.copy(FIXTURES / "byom_models.py", tmp_path)
    shutil.copy(FIXTURES / "lion.py", tmp_path)  # the optimizer recipe's, beside the spec
    assert_falls(train_steps(parse_spec(raw, source_dir=tmp_path)))


def test_block_discovery_in_containers():
    from byom_models import BasicBlock

    sys.path.insert(0, str(FIXTURES))
    listed = nn.Module()
    listed.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)])
    assert find_block_stack(listed)[0] == "blocks" and len(find_block_stack(listed)[1]) == 3
    # Stages in an nn.Sequential give way to the blocks inside them.
    staged = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8)),
                           nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8), BasicBlock(8, 8)), nn.Linear(8, 2))
    name, blocks = find_block_stack(staged)
    assert name == "1, 2" and blocks.names == ["1.0", "1.1", "2.0", "2.1", "2.2"]
    # An MoE block's experts are no stack of their own.
    moe = nn.Module()
    moe.layers = nn.ModuleList([nn.Module() for _ in range(2)])
    for layer in moe.layers:
        layer.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(8)])
    assert find_block_stack(moe)[0] == "layers"
    assert find_block_stack(nn.Sequential(nn.Linear(4, 4), nn.ReLU())) is None


def test_tune_and_trial_probe_in_a_child_that_may_crash_or_hang(tmp_path):
    """The probe runs the user's forward: for `tune` and `trial` in a child with a timeout,
    so a forward that exits the process or hangs costs the command its answer, not its life."""
    from autofit.base.errors import InputError, TrialError, TrialTimeoutError
    from autofit.config.spec import load_spec
    from autofit.measure import asks
    from autofit.measure.trial import trial_worker

    shutil.copy(FIXTURES / "faulty.py", tmp_path)
    shutil.copy(FIXTURES / "byom_models.py", tmp_path)

    def spec(model: str, data: str = "faulty:dataset"):
        return load_spec(write_spec(tmp_path, spec_dict({"python": model}, {"kind": "python", "factory": data}),
                                    f"{model.replace(':', '-')}.yaml"))

    def probe_batch_dim(spec, **kwargs):  # as tune and trial run it: in a child of the spec's worker
        with trial_worker(spec) as worker:
            asks.probe_batch_dim(worker, spec, **kwargs)

    probe_batch_dim(spec("byom_models:LogitsNet", "byom_models:separable"))  # passes
    with pytest.raises(TrialError, match=r"^model: the batch-dimension probe .* exited with code 3"):
        probe_batch_dim(spec("faulty:crash"))
    started = time.monotonic()
    with pytest.raises(TrialTimeoutError, match=r"no result after 3 s.*declare model.batch_dim"):
        probe_batch_dim(spec("faulty:hang"), timeout_s=3)
    assert time.monotonic() - started < 60
    with pytest.raises(InputError, match=r"^model.python: faulty:raise_ raised ValueError"):
        probe_batch_dim(spec("faulty:raise_"))
    with pytest.raises(InputError, match=r"the samples of a micro batch are not independent"):
        probe_batch_dim(load_spec(write_spec(tmp_path, spec_dict(SEQ_FIRST, TOKEN_DATA), "seq.yaml")))
