"""The knob registry (`autofit.config.knobs`): one row per knob, everything else derived."""

import ast
import dataclasses
import importlib
import typing
from pathlib import Path

import pytest
from conftest import tiny_gpt_dict, write_spec

from autofit.base.errors import SpecError
from autofit.config.knobs import Axis, KNOBS, knob_table, ModelFact, Role, spec_knobs
from autofit.config.spec import load_spec, SearchSpec
from autofit.config.train_config import TrainConfig
from autofit.measure.messages import Analysis
from autofit.search.search_space import SearchSpace

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = Path("autofit/config/knobs.py")


def knob_lists(root: Path) -> list[str]:
    """Places under `root`/autofit, besides the registry, that write two or more knob names
    (fields or `search:` keys) in one literal: a tuple, list or set of names, a dict's keys,
    or a call's keywords. Each is a list someone must remember to extend."""
    names = {k.name for k in KNOBS.values()} | {k.choices for k in KNOBS.values()}
    out = []
    for path in sorted((root / "autofit").rglob("*.py")):
        if path.relative_to(root) == REGISTRY:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        # The training side's hook registry is keyed by knob name (config/ cannot import train/).
        hooks = {id(node.value) for node in ast.walk(tree)
                 if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["HOOKS"])
                 or (isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "HOOKS")}
        for node in ast.walk(tree):
            if id(node) in hooks:
                continue
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                # A name, or a pair that starts with one: (("compile", False), ...).
                firsts = (e.elts[0] if isinstance(e, ast.Tuple) and e.elts else e for e in node.elts)
                words = [e.value for e in firsts if isinstance(e, ast.Constant)]
            elif isinstance(node, ast.Dict):
                words = [k.value for k in node.keys if isinstance(k, ast.Constant)]
            elif isinstance(node, ast.Call):
                words = [k.arg for k in node.keywords]
            else:
                continue
            if len(named := [w for w in words if w in names]) >= 2:
                out.append(f"{path.relative_to(root)}:{node.lineno}: {', '.join(map(str, named))}")
    return out


def test_no_list_of_knob_names_outside_the_registry():
    assert knob_lists(ROOT) == []


def test_the_scan_finds_a_hand_written_list(tmp_path):
    # The check above can fail: a list of knob names anywhere else is found.
    (tmp_path / "autofit").mkdir()
    (tmp_path / "autofit" / "x.py").write_text('MEMORY = ("optimizer_bits", "chunked_loss")\n'
                                               'c = config.replace(compile=True, length_bucketing=False)\n'
                                               'DEFAULTS = (("compile", False), ("chunked_loss", False))\n'
                                               'HOOKS = {"compile": f, "chunked_loss": g}\n')
    assert [line.split(": ")[0] for line in knob_lists(tmp_path)] == ["autofit/x.py:1", "autofit/x.py:2",
                                                                      "autofit/x.py:3"]


def test_each_hook_is_a_registered_knob():
    from autofit.train.configure import HOOKS, KnobHook

    assert set(HOOKS) <= set(KNOBS)
    for name, hook in HOOKS.items():
        assert isinstance(hook, KnobHook)
        assert KNOBS[name].applied_by.startswith("autofit.train.configure:")


def test_the_typed_fields_name_what_exists():
    # A typo (needs="convolution", active_with="checkpoint_block") fails here, not on a CUDA device.
    analysis_fields = {f.name: f for f in dataclasses.fields(Analysis)}
    config_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for fact in ModelFact:
        assert analysis_fields[fact.value].type is bool, fact
    assert set(typing.get_args(Axis)) <= config_fields
    for k in KNOBS.values():
        assert isinstance(k.role, Role) and (k.needs is None or isinstance(k.needs, ModelFact)), k.name
        assert k.after is None or k.after in typing.get_args(Axis), k.name
        assert k.active_with is None or k.active_with in typing.get_args(Axis), k.name


def test_the_config_writes_out_the_registry_fields_in_its_order():
    # TrainConfig's knob fields are written by hand (for grep, editors and type checkers):
    # each is the row's name, type and default, placed after its `after` field, the others
    # at the end in registry order.
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    for k in KNOBS.values():
        if k.after is not None:
            assert names.index(k.name) == names.index(k.after) + 1, k.name
    tail = [k.name for k in KNOBS.values() if k.after is None]
    assert names[-len(tail):] == tail
    for name in set(names) - set(KNOBS):
        assert name not in {k.choices for k in KNOBS.values()}


def _runs_with(knob) -> dict:
    """A config's fields where every value of `knob` runs: its axis on, and a strategy its
    rules allow (FSDP2's offload policy needs FSDP2)."""
    base = {"micro_batch_size": 4, **({knob.active_with: 1} if knob.active_with else {})}
    if any(knob.refusal(v, "32-true", "none") for v in knob.values):
        base |= {"parallelism": "fsdp", "world_size": 2}
    return base


@pytest.mark.parametrize("name", list(KNOBS))
def test_each_knob_is_exported_as_its_row_says(name):
    # Every value away from the default reaches the env export (where the row names a
    # variable), the HF arguments and notes, and the Lightning notes the row declares.
    from autofit.profiles.export import hf_notes, lightning_notes, to_env, to_hf_training_args

    knob = KNOBS[name]
    base = _runs_with(knob)
    for value in knob.values[1:]:
        config = TrainConfig(**base, **{name: value})
        env = to_env(config)
        if knob.exports.env is not None:
            assert env[knob.exports.env] == knob.exports.env_value(value)
        assert set(env) - set(to_env(TrainConfig(**base))) <= {knob.exports.env}
        args = to_hf_training_args(config)
        for key, arg in knob.exports.hf_args.get(value, {}).items():
            assert args.get(key, args.get("train_sampling_strategy")) in (arg, "group_by_length"), key
        if knob.exports.hf_note is not None:
            assert len(hf_notes(config)) == len(hf_notes(TrainConfig(**base))) + 1
        if knob.exports.lightning_note is not None or knob.exports.model_setup:
            assert lightning_notes(config) != lightning_notes(TrainConfig(**base))


