"""What one tune searches: the study's name (so the same command resumes it), the device a
multi-rank profile is keyed by, and the search space of a spec on a device.

The space needs facts about the model (its block count, BatchNorm layers, an LM head for
the chunked loss): the tune's worker finds them from a model built on the meta device
(`autofit.measure.tasks.analysis`), so the user's code never runs in the tuner's process.
"""

import dataclasses

from loguru import logger

from autofit.base.errors import DeviceError, SpecError
from autofit.config.knobs import spec_knobs
from autofit.config.spec import divisors, ModelSpec
from autofit.device.probe import DeviceInfo
from autofit.device.support import supported_precisions, unsupported_reason
from autofit.measure.messages import Analysis
from autofit.search import SearchSpace


def study_name(spec: ModelSpec, device: DeviceInfo, emulated_budget_bytes: int | None = None) -> str:
    """One study per (spec, device kind[, emulated budget]): a rerun of the same command
    resumes it. The measured budget is not part of the key: other processes' memory moves
    it a little between runs, and measured peaks stay true whatever the budget."""
    name = f"{study_prefix(spec)}{device.fingerprint}"
    return name if emulated_budget_bytes is None else f"{name}-budget{emulated_budget_bytes}"


def study_prefix(spec: ModelSpec) -> str:
    """What every GPU kind's study of `spec` starts with: the service's warm start finds them by it."""
    return f"{spec.name}-{spec.spec_hash.removeprefix('sha256:')[:12]}-"


def device_for_ranks(device: DeviceInfo, nproc: int) -> DeviceInfo:
    """The device a profile for `nproc` ranks is keyed by. A profile for N ranks is not one
    for a single process: its own fingerprint and file name (`…-x8`), so the store keeps
    both and never hands one out for the other."""
    if nproc == 1:
        return device
    return dataclasses.replace(device, fingerprint=f"{device.fingerprint}-x{nproc}", slug=f"{device.slug}-x{nproc}")


def search_space(spec: ModelSpec, device: DeviceInfo, nproc: int = 1, analysis: Analysis | None = None) -> SearchSpace:
    """The space of `spec` on `device` over `nproc` ranks. `analysis`: the model's facts as the
    tune's worker found them (`autofit.measure.tasks.analysis`); without it they are found in
    this process, which runs the user's model code here (tests and tools only)."""
    precisions = supported_precisions(spec.search.precisions, device_kind=device.kind,
                                      compute_capability=device.compute_capability)
    if not precisions:  # the spec asks for what this device cannot do: the user's input
        reasons = "; ".join(unsupported_reason(p, device_kind=device.kind, compute_capability=device.compute_capability)
                            for p in spec.search.precisions)
        raise DeviceError(f"search.precisions: none runs on {device.name}: {reasons}")
    if analysis is None:
        # Here, not at the top: the tune's parent gets the analysis from its worker and never imports torch.
        from autofit.measure.tasks import analysis as model_analysis
        from autofit.workload import build_workload

        analysis = model_analysis(spec, build_workload(spec), nproc)
    n_blocks, floor = analysis.n_blocks, analysis.micro_batch_floor
    choices = {k.choices: _choices(k, spec, device, analysis) for k in spec_knobs()}
    chunked = choices["chunked_loss"]
    if True in chunked and not analysis.chunkable:
        raise SpecError(f"search.chunked_loss: only for language-model heads autofit can chunk (builtin gpt, "
                        f"hf *ForCausalLM with synthetic, tokens or text data); {spec.name} has none; use [false]")
    if True in chunked and nproc > 1:
        if spec.search.chunked_loss:  # asked for, not turned on by the device
            logger.warning("search.chunked_loss: runs in one process only; not searched with --nproc {}", nproc)
        chunked = (False,)
    choices["chunked_loss"] = chunked
    rank_batch = spec.train.global_batch_size // nproc  # micro x accumulation x ranks = global
    return SearchSpace(
        global_batch_size=spec.train.global_batch_size, precisions=tuple(precisions),
        micro_batch_sizes=tuple(d for d in divisors(rank_batch) if floor is None or d >= floor.size),
        micro_batch_floor=floor, world_size=nproc,
        max_checkpoint_blocks=n_blocks if spec.search.activation_checkpointing else 0,
        max_freeze_blocks=min(spec.search.max_freeze_blocks, n_blocks),
        length_bucketing=(False, True) if analysis.bucketing else (False,),
        **choices,
        # The memory knobs the device turned on, not the spec: refinements of the leaders.
        refined=tuple(k.name for k in spec_knobs() if k.role == "memory" and not getattr(spec.search, k.choices)
                      and len(choices[k.choices]) > 1 and not k.last_resort),
    )


def _choices(knob, spec: ModelSpec, device: DeviceInfo, analysis: Analysis) -> tuple:
    """The values of `knob` searched on `device`: none but the default where it is inert (a
    CUDA setting on the CPU); the spec's where it names them; else every value where the device
    turns it on by default and the model has what it needs (`KnobDef.needs`), the default elsewhere."""
    named = getattr(spec.search, knob.choices)
    if device.kind not in knob.devices:
        if len(named) > 1:
            logger.info("search.{}: inert on {}; not searched", knob.choices, device.name)
        return (knob.default,)
    if named:
        return named
    if device.kind in knob.default_on and (knob.needs is None or getattr(analysis, knob.needs)):
        return knob.values
    return (knob.default,)
