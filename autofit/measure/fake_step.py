"""Peak memory of a `TrainConfig` without running it and without a GPU.

    autofit estimate examples/tiny-gpt.yaml --set precision=bf16-true --memory-budget 24GiB --json

The real `Runner` (same model, knobs, precision policy, optimizer, step) runs two optimizer
steps on fake tensors: `FakeTensorMode` gives every tensor a shape, dtype and device but no
storage, so a 7B-parameter model costs kilobytes and seconds. `LiveBytesTracker`, the CPU
trials' memory meter, counts the bytes those tensors would hold. Two steps, because the
optimizer state exists only from the first `optimizer.step()` on. Known blind spots and how
the search corrects them: docs/estimator.md.
"""

import contextlib
import dataclasses
import functools
from dataclasses import dataclass

import torch
from loguru import logger
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._pytree import tree_leaves

from autofit.base.errors import AutofitError, UserCodeError
from autofit.config.knobs import coherent, DEVICE_KINDS
from autofit.config.spec import divisors, ModelSpec
from autofit.config.train_config import check_global_batch, TrainConfig
from autofit.device.allocator import replay, workspace_events
from autofit.device.memory import LiveBytesTracker
from autofit.device.support import same_tensors
from autofit.workload import build_workload, Workload
from autofit.train.distributed import DEVICE_BUILD_SHARE
from autofit.train.configure import apply_optimizer_hooks, trainable_parameters
from autofit.train.offload import HostCounter
from autofit.train.optim import build_optimizer, implementation
from autofit.train.optim_state import fill_state, inferred_layout, state_layout, unfakeable_reason
from autofit.train.runner import fp32_bytes, Runner
from autofit.train.user_optim import count_state, CountedState, OptimizerStateError
from autofit.measure.cuda_attention import CudaAttention
from autofit.measure.fake_kernels import FakeKernels
from autofit.measure.rank_memory import per_rank
from autofit.measure.memory_estimate import EstimateError, MemoryEstimate
from autofit.measure.host_estimate import host_counter, host_split, traced

ESTIMATED_STEPS = 2  # optimizer state exists from the first optimizer.step() on
# Memory is the same for every micro batch after the second: the first allocates the
# gradients, the second adds to them. Simulating two keeps long accumulations cheap.
_MICRO_BATCHES = 2


def estimate_memory(spec: ModelSpec, config: TrainConfig, *, device_kind: str = "cpu",
                    workload: Workload | None = None, compute_capability: str | None = None,
                    capacity_bytes: int | None = None) -> MemoryEstimate:
    """Peak bytes of training `spec` with `config`, on a device of kind `device_kind`.

    "cpu" predicts what a CPU trial tracks, model construction included. "cuda" counts the
    construction as the runner does it there (`distributed.build_device`: built on the card in
    fp32, then cast one tensor at a time, where the fp32 weights take at most half of
    `capacity_bytes`; else arriving from the host in their dtype), uses the fused optimizer
    the runner picks on CUDA, and adds the card's allocated and reserved peaks (caching
    allocator, cuBLAS workspaces sized for `compute_capability`, default Hopper's);
    `capacity_bytes` (the allocator's cap) replays reserved under it, with PyTorch's retry,
    for `fit_bytes`. `workload`: built already (default: built here).
    """
    if device_kind not in DEVICE_KINDS:
        raise ValueError(f"device_kind: one of {', '.join(DEVICE_KINDS)}, got {device_kind!r}")
    check_global_batch(config, spec.train.global_batch_size)
    return _estimate(spec, workload or build_workload(spec), config, device_kind, compute_capability, capacity_bytes)


