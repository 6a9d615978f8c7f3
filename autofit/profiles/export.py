"""A profile in the words of the tools users already run: Hugging Face `TrainingArguments`,
Lightning `Trainer` kwargs, and environment variables.

    autofit profiles export tiny-gpt --format hf          # YAML, notes as comments
    TrainingArguments(output_dir="out", **profile.to_hf_training_args())
    lightning.Trainer(**profile.to_lightning())

Each `to_*` returns only what the target accepts, so it can be splatted as is; what the
target cannot express (partial or selective checkpointing, freezing, ...) is listed by `*_notes`.
What a knob writes is its registry row's (`KnobDef.exports`): the exporters loop over the rows.
"""

import dataclasses
import json
import shlex
from typing import Any

import yaml

from autofit.base.errors import ProfileError
from autofit.config.knobs import KnobDef, KNOBS
from autofit.config.train_config import TrainConfig
from autofit.device.support import TF32_PRECISIONS

FORMATS = ("yaml", "json", "hf", "lightning", "env")

# Lightning's precision names are autofit's, except tf32: to Lightning that is 32-true
# plus a process-wide matmul setting.
_LIGHTNING_PRECISION = {"32-true": "32-true", "tf32": "32-true", "16-mixed": "16-mixed",
                        "bf16-mixed": "bf16-mixed", "bf16-true": "bf16-true"}


def _config(profile) -> TrainConfig:
    """Exports take a Profile or a bare TrainConfig (e.g. one not tuned yet)."""
    if isinstance(profile, TrainConfig):
        return profile
    return profile.config


def _hf_field_names() -> set[str] | None:
    """TrainingArguments' fields in the installed transformers; None when it is absent."""
    try:
        from transformers import TrainingArguments
    except ImportError:
        return None
    return {f.name for f in dataclasses.fields(TrainingArguments)}


def _hf(profile, n_blocks: int | None) -> tuple[dict, list[str]]:
    config = _config(profile)
    fields = _hf_field_names()
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old
    # name is a deprecated alias) and added every_n_layers; older releases know only the old.
    new_names = fields is not None and "activation_checkpointing" in fields
    ckpt_key = "activation_checkpointing" if new_names else "gradient_checkpointing"
    args = _hf_base_args(config, ckpt_key)
    notes: list[str] = []
    if _device_kind(profile) == "cpu":
        # Tuned on a CPU: the job trains there. TrainingArguments refuses bf16/fp16 without a
        # GPU unless told the CPU is meant.
        args["use_cpu"] = True
    if config.checkpoint_blocks > 0:
        _hf_checkpointing(args, notes, config, n_blocks, ckpt_key=ckpt_key, new_names=new_names)
    _hf_knobs(args, notes, profile, ckpt_key)
    _hf_optimizer(args, notes, profile)
    data = {} if isinstance(profile, TrainConfig) else profile.data
    if data.get("kind") == "text":
        _hf_lengths(args, notes, config, data)
    _hf_spelling(args, fields)
    _hf_parallelism(args, notes, config)
    _hf_caveats(notes, profile)
    if fields is not None:
        unknown = sorted(set(args) - fields)
        assert not unknown, f"this transformers' TrainingArguments lacks {unknown}"
    return args, notes


def _hf_base_args(config: TrainConfig, ckpt_key: str) -> dict[str, Any]:
    """Batch, accumulation, precision flags and whether to checkpoint at all."""
    return {
        "per_device_train_batch_size": config.micro_batch_size,
        "gradient_accumulation_steps": config.grad_accum_steps,
        "bf16": config.precision in ("bf16-mixed", "bf16-true"),
        "fp16": config.precision == "16-mixed",
        # Explicit either way: the profile was measured with TF32 on or off, not the default.
        "tf32": config.precision in TF32_PRECISIONS,
        ckpt_key: config.checkpoint_blocks > 0,
    }