def test_the_allocator_variable_is_the_allocators():
    from autofit.device.alloc_conf import ALLOC_CONF_ENV, with_expandable_segments

    exports = KNOBS["expandable_segments"].exports
    assert (exports.env, exports.env_text[True]) == (ALLOC_CONF_ENV, with_expandable_segments(None, True))


def test_each_knob_is_a_field_of_the_config_the_spec_and_the_space():
    config_fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    spec_fields = {f.name: f for f in dataclasses.fields(SearchSpec)}
    space_fields = {f.name for f in dataclasses.fields(SearchSpace)}
    for k in KNOBS.values():
        assert config_fields[k.name].default == k.default and config_fields[k.name].type is k.type
        assert k.choices in space_fields
        assert (k.choices in spec_fields) == k.in_spec
        if k.in_spec:
            # () where the device decides (compile on CUDA), else the default alone.
            assert spec_fields[k.choices].default == (() if k.default_on else (k.default,))


@pytest.mark.parametrize("name", list(KNOBS))
def test_each_knob_names_its_apply_hook(name):
    module, _, attribute = KNOBS[name].applied_by.partition(":")
    target = importlib.import_module(module)
    for part in attribute.split("."):
        target = getattr(target, part)
    assert callable(target)


@pytest.mark.parametrize("name", list(KNOBS))
def test_each_knob_round_trips_and_is_left_out_at_its_default(name):
    knob = KNOBS[name]
    base = _runs_with(knob)
    assert name not in TrainConfig(**base).to_dict()
    for value in knob.values[1:]:
        config = TrainConfig(**base, **{name: value})
        assert config.to_dict()[name] == value
        assert TrainConfig.from_dict(config.to_dict()) == config
        assert knob.tags.get(value, "") in config.short()
    with pytest.raises(SpecError, match=f"{name}: must be {knob.allowed_text()}"):
        TrainConfig(**base, **{name: "no such value"})


@pytest.mark.parametrize("name", [k.name for k in KNOBS.values() if k.rules])
def test_each_rule_refuses_its_combination(name):
    for rule in KNOBS[name].rules:
        for precision in rule.precisions:
            with pytest.raises(SpecError, match=f"^{name}: "):
                TrainConfig(micro_batch_size=4, precision=precision, **{name: rule.value})
        for parallelism in rule.parallelisms:
            with pytest.raises(SpecError, match=f"^{name}: "):
                TrainConfig(micro_batch_size=4, grad_accum_steps=1, world_size=2, parallelism=parallelism,
                            **{name: rule.value})


def test_a_knob_acting_on_an_axis_is_reset_without_it():
    for k in KNOBS.values():
        if k.active_with:
            assert getattr(TrainConfig(micro_batch_size=4, **{k.active_with: 0, k.name: k.values[-1]}),
                           k.name) == k.default


@pytest.mark.parametrize("knob", spec_knobs(), ids=lambda k: k.name)
def test_each_spec_knob_is_read_from_the_search_section(knob, tmp_path):
    def spec_with(values):
        return write_spec(tmp_path, tiny_gpt_dict(search={"trials": 12, knob.choices: values}))

    spec = load_spec(spec_with(list(knob.values)))
    assert getattr(spec.search, knob.choices) == knob.values
    assert spec.to_dict()["search"][knob.choices] == list(knob.values)
    with pytest.raises(SpecError, match=f"search.{knob.choices}"):
        load_spec(spec_with(["no such value"]))


def test_the_docs_table_is_the_registry():
    assert knob_table() in (ROOT / "docs" / "design.md").read_text()


class _Recording:
    """A hook with every entry, recording what reached it (the shape an offload knob takes)."""

    def __init__(self):
        from autofit.train.configure import KnobHook

        class Hook(KnobHook):
            def model(hook, model, value):
                self.seen.append(("model", value))

            def optimizer(hook, optimizer, value):
                self.seen.append(("optimizer", value))
                return optimizer

            def batch(hook, batch, value):
                self.seen.append(("batch", batch["x"].dtype, value))
                return batch

        self.seen, self.hook = [], Hook()


def test_a_hook_sees_the_model_the_optimizer_and_each_micro_batch(monkeypatch):
    import torch

    from autofit.train import configure as knobs
    from autofit.train.training_plan import TrainingPlan

    recording = _Recording()
    monkeypatch.setitem(knobs.HOOKS, "length_bucketing", recording.hook)
    config = TrainConfig(micro_batch_size=2, precision="bf16-true", length_bucketing=True)
    plan = TrainingPlan(torch.nn.Linear(3, 1), config, lambda params: torch.optim.SGD(params, lr=0.1), device="cpu")
    plan.to_device({"x": torch.zeros(2, 3)})
    # The batch entry sees the micro batch as the step takes it: cast to the weights' dtype.
    assert recording.seen == [("model", True), ("optimizer", True), ("batch", torch.bfloat16, True)]
    recording.seen.clear()
    knobs.prepare_batch({"x": torch.zeros(2, 3)}, config.replace(length_bucketing=False), torch.float32,
                        torch.device("cpu"))
    assert recording.seen == []  # at its default a knob's entries are not called
