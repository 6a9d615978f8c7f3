"""`TrainingPlan`: a tuned configuration applied to the caller's own model and loop.

    profile = autofit.load_profile("tiny-gpt")
    plan = profile.apply(model, lambda params: torch.optim.AdamW(params, lr=3e-4), max_grad_norm=1.0)
    for batch in loader:                                  # micro batches of plan.micro_batch_size
        with plan.autocast():
            loss = loss_fn(plan.model, plan.to_device(batch))
        if plan.backward(loss):                           # every grad_accum_steps micro batches
            plan.step()

The step is the built-in runner's own (`autofit.train.runner.optimizer_step`), so the loop trains
exactly as `autofit train --profile` does and as the profile was measured. Without an
optimizer factory the plan builds the optimizer the profile was measured with (and clips at
its `max_grad_norm`); a factory whose optimizer is another implementation gets a warning.
The plan sets the process-wide TF32/cuDNN flags the profile ran with; `plan.close()`, or
leaving `with profile.apply(model) as plan:`, puts the caller's back.

A profile tuned with `--nproc N` (parallelism ddp or fsdp) is applied in each of the N
ranks of a torchrun job, after `torch.distributed.init_process_group()`: `plan.model` is
then the DDP or FSDP2-wrapped model, and each rank feeds it its own share of the data
(`plan.micro_batch_size` samples per micro batch, a DistributedSampler's job).

Or hand the plan a whole global batch and a loss function, and it cuts the micro batches
itself and survives an out-of-memory error as `autofit train` does (half the micro batch,
twice the accumulation, the step done again from its beginning):

    for batch in loader:                                  # global batches of plan.global_batch_size
        plan.step(batch=batch, loss_fn=lambda model, mb: loss_fn(model, mb))
"""

import contextlib
from collections.abc import Callable

import torch
from loguru import logger
from torch import nn