def _hf_checkpointing(args: dict, notes: list[str], config: TrainConfig, n_blocks: int | None, *,
                      ckpt_key: str, new_names: bool) -> None:
    """Which blocks to checkpoint, where TrainingArguments can say it; a note where it cannot."""
    k = config.checkpoint_blocks
    # autofit's non-reentrant checkpointing; HF's default is still reentrant on some versions.
    ckpt_kwargs: dict[str, Any] = {"use_reentrant": False}
    if n_blocks is not None and k < n_blocks and new_names and n_blocks % k == 0 and not config.freeze_blocks:
        # Blocks 0, n/k, 2n/k, ...: the very blocks `knobs.spread_indices` picks when
        # nothing is frozen (with freezing it spreads over the blocks after the frozen ones).
        ckpt_kwargs["every_n_layers"] = n_blocks // k
    elif n_blocks is None or k < n_blocks:
        of = f"of {n_blocks} " if n_blocks is not None else ""
        notes.append(
            f"checkpoint_blocks={k}: the profile checkpoints {k} {of}blocks; TrainingArguments here "
            f"checkpoints every block, which fits in no more memory but is slower. For the exact "
            f"choice, apply it to the model (autofit.train.configure.apply_checkpointing(model, {k}, "
            f"first_block={config.freeze_blocks})) and set "
            f"{ckpt_key}=False" + ("" if n_blocks is not None else
                                   ", or pass n_blocks= so an evenly spread choice can be exported"))
    args[f"{ckpt_key}_kwargs"] = ckpt_kwargs


def _hf_knobs(args: dict, notes: list[str], profile, ckpt_key: str) -> None:
    """What each changed knob's registry row writes for the Trainer."""
    config = _config(profile)
    for knob, value in _changed(config):
        if not (knob.exports.names_optimizer and _optimizer_recorded(profile)):
            args |= knob.exports.hf_args.get(value, {})
        if knob.exports.hf_note is not None:
            notes.append(knob.exports.hf_note.format(config=config, ckpt_key=ckpt_key))


def _hf_parallelism(args: dict, notes: list[str], config: TrainConfig) -> None:
    if config.parallelism == "ddp":
        # The Trainer runs DDP by itself when launched by torchrun; only the buckets are set.
        args["ddp_bucket_cap_mb"] = config.bucket_cap_mb
        notes.append(_launch_note(config))
    elif config.parallelism == "fsdp":
        args["fsdp"] = "full_shard auto_wrap" if config.reshard_after_forward else "shard_grad_op auto_wrap"
        args["fsdp_config"] = {"version": 2, "reshard_after_forward": config.reshard_after_forward}
        notes.append(_launch_note(config))


def _hf_caveats(notes: list[str], profile) -> None:
    """What the profile ran that TrainingArguments leaves to the user: freezing, a bf16 cast,
    TF32's hardware, the spec's own loss."""
    config = _config(profile)
    if config.freeze_blocks > 0:
        notes.append(f"freeze_blocks={config.freeze_blocks}: TrainingArguments cannot freeze parameters; "
                     f"freeze them before building the Trainer: "
                     f"autofit.train.configure.apply_freezing(model, {config.freeze_blocks})")
    if config.precision == "bf16-true":
        notes.append("bf16-true: bf16=True only autocasts; the Trainer keeps fp32 weights and optimizer "
                     "state unless the model is cast first: model.to(torch.bfloat16)")
    if config.precision == "tf32":
        notes.append("tf32: TrainingArguments(tf32=True) needs an Ampere or newer GPU and fails elsewhere")
    loss = _own_loss(profile)
    if loss is not None:
        notes.append(f"loss: measured with your {loss}; in the Trainer, override compute_loss(model, inputs) to "
                     f"return it (or pass compute_loss_func)")


def _device_kind(profile) -> str | None:
    return None if isinstance(profile, TrainConfig) else profile.device.kind


def _changed(config: TrainConfig) -> list[tuple[KnobDef, Any]]:
    """(knob, value) of each registry knob away from its default, in registry order."""
    return [(k, value) for k in KNOBS.values() if (value := getattr(config, k.name)) != k.default]


def _optimizer_recorded(profile) -> bool:
    """The profile recorded the optimizer implementation it measured: the exports name that,
    not what a knob (`Exports.names_optimizer`) would build."""
    return not isinstance(profile, TrainConfig) and profile.measured.optimizer is not None


