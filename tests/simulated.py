"""Simulated GPUs for testing the search: memory and throughput from known formulas with the
shape of real hardware, so the exhaustive-grid optimum is known exactly.

- memory: model states (16 B/param, 8 for bf16-true; frozen parameters keep no gradient
  or optimizer state) + micro batch x activations of the trainable blocks (a frozen block
  saves none; 16-bit activations are ~half; a checkpointed block keeps ~1/8 of its own,
  a selectively checkpointed one ~45%: its matmul and attention outputs),
  plus a device context and allocator fragmentation that grows with the activations;
- throughput saturates with micro batch (m / (m + m_half)), optionally falling again past
  a peak (cache or scheduling effects), 16-bit is faster, each checkpointed block adds a
  third of its forward (a selective one a tenth: only its cheap ops), each accumulation
  step costs a little, frozen blocks skip their
  weight-gradient work;
- the estimator sees the tensors only: not the context, not the fragmentation, and it can
  be off by a constant factor (`estimate_bias`);
- per-call measurement noise (`noise`, uniform +-) on top of a fixed +-1% per config;
- memory knobs (`optimizer_bits`, `chunked_loss` where the landscape searches them): 8-bit
  AdamW moments take 2.03 B/param instead of 8 (fp32 weights) and cost 2% of the step; a
  chunked loss keeps a sixteenth of the logits' bytes per sample and costs 3%;
- compiled steps (`compile`) run `compile_speedup` times faster with 15% leaner
  activations the estimator does not see, or fail to compile (`compile_fails`);
- over several ranks (`world_size`), per rank: DDP keeps whole model states plus a bucket
  copy of the gradients (unless they are bucket views) and pays a little for its overlapped
  all-reduce; FSDP2 shards the states, holds one gathered block in flight (every block if it
  does not reshard after forward) and pays more for its gathers. Throughput is global;
- the shapes added with the landscape suite: how much of the model freezing reaches and what
  it saves in time (`freezable_share`, `freeze_speedup`), a memory cliff the estimator does
  not see (`cliff_bytes` from `cliff_micro_batch` on), and knobs whose loss drifts
  (`unhealthy_knobs`, e.g. 8-bit optimizer state).

- device time (`clock()`): each measurement costs its start (`start_s`: process, context,
  model), its warm-up and its window at the config's own step time (`window_s` seconds with
  at least `MIN_WINDOW_STEPS` steps; or, as before windows were sized in time,
  `STEP_WINDOW` steps), an out-of-memory trial its start and one step, a compiled config
  its compiling too (`compile_s`), a compile error its start twice, an estimate
  `estimate_s`. A search on a landscape reads this clock, so a time budget is spent as on
  the device.

`SHAPED` and `generated(n, seed)` are the landscape suite of `benchmarks/anytime.py --trial-budget` (shapes
made by hand, and a seeded parametric family); `search(landscape, seed)` runs the tuner on one
at the spec's default budget and says what its choice is worth against the grid optimum.
"""

import dataclasses
import hashlib
import math
import random
from dataclasses import dataclass, field

from autofit.config.train_config import TrainConfig
from autofit.config.spec import SearchSpec
from autofit.device.budget import Budget
from autofit.search import FULL_PRECISION_SLOWDOWN, SearchSpace, Tuner, make_study
from autofit.search.deadline import Deadline, SEARCH_SHARE
from autofit.search.memory_model import MemoryModel
from autofit.search.trial_health import REFERENCE_TRIAL_STEPS
from autofit.search.warm_start import translate
from autofit.measure.measurement import Measurement