from autofit.base.errors import DeviceError, ProfileError
from autofit.config.train_config import TrainConfig
from autofit.device.precision import check_supported, PrecisionPolicy, process_flags, set_process_flags
from autofit.workload import Batch, batch_size_of, split_batch
from autofit.workload.binding import check_loss
from autofit.train import distributed
from autofit.train.configure import apply_config, apply_optimizer_hooks, prepare_batch, trainable_parameters
from autofit.train.optim import implementation
from autofit.train.recover import accumulate, Demotion, demotion, release_memory, StepOutOfMemory
from autofit.train.runner import optimizer_step, resolve_device

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class TrainingPlan:
    """What a training loop needs to run one `TrainConfig`: the prepared model, its
    trainable parameters, autocast, the GradScaler, the batch shape and the step."""

    def __init__(self, model: nn.Module, config: TrainConfig, optimizer_factory: OptimizerFactory | None = None,
                 *, device: torch.device | str | int | None = None, max_grad_norm: float | None = None,
                 on_demotion: Callable[[Demotion], None] | None = None, flags: dict | None = None,
                 min_micro_batch_size: int = 1):
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ProfileError(f"max_grad_norm: must be positive or None (no clipping), got {max_grad_norm!r}")
        self.config = config
        self.device = resolve_plan_device(device)
        self.max_grad_norm = max_grad_norm
        # Same order as `Runner.__init__`: the policy is checked before any weight moves, and
        # freezing/checkpointing are applied before the cast so the wrappers move with the model.
        self.policy: PrecisionPolicy = check_supported(config.precision, self.device)
        # The flags are process-wide: the caller's are put back by `close()` (or the with block).
        self._caller_flags: dict | None = process_flags()
        self.policy.set_matmul_precision()
        if flags:  # what the profile's measurement ran with (cudnn.benchmark included)
            set_process_flags(flags)
        distributed.check_world(config, what="profile")
        apply_config(model, config)
        self.model = distributed.place_model(model, config, self.device, self.policy.param_dtype)
        self.model.train()
        self.parameters = trainable_parameters(self.model)
        if not self.parameters:
            raise ProfileError(f"freeze_blocks={config.freeze_blocks} froze every parameter of "
                               f"{type(model).__name__}: nothing to train")
        # Built from the trainable parameters only: frozen ones get no optimizer state.
        self.optimizer = (apply_optimizer_hooks(optimizer_factory(self.parameters), config)
                          if optimizer_factory is not None else None)
        if config.chunked_loss:  # the loss is the loop's own: say what was measured
            logger.info("this profile was measured with the chunked LM loss: compute the loss with "
                        "autofit.chunked_lm_loss(plan.model, micro_batch) (or plan.step(batch=..., "
                        "loss_fn=autofit.chunked_lm_loss)), or the full logits come back into the peak")
        self.scaler = distributed.grad_scaler(self.policy.make_scaler(self.device.type), config, self.device)
        self.skipped_steps = 0
        self.steps_done = 0  # optimizer steps taken
        self.demotions: list[Demotion] = []  # out-of-memory recoveries, oldest first
        self.on_demotion = on_demotion
        # A BatchNorm model's floor (the profile's search.micro_batch_floor): an out-of-memory
        # step is not done again below it, where it would train on other statistics.
        self.min_micro_batch_size = min_micro_batch_size
        self.last_loss: torch.Tensor | None = None  # mean loss of the last `step(batch=...)`
        self._micro_batches = 0  # backward passes since the last optimizer step

    # --- what the loop reads ----------------------------------------------------------

    @property
    def precision(self) -> str:
        return self.config.precision

    @property
    def micro_batch_size(self) -> int:
        return self.config.micro_batch_size

    @property
    def grad_accum_steps(self) -> int:
        return self.config.grad_accum_steps

    @property
    def global_batch_size(self) -> int:
        return self.config.global_batch_size

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward pass's autocast (a no-op for 32-true, tf32 and bf16-true). Under DDP
        also `no_sync()` for all but the window's last micro batch: DDP decides in the
        forward whether the backward all-reduces."""
        stack = contextlib.ExitStack()
        last = self._micro_batches + 1 >= self.grad_accum_steps
        stack.enter_context(distributed.no_sync(self.model, self.config, last=last))
        stack.enter_context(self.policy.autocast(self.device.type))
        return stack

    def to_device(self, batch: Batch) -> Batch:
        """A micro batch as the step takes it: on the plan's device, under bf16-true its float
        inputs in bf16 too, with the knobs' batch entries (`autofit.train.configure.prepare_batch`,
        as the runner's)."""
        return prepare_batch(batch, self.config, self.policy.param_dtype, self.device)

    # --- the step ---------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> bool:
        """Scaled backward of one micro batch's mean loss. Returns True when this completes
        an accumulation window, i.e. it is time for `step()`."""
        # Dividing by the window length makes the accumulated gradient the global batch's
        # mean, exactly as `Runner.step` does.
        check_loss(loss, "the loss given to plan.backward() / plan.step()")
        self.scaler.scale(loss / self.grad_accum_steps).backward()
        self._micro_batches += 1
        return self._micro_batches >= self.grad_accum_steps

    def step(self, loss: torch.Tensor | None = None, *, batch: Batch | None = None,
             loss_fn: Callable[[nn.Module, Batch], torch.Tensor] | None = None) -> bool | None:
        """The optimizer step: unscale, clip, GradScaler step and update, zero the grads.

        With `loss`, first its `backward`, and the optimizer step only once the window is
        full, so a loop may call `plan.step(loss)` once per micro batch. Returns whether the
        GradScaler skipped the update (inf/NaN gradients), or None while still accumulating.

        With `batch` (a whole global batch, CPU or device tensors) and `loss_fn(model,
        micro_batch) -> mean loss`, the whole step: micro batches, autocast, backward and
        update. A micro batch that runs out of memory makes the plan halve its micro batch,
        double its accumulation and do the step again from its beginning; the event is in
        `plan.demotions` and goes to `on_demotion`.
        """
        if batch is not None:
            return self._step_batch(batch, loss_fn)
        if loss is not None and not self.backward(loss):
            return None
        if self.optimizer is None:
            raise ProfileError("this plan has no optimizer: pass optimizer_factory to profile.apply(), "
                               "or call plan.backward() and step your own optimizer via "
                               "autofit.train.runner.optimizer_step(optimizer, plan.scaler, plan.parameters, ...)")
        skipped = optimizer_step(self.optimizer, self.scaler, self.parameters, self.max_grad_norm)
        self.skipped_steps += int(skipped)
        self.steps_done += 1
        self._micro_batches = 0
        return skipped

    def _step_batch(self, batch: Batch, loss_fn) -> bool:
        if loss_fn is None:
            raise ProfileError("plan.step(batch=...) needs loss_fn=: a function (model, micro_batch) -> mean loss")
        if batch_size_of(batch) != self.config.rank_batch_size:
            raise ProfileError(f"plan.step(batch=...): the batch has {batch_size_of(batch)} samples; this process "
                               f"takes {self.config.rank_batch_size} per step (micro batch x accumulation)")
        while True:
            try:
                return self._accumulate(batch, loss_fn)
            except StepOutOfMemory as exc:
                # Not under DDP/FSDP: the other ranks would wait in the all-reduce of this step.
                event = None if self.config.distributed else demotion(self.steps_done, self.config, exc)
                if event is None or event.to_config.micro_batch_size < self.min_micro_batch_size:
                    raise
            self.config = event.to_config
            release_memory(self.device)
            logger.warning("plan step {}: out of memory at {}; doing the step again at {}", event.step,
                           event.from_config.short(), event.to_config.short())
            self.demotions.append(event)
            if self.on_demotion is not None:
                self.on_demotion(event)

    def _accumulate(self, batch: Batch, loss_fn) -> bool:
        def forward_backward(micro_batch) -> torch.Tensor:
            with self.autocast():
                loss = check_loss(loss_fn(self.model, self.to_device(micro_batch)), loss_fn)
            self.backward(loss)
            return loss.detach().float()

        self._micro_batches = 0
        try:
            loss_sum = accumulate(split_batch(batch, self.micro_batch_size), forward_backward, self.optimizer,
                                  self.parameters)
        except StepOutOfMemory:
            self._micro_batches = 0  # the window starts again, with the cleared gradients
            raise
        self.last_loss = loss_sum / self.grad_accum_steps
        return self.step()

    def state_dict(self) -> dict:
        """Model, optimizer and scaler state: what a checkpoint of this loop needs."""
        return {"model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                "scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)

    def close(self) -> None:
        """Put back the process-wide TF32/cuDNN/matmul flags the plan changed. Idempotent."""
        if self._caller_flags is not None:
            set_process_flags(self._caller_flags)
            self._caller_flags = None

    def __enter__(self) -> "TrainingPlan":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> dict:
        """The effective setup as a plain dict, for the loop's log line."""
        n_trainable = sum(p.numel() for p in self.parameters)
        n_total = sum(p.numel() for p in self.model.parameters())
        return {**self.config.to_dict(), "device": str(self.device), "max_grad_norm": self.max_grad_norm,
                "trainable_params": n_trainable, "frozen_params": n_total - n_trainable,
                "optimizer": implementation(self.optimizer) if self.optimizer is not None else None}

    def __repr__(self) -> str:
        return f"TrainingPlan({self.config.short()}, device={self.device})"


def resolve_plan_device(device: torch.device | str | int | None) -> torch.device:
    """None: the first GPU if there is one, else the CPU (as `autofit train` picks)."""
    if isinstance(device, torch.device):
        return device
    try:
        return resolve_device(device)
    except ValueError:
        raise DeviceError(f"device: expected a CUDA index, cuda:N or cpu, got {device!r}") from None
