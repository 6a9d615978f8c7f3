"""Optimizers whose step cannot run on fake tensors: estimated from their state's layout,
never by running their kernels, and within 10% of the peak a CPU trial measures."""

import pytest
import torch

from autofit.config.spec import load_spec
from autofit.config.train_config import TrainConfig
from autofit.measure import fake_step
from autofit.measure import tasks
from autofit.measure.fake_step import estimate_memory
from autofit.train import optim, optim_state, runner
from autofit.train.optim_state import fill_state, register_state_layout, state_layout
from autofit.workload import build_workload
from conftest import tiny_gpt_dict, write_spec
from test_estimate import _tracked_peak

pytest.importorskip("bitsandbytes")
pytest.importorskip("optimi")

# Width 64: most matrices reach bitsandbytes' 4096-element floor for 8-bit state.
WIDE_GPT = {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 128, "seq_len": 16}


@pytest.fixture
def wide_spec(tmp_path):
    return load_spec(write_spec(tmp_path, tiny_gpt_dict(model={"builtin": "gpt", "args": WIDE_GPT})))


@pytest.fixture(autouse=True)
def fresh_estimates(monkeypatch):
    # The estimator memoises per process; these tests change what the optimizer is.
    monkeypatch.setattr(fake_step, "_cache", {})


def _state_shapes(optimizer) -> list[dict]:
    return [{k: (tuple(v.shape), v.dtype) for k, v in s.items() if isinstance(v, torch.Tensor)}
            for s in optimizer.state.values()]


def _params(dtype) -> list[torch.nn.Parameter]:
    # One under bitsandbytes' 4096-element floor, two over it, one not a multiple of its block.
    return [torch.nn.Parameter(torch.randn(*shape).to(dtype)) for shape in ((64, 80), (10,), (4097,), (3, 5))]


@pytest.fixture(autouse=True)
def no_lasting_bnb_overrides():
    # bitsandbytes keeps per-parameter overrides in a process-wide manager, keyed by id(p)
    # and by (group, index): one test's override must not reach another's parameters.
    import bitsandbytes
    manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
    saved = dict(manager.pid2config), dict(manager.index2config)
    yield
    manager.pid2config, manager.index2config = saved


def _bnb_with_a_32_bit_override(params):
    """GlobalOptimManager's per-parameter override (what users set for embeddings): that
    parameter's state is fp32, though the optimizer is 8-bit."""
    import bitsandbytes
    optimizer = bitsandbytes.optim.AdamW8bit(params)
    manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
    manager.override_config(params[0], "optim_bits", 32)
    return optimizer


@pytest.mark.parametrize("make, dtype", [
    (lambda ps: torch.optim.AdamW(ps, foreach=False), torch.float32),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), torch.float32),
    (lambda ps: __import__("optimi").AdamW(ps, lr=1e-3, kahan_sum=True, foreach=False), torch.bfloat16),
    (lambda ps: __import__("bitsandbytes").optim.AdamW8bit(ps), torch.float32),
    # The 5120-element matrix keeps fp32 moments under this floor, as the library's args say.
    (lambda ps: __import__("bitsandbytes").optim.AdamW8bit(ps, min_8bit_size=8192), torch.float32),
    (lambda ps: _bnb_with_a_32_bit_override(ps), torch.float32),
], ids=["torch-adamw", "torch-sgd", "optimi-adamw-kahan", "bnb-adamw8bit", "bnb-adamw8bit-min-size",
        "bnb-adamw8bit-32bit-override"])
def test_the_layout_is_the_state_the_real_step_creates(make, dtype):
    real, standin = make(_params(dtype)), make(_params(dtype))
    for opt in (real, standin):
        for g in opt.param_groups:
            for p in g["params"]:
                p.grad = torch.ones_like(p)
    real.step()
    fill_state(standin, state_layout(standin))
    assert _state_shapes(standin) == _state_shapes(real)
    shared = [id(s["qmap1"]) for s in standin.state.values() if "qmap1" in s]
    assert len(set(shared)) <= 1  # bitsandbytes' maps: one pair for all tensors, as the library keeps them


def _within(predicted: int, measured: int, rel: float = 0.10) -> None:
    print(f"\npredicted {predicted:,} measured {measured:,} ({predicted / measured - 1:+.2%})")
    assert abs(predicted / measured - 1) < rel


