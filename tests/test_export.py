"""Exports: a profile becomes real TrainingArguments, Lightning Trainer kwargs and env variables."""

import json
import shlex

import pytest
import yaml

from autofit.base.errors import ProfileError
from autofit.profiles.export import hf_notes, lightning_notes, to_env, to_hf_training_args
from autofit.config.train_config import TrainConfig
from autofit.config.spec import parse_spec
from autofit.profiles.store import ProfileStore
from autofit.commands.profiles import export_command
from conftest import REPO, run_cli, tiny_gpt_dict
from test_profile import make_profile


def _profile(**config):
    spec = parse_spec(tiny_gpt_dict(), source_dir=REPO)
    return make_profile(spec, TrainConfig(**{"micro_batch_size": 4, "grad_accum_steps": 2, **config}))


def _checkpointing(args) -> bool:
    # transformers 5 calls it activation_checkpointing; the old name mirrors it.
    return args.gradient_checkpointing


# tf32 is left out: TrainingArguments(tf32=True) refuses to build without an Ampere GPU.
@pytest.mark.parametrize("precision, bf16, fp16", [
    ("32-true", False, False), ("16-mixed", False, True), ("bf16-mixed", True, False), ("bf16-true", True, False),
])
def test_hf_export_builds_real_training_arguments(tmp_path, precision, bf16, fp16):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # TrainingArguments needs it to resolve its device
    profile = _profile(precision=precision, checkpoint_blocks=2)
    kwargs = profile.to_hf_training_args(n_blocks=2)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], **kwargs)
    assert args.per_device_train_batch_size == 4 and args.gradient_accumulation_steps == 2
    assert (args.bf16, args.fp16, args.tf32) == (bf16, fp16, False)
    assert _checkpointing(args) is True
    notes = hf_notes(profile, n_blocks=2)
    assert any("bf16-true" in n and "model.to(torch.bfloat16)" in n for n in notes) == (precision == "bf16-true")


def test_hf_export_says_what_it_cannot_express(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    partial = _profile(checkpoint_blocks=1, freeze_blocks=1)
    notes = hf_notes(partial)
    assert any("checkpoint_blocks=1" in n and "apply_checkpointing" in n for n in notes)
    assert any("freeze_blocks=1" in n and "apply_freezing(model, 1)" in n for n in notes)
    # No checkpointing: no checkpointing and no note about it.
    plain = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], **to_hf_training_args(_profile()))
    assert _checkpointing(plain) is False and hf_notes(_profile()) == []
    tf32 = to_hf_training_args(_profile(precision="tf32"))
    assert tf32["tf32"] is True and any("Ampere" in n for n in hf_notes(_profile(precision="tf32")))

    # Where transformers checkpoints every n-th layer, an evenly spread choice needs no note.
    if "activation_checkpointing" in transformers.TrainingArguments.__dataclass_fields__:
        kwargs = to_hf_training_args(_profile(checkpoint_blocks=2), n_blocks=4)
        assert kwargs["activation_checkpointing_kwargs"] == {"use_reentrant": False, "every_n_layers": 2}
        assert hf_notes(_profile(checkpoint_blocks=2), n_blocks=4) == []
        args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], **kwargs)
        assert args.activation_checkpointing_kwargs["every_n_layers"] == 2


def test_selective_checkpointing_exports_say_where_the_target_cannot_express_it():
    profile = _profile(checkpoint_blocks=2, checkpoint_policy="selective")
    args = to_hf_training_args(profile, n_blocks=2)
    # Whole layers are what TrainingArguments can do: less memory, more recomputation.
    assert args.get("activation_checkpointing", args.get("gradient_checkpointing")) is True
    assert any("checkpoint_policy=selective" in n and "policy='selective'" in n for n in hf_notes(profile, n_blocks=2))
    assert any("(selective)" in n and "apply_config" in n for n in lightning_notes(profile))
    assert profile.to_env()["AUTOFIT_CHECKPOINT_POLICY"] == "selective"
    assert "AUTOFIT_CHECKPOINT_POLICY" not in _profile(checkpoint_blocks=2).to_env()
    assert not any("checkpoint_policy" in n for n in hf_notes(_profile(checkpoint_blocks=2), n_blocks=2))


def test_compiled_exports_say_how_the_target_compiles():
    profile = _profile(compile=True)
    assert to_hf_training_args(profile)["torch_compile"] is True
    assert any("apply_compile(model)" in n for n in hf_notes(profile))
    assert any("compile=true" in n and "apply_config" in n for n in lightning_notes(profile))
    assert profile.to_env()["AUTOFIT_COMPILE"] == "1"
    assert "torch_compile" not in to_hf_training_args(_profile()) and "AUTOFIT_COMPILE" not in _profile().to_env()


@pytest.mark.parametrize("precision, lightning", [
    ("32-true", "32-true"), ("tf32", "32-true"), ("16-mixed", "16-mixed"), ("bf16-mixed", "bf16-mixed"),
    ("bf16-true", "bf16-true"),
])
def test_lightning_export(precision, lightning):
    profile = _profile(precision=precision, checkpoint_blocks=1)
    assert profile.to_lightning() == {"precision": lightning, "accumulate_grad_batches": 2, "accelerator": "cpu",
                                      "gradient_clip_val": 1.0}
    notes = lightning_notes(profile)
    assert any("batch_size" in n and "4" in n for n in notes)
    assert any("apply_config" in n for n in notes)
    assert any("set_float32_matmul_precision" in n for n in notes) == (precision == "tf32")


