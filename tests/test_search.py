"""Search quality on simulated devices at the spec's default budget, the memory model, and
resume from a stored study."""

import dataclasses
import itertools
import time

import optuna
import pytest

from autofit.config.spec import SearchSpec
from autofit.config.train_config import TrainConfig
from autofit.device.budget import Budget
from autofit.measure.measurement import Measurement
from autofit.search import _trial, make_study, MemoryModel, SearchSpace, seeding, TrialRecord, Tuner
from autofit.search.fallback import floor_record
from autofit.search.memory_model import fit_points
from simulated import generated, GiB, LANDSCAPES, Landscape, search, SHAPED

DEFAULTS = SearchSpec()  # the budget a user gets: 40 trials, patience 12


def run_tuner(landscape: Landscape, *, storage=None, study_name="sim", max_trials=DEFAULTS.trials,
              patience=DEFAULTS.patience, budget_bytes=None):
    study = make_study(study_name=study_name, storage=storage, seed=0)
    tuner = Tuner(landscape.space(), study=study, budget=Budget(usable_bytes=budget_bytes or landscape.budget_bytes),
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
    landscape = next(l for l in [*LANDSCAPES, *SHAPED] if l.name == name)
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
    """Over six draws of the device's noise: whether there is a race, and how many rounds it
    needs, depends on them (no config within noise of the best: none; a first round that
    separates the contenders beyond the noise it shows: one)."""
    raced = 0
    for seed in range(6):
        landscape = _landscape("noisy")
        landscape.reset(seed)
        _, result = run_tuner(landscape)
        repeats = [r.config for r in result.records if r.repeat]
        contenders = list(dict.fromkeys(repeats))
        if not repeats:
            assert "no other config within noise" in result.choice
            continue
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
        assert rounds[0] == contenders
        raced += len(rounds) >= 2
        assert all(set(later) <= set(earlier) for earlier, later in zip(rounds, rounds[1:]))
        assert result.noise is not None and 0 < result.noise < 0.1
        assert "interleaved rounds" in result.choice and f"{result.noise:.1%}" in result.choice
    assert raced >= 1


def test_reference_is_at_the_bests_micro_batch_with_the_fewest_checkpointed_blocks():
    """The 32-true reference is taken at the best's micro batch (there the one-liner's, the
    largest), with the fewest checkpointed blocks predicted to fit: not the smallest peak."""
    landscape = _landscape("roomy")
    tuner, result = run_tuner(landscape, max_trials=1)
    refs = [r for r in result.records if r.config.precision == "32-true" and r.status == "ok"]
    assert refs and refs[0].config.micro_batch_size == result.records[0].config.micro_batch_size
    assert refs[0].config.micro_batch_size == landscape.space().micro_batch_sizes[-1]
    assert refs[0].config.checkpoint_blocks == 0


def test_a_reference_for_a_best_at_a_small_micro_batch_is_taken_there():
    space = _landscape("roomy").space()
    fits = lambda config: True  # noqa: E731
    small = space.micro_batch_sizes[1]
    assert seeding.reference_point(space, fits, 0, small).micro_batch_size == small
    assert seeding.reference_point(space, fits, 0).micro_batch_size == space.micro_batch_sizes[-1]
    # Nothing fits at the best's micro batch: the largest that fits.
    only_one = lambda config: config.micro_batch_size == space.micro_batch_sizes[0]  # noqa: E731
    assert seeding.reference_point(space, only_one, 0, small).micro_batch_size == space.micro_batch_sizes[0]


def test_resume_under_the_same_budget_measures_no_search_trial_again(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    landscape = _landscape("noisy")
    _, first = run_tuner(landscape, storage=storage)
    assert landscape.calls
    landscape.calls.clear()
    _, second = run_tuner(landscape, storage=storage)
    # Only the leaders are measured again (their old figures do not decide: tests/test_speedup.py).
    leaders = {r.config for r in first.ranked[:3]}
    assert set(landscape.calls) <= leaders
    assert {r.number for r in second.records if r.measurement is not None and not r.repeat} == {
        r.number for r in first.records if r.measurement is not None and not r.repeat}
    assert second.ranked[0].config in leaders


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
    same = MemoryModel(lambda c: 9 * GiB * c.micro_batch_size // 8, Budget(usable_bytes=10 * GiB))
    assert same.blocked_by_oom(larger, [oom]) is oom and not same.fits(larger, [oom])
    bigger = MemoryModel(lambda c: 9 * GiB * c.micro_batch_size // 8, Budget(usable_bytes=40 * GiB))
    assert bigger.blocked_by_oom(small, [oom]) is None and bigger.fits(small, [oom])
    # More checkpointing needs less memory: not blocked by the OOM, whatever the estimate says.
    assert same.blocked_by_oom(small.replace(checkpoint_blocks=2), [oom]) is None


def test_pruning_is_redecided_when_the_fit_changes():
    config = TrainConfig(precision="32-true", micro_batch_size=4, grad_accum_steps=1)
    model = MemoryModel(lambda c: 10 * GiB, Budget(usable_bytes=10 * GiB))
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


def test_seeds_estimate_no_micro_batch_below_the_largest_that_fits_unchecked():
    """Each estimate is a fake training step: the seeds find each precision's largest micro
    batch that fits with no checkpointing, and ask nothing of the smaller ones (they fit too)."""
    space = SearchSpace(global_batch_size=64, precisions=("32-true", "bf16-true"),
                        micro_batch_sizes=(1, 2, 4, 8, 16, 32, 64), max_checkpoint_blocks=4, max_freeze_blocks=0)
    asked = []

    def fits(config: TrainConfig) -> bool:  # 16 fits unchecked; 32 with 2 blocks, 64 with all 4
        asked.append(config)
        return config.micro_batch_size <= 16 * 2 ** (config.checkpoint_blocks // 2)

    lists = seeding.seed_lists(space, fits)
    assert [[c.short() for c in seeds] for seeds in lists] == [[
        f"{p} mb=16x4 ckpt=0 freeze=0", f"{p} mb=64x1 ckpt=4 freeze=0", f"{p} mb=32x2 ckpt=2 freeze=0"]
        for p in ("32-true", "bf16-true")]
    # Of the micro batches below 16 (they fit too), only a binary search's midpoint is asked.
    assert {c.micro_batch_size for c in asked if c.micro_batch_size < 16} <= {8}


def test_seeds_on_a_tight_card_binary_search_the_micro_batch_instead_of_scanning_it():
    """On a tight card most micro batches do not fit even fully checkpointed: a scan from the
    largest pays two estimates (fake steps) for each; a binary search over the sizes pays
    about log2(sizes) per search. Here 20 sizes, 11 of which do not fit fully checkpointed:
    the scan asks 22 configs for those alone."""
    space = SearchSpace(global_batch_size=240, precisions=("bf16-mixed",),
                        micro_batch_sizes=tuple(m for m in range(1, 241) if 240 % m == 0),
                        max_checkpoint_blocks=16, max_freeze_blocks=0)
    asked = []

    def fits(config: TrainConfig) -> bool:  # 4 fits unchecked, 10 from 12 blocks, 12 with all 16
        asked.append(config)
        return config.micro_batch_size <= 4 + config.checkpoint_blocks // 2

    [seeds] = seeding.seed_lists(space, fits)
    assert [c.short() for c in seeds] == ["bf16-mixed mb=4x60 ckpt=0 freeze=0", "bf16-mixed mb=12x20 ckpt=16 freeze=0",
                                          "bf16-mixed mb=10x24 ckpt=12 freeze=0"]
    assert len(set(asked)) <= 20, len(set(asked))


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
    from autofit.search.memory_model import _needs_more

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
    model = MemoryModel(lambda c: 5 * GiB, Budget(usable_bytes=10 * GiB))
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
    from autofit.tuning.tune import tune, TuneSetup
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
                        lambda spec, config, **_: types.SimpleNamespace(fit_bytes=1000 * config.micro_batch_size))
    profile = tune(TuneSetup(spec=spec, device=cpu_device(), budget=Budget(usable_bytes=10**6),
                             out_dir=tmp_path / "profiles", storage=None, report=False)).profile
    assert measured and min(c.micro_batch_size for c in measured) == 16
    assert all(p.config.micro_batch_size >= 16 for p in profile.points)
    floor = profile.to_dict()["search"]["micro_batch_floor"]
    assert floor["size"] == 16 and floor["excludes_accumulation"] is False
    assert floor["reason"].startswith("the model has 3 BatchNorm2d")


# --- the landscape suite at the default budget (benchmarks/anytime.py --trial-budget runs all ten seeds) ---

# The original landscapes, the shaped ones, and a family drawn with a seed the search was
# never developed against (benchmarks/anytime.py --trial-budget draws its own with another).
SUITE = [*LANDSCAPES, *SHAPED, *generated(16, seed=31)]


@pytest.mark.parametrize("landscape", SUITE, ids=lambda landscape: landscape.name)
def test_search_reaches_the_grid_optimum_on_the_landscape_suite(landscape):
    """Sampler (and device noise) seeds 0, 1 and 2, the spec's default budget: the chosen
    config fits, does not drift, and is within 2% of the exhaustive grid's optimum."""
    for seed in (0, 1, 2):
        run = search(landscape, seed)
        assert run.ratio >= 0.98, (seed, run.chosen and run.chosen.short(), run.best.short(), run.stop_reason)


def test_a_trial_measured_before_its_reference_is_judged_again():
    """bf16-true is the fastest precision and drifts; the 32-true seed runs out of memory, so
    a bf16-true trial runs before any reference. It is judged again once the reference runs:
    never the best the search refines around, unhealthy in the result, never chosen."""
    landscape = _landscape("bf16true-drift+freeze")
    _, result = run_tuner(landscape)
    calls = [c.precision for c in landscape.calls]
    assert calls.index("bf16-true") < next(i for i, c in enumerate(landscape.calls)
                                           if c.precision == "32-true" and landscape.peak_bytes(c) <= GiB * 24)
    assert calls.count("bf16-true") <= 2, [c.short() for c in landscape.calls]
    assert all(r.status == "unhealthy" for r in result.records if r.config.precision == "bf16-true")
    assert landscape.healthy(result.ranked[0].config)


def _ok(number, config, samples_per_s=100.0, *, losses=(4.0, 3.9, 3.8, 3.7), repeat=False, budget=GiB):
    m = Measurement(status="ok", config=config, budget_bytes=budget, peak_memory_bytes=budget // 2,
                    samples_per_s=samples_per_s, losses=list(losses))
    return TrialRecord(number=number, config=config, status="ok", predicted_peak_bytes=budget // 2,
                       measurement=m, budget_bytes=budget, repeat=repeat)


def _plan(space, records=(), estimate=lambda config: 1, **kwargs):
    from autofit.search.plan import Plan

    def known(config, records):
        return next((r for r in records if r.config == config and not r.repeat), None)

    return Plan(space, (), known=known, fits_of=lambda records: lambda config: True, estimate=estimate, **kwargs)


FREEZABLE = SearchSpace(global_batch_size=8, precisions=("32-true", "bf16-mixed"), micro_batch_sizes=(1, 2, 4, 8),
                        max_checkpoint_blocks=4, max_freeze_blocks=4)


def test_a_low_precision_best_gets_a_reference_at_its_freezing_depth_first():
    """The mean loss is compared only at one freezing depth: a bf16-mixed best at depth 2 with
    a reference at depth 4 only is judged by nothing but its first loss. Its reference (the
    largest 32-true micro batch at depth 2) is the next config measured."""
    reference = _ok(0, FREEZABLE.config("32-true", 8, 0, 4))
    best = _ok(1, FREEZABLE.config("bf16-mixed", 8, 0, 2), 300.0)
    planned = _plan(FREEZABLE).next([reference, best], best, set())
    assert planned == FREEZABLE.config("32-true", 8, 0, 2)


def test_the_contenders_freezing_depths_get_their_references_after_the_search():
    """A config the sampler found at a depth with no reference, close to the best: before the
    choice, a reference at its depth; its drift shows and it is not chosen."""
    from autofit.search import _finish as finish

    reference = _ok(0, FREEZABLE.config("32-true", 8, 0, 4))
    healthy = _ok(1, FREEZABLE.config("bf16-mixed", 8, 0, 4), 300.0)
    drifting = _ok(2, FREEZABLE.config("bf16-mixed", 8, 0, 1), 305.0, losses=(4.0, 4.3, 4.7, 5.2))
    tuner = _StubTuner(FREEZABLE, [reference, healthy, drifting], lambda config: 100.0)
    finish.ensure_reference(tuner)
    assert [r.config for r in tuner.records()[3:]] == [FREEZABLE.config("32-true", 8, 0, 1)]
    assert tuner.references == {FREEZABLE.config("32-true", 8, 0, 1)}  # measured as a reference: a few steps
    # ... and priced as one: all its steps, whatever a trial's cap (`_timing.affordable_after_search`).
    assert tuner.priced_as_reference and all(tuner.priced_as_reference)
    from autofit.search import choice
    assert choice.rank(tuner.records(), tuner.budget.usable_bytes)[0].record.config == healthy.config


def test_drifting_8bit_state_leaves_the_chunked_loss_as_the_lean_seed():
    """8-bit moments that drift under 32-true math are blamed on the state: no precision's
    lean seed runs them, and the chunked loss (the same loss) is the lean setting left."""
    from autofit.search.trial_health import drifting
    from autofit.search.plan import allowed_of
    from autofit.search.seeding import seed_groups

    space = SearchSpace(global_batch_size=8, precisions=("32-true", "bf16-mixed"), micro_batch_sizes=(1, 2, 4, 8),
                        max_checkpoint_blocks=2, max_freeze_blocks=0, optimizer_bits=(32, 8),
                        chunked_loss=(False, True))
    reference = _ok(0, space.config("32-true", 8))
    eight = _ok(1, space.config("32-true", 8, optimizer_bits=8), losses=(4.0, 4.3, 4.7, 5.2))
    assert drifting([reference, eight]) == {("optimizer_bits", 8)}
    groups = seed_groups(space, allowed_of([reference, eight]))
    assert [(p, knobs) for p, _, knobs in groups] == [("32-true", {}), ("32-true", {"chunked_loss": True}),
                                                      ("bf16-mixed", {}), ("bf16-mixed", {"chunked_loss": True})]


def _oom(number, config, *, predicted, budget):
    m = Measurement(status="oom", config=config, budget_bytes=budget, peak_memory_bytes=budget - GiB // 2,
                    overhead_bytes=GiB // 2)
    return TrialRecord(number=number, config=config, status="oom", predicted_peak_bytes=predicted, measurement=m,
                       budget_bytes=budget)


def test_out_of_memory_trials_bound_every_fit_until_something_runs():
    """Nothing has run yet: 32-true at 9 GiB estimated ran out of a 10 GiB budget. tf32 holds
    32-true's tensors and bf16-true another group's, but at the same estimate neither is
    predicted to fit (each OOM used to raise its own group only, so every group walked its
    frontier down one OOM at a time); the overhead the OOM's child read joins every
    prediction. Once a trial has run, another group's OOM no longer bounds bf16-true's fit."""
    budget = 10 * GiB
    fp32 = TrainConfig(precision="32-true", micro_batch_size=8)
    oom = _oom(0, fp32, predicted=9 * GiB, budget=budget)
    model = MemoryModel(lambda config: 9 * GiB, Budget(usable_bytes=budget))
    assert not model.fits(fp32.replace(precision="tf32"), [oom])
    assert not model.fits(fp32.replace(precision="bf16-true"), [oom])
    assert model.fit(fp32.replace(precision="bf16-true"), []).overhead_bytes == 0
    assert model.fit(fp32.replace(precision="bf16-true"), [oom]).overhead_bytes == GiB // 2
    ran = _ok(1, fp32.replace(precision="bf16-mixed", micro_batch_size=1), budget=budget)
    assert model.fit(fp32.replace(precision="bf16-true"), [oom]).bounded
    assert not model.fit(fp32.replace(precision="bf16-true"), [oom, ran]).bounded
    assert model.fit(fp32.replace(precision="tf32"), [oom, ran]).bounded  # its own group's OOM still holds


def test_a_config_no_larger_than_one_that_ran_fits_whatever_the_fit_says():
    """A cliff: the fit, raised by an OOM at a larger micro batch, predicts micro batch 4 over
    the budget, but micro batch 4 with more checkpointed blocks ran: a smaller one fits."""
    budget = 10 * GiB
    ran = _ok(0, TrainConfig(precision="bf16-mixed", micro_batch_size=4, grad_accum_steps=2, checkpoint_blocks=1),
              budget=budget)
    oom = _oom(1, TrainConfig(precision="bf16-mixed", micro_batch_size=8, checkpoint_blocks=2),
               predicted=5 * GiB, budget=budget)
    model = MemoryModel(lambda config: 5 * GiB, Budget(usable_bytes=budget))
    smaller = ran.config.replace(checkpoint_blocks=2)
    assert model.covered_by_measured(smaller, [ran, oom]) is ran and model.fits(smaller, [ran, oom])
    assert model.covered_by_measured(ran.config.replace(checkpoint_blocks=0), [ran, oom]) is None


def test_after_two_ooms_and_nothing_that_ran_the_smallest_config_is_measured():
    """Each OOM raises the fit only to the least that explains it; an estimator far too low
    would spend a trial per OOM on every seed group. The smallest config anchors the fit."""
    from autofit.search import seeding

    budget = 10 * GiB
    ooms = [_oom(0, FREEZABLE.config("32-true", 8, 0, 4), predicted=9 * GiB, budget=budget),
            _oom(1, FREEZABLE.config("bf16-mixed", 8, 0, 4), predicted=8 * GiB, budget=budget)]
    estimate = lambda config: config.micro_batch_size * (4 if config.precision == "32-true" else 2)  # noqa: E731
    plan = _plan(FREEZABLE, estimate=estimate)
    assert plan.next(ooms[:1], None, set()) != seeding.smallest(FREEZABLE, estimate)  # one OOM: the seeds go on
    assert plan.next(ooms, None, set()) == FREEZABLE.config("bf16-mixed", 1, 0, 4) == seeding.smallest(
        FREEZABLE, estimate)


def test_a_second_oom_at_one_micro_batch_halves_the_depth_left():
    budget = 10 * GiB
    space = SearchSpace(global_batch_size=8, precisions=("32-true",), micro_batch_sizes=(1, 2, 4, 8),
                        max_checkpoint_blocks=24, max_freeze_blocks=0)
    first, second = space.config("32-true", 8, 19), space.config("32-true", 8, 20)
    plan = _plan(space)
    plan.after_oom(first, [_oom(0, first, predicted=9 * GiB, budget=budget)])
    assert plan.queue[0] == space.config("32-true", 8, 0)  # the fit's own answer (here: everything fits)
    plan.queue.clear()
    records = [_oom(0, first, predicted=9 * GiB, budget=budget), _oom(1, second, predicted=9 * GiB, budget=budget)]
    plan.after_oom(second, records)
    assert plan.queue[0] == space.config("32-true", 8, 22)  # halfway between 20 and 24


def test_a_new_best_is_compared_with_every_other_group_at_its_own_shape():
    """Throughput peaks at micro batch 2-4: each precision's seed ran at its largest micro
    batch, where tf32 happened to lead. bf16-true at the best's micro batch is twice as fast."""
    landscape = _landscape("small-peak+freeze")
    for seed in (1, 4):  # the two seeds on which the search settled on tf32 without twins
        run = search(landscape, seed)
        assert run.chosen.precision == "bf16-true" and run.ratio >= 0.98, run.chosen.short()


def test_twins_skip_groups_measured_well_below_the_best_s_at_its_micro_batch():
    from autofit.search.seeding import twins

    space = SearchSpace(global_batch_size=8, precisions=("32-true", "tf32", "bf16-mixed"),
                        micro_batch_sizes=(1, 2, 4, 8), max_checkpoint_blocks=2, max_freeze_blocks=0)
    best = space.config("bf16-mixed", 4)
    records = [_ok(0, space.config("32-true", 8), 30.0), _ok(1, space.config("bf16-mixed", 8), 100.0),
               _ok(2, best, 110.0)]
    fits = lambda config: config.micro_batch_size <= 4  # noqa: E731
    assert twins(space, fits, best) == [space.config("32-true", 4), space.config("tf32", 4)]
    # 32-true ran at 0.3 of bf16-mixed at micro batch 8: no twin; tf32 has no matched run, so
    # its precision's ratio (none either) leaves it in.
    assert twins(space, fits, best, records=records) == [space.config("tf32", 4)]


class _StubTuner:
    """What search/_finish.py uses of a Tuner, with scripted measurements."""

    def __init__(self, space, records, measure, budget_bytes=GiB):
        self.space, self._records, self._measure = space, list(records), measure
        self.budget = Budget(usable_bytes=budget_bytes)
        self.session_start = None  # one session: every record is this session's (TrialRecord.fresh)
        self.references = set()  # the configs planned as references (measured for their losses)
        self.priced_as_reference: list[bool] = []  # each affordability check's `reference`
        self.one_liner = self.fallback = None  # no floors planned
        self.loaded: set = set()  # configs measured from now on while other work holds the host

    def records(self):
        return list(self._records)

    def fits(self, records):
        return lambda config: True

    def known(self, config, records):
        return next((r for r in records if r.config == config and not r.repeat), None)

    def should_stop(self):
        return False

    halted = should_stop

    def affordable_after_search(self, config, records, *, after_estimates=0, reference=False):
        self.priced_as_reference.append(reference)
        return True

    def measure_now(self, config, records, *, repeat=False, unless_busy=False):
        figure = self._measure(config)
        record = _ok(len(self._records), config, figure or 0.0, repeat=repeat).replace(measured_at=time.time())
        if figure is None:  # the run failed
            record = record.replace(status="error", measurement=None)
        elif config in self.loaded:
            record = _loaded(record)
        self._records.append(record)
        return record


def _loaded(record):
    """`record` as measured while other work held one and a half of the host's two cores."""
    m = dataclasses.replace(record.measurement, foreign_cores=1.5, cores=2)
    return record.replace(measurement=m)


RACE = SearchSpace(global_batch_size=64, precisions=("32-true",), micro_batch_sizes=(1, 2, 4, 8, 16, 32, 64),
                   max_checkpoint_blocks=2, max_freeze_blocks=0)


def _repeats(tuner):
    counts = {}
    for r in tuner.records():
        if r.repeat:
            counts[r.config] = counts.get(r.config, 0) + 1
    return counts


def test_a_contender_behind_beyond_doubt_leaves_the_race_and_close_ones_race_on():
    from autofit.search import _finish as finish

    a, b, c = RACE.config("32-true", 64), RACE.config("32-true", 32), RACE.config("32-true", 16)
    runs = {a: iter([100.2, 99.8] * 20), b: iter([99.0, 99.4] * 20), c: iter([95.0, 95.2] * 20)}
    tuner = _StubTuner(RACE, [_ok(0, a, 100.0), _ok(1, b, 99.5), _ok(2, c, 96.0)], lambda config: next(runs[config]))
    finish.remeasure_contenders(tuner)
    repeats = _repeats(tuner)
    assert repeats[c] == 1 and repeats[a] == repeats[b] > 1
    from autofit.search import choice
    assert choice.rank(tuner.records(), tuner.budget.usable_bytes)[0].record.config == a


def test_a_config_measured_once_that_comes_to_lead_joins_the_race():
    """Eleven configs within the noise: ten race; their repeats come in lower than the
    eleventh's single run, which must not win on that one run: it is measured level first."""
    from autofit.search import _finish as finish

    configs = [RACE.config("32-true", m, k) for m in (64, 32, 16, 8) for k in (0, 1, 2)][:11]
    first = [_ok(i, config, 101.0 - 0.1 * i) for i, config in enumerate(configs)]
    tuner = _StubTuner(RACE, first, lambda config: 97.0 if config == configs[-1] else 95.0)
    finish.remeasure_contenders(tuner)
    assert _repeats(tuner).get(configs[-1], 0) >= 1


def test_on_a_host_too_noisy_for_any_number_of_rounds_the_race_stops_after_one():
    from autofit.search import _finish as finish

    a, b = RACE.config("32-true", 64), RACE.config("32-true", 32)
    runs = {a: iter([140.0, 60.0] * 20), b: iter([145.0, 55.0] * 20)}  # a 2% gap under 17% noise
    tuner = _StubTuner(RACE, [_ok(0, a, 100.0), _ok(1, b, 99.0)], lambda config: next(runs[config]))
    noise, rounds = finish.remeasure_contenders(tuner)
    assert rounds == 1 and noise > 0.1


def test_a_resumed_race_runs_on_this_session_s_figures_only():
    """Five configs within noise and one far behind, all measured in an older session (under
    a lighter load: every old figure is twice today's), one of them with old repeats that
    spread wildly. The five (the leaders) are measured again; the race, its noise and the
    choice count only this session's runs: the close two race on (the old spread would have
    stopped the race as futile after one round), and the config far behind, though its old
    figure is above today's, is not measured at all."""
    from autofit.search import _finish as finish, choice

    a, b, c, d, e, far = (RACE.config("32-true", m, k) for m, k in ((64, 0), (32, 0), (16, 0), (8, 0), (4, 0), (2, 0)))
    old = [_ok(0, a, 200.0), _ok(1, b, 199.6), _ok(2, c, 199.2), _ok(3, d, 198.8), _ok(4, e, 198.4), _ok(5, far, 150.0),
           _ok(6, a, 300.0, repeat=True), _ok(7, a, 100.0, repeat=True)]
    runs = {a: iter([100.2, 99.8] * 20), b: iter([99.0, 99.4] * 20)}
    today = lambda config: next(runs.get(config, iter([95.0])))  # noqa: E731
    tuner = _StubTuner(RACE, [r.replace(measured_at=1.0) for r in old], today)
    tuner.session_start = 1000.0
    noise, rounds = finish.remeasure_contenders(tuner)
    repeats = _repeats(tuner)
    assert far not in repeats and all(repeats[x] == 2 for x in (c, d, e))  # measured again, then out-raced
    assert rounds > 1 and repeats[b] == rounds + 1 and repeats[a] == 2 + rounds + 1  # the old repeats count 2
    assert noise < 0.01
    assert choice.rank(tuner.records(), tuner.budget.usable_bytes, fresh_since=tuner.session_start)[0].record.config == a


def test_a_trial_whose_threads_other_work_took_a_core_from_is_loaded():
    """Seen on the CPU (2 cores): a published ModernBERT's one-liner ran while two other
    processes spun, at 3.4 samples/s (about 23 quiet), with other work on 0.95 cores: under
    half the host's, so unmarked, though its two threads had one core between them. On a GPU
    the steps need the one thread that launches kernels, and the host's half still decides."""
    config = RACE.config("32-true", 4)

    def record(foreign, cores, step_cores):
        return _ok(0, config).replace(measurement=dataclasses.replace(
            _ok(0, config).measurement, foreign_cores=foreign, cores=cores, step_cores=step_cores))

    assert record(0.952, 2, 2).loaded and not record(0.112, 2, 2).loaded
    assert not record(0.952, 2, None).loaded  # a record from before `step_cores`: the host's half alone
    assert record(1.0, 2, None).loaded
    assert not record(4.0, 16, 1).loaded and record(8.0, 16, 1).loaded  # a GPU host
    assert record(0.5, 16, 16).loaded  # a CPU trial on every core of a larger host
    assert not record(0.0, 1, 2).loaded  # more threads than the cores it may run on (OMP_NUM_THREADS)


def test_a_contender_whose_re_measures_run_under_load_keeps_its_quiet_figure_and_the_race_ends():
    """A config that ran quiet and loaded is ranked by its quiet runs (a loaded figure is the
    host's), and a round whose run shared the host with other work ends the race: it tightens
    no figure (counting quiet runs as rounds, the race stayed at round 0 until the budget
    ended; counting every run but ranking by quiet ones, a mild load ran all MAX_ROUNDS)."""
    from autofit.search import _finish as finish, choice

    a, b = RACE.config("32-true", 64), RACE.config("32-true", 32)
    runs = {a: iter([99.7] * 40), b: iter([99.0, 99.4] * 20)}  # a mild load: a's runs barely slower
    tuner = _StubTuner(RACE, [_ok(0, a, 100.0), _ok(1, b, 99.5)], lambda config: next(runs[config]))
    tuner.loaded = {a}
    noise, rounds = finish.remeasure_contenders(tuner)
    assert rounds == 1 and _repeats(tuner) == {a: 1, b: 1}
    best = choice.rank(tuner.records(), tuner.budget.usable_bytes)[0]
    assert best.record.config == a and best.samples_per_s == 100.0 and best.measurements == 1 and best.runs == 2


def test_a_contender_measured_quiet_at_last_races_on():
    """A config whose figures were all loaded gets its first quiet run in a round: its figure
    now rests on that run alone (fewer measurements than before), and the race goes on."""
    from autofit.search import _finish as finish

    a, b = RACE.config("32-true", 64), RACE.config("32-true", 32)
    runs = {a: iter([99.0] + [100.0, 99.4] * 20), b: iter([98.6] + [99.2, 98.8] * 20)}
    tuner = _StubTuner(RACE, [_loaded(_ok(0, a, 100.0)), _ok(1, b, 99.0)], lambda config: next(runs[config]))
    tuner.loaded = {a}  # its search trial and its re-measure before the race (`refresh_leaders`)
    measure_now = tuner.measure_now

    def quiet_after_the_refresh(config, records, **kwargs):
        if _repeats(tuner).get(a, 0) >= 1:
            tuner.loaded = set()
        return measure_now(config, records, **kwargs)

    tuner.measure_now = quiet_after_the_refresh
    noise, rounds = finish.remeasure_contenders(tuner)
    assert rounds >= 2 and _repeats(tuner)[a] >= 3


def test_a_contender_whose_re_measures_fail_ends_the_race():
    """A re-measure that fails adds no run: the race stayed at its round until the budget ended."""
    from autofit.search import _finish as finish

    a, b = RACE.config("32-true", 64), RACE.config("32-true", 32)
    runs = {a: iter([None] * 40), b: iter([99.0, 99.4] * 20)}
    tuner = _StubTuner(RACE, [_ok(0, a, 100.0), _ok(1, b, 99.5)], lambda config: next(runs[config]))
    noise, rounds = finish.remeasure_contenders(tuner)
    assert rounds == 1 and _repeats(tuner) == {a: 1, b: 1}


def test_a_floor_that_ran_only_under_load_is_measured_again_before_the_race():
    """Seen on the CPU (a published ModernBERT under 100 MiB): the one-liner's trial ran while
    other work held one of the two cores, at 1.6 samples/s; the fallback, measured quiet at 18.0,
    became the floor and the profile, though the one-liner runs about 23 on a quiet host. A
    floor is measured again, as a leader is, where its figures are all loaded, and the profile's
    floor is its quiet figure."""
    from autofit.search import _finish as finish, choice

    one, fallback = RACE.config("32-true", 64), RACE.config("32-true", 16, 2)
    leaders = [RACE.config("32-true", m) for m in (32, 16, 8, 4)]  # the one-liner ranks below all
    figures = {one: 23.0, fallback: 18.0} | {c: 24.0 + i for i, c in enumerate(leaders)}
    runs = {c: iter([f] * 40) for c, f in figures.items()}
    first = [_loaded(_ok(0, one, 1.6)), _ok(1, fallback, 18.0)] + [_ok(2 + i, c, figures[c])
                                                                   for i, c in enumerate(leaders)]
    tuner = _StubTuner(RACE, first, lambda config: next(runs[config]))
    tuner.one_liner, tuner.fallback = one, fallback
    assert one not in {r.record.config for r in choice.leaders(choice.rank(first, tuner.budget.usable_bytes))}
    finish.remeasure_contenders(tuner)
    assert _repeats(tuner)[one] == 1
    ranked = {r.record.config: r.samples_per_s for r in choice.rank(tuner.records(), tuner.budget.usable_bytes)}
    assert ranked[one] == 23.0
    assert floor_record(tuner.records(), (one, fallback), tuner.budget.usable_bytes).config == one


def test_the_leaders_are_the_contenders_and_at_least_three():
    from autofit.search import choice

    configs = [RACE.config("32-true", m, k) for m in (64, 32, 16, 8) for k in (0, 1, 2)]
    clear = choice.rank([_ok(0, configs[0], 200.0)] + [_ok(i, c, 100.0 - i) for i, c in enumerate(configs[1:], 1)], GiB)
    assert len(choice.leaders(clear)) == choice.MIN_LEADERS  # one alone would rank first however slow it now is
    close = choice.rank([_ok(i, c, 100.0 - 0.1 * i) for i, c in enumerate(configs)], GiB)
    assert len(choice.leaders(close)) == choice.MAX_CONTENDERS


def test_the_noise_decided_with_is_an_upper_bound_of_the_spread_seen():
    from autofit.search import choice

    a, b = RACE.config("32-true", 64), RACE.config("32-true", 32)
    records = [_ok(0, a, 100.0), _ok(1, a, 102.0, repeat=True), _ok(2, b, 50.0), _ok(3, b, 51.0, repeat=True)]
    observed = choice.observed_noise(records)
    assert observed == pytest.approx(((2 * (1 / 101) ** 2 + 2 * (0.5 / 50.5) ** 2) / 2) ** 0.5, rel=1e-9)
    assert choice.decision_noise(records, 0.03) > 2 * observed  # two repeats prove little
    assert choice.decision_noise([_ok(0, a), _ok(1, a, repeat=True)], 0.03) == choice.NOISE_FLOOR
    assert choice.central([1.0, 9.0, 2.0]) == 2.0 and choice.central([0.0, 2.0, 2.0, 2.0, 50.0]) == 2.0


def test_compile_is_tried_on_the_leaders_only():
    """Compiling is a refinement of the leading configs: no seed, twin, reference or sampled
    trial is compiled; the first compiled trial is the compiled twin of the eager best measured
    before it, and few are tried (each costs a compile on a GPU)."""
    landscape = _landscape("compiled")
    landscape.reset()
    _, result = run_tuner(landscape)
    measured = [r for r in sorted(result.records, key=lambda r: r.number) if r.measurement is not None
                and not r.repeat]
    first = next(i for i, r in enumerate(measured) if r.config.compile)
    eager_best = max((r for r in measured[:first] if r.status == "ok"), key=lambda r: r.samples_per_s)
    assert measured[first].config == eager_best.config.replace(compile=True)
    compiled = [r for r in measured if r.config.compile]
    # The leader's twin and what it lets fit (main before this change compiled 16 of 26 trials here).
    assert 1 <= len(compiled) <= 3, [r.config.short() for r in compiled]
    assert result.ranked[0].config.compile  # compiled steps run faster on this landscape
    assert landscape.samples_per_s(result.ranked[0].config) >= 0.98 * landscape.grid_best()[1]


def test_the_sampler_never_proposes_a_refinement_knob():
    space = SearchSpace(global_batch_size=8, precisions=("32-true", "bf16-mixed"), micro_batch_sizes=(1, 2, 4, 8),
                        max_checkpoint_blocks=2, max_freeze_blocks=0, compile=(False, True),
                        expandable_segments=(False, True))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(40):
        trial = study.ask()
        config = space.suggest(trial)
        assert not config.compile and not config.expandable_segments
        study.tell(trial, 1.0)
    # Enqueued (a refinement planned it), the same knob is read back; its default is no param at all.
    leader = space.config("bf16-mixed", 4)
    study.enqueue_trial(space.params(leader.replace(compile=True)))
    trial = study.ask()
    assert space.suggest(trial, study.trials[trial.number].system_attrs["fixed_params"]).compile
    assert "compile" not in space.params(leader) and space.params(leader.replace(compile=True))["compile"]
    assert all(not c.compile for c in space.neighbours(leader))


def test_seeds_twins_and_the_reference_are_eager_and_the_leader_gets_its_compiled_twin():
    space = SearchSpace(global_batch_size=8, precisions=("32-true", "bf16-mixed"), micro_batch_sizes=(1, 2, 4, 8),
                        max_checkpoint_blocks=2, max_freeze_blocks=0, compile=(False, True))
    fits = lambda c: c.micro_batch_size <= 4  # noqa: E731
    assert not any(c.compile for c in seeding.starting_points(space, fits))
    best = space.config("bf16-mixed", 4, compile=True)
    assert not any(c.compile for c in seeding.twins(space, fits, best))
    assert not seeding.reference_point(space, fits, 0).compile
    eager = best.replace(compile=False)
    refined = list(seeding.refinements(space, fits, eager))
    assert [c for c in refined if c.compile] == [best]  # the leader's compiled twin, nothing else compiled
    # After the cheap moves around the leader: its twins in the other seed groups first.
    twins = list(seeding.twins(space, fits, eager))
    assert twins and all(refined.index(t) < refined.index(best) for t in twins)


def _worker(study_name: str):
    """(landscape, space, study, tuner): one worker of an in-memory study on selective+freeze,
    whose other workers' trials a test makes by hand."""
    landscape = _landscape("selective+freeze")
    space = landscape.space()
    study = make_study(study_name=study_name, storage=None, seed=0)
    tuner = Tuner(space, study=study, budget=Budget(usable_bytes=landscape.budget_bytes), measure=landscape.measure,
                  estimate=landscape.estimate, max_trials=DEFAULTS.trials, patience=DEFAULTS.patience)
    return landscape, space, study, tuner


def test_a_sampled_trial_another_worker_runs_is_busy_though_its_raw_params_differ():
    """The sampler may propose checkpointing beyond the trainable blocks (read as all of them)
    or a policy with none checkpointed (read as none): the config another worker is
    measuring is the one its params read as, not its raw params (seen on PostgreSQL: two
    workers measured bf16-mixed 4 x 2 with 1 block checkpointed one after the other)."""
    landscape, space, study, tuner = _worker("busy")
    deep = space.config("bf16-mixed", space.micro_batch_sizes[1], space.checkpointable(4), 4,
                        checkpoint_policy="selective")
    plain = space.config("bf16-mixed", space.micro_batch_sizes[2], 0, 0)
    for config, raw in [(deep, {"checkpoint_blocks": space.max_checkpoint_blocks}),
                        (plain, {"checkpoint_policy": "selective"})]:
        params = {**space.params(config), **raw}
        assert params != space.params(config) and space.config_of(params) == config
        study.enqueue_trial(params)
        running = study.ask()
        assert space.suggest(running, params) == config  # what that worker measures
    assert _trial.running(tuner.trials) == {deep, plain}  # what the plan and the claim skip
    # A worker killed while it set a trial's params leaves it running with some: no config.
    partial = study.ask()
    partial.suggest_categorical("precision", list(space.precisions))
    assert _trial.running(tuner.trials) == {deep, plain}


def test_a_move_along_the_micro_batches_that_paid_is_followed_twice_as_far():
    """A pattern search's expanding step: the leader reached from a slower micro batch next
    tries the same way twice as far, then the adjacent size; with no such move (or the way
    back), the adjacent sizes as before."""
    space = SearchSpace(global_batch_size=96, precisions=("32-true", "bf16-mixed"),
                        micro_batch_sizes=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96),
                        max_checkpoint_blocks=0, max_freeze_blocks=2)
    def fits(config):
        return True

    def at(micro, freeze=0):
        return space.config("bf16-mixed", micro, 0, freeze)

    def first(best, records, count=3):
        return [c.micro_batch_size for c in itertools.islice(seeding.refinements(space, fits, best, records=records),
                                                             count)]

    climbed = [_ok(0, at(8), 100.0), _ok(1, at(12), 120.0)]
    assert first(at(12), climbed) == [24, 16, 8]  # 8 -> 12 paid: 24 next (two sizes on), then the adjacent ones
    descended = [_ok(0, at(48), 50.0), _ok(1, at(16), 90.0)]
    assert first(at(16), descended) == [4, 24, 12]  # 48 -> 16 (three sizes down) paid: on, at most four sizes
    # Which way it came is what was measured before the best: a slower size measured after it
    # (its own refinement) turns nothing, and a size on the way measured slower stops the step.
    assert first(at(12), [_ok(0, at(12), 120.0), _ok(1, at(8), 100.0)], 2) == [16, 8]
    assert first(at(12), [*climbed, _ok(2, at(16), 110.0)], 2) == [16, 8]  # 16, on the way to 24, was slower
    assert first(at(12), [], 2) == [16, 8]  # nothing measured around it: the adjacent sizes
    slower_elsewhere = [_ok(0, at(8, freeze=1), 100.0), _ok(1, at(12), 120.0)]  # another freezing depth
    assert first(at(12), slower_elsewhere, 2) == [16, 8]
    within_noise = [_ok(0, at(8), 118.0), _ok(1, at(12), 120.0)]  # 2% slower: no move that paid
    assert first(at(12), within_noise, 2) == [16, 8]
    # Climbed to the largest size: nothing further that way; the adjacent ones as before.
    assert first(at(96), [_ok(0, at(48), 50.0), _ok(1, at(96), 90.0)], 2) == [48, 32]


def test_a_trial_another_worker_ends_while_this_one_plans_is_not_measured_again():
    """A trial is told outside the claim lock: one running when this worker read the study's
    records may end before it checks what is running. Its config is then neither in those
    records nor running, and was measured twice (seen on PostgreSQL with three workers)."""
    from autofit.search import _claim
    from autofit.search._state import Progress

    landscape, space, study, tuner = _worker("ended")
    config = space.config("bf16-mixed", space.micro_batch_sizes[2], 0, 0)
    study.enqueue_trial(space.params(config))
    theirs = study.ask()  # another worker's trial, running when this worker reads the records
    measured = _trial.evaluate(tuner.trials, tuner.timing, theirs, space.suggest(theirs, space.params(config)), [])

    class Plan:  # the other worker tells its trial while this one plans, and this one plans the same config
        look_down = None

        def next(self, records, best, running):
            assert not records  # theirs was running
            _trial.tell(tuner.trials, theirs, measured)
            return config

        def neighbours_first(self, config):
            pass

    tuner.plan = Plan()
    progress = Progress(best=None, since_best=0, start=time.monotonic())
    claimed, stop_reason = _claim.claim_next(tuner.trials, tuner.timing, tuner.plan, progress,
                                             max_trials=tuner.max_trials, patience=tuner.patience)
    assert claimed is None and stop_reason is None and progress.skipped["known"] == 1
    assert len(landscape.calls) == 1  # measured once, by the other worker


def test_a_bf16_precision_measured_far_below_a_full_precision_best_speaks_for_the_other():
    """A CPU without bf16 units runs 16 bits several times slower than 32 (seen with a published
    GPT-NeoX at 100 MiB: 32-true 18.9 samples/s, 16-mixed 2.8, then bf16-mixed 3.1 and bf16-true
    3.2 measured, 119 s of a 144 s search). bf16-mixed and bf16-true share their matmuls: once one
    is measured below half of `DEFER_SHARE` of a full-precision best (`ALIKE_SPREAD`: bf16-true
    may be 1.3x bf16-mixed), the other's seed waits behind the best's refinements (`outpaced`)
    and gets no twin (`TWIN_FLOOR`). fp16 does not speak for bf16 (a CPU may have units for one
    only), a gap the spread covers defers nothing, and a 16-bit best's speed defers no other
    16-bit group."""
    from autofit.search.plan import outpaced

    space = SearchSpace(global_batch_size=16, precisions=("32-true", "16-mixed", "bf16-mixed", "bf16-true"),
                        micro_batch_sizes=(1, 2, 4, 8, 16), max_checkpoint_blocks=3, max_freeze_blocks=0)
    best = _ok(0, space.config("32-true", 4, 0, 0), 18.9)
    fp16 = _ok(1, space.config("16-mixed", 4, 0, 0), 2.8)
    bf16 = _ok(2, space.config("bf16-mixed", 4, 0, 0), 3.1)
    seed = space.config("bf16-true", 4, 0, 0)
    assert outpaced(space, seed, [best, fp16, bf16], best)
    assert not outpaced(space, seed, [best, fp16], best)  # fp16's speed is not bf16's
    assert not outpaced(space, seed, [best, _ok(2, bf16.config, 15.0)], best)  # 2 x 15 > 0.9 x 18.9
    twins = {t.precision for t in seeding.twins(space, lambda c: True, best.config, records=[best, fp16, bf16])}
    assert twins == set()  # 16-mixed and bf16-mixed measured below the floor, bf16-true judged by bf16-mixed
    assert "bf16-true" in {t.precision for t in seeding.twins(space, lambda c: True, best.config,
                                                               records=[best, fp16])}
    # The spread bounds the floor; it ranks no twin above a group nothing measured (16-mixed here).
    close = _ok(2, bf16.config, 15.0)  # 2 x 15 / 18.9: 1.6
    ranked = [t.precision for t in seeding.twins(space, lambda c: True, best.config, records=[best, close])]
    assert ranked[:2] == ["16-mixed", "bf16-true"], ranked
    plan = _plan(space)
    plan.queue = [seed]
    plan.seeds.add(seed)
    assert plan.next([best, fp16, bf16], best, set()) != seed  # the best's refinements first
    # Against a 16-bit best, another 16-bit group is not judged by its speed.
    fast = _ok(0, space.config("bf16-mixed", 4, 0, 0), 30.0)
    assert not outpaced(space, space.config("bf16-true", 1, 0, 0), [fast], fast)


def test_a_twin_whose_group_ran_at_another_shape_is_judged_by_that_trial_moved_along_the_shape():
    """A CPU without bf16 units: bf16-true ran at micro batch 2, at a fifth of the 32-true
    best's speed at 4, and bf16-mixed never ran. Matched at no shape, the bf16-true twin
    ranked as unmeasured (1.0) and its slow trial came again; its own trial moved to the
    best's shape by the step model (`predict`) puts it below `TWIN_FLOOR`. Where the step
    model moves it above the floor, the twin stays."""
    from autofit.search.step_model import PRIOR

    space = SearchSpace(global_batch_size=16, precisions=("32-true", "bf16-mixed", "bf16-true"),
                        micro_batch_sizes=(1, 2, 4, 8, 16), max_checkpoint_blocks=3, max_freeze_blocks=0)
    best = _ok(0, space.config("32-true", 4, 0, 0), 20.0)
    slow = _ok(1, space.config("bf16-true", 2, 0, 0), 4.0)

    def predict(config, anchor):
        return PRIOR.predicted(config, anchor, space)

    def twin_precisions(records, **kwargs):
        return {t.precision for t in seeding.twins(space, lambda c: True, best.config, records=records, **kwargs)}

    assert "bf16-true" in twin_precisions([best, slow])  # unmatched: as if unmeasured
    assert twin_precisions([best, slow], predict=predict) == {"bf16-mixed"}
    assert twin_precisions([best, slow.replace(measurement=dataclasses.replace(
        slow.measurement, foreign_cores=2.0, cores=2))], predict=predict) == {"bf16-mixed", "bf16-true"}  # loaded
    # Moved to micro batch 4 by the prior, 15.0 is 22.5, above the best's 20.0: a bound for
    # the floor only, so it ranks no higher than the unmeasured bf16-mixed (1.0), in the
    # groups' order, not ahead of it.
    close = _ok(1, slow.config, 15.0)
    ranked = [t.precision for t in seeding.twins(space, lambda c: True, best.config, records=[best, close],
                                                 predict=predict)]
    assert ranked == ["bf16-mixed", "bf16-true"], ranked
    # Against a 16-bit best the move along the shape judges no twin (on a GPU it skipped the
    # optimum's group): bf16-true at a fifth of a bf16-mixed best's speed keeps its twin.
    fast = _ok(0, space.config("bf16-mixed", 4, 0, 0), 20.0)
    assert "bf16-true" in {t.precision for t in seeding.twins(space, lambda c: True, fast.config,
                                                               records=[fast, slow], predict=predict)}


def test_a_look_from_below_pruned_when_claimed_is_priced_as_any_config_after():
    """The look from below (`plan._look_down`) is priced at the speed measured, not scaled down
    with its micro batch. One that the claim then prunes (its traced estimate does not fit) is
    dropped: proposed again by the sampler, it is priced as any config is."""
    from autofit.search import _claim
    from autofit.search._state import Progress

    landscape, space, study, tuner = _worker("pruned-look")
    look = space.config("32-true", space.micro_batch_sizes[-1], 0, 0)
    assert not tuner.trials.memory.fits(look, [])

    class Plan:
        look_down = look

        def next(self, records, best, running):
            return look

        def slow_16_bit_now(self, records, best):
            return set()

    tuner.plan = Plan()
    progress = Progress(best=None, since_best=0, start=time.monotonic())
    claimed, stop_reason = _claim.claim_next(tuner.trials, tuner.timing, tuner.plan, progress,
                                             max_trials=tuner.max_trials, patience=tuner.patience)
    assert claimed is None and progress.skipped["pruned"] == 1
    assert tuner.plan.look_down is None and not tuner._looks_down(look)


def test_a_reference_another_worker_measured_since_the_records_were_read_is_not_measured_again():
    """`measure_now(unless_busy=True)` (the finisher's reference) reads what is running and
    measured under the claim lock, not from the caller's older records."""
    landscape, space, study, tuner = _worker("reference")
    config = space.config("32-true", space.micro_batch_sizes[2], 0, 0)
    study.enqueue_trial(space.params(config))
    theirs = study.ask()
    space.suggest(theirs, space.params(config))  # claimed: its params set
    assert tuner.measure_now(config, [], unless_busy=True) is None  # running in another worker's trial
    _trial.tell(tuner.trials, theirs, _trial.evaluate(tuner.trials, tuner.timing, theirs, config, []))
    assert tuner.measure_now(config, [], unless_busy=True) is None  # measured since `[]` was read
    assert len(landscape.calls) == 1


SIZES_96 = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96)


def _stepped(number, config, samples_per_s, step_time_s):
    record = _ok(number, config, samples_per_s)
    return dataclasses.replace(record, measurement=dataclasses.replace(record.measurement, step_time_s=step_time_s))


def test_a_slow_first_step_at_a_large_micro_batch_looks_down_to_an_eighth_of_it_next():
    """Past the throughput's peak (a CPU's caches) the largest micro batch is the slowest and
    dearest, and every seed wave measures there. A first trial whose micro steps are slow
    (longer than `SLOW_MICRO_STEP_S`) at micro batch 8 or more with nothing checkpointed is
    looked at from below once, where the time budget holds few trials at its step: its line
    at an eighth of its micro batch, next, before its reference and the seeds."""
    from autofit.search.plan import LOOK_DOWN_TRIALS, SLOW_MICRO_STEP_S

    space = SearchSpace(global_batch_size=96, precisions=("32-true", "bf16-mixed"), micro_batch_sizes=SIZES_96,
                        max_checkpoint_blocks=2, max_freeze_blocks=0)

    def at(micro, blocks=0):
        return space.config("bf16-mixed", micro, blocks, 0)

    def first(config, share=2.0):  # micro steps `share` times SLOW_MICRO_STEP_S
        return _stepped(0, config, 40.0, share * SLOW_MICRO_STEP_S * config.grad_accum_steps)

    def after(*records, trials=LOOK_DOWN_TRIALS / 2, plan=None, running=frozenset()):
        best = max(records, key=lambda r: r.samples_per_s)
        plan = plan or _plan(space, trials_within=lambda step_s: trials)
        return plan.next(list(records), best, set(running))

    assert after(first(at(48))) == at(6)
    assert after(first(at(48)), trials=LOOK_DOWN_TRIALS) != at(6)  # time for many trials: the refinements walk down
    assert after(first(at(48), share=0.5)) != at(6)  # quick micro steps: the GPU's way up
    assert after(first(at(48, 1))) != at(6)  # checkpointed: not the micro batch's cost
    assert after(first(at(6))) != at(1)  # too small to look down from
    # Measured while other work held the host: the slow step is the host's (seen on this CPU:
    # the look at 1 x 16 then cost 95 s of a 180 s share, at 0.9 samples/s).
    busy = first(at(48))
    busy = dataclasses.replace(busy, measurement=dataclasses.replace(busy.measurement, foreign_cores=1.0, cores=2))
    assert busy.loaded and after(busy) != at(6)
    # Once, at the first trial: not in a study with more (resumed, or other workers'), and a
    # look that cannot start when it comes (another worker runs it) is dropped, not retried.
    assert after(first(at(48)), _stepped(1, at(24), 30.0, 3.0)) != at(6)
    plan = _plan(space, trials_within=lambda step_s: LOOK_DOWN_TRIALS / 2)
    assert after(first(at(48)), plan=plan, running={at(6)}) != at(6)
    assert plan.look_down is None  # dropped: proposed again, it is priced as any config is
    assert after(first(at(48)), plan=plan) != at(6)
    # A slow step for its accumulation (a GPU's micro batch of 8 limited by memory, 12 of
    # them) is not a slow micro step.
    gpu = _stepped(0, at(8), 40.0, 12 * 0.5 * SLOW_MICRO_STEP_S)
    assert gpu.measurement.step_time_s > 2.0 and after(gpu) != at(1)
    # Sizes that do not reach an eighth (a micro-batch floor): no look.
    floored = SearchSpace(global_batch_size=64, precisions=("32-true", "bf16-mixed"), micro_batch_sizes=(4, 8, 16),
                          max_checkpoint_blocks=0, max_freeze_blocks=0)
    config = floored.config("bf16-mixed", 16, 0, 0)
    record = _stepped(0, config, 40.0, 4 * SLOW_MICRO_STEP_S * config.grad_accum_steps)
    assert _plan(floored, trials_within=lambda step_s: 1).next([record], record, set()) != floored.config(
        "bf16-mixed", 4, 0, 0)


def test_once_a_smaller_micro_batch_paid_no_seed_is_above_the_bests():
    """Where a move down the micro batches paid (beyond noise, checkpointed alike), each seed
    group's largest micro batch is its slowest and dearest trial: the seeds planned from then
    on, and those planned before, are capped at the best's micro batch."""
    space = SearchSpace(global_batch_size=96, precisions=("32-true", "bf16-mixed", "bf16-true"),
                        micro_batch_sizes=SIZES_96, max_checkpoint_blocks=2, max_freeze_blocks=0)
    reference = _ok(2, space.config("32-true", 6, 0, 0), 60.0)

    def mixed(micro, blocks=0):
        return space.config("bf16-mixed", micro, blocks, 0)

    def next_seed(*records, queued=None):
        best = max((r for r in records if r.config.precision != "32-true"), key=lambda r: r.samples_per_s)
        plan = _plan(space)
        if queued is None:
            plan.new_best(best.config, list(records))  # the seed groups with nothing measured come next
        else:  # a seed planned before the move down paid
            plan.queue, plan.seeds = [queued], {queued}
        return plan.next(list(records), best, set())

    down = [_ok(0, mixed(48), 40.0), _ok(1, mixed(6), 170.0)]
    assert next_seed(*down, reference) == space.config("bf16-true", 6, 0, 0)
    assert next_seed(*down, reference, queued=space.config("bf16-true", 96, 0, 0)) == space.config(
        "bf16-true", 6, 0, 0)
    up = [_ok(0, mixed(6), 40.0), _ok(1, mixed(48), 170.0)]
    assert next_seed(*up, reference) == space.config("bf16-true", 96, 0, 0)
    within_noise = [down[0], _ok(1, mixed(6), 41.0)]
    assert next_seed(*within_noise, reference) == space.config("bf16-true", 96, 0, 0)
    # Faster for checkpointing less, not for a smaller micro batch: no cap.
    less_checkpointed = [_ok(0, mixed(48, 2), 40.0), _ok(1, mixed(6), 170.0)]
    assert next_seed(*less_checkpointed, reference) == space.config("bf16-true", 96, 0, 0)


def test_a_full_precision_far_below_a_healthy_16_bit_best_leaves_tf32_unseeded_too():
    """gen-2026-08: 32-true ran at 0.28 of the bf16-true best, and tf32's seed (4 x 64, a
    9.8 s step) then took 52 s of the 55 s left. Such a gap says the step is bound by its
    matmuls, where tf32 (half 16-bit's tensor-core rate) cannot come near either: neither full
    precision gets a seed. Where 32-true ran close to the best, tf32 still does."""
    space = SearchSpace(global_batch_size=64, precisions=("32-true", "tf32", "bf16-true"),
                        micro_batch_sizes=(1, 2, 4, 8, 16, 32, 64), max_checkpoint_blocks=2, max_freeze_blocks=0)
    best = _ok(0, space.config("bf16-true", 8, 0, 0), 120.0)

    def seeded(reference_samples_per_s):
        records = [best, _ok(1, space.config("32-true", 8, 0, 0), reference_samples_per_s)]
        plan = _plan(space, fast_first=True, first=("bf16-true",))
        plan.new_best(best.config, records)  # the seed groups with nothing measured come next
        return plan.next(records, best, set())

    assert seeded(0.9 * 120.0).precision == "tf32"
    assert seeded(0.28 * 120.0).precision == "bf16-true"  # its refinements instead


def test_a_seed_group_left_out_costs_no_estimate():
    """The groups not yet seeded are read one at a time after a new best (`Plan._unseeded`);
    finding a group's seed costs estimates. A full-precision group left out (`Plan._slow`) is
    not read at all: its seed would only be dropped when its turn came."""
    from autofit.search.plan import Plan

    space = SearchSpace(global_batch_size=64, precisions=("32-true", "tf32", "bf16-true"),
                        micro_batch_sizes=(1, 2, 4, 8, 16, 32, 64), max_checkpoint_blocks=2, max_freeze_blocks=0)
    best = _ok(0, space.config("bf16-true", 8, 0, 0), 120.0)
    records = [best, _ok(1, space.config("32-true", 8, 0, 0), 0.28 * 120.0)]
    asked = []

    def fits_of(records):
        return lambda config: asked.append(config) or True

    plan = Plan(space, (), known=lambda c, records: next((r for r in records if r.config == c), None),
                fits_of=fits_of, estimate=lambda config: 1, fast_first=True, first=("bf16-true",))
    plan.new_best(best.config, records)
    assert plan.next(records, best, set()).precision == "bf16-true"
    assert not [c for c in asked if c.precision == "tf32"]


def _proposed(plan, records, best, trials=16):
    """What `plan` proposes, each measured at half the best's speed, for up to `trials` trials."""
    records, proposed = list(records), []
    while len(proposed) < trials and (config := plan.next(records, best, set())) is not None:
        proposed.append(config)
        records.append(_ok(len(records), config, best.samples_per_s / 2))
    return proposed


NO_16_BIT_UNIT = frozenset({"16-mixed", "bf16-mixed", "bf16-true"})


@pytest.mark.parametrize("slow_16_bit, ran, proposed, blocked", [
    (NO_16_BIT_UNIT, None, set(), NO_16_BIT_UNIT),  # a CPU with no 16-bit unit: a bound says they lose
    (frozenset(), None, {"bf16-mixed", "16-mixed"}, set()),  # a GPU: 16 bits may win
    # bf16 measured near the best: the prior is wrong here, for bf16.
    (NO_16_BIT_UNIT, ("bf16-true", 95.0), {"bf16-mixed"}, {"16-mixed"}),
    # fp16 measured slow, as the prior said; bf16 still unmeasured.
    (NO_16_BIT_UNIT, ("16-mixed", 14.0), set(), NO_16_BIT_UNIT),
])
def test_a_cpu_with_no_16_bit_unit_plans_no_16_bit_config_once_full_precision_ran(slow_16_bit, ran, proposed,
                                                                                  blocked):
    """On a CPU with no unit that multiplies a 16-bit dtype its precisions run at least 6x
    slower than 32-true: once a 32-true trial ran, and none in their dtype near the best,
    no config of theirs is planned (their seeds cost estimates). A Mixtral-style model spent
    30 s of a 72 s search estimating them and 42 s on one 16-mixed trial at a seventh of the
    one-liner's speed."""
    space = SearchSpace(global_batch_size=8, precisions=("32-true", "16-mixed", "bf16-mixed", "bf16-true"),
                        micro_batch_sizes=(1, 2, 4, 8), max_checkpoint_blocks=2, max_freeze_blocks=0)
    best = _ok(0, space.config("32-true", 8, 0, 0), 100.0)
    records = [best] + ([_ok(1, space.config(ran[0], 8, 0, 0), ran[1])] if ran else [])
    plan = _plan(space, first=("32-true",), slow_16_bit=slow_16_bit)
    plan.new_best(best.config, records)
    assert plan.slow_16_bit_now(records, best) == blocked  # what the sampler's proposals are checked against too
    configs = _proposed(plan, records, best, trials=24)
    assert any(c.precision == "32-true" for c in configs)  # the search goes on in 32-true
    assert {c.precision for c in configs} & {"16-mixed", "bf16-mixed"} == proposed


def test_a_probe_does_not_stand_for_its_seed_groups_seed():
    """After two OOMs the probe (the smallest config, or its shape well inside the budget)
    anchors the memory fit; it is not its group's seed, which is the group's largest config
    that fits. gen-2026-01: bf16-true measured only at its probe (8 x 24 at 75% of the budget)
    was never measured at 16 x 12, the optimum, 1.14x the 16-mixed pick."""
    space = SearchSpace(global_batch_size=8, precisions=("32-true", "bf16-true"), micro_batch_sizes=(1, 2, 4, 8),
                        max_checkpoint_blocks=2, max_freeze_blocks=0)
    ooms = [_oom(0, space.config("bf16-true", 8, 0, 0), predicted=GiB // 2, budget=GiB),
            _oom(1, space.config("bf16-true", 4, 0, 0), predicted=GiB // 2, budget=GiB)]
    plan = _plan(space, estimate=lambda c: c.micro_batch_size * (2 if c.precision == "32-true" else 1))
    probe = plan.next(ooms, None, set())
    assert probe == space.config("bf16-true", 1, 2, 0)  # the smallest config
    records = [*ooms, _ok(2, probe, 50.0)]
    plan.new_best(probe, records)
    offered = []
    def small_or_checkpointed(config):
        return config.micro_batch_size <= 2 or config.checkpoint_blocks

    while found := plan._unseeded(records, None, small_or_checkpointed):
        offered += found
    assert [c for c in offered if c.precision == "bf16-true"] == [space.config("bf16-true", 2, 0, 0)]  # its seed
    # A resumed study (or another worker's plan) knows the probe from the records alone.
    resumed = _plan(space)
    resumed.new_best(probe, records)
    offered = []
    while found := resumed._unseeded(records, None, small_or_checkpointed):
        offered += found
    assert [c for c in offered if c.precision == "bf16-true"] == [space.config("bf16-true", 2, 0, 0)]