def test_triton_kahan_adamw_is_estimated_from_its_layout_without_running_it(wide_spec, monkeypatch, one_thread):
    """On a CUDA box optimi's bf16-true AdamW runs Triton kernels on raw pointers: under fake
    tensors an illegal memory access. Its kernel must never be called; the state comes from
    the layout. (Before: the estimate ran the Triton step and failed.)"""
    monkeypatch.setattr(optim, "triton_available", lambda: True)
    monkeypatch.setattr(__import__("optimi").optimizer, "HAS_TRITON", True)  # this CPU box has no Triton
    called = []
    monkeypatch.setattr(__import__("optimi").AdamW, "step", lambda self, *a, **k: called.append(1))
    config = TrainConfig(precision="bf16-true", micro_batch_size=8)
    e = estimate_memory(wide_spec, config, device_kind="cuda")
    assert not called
    assert "optimi.AdamW/triton+kahan" in e.note and "documented layout" in e.note
    # Two bf16 moments and the bf16 Kahan buffer: 6 bytes per parameter.
    assert e.optimizer_bytes == 6 * e.trainable_parameters
    monkeypatch.undo()  # the CPU trial runs optimi's own per-parameter step
    _within(e.peak_bytes, _tracked_peak(wide_spec, config))


def test_8bit_adamw_on_cuda_is_estimated_from_its_layout(wide_spec, one_thread):
    config = TrainConfig(micro_batch_size=8, optimizer_bits=8)
    on_cuda = estimate_memory(wide_spec, config, device_kind="cuda")
    on_cpu = estimate_memory(wide_spec, config, device_kind="cpu")  # bitsandbytes' own CPU step, on fake tensors
    assert "bitsandbytes.AdamW8bit" in on_cuda.note and not on_cpu.note
    assert on_cuda.optimizer_bytes == on_cpu.optimizer_bytes
    _within(on_cuda.peak_bytes, _tracked_peak(wide_spec, config))


# An op with a real kernel and no fake implementation, as a user's extension op may be.
@torch.library.custom_op("autofit_test::momentum_update", mutates_args=())
def momentum_update(grad: torch.Tensor, buf: torch.Tensor, momentum: float) -> torch.Tensor:
    return buf * momentum + grad


class OpaqueSGD(torch.optim.Optimizer):
    """SGD with momentum whose update is that op: its state is made in Python, its step's
    arithmetic cannot run on fake tensors."""

    def __init__(self, params, lr=0.01, momentum=0.9):
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = torch.zeros_like(p)
                state["buf"].copy_(torch.ops.autofit_test.momentum_update(p.grad, state["buf"], group["momentum"]))
                p.add_(state["buf"], alpha=-group["lr"])


@pytest.fixture
def opaque_optimizer(monkeypatch):
    def build(spec, params, *, config, device, user=None):
        return OpaqueSGD(params, lr=spec.lr)

    monkeypatch.setattr(fake_step, "build_optimizer", build)
    monkeypatch.setattr(runner, "build_optimizer", build)


def test_an_op_without_a_fake_implementation_fails_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), pytest.raises(RuntimeError, match="no fake impl"):
        torch.ops.autofit_test.momentum_update(torch.ones(3), torch.ones(3), 0.9)


def test_an_optimizer_whose_step_has_no_fake_kernel_is_estimated(wide_spec, opaque_optimizer, one_thread):
    """Its step raises on fake tensors after it made its first parameter's state; the rest is
    made alike, and the estimate holds. (Before: EstimateError, the config measured blind.)"""
    config = TrainConfig(micro_batch_size=8)
    e = estimate_memory(wide_spec, config)
    assert "OpaqueSGD" in e.note and "before it raised" in e.note and "no fake impl" in e.note
    assert e.optimizer_bytes == 4 * e.trainable_parameters  # one fp32 buffer per parameter
    _within(e.peak_bytes, _tracked_peak(wide_spec, config))


def test_a_registered_layout_is_used_when_the_step_fails(wide_spec, opaque_optimizer, monkeypatch, one_thread):
    """The plug for a user's optimizer: a function of the parameter's state bytes."""
    monkeypatch.setitem(optim_state.LAYOUTS, "test_estimate_unfakeable.OpaqueSGD", None)
    register_state_layout("test_estimate_unfakeable.OpaqueSGD", lambda opt, group, p: {"buf": 4 * p.numel()})
    e = estimate_memory(wide_spec, TrainConfig(micro_batch_size=8))
    assert "documented layout" in e.note
    assert e.optimizer_bytes >= 4 * e.trainable_parameters


