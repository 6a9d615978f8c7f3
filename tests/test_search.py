"""Search quality on simulated devices, and resume from a stored study."""

import pytest

from autofit.search import Tuner, make_study
from simulated import LANDSCAPES, Landscape


def run_tuner(landscape: Landscape, *, storage=None, study_name="sim", max_trials=120, patience=25) -> Tuner:
    study = make_study(study_name=study_name, storage=storage, seed=0)
    tuner = Tuner(landscape.space(), study=study, budget_bytes=landscape.budget_bytes,
                  measure=landscape.measure, estimate=landscape.estimate,
                  max_trials=max_trials, patience=patience)
    return tuner, tuner.run()


def test_search_reaches_the_grid_optimum_measuring_a_fraction_of_the_grid(capsys):
    rows = []
    for landscape in LANDSCAPES:
        landscape.calls.clear()
        _, result = run_tuner(landscape)
        best_config, best_sps = landscape.grid_best()
        chosen = result.ranked[0]
        true_sps = landscape.samples_per_s(chosen.config)
        grid_size = landscape.space().size
        measured = len(landscape.calls)
        rows.append((landscape.name, grid_size, measured, measured / grid_size, true_sps / best_sps,
                     chosen.config.short(), best_config.short()))
    with capsys.disabled():
        print("\nlandscape       grid  measured  fraction  tune/grid  chosen / grid best")
        for name, grid, measured, frac, ratio, chosen, best in rows:
            print(f"{name:<14}{grid:>6}{measured:>10}{frac:>10.1%}{ratio:>11.3f}  {chosen}  /  {best}")
    for name, grid, measured, frac, ratio, chosen, best in rows:
        assert ratio >= 0.98, (name, chosen, best)
        assert frac <= 0.30, (name, measured, grid)


def test_unhealthy_precision_is_never_chosen():
    landscape = next(l for l in LANDSCAPES if l.unhealthy)
    _, result = run_tuner(landscape)
    assert all(r.config.precision not in landscape.unhealthy for r in result.ranked)
    assert any(r.status == "unhealthy" for r in result.records)


def test_infeasible_configs_are_pruned_or_oom_never_chosen():
    landscape = LANDSCAPES[1]
    _, result = run_tuner(landscape)
    assert result.count("pruned") > 0
    for r in result.ranked:
        assert landscape.peak_bytes(r.config) <= landscape.budget_bytes


def test_resume_does_not_measure_finished_trials_again(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    landscape = LANDSCAPES[0]
    landscape.calls.clear()
    _, first = run_tuner(landscape, storage=storage, max_trials=10)
    first_calls = list(landscape.calls)
    assert len(first.records) == 10
    landscape.calls.clear()
    _, second = run_tuner(landscape, storage=storage, max_trials=20)
    assert second.resumed == 10
    assert len(second.records) == 20
    assert not set(landscape.calls) & set(first_calls)  # nothing measured twice
    assert len(landscape.calls) <= 10


def test_queued_configs_are_never_queued_twice(tmp_path):
    import optuna

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    landscape = LANDSCAPES[1]
    run_tuner(landscape, storage=storage, max_trials=2)
    tuner, _ = run_tuner(landscape, storage=storage, max_trials=30)
    trials = tuner.study.get_trials(deepcopy=False)
    queued = [tuple(sorted(t.system_attrs["fixed_params"].items())) for t in trials if "fixed_params" in t.system_attrs]
    assert len(queued) == len(set(queued))


def test_search_space_for_python_data(tmp_path):
    """The block count is read from a meta-device model; a python dataset still samples real data."""
    from autofit.device.probe import cpu_device
    from autofit.spec import load_spec
    from autofit.tune import search_space
    from conftest import FIXTURES, tiny_gpt_dict, write_spec

    spec_dict = tiny_gpt_dict(data={"kind": "python", "factory": "faulty:dataset", "seq_len": 16})
    (tmp_path / "faulty.py").write_text((FIXTURES / "faulty.py").read_text())
    space = search_space(load_spec(write_spec(tmp_path, spec_dict)), cpu_device())
    assert space.max_checkpoint_blocks == 2
