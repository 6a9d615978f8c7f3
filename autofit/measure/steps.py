"""The steps of one trial, in order: the CPU tracker's own pass (memory), compiling, the
warm-up (until steps are steady), then the timed steps (speed).

- **Memory.** On a CPU the tracker watches the first `TRACKED_STEPS` steps (it slows every
  op); after them the malloc meter (`HeapMeter`) is read after every step, so memory that
  grows from step to step (a model that keeps tensors) counts in the peak and crosses the
  budget as an out-of-memory error. On CUDA the allocator's peak covers the whole run.
- **Warm-up.** At least one step after the tracked ones (`search.warmup_steps: 0` none; but
  one worst-case step where lengths vary, and a GradScaler that has found its scale, always),
  then until a step takes within `STEADY_RTOL` of the one before, at most
  `search.warmup_steps` steps.
- **Timing.** Each timed step alone, synchronised, with the host's foreign load over them
  and the spread of their times. The window is sized in seconds: steps until their times add
  up to `window_s`, at least `measure_steps` of them and at most `MAX_WINDOW_STEPS` (a window
  of 0 s: exactly `measure_steps`). A 1.2 s step and a 0.02 s step then cost about the same
  wall time, and a fast step's figure is a median over many.
- **A cap** (`cap_s`, the tune's `Deadline.trial_cap_s`): once the untracked warm-up and the
  timed steps have taken half of it, warm-up stops (after one step); once they have taken all
  of it, so does the window (after one timed step that updated the weights; all ranks stop
  together). A step slower than the time budget can afford five of is measured from one.
"""

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from loguru import logger

from autofit.device.load import HostLoad
from autofit.device.memory import check_growth, HeapMeter, LiveBytesTracker
from autofit.device.oom import is_oom
from autofit.measure.measurement import TRACKED_STEPS
from autofit.train import distributed
from autofit.train.configure import compile_count
from autofit.train.runner import Runner

MAX_COMPILE_STEPS = 4  # compile=true: warm-up steps that may compile (forward, backward, another shape)
STEADY_RTOL = 0.10  # a warm-up step within this of the one before: steady, the clock starts
# GradScaler starts at 2**16 and halves per overflow: 24 halvings reach 2**-8, below which
# the gradients overflow fp16 at any scale and the skipping is the model's, not the warm-up's.
SCALER_WARMUP_SKIPS = 24
# A window in seconds stops here whatever its time: a step of microseconds (a toy model)
# would otherwise fill it with tens of thousands.
MAX_WINDOW_STEPS = 200


class CompileFailed(Exception):
    """torch.compile failed on this config: the trial's status is compile_error."""


@dataclass
class StepLog:
    """What the steps saw."""

    losses: list = field(default_factory=list)  # every optimizer step's loss, from step 0 (device tensors)
    warmup_skips: int = 0  # fp16 warm-up steps done again while the GradScaler found its scale
    warmup_times_s: list[float] = field(default_factory=list)  # the untracked warm-up steps
    compile_s: float | None = None
    step_times_s: list[float] = field(default_factory=list)  # the timed steps
    tokens: list = field(default_factory=list)  # non-pad tokens per timed step (varying lengths)
    skipped: int = 0  # GradScaler skips among the timed steps
    load: dict = field(default_factory=dict)  # the host's foreign load over the timed steps
    peak_bytes: int = 0  # CPU: the tracked peak plus what live memory grew since

    @property
    def spread(self) -> float | None:
        """(max - min) / (2 x median) of the timed steps: the trial's own noise."""
        times = self.step_times_s
        return None if len(times) < 2 else (max(times) - min(times)) / (2 * statistics.median(times))