GiB = 2**30
ONE_LINER_GPU = ("bf16-mixed", "16-mixed")  # the one-liner's precision on a GPU, first found first
STEP_WINDOW = 10  # steps per trial before windows were sized in time: 5 of warm-up, 5 timed
WARMUP_STEPS = 2  # warm-up steps until steady, with time-sized windows
MIN_WINDOW_STEPS = SearchSpec.__dataclass_fields__["measure_steps"].default  # a window's fewest steps, as the tool's
HALF = ("16-mixed", "bf16-mixed", "bf16-true")
HEALTHY_LOSSES = [4.0, 3.9, 3.8, 3.7]
DRIFTING_LOSSES = [4.0, 4.3, 4.7, 5.2]  # same start, mean 14% above: caught by the mean check


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
    estimate_bias: float = 1.0  # estimate / true tensor bytes
    context_bytes: float = 0.25 * GiB  # device context the estimator does not see
    fragmentation: float = 0.0  # extra fraction of activation bytes the allocator wastes
    m_peak: float | None = None  # throughput falls past this micro batch
    noise: float = 0.0  # per-call measurement noise, uniform +-
    world_size: int = 1
    checkpoint_policies: tuple = ("full",)
    optimizer_bits: tuple = (32,)
    chunked_loss: tuple = (False,)
    logit_bytes_per_sample: float = 0.0  # logits + their gradient, which a chunked loss avoids
    compile: tuple = (False,)  # (False, True): compiled steps searched
    compile_speedup: float = 1.2  # compiled steps' speed over eager
    compile_fails: bool = False  # every compiled config is a compile_error
    compile_s: float = 20.0  # a compiled measurement's compiling (inductor, cold cache): device time, reported
    # Shapes added with the landscape suite (defaults: the shapes above were made with).
    freezable_share: float = 0.9  # of the parameters, the share the frozen blocks and embeddings hold
    freeze_speedup: float = 0.25  # speed gained with every block frozen (their weight gradients skipped)
    cliff_micro_batch: int | None = None  # from this micro batch on, `cliff_bytes` more (a kernel's
    cliff_bytes: float = 0.0  # workspace, an allocator rounding): a step the estimator does not see
    unhealthy_knobs: tuple = ()  # (field, value) pairs whose loss drifts, e.g. (("optimizer_bits", 8),)
    start_s: float = 3.0  # a trial's start on the device: child, CUDA context, model build
    estimate_s: float = 0.3  # one memory estimate (a fake step)
    window_s: float | None = 2.0  # a measurement's timed window; None: STEP_WINDOW steps (today's trials)
    cap_s: float | None = None  # the most one trial's steps may take (`Deadline.trial_cap_s`); None: no cap
    calls: list = field(default_factory=list)
    device_s: list = field(default_factory=lambda: [0.0])  # device time spent so far (a list: the class is frozen)
    # The device time at which the tune's budget ends: a measurement still running then is
    # cut there (the tune kills its child) and gives no result.
    stop_at_s: list = field(default_factory=lambda: [math.inf])
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def reset(self, seed: int | None = None) -> None:
        """Forget the calls; the per-call noise restarts (from `seed`'s own draws if given)."""
        self.calls.clear()
        self.device_s[0] = 0.0
        self.stop_at_s[0] = math.inf
        self.rng.seed(self.name if seed is None else f"{self.name}/{seed}")

    def space(self) -> SearchSpace:
        n = self.global_batch_size
        per_rank = n // self.world_size
        return SearchSpace(global_batch_size=n, precisions=tuple(self.rate),
                           micro_batch_sizes=tuple(m for m in range(1, per_rank + 1) if per_rank % m == 0),
                           max_checkpoint_blocks=self.n_blocks, max_freeze_blocks=self.max_freeze_blocks,
                           world_size=self.world_size, checkpoint_policies=self.checkpoint_policies,
                           optimizer_bits=self.optimizer_bits, chunked_loss=self.chunked_loss,
                           compile=self.compile)

    def tensor_bytes(self, c: TrainConfig) -> float:
        trainable = 1 - self.freezable_share * c.freeze_blocks / self.n_blocks
        weight_bytes = 2 if c.precision == "bf16-true" else 4
        moment_bytes = 2 * (1 + 4 / 256) if c.optimizer_bits == 8 else 2 * weight_bytes
        states = self.params * (weight_bytes + trainable * (weight_bytes + moment_bytes))
        if c.parallelism == "fsdp":
            gathered_blocks = 1 if c.reshard_after_forward else self.n_blocks
            states = states / self.world_size + self.params / self.n_blocks * weight_bytes * gathered_blocks
        elif c.parallelism == "ddp" and not c.gradient_as_bucket_view:
            states += self.params * weight_bytes * trainable
        return states + self.activation_bytes(c)

    def activation_bytes(self, c: TrainConfig) -> float:
        act = self.act_bytes_per_sample_block * (0.55 if c.precision in HALF else 1.0)
        kept = 0.45 if c.checkpoint_policy == "selective" else 1 / 8
        kept_blocks = (self.n_blocks - c.freeze_blocks - c.checkpoint_blocks) + c.checkpoint_blocks * kept
        logits = self.logit_bytes_per_sample / (16 if c.chunked_loss else 1)
        fused = 0.85 if c.compile else 1.0  # fused kernels keep fewer intermediates
        return c.micro_batch_size * (act * kept_blocks * fused + logits)

    def peak_bytes(self, c: TrainConfig) -> int:
        cliff = self.cliff_bytes if self.cliff_micro_batch and c.micro_batch_size >= self.cliff_micro_batch else 0
        return int(self.tensor_bytes(c) + self.fragmentation * self.activation_bytes(c) + self.context_bytes + cliff)

    def needed_bytes(self, c: TrainConfig) -> int:
        """What an OOM's message says `c` needed, as a real device reports it (CUDA: held by
        PyTorch plus the refused request): the bytes up to and including the first allocation
        that crosses the budget, in step order: the context and model states, each kept
        block's activations as 4 tensors, the logits, then what the estimator does not see
        (fragmentation, a cliff). A lower bound of `peak_bytes`: weak where the crossing
        allocation is small, strong where it is large (the logits of an LM)."""
        per_block = self.activation_bytes(c) - c.micro_batch_size * self.logit_bytes_per_sample / (
            16 if c.chunked_loss else 1)
        blocks = max(1, math.ceil(self.n_blocks - c.freeze_blocks))
        allocations = [self.context_bytes + self.tensor_bytes(c) - self.activation_bytes(c)]
        allocations += [per_block / (4 * blocks)] * (4 * blocks)
        allocations.append(self.activation_bytes(c) - per_block)
        allocations.append(self.peak_bytes(c) - sum(allocations))
        held = 0.0
        for size in allocations:
            held += size
            if held > self.budget_bytes:
                return int(held)
        return self.peak_bytes(c)

    def samples_per_s(self, c: TrainConfig) -> float:
        m = c.micro_batch_size
        speed = self.rate[c.precision] * m / (m + self.m_half)
        if self.m_peak is not None and m > self.m_peak:
            speed /= 1 + 0.25 * (m / self.m_peak - 1)
        speed /= 1 + (c.checkpoint_blocks / self.n_blocks) / (10 if c.checkpoint_policy == "selective" else 3)
        speed /= 1 + 0.03 * (c.grad_accum_steps - 1) / max(1, m)
        speed *= 1 + self.freeze_speedup * c.freeze_blocks / self.n_blocks
        speed /= (1.02 if c.optimizer_bits == 8 else 1.0) * (1.03 if c.chunked_loss else 1.0)
        if c.parallelism == "ddp":
            speed *= self.world_size / (1 + 0.4 / m)  # the all-reduce, amortised over the micro batch
        elif c.parallelism == "fsdp":
            speed *= self.world_size / (1 + (0.8 if c.reshard_after_forward else 0.6) / m)
        speed *= self.compile_speedup if c.compile else 1.0
        fixed = int(hashlib.sha256(_noise_key(c).encode()).hexdigest()[:4], 16) / 0xFFFF  # deterministic +-1%
        return speed * (0.99 + 0.02 * fixed)

    def healthy(self, c: TrainConfig) -> bool:
        return c.precision not in self.unhealthy and not any(getattr(c, k) == v for k, v in self.unhealthy_knobs)

    def clock(self) -> float:
        """Device seconds spent by the measurements and estimates so far."""
        return self.device_s[0]

    def step_s(self, c: TrainConfig) -> float:
        return self.global_batch_size / self.samples_per_s(c)

    def measure_s(self, c: TrainConfig, status: str, window_s: float | None = None, *, reference: bool = False) -> float:
        """What one measurement of `c` costs on the device (`reference`: for the losses,
        `REFERENCE_TRIAL_STEPS` steps, no warm-up and no time window)."""
        step_s = self.step_s(c)
        if status == "compile_error":
            return 2 * self.start_s
        start_s = self.start_s + (self.compile_s if c.compile else 0.0)  # the first step compiles
        if status == "oom":
            return start_s + step_s
        if reference:
            return start_s + REFERENCE_TRIAL_STEPS * step_s  # all its steps, uncapped
        window_s = self.window_s if window_s is None else window_s
        if window_s is None:
            return start_s + STEP_WINDOW * step_s
        return start_s + _steps_s(step_s, WARMUP_STEPS, MIN_WINDOW_STEPS, window_s, self.cap_s)

    def measure_reference(self, c: TrainConfig) -> Measurement:
        return self.measure(c, reference=True)

    def measure(self, c: TrainConfig, *, reference: bool = False) -> Measurement:
        m = self._measure(c)
        cost_s = self.measure_s(c, m.status, reference=reference)
        if self.device_s[0] + cost_s > self.stop_at_s[0]:
            self.device_s[0] = max(self.device_s[0], self.stop_at_s[0])
            return Measurement(status="timeout", config=c, budget_bytes=self.budget_bytes,
                               reason="cut at the end of the time budget (simulated)")
        self.device_s[0] += cost_s
        return m

    def _measure(self, c: TrainConfig) -> Measurement:
        self.calls.append(c)
        if c.compile and self.compile_fails:
            return Measurement(status="compile_error", config=c, budget_bytes=self.budget_bytes,
                               reason="torch.compile failed: Unsupported: graph break (simulated)")
        peak = self.peak_bytes(c)
        # The context is read at the trial's start: the part loaded lazily later (kernels,
        # workspaces) is in neither the reading nor the estimate. A trial that runs out of
        # memory has read it too.
        seen_context = int(0.6 * self.context_bytes)
        if peak > self.budget_bytes:
            return Measurement(status="oom", config=c, peak_memory_bytes=self.budget_bytes - seen_context,
                               overhead_bytes=seen_context, budget_bytes=self.budget_bytes, reason="simulated OOM",
                               needed_bytes=self.needed_bytes(c) - seen_context)
        sps = self.samples_per_s(c) * (1 + self.noise * (2 * self.rng.random() - 1))
        return Measurement(status="ok", config=c, peak_memory_bytes=peak - seen_context,
                           overhead_bytes=seen_context, budget_bytes=self.budget_bytes,
                           samples_per_s=sps, step_time_s=self.global_batch_size / sps,
                           losses=list(HEALTHY_LOSSES if self.healthy(c) else DRIFTING_LOSSES),
                           compile_s=self.compile_s if c.compile else None)

    def estimate(self, c: TrainConfig) -> int:
        self.device_s[0] += self.estimate_s
        return int(self.tensor_bytes(c.replace(compile=False)) * self.estimate_bias)  # compiled: as eager

    def works(self, c: TrainConfig) -> bool:
        """`c` fits, keeps its numerics and compiles: a config a profile may hold."""
        return (self.peak_bytes(c) <= self.budget_bytes and self.healthy(c)
                and not (c.compile and self.compile_fails))

    def one_liner_of(self, precisions: tuple = ONE_LINER_GPU) -> TrainConfig | None:
        """What a user tries first: the first of `precisions` here at the largest micro batch
        that truly fits with nothing checkpointed or frozen. None where it does not fit or drifts."""
        space = self.space()
        precision = next((p for p in precisions if p in space.precisions), None)
        if precision is None:
            return None
        fitting = [space.config(precision, m) for m in space.micro_batch_sizes]
        fitting = [c for c in fitting if self.works(c)]
        return fitting[-1] if fitting else None

    def fallback_of(self, precisions: tuple = ONE_LINER_GPU) -> TrainConfig | None:
        """The expert's fallback as a user runs it by hand: every block checkpointed in the
        one-liner's precision, the micro batch halved from the global batch (per rank) until a
        step truly fits, accumulating the rest. None where the one-liner fits the global batch
        (no user reaches for the fallback), where nothing fits so, or where it drifts."""
        space = self.space()
        precision = next((p for p in precisions if p in space.precisions), None)
        one = self.one_liner_of(precisions)
        if precision is None or (one is not None and one.micro_batch_size == space.micro_batch_sizes[-1]):
            return None
        micro = space.micro_batch_sizes[-1]
        while micro is not None:
            config = space.config(precision, micro, self.n_blocks)
            if self.peak_bytes(config) <= self.budget_bytes:
                return config if self.works(config) else None
            micro = next((m for m in reversed(space.micro_batch_sizes) if m <= micro // 2), None)
        return None

    def grid_best(self) -> tuple[TrainConfig, float]:
        feasible = [c for c in self.space().grid() if self.peak_bytes(c) <= self.budget_bytes and self.healthy(c)
                    and not (c.compile and self.compile_fails)]
        best = max(feasible, key=self.samples_per_s)
        return best, self.samples_per_s(best)


@dataclass(frozen=True)
class Run:
    """One search on a landscape: what it chose and what that is worth on the device."""

    landscape: str
    seed: int
    chosen: TrainConfig | None
    best: TrainConfig  # the exhaustive grid's optimum
    ratio: float  # the chosen config's true throughput / the optimum's; 0 if it does not fit or drifts
    trials: int  # search trials measured (the budget's count)
    measured: int  # measurements taken, repeats, reference and re-measured contenders included
    configs: int  # distinct configs measured
    grid: int
    stop_reason: str
    device_s: float = 0.0  # device time the search spent (measurements and estimates)
    one_liner: TrainConfig | None = None  # the landscape's one-liner (`one_liner_of`), if it fits and is healthy
    over_one_liner: float | None = None  # the chosen config's true throughput / the one-liner's
    # Device seconds until a measured config was worth `REACH_SHARE` of the optimum (truly:
    # it fits, keeps its numerics); None if none was. `warm`: the translated starts measured first.
    reach_s: float | None = None
    warm: tuple = ()
    ranked: tuple = ()  # the search's ranking, best first: what another card's warm start reads
    fallback: TrainConfig | None = None  # the expert's fallback (`fallback_of`), where it fits and is healthy
    over_fallback: float | None = None  # the chosen config's true throughput / the fallback's
    oom_trials: int = 0  # measurements that ran out of memory, the floors' included
    # ... of them, those the floors' ladders did not take (`_floor_ladder`): the search's own
    search_oom_trials: int = 0


REACH_SHARE = 0.95


def search(landscape: Landscape, seed: int, *, trials: int = SearchSpec().trials,
           patience: int = SearchSpec().patience, budget_s: float | None = None, anytime: bool = False,
           warm_from: tuple = ()) -> Run:
    """The tuner at `trials` and `patience` (the spec's defaults) on `landscape`, its sampler
    and the device's noise seeded with `seed`. `budget_s`: device seconds for the whole
    search. `anytime`: the one-liner measured first, windows sized in time, the search loop
    held to its share of the budget; else as before (step windows, the budget a timeout on
    the search loop, what follows it cut at the budget). `warm_from`: another card's ranked
    configs, translated here (`search.warm_start`, estimates on this card's clock) and measured first."""
    landscape.reset(seed)
    landscape.stop_at_s[0] = math.inf if budget_s is None else budget_s
    study = make_study(study_name=f"{landscape.name}-{seed}", storage=None, seed=seed)
    deadline = Deadline(budget_s, clock=landscape.clock, search_share=SEARCH_SHARE if anytime else 1.0)
    timed = dataclasses.replace(landscape, window_s=landscape.window_s if anytime else None,
                                cap_s=deadline.trial_cap_s() if anytime else None)
    best, best_sps = landscape.grid_best()
    reached: list[float] = []
    ooms: list[TrainConfig] = []

    def measure(c: TrainConfig, **kwargs) -> Measurement:
        m = timed.measure(c, **kwargs)
        if m.status == "oom":
            ooms.append(c)
        if not reached and m.status == "ok" and landscape.works(c) and landscape.samples_per_s(c) >= REACH_SHARE * best_sps:
            reached.append(landscape.clock())
        return m

    memory = MemoryModel(timed.estimate, Budget(usable_bytes=landscape.budget_bytes))
    warm = translate(warm_from, timed.space(), lambda c: memory.fits(c, [])) if warm_from else ()
    tuner = Tuner(timed.space(), study=study, budget=Budget(usable_bytes=landscape.budget_bytes), measure=measure,
                  starts=warm, estimate=timed.estimate, max_trials=trials, patience=patience, deadline=deadline,
                  one_liner=ONE_LINER_GPU if anytime else (), measure_reference=timed.measure_reference if anytime else None,
                  full_precision_slowdown=FULL_PRECISION_SLOWDOWN["cuda"])  # the landscapes are GPUs
    result = tuner.run()
    chosen = result.ranked[0].config if result.ranked else None
    worth = chosen is not None and landscape.works(chosen)
    ratio = landscape.samples_per_s(chosen) / best_sps if worth else 0.0
    one = landscape.one_liner_of()
    picked_sps = landscape.samples_per_s(chosen) if worth else 0.0
    over = picked_sps / landscape.samples_per_s(one) if one else None
    fallback = landscape.fallback_of()
    return Run(landscape=landscape.name, seed=seed, chosen=chosen, best=best, ratio=ratio,
               trials=tuner.spent(result.records), measured=len(landscape.calls),
               configs=len(set(landscape.calls)), grid=landscape.space().size, stop_reason=result.stop_reason,
               device_s=landscape.clock(), one_liner=one, over_one_liner=over, fallback=fallback,
               over_fallback=picked_sps / landscape.samples_per_s(fallback) if fallback else None,
               reach_s=reached[0] if reached else None, warm=warm,
               ranked=tuple(r.config for r in result.ranked), oom_trials=len(ooms),
               search_oom_trials=sum(not _floor_ladder(landscape, c) for c in ooms))


def _floor_ladder(landscape: Landscape, c: TrainConfig) -> bool:
    """`c` is a rung of the one-liner's or the expert's fallback's ladder: the one-liner's
    precision, the global batch split into a micro batch, and nothing checkpointed (the
    one-liner) or every block checkpointed (the fallback), nothing else changed. Their OOMs
    are the baselines' own (the expert runs out of memory on each rung above a fit)."""
    space = landscape.space()
    precision = next((p for p in ONE_LINER_GPU if p in space.precisions), None)
    return precision is not None and c.micro_batch_size in space.micro_batch_sizes and c in (
        space.config(precision, c.micro_batch_size), space.config(precision, c.micro_batch_size, landscape.n_blocks))


# Knobs added after the landscapes were made, at their defaults: left out of the key of the
# fixed per-config noise, so adding a knob does not reshuffle the landscapes.
_LATER_KNOB_DEFAULTS = {"checkpoint_policy": "full", "compile": False, "expandable_segments": False,
                        "cudnn_benchmark": False}


def _noise_key(c: TrainConfig) -> str:
    text = repr(c)
    for name, default in _LATER_KNOB_DEFAULTS.items():
        text = text.replace(f", {name}={default!r}", "")
    return text


GPU_RATES = {"32-true": 100.0, "tf32": 190.0, "16-mixed": 290.0, "bf16-mixed": 300.0, "bf16-true": 330.0}

LANDSCAPES = [
    # Roomy: a small model on a large card; the largest micro batch at the fastest precision.
    Landscape(name="roomy", params=125e6, act_bytes_per_sample_block=60e6, n_blocks=12, global_batch_size=64,
              budget_bytes=78 * GiB, rate=GPU_RATES, m_half=6.0, estimate_bias=0.88),
    # Tight: the model states take most of a 24 GiB card; checkpointing buys batch.
    Landscape(name="tight", params=1.0e9, act_bytes_per_sample_block=150e6, n_blocks=24, global_batch_size=128,
              budget_bytes=24 * GiB, rate=GPU_RATES, m_half=8.0, estimate_bias=0.88),
    # A 1.2 GiB context and 15% fragmentation of activations, neither seen by the estimator,
    # on a 16 GiB card: a multiplicative correction learned on small configs over-predicts
    # the large ones.
    Landscape(name="context+frag", params=350e6, act_bytes_per_sample_block=110e6, n_blocks=24,
              global_batch_size=96, budget_bytes=16 * GiB, rate=GPU_RATES, m_half=6.0,
              context_bytes=1.2 * GiB, fragmentation=0.15),
    # The estimator over-predicts by 20%: trusted as is, it would prune the optimum.
    Landscape(name="over-predict", params=700e6, act_bytes_per_sample_block=120e6, n_blocks=24,
              global_batch_size=128, budget_bytes=40 * GiB, rate=GPU_RATES, m_half=10.0,
              estimate_bias=1.2, context_bytes=0.6 * GiB),
    # Every measurement +-4% on every call (a shared GPU): one short measurement is a coin toss.
    Landscape(name="noisy", params=350e6, act_bytes_per_sample_block=80e6, n_blocks=16, global_batch_size=64,
              budget_bytes=24 * GiB, rate=GPU_RATES, m_half=4.0, noise=0.04, context_bytes=0.8 * GiB),
    # Throughput peaks at micro batch 8 and falls past it: the largest batch is not the best.
    Landscape(name="peaked", params=125e6, act_bytes_per_sample_block=60e6, n_blocks=12, global_batch_size=96,
              budget_bytes=40 * GiB, rate=GPU_RATES, m_half=2.0, m_peak=8.0, context_bytes=0.5 * GiB),
    # fp16 is fastest but its loss drifts (unhealthy); freezing allowed; bf16-true absent.
    Landscape(name="drift+freeze", params=350e6, act_bytes_per_sample_block=90e6, n_blocks=16, global_batch_size=96,
              budget_bytes=16 * GiB,
              rate={"32-true": 100.0, "tf32": 180.0, "16-mixed": 320.0, "bf16-mixed": 280.0},
              m_half=4.0, max_freeze_blocks=4, unhealthy=("16-mixed",), estimate_bias=0.88),
    # A grid of more than 5,000 configs: 20 micro batches x 4 precisions x checkpointing x
    # freezing, with a context and noise.
    # Two ranks of a 24 GiB card: whole model states leave DDP only small micro batches or
    # checkpointing; sharded FSDP2 fits larger ones, but its gathers cost more per step.
    Landscape(name="two-ranks", params=1.2e9, act_bytes_per_sample_block=150e6, n_blocks=24,
              global_batch_size=64, budget_bytes=24 * GiB, world_size=2,
              rate={"32-true": 100.0, "bf16-mixed": 300.0}, m_half=6.0, estimate_bias=0.9,
              context_bytes=0.8 * GiB),
    # Selective checkpointing searched beside full: selective recomputes less but keeps more,
    # so the fastest point (selective, 22 of 24 blocks at micro batch 32) needs more blocks
    # than full's at the same batch.
    Landscape(name="selective", params=1.0e9, act_bytes_per_sample_block=150e6, n_blocks=24,
              global_batch_size=128, budget_bytes=40 * GiB, rate=GPU_RATES, m_half=8.0, estimate_bias=0.88,
              checkpoint_policies=("full", "selective"), context_bytes=0.8 * GiB),
    # An LM on a 24 GiB card: fp32 AdamW state takes 16 of them and the logits are a tenth of a
    # sample's activations; 8-bit state and the chunked loss buy a larger micro batch.
    Landscape(name="lm-memory-knobs", params=1.0e9, act_bytes_per_sample_block=100e6, n_blocks=24,
              global_batch_size=64, budget_bytes=24 * GiB, rate={"32-true": 100.0, "bf16-mixed": 300.0,
                                                                 "bf16-true": 320.0},
              m_half=8.0, estimate_bias=0.9, context_bytes=0.8 * GiB, logit_bytes_per_sample=400e6,
              optimizer_bits=(32, 8), chunked_loss=(False, True)),
    # Compiled steps searched: 1.2x faster and 15% leaner activations, which the estimator
    # (eager) does not see.
    Landscape(name="compiled", params=350e6, act_bytes_per_sample_block=110e6, n_blocks=24,
              global_batch_size=96, budget_bytes=16 * GiB, rate=GPU_RATES, m_half=6.0,
              context_bytes=1.2 * GiB, fragmentation=0.15, compile=(False, True)),
    Landscape(name="large-grid", params=1.3e9, act_bytes_per_sample_block=100e6, n_blocks=16,
              global_batch_size=240, budget_bytes=32 * GiB,
              rate={"32-true": 100.0, "tf32": 180.0, "bf16-mixed": 300.0, "bf16-true": 320.0},
              m_half=8.0, max_freeze_blocks=4, context_bytes=1.0 * GiB, fragmentation=0.05, noise=0.03),
]


# --- the landscape suite (benchmarks/anytime.py --trial-budget) -----------------------------
# Shapes a real GPU and model can present, each made to break one assumption a search could
# lean on; then a seeded parametric family, so the suite is not only shapes picked by hand.

SHAPED = [
    # bf16-true is the fastest precision but drifts; freezing (up to 8 of 16 blocks) frees
    # most of the optimizer state, so what fits at each precision depends on the depth.
    Landscape(name="bf16true-drift+freeze", params=1.3e9, act_bytes_per_sample_block=90e6, n_blocks=16,
              global_batch_size=128, budget_bytes=24 * GiB, rate=GPU_RATES, m_half=6.0, max_freeze_blocks=8,
              unhealthy=("bf16-true",), estimate_bias=0.9, context_bytes=0.8 * GiB, fragmentation=0.1),
    # A 3B model on 40 GiB: unfrozen, only bf16-true's halved states fit (and it drifts);
    # freezing 22 of 24 blocks frees nearly all gradient and optimizer state.
    Landscape(name="freeze-frees-most", params=3.0e9, act_bytes_per_sample_block=120e6, n_blocks=24,
              global_batch_size=96, budget_bytes=40 * GiB, rate=GPU_RATES, m_half=8.0, max_freeze_blocks=22,
              freezable_share=0.97, unhealthy=("bf16-true",), estimate_bias=0.92, context_bytes=1.0 * GiB),
    # A memory cliff: from micro batch 16 on a 3 GiB workspace the estimator does not see,
    # so the calibrated model says 16 fits when it does not.
    Landscape(name="cliff", params=350e6, act_bytes_per_sample_block=100e6, n_blocks=24, global_batch_size=128,
              budget_bytes=24 * GiB, rate=GPU_RATES, m_half=12.0, cliff_micro_batch=16, cliff_bytes=3 * GiB,
              context_bytes=0.8 * GiB),
    # Flat: saturated from micro batch 2, the 16-bit precisions within 3% of each other, 2% noise.
    Landscape(name="plateau", params=350e6, act_bytes_per_sample_block=80e6, n_blocks=16, global_batch_size=128,
              budget_bytes=24 * GiB, rate={"32-true": 100.0, "16-mixed": 296.0, "bf16-mixed": 300.0,
                                           "bf16-true": 305.0},
              m_half=0.3, noise=0.02, context_bytes=0.8 * GiB),
    # Every fast point needs checkpointing: even micro batch 1 at 16 bits does not fit without it.
    Landscape(name="checkpoint-everywhere", params=1.3e9, act_bytes_per_sample_block=500e6, n_blocks=32,
              global_batch_size=64, budget_bytes=40 * GiB, rate=GPU_RATES, m_half=4.0, estimate_bias=0.9,
              context_bytes=1.0 * GiB, fragmentation=0.1),
    # The estimator sees only three quarters of the bytes: every seed trusted as is runs out of memory.
    Landscape(name="under-predict", params=700e6, act_bytes_per_sample_block=120e6, n_blocks=24,
              global_batch_size=128, budget_bytes=32 * GiB, rate=GPU_RATES, m_half=10.0, estimate_bias=0.75,
              context_bytes=0.6 * GiB),
    # ... and one that over-predicts by 35%.
    Landscape(name="over-predict-35", params=700e6, act_bytes_per_sample_block=120e6, n_blocks=24,
              global_batch_size=128, budget_bytes=32 * GiB, rate=GPU_RATES, m_half=10.0, estimate_bias=1.35,
              context_bytes=0.6 * GiB),
    # Throughput peaks at micro batch 2: long accumulation wins; with freezing and noise.
    Landscape(name="small-peak+freeze", params=350e6, act_bytes_per_sample_block=60e6, n_blocks=12,
              global_batch_size=96, budget_bytes=24 * GiB, rate=GPU_RATES, m_half=0.5, m_peak=2.0,
              max_freeze_blocks=6, noise=0.02, context_bytes=0.5 * GiB),
    # An LM whose 8-bit optimizer state drifts and whose bf16-true drifts: only the chunked
    # loss is a memory knob that may pay.
    Landscape(name="lean-knobs-drift", params=1.0e9, act_bytes_per_sample_block=100e6, n_blocks=24,
              global_batch_size=64, budget_bytes=24 * GiB, rate={"32-true": 100.0, "bf16-mixed": 300.0,
                                                                 "bf16-true": 330.0},
              m_half=8.0, estimate_bias=0.9, context_bytes=0.8 * GiB, logit_bytes_per_sample=400e6,
              optimizer_bits=(32, 8), chunked_loss=(False, True), unhealthy=("bf16-true",),
              unhealthy_knobs=(("optimizer_bits", 8),)),
    # Selective checkpointing with freezing: the checkpointable blocks shrink as the depth grows.
    Landscape(name="selective+freeze", params=1.0e9, act_bytes_per_sample_block=150e6, n_blocks=24,
              global_batch_size=128, budget_bytes=32 * GiB, rate=GPU_RATES, m_half=8.0, estimate_bias=0.88,
              checkpoint_policies=("full", "selective"), max_freeze_blocks=6, context_bytes=0.8 * GiB),
    # Two ranks with freezing: DDP keeps whole states, which freezing shrinks.
    Landscape(name="two-ranks+freeze", params=1.2e9, act_bytes_per_sample_block=150e6, n_blocks=24,
              global_batch_size=64, budget_bytes=24 * GiB, world_size=2, max_freeze_blocks=12,
              rate={"32-true": 100.0, "bf16-mixed": 300.0, "bf16-true": 320.0}, m_half=6.0,
              unhealthy=("bf16-true",), estimate_bias=0.9, context_bytes=0.8 * GiB),
    # Compiled steps over a memory cliff, with fragmentation the estimator does not see.
    Landscape(name="compiled-cliff", params=350e6, act_bytes_per_sample_block=110e6, n_blocks=24,
              global_batch_size=96, budget_bytes=16 * GiB, rate=GPU_RATES, m_half=6.0, context_bytes=1.2 * GiB,
              fragmentation=0.15, compile=(False, True), cliff_micro_batch=12, cliff_bytes=1.5 * GiB),
    # Freezing that buys little speed but most of the memory, fp16 the fastest and drifting.
    Landscape(name="freeze-memory-only", params=2.0e9, act_bytes_per_sample_block=60e6, n_blocks=32,
              global_batch_size=256, budget_bytes=32 * GiB, rate=GPU_RATES, m_half=16.0, max_freeze_blocks=24,
              freezable_share=0.95, freeze_speedup=0.02, unhealthy=("16-mixed",), estimate_bias=1.1,
              context_bytes=1.0 * GiB, fragmentation=0.2),
]


# --- landscapes timed as a GPU runs them (benchmarks/anytime.py) ------------------------------

TIMED = [
    # GPT-2 small (124M, sequence 1024, global batch 64) on an H100 80GB, calibrated to the hand
    # loops of issue 33: fp32 fits micro batch 32 only (53.1 samples/s at 32 x 2), tf32 149.3,
    # bf16-mixed at 64 (the one-liner) 322.8, bf16-true 64 x 1 356.0; the logits (50304 x 1024,
    # and their gradient) are a large part of each sample's bytes; the estimator sees 85% of
    # them, so 32-true at 64 runs out of memory as it did there; a trial starts in 4 s.
    Landscape(name="h100-gpt-small", params=124e6, act_bytes_per_sample_block=100e6, n_blocks=12,
              global_batch_size=64, budget_bytes=78 * GiB, m_half=2.0, logit_bytes_per_sample=400e6,
              rate={"32-true": 56.4, "tf32": 158.7, "16-mixed": 320.0, "bf16-mixed": 332.8, "bf16-true": 367.0},
              estimate_bias=0.85, context_bytes=1.5 * GiB, fragmentation=0.05, start_s=4.0, estimate_s=0.5),
    # fp32 six times slower than 16-bit, 32-true first in the seeds' order, on a card where
    # the large micro batches need checkpointing: a slow precision's trials eat the budget.
    Landscape(name="fp32-6x-slower", params=350e6, act_bytes_per_sample_block=150e6, n_blocks=24,
              global_batch_size=128, budget_bytes=40 * GiB, m_half=4.0, estimate_bias=0.9,
              rate={"32-true": 50.0, "tf32": 150.0, "16-mixed": 290.0, "bf16-mixed": 300.0, "bf16-true": 330.0},
              context_bytes=1.0 * GiB, fragmentation=0.05, start_s=4.0, estimate_s=0.5),
]


# One model on three cards, for warm starts across GPU kinds (benchmarks/warm_start.py): GPT-2
# small as in `h100-gpt-small`, its rates scaled from the H100's by each card's dense peaks and
# bandwidth (A100-40G: fp32 19.5, tf32 156, 16-bit 312 TFLOP/s against the H100's 67, 495,
# 989; the L4-24G: 30, 60, 121 at 300 GB/s), its saturation by its SM count (132, 108, 58), its
# budget the card's memory less the driver's share. All three run bf16 and tf32 (Ampere and later).
_GPT_SMALL = dict(params=124e6, act_bytes_per_sample_block=100e6, n_blocks=12, global_batch_size=64,
                  logit_bytes_per_sample=400e6, estimate_bias=0.85, fragmentation=0.05, start_s=4.0, estimate_s=0.5,
                  noise=0.02)
CARDS = {
    "h100-80g": Landscape(name="h100-80g", budget_bytes=78 * GiB, m_half=2.0, context_bytes=1.5 * GiB,
                          rate={"32-true": 56.4, "tf32": 158.7, "16-mixed": 320.0, "bf16-mixed": 332.8,
                                "bf16-true": 367.0}, **_GPT_SMALL),
    "a100-40g": Landscape(name="a100-40g", budget_bytes=38 * GiB, m_half=1.6, context_bytes=1.3 * GiB,
                          rate={"32-true": 17.5, "tf32": 58.0, "16-mixed": 118.0, "bf16-mixed": 123.0,
                                "bf16-true": 136.0}, **_GPT_SMALL),
    "l4-24g": Landscape(name="l4-24g", budget_bytes=int(21.5 * GiB), m_half=0.9, context_bytes=1.0 * GiB,
                        rate={"32-true": 8.6, "tf32": 19.5, "16-mixed": 38.0, "bf16-mixed": 40.0, "bf16-true": 44.0},
                        **_GPT_SMALL),
}


# --- memory-bound landscapes: the one-liner does not fit the global batch (issue 43) ---------
# Calibrated from each model's Hugging Face config, not from any search: model states 16 B per
# parameter (8 in bf16-true); a block's saved activations 34·s·h bytes per sample in 16 bits
# (Korthikanti et al. 2022, attention by a fused kernel: no s² term), written here in fp32
# bytes (x 1/0.55); the LM head's logits and their gradient in fp32 (s x vocab x 8 B); the
# speed at saturation from 6·N·s FLOPs per sample at ~45% of the card's dense bf16 peak; long
# sequences saturate a GPU at a micro batch of about one (`m_half`); a 1B model's trial starts
# in ~6 s (child, CUDA context, model build) and its memory estimate (a fake step traced on the
# host's CPU) takes seconds: issue 43 measured 4-9 s for GPT-2 XL.
_MB_RATES = {"32-true": 0.15, "tf32": 0.45, "bf16-mixed": 1.0, "bf16-true": 1.08}  # x the bf16-mixed rate


def _mb_rates(bf16_samples_per_s: float, precisions: tuple = tuple(_MB_RATES)) -> dict:
    return {p: round(_MB_RATES[p] * bf16_samples_per_s, 2) for p in precisions}


MEMORY_BOUND = [
    # TinyLlama-1.1B (22 blocks, h 2048, GQA, vocab 32000) at 2048 tokens on a 24 GiB card
    # (RTX 4090, ~75 TFLOP/s reached): states take 16.4 GiB, a sample's activations 3.7 GB.
    Landscape(name="mb-llama1.1b-2k-24g", params=1.1e9, act_bytes_per_sample_block=260e6, n_blocks=22,
              global_batch_size=16, budget_bytes=24 * GiB, rate=_mb_rates(5.5), m_half=1.0,
              logit_bytes_per_sample=524e6, estimate_bias=0.9, context_bytes=1.0 * GiB, fragmentation=0.1,
              start_s=6.0, estimate_s=3.0),
    # GPT-2 XL (1.56B, 48 blocks, h 1600, vocab 50257) at 1024 tokens on an A100 40GB
    # (~140 TFLOP/s reached); bf16-true drifts (its loss is not 32-true's).
    Landscape(name="mb-gpt2xl-1k-40g", params=1.56e9, act_bytes_per_sample_block=101e6, n_blocks=48,
              global_batch_size=32, budget_bytes=40 * GiB, rate=_mb_rates(14.6), m_half=2.0,
              logit_bytes_per_sample=412e6, unhealthy=("bf16-true",), estimate_bias=0.85,
              context_bytes=1.2 * GiB, fragmentation=0.1, start_s=8.0, estimate_s=4.0),
    # A 1.3B decoder (24 blocks, h 2048, vocab 50304) at 4096 tokens on 40 GiB: the logits are
    # 1.65 GB a sample, so the chunked loss and 8-bit AdamW state are searched (opt-in).
    Landscape(name="mb-decoder1.3b-4k-40g", params=1.3e9, act_bytes_per_sample_block=518e6, n_blocks=24,
              global_batch_size=32, budget_bytes=40 * GiB, rate=_mb_rates(4.4), m_half=0.5,
              logit_bytes_per_sample=1.65e9, optimizer_bits=(32, 8), chunked_loss=(False, True),
              estimate_bias=0.92, context_bytes=1.0 * GiB, fragmentation=0.08, noise=0.02,
              start_s=6.0, estimate_s=3.0),
    # XLM-R large (560M, 24 blocks, h 1024, vocab 250002: logits of the 15% masked tokens)
    # at 512 tokens on a 16 GiB card (V100, ~60 TFLOP/s reached), global batch 256.
    Landscape(name="mb-xlmr-large-512-16g", params=5.6e8, act_bytes_per_sample_block=32e6, n_blocks=24,
              global_batch_size=256, budget_bytes=16 * GiB, rate=_mb_rates(35.0, ("32-true", "bf16-mixed")),
              m_half=4.0, logit_bytes_per_sample=154e6, estimate_bias=1.1, context_bytes=0.8 * GiB,
              fragmentation=0.12, start_s=5.0, estimate_s=1.5),
    # GPT-2 large (774M, 36 blocks, h 1280) at 1024 tokens on a 16 GiB card (~40 TFLOP/s):
    # the one-liner fits micro batch 1 only, with 32 accumulation steps.
    Landscape(name="mb-gpt2large-1k-16g", params=7.74e8, act_bytes_per_sample_block=81e6, n_blocks=36,
              global_batch_size=32, budget_bytes=16 * GiB, rate=_mb_rates(8.4), m_half=1.5,
              logit_bytes_per_sample=412e6, estimate_bias=0.9, context_bytes=0.8 * GiB, fragmentation=0.1,
              start_s=5.0, estimate_s=2.0),
]


def _steps_s(step_s: float, warmup: int, least: int, window_s: float, cap_s: float | None) -> float:
    """The device time of a trial's warm-up and window, as `measure.steps.Steps` takes them:
    `warmup` steps, then `least` steps or `window_s` (as a time, not whole steps), whichever is
    longer. Under a cap: warm-up ends with the step that reaches half of it (one at least), the
    window with the step that reaches all of it (one at least)."""
    if cap_s is None:
        return warmup * step_s + max(window_s, least * step_s)
    warm = min(warmup, max(1, math.ceil(0.5 * cap_s / step_s))) if warmup else 0
    window = max(window_s, least * step_s)
    if warm * step_s + window > cap_s:
        window = min(window, max(1, math.ceil((cap_s - warm * step_s) / step_s)) * step_s)
    return warm * step_s + window


def generated(count: int, seed: int = 2026) -> list[Landscape]:
    """`count` landscapes drawn from a seeded parametric family: model and card sizes, block
    counts, saturation and peaks, estimator bias both ways, unseen context, fragmentation and
    cliffs, noise, drifting precisions and 8-bit state, freezing, checkpoint policies, memory
    knobs, compiled steps and two ranks, each drawn independently. The budget is drawn
    between the leanest config's peak and the plain 32-true full batch's, so most draws are
    tight; a draw where no healthy config fits, or where a drift could not be seen (no
    full-precision reference fits), is drawn again."""
    rng = random.Random(seed)
    out: list[Landscape] = []
    while len(out) < count:
        candidate = _draw(rng, f"gen-{seed}-{len(out):02d}")
        if candidate is not None:
            out.append(candidate)
    return out


def _draw(rng: random.Random, name: str) -> Landscape | None:
    n_blocks = rng.choice((8, 12, 16, 24, 32))
    world_size = 2 if rng.random() < 0.15 else 1
    global_batch = rng.choice((32, 48, 64, 96, 128, 192, 256)) * world_size
    precisions = ["32-true"] + [p for p in ("tf32", "16-mixed", "bf16-mixed", "bf16-true") if rng.random() < 0.7]
    half = rng.uniform(2.0, 3.4)
    rate = {"32-true": 100.0, "tf32": rng.uniform(130, 200), "16-mixed": 100 * half * rng.uniform(0.93, 1.07),
            "bf16-mixed": 100 * half, "bf16-true": 100 * half * rng.uniform(0.97, 1.15)}
    rate = {p: round(rate[p], 1) for p in precisions}
    low = [p for p in precisions if p in HALF]
    unhealthy = tuple(p for p in low if rng.random() < 0.25)
    lm = rng.random() < 0.3 and world_size == 1  # the chunked loss runs in one process only
    knobs = {}
    if lm:
        knobs = dict(logit_bytes_per_sample=rng.uniform(0.5, 4) * 100e6, optimizer_bits=(32, 8),
                     chunked_loss=(False, True), unhealthy_knobs=(("optimizer_bits", 8),) if rng.random() < 0.3 else ())
    max_freeze = rng.randint(1, n_blocks - 2) if rng.random() < 0.4 else 0
    cliff = rng.random() < 0.25
    landscape = Landscape(
        name=name, params=math.exp(rng.uniform(math.log(100e6), math.log(3e9))),
        act_bytes_per_sample_block=math.exp(rng.uniform(math.log(20e6), math.log(400e6))), n_blocks=n_blocks,
        global_batch_size=global_batch, budget_bytes=0, rate=rate, m_half=rng.uniform(0.3, 16),
        m_peak=rng.choice((2.0, 4.0, 8.0, 16.0, 32.0)) if rng.random() < 0.3 else None,
        max_freeze_blocks=max_freeze, unhealthy=unhealthy, estimate_bias=rng.uniform(0.78, 1.3),
        context_bytes=rng.uniform(0.2, 2.0) * GiB, fragmentation=rng.uniform(0.0, 0.25),
        noise=rng.uniform(0.01, 0.04) if rng.random() < 0.3 else 0.0, world_size=world_size,
        checkpoint_policies=("full", "selective") if rng.random() < 0.3 else ("full",),
        compile=(False, True) if rng.random() < 0.2 else (False,), compile_speedup=rng.uniform(1.05, 1.4),
        freezable_share=rng.uniform(0.6, 0.97), freeze_speedup=rng.uniform(0.0, 0.4),
        cliff_micro_batch=rng.choice((4, 8, 16, 32)) if cliff else None,
        cliff_bytes=rng.uniform(0.5, 4) * GiB if cliff else 0.0, **knobs)
    if landscape.space().size > 8000:  # the exhaustive optimum stays quick to compute
        return None
    grid = landscape.space().grid()
    peaks = sorted(landscape.peak_bytes(c) for c in grid)
    # Between the leanest config and the largest: a log-uniform draw, so tight cards are common.
    low_bytes, high_bytes = peaks[0] * 1.05, peaks[-1] * 1.1
    budget = int(math.exp(rng.uniform(math.log(low_bytes), math.log(high_bytes))))
    landscape = dataclasses.replace(landscape, budget_bytes=budget)
    feasible = [c for c in grid if landscape.peak_bytes(c) <= budget]
    healthy = [c for c in feasible if landscape.healthy(c)]
    reference = [c for c in feasible if c.precision == "32-true" and c.optimizer_bits == 32]
    if not healthy or (len(healthy) < len(feasible) and not reference):
        return None
    return landscape
