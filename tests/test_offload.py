"""Offloading (`autofit.train.offload`): which blocks save to the host, that the update is
the same, what the estimator's host counter keeps against what save_on_cpu really keeps,
and the optimizer's CPU offload wired through torchao."""

import contextlib
import sys

import pytest
import torch

from autofit.config.train_config import TrainConfig
from autofit.device.memory import LiveBytesTracker
from autofit.train import offload
from autofit.train.configure import apply_config, apply_optimizer_hooks
from autofit.train.optim import OptimizerMissingError
from autofit.workload.zoo import gpt

ARGS = {"n_layer": 4, "n_embd": 16, "n_head": 2, "vocab_size": 32, "seq_len": 8}


def _model():
    torch.manual_seed(0)
    return gpt(ARGS)


def _tokens():
    return torch.randint(0, ARGS["vocab_size"], (2, ARGS["seq_len"]), generator=torch.Generator().manual_seed(1))


def _loss(model, tokens):
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def test_the_blocks_not_checkpointed_and_only_those_save_to_the_host(monkeypatch):
    model = apply_config(_model(), TrainConfig(micro_batch_size=2, checkpoint_blocks=2, offload_activations=True))
    # checkpoint_blocks=2 of 4 spreads over blocks 0 and 2: the other two are offloaded.
    assert offload.offloaded_blocks(model) == [1, 3]
    entered = []

    @contextlib.contextmanager
    def recording(pin_memory):
        entered.append(pin_memory)
        yield

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", recording)
    _loss(model, _tokens())
    assert entered == [torch.cuda.is_available()] * 2  # once per offloaded block per forward


def test_frozen_blocks_are_not_offloaded_and_the_default_offloads_nothing():
    model = apply_config(_model(), TrainConfig(micro_batch_size=2, freeze_blocks=1, offload_activations=True))
    assert offload.offloaded_blocks(model) == [1, 2, 3]
    assert offload.offloaded_blocks(apply_config(_model(), TrainConfig(micro_batch_size=2))) == []


def test_offloaded_gradients_equal_the_plain_ones():
    grads = []
    for config in (TrainConfig(micro_batch_size=2, checkpoint_blocks=1),
                   TrainConfig(micro_batch_size=2, checkpoint_blocks=1, offload_activations=True)):
        model = apply_config(_model(), config)
        _loss(model, _tokens()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=0, msg=name)


def _bytes_after_forward(model, saving) -> int:
    tracker = LiveBytesTracker()
    tokens = _tokens()
    with tracker, saving:
        loss = _loss(model, tokens)
        live_bytes = tracker.live_bytes
    loss.backward()  # the saved tensors come back
    return live_bytes


def test_the_host_counter_moves_off_the_device_what_the_saved_activations_hold_there():
    """The tracker measures, on the CPU, the bytes a forward leaves alive for backward. Under
    the counter (the estimator's stand-in for save_on_cpu) the saved activations leave the
    device; the host holds a copy of each saved tensor (save_on_cpu copies each one, views
    and weights too), so at least what the device sheds. On the CPU itself save_on_cpu is
    inert (`tensor.cpu()` of a CPU tensor is that tensor): the plain bytes, measured."""
    model = apply_config(_model(), TrainConfig(micro_batch_size=2, offload_activations=True))
    on_cpu = _bytes_after_forward(model, contextlib.nullcontext())  # the real save_on_cpu
    counter = offload.HostCounter(pinned=False)
    counted = _bytes_after_forward(model, counter.counting())
    plain = _bytes_after_forward(apply_config(_model(), TrainConfig(micro_batch_size=2)), contextlib.nullcontext())
    assert on_cpu == plain
    shed_bytes = plain - counted
    assert shed_bytes > 0 and counter.live_bytes == 0  # and every saved tensor came back
    assert counter.peak_bytes >= shed_bytes


def test_pinned_host_blocks_round_up_to_a_power_of_two():
    counter = offload.HostCounter(pinned=True)
    counter._pack(torch.empty(3, dtype=torch.float32))  # 12 bytes -> a 16-byte pinned block
    assert counter.peak_bytes == 16


class _FakeOffloadOptimizer:
    def __init__(self, params, optimizer_class, **kwargs):
        self.groups, self.optimizer_class, self.kwargs = list(params), optimizer_class, kwargs

    def step(self, closure=None):
        pass