class Steps:
    def __init__(self, runner: Runner, *, tracker: LiveBytesTracker | None, budget_bytes: int | None,
                 warmup_steps: int, measure_steps: int, window_s: float = 0.0, cap_s: float | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.runner, self.tracker, self.budget_bytes = runner, tracker, budget_bytes
        self.warmup_steps, self.measure_steps, self.window_s = warmup_steps, measure_steps, window_s
        self.cap_s = cap_s
        self.clock = clock  # a seam: tests feed the step times
        self.capped_since: float | None = None  # the clock at the first untracked step
        self.heap = HeapMeter()
        self.log = StepLog()
        self.step = 0

    def warm_up(self) -> None:
        """Every step before the clock."""
        runner = self.runner
        # Memory is measured on the largest step the data can give (`peak_batch`: the longest
        # samples at this micro batch), speed on the real steps that follow.
        if self.tracker is not None:
            # The tracker sees every op and slows them: a pass of its own, before timing. Its
            # steps are real optimizer steps and count as warm-up.
            with self.tracker:
                for _ in range(TRACKED_STEPS):
                    logger.info("tracked step {}", self.step)
                    self._warm_step(runner.peak_batch(self.step))
            self.heap.mark()
            self.log.peak_bytes = self.tracker.peak_bytes
        if runner.config.compile:
            self._warm_compiled()
        # One untracked step at least (unless warm-up is off; but one worst-case step where
        # lengths vary, and a GradScaler warmed up before the clock, always), then until steady.
        least = max(min(1, self.warmup_steps), int(runner.varying_lengths), int(runner.scaler.is_enabled()))
        most = max(least, self.warmup_steps)
        while len(self.log.warmup_times_s) < most:
            logger.info("warm-up step {}", self.step)
            started = self._mark()
            self._warm_step(runner.peak_batch(self.step))
            runner.synchronize()
            self.log.warmup_times_s.append(self.clock() - started)
            steady = len(self.log.warmup_times_s) >= least and _steady(self.log.warmup_times_s)
            if self._agreed(steady or self._past_cap(0.5)):
                break

    def timed(self) -> None:
        """Optimizer steps, each timed alone, until the window is full (`_window_full`)."""
        runner, log = self.runner, self.log
        load = HostLoad()
        load.start()
        while not self._window_full():
            logger.info("timed step {}", self.step)
            batch = None  # the previous step's batch is freed before the next is built
            batch = runner.global_batch(self.step)  # built (and copied to the device) before the clock
            log.tokens.append(runner.tokens_in(batch))
            runner.synchronize()
            started = self._mark()
            result = runner.step(batch)
            runner.synchronize()
            log.step_times_s.append(self.clock() - started)
            log.losses.append(result.loss.detach())
            log.skipped += int(result.skipped)
            self._after_step()
        log.load = load.stop()

    def _window_full(self) -> bool:
        """At least `measure_steps` timed, and their times add up to `window_s` (or
        MAX_WINDOW_STEPS are timed); or past the cap, with one timed step not skipped."""
        times = self.log.step_times_s
        full = len(times) >= self.measure_steps and (sum(times) >= self.window_s
                                                     or len(times) >= max(MAX_WINDOW_STEPS, self.measure_steps))
        # Past the cap, one timed step that updated the weights ends it (a GradScaler skip
        # right after warm-up is common and would leave the trial's only step a skipped one).
        capped = not full and len(times) > self.log.skipped and self._past_cap(1.0)
        if capped:
            logger.info("window ends after {} timed step(s): the trial's steps reached its cap ({:.1f} s)",
                        len(times), self.cap_s)
        return self._agreed(full or capped)

    def _agreed(self, decided: bool) -> bool:
        """`decided` as all ranks take it (any rank's yes): each rank reads its own clock, and
        ranks that stopped apart would wait on each other's collectives."""
        if distributed.current_world_size() == 1:
            return decided
        return bool(distributed.max_over_ranks(int(decided), self.runner.device))

    def _mark(self) -> float:
        """The clock now; the first untracked step starts the cap's clock."""
        now = self.clock()
        if self.capped_since is None:
            self.capped_since = now
        return now

    def _past_cap(self, share: float) -> bool:
        """The untracked steps have taken `share` of the cap."""
        return (self.cap_s is not None and self.capped_since is not None
                and self.clock() - self.capped_since >= share * self.cap_s)

    def _warm_step(self, batch: list) -> None:
        """A warm-up step. fp16's GradScaler starts at a scale that usually overflows and halves
        it on every skipped step: the step is done again (the skipped update changed nothing)
        until one is taken or SCALER_WARMUP_SKIPS are spent, so the timed steps are real
        updates and the losses still belong to their steps."""
        runner = self.runner
        while True:
            result = runner.step(batch)
            if not result.skipped or self.log.warmup_skips >= SCALER_WARMUP_SKIPS:
                break
            self.log.warmup_skips += 1
            logger.info("GradScaler skipped the warm-up step (scale now {}); again", runner.scaler.get_scale())
        self.log.losses.append(result.loss.detach())
        self._after_step()

    def _after_step(self) -> None:
        self.step += 1
        if self.tracker is not None and self.step > TRACKED_STEPS:
            self.log.peak_bytes = max(self.log.peak_bytes, check_growth(
                self.heap, self.tracker.peak_bytes, self.budget_bytes, self.step - 1))

    def _warm_compiled(self) -> None:
        """Warm-up steps until one compiles nothing (at most MAX_COMPILE_STEPS), so the timed
        steps run what is compiled. The compile time is the compiling steps' time beyond what
        the first steady step took. A failure while compiling is `CompileFailed`, unless it is
        an out-of-memory error."""
        runner = self.runner
        compiling_s, compiled_steps = 0.0, 0
        for attempt in range(MAX_COMPILE_STEPS):
            before = compile_count()
            logger.info("compile step {}", self.step)
            # The widest step first; then real steps: where lengths vary, a second shape makes
            # Dynamo recompile with dynamic shapes here rather than in a timed step.
            batch = runner.peak_batch(self.step) if attempt == 0 else runner.global_batch(self.step)
            runner.synchronize()
            started = time.perf_counter()
            try:
                self._warm_step(batch)
                runner.synchronize()
            except Exception as exc:
                if is_oom(exc):
                    raise
                raise CompileFailed(f"torch.compile failed: {type(exc).__name__}: "
                                    f"{(str(exc).strip().splitlines() or [''])[0][:300]}") from exc
            elapsed = time.perf_counter() - started
            if compile_count() == before:  # steady: its time is what a compiled step costs
                self.log.compile_s = max(0.0, compiling_s - compiled_steps * elapsed)
                return
            compiling_s, compiled_steps = compiling_s + elapsed, compiled_steps + 1
        logger.warning("still compiling after {} steps: the timed steps may recompile", MAX_COMPILE_STEPS)
        self.log.compile_s = compiling_s


def _steady(times_s: list[float]) -> bool:
    return len(times_s) >= 2 and abs(times_s[-1] - times_s[-2]) <= STEADY_RTOL * times_s[-2]

