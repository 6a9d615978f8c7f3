"""A new GPU kind tuned from another kind's experience (`autofit.search.warm_start`,
`autofit.service.warm`): the translation, its worth on simulated cards, and the service using it."""

import statistics

import pytest
import yaml

from autofit.profiles.profile import Profile
from autofit.search.search_space import SearchSpace
from autofit.search.warm_start import kept_precision, translate
from conftest import write_spec
from simulated import CARDS, search
from test_daemon import A100, H100, model, ready, Serve, write_config, write_inventory


def _space(precisions=("32-true", "16-mixed", "bf16-mixed", "bf16-true")) -> SearchSpace:
    return SearchSpace(global_batch_size=64, precisions=precisions, micro_batch_sizes=(1, 2, 4, 8, 16, 32, 64),
                       max_checkpoint_blocks=12, max_freeze_blocks=0)


def test_translation_keeps_the_precision_the_card_has_and_refits_the_batch():
    space = _space(precisions=("32-true", "16-mixed"))  # a card without bf16
    source = space.config("16-mixed", 64).replace(precision="bf16-true")
    # This card fits 16 samples without checkpointing, 64 with 11 blocks or more checkpointed.
    fits = (lambda c: c.micro_batch_size * (12 - c.checkpoint_blocks * 7 / 8) <= 16 * 12)
    assert kept_precision("bf16-true", space) == "16-mixed" and kept_precision("tf32", space) == "32-true"
    assert [(c.precision, c.micro_batch_size, c.grad_accum_steps, c.checkpoint_blocks)
            for c in translate([source], space, fits)] == [("16-mixed", 16, 4, 0), ("16-mixed", 64, 1, 11)]
    assert translate([source], space, lambda c: False) == ()  # nothing fits here: a cold start


def test_translation_follows_the_source_ranking_up_to_its_limit():
    space = _space()
    ranked = [space.config("bf16-true", 32), space.config("bf16-mixed", 32), space.config("32-true", 8)]
    out = translate(ranked, space, lambda c: c.micro_batch_size <= 16, limit=3)
    assert [c.precision for c in out] == ["bf16-true", "bf16-mixed", "32-true"]  # the ranking, one each
    assert all(c.micro_batch_size <= 16 for c in out)


def _reach(source: str, target: str, seeds: range, warm: bool) -> list[float]:
    out = []
    for seed in seeds:
        ranked = search(CARDS[source], seed, budget_s=240, anytime=True).ranked if warm else ()
        run = search(CARDS[target], seed, budget_s=240, anytime=True, warm_from=ranked)
        assert run.reach_s is not None, run  # both reach 0.95 of the optimum within the budget
        out.append(run.reach_s)
    return out


@pytest.mark.parametrize("source, target", [("h100-80g", "l4-24g"), ("l4-24g", "h100-80g")])
def test_a_warm_start_reaches_the_optimum_in_half_the_device_time(source, target):
    """Device seconds to 0.95 of the grid optimum on the target card (benchmarks/warm_start.py
    has the full table); without the warm start the two are the same search."""
    seeds = range(3)
    cold = statistics.median(_reach(source, target, seeds, warm=False))
    warm = statistics.median(_reach(source, target, seeds, warm=True))
    assert warm <= 0.5 * cold, (warm, cold)


@pytest.mark.slow
def test_the_service_starts_a_new_kind_from_the_first_kinds_experience(tmp_path):
    config = write_config(tmp_path, trials=3, metrics_address="off")
    write_spec(tmp_path / "models", model("alpha", precisions=["32-true", "bf16-mixed"]), "alpha.yaml")
    serve = Serve(config, write_inventory(tmp_path, H100))
    try:
        serve.wait_for("the first kind's profile", lambda s: ready(s, ("alpha", H100["name"])))
        write_inventory(tmp_path, H100, A100)
        serve.wait_for("the new kind's profile", lambda s: ready(s, ("alpha", A100["name"])))
        assert serve.terminate()[0] == 0
    finally:
        serve.kill()
    profiles = {p.name: Profile.load(p) for p in (tmp_path / "profiles").glob("*.yaml")}
    (first,) = [p for name, p in profiles.items() if "h100" in name]
    (second,) = [p for name, p in profiles.items() if "a100" in name]
    log = serve.log()  # said on failure: a warm start missing under load was seen once
    assert first.search.warm_start_from == "", log[-4000:]  # nothing to start from: cold
    assert second.search.warm_start_from == first.device.fingerprint, log[-4000:]
    assert f"warm start from {first.device.fingerprint}: measuring first" in log, log[-4000:]
    assert yaml.safe_load((tmp_path / "profiles" / next(n for n in profiles if "a100" in n)).read_text())[
        "search"]["warm_start_from"] == first.device.fingerprint



def test_translation_drops_checkpointing_the_new_card_does_not_need():
    space = _space()
    source = space.config("bf16-true", 16, checkpoint_blocks=6)  # a small card needed it
    out = translate([source], space, lambda c: c.micro_batch_size <= 64)  # this one fits all, unchecked
    assert [(c.micro_batch_size, c.checkpoint_blocks) for c in out] == [(64, 0), (16, 0)]
