"""Is the batch where autofit splits it? A probe run before training a model autofit did not
write, unless its spec declares `model.batch_dim`.

autofit cuts every batch into micro batches along dim 0 and averages their losses. That is
the same training only when each sample's loss depends on that sample alone. A
sequence-first model given batch-first data (`nn.Transformer`'s default) attends across the
samples instead of along the sequence: it trains, its loss falls, and it is wrong. The probe
builds the model on the CPU, puts it in eval mode (no dropout; BatchNorm on its running
statistics) and runs one batch of three samples, then the same samples as one and two:

- the model's outputs are looked at for the dimension whose size follows the number of
  samples: when no output holds the batch in dim 0 but one holds it in another, the model
  takes the batch elsewhere;
- the loss of the three together must be the weighted mean of the parts' losses; when it
  is not, the model (or its loss) mixes the samples of a micro batch.

Either way training stops before it starts, with one line that says what was seen and
how to declare it (`model.batch_dim`, or `loss.per_sample: false` for a loss that couples
samples on purpose).
"""

import math

import torch
from torch.utils._pytree import tree_leaves

from autofit.base.errors import NonFiniteLossError, SpecError
from autofit.workload.data import Batch

PROBE_SAMPLES = 3  # the whole; its parts are the first sample and the other two
_PROBE_INPUTS = ("its 3 samples together", "its sample 0 alone", "its samples 1-2")  # the calls, in order
_RTOL, _ATOL = 1e-4, 1e-5  # fp32 on a CPU: batch sizes change only the summation order


def check_batch_dim(workload, *, key_path: str = "model") -> None:
    """Raise SpecError when `workload`'s model does not take the batch in dim 0 with samples
    independent of each other. Does nothing for a workload that needs no probe (a built-in
    or Hugging Face model, a declared `batch_dim`, a loss that couples samples)."""
    if not workload.probe_batch_dim:
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = workload.build_model()
        batch = workload.data.batch(PROBE_SAMPLES, torch.Generator().manual_seed(0))
        model.eval()
        parts = [_take(batch, 0, 1), _take(batch, 1, PROBE_SAMPLES)]
        calls: list = []  # what forward returned during one loss
        hook = model.register_forward_hook(lambda module, args, output: calls.append(output))
        try:
            with torch.no_grad():
                losses, outputs, error = _losses(workload, model, [batch, *parts], calls)
        finally:
            hook.remove()
    moved = _batch_elsewhere(outputs)
    if moved is not None:
        raise SpecError(f"{key_path}: its output {moved[0]} follows the micro batch in dim {moved[1]}, not in dim 0 "
                        f"where autofit splits batches: declare model.batch_dim: {moved[1]} if forward takes "
                        f"its inputs that way too (autofit moves the batch there), or return batch-first outputs")
    if error is not None:
        raise error
    whole, weighted = losses[0], _weighted(workload, model, parts, losses[1:])
    if not math.isclose(whole, weighted, rel_tol=_RTOL, abs_tol=_ATOL):
        raise SpecError(
            f"{key_path}: the samples of a micro batch are not independent: the loss of {PROBE_SAMPLES} samples "
            f"together is {whole:.6g}, their mean apart {weighted:.6g} (eval mode, fp32), so micro batches would "
            f"train something else than the batch. A sequence-first model given batch-first data mixes samples: "
            f"declare model.batch_dim (1: autofit moves the batch to dim 1); a loss that couples samples on "
            f"purpose (in-batch negatives): loss.per_sample: false; a model that takes the batch in dim 0 and "
            f"differs by its own randomness: model.batch_dim: 0")


def _losses(workload, model, batches: list[Batch], calls: list) -> tuple[list[float], list, SpecError | None]:
    """Each batch's loss and forward's output (None unless forward ran once: a user loss
    may call other methods). A SpecError from the loss (its logits did not fit its
    targets) is returned, to be raised only if the outputs' shapes do not say more."""
    losses, outputs, error = [], [], None
    for i, batch in enumerate(batches):
        calls.clear()
        try:
            loss = float(workload.loss_fn(model, batch))
        except SpecError as exc:
            error = error or exc
        else:
            if not math.isfinite(loss):
                # Not a sign of coupled samples: a loss that is not a number compares with nothing.
                raise NonFiniteLossError(
                    f"model: the loss is {loss} on call {i + 1} of {len(batches)} of the batch-dimension probe, "
                    f"on {_PROBE_INPUTS[i]} (the data's batch of {PROBE_SAMPLES} from seed 0; eval mode, fp32, "
                    f"before any training): the model or its loss gives a non-finite loss")
            losses.append(loss)
        outputs.append(calls[0] if len(calls) == 1 else None)
    return losses, outputs, error


def _weighted(workload, model, parts: list[Batch], losses: list[float]) -> float:
    """The whole batch's loss from its parts': weighted by what each loss is a mean over
    (labelled tokens, where the workload counts them), else by samples."""
    counts = None
    if workload.loss_items is not None:
        counts = [workload.loss_items(model, part) for part in parts]
        counts = None if any(c is None for c in counts) else [float(c) for c in counts]
    if counts is None or sum(counts) == 0:
        counts = [1.0, float(PROBE_SAMPLES - 1)]
    return sum(c * loss for c, loss in zip(counts, losses)) / sum(counts)


def _take(batch: Batch, start: int, stop: int) -> Batch:
    if isinstance(batch, dict):
        return {k: v[start:stop] for k, v in batch.items()}
    return tuple(t[start:stop] for t in batch)


def _batch_elsewhere(outputs: list) -> tuple[str, int] | None:
    """(an output's shape, the dim that follows the samples) when the outputs of the whole
    and its parts hold the batch somewhere, but no output holds it in dim 0."""
    if len(outputs) < 3 or any(o is None for o in outputs[:3]):
        return None
    leaves = [[t for t in tree_leaves(o) if isinstance(t, torch.Tensor) and t.ndim > 0] for o in outputs[:3]]
    if len({len(x) for x in leaves}) != 1:
        return None
    found = None
    for whole, one, two in zip(*leaves):
        if not (whole.ndim == one.ndim == two.ndim):
            continue
        dims = [d for d in range(whole.ndim) if one.shape[d] * 2 == two.shape[d]
                and one.shape[d] * PROBE_SAMPLES == whole.shape[d]]
        if 0 in dims:
            return None
        if dims and found is None:
            found = (f"[{', '.join(map(str, whole.shape))}]", dims[0])
    return found
