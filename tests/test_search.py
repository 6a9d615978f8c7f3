"""Search quality on simulated devices at the spec's default budget, the memory model, and
resume from a stored study."""

import optuna
import pytest

from autofit.config.train_config import TrainConfig
from autofit.search import MemoryModel, SearchSpace, TrialRecord, Tuner, make_study
from autofit.search.memory import fit_points
from autofit.config.spec import SearchSpec
from autofit.measure.measurement import Measurement
from simulated import GiB, LANDSCAPES, Landscape

DEFAULTS = SearchSpec()  # the budget a user gets: 40 trials, patience 12


def run_tuner(landscape: Landscape, *, storage=None, study_name="sim", max_trials=DEFAULTS.trials,
              patience=DEFAULTS.patience, budget_bytes=None):
    study = make_study(study_name=study_name, storage=storage, seed=0)
    tuner = Tuner(landscape.space(), study=study, budget_bytes=budget_bytes or landscape.budget_bytes,
                  measure=landscape.measure, estimate=landscape.estimate, max_trials=max_trials, patience=patience)
    return tuner, tuner.run()


def test_search_reaches_the_grid_optimum_at_the_default_budget(capsys):
    rows = []
    for landscape in LANDSCAPES:
        landscape.reset()
        _, result = run_tuner(landscape)
        best_config, best_sps = landscape.grid_best()
        chosen = result.ranked[0].config
        grid_size = landscape.space().size
        measured = len(landscape.calls)  # every measurement, repeats included
        rows.append((landscape.name, grid_size, measured, measured / grid_size,
                     landscape.samples_per_s(chosen) / best_sps, chosen.short(), best_config.short()))
    with capsys.disabled():
        print(f"\ntrials {DEFAULTS.trials}, patience {DEFAULTS.patience}")
        print("landscape       grid  measured  fraction  tune/grid  chosen / grid best")
        for name, grid, measured, frac, ratio, chosen, best in rows:
            print(f"{name:<14}{grid:>6}{measured:>10}{frac:>10.1%}{ratio:>11.3f}  {chosen}  /  {best}")
    assert len(rows) >= 6 and max(r[1] for r in rows) > 5000
    for name, grid, measured, frac, ratio, chosen, best in rows:
        assert ratio >= 0.98, (name, chosen, best)
        assert frac <= 0.30, (name, measured, grid)


def _landscape(name: str) -> Landscape:
    landscape = next(l for l in LANDSCAPES if l.name == name)
    landscape.reset()
    return landscape


def test_unhealthy_precision_is_never_chosen():
    landscape = _landscape("drift+freeze")
    _, result = run_tuner(landscape)
    assert all(r.config.precision not in landscape.unhealthy for r in result.ranked)
    assert any(r.status == "unhealthy" and "mean loss" in r.reason for r in result.records)


def test_infeasible_configs_are_never_chosen_and_pruned_ones_do_not_spend_trials():
    landscape = _landscape("tight")
    tuner, result = run_tuner(landscape, max_trials=15, patience=100)
    for r in result.ranked:
        assert landscape.peak_bytes(r.config) <= landscape.budget_bytes
    searched = [r for r in result.records if r.measurement is not None and not r.repeat]
    assert len(searched) == 15 == tuner.spent(result.records)
    assert result.stop_reason == "15 trials measured"


def test_contenders_within_noise_are_remeasured_interleaved():
    landscape = _landscape("noisy")
    _, result = run_tuner(landscape)
    repeats = [r.config for r in result.records if r.repeat]
    contenders = list(dict.fromkeys(repeats))
    assert len(contenders) >= 2
    # Interleaved: each round measures every contender still in the race once, in the same
    # order; one that fell behind beyond doubt is not measured again (the race only narrows).
    order = {config: i for i, config in enumerate(contenders)}
    rounds: list[list] = []
    for config in repeats:
        if rounds and order[config] > order[rounds[-1][-1]]:
            rounds[-1].append(config)
        else:
            rounds.append([config])
    assert rounds[0] == contenders and len(rounds) >= 2
    assert all(set(later) <= set(earlier) for earlier, later in zip(rounds, rounds[1:]))
    assert result.noise is not None and 0 < result.noise < 0.1
    assert "interleaved rounds" in result.choice and f"{result.noise:.1%}" in result.choice


