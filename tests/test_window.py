"""A trial's timed window is sized in seconds (measure/steps.py), with `measure_steps` as its
fewest steps: driven here by a fed clock, not by wall timings."""

from types import SimpleNamespace

import torch

from autofit.config.spec import SearchSpec
from autofit.config.train_config import TrainConfig
from autofit.measure.steps import MAX_WINDOW_STEPS, Steps
from autofit.measure.trial import trial_request


class FakeRunner:
    """Steps that take `step_s` on the fed clock."""

    def __init__(self, clock: list, step_s: float):
        self.clock, self.step_s = clock, step_s

    def global_batch(self, step: int) -> list:
        return []

    def tokens_in(self, batch) -> None:
        return None

    def synchronize(self) -> None:
        pass

    def step(self, batch) -> SimpleNamespace:
        self.clock[0] += self.step_s
        return SimpleNamespace(loss=torch.tensor(1.0), skipped=False)


def _timed(step_s: float, *, window_s: float, measure_steps: int) -> list[float]:
    clock = [0.0]
    steps = Steps(FakeRunner(clock, step_s), tracker=None, budget_bytes=None, warmup_steps=0,
                  measure_steps=measure_steps, window_s=window_s, clock=lambda: clock[0])
    steps.timed()
    return steps.log.step_times_s


def test_a_slow_step_and_a_fast_step_fill_about_the_same_window():
    slow, fast = _timed(1.2, window_s=2.0, measure_steps=1), _timed(0.02, window_s=2.0, measure_steps=1)
    assert len(slow) == 2 and len(fast) == 100  # 2.4 s and 2.0 s of timed steps
    assert abs(sum(slow) - sum(fast)) < 0.5


def test_measure_steps_is_the_fewest_steps_a_window_holds():
    assert len(_timed(1.2, window_s=2.0, measure_steps=5)) == 5
    assert len(_timed(0.5, window_s=0.0, measure_steps=3)) == 3  # no window: exactly the steps asked


def test_a_window_of_tiny_steps_stops_at_its_most_steps():
    assert len(_timed(1e-6, window_s=2.0, measure_steps=1)) == MAX_WINDOW_STEPS


def test_a_trial_asked_for_steps_gets_them_and_one_of_the_specs_steps_gets_the_specs_window():
    spec = SimpleNamespace(search=SearchSpec(window_s=3.0), to_dict=dict, source_dir=".")
    config = TrainConfig(micro_batch_size=4)
    assert trial_request(spec, config).window_s == 3.0
    assert trial_request(spec, config, measure_steps=7).window_s == 0.0
    assert trial_request(spec, config, measure_steps=7, window_s=1.0).window_s == 1.0


class WarmingRunner(FakeRunner):
    """Steps whose times are fed one by one (a cold start that never settles within 10%)."""

    config = SimpleNamespace(compile=False)
    varying_lengths = False
    scaler = SimpleNamespace(is_enabled=lambda: False)

    def __init__(self, clock: list, steps_s: list[float]):
        super().__init__(clock, 0.0)
        self.steps_s = list(steps_s)

    def peak_batch(self, step: int) -> list:
        return []

    def step(self, batch) -> SimpleNamespace:
        self.step_s = self.steps_s.pop(0) if self.steps_s else self.step_s
        return super().step(batch)


def _trial(steps_s: list[float], cap_s: float | None) -> Steps:
    clock = [0.0]
    steps = Steps(WarmingRunner(clock, steps_s), tracker=None, budget_bytes=None, warmup_steps=5, measure_steps=3,
                  window_s=2.0, cap_s=cap_s, clock=lambda: clock[0])
    steps.warm_up()
    steps.timed()
    return steps


def test_a_step_dearer_than_the_trials_cap_is_timed_once_after_one_warm_up_step():
    """gen-2026-00's first trial: a 21.7 s step, 5 of them 112 s of a 144 s search. Under a
    36 s cap (a quarter of that share) the trial takes one warm-up step and one timed step."""
    slow = [21.7 * (1 - 0.2 * i) for i in range(5)] + [21.7] * 5  # never within 10%: 5 warm-up steps uncapped
    capped, free = _trial(slow, cap_s=36.0), _trial(slow, cap_s=None)
    assert (len(capped.log.warmup_times_s), len(capped.log.step_times_s)) == (1, 1)
    assert (len(free.log.warmup_times_s), len(free.log.step_times_s)) == (5, 3)
    assert len(capped.log.losses) == 2  # the losses of both steps still count (health)


def test_past_the_cap_a_timed_step_the_grad_scaler_skipped_does_not_end_the_window():
    """Right after a GradScaler's warm-up, its scale sits just under overflow and the next
    batch often overflows once. That skipped step updated nothing: were it the window's only
    step, the trial would read as mostly skipped (unhealthy) and its weights as unchanged."""
    clock = [0.0]

    class Skipping(WarmingRunner):
        def step(self, batch):
            result = super().step(batch)
            return SimpleNamespace(loss=result.loss, skipped=self.clock[0] == 43.4)  # the first timed step

    steps = Steps(Skipping(clock, [21.7] * 5), tracker=None, budget_bytes=None, warmup_steps=5, measure_steps=3,
                  window_s=2.0, cap_s=36.0, clock=lambda: clock[0])
    steps.warm_up()
    steps.timed()
    assert len(steps.log.warmup_times_s) == 1 and len(steps.log.step_times_s) == 2 and steps.log.skipped == 1


def test_a_cap_a_trial_does_not_reach_changes_nothing():
    fast = _trial([0.1] * 50, cap_s=36.0)
    assert len(fast.log.warmup_times_s) == 2 and len(fast.log.step_times_s) == 20  # steady after 2; 2 s of 0.1 s steps
