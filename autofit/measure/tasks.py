"""What a tune's pre-loaded worker (`worker_main.py`) runs: its setup, once (the spec parsed,
the user's model module imported, the data loaded), and the tasks it forks a child for: a
trial, a memory estimate, the model's analysis. The user's code runs only here, in children
with a timeout, never in the tuner's own process.

Each task takes the request (JSON) and the setup's context, and returns its reply (a message
of `messages.py`) as the JSON-able dict that crosses back; an error in the user's code is a
reply (`input_error`), never an exception out of the task.
"""

import dataclasses
import pickle
import traceback
from pathlib import Path

import torch

from autofit.base.errors import AutofitError, InputError, SpecError
from autofit.config.knobs import LARGE_VOCAB_TOKENS
from autofit.config.spec import ModelSpec, parse_spec
from autofit.config.train_config import TrainConfig
from autofit.workload import build_workload, make_workload, TextData, Workload
from autofit.workload.flops import train_flops_per_sample
from autofit.workload.batch_dim import check_batch_dim
from autofit.train.configure import block_count, micro_batch_floor
from autofit.measure.child import run_request
from autofit.measure.messages import Analysis, EstimateReply, EstimateRequest, TaskReply, TrialRequest
from autofit.measure.fake_step import cuda_poisoned, estimate_memory, EstimateError, max_micro_batch_size

_TRACEBACK_CHARS = 8000


def setup(payload: dict) -> dict:
    """Once per worker: the spec and its workload (model factory, data, loss), then the model
    built once on the meta device, so that what torch imports and initialises on first use
    (Dynamo, the decompositions: a second here) is there before the fork, not paid by every
    child. Nothing runs on real tensors, and the user's forward not at all: the worker must
    stay fit to fork, and a forward that crashes or hangs is a trial's result, in its child."""
    spec = parse_spec(payload["spec"], source_dir=Path(payload["source_dir"]))
    workload = build_workload(spec)
    analysis(spec, workload)  # an error in building the user's model is the setup's, reported at once
    return {"spec": spec, "workload": workload}


def setup_objects(payload: dict) -> dict:
    """`setup` for a model given to `autofit.tune()` as Python objects: the model (or its
    factory), batch_fn and loss_fn unpickled from the file the caller wrote (cloudpickle, by
    value), made a workload as the spec says (per_sample, batch_dim, blocks)."""
    spec = parse_spec(payload["spec"], source_dir=Path(payload["source_dir"]))
    with open(payload["objects"], "rb") as f:
        objects = pickle.load(f)
    workload = make_workload(objects["model"], objects["batch_fn"], objects["loss_fn"], name=spec.name,
                             per_sample=spec.loss.per_sample, batch_dim=spec.model.batch_dim,
                             blocks=spec.model.blocks, probe_batch_dim=spec.probes_batch_dim,
                             target=spec.model.target.rsplit(".", 1)[-1], optimizer=objects.get("optimizer"))
    analysis(spec, workload)
    return {"spec": spec, "workload": workload}


def trial(request: dict, context: dict) -> dict:
    """One trial: its `Measurement` (autofit.measure.child.run_request), as it crosses back."""
    trial_request = TrialRequest.from_dict(request)
    if trial_request.claim:  # the service's guard reads the CUDA claim in the trial folder
        trial_request = dataclasses.replace(trial_request, claim=False, claim_dir=request["_folder"])
    return run_request(trial_request, workload=context["workload"]).to_dict()


def estimate(request: dict, context: dict) -> dict:
    """The predicted peak of `config` on fake tensors; with `budget_bytes`, also the
    largest micro batch that fits it: an `EstimateReply`, as it crosses back."""
    spec, workload = context["spec"], context["workload"]
    asked = EstimateRequest.from_dict(request)
    reply = _estimate(spec, workload, asked.config, asked)
    if cuda_poisoned():  # a CUDA error is sticky: this child is replaced after answering
        reply = dataclasses.replace(reply, end_child=True)
    return reply.to_dict()


