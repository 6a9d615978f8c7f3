"""Simulated GPUs for testing the search: memory and throughput from known formulas with the
shape of real hardware, so the exhaustive-grid optimum is known exactly.

- memory is affine in micro batch: model states (16 B/param, 8 for bf16-true) + micro batch x
  activations; 16-bit activations are ~half; a checkpointed block keeps ~1/8 of its activations;
- throughput saturates with micro batch (m / (m + m_half)), 16-bit is faster, each
  checkpointed block adds a third of its forward, each accumulation step costs a little,
  frozen blocks skip their weight-gradient work;
- the estimator is systematically 12% low (as a real one misses the CUDA context), which
  the tuner's calibration has to learn.
"""

import hashlib
from dataclasses import dataclass, field

from autofit.knobs import TrainConfig
from autofit.search import SearchSpace
from autofit.trial import Measurement

GiB = 2**30


@dataclass(frozen=True)
class Landscape:
    name: str
    params: float  # parameter count
    act_bytes_per_sample_block: float  # fp32 activations per sample per block
    n_blocks: int
    global_batch_size: int
    budget_bytes: int
    rate: dict  # samples/s at saturation, per precision
    m_half: float  # micro batch at half of saturation
    max_freeze_blocks: int = 0
    unhealthy: tuple = ()  # precisions whose loss drifts from 32-true
    estimate_bias: float = 0.88
    calls: list = field(default_factory=list)

    def space(self) -> SearchSpace:
        n = self.global_batch_size
        return SearchSpace(global_batch_size=n, precisions=tuple(self.rate),
                           micro_batch_sizes=tuple(m for m in range(1, n + 1) if n % m == 0),
                           max_checkpoint_blocks=self.n_blocks, max_freeze_blocks=self.max_freeze_blocks)

    def peak_bytes(self, c: TrainConfig) -> int:
        trainable = 1 - 0.9 * c.freeze_blocks / self.n_blocks
        states = self.params * (8 if c.precision == "bf16-true" else 4) * (1 + 3 * trainable)
        act = self.act_bytes_per_sample_block * (0.55 if c.precision in ("16-mixed", "bf16-mixed", "bf16-true") else 1.0)
        kept_blocks = (self.n_blocks - c.checkpoint_blocks) + c.checkpoint_blocks / 8
        return int(states + c.micro_batch_size * act * kept_blocks + 0.25 * GiB)

    def samples_per_s(self, c: TrainConfig) -> float:
        m = c.micro_batch_size
        speed = self.rate[c.precision] * m / (m + self.m_half)
        speed /= 1 + (c.checkpoint_blocks / self.n_blocks) / 3
        speed /= 1 + 0.03 * (c.grad_accum_steps - 1) / max(1, m)
        speed *= 1 + 0.25 * c.freeze_blocks / self.n_blocks
        noise = int(hashlib.sha256(repr(c).encode()).hexdigest()[:4], 16) / 0xFFFF  # deterministic +-1%
        return speed * (0.99 + 0.02 * noise)

    def healthy(self, c: TrainConfig) -> bool:
        return c.precision not in self.unhealthy

    def measure(self, c: TrainConfig) -> Measurement:
        self.calls.append(c)
        peak = self.peak_bytes(c)
        losses = [4.0 * (1.3 if not self.healthy(c) else 1.0), 3.9, 3.8]
        if peak > self.budget_bytes:
            return Measurement(status="oom", config=c, peak_memory_bytes=self.budget_bytes,
                               budget_bytes=self.budget_bytes, reason="simulated OOM")
        sps = self.samples_per_s(c)
        return Measurement(status="ok", config=c, peak_memory_bytes=peak, budget_bytes=self.budget_bytes,
                           samples_per_s=sps, step_time_s=self.global_batch_size / sps, losses=losses)

    def estimate(self, c: TrainConfig) -> int:
        return int(self.peak_bytes(c) * self.estimate_bias)

    def grid_best(self) -> tuple[TrainConfig, float]:
        feasible = [c for c in self.space().grid() if self.peak_bytes(c) <= self.budget_bytes and self.healthy(c)]
        best = max(feasible, key=self.samples_per_s)
        return best, self.samples_per_s(best)


GPU_RATES = {"32-true": 100.0, "tf32": 190.0, "16-mixed": 290.0, "bf16-mixed": 300.0, "bf16-true": 330.0}

LANDSCAPES = [
    # Roomy: a small model on a large card; the largest micro batch at the fastest precision.
    Landscape(name="roomy", params=125e6, act_bytes_per_sample_block=60e6, n_blocks=12, global_batch_size=64,
              budget_bytes=78 * GiB, rate=GPU_RATES, m_half=6.0),
    # Tight: the model states take most of a 24 GiB card; checkpointing buys batch.
    Landscape(name="tight", params=1.0e9, act_bytes_per_sample_block=150e6, n_blocks=24, global_batch_size=128,
              budget_bytes=24 * GiB, rate=GPU_RATES, m_half=8.0),
    # fp16 is fastest but drifts (unhealthy); freezing allowed; bf16-true absent.
    Landscape(name="drift+freeze", params=350e6, act_bytes_per_sample_block=90e6, n_blocks=16, global_batch_size=96,
              budget_bytes=16 * GiB,
              rate={"32-true": 100.0, "tf32": 180.0, "16-mixed": 320.0, "bf16-mixed": 280.0},
              m_half=4.0, max_freeze_blocks=4, unhealthy=("16-mixed",)),
]
