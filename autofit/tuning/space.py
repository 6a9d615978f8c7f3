"""What one tune searches: the study's name (so the same command resumes it), the device a
multi-rank profile is keyed by, and the search space of a spec on a device.

The space needs facts about the model (its block count, BatchNorm layers, an LM head for
the chunked loss): they come from a model built on the meta device, which allocates nothing.
"""

import dataclasses

import torch
from loguru import logger

from autofit.base.errors import DeviceError, SpecError
from autofit.config.spec import divisors, ModelSpec
from autofit.device.probe import DeviceInfo
from autofit.device.support import supported_precisions, unsupported_reason
from autofit.workload import build_workload, TextData
from autofit.train.knobs import block_count, micro_batch_floor
from autofit.measure.probe import probe_batch_dim
from autofit.search import SearchSpace


def study_name(spec: ModelSpec, device: DeviceInfo, emulated_budget_bytes: int | None = None) -> str:
    """One study per (spec, device kind[, emulated budget]): a rerun of the same command
    resumes it. The measured budget is not part of the key: other processes' memory moves
    it a little between runs, and measured peaks stay true whatever the budget."""
    name = f"{spec.name}-{spec.spec_hash.removeprefix('sha256:')[:12]}-{device.fingerprint}"
    return name if emulated_budget_bytes is None else f"{name}-budget{emulated_budget_bytes}"


def device_for_ranks(device: DeviceInfo, nproc: int) -> DeviceInfo:
    """The device a profile for `nproc` ranks is keyed by. A profile for N ranks is not one
    for a single process: its own fingerprint and file name (`…-x8`), so the store keeps
    both and never hands one out for the other."""
    if nproc == 1:
        return device
    return dataclasses.replace(device, fingerprint=f"{device.fingerprint}-x{nproc}", slug=f"{device.slug}-x{nproc}")


def search_space(spec: ModelSpec, device: DeviceInfo, nproc: int = 1) -> SearchSpace:
    precisions = supported_precisions(spec.search.precisions, device_kind=device.kind,
                                      compute_capability=device.compute_capability)
    if not precisions:  # the spec asks for what this device cannot do: the user's input
        reasons = "; ".join(unsupported_reason(p, device_kind=device.kind, compute_capability=device.compute_capability)
                            for p in spec.search.precisions)
        raise DeviceError(f"search.precisions: none runs on {device.name}: {reasons}")
    # The block count comes from a model built on the meta device: no memory, any size.
    # Only the model: a data source may sample real batches while it is built.
    workload = build_workload(spec)
    if not workload.per_sample and nproc > 1:
        raise SpecError(f"loss.per_sample: false couples the samples of a batch, and with --nproc {nproc} each rank "
                        f"sees only its share of them: tune with --nproc 1")
    # A model autofit did not write: is its batch where autofit splits it? (In a child: it
    # runs the user's forward.)
    probe_batch_dim(spec)
    rank_batch = spec.train.global_batch_size // nproc  # micro x accumulation x ranks = global
    with torch.device("meta"):
        model = workload.build_model()
    n_blocks = block_count(model)
    # A knob that changes the math is bounded: BatchNorm normalizes over each micro batch, a
    # loss that couples samples over the whole batch.
    floor = micro_batch_floor(model, rank_batch, spec.search.min_micro_batch_size, per_sample=workload.per_sample)
    data = workload.data
    # Sorting a step by length only changes dynamically padded micro batches of mixed lengths.
    bucketing = (isinstance(data, TextData) and data.padding == "dynamic" and not data.packing
                 and spec.train.global_batch_size > 1)
    chunked = spec.search.chunked_loss
    if True in chunked and workload.chunked_loss_fn is None:
        raise SpecError(f"search.chunked_loss: only for language-model heads autofit can chunk (builtin gpt, "
                        f"hf *ForCausalLM with synthetic, tokens or text data); {spec.name} has none; use [false]")
    if True in chunked and nproc > 1:
        logger.warning("search.chunked_loss: runs in one process only; not searched with --nproc {}", nproc)
        chunked = (False,)
    return SearchSpace(
        global_batch_size=spec.train.global_batch_size, precisions=tuple(precisions),
        micro_batch_sizes=tuple(d for d in divisors(rank_batch) if floor is None or d >= floor.size),
        micro_batch_floor=floor, world_size=nproc,
        max_checkpoint_blocks=n_blocks if spec.search.activation_checkpointing else 0,
        max_freeze_blocks=min(spec.search.max_freeze_blocks, n_blocks),
        length_bucketing=(False, True) if bucketing else (False,),
        checkpoint_policies=spec.search.checkpoint_policies,
        optimizer_bits=spec.search.optimizer_bits, chunked_loss=chunked,
        compile=spec.search.compile,
    )