def _estimate(spec: ModelSpec, workload: Workload, config: TrainConfig, request: EstimateRequest) -> EstimateReply:
    try:
        found = estimate_memory(spec, config, device_kind=request.device_kind, workload=workload,
                                compute_capability=request.compute_capability,
                                capacity_bytes=request.capacity_bytes)
        largest = None if request.budget_bytes is None else max_micro_batch_size(
            spec, config, request.budget_bytes, device_kind=request.device_kind, workload=workload,
            compute_capability=request.compute_capability)  # the card `fits` was judged for
        return EstimateReply(status="ok", estimate=found, max_micro_batch_size=largest)
    except EstimateError as exc:  # fake tensors' limit (data-dependent shapes): measured instead
        return EstimateReply(status="estimate_error", reason=str(exc))
    except AutofitError as exc:
        return _failure(exc, EstimateReply)


def analyze(request: dict, context: dict) -> dict:
    """What the search space needs to know of the model and data, from a model built on the
    meta device (no memory, any size)."""
    try:
        facts = analysis(context["spec"], context["workload"], request.get("nproc", 1))
        return TaskReply(status="ok").to_dict() | facts.to_dict()
    except AutofitError as exc:
        return _failure(exc).to_dict()


def probe(request: dict, context: dict) -> dict:
    """The batch-dimension probe (`autofit.workload.batch_dim.check_batch_dim`): it runs the
    user's forward on three CPU samples, so it is a task like a trial. A refusal, or an error
    in the user's code, is an `input_error`; anything else the parent reports as a failure."""
    try:
        check_batch_dim(context["workload"])
    except AutofitError as exc:
        return _failure(exc).to_dict()
    return TaskReply(status="ok").to_dict()


_CONVOLUTIONS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
                 torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)


def analysis(spec: ModelSpec, workload: Workload, nproc: int = 1) -> Analysis:
    """The facts of `workload` the search space is built from: block count, the micro-batch
    floor of each rank's batch, whether its LM head can be chunked, whether sorting a step by
    length changes anything, and what the profile's figures assume of the data."""
    with torch.device("meta"):
        model = workload.build_model()
    if not workload.per_sample and nproc > 1:
        raise SpecError(f"loss.per_sample: false couples the samples of a batch, and with --nproc {nproc} each rank "
                        f"sees only its share of them: tune with --nproc 1")
    rank_batch = spec.train.global_batch_size // nproc  # micro x accumulation x ranks = global
    # A knob that changes the math is bounded: BatchNorm normalizes over each micro batch, a
    # loss that couples samples over the whole batch.
    floor = micro_batch_floor(model, rank_batch, spec.search.min_micro_batch_size, per_sample=workload.per_sample)
    data = workload.data
    # Sorting a step by length only changes dynamically padded micro batches of mixed lengths.
    bucketing = (isinstance(data, TextData) and data.padding == "dynamic" and not data.packing
                 and spec.train.global_batch_size > 1)
    chunkable = workload.chunked_loss_fn is not None
    vocab = max((m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)), default=0)
    return Analysis(n_blocks=block_count(model), micro_batch_floor=floor, chunkable=chunkable, bucketing=bucketing,
                    # What the knobs searched by default need (`KnobDef.needs`).
                    large_vocab_head=chunkable and vocab >= LARGE_VOCAB_TOKENS,
                    convolutional=any(isinstance(m, _CONVOLUTIONS) for m in model.modules()),
                    data_assumptions=workload.data_assumptions(),
                    # For the profile's MFU: counted where the model is built (the user's code
                    # runs in children only); None for a model whose FLOPs are not known.
                    flops_per_sample=train_flops_per_sample(model, workload.tokens_per_sample))


def _failure(exc: AutofitError, reply: type[TaskReply] = TaskReply) -> TaskReply:
    """`exc` as a failed task's `reply`: an input error where the user's code or spec raised,
    with its exit code and the end of its traceback."""
    cause = exc.__cause__ or exc
    return reply(status="input_error" if isinstance(exc, (InputError, SpecError)) else "error", reason=str(exc),
                 exit_code=exc.exit_code, traceback="".join(traceback.format_exception(cause))[-_TRACEBACK_CHARS:])
