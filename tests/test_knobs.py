"""Knobs change memory and speed, not math: accumulation, checkpointing and freezing."""

import pytest
import torch

from autofit.config.train_config import TrainConfig, with_overrides
from autofit.train.configure import apply_checkpointing, find_block_stack, spread_indices
from autofit.base.errors import SpecError
from autofit.train.runner import Runner
from autofit.config.spec import parse_spec
from autofit.workload import build_workload
from conftest import REPO, tiny_gpt_dict


def make_runner(config: TrainConfig, **sections) -> Runner:
    spec = parse_spec(tiny_gpt_dict(**sections), source_dir=REPO)
    return Runner(spec, build_workload(spec), config, device=torch.device("cpu"))


def grads_of_first_step(runner: Runner) -> dict[str, torch.Tensor]:
    """The gradients the optimizer sees at step 0, captured by a step pre-hook."""
    captured = {}
    names = {id(p): n.replace("._checkpoint_wrapped_module", "") for n, p in runner.model.named_parameters()}

    def hook(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                captured[names[id(p)]] = p.grad.detach().clone()

    runner.optimizer.register_step_pre_hook(hook)
    runner.step(runner.global_batch(0))
    return captured


def assert_same_grads(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


def test_accumulation_is_exact():
    one = grads_of_first_step(make_runner(TrainConfig(micro_batch_size=8, grad_accum_steps=1)))
    four = grads_of_first_step(make_runner(TrainConfig(micro_batch_size=2, grad_accum_steps=4)))
    assert_same_grads(one, four, atol=1e-5)


def saved_activation_bytes(runner: Runner) -> int:
    """Bytes autograd keeps for backward during one forward (unique storages)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        runner.workload.loss_fn(runner.model, runner.global_batch(0)[0])
    return sum(storages.values())


def test_checkpointing_changes_memory_not_math():
    plain = make_runner(TrainConfig(micro_batch_size=8))
    ckpt = make_runner(TrainConfig(micro_batch_size=8, checkpoint_blocks=2))
    assert saved_activation_bytes(ckpt) < 0.6 * saved_activation_bytes(plain)
    assert_same_grads(grads_of_first_step(plain), grads_of_first_step(ckpt), atol=1e-6)


def test_checkpoint_wrapper_keeps_state_dict_keys():
    """The one private torch API we use: fails loudly if torch changes it."""
    runner = make_runner(TrainConfig(micro_batch_size=8))
    keys = set(runner.model.state_dict())
    apply_checkpointing(runner.model, 2)
    assert set(runner.model.state_dict()) == keys
    assert type(runner.model.blocks[0]).__name__ == "CheckpointWrapper"


def test_freezing_embeddings_and_first_blocks():
    runner = make_runner(TrainConfig(micro_batch_size=8, freeze_blocks=1))
    model = runner.model
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith(("tok_emb", "pos_emb", "wte", "wpe", "blocks.0.")) for n in frozen), frozen
    assert any(n.startswith("blocks.1.") for n, p in model.named_parameters() if p.requires_grad)
    in_optimizer = {id(p) for g in runner.optimizer.param_groups for p in g["params"]}
    assert all(id(p) not in in_optimizer for p in model.parameters() if not p.requires_grad)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    runner.step(runner.global_batch(0))
    for name, p in model.named_parameters():
        assert p.grad is None
        changed = not torch.equal(before[name], p.detach())
        assert changed == p.requires_grad, name


def test_block_stack_discovery_and_errors():
    runner = make_runner(TrainConfig(micro_batch_size=8))
    name, stack = find_block_stack(runner.model)
    assert name == "blocks" and len(stack) == 2
    no_stack = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert find_block_stack(no_stack) is None
    with pytest.raises(SpecError, match="no block stack"):
        apply_checkpointing(no_stack, 1)
    with pytest.raises(SpecError, match="has 2 blocks"):
        apply_checkpointing(runner.model, 3)
    assert spread_indices(12, 4) == [0, 3, 6, 9] and spread_indices(12, 12) == list(range(12))


def test_checkpointing_spreads_over_the_trainable_blocks_only():
    """Frozen blocks keep no activations: checkpointing goes to the blocks after them."""
    assert spread_indices(12, 4, first=4) == [4, 6, 8, 10]
    runner = make_runner(TrainConfig(micro_batch_size=8, freeze_blocks=1, checkpoint_blocks=1))
    assert [type(b).__name__ for b in runner.model.blocks] == ["GPTBlock", "CheckpointWrapper"]
    with pytest.raises(SpecError, match="1 blocks after the 1 frozen"):
        make_runner(TrainConfig(micro_batch_size=8, freeze_blocks=1, checkpoint_blocks=2))


def test_overrides_keep_the_global_batch():
    base = TrainConfig(micro_batch_size=8)
    assert with_overrides(base, {"micro_batch_size": "2"}, global_batch_size=8).grad_accum_steps == 4
    assert with_overrides(base, {"grad_accum_steps": "4"}, global_batch_size=8).micro_batch_size == 2
    with pytest.raises(SpecError, match="must divide"):
        with_overrides(base, {"micro_batch_size": "3"}, global_batch_size=8)
    with pytest.raises(SpecError, match="unknown key"):
        with_overrides(base, {"batch": "3"}, global_batch_size=8)
    with pytest.raises(SpecError, match="precision"):
        with_overrides(base, {"precision": "fp8"}, global_batch_size=8)


@pytest.mark.parametrize("cls,config,stack", [
    ("GPT2LMHeadModel", {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 32}, "transformer.h"),
    ("BertForMaskedLM", {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
                         "intermediate_size": 64, "vocab_size": 128, "max_position_embeddings": 32}, "bert.encoder.layer"),
])
def test_hf_models_train_a_step_with_checkpointing_and_freezing(cls, config, stack):
    pytest.importorskip("transformers")
    spec_dict = tiny_gpt_dict()
    spec_dict["model"] = {"hf": {"class": cls, "config": config}}
    spec_dict["data"] = {"kind": "synthetic", "seq_len": 16}
    spec = parse_spec(spec_dict, source_dir=REPO)
    runner = Runner(spec, build_workload(spec), TrainConfig(micro_batch_size=4, grad_accum_steps=2,
                    checkpoint_blocks=1, freeze_blocks=1), device=torch.device("cpu"))
    assert find_block_stack(runner.model)[0] == stack
    assert any(not p.requires_grad for p in runner.model.parameters())
    result = runner.step(runner.global_batch(0))
    assert torch.isfinite(result.loss)


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops dispatched while active, by name."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def ops_in_backward(runner: Runner) -> dict[str, int]:
    loss = runner.workload.loss_fn(runner.model, runner.global_batch(0)[0])
    with _OpCounter() as counter:
        loss.backward()
    return counter.counts


def test_selective_checkpointing_keeps_matmul_outputs_and_recomputes_the_rest():
    """The named policy: backward recomputes a selective block's layer norms and GELU but
    none of its matmuls or its attention; a full block recomputes them all. Gradients are
    the plain step's."""
    from autofit.train.configure import save_matmul_attention

    aten = torch.ops.aten
    assert save_matmul_attention(None, aten.mm.default).name == "MUST_SAVE"
    assert save_matmul_attention(None, aten._scaled_dot_product_flash_attention_for_cpu.default).name == "MUST_SAVE"
    assert save_matmul_attention(None, aten.convolution.default).name == "MUST_SAVE"
    assert save_matmul_attention(None, aten.gelu.default).name == "PREFER_RECOMPUTE"

    plain = make_runner(TrainConfig(micro_batch_size=8))
    full = make_runner(TrainConfig(micro_batch_size=8, checkpoint_blocks=2))
    selective = make_runner(TrainConfig(micro_batch_size=8, checkpoint_blocks=2, checkpoint_policy="selective"))
    attention = "_scaled_dot_product_flash_attention_for_cpu"
    base, full_ops, sel_ops = (ops_in_backward(r) for r in (plain, full, selective))
    # Forward ops that run again in backward: 2 blocks x (LayerNorm x 2, GELU, attention, 4 linears).
    assert full_ops[attention] == base.get(attention, 0) + 2
    assert full_ops["native_layer_norm"] == base.get("native_layer_norm", 0) + 4
    assert sel_ops.get(attention, 0) == base.get(attention, 0)
    assert sel_ops.get("addmm", 0) == base.get("addmm", 0) and sel_ops.get("mm") == base.get("mm")
    assert sel_ops["native_layer_norm"] == full_ops["native_layer_norm"]
    assert sel_ops["gelu"] == full_ops["gelu"] == base.get("gelu", 0) + 2
    # (What each keeps in memory: tests/test_estimate.py, with the tracker; the selective
    # cache holds its outputs outside autograd's saved-tensor hooks.)
    assert_same_grads(grads_of_first_step(plain), grads_of_first_step(selective), atol=1e-6)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_selective_checkpointing_under_autocast_matches_the_plain_step(precision):
    plain = make_runner(TrainConfig(precision=precision, micro_batch_size=4, grad_accum_steps=2))
    selective = make_runner(TrainConfig(precision=precision, micro_batch_size=4, grad_accum_steps=2,
                                        checkpoint_blocks=1, checkpoint_policy="selective"))
    # The recomputed ops see the same inputs in the same dtype: equal to bf16 rounding.
    assert_same_grads(grads_of_first_step(plain), grads_of_first_step(selective), atol=1e-3)


def test_checkpoint_policy_is_a_config_knob():
    base = TrainConfig(micro_batch_size=8)
    sel = with_overrides(base, {"checkpoint_blocks": "2", "checkpoint_policy": "selective"}, global_batch_size=8)
    assert sel.checkpoint_policy == "selective" and sel.to_dict()["checkpoint_policy"] == "selective"
    assert TrainConfig.from_dict(sel.to_dict()) == sel and "sel" in sel.short()
    # With no block checkpointed the policy is inert: one config, and profiles without it load.
    assert base.replace(checkpoint_policy="selective") == base
    assert "checkpoint_policy" not in base.to_dict()
    with pytest.raises(SpecError, match="checkpoint_policy: must be one of full, selective"):
        with_overrides(base, {"checkpoint_blocks": "1", "checkpoint_policy": "some"}, global_batch_size=8)


@pytest.fixture
def aot_eager(monkeypatch):
    """Compile with aot_eager: the same Dynamo graphs, AOT autograd and checkpoint capture
    as inductor, without generating C++ (tens of seconds per graph on a shared CPU). Trial
    children inherit the variable."""
    monkeypatch.setenv("AUTOFIT_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_blocks_keep_keys_and_gradients(aot_eager):
    from autofit.train.configure import compile_count

    config = TrainConfig(micro_batch_size=4, grad_accum_steps=2, checkpoint_blocks=1, checkpoint_policy="selective")
    plain, compiled = make_runner(config), make_runner(config.replace(compile=True))
    assert set(compiled.model.state_dict()) == set(plain.model.state_dict())
    before = compile_count()
    assert_same_grads(grads_of_first_step(plain), grads_of_first_step(compiled), atol=1e-5)
    # torch's compile counters (a private structure): the step compiled the block graph.
    assert compile_count() > before
    steady = compile_count()
    compiled.step(compiled.global_batch(1))
    assert compile_count() == steady  # the next step runs what was compiled


@pytest.mark.slow  # inductor generates and builds C++ for the block's forward and backward: 20-60 s here
def test_inductor_compiled_step_matches_the_plain_step():
    torch._dynamo.reset()
    config = TrainConfig(micro_batch_size=8)
    plain, compiled = make_runner(config), make_runner(config.replace(compile=True))
    # Inductor fuses and reorders fp32 reductions: equal to float rounding, not bit for bit.
    assert_same_grads(grads_of_first_step(plain), grads_of_first_step(compiled), atol=1e-4)