# Keywords transformers renamed: the exports' (and the rows') spelling -> (the new field, its value).
# transformers 5 replaced group_by_length=True by train_sampling_strategy="group_by_length".
_HF_RENAMED = {"group_by_length": ("train_sampling_strategy", {True: "group_by_length", False: "random"})}


def _hf_spelling(args: dict, fields: set[str] | None) -> None:
    """`args` in the installed transformers' spelling, in place."""
    for old, (new, values) in _HF_RENAMED.items():
        if old in args and fields is not None and new in fields:
            args[new] = values[args.pop(old)]


# autofit.train.optim.implementation -> TrainingArguments.optim, where the Trainer builds the same one.
_HF_OPTIM = {"torch.AdamW/fused": "adamw_torch_fused", "torch.AdamW/per-parameter": "adamw_torch",
             "torch.AdamW/foreach": "adamw_torch", "bitsandbytes.AdamW8bit/per-parameter": "adamw_bnb_8bit"}


def _hf_optimizer(args: dict, notes: list[str], profile) -> None:
    """The clipping and optimizer the profile was measured with, where the Trainer can build
    them. Without a record of the implementation, what the knobs wrote stands."""
    if isinstance(profile, TrainConfig):
        return
    if profile.training is not None:
        # The Trainer clips at 1.0 unless told; 0 turns clipping off, as None did in the trials.
        args["max_grad_norm"] = profile.training.max_grad_norm or 0.0
    measured = profile.measured.optimizer
    own = _own_optimizer(profile)
    if own is not None:
        notes.append(f"optimizer: measured with {own}; TrainingArguments has no slot for an optimizer of your "
                     f"own: build it over the model's parameters and pass Trainer(optimizers=(optimizer, None))")
    elif measured in _HF_OPTIM:
        args["optim"] = _HF_OPTIM[measured]
    elif measured is not None:
        notes.append(f"optimizer: measured with {measured}, which TrainingArguments cannot name; build it "
                     f"(autofit.train.optim.build_optimizer) and pass Trainer(optimizers=(optimizer, None))")


def _own_optimizer(profile) -> str | None:
    """The user's own optimizer the profile ran, as a sentence's object: `lion:make(params, lr=0.0003)`."""
    training = None if isinstance(profile, TrainConfig) else profile.training
    if training is None or training.optimizer.get("python") is None:
        return None
    args = ", ".join(f"{k}={v!r}" for k, v in (training.optimizer.get("args") or {}).items())
    measured = f" ({profile.measured.optimizer})" if profile.measured.optimizer else ""
    return f"your {training.optimizer['python']}(params{', ' + args if args else ''}){measured}"


def _hf_lengths(args: dict, notes: list[str], config: TrainConfig, data: dict) -> None:
    """Text data: length grouping in TrainingArguments (off, said explicitly, unless the
    length-bucketing knob turned it on), padding and truncation in notes (they belong to the
    tokenizer and the data collator, which TrainingArguments does not build)."""
    args.setdefault("group_by_length", False)
    max_length, multiple = data.get("max_length"), data.get("pad_to_multiple_of") or 1
    pad_kw = f", pad_to_multiple_of={multiple}" if multiple > 1 else ""
    if data.get("packing"):
        notes.append(f"packing: measured on documents joined by the end-of-text token and cut into windows "
                     f"of {max_length} tokens (no padding); pack the dataset the same way before the Trainer")
    elif data.get("padding") == "max_length":
        notes.append(f"padding: measured with every sample padded to max_length={max_length}: tokenize with "
                     f"truncation=True, padding='max_length', max_length={max_length}")
    elif data:
        notes.append(f"padding: measured with each micro batch padded to its longest sample (dynamic): tokenize "
                     f"with truncation=True, max_length={max_length} and no padding, then "
                     f"DataCollatorForLanguageModeling(tokenizer, mlm=False{pad_kw})")
    if data.get("longest_tokens"):
        notes.append(f"lengths: the peak was measured at {config.micro_batch_size} samples of "
                     f"{data['longest_tokens']} tokens; longer samples may run out of memory")