def test_the_optimizer_hook_hands_torchao_the_built_optimizers_groups(monkeypatch):
    torchao_optim = pytest.importorskip("torchao.optim")
    monkeypatch.setattr(torchao_optim, "CPUOffloadOptimizer", _FakeOffloadOptimizer)
    model = _model()
    built = torch.optim.AdamW([{"params": [model.wte.weight], "weight_decay": 0.1},
                               {"params": [model.ln_f.weight], "weight_decay": 0.0}], lr=3e-4, fused=False)
    built.param_groups[0]["triton"] = True  # optimi's switch on CUDA (bf16-true): the CPU step has none
    wrapped = apply_optimizer_hooks(built, TrainConfig(micro_batch_size=2, offload_optimizer=True))
    assert isinstance(wrapped, _FakeOffloadOptimizer) and wrapped.optimizer_class is torch.optim.AdamW
    assert type(wrapped).step is not _FakeOffloadOptimizer.step  # the step copies the clipped gradients
    assert [g["params"] for g in wrapped.groups] == [[model.wte.weight], [model.ln_f.weight]]
    assert [(g["weight_decay"], g["lr"]) for g in wrapped.groups] == [(0.1, 3e-4), (0.0, 3e-4)]
    assert not any({"fused", "foreach", "triton"} & set(g) for g in wrapped.groups)  # the CPU step picks its own
    assert apply_optimizer_hooks(built, TrainConfig(micro_batch_size=2)) is built


def test_without_torchao_the_optimizer_offload_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # import fails as if not installed
    built = torch.optim.AdamW(_model().parameters())
    with pytest.raises(OptimizerMissingError, match=r"offload_optimizer needs torchao: pip install"):
        apply_optimizer_hooks(built, TrainConfig(micro_batch_size=2, offload_optimizer=True))


# --- where the offload knobs are searched ----------------------------------------------------

import dataclasses  # noqa: E402

from autofit.config.spec import parse_spec  # noqa: E402
from autofit.device.probe import cpu_device  # noqa: E402
from autofit.measure.messages import Analysis  # noqa: E402
from autofit.tuning.space import search_space  # noqa: E402
from conftest import REPO, tiny_gpt_dict  # noqa: E402

PLAIN_LM = Analysis(n_blocks=2, micro_batch_floor=None, chunkable=True, bucketing=False, data_assumptions={},
                    large_vocab_head=False, convolutional=False)


def _cuda():
    """A CUDA card as the probe reports one: the seam that drives the CUDA defaults here."""
    return dataclasses.replace(cpu_device(), kind="cuda", compute_capability=(9, 0), driver_version="580")


def _space(device, search=None, nproc=1):
    spec = parse_spec(tiny_gpt_dict(search={**tiny_gpt_dict()["search"], **(search or {})}), source_dir=REPO)
    return search_space(spec, device, nproc=nproc, analysis=PLAIN_LM)


def test_on_cuda_offloading_is_a_lean_seed_group_not_a_refinement_and_on_the_cpu_inert():
    cuda = _space(_cuda())
    assert cuda.offload_activations == cuda.offload_optimizer == (False, True)
    assert not {"offload_activations", "offload_optimizer", "fsdp_offload"} & set(cuda.refined)
    lean = cuda.lean("bf16-mixed")
    assert lean["offload_activations"] is lean["offload_optimizer"] is True
    assert "fsdp_offload" not in lean  # FSDP2's policy: not in one process
    cpu = _space(cpu_device(), {"offload_activations": [False, True]})
    assert cpu.offload_activations == cpu.offload_optimizer == (False,)
    assert _space(_cuda(), {"offload_optimizer": [False]}).offload_optimizer == (False,)



def test_the_torchao_internals_the_step_time_copy_uses_are_there():
    """Loud when torchao changes them: the subclass re-copies each queued gradient at step time
    through the optimizer's own stream, map and queue (`offload._stepped_after_clipping`)."""
    import inspect

    torchao_optim = pytest.importorskip("torchao.optim")
    source = inspect.getsource(torchao_optim.CPUOffloadOptimizer)
    for name in ("self.queue", "self.param_d2h_map", "self.stream", "self.device", "p_host.grad.copy_"):
        assert name in source, name
