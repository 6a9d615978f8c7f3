"""What every doctor check that runs on the device shares: its context and the example model."""

from dataclasses import dataclass
from pathlib import Path

import torch

from autofit.config.spec import parse_spec

# examples/tiny-gpt.yaml's model and optimizer on synthetic tokens: the doctor checks the device,
# not learning, and must run from a plain `pip install` where examples/ is not shipped.
EXAMPLE_SPEC = {
    "schema": 1, "name": "doctor-tiny-gpt",
    "model": {"builtin": "gpt", "args": {"n_layer": 4, "n_head": 4, "n_embd": 64, "vocab_size": 256, "seq_len": 64}},
    "data": {"kind": "synthetic"},
    "optimizer": {"name": "adamw", "lr": 3.0e-3, "weight_decay": 0.1},
    "train": {"global_batch_size": 16, "steps": 200, "max_grad_norm": 1.0, "seed": 0},
}
MIB = 2**20


@dataclass(frozen=True, kw_only=True, slots=True)
class Context:
    device: torch.device  # where the check runs: cpu, or the CUDA index as the child numbers it
    fault: bool = False  # inject this check's fault (AUTOFIT_DOCTOR_FAULT)


def example_spec():
    """The example GPT (EXAMPLE_SPEC): the model every training check runs (seconds on a CPU)."""
    return parse_spec(EXAMPLE_SPEC, source_dir=Path.cwd())