def test_reference_is_the_fastest_full_precision_config_predicted_to_fit():
    """The 32-true reference is the largest micro batch predicted to fit, not the smallest peak."""
    landscape = _landscape("roomy")
    tuner, result = run_tuner(landscape, max_trials=1)
    refs = [r for r in result.records if r.config.precision == "32-true" and r.status == "ok"]
    assert refs and refs[0].config.micro_batch_size == landscape.space().micro_batch_sizes[-1]
    assert refs[0].config.checkpoint_blocks == 0


def test_resume_under_the_same_budget_measures_nothing_again(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    landscape = _landscape("noisy")
    _, first = run_tuner(landscape, storage=storage)
    assert landscape.calls
    landscape.calls.clear()
    _, second = run_tuner(landscape, storage=storage)
    assert landscape.calls == []
    assert second.ranked[0].config == first.ranked[0].config


def test_resume_under_a_larger_budget_measures_what_was_oom_or_pruned(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    landscape = _landscape("tight")
    small = 20 * GiB  # the landscape's card is 24 GiB: an emulated smaller budget first
    tuner, first = run_tuner(landscape, storage=storage, budget_bytes=small)
    blocked = {r.config for r in first.records if r.status in ("oom", "pruned")
               and landscape.peak_bytes(r.config) <= landscape.budget_bytes}
    assert blocked
    landscape.calls.clear()
    _, second = run_tuner(landscape, storage=storage)
    assert blocked & set(landscape.calls)
    best_config, best_sps = landscape.grid_best()
    assert landscape.samples_per_s(second.ranked[0].config) / best_sps >= 0.98


def test_affine_memory_fit_recovers_overhead_and_scale():
    """peak = 1.1 x estimate + 1 GiB: the fit finds both; a ratio learned on small configs
    would over-predict the largest by the overhead's share."""
    points = [(e * GiB, 1.1 * e * GiB + GiB) for e in (2.0, 4.0, 8.0)]
    fit = fit_points(points)
    assert fit.scale == pytest.approx(1.1, rel=1e-6) and fit.overhead_bytes == pytest.approx(GiB, rel=1e-6)
    assert fit.predict(20 * GiB) == pytest.approx(23 * GiB, rel=1e-6)
    one = fit_points(points[:1], overhead_hint=GiB)  # one point: the measured overhead anchors it
    assert one.predict(20 * GiB) == pytest.approx(23 * GiB, rel=1e-6)


def _record(config, status, *, budget, predicted, peak=None):
    m = Measurement(status=status, config=config, budget_bytes=budget, peak_memory_bytes=peak,
                    samples_per_s=1.0 if status == "ok" else None)
    return TrialRecord(number=0, config=config, status=status, predicted_peak_bytes=predicted,
                       measurement=m, budget_bytes=budget)


def test_an_oom_blocks_only_budgets_at_or_below_its_own():
    small = TrainConfig(precision="bf16-mixed", micro_batch_size=8, grad_accum_steps=2)
    larger = small.replace(micro_batch_size=16, grad_accum_steps=1)
    oom = _record(small, "oom", budget=10 * GiB, predicted=9 * GiB)
    same = MemoryModel(lambda c: 9 * GiB * c.micro_batch_size // 8, 10 * GiB)
    assert same.blocked_by_oom(larger, [oom]) is oom and not same.fits(larger, [oom])
    bigger = MemoryModel(lambda c: 9 * GiB * c.micro_batch_size // 8, 40 * GiB)
    assert bigger.blocked_by_oom(small, [oom]) is None and bigger.fits(small, [oom])
    # More checkpointing needs less memory: not blocked by the OOM, whatever the estimate says.
    assert same.blocked_by_oom(small.replace(checkpoint_blocks=2), [oom]) is None


def test_pruning_is_redecided_when_the_fit_changes():
    config = TrainConfig(precision="32-true", micro_batch_size=4, grad_accum_steps=1)
    model = MemoryModel(lambda c: 10 * GiB, 10 * GiB)
    over = [_record(config.replace(micro_batch_size=2, grad_accum_steps=2), "ok", budget=10 * GiB,
                    predicted=10 * GiB, peak=12 * GiB)]
    assert not model.fits(config, over)  # the estimator is 20% low on this device
    under = [_record(config.replace(micro_batch_size=2, grad_accum_steps=2), "ok", budget=10 * GiB,
                     predicted=10 * GiB, peak=8 * GiB)]
    assert model.fits(config, under)  # and now 20% high: the same config is back in


def test_space_has_no_equivalent_checkpointing_points():
    space = SearchSpace(global_batch_size=4, precisions=("32-true",), micro_batch_sizes=(1, 2, 4),
                        max_checkpoint_blocks=4, max_freeze_blocks=2)
    grid = space.grid()
    assert len(grid) == space.size == 3 * (5 + 4 + 3)
    assert all(c.checkpoint_blocks + c.freeze_blocks <= 4 for c in grid)
    study = optuna.create_study()
    study.enqueue_trial({"precision": "32-true", "micro_batch_index": 0, "checkpoint_blocks": 4, "freeze_blocks": 2})
    assert space.suggest(study.ask()).checkpoint_blocks == 2  # clamped to the trainable blocks


def test_checkpoint_policies_join_the_space_only_when_opted_in():
    plain = SearchSpace(global_batch_size=4, precisions=("32-true",), micro_batch_sizes=(1, 2, 4),
                        max_checkpoint_blocks=4, max_freeze_blocks=1)
    both = SearchSpace(global_batch_size=4, precisions=("32-true",), micro_batch_sizes=(1, 2, 4),
                       max_checkpoint_blocks=4, max_freeze_blocks=1, checkpoint_policies=("full", "selective"))
    assert "checkpoint_policy" not in {k.field for k in plain.knobs()}
    grid = both.grid()
    # No checkpointed block has no policy: those configs are counted once.
    assert len(grid) == len(set(grid)) == both.size == 3 * ((2 * 4 + 1) + (2 * 3 + 1))
    assert {c.checkpoint_policy for c in grid if c.checkpoint_blocks} == {"full", "selective"}
    sel = both.config("32-true", 2, 2, checkpoint_policy="selective")
    assert sel.replace(checkpoint_policy="full") in both.neighbours(sel)
    assert all(n != sel.replace(checkpoint_blocks=0) or n.checkpoint_policy == "full" for n in both.neighbours(sel))


def test_an_oom_blocks_only_configs_that_keep_at_least_as_much():
    from autofit.search.memory import _needs_more

    full2 = TrainConfig(micro_batch_size=4, checkpoint_blocks=2)
    sel2 = full2.replace(checkpoint_policy="selective")
    assert _needs_more(sel2, full2) and not _needs_more(full2, sel2)  # selective keeps more per block
    assert _needs_more(full2.replace(checkpoint_blocks=0), sel2)  # no checkpointing keeps everything
    assert _needs_more(sel2.replace(checkpoint_blocks=1), sel2) and not _needs_more(full2.replace(checkpoint_blocks=1), sel2)
    assert not _needs_more(sel2.replace(checkpoint_blocks=3), full2)


def test_a_model_that_fails_to_compile_is_searched_eagerly_from_then_on():
    import dataclasses

    landscape = dataclasses.replace(_landscape("compiled"), compile_fails=True)
    landscape.reset()
    _, result = run_tuner(landscape)
    compiled = [c for c in landscape.calls if c.compile]
    assert len(compiled) == 1, [c.short() for c in compiled]  # the first failure ends compiled configs
    assert [r.status for r in result.records if r.config.compile and r.measurement] == ["compile_error"]
    chosen = result.ranked[0].config
    assert not chosen.compile
    assert landscape.samples_per_s(chosen) >= 0.98 * landscape.grid_best()[1]


def test_search_space_for_python_data(tmp_path):
    """The block count is read from a meta-device model; a python dataset still samples real data."""
    from autofit.device.probe import cpu_device
    from autofit.config.spec import load_spec
    from autofit.tuning.space import search_space
    from conftest import FIXTURES, tiny_gpt_dict, write_spec

    spec_dict = tiny_gpt_dict(data={"kind": "python", "factory": "faulty:dataset", "seq_len": 16})
    (tmp_path / "faulty.py").write_text((FIXTURES / "faulty.py").read_text())
    space = search_space(load_spec(write_spec(tmp_path, spec_dict)), cpu_device())
    assert space.max_checkpoint_blocks == 2


def test_every_strategy_s_seed_is_measured_before_refinements():
    """Over two ranks with one precision, the first wave is one seed per strategy: which
    strategy is faster is measured before any refinement around the first one measured."""
    import dataclasses

    landscape = dataclasses.replace(_landscape("two-ranks"), rate={"bf16-mixed": 300.0})
    landscape.reset()
    run_tuner(landscape, max_trials=2)
    assert {c.parallelism for c in landscape.calls[:2]} == {"ddp", "fsdp"}, [c.short() for c in landscape.calls]


def test_a_strategy_whose_seed_ran_out_of_memory_is_measured_again_before_refining_the_other():
    """Two ranks, one precision, 28 GiB: DDP's seed runs out of memory and FSDP2's fits. The
    next trial goes to DDP again (at a config the refit model predicts to fit), not to
    refining FSDP2: otherwise a small trial budget never learns what DDP does."""
    import dataclasses

    landscape = dataclasses.replace(_landscape("two-ranks"), rate={"bf16-mixed": 300.0}, budget_bytes=28 * GiB)
    landscape.reset()
    run_tuner(landscape, max_trials=3)
    first = [(c.parallelism, landscape.peak_bytes(c) <= landscape.budget_bytes) for c in landscape.calls[:3]]
    assert first[:2] == [("ddp", False), ("fsdp", True)] and first[2][0] == "ddp", first


TINY_CONVNET = {"builtin": "convnet", "args": {"image_size": 8, "channels": 8, "n_blocks": 2, "n_classes": 5}}


def test_a_batchnorm_model_never_searches_below_its_micro_batch_floor():
    import torch

    from autofit.device.probe import cpu_device
    from autofit.train.runner import Runner
    from autofit.config.spec import parse_spec
    from autofit.tuning.space import search_space
    from autofit.workload import build_workload, split_batch
    from conftest import REPO, tiny_gpt_dict

    def spec_of(global_batch_size, model=TINY_CONVNET, **search):
        return parse_spec(tiny_gpt_dict(model=model, train={"global_batch_size": global_batch_size}, search=search),
                          source_dir=REPO)

    # Why: BatchNorm normalizes over each micro batch, so 8 x 1 and 2 x 4 train on other gradients.
    spec = spec_of(8)
    workload = build_workload(spec)
    torch.manual_seed(0)
    model = workload.build_model()
    batch = workload.data.batch(8, torch.Generator().manual_seed(0))
    whole = torch.autograd.grad(workload.loss_fn(model, batch), model.stem[0].weight)[0]
    accumulated = sum(torch.autograd.grad(workload.loss_fn(model, mb) / 4, model.stem[0].weight)[0]
                      for mb in split_batch(batch, 2))
    assert (whole - accumulated).norm() > 0.01 * whole.norm()

    large = search_space(spec_of(64), cpu_device())
    assert large.micro_batch_sizes == (16, 32, 64)
    assert all(c.micro_batch_size >= 16 for c in large.grid())
    floor = large.micro_batch_floor
    assert (floor.size, floor.excludes_accumulation) == (16, False)
    assert "3 BatchNorm2d" in floor.reason and "search.min_micro_batch_size" in floor.reason
    small = search_space(spec, cpu_device())  # a global batch below the floor: one micro batch, no accumulation
    assert small.micro_batch_sizes == (8,) and small.micro_batch_floor.excludes_accumulation
    assert small.micro_batch_floor.describe().startswith("accumulation excluded: the model has 3 BatchNorm2d")
    chosen = search_space(spec_of(8, min_micro_batch_size=2), cpu_device())
    assert chosen.micro_batch_sizes == (2, 4, 8) and "is 2" in chosen.micro_batch_floor.reason
    assert spec_of(8, min_micro_batch_size=2).spec_hash != spec.spec_hash  # another space, another study
    gpt = search_space(spec_of(8, model=tiny_gpt_dict()["model"]), cpu_device())
    assert gpt.micro_batch_sizes == (1, 2, 4, 8) and gpt.micro_batch_floor is None

    # Out of memory in training: the micro batch is not halved below the floor.
    runner = Runner(spec, workload, TrainConfig(micro_batch_size=8), device=torch.device("cpu"))
    assert runner.demote(0, torch.OutOfMemoryError("out of memory")) is None


def test_memory_knobs_space_has_no_8bit_state_on_bf16_weights():
    space = SearchSpace(global_batch_size=4, precisions=("32-true", "bf16-true"), micro_batch_sizes=(1, 2, 4),
                        max_checkpoint_blocks=1, max_freeze_blocks=0, optimizer_bits=(32, 8),
                        chunked_loss=(False, True))
    grid = space.grid()
    assert len(grid) == space.size == len(set(grid)) == 3 * 2 * (2 + 1) * 2
    assert not [c for c in grid if c.precision == "bf16-true" and c.optimizer_bits == 8]
    study = optuna.create_study()
    study.enqueue_trial({"precision": "bf16-true", "micro_batch_index": 0, "checkpoint_blocks": 0,
                         "freeze_blocks": 0, "optimizer_bits": 8, "chunked_loss": True})
    assert space.suggest(study.ask()).optimizer_bits == 32  # bf16 weights keep the compensated update
    lean = space.config("32-true", 4, **space.lean("32-true"))
    assert (lean.optimizer_bits, lean.chunked_loss) == (8, True) and space.lean("bf16-true") == {"chunked_loss": True}
    toggles = [c for c in space.neighbours(lean) if c.micro_batch_size == 4 and c.precision == "32-true"]
    assert {(c.optimizer_bits, c.chunked_loss) for c in toggles} >= {(32, True), (8, False)}
    two = SearchSpace(global_batch_size=4, precisions=("32-true",), micro_batch_sizes=(1, 2), max_checkpoint_blocks=0,
                      max_freeze_blocks=0, world_size=2, optimizer_bits=(32, 8))
    assert {(c.parallelism, c.optimizer_bits) for c in two.grid()} == {("ddp", 32), ("ddp", 8), ("fsdp", 32)}
    assert two.lean("32-true", {"parallelism": "fsdp"}) == {}  # FSDP2's shards keep 32-bit state


def test_an_oom_at_32bit_state_does_not_block_8bit_state():
    plain = TrainConfig(precision="32-true", micro_batch_size=8, grad_accum_steps=1)
    oom = _record(plain, "oom", budget=10 * GiB, predicted=9 * GiB)
    model = MemoryModel(lambda c: 5 * GiB, 10 * GiB)
    assert model.blocked_by_oom(plain.replace(chunked_loss=False), [oom]) is oom
    assert model.blocked_by_oom(plain.replace(optimizer_bits=8), [oom]) is None
    assert model.blocked_by_oom(plain.replace(chunked_loss=True), [oom]) is None
    lean_oom = _record(plain.replace(optimizer_bits=8, chunked_loss=True), "oom", budget=10 * GiB, predicted=9 * GiB)
    assert model.blocked_by_oom(plain, [lean_oom]) is lean_oom  # the plain one holds more
    assert model.blocked_by_oom(plain.replace(precision="bf16-true"), [lean_oom]) is None


def test_8bit_state_is_judged_against_an_fp32_state_reference():
    from autofit.search import health_problem

    plain = TrainConfig(precision="32-true", micro_batch_size=8, grad_accum_steps=1)

    def rec(config, losses):
        m = Measurement(status="ok", config=config, budget_bytes=GiB, peak_memory_bytes=1, samples_per_s=1.0,
                        losses=losses)
        return TrialRecord(number=0, config=config, status="ok", predicted_peak_bytes=1, measurement=m,
                           budget_bytes=GiB)

    reference = rec(plain, [4.0, 3.9, 3.8, 3.7])
    drifting = rec(plain.replace(optimizer_bits=8), [4.0, 4.3, 4.7, 5.2])
    assert "mean loss differs from 32-true" in health_problem(drifting, [reference])
    assert health_problem(drifting, [drifting]) is None  # an 8-bit trial is no reference
    assert health_problem(rec(plain.replace(chunked_loss=True), [4.0, 4.3, 4.7, 5.2]), [reference]) is None


def test_a_batchnorm_model_s_profile_says_which_floor_and_why(tmp_path, monkeypatch):
    """A tune of the built-in convnet (simulated measurements, in this process): no trial and
    no profile point below the floor, and the profile file states it."""
    import types

    from autofit.device.probe import cpu_device
    from autofit.config.spec import load_spec
    from autofit.tuning.tune import tune
    from conftest import tiny_gpt_dict, write_spec
    from test_health import _simulated

    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict(model=TINY_CONVNET, train={"global_batch_size": 32}, search={
        "precisions": ["32-true"], "activation_checkpointing": False, "trials": 6, "patience": 6,
        "frontier_points": 3})))
    measured = []
    simulated = _simulated(spec.search.validate_steps, 0.0)

    def measure(spec, config, **kwargs):
        measured.append(config)
        return simulated(spec, config, **kwargs)

    monkeypatch.setattr("autofit.tuning.tune.measure", measure)
    monkeypatch.setattr("autofit.tuning.tune.estimate_memory",
                        lambda spec, config, **_: types.SimpleNamespace(peak_bytes=1000 * config.micro_batch_size))
    profile = tune(spec, device=cpu_device(), budget_bytes=10**6, out_dir=tmp_path / "profiles", storage=None,
                   report=False).profile
    assert measured and min(c.micro_batch_size for c in measured) == 16
    assert all(p.config.micro_batch_size >= 16 for p in profile.points)
    floor = profile.to_dict()["search"]["micro_batch_floor"]
    assert floor["size"] == 16 and floor["excludes_accumulation"] is False
    assert floor["reason"].startswith("the model has 3 BatchNorm2d")
