"""One rank's memory under DDP or FSDP2, from a one-process estimate of the same micro batch.

Each rank runs the one-process step on its share of the global batch, so activations and
temporaries are the one-process figures. What the strategy changes is the model state and
the collectives' buffers:

- DDP keeps a whole replica and adds flat gradient buckets the size of all gradients
  (allocated when it is built); with `gradient_as_bucket_view` the `.grad` tensors are
  views into those buckets, and the copy is gone.
- FSDP2 (`fully_shard`, one unit per block plus the root) keeps 1/N of every parameter,
  gradient and optimizer state. In flight at the peak (start of backward): the root unit
  gathered (FSDP2 keeps it after forward), the current block and the prefetched next one
  gathered, the root's unsharded gradients (reduce-scattered when backward ends) and one
  block's before its reduce-scatter. With `reshard_after_forward=False` every unit stays
  gathered from forward to backward.

The peak is the larger of the one-process peak with the state sharded and the sharded
state plus one micro batch's activations, plus the collectives' buffers. The search's
calibration corrects what this model misses, per strategy (docs/estimator.md).
"""

import dataclasses
import math

from torch import nn

from autofit.config.train_config import TrainConfig
from autofit.train.configure import find_block_stack


def per_rank(one, model: nn.Module, config: TrainConfig, device_kind: str):
    """`one` (a MemoryEstimate of one process) as one of `config.world_size` ranks sees it."""
    n = config.world_size
    if config.parallelism == "ddp":
        buckets = 0 if config.gradient_as_bucket_view else one.gradients_bytes
        return dataclasses.replace(one, world_size=n, collective_bytes=buckets, peak_bytes=one.peak_bytes + buckets)
    assert config.parallelism == "fsdp", config.parallelism
    root, blocks = unit_bytes(model)
    largest = max(blocks, default=(0, 0), key=lambda unit: unit[0])
    if config.reshard_after_forward:
        gathered = root[0] + 2 * largest[0]
    else:
        gathered = root[0] + sum(b[0] for b in blocks)
    collective = gathered + root[1] + largest[1]
    params, grads, optim = (math.ceil(b / n) for b in (one.parameters_bytes, one.gradients_bytes,
                                                       one.optimizer_bytes))
    sharded = params + grads + optim
    # One process peaks either in backward (activations on top of the state) or in the
    # optimizer step (the state alone weighs more); a rank's peak comes from the same two
    # moments with the state sharded, and the collectives' buffers on top.
    peak = max(one.peak_bytes - (one.model_state_bytes - sharded), sharded + one.activations_bytes) + collective
    if device_kind == "cpu":
        # A CPU rank builds the whole model in fp32 before sharding it (plus the cast copy
        # under bf16-true); a GPU rank builds it in host memory and moves only shards.
        build = one.parameters * 4 + (one.parameters_bytes if one.parameters_bytes < one.parameters * 4 else 0)
        peak = max(peak, build)
    return dataclasses.replace(one, world_size=n, parameters_bytes=params, gradients_bytes=grads,
                               optimizer_bytes=optim, collective_bytes=collective, peak_bytes=peak)


def unit_bytes(model: nn.Module) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """(parameter bytes, gradient bytes) of the root unit and of each block's unit, as
    `distributed.wrap_model` cuts them."""
    stack = find_block_stack(model)
    blocks = list(stack[1]) if stack is not None else []
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    root = _sizes(p for p in model.parameters() if id(p) not in in_blocks)
    return root, [_sizes(block.parameters()) for block in blocks]


def _sizes(params) -> tuple[int, int]:
    p_bytes = g_bytes = 0
    for p in params:
        n = p.numel() * p.element_size()
        p_bytes += n
        g_bytes += n if p.requires_grad else 0
    return p_bytes, g_bytes