def _own_loss(profile) -> str | None:
    """The spec's own loss a profile was measured with, in words; None: the model's own."""
    training = None if isinstance(profile, TrainConfig) else profile.training
    loss = training.loss if training is not None else None
    if not loss:
        return None
    args = "".join(f", {k}={v!r}" for k, v in (loss.get("args") or {}).items())
    call = f"{loss['python']}(model, micro_batch{args})" if loss.get("python") else "model's own loss"
    coupled = ("; it couples the samples of a batch (per_sample: false), so keep the whole batch in one micro batch"
               if loss.get("per_sample") is False else "")
    return call + coupled


def to_hf_training_args(profile, *, n_blocks: int | None = None) -> dict:
    """Keyword arguments for `transformers.TrainingArguments` (add output_dir and the rest).

    `n_blocks`, the model's number of layers, lets a partial checkpointing choice be
    expressed as `every_n_layers` where transformers supports it.
    """
    return _hf(profile, n_blocks)[0]


def hf_notes(profile, *, n_blocks: int | None = None) -> list[str]:
    """What `to_hf_training_args` cannot express, and how to get it anyway."""
    return _hf(profile, n_blocks)[1]


def to_lightning(profile) -> dict:
    """Keyword arguments for `lightning.Trainer`."""
    config = _config(profile)
    out = {"precision": _LIGHTNING_PRECISION[config.precision], "accumulate_grad_batches": config.grad_accum_steps}
    kind = _device_kind(profile)
    if kind is not None:  # where it was measured: a CPU profile must not grab a GPU, nor the reverse
        out["accelerator"] = "cpu" if kind == "cpu" else "gpu"
    if not isinstance(profile, TrainConfig) and profile.training is not None \
            and profile.training.max_grad_norm is not None:
        out["gradient_clip_val"] = profile.training.max_grad_norm  # by norm, Lightning's default algorithm
    if config.distributed:
        # One node by default; for several, devices x num_nodes must stay world_size.
        out |= {"strategy": config.parallelism, "devices": config.world_size, "num_nodes": 1}
    return out


def torchrun_command(config: TrainConfig, spec_path: str = "MODEL_YAML", profile_path: str = "PROFILE") -> str:
    """The launch line of a profile: one process per rank on this node through torchrun."""
    return (f"torchrun --standalone --nproc-per-node {config.world_size} -m autofit train "
            f"{shlex.quote(spec_path)} --profile {shlex.quote(profile_path)}")


def _launch_note(config: TrainConfig) -> str:
    return (f"{config.parallelism} over {config.world_size} ranks: launch the script with "
            f"`torchrun --nproc-per-node {config.world_size} train.py`; per_device_train_batch_size "
            f"is each rank's micro batch")


def lightning_notes(profile) -> list[str]:
    config = _config(profile)
    # The batch size is the DataLoader's in Lightning, not the Trainer's.
    notes = [f"micro_batch_size={config.micro_batch_size}: pass it to your DataLoader(batch_size=...)"]
    if config.precision == "tf32":
        notes.append("tf32: Lightning calls this 32-true; also call torch.set_float32_matmul_precision('high')")
    if config.parallelism == "fsdp":
        notes.append("strategy=fsdp: Lightning's FSDPStrategy; for FSDP2's fully_shard as autofit measured it, "
                     "use ModelParallelStrategy and call fully_shard in configure_model(), with "
                     f"reshard_after_forward={config.reshard_after_forward}")
    elif config.parallelism == "ddp":
        notes.append(f"strategy=ddp: for the measured buckets pass DDPStrategy(bucket_cap_mb={config.bucket_cap_mb}, "
                     f"gradient_as_bucket_view={config.gradient_as_bucket_view})")
    if config.distributed:
        notes.append(f"several nodes: devices (per node) x num_nodes must equal world_size={config.world_size}")
    if _own_optimizer(profile) is not None:
        notes.append(f"optimizer: measured with {_own_optimizer(profile)}; return it from configure_optimizers()")
    elif _optimizer_recorded(profile):
        notes.append(f"optimizer: measured with {profile.measured.optimizer}; return the same from "
                     f"configure_optimizers() (autofit.train.optim.build_optimizer builds it)")
    loss = _own_loss(profile)
    if loss is not None:
        notes.append(f"loss: measured with your {loss}; return it from training_step")
    # (a knob naming the optimizer: for a bare config, or a profile from before the record)
    own_or_recorded = _own_optimizer(profile) is not None or _optimizer_recorded(profile)
    notes += [knob.exports.lightning_note.format(config=config) for knob, _ in _changed(config)
              if knob.exports.lightning_note is not None and not (knob.exports.names_optimizer and own_or_recorded)]
    setup = [knob for knob, _ in _changed(config) if knob.exports.model_setup]
    if config.checkpoint_blocks or config.freeze_blocks or setup:
        # Lightning has no checkpointing of its own outside FSDP's activation_checkpointing_policy,
        # which wraps whole modules (neither a few blocks nor a selective policy), and no
        # Trainer argument for torch.compile.
        policy = "".join(f" ({getattr(config, k.name)})" for k in KNOBS.values() if k.active_with == "checkpoint_blocks")
        knobs = [f"checkpoint_blocks={config.checkpoint_blocks}" + (policy if config.checkpoint_blocks else ""),
                 f"freeze_blocks={config.freeze_blocks}"] + [f"{k.name}={_spell(getattr(config, k.name))}"
                                                            for k in setup]
        notes.append(f"{', '.join(knobs)}: apply them to the model in configure_model() with "
                     f"autofit.train.configure.apply_config(model, profile.config)")
    return notes