def test_a_users_optimizer_whose_wrapped_step_meets_fake_tensors_limit_is_estimated(wide_spec, opaque_optimizer,
                                                                                     monkeypatch, one_thread):
    """A user's optimizer runs behind autofit's wrapper, which reports its errors as
    UserCodeError: fake tensors' own limit under it is still handled, a bug of theirs is not."""
    from autofit.base.errors import UserCodeError

    step = OpaqueSGD.step

    def wrapped(self):
        try:
            return step(self)
        except Exception as exc:
            raise UserCodeError(f"optimizer.python: raised {exc}") from exc

    monkeypatch.setattr(OpaqueSGD, "step", wrapped)
    assert "before it raised" in estimate_memory(wide_spec, TrainConfig(micro_batch_size=8)).note

    def buggy(self):
        raise UserCodeError("optimizer.python: raised KeyError") from KeyError("lr")

    monkeypatch.setattr(OpaqueSGD, "step", buggy)
    with pytest.raises(UserCodeError):
        estimate_memory(wide_spec, TrainConfig(micro_batch_size=4, grad_accum_steps=2))


def test_one_failed_estimate_does_not_poison_the_next(wide_spec, opaque_optimizer, monkeypatch):
    """A step whose state cannot be inferred (it raised before making any) is an EstimateError;
    the next estimate, with a working optimizer, is unaffected."""
    def broken_step(self):
        raise RuntimeError("There was no fake impl registered")

    monkeypatch.setattr(OpaqueSGD, "step", broken_step)
    with pytest.raises(fake_step.EstimateError, match="cannot run on fake tensors"):
        estimate_memory(wide_spec, TrainConfig(micro_batch_size=8))
    monkeypatch.undo()
    assert estimate_memory(wide_spec, TrainConfig(micro_batch_size=8)).note == ""


def test_a_cuda_error_ends_the_estimator_child_after_its_answer(wide_spec, monkeypatch):
    monkeypatch.setattr(fake_step, "_cuda_poisoned", False)
    fake_step._note_cuda_error(RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"))
    assert fake_step.cuda_poisoned()
    answer = tasks.estimate({"config": TrainConfig(micro_batch_size=8).to_dict(), "device_kind": "cpu"},
                            {"spec": wide_spec, "workload": build_workload(wide_spec)})
    assert answer["status"] == "ok" and answer["end_child"] is True


# Width 16, vocabulary 8192: the head's fp32 logits, their log-softmax and their gradient
# ([tokens, vocabulary] each) are most of the peak.
LOGITS_GPT = {"n_layer": 1, "n_head": 2, "n_embd": 16, "vocab_size": 8192, "seq_len": 32}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_peak_made_of_the_heads_fp32_logits_is_predicted_within_10_percent(tmp_path, precision, one_thread):
    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict(model={"builtin": "gpt", "args": LOGITS_GPT})))
    config = TrainConfig(precision=precision, micro_batch_size=8)
    fp32_logits_bytes = 8 * LOGITS_GPT["seq_len"] * LOGITS_GPT["vocab_size"] * 4
    e, measured = estimate_memory(spec, config), _tracked_peak(spec, config)
    assert 3 * fp32_logits_bytes > 0.8 * measured  # logits, log-softmax, gradient: most of the peak
    _within(e.peak_bytes, measured)


def test_the_fake_step_sees_autocasts_weight_cast_cache():
    """A weight used three times under autocast is cast to 16 bits once and the copy held for
    the forward: the cache CUDA autocast keeps, made by the CPU's under the same rule, and so
    counted by the estimator's tracker without a model of its own."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autofit.device.memory import LiveBytesTracker

    mode = FakeTensorMode()
    with mode:
        linear, x = torch.nn.Linear(1024, 1024, bias=False), torch.randn(4, 1024)
    tracker = LiveBytesTracker(record=True)
    with mode, tracker, torch.autocast("cpu", dtype=torch.bfloat16):
        linear(linear(linear(x)))
    weight_casts = [n for _, n in tracker.events if n == 1024 * 1024 * 2]
    assert len(weight_casts) == 1
