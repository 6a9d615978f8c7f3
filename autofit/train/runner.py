"""The training step: one code path for trials, `autofit train` (`autofit.train.loop`) and
profile plans (`autofit.train.training_plan`). `Runner` builds the model with a `TrainConfig` applied
and runs optimizer steps; `optimizer_step` is the end of every step, whoever runs it.
"""

import contextlib
from dataclasses import dataclass

import torch
from loguru import logger
from torch import nn

from autofit.base.errors import SpecError
from autofit.config.spec import ModelSpec
from autofit.config.train_config import check_global_batch, TrainConfig
from autofit.device.precision import check_supported, PrecisionPolicy
from autofit.workload import split_batch, TextData, Workload
from autofit.workload.binding import check_loss
from autofit.workload.text import count_tokens
from autofit.train import distributed
from autofit.train.configure import (apply_config, apply_optimizer_hooks, micro_batch_floor, prepare_batch,
                                 trainable_parameters)
from autofit.train.optim import build_optimizer
from autofit.train.recover import accumulate, demotion, Demotion, release_memory


def step_generator(seed: int, step: int) -> torch.Generator:
    """The data of optimizer step `step`: the same for every config and after a resume."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def resolve_device(name: str | int | None) -> torch.device:
    if name is None:
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if str(name) == "cpu":
        return torch.device("cpu")
    index = int(str(name).removeprefix("cuda:"))
    return torch.device("cuda", index)


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, params: list[nn.Parameter],
                   max_grad_norm: float | None) -> bool:
    """The end of every optimizer step, after the micro batches' backward: unscale, clip,
    step through the GradScaler, zero the grads. True when the scaler skipped the update.

    `Runner.step` and `TrainingPlan.step` both call this, so a profile applied to a
    user's own loop steps exactly as it did while it was measured.
    """
    if max_grad_norm is not None:
        # Clip the true gradients, not the loss-scaled ones.
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    skipped = False
    if scaler.is_enabled():
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        # The scaler only lowers its scale when it found inf/NaN grads and skipped the step.
        skipped = scaler.get_scale() < scale_before
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return skipped


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    loss: torch.Tensor  # mean loss over the global batch (a device tensor: reading it syncs)
    skipped: bool  # the GradScaler found inf/NaN gradients and skipped the update


def fp32_bytes(model: nn.Module) -> int:
    """`model`'s floating weights and buffers in fp32, each tensor once (tied weights share one)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()}
    return sum(4 * t.numel() for t in tensors.values())


def _fp32_bytes(workload: Workload) -> int | None:
    """`fp32_bytes` of the model from a build on the meta device (no memory, no init); None
    where the model cannot be built there."""
    try:
        with torch.device("meta"):
            return fp32_bytes(workload.build_model())
    except Exception:  # noqa: BLE001 - a model that needs real tensors to build: built on the host
        return None