def _spell(value) -> str:
    """A value as the profile's YAML writes it (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def to_env(profile) -> dict[str, str]:
    """AUTOFIT_* variables, for job scripts and launchers that read the environment."""
    config = _config(profile)
    env = {
        "AUTOFIT_PRECISION": config.precision,
        "AUTOFIT_MICRO_BATCH_SIZE": str(config.micro_batch_size),
        "AUTOFIT_GRAD_ACCUM_STEPS": str(config.grad_accum_steps),
        "AUTOFIT_GLOBAL_BATCH_SIZE": str(config.global_batch_size),
        "AUTOFIT_CHECKPOINT_BLOCKS": str(config.checkpoint_blocks),
        "AUTOFIT_FREEZE_BLOCKS": str(config.freeze_blocks),
    }
    # A knob at its default is absent, as in profiles written before the knob.
    env |= {knob.exports.env: knob.exports.env_value(value) for knob, value in _changed(config)
            if knob.exports.env is not None}
    if config.distributed:
        env |= {"AUTOFIT_PARALLELISM": config.parallelism, "AUTOFIT_WORLD_SIZE": str(config.world_size),
                "AUTOFIT_TORCHRUN": torchrun_command(config)}
    if not isinstance(profile, TrainConfig):
        env["AUTOFIT_MODEL"] = profile.model.name
        env["AUTOFIT_DEVICE_FINGERPRINT"] = profile.device.fingerprint
    return env


def render(profile, fmt: str, *, n_blocks: int | None = None) -> str:
    """`autofit profiles export` output. Notes are comments, so the YAML and env outputs
    still load (`yaml.safe_load`, `set -a; . file`, docker --env-file, systemd)."""
    if fmt == "yaml":
        return profile.to_yaml()
    if fmt == "json":
        return json.dumps(profile.to_dict(), indent=2) + "\n"
    if fmt == "hf":
        args, notes = _hf(profile, n_blocks)
        return _comments(notes) + yaml.safe_dump(args, sort_keys=False)
    if fmt == "lightning":
        return _comments(lightning_notes(profile)) + yaml.safe_dump(to_lightning(profile), sort_keys=False)
    if fmt == "env":
        config = _config(profile)
        launch = (f"# run: {torchrun_command(config, 'MODEL_YAML', profile.file_name)}\n"
                  f"# several nodes: torchrun --nnodes NODES --nproc-per-node GPUS_PER_NODE --rdzv-backend c10d "
                  f"--rdzv-endpoint HOST:29500 ... (NODES x GPUS_PER_NODE = {config.world_size})\n"
                  if config.distributed and not isinstance(profile, TrainConfig) else "")
        return launch + "".join(f"{key}={shlex.quote(value)}\n" for key, value in to_env(profile).items())
    raise ProfileError(f"--format: must be one of {', '.join(FORMATS)}, got {fmt!r}")


def _comments(notes: list[str]) -> str:
    return "".join(f"# note: {note}\n" for note in notes)