def test_env_export():
    profile = _profile(precision="bf16-mixed", checkpoint_blocks=1)
    env = profile.to_env()
    assert env == {
        "AUTOFIT_PRECISION": "bf16-mixed", "AUTOFIT_MICRO_BATCH_SIZE": "4", "AUTOFIT_GRAD_ACCUM_STEPS": "2",
        "AUTOFIT_GLOBAL_BATCH_SIZE": "8", "AUTOFIT_CHECKPOINT_BLOCKS": "1", "AUTOFIT_FREEZE_BLOCKS": "0",
        "AUTOFIT_MODEL": "tiny", "AUTOFIT_DEVICE_FINGERPRINT": profile.device.fingerprint,
    }
    assert all(isinstance(v, str) for v in env.values())


def test_export_formats_and_cli(tmp_path):
    profile = _profile(precision="bf16-mixed", checkpoint_blocks=1, freeze_blocks=1)
    store = ProfileStore(tmp_path / "profiles")
    store.save(profile)

    def export(fmt: str) -> str:
        return export_command("tiny", fmt, store=store.root, device="cpu")

    assert yaml.safe_load(export("yaml")) == profile.to_dict()
    assert json.loads(export("json")) == profile.to_dict()
    hf = export("hf")
    assert "# note: freeze_blocks=1" in hf  # notes are comments: the output still loads
    assert yaml.safe_load(hf)["per_device_train_batch_size"] == 4
    assert yaml.safe_load(export("lightning")) == {"precision": "bf16-mixed", "accumulate_grad_batches": 2,
                                                   "accelerator": "cpu", "gradient_clip_val": 1.0}
    with pytest.raises(ProfileError, match="--format"):
        export("xml")

    # The CLI prints the same text; env lines are KEY=VALUE, as shells and env files read them.
    result = run_cli("profiles", "export", "tiny", "--format", "env", "--store", store.root, "--device", "cpu",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    env = dict(shlex.split(line)[0].split("=", 1) for line in result.stdout.splitlines())
    assert env == profile.to_env()
    shown = run_cli("profiles", "show", "tiny--cpu", "--store", store.root, "--device", "cpu", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"# {store.root / 'tiny--cpu.yaml'}\n")
    assert yaml.safe_load(shown.stdout) == profile.to_dict()


@pytest.mark.parametrize("bucketing", [False, True])
def test_text_profile_names_its_length_grouping_and_padding(tmp_path, bucketing):
    import dataclasses

    from transformers import TrainingArguments

    data = {"kind": "text", "samples": 400, "longest_tokens": 129, "mean_tokens": 40.2, "max_length": 129,
            "padding": "dynamic", "packing": False, "pad_to_multiple_of": 8}
    profile = dataclasses.replace(_profile(length_bucketing=bucketing), data=data)
    args = to_hf_training_args(profile)
    built = TrainingArguments(output_dir=str(tmp_path), **args)  # the installed transformers accepts them
    grouped = getattr(built, "group_by_length", None) or getattr(built, "train_sampling_strategy", None) == \
        "group_by_length"
    assert grouped == bucketing
    notes = " ".join(hf_notes(profile))
    assert "pad_to_multiple_of=8" in notes and "max_length=129" in notes and "129 tokens" in notes
    assert _roundtrip(profile) == profile


def _roundtrip(profile):
    from autofit.profiles.profile import Profile

    return Profile.from_dict(yaml.safe_load(profile.to_yaml()))


def test_a_cpu_profile_with_bf16_mixed_builds_real_training_arguments(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    profile = _profile(precision="bf16-mixed")
    assert profile.device.kind == "cpu"
    # Nothing added by hand: TrainingArguments refuses bf16 on a CPU unless use_cpu says so.
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], **profile.to_hf_training_args())
    assert args.use_cpu is True and args.bf16 is True
    # What the CPU trials ran: torch's AdamW (one tensor at a time), clipped at 1.0.
    assert args.max_grad_norm == 1.0 and args.optim == "adamw_torch"


def test_to_lightning_builds_a_real_trainer_that_fits_a_tiny_model_on_cpu(tmp_path):
    lightning = pytest.importorskip("lightning")
    import torch

    profile = _profile(precision="bf16-mixed")  # micro batch 4, accumulation 2

    class Tiny(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=generator),
                                          torch.randint(0, 2, (32,), generator=generator))
    loader = torch.utils.data.DataLoader(data, batch_size=profile.config.micro_batch_size)
    trainer = lightning.Trainer(**profile.to_lightning(), max_steps=3, default_root_dir=str(tmp_path), logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = Tiny()
    before = [p.detach().clone() for p in model.parameters()]
    trainer.fit(model, loader)
    assert trainer.global_step == 3 and trainer.accumulate_grad_batches == 2
    assert trainer.precision == "bf16-mixed" and trainer.gradient_clip_val == 1.0
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_8bit_state_exports_where_the_target_can_say_it():
    config = TrainConfig(precision="bf16-mixed", micro_batch_size=4, grad_accum_steps=2, optimizer_bits=8)
    assert to_hf_training_args(config)["optim"] == "adamw_bnb_8bit"
    assert "optim" not in to_hf_training_args(config.replace(optimizer_bits=32))
    assert any("bitsandbytes.optim.AdamW8bit" in note for note in lightning_notes(config))
    assert to_env(config)["AUTOFIT_OPTIMIZER_BITS"] == "8"
    assert "AUTOFIT_OPTIMIZER_BITS" not in to_env(config.replace(optimizer_bits=32))
