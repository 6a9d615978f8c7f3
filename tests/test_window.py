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
