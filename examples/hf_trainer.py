"""A Hugging Face `Trainer` configured from an autofit profile.

    autofit tune my-gpt2.yaml                        # model: {hf: {class: GPT2LMHeadModel, ...}}
    python examples/hf_trainer.py --profile profiles/my-gpt2--<device>.yaml
    python examples/hf_trainer.py                    # no profile: a demonstration config

A 2-layer GPT-2 built from its config (no download) learns the byte-level text in
examples/data for a few steps; on a CPU it takes well under a minute. The profile supplies
batch size, accumulation, precision and checkpointing through `to_hf_training_args()`; what
TrainingArguments cannot say (freezing, bf16 weights, a partial checkpointing choice) is
listed by `hf_notes()` and applied to the model here instead.
"""

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

import autofit
from autofit.profiles.export import hf_notes, to_hf_training_args
from autofit.train.knobs import apply_freezing

try:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
except ImportError:
    raise SystemExit("this example needs transformers and accelerate: pip install 'autofit[hf]' accelerate") from None

HERE = Path(__file__).resolve().parent
SEQ_LEN = 64



def demo_config() -> autofit.TrainConfig:
    """Without a profile: the kind of choice `autofit tune` makes. On a CPU without bf16
    matrix units, bf16 autocast is slower than fp32, so a CPU profile keeps 32-true."""
    precision = "bf16-mixed" if torch.cuda.is_available() else "32-true"
    return autofit.TrainConfig(precision=precision, micro_batch_size=8, grad_accum_steps=2, checkpoint_blocks=2)


class ByteWindows(torch.utils.data.Dataset):
    """Consecutive SEQ_LEN-byte windows of a uint16 token file; GPT-2 shifts the labels itself."""

    def __init__(self, path: Path):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")

    def __len__(self) -> int:
        return len(self.tokens) // SEQ_LEN - 1

    def __getitem__(self, i: int) -> dict:
        ids = torch.from_numpy(self.tokens[i * SEQ_LEN:(i + 1) * SEQ_LEN].astype(np.int64))
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="a profile file or model name in the store (default: a demo config)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    args = parser.parse_args()

    config = autofit.load_profile(args.profile).config if args.profile else demo_config()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=SEQ_LEN,
                                       bos_token_id=None, eos_token_id=None))  # bytes: no special tokens
    n_blocks = model.config.n_layer

    # The part of the profile that lives on the model, not in TrainingArguments.
    for note in hf_notes(config, n_blocks=n_blocks):
        print("note:", note)
    if config.freeze_blocks:
        apply_freezing(model, config.freeze_blocks)
    if config.precision == "bf16-true":
        model.to(torch.bfloat16)

    hf_args = to_hf_training_args(config, n_blocks=n_blocks)
    print("from the profile:", hf_args)
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out, max_steps=args.steps, learning_rate=3e-3, warmup_steps=5,
            logging_steps=max(1, args.steps // 4),
            save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), seed=0, disable_tqdm=True,
            **hf_args)
        trainer = Trainer(model=model, args=training_args, train_dataset=ByteWindows(HERE / "data" / "train.bin"))
        result = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"trained {result.global_step} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