def max_micro_batch_size(spec: ModelSpec, config: TrainConfig, budget_bytes: int, *,
                         device_kind: str = "cpu", workload: Workload | None = None,
                         compute_capability: str | None = None) -> int | None:
    """Largest divisor of the global batch whose estimated peak fits `budget_bytes`, with
    `config`'s precision, checkpointing and freezing (accumulation follows); None when even
    a micro batch of 1 does not fit. Memory grows with the micro batch, so a binary search
    over the divisors finds the boundary."""
    if device_kind not in DEVICE_KINDS:
        raise ValueError(f"device_kind: one of {', '.join(DEVICE_KINDS)}, got {device_kind!r}")
    workload = workload or build_workload(spec)
    rank_batch = spec.train.global_batch_size // config.world_size  # each rank's share
    sizes = divisors(rank_batch)

    def fits(micro: int) -> bool:
        trial = config.replace(micro_batch_size=micro, grad_accum_steps=rank_batch // micro)
        return _estimate(spec, workload, trial, device_kind, compute_capability, budget_bytes).fit_bytes <= budget_bytes

    lo, hi = 0, len(sizes) - 1  # invariant: everything below lo fits, everything above hi does not
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(sizes[mid]):
            lo = mid + 1
        else:
            hi = mid - 1
    return sizes[hi] if hi >= 0 else None


_CACHE_SIZE = 512
_cache: dict[tuple, MemoryEstimate] = {}


def _estimate(spec: ModelSpec, workload: Workload, config: TrainConfig, device_kind: str,
              compute_capability: str | None = None, capacity_bytes: int | None = None) -> MemoryEstimate:
    """Memoised in this process: the search, `max_micro_batch_size` and the CLI ask for the
    same configurations again, and each answer costs a fake training step (~0.5 s)."""
    # Precisions that hold tensors of the same sizes have one estimate (bf16-mixed's is fp16's).
    same = same_tensors(config.precision)
    if coherent(config.to_dict() | {"precision": same}):  # not where a knob refuses it (offload_optimizer: 16-mixed)
        config = config.replace(precision=same)
    if device_kind != "cuda" or config.world_size > 1:
        capacity_bytes = None  # no caching allocator replayed: the cap changes nothing
    key = (spec.spec_hash, str(spec.source_dir), config, device_kind, compute_capability, capacity_bytes)
    if key not in _cache:
        if len(_cache) >= _CACHE_SIZE:
            _cache.pop(next(iter(_cache)))  # oldest first
        _cache[key] = _simulate(spec, workload, config, device_kind, compute_capability, capacity_bytes)
    return _cache[key]


def _simulate(spec: ModelSpec, workload: Workload, config: TrainConfig, device_kind: str,
              compute_capability: str | None = None, capacity_bytes: int | None = None) -> MemoryEstimate:
    micro_batches = min(config.grad_accum_steps, _MICRO_BATCHES)
    fake = _fake_step(spec, workload, config, micro_batches, device_kind, compute_capability)
    # The runner seeds torch and sets matmul precision for its process; here that process
    # is the caller's, so both are put back afterwards.
    with torch.random.fork_rng(devices=[]), _matmul_flags_kept(), _fake_limits(spec.name):
        runner, guard, construction_events = _fake_runner(fake, device_kind)
        real = _run_steps(fake, runner)
    # Runner.global_batch puts every micro batch of a step on the device before the first
    # forward; only `micro_batches` of them were simulated, the others' inputs sit there too.
    idle_bytes = (config.grad_accum_steps - micro_batches) * _input_bytes(real[0])
    one = dataclasses.replace(_breakdown(runner, fake.tracker.peak_bytes + idle_bytes, fake.activations.peak_bytes),
                              note=guard.note)
    if isinstance(runner.optimizer, CountedState):
        one = dataclasses.replace(one, optimizer_counted=runner.optimizer.count.how)
    if device_kind == "cuda" and config.world_size == 1:
        one = _on_the_card(one, fake.tracker.events, construction_events, config, real[0], compute_capability,
                           capacity_bytes, runner.policy.param_dtype, fp32_bytes(runner.model))
    if guard.note:
        logger.info("estimate {} {}: {}", spec.name, config.short(), guard.note)
    if config.world_size == 1:
        return host_split(one, config, device_kind, fake.counter)
    return host_split(per_rank(one, runner.model, config, device_kind), config, device_kind, fake.counter)


@dataclass(frozen=True, kw_only=True, slots=True)
class _FakeStep:
    """What one estimate runs the runner's step with, and the meters that count it."""

    spec: ModelSpec  # its global batch: the simulated micro batches only
    config: TrainConfig  # one process, eager, the simulated micro batches
    workload: Workload  # built on the meta device, the optimizer's state counted, the loss metered
    fake_mode: FakeTensorMode
    tracker: LiveBytesTracker  # the device bytes the fake tensors would hold
    activations: "_ActivationMeter"  # what each forward leaves alive for backward
    build: "_MetaBuild"
    attention: contextlib.AbstractContextManager  # the card's attention kernels, or nothing
    counter: HostCounter | None  # offloaded activations: on the host, off the device trace


def _fake_step(spec: ModelSpec, workload: Workload, config: TrainConfig, micro_batches: int, device_kind: str,
               compute_capability: str | None) -> _FakeStep:
    # One rank runs the same step as one process on its share of the batch; what the
    # strategy adds or shards is applied afterwards (`rank_memory`).
    # A compiled step is estimated as the eager one: torch.compile cannot trace under the
    # tracker's dispatch mode, and compiling per estimate would cost more than a trial.
    # Fused kernels usually keep fewer intermediates; the calibration, fitted per compile
    # setting, learns the difference from measured trials.
    small_config = traced(config).replace(grad_accum_steps=micro_batches, parallelism="none", world_size=1,
                                          compile=False)
    tracker = LiveBytesTracker(record=device_kind == "cuda")
    activations = _ActivationMeter(tracker)
    build = _MetaBuild(workload.build_model, workload.optimizer)
    chunked = workload.chunked_loss_fn
    return _FakeStep(
        spec=dataclasses.replace(spec, train=dataclasses.replace(
            spec.train, global_batch_size=config.micro_batch_size * micro_batches)),
        config=small_config,
        # The user's optimizer never runs here (its kernels may not take fake tensors): a
        # stand-in is built, and `retie` gives it the state bytes counted on real tensors.
        workload=dataclasses.replace(workload, build_model=build, optimizer=workload.optimizer and CountedState,
                                     loss_fn=functools.partial(activations.loss, workload.loss_fn),
                                     chunked_loss_fn=chunked and functools.partial(activations.loss, chunked)),
        # Real (meta) tensors are let in: a model's constant tensors become fake on first use.
        fake_mode=FakeTensorMode(allow_non_fake_inputs=True),
        tracker=tracker, activations=activations, build=build,
        # A CUDA target runs attention on its own kernels (flash, memory-efficient), which save far
        # less than the CPU's math path does with dropout on: traced as the card would run it.
        attention=CudaAttention(compute_capability) if device_kind == "cuda" else contextlib.nullcontext(),
        counter=host_counter(config, device_kind),
    )


def _fake_runner(fake: _FakeStep, device_kind: str) -> tuple[Runner, "_OptimizerGuard", int]:
    """The runner built on fake tensors, its optimizer guarded, and how many of the tracker's
    events its construction made (on CUDA: the card's peaks count them apart)."""
    with fake.fake_mode, fake.tracker:
        runner = Runner(fake.spec, fake.workload, fake.config, device=torch.device("cpu"))
        fake.build.retie(runner, device_kind)
        guard = _OptimizerGuard(runner.optimizer, device_kind)
    # GradScaler reads its found-inf flag with .item(), which a fake tensor has no
    # value for; a disabled scaler differs only by a few scalars.
    runner.scaler = torch.amp.GradScaler("cpu", enabled=False)
    construction_events = 0
    if device_kind == "cuda":
        fake.tracker.reset_peak()  # the step's tensor peak; the card's peaks add the build (_on_the_card)
        construction_events = len(fake.tracker.events)
    return runner, guard, construction_events


def _run_steps(fake: _FakeStep, runner: Runner):
    """`ESTIMATED_STEPS` optimizer steps on fake batches; the last step's real micro batches."""
    for step in range(ESTIMATED_STEPS):
        # Batches come from the real data source (it may read files or call numpy),
        # then become fake tensors that the tracker counts as device inputs.
        real = runner.peak_batch(step)
        if step < ESTIMATED_STEPS - 1:
            # A step before the last only has to create the optimizer's state: one
            # micro batch does, and holds nothing the last step does not hold too.
            real = real[:1]
        runner.config = fake.config.replace(grad_accum_steps=len(real))
        with fake.fake_mode:
            batch = [_to_fake(fake.fake_mode, mb) for mb in real]
        counting = fake.counter.counting() if fake.counter else contextlib.nullcontext()
        # FakeKernels sits between the fake mode and the tracker: the tracker counts its outputs.
        with fake.fake_mode, FakeKernels(), fake.tracker, fake.attention, counting:
            fake.tracker.track(t for mb in batch for t in tree_leaves(mb))
            runner.step(batch)
            del batch
    return real


@contextlib.contextmanager
def _matmul_flags_kept():
    matmul_precision, cudnn_tf32 = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul_precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32


@contextlib.contextmanager
def _fake_limits(name: str):
    """What fake tensors cannot run becomes an `EstimateError` (a trial measures the model
    instead); the user's own bugs and autofit's errors pass as they are."""
    try:
        yield
    except UserCodeError as exc:
        # The user's code raised. Under fake tensors that may be fake tensors' own limit
        # (a value read with .item(), an op with no fake kernel: torch's exceptions),
        # which a real run would not meet; anything else is their bug.
        if not _fake_limitation(exc.__cause__):
            raise
        cause = exc.__cause__
        raise EstimateError(f"estimate: {name} cannot run on fake tensors ({type(cause).__name__}: "
                            f"{str(cause).splitlines()[0] if str(cause) else ''}); "
                            f"measure it with `autofit trial` instead") from cause
    except OptimizerStateError as exc:
        raise EstimateError(f"estimate: {exc}") from exc
    except AutofitError:
        raise
    except Exception as exc:
        _note_cuda_error(exc)
        raise EstimateError(f"estimate: {name} cannot run on fake tensors "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                            f"measure it with `autofit trial` instead") from exc


class _OptimizerGuard:
    """Never runs a real kernel on fake tensors. An optimizer whose step is known not to run on
    them (Triton or CUDA kernels on raw pointers) gets its state from its documented layout
    and no step at all; one whose step raises under fake tensors (an op with no fake
    implementation) gets the state it did not create from its layout, or from the state it
    created before it raised. `note` says which, for the estimate's result and the log."""

    def __init__(self, optimizer: torch.optim.Optimizer, device_kind: str):
        self.optimizer, self.real_step = optimizer, optimizer.step
        self.name = implementation(optimizer)
        reason = unfakeable_reason(optimizer, device_kind)
        self.layout = state_layout(optimizer) if reason else None
        self.note = ""
        if self.layout is not None:
            self.note = f"optimizer state of {self.name} from its documented layout, its step not run ({reason})"
        optimizer.step = self.step  # the instance's step: what `optimizer_step` calls

    def step(self, *args, **kwargs):
        if self.layout is not None:
            fill_state(self.optimizer, self.layout)
            return None
        try:
            return self.real_step(*args, **kwargs)
        except UserCodeError as exc:  # a user's optimizer, wrapped: only fake tensors' own limit is ours
            if not (_fake_limitation(exc.__cause__) and self._instead(exc.__cause__)):
                raise
        except AutofitError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the step on fake tensors is that limit
            if not self._instead(exc):
                raise
        return None

    def _instead(self, exc: BaseException) -> bool:
        """Makes the state the failed step did not, from the layout or from what the step made;
        False when neither is known (the estimate fails)."""
        _note_cuda_error(exc)
        cause = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
        self.layout, source = state_layout(self.optimizer), "its documented layout"
        if self.layout is None:
            self.layout, source = inferred_layout(self.optimizer), "the state its step created before it raised"
        if self.layout is None:
            return False
        self.note = f"optimizer state of {self.name} from {source}: its step cannot run on fake tensors ({cause})"
        fill_state(self.optimizer, self.layout)
        return True


_cuda_poisoned = False


def cuda_poisoned() -> bool:
    """Whether an estimate in this process met a CUDA error: sticky, so the process must be
    replaced (the resident estimator child ends after its answer)."""
    return _cuda_poisoned


def _note_cuda_error(exc: BaseException) -> None:
    global _cuda_poisoned
    text = f"{type(exc).__name__} {exc}"
    if isinstance(exc, getattr(torch, "AcceleratorError", ())) or "CUDA" in text or "illegal memory access" in text:
        _cuda_poisoned = True


def _built_on_the_card(events: list, param_dtype: torch.dtype) -> list:
    """The construction's allocations (`events`: each tensor in the precision's dtype) as the
    runner makes them on a GPU: the model built in fp32, then cast to a 16-bit dtype one tensor
    at a time, each fp32 original freed after its copy, so the whole fp32 model is live once.
    Integer buffers, which are not cast, count as if they were: a few bytes."""
    if param_dtype.itemsize >= 4:
        return events
    built = [(("fp32", i), 2 * n) for i, (_, n) in enumerate(events) if n is not None]
    cast = []
    for i, (key, n) in enumerate(events):
        cast += [(key, n), (("fp32", i), None)] if n is not None else [(key, n)]
    return built + cast


def _on_the_card(one: MemoryEstimate, events: list, construction_events: int, config: TrainConfig,
                 micro_batch, compute_capability: str | None, capacity_bytes: int | None,
                 param_dtype: torch.dtype, model_fp32_bytes: int) -> MemoryEstimate:
    """The step's trace through the caching allocator's rules, after the cuBLAS/cuBLASLt
    workspaces the trial's first matmuls allocate and keep, the model's construction on the
    card, and the inputs of the micro batches that were not simulated (on the card before the
    first forward); with no cap, and under `capacity_bytes` where given. The peaks count the
    construction: a trial's peak statistics are reset before it builds the model."""
    workspaces = workspace_events(compute_capability)
    idle = [(("input", i, j), t.numel() * t.element_size())
            for i in range(config.grad_accum_steps - min(config.grad_accum_steps, _MICRO_BATCHES))
            for j, t in enumerate(tree_leaves(micro_batch)) if isinstance(t, torch.Tensor)]
    construction = events[:construction_events]
    if capacity_bytes is None or model_fp32_bytes <= DEVICE_BUILD_SHARE * capacity_bytes:  # `distributed.build_device`
        construction, count_from = _built_on_the_card(construction, param_dtype), len(workspaces)
    else:  # built on the host: the card sees each tensor arrive in its dtype, counted as resident
        count_from = len(workspaces) + construction_events
    trace = workspaces + construction + idle + events[construction_events:]
    peaks = replay(trace, count_from=count_from)
    workspace_bytes = sum(n for _, n in workspaces)
    one = dataclasses.replace(one, allocated_peak_bytes=peaks.allocated_peak_bytes,
                              reserved_peak_bytes=peaks.reserved_peak_bytes, workspace_bytes=workspace_bytes)
    if capacity_bytes is None:
        return one
    capped = peaks
    if peaks.reserved_peak_bytes > capacity_bytes:  # under the cap the replay is the same: no retry
        capped = replay(trace, count_from=count_from, capacity_bytes=capacity_bytes)
    # An OOM even after the retry: the larger of what the refused segment asked for and the
    # uncapped peak, so that the figure is over the cap and never below today's.
    under_cap = capped.reserved_peak_bytes if capped.fits else max(capped.reserved_peak_bytes,
                                                                    peaks.reserved_peak_bytes)
    return dataclasses.replace(one, capacity_bytes=capacity_bytes, capped_reserved_peak_bytes=under_cap,
                               allocator_retries=capped.retries)


def _fake_limitation(exc: BaseException | None) -> bool:
    # torch's own exception types; a custom op with no fake kernel raises a plain RuntimeError
    # that says so.
    return exc is not None and (type(exc).__module__.startswith("torch") or isinstance(exc, NotImplementedError)
                                or (isinstance(exc, RuntimeError) and "fake" in str(exc).lower()))


def _input_bytes(micro_batch) -> int:
    # Per tensor, not per storage: on a CPU the micro batches are views of one global batch.
    return sum(t.numel() * t.element_size() for t in tree_leaves(micro_batch) if isinstance(t, torch.Tensor))


class _MetaBuild:
    """Builds the model on the meta device, as plain tensors: the runner's `.to(device,
    dtype)` then makes fake CPU parameters of them. (A model built as fake tensors cannot be
    moved at all: `Module._apply` swaps fake parameters, and fake tensors carry weak
    references that forbid the swap.) The tracker still counts the fp32 build, as a CPU
    trial would.

    That `.to()` gives every module a new Parameter, which unties tied weights (GPT-2's
    head and embedding); `retie` restores them, or the estimate would count one twice."""

    def __init__(self, build_model, user_optimizer=None):
        self.build_model, self.user_optimizer = build_model, user_optimizer
        self.ties: list[list[tuple[torch.nn.Module, str]]] = []

    def __call__(self) -> torch.nn.Module:
        with unset_fake_temporarily(), torch.device("meta"):
            model = self.build_model()
        owners: dict[int, list] = {}
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    owners.setdefault(id(p), []).append((module, name))
        self.ties = [o for o in owners.values() if len(o) > 1]
        return model

    def retie(self, runner: Runner, device_kind: str) -> None:
        for (first, first_name), *rest in self.ties:
            for module, name in rest:
                module._parameters[name] = first._parameters[first_name]
        runner.params = trainable_parameters(runner.model)
        if self.user_optimizer is not None:
            count = count_state(self.user_optimizer, runner.params, runner.spec.optimizer.python or "the optimizer")
            runner.optimizer = CountedState(runner.params, count)
            return
        # Rebuilt over the tied parameters, and as the runner builds it on `device_kind`
        # (fused on CUDA: no per-parameter scratch).
        runner.optimizer = apply_optimizer_hooks(build_optimizer(
            runner.spec.optimizer, runner.params, config=runner.config, device=torch.device(device_kind)),
            runner.config)


class _ActivationMeter:
    """Wraps the loss function: live bytes after the forward minus before it are what the
    forward left alive for backward (the loss itself is a few bytes)."""

    def __init__(self, tracker: LiveBytesTracker):
        self.tracker, self.peak_bytes = tracker, 0

    def loss(self, loss_fn, model, batch):
        before = self.tracker.live_bytes
        loss = loss_fn(model, batch)
        self.peak_bytes = max(self.peak_bytes, self.tracker.live_bytes - before)
        return loss


def _to_fake(fake_mode: FakeTensorMode, batch):
    if isinstance(batch, dict):
        return {k: fake_mode.from_tensor(v) for k, v in batch.items()}
    return tuple(fake_mode.from_tensor(t) for t in batch)


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            total += storage.nbytes()
    return total


def _breakdown(runner: Runner, peak_bytes: int, activations_bytes: int) -> MemoryEstimate:
    model, params = runner.model, runner.params
    state = [t for s in runner.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    parameters_bytes = _storage_bytes([*model.parameters(), *model.buffers()])
    gradients_bytes = sum(p.numel() * p.element_size() for p in params)
    optimizer_bytes = _storage_bytes(state)
    parts = parameters_bytes + gradients_bytes + optimizer_bytes + activations_bytes
    return MemoryEstimate(
        parameters=sum(p.numel() for p in model.parameters()),
        trainable_parameters=sum(p.numel() for p in params),
        parameters_bytes=parameters_bytes, gradients_bytes=gradients_bytes, optimizer_bytes=optimizer_bytes,
        activations_bytes=activations_bytes, temporaries_bytes=max(0, peak_bytes - parts), peak_bytes=peak_bytes,
    )