class Runner:
    """Builds the model with a `TrainConfig` applied and runs optimizer steps."""

    def __init__(self, spec: ModelSpec, workload: Workload, config: TrainConfig, *, device: torch.device):
        check_global_batch(config, spec.train.global_batch_size)
        self.spec, self.workload, self.config, self.device = spec, workload, config, device
        self.policy: PrecisionPolicy = check_supported(config.precision, device)
        self.policy.set_matmul_precision()
        if config.distributed:
            distributed.check_world(config)
        # Every rank builds the same initial weights from the seed: DDP and FSDP2 both
        # start from identical replicas (DDP also broadcasts rank 0's to be sure).
        torch.manual_seed(spec.train.seed)
        where = distributed.build_device(config, device, lambda: _fp32_bytes(workload))
        with torch.device(where) if where is not None else contextlib.nullcontext():
            model = apply_config(workload.build_model(), config)
        self.model = distributed.place_model(model, config, device, self.policy.param_dtype)
        self.model.train()
        self.params = trainable_parameters(self.model)
        if not self.params:
            raise ValueError("every parameter is frozen: nothing to train")
        self.optimizer = apply_optimizer_hooks(build_optimizer(spec.optimizer, self.params, config=config,
                                                               device=device, user=workload.optimizer), config)
        self.scaler = distributed.grad_scaler(self.policy.make_scaler(device.type), config, device)
        self.skipped_steps = 0
        self.loss_fn = workload.loss_fn
        if config.chunked_loss:
            if workload.chunked_loss_fn is None:
                raise SpecError(f"chunked_loss: only for language-model heads autofit can chunk (builtin gpt, "
                                f"hf *ForCausalLM); {spec.name} has none")
            self.loss_fn = workload.chunked_loss_fn

    def global_batch(self, step: int) -> list:
        """This rank's micro batches of optimizer step `step`, on the device."""
        data, train = self.workload.data, self.spec.train
        if isinstance(data, TextData):  # padded per micro batch, so it cuts the step itself
            return self._to_device(distributed.rank_share(data.step_batches(
                step, train.seed, train.global_batch_size, self.config.micro_batch_size,
                self.config.length_bucketing), self.config))
        batch = data.batch(train.global_batch_size, step_generator(train.seed, step))
        return self._to_device(distributed.rank_share(split_batch(batch, self.config.micro_batch_size), self.config))

    def peak_batch(self, step: int) -> list:
        """A step with the largest inputs the data can give at this micro batch: what a
        peak-memory measurement runs. Fixed-size data: step `step` itself."""
        data = self.workload.data
        if isinstance(data, TextData):
            return self._to_device(distributed.rank_share(data.worst_case_batches(
                self.spec.train.global_batch_size, self.config.micro_batch_size), self.config))
        return self.global_batch(step)

    @property
    def varying_lengths(self) -> bool:
        """The data's steps differ in size (text): peak and speed come from different steps."""
        return isinstance(self.workload.data, TextData)

    def tokens_in(self, micro_batches: list) -> int | None:
        """Non-pad tokens of a step, for data whose lengths vary (None otherwise)."""
        return count_tokens(micro_batches) if self.varying_lengths else None

    def _to_device(self, micro_batches: list) -> list:
        return [prepare_batch(mb, self.config, self.policy.param_dtype, self.device) for mb in micro_batches]

    def step(self, micro_batches: list) -> StepResult:
        """One optimizer step: scaled backward per micro batch, unscale, clip, step.

        A micro batch that runs out of memory raises `StepOutOfMemory` with the step's
        gradients cleared: `demote` and the same step again recover (`train` does)."""
        n_micro = len(micro_batches)
        assert n_micro == self.config.grad_accum_steps, (n_micro, self.config.grad_accum_steps)
        weights = self.micro_batch_weights(micro_batches)

        def forward_backward(indexed) -> torch.Tensor:
            i, micro_batch = indexed
            with distributed.no_sync(self.model, self.config, last=i == n_micro - 1):
                with self.policy.autocast(self.device.type):
                    loss = check_loss(self.loss_fn(self.model, micro_batch), self.loss_fn)
                # Mean over micro batches == mean over the global batch: accumulation is
                # exact, and DDP/FSDP2 average the ranks' gradients. A token loss weighs each
                # micro batch by its share of the global batch's labelled tokens.
                share = loss / n_micro if weights is None else loss * weights[i]
                self.scaler.scale(share).backward()
            # .float() is free for an fp32 loss and keeps a bf16 one from rounding the sum.
            return (loss if weights is None else share).detach().float()

        loss_sum = accumulate(enumerate(micro_batches), forward_backward, self.optimizer, self.params)
        skipped = optimizer_step(self.optimizer, self.scaler, self.params, self.spec.train.max_grad_norm)
        self.skipped_steps += int(skipped)
        loss = loss_sum / n_micro if weights is None and n_micro > 1 else loss_sum  # weighted: a sum already
        return StepResult(loss=loss, skipped=skipped)

    def micro_batch_weights(self, micro_batches: list) -> list[torch.Tensor] | None:
        """Each micro batch's weight in the step's loss when the workload counts what its
        loss is a mean over (labelled tokens), so the step's loss is the global batch's
        mean whatever the micro batch size (Hugging Face's `num_items_in_batch`); None:
        alike. Device tensors, no host sync; the ranks' counts are summed (DDP and FSDP2
        average the ranks' gradients, hence the world size)."""
        items_of = self.workload.loss_items
        if items_of is None:
            return None
        counts = [items_of(self.model, mb) for mb in micro_batches]
        if any(c is None for c in counts):
            return None
        total = distributed.sum_over_ranks(torch.stack(counts).sum()).clamp(min=1)
        world = self.config.world_size if self.config.distributed else 1
        return [c.float() * world / total.float() for c in counts]

    def demote(self, step: int, exc: BaseException) -> Demotion | None:
        """Half the micro batch, twice the accumulation, from this step on; None when the
        micro batch is already 1. The model, optimizer and scaler are untouched."""
        if self.config.distributed:
            # The other ranks would wait forever in the all-reduce of a step this rank left.
            return None
        event = demotion(step, self.config, exc)
        floor = micro_batch_floor(self.model, self.config.rank_batch_size, self.spec.search.min_micro_batch_size,
                                  per_sample=self.workload.per_sample)
        if event is not None and floor is not None and event.to_config.micro_batch_size < floor.size:
            # Below the floor the step would train on other math (BatchNorm's statistics).
            logger.error("step {}: out of memory, and half the micro batch is below its floor ({})", step,
                         floor.describe())
            return None
        if event is not None:
            self.config = event.to_config
            release_memory(self.device)
        return event

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- checkpoints -------------------------------------------------------------------

    def state_dict(self, step: int, history: dict) -> dict:
        return {
            "step": step, "config": self.config.to_dict(), "spec_hash": self.spec.spec_hash,
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps, "history": history,
        }

    def load_state_dict(self, state: dict, *, weights: bool = True) -> None:
        """`weights=False`: model and optimizer were loaded already (sharded checkpoints)."""
        if weights:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)

