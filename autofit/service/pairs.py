"""What the service should do: every (model, GPU kind) pair, its status, and the queue of pairs
with no valid profile and nothing holding them back.

A pair's status follows from the store and from how its last tune ended (`job.py`'s table):
`ready` with a current profile, `nothing fits` until the spec or headroom changes, `failed` or
`retrying` while a back-off runs, else `queued`.
"""

import time
from pathlib import Path

from autofit.config.spec import ModelSpec
from autofit.device.probe import DeviceInfo
from autofit.profiles.store import ProfileStore
from autofit.tuning.space import device_for_ranks
from autofit.service.inventory import Gpu
from autofit.service.job import retry_text
from autofit.service.state import pair_key, PairState


def plan(pairs: dict[str, PairState], specs: dict[str, tuple[Path, ModelSpec]], gpus: list[Gpu], *,
         store_dir: Path, tuning: set[str], multi_gpu: bool, headroom) -> list[str]:
    """Update every pair's status in `pairs` (adding new ones) and return the queue: the keys
    of pairs to tune. `tuning`: the keys being tuned now; `headroom(spec)`: the headroom a
    tune of `spec` uses."""
    store = ProfileStore(store_dir)
    profiles = store.list()  # one read of the store per poll
    devices = [g.device for g in gpus]
    queue, active = [], set()
    for name, (_, spec) in sorted(specs.items()):
        for fingerprint, device, world_size in kinds(spec, gpus, multi_gpu=multi_gpu):
            key = pair_key(name, fingerprint)
            active.add(key)
            pair = pairs.setdefault(key, PairState(model=name, fingerprint=fingerprint, device=device.name,
                                                   world_size=world_size))
            pair.spec_hash = spec.spec_hash
            mine = sorted((item for item in profiles if item[1].model.name == name
                           and item[1].device.fingerprint == fingerprint),
                          key=lambda item: item[1].created, reverse=True)
            stale = store.stale_reasons(mine[0][1], spec, devices=devices) if mine else []
            pair.profile = profile_summary(*mine[0], stale) if mine else None
            if _decide(pair, spec, tuning=key in tuning, ready=bool(mine and not stale), stale=stale,
                       headroom=headroom(spec)):
                queue.append(key)
    for key, pair in pairs.items():
        if key not in active:
            pair.status, pair.detail = "inactive", "the model or this GPU kind is not present now"
    return queue


def _decide(pair: PairState, spec: ModelSpec, *, tuning: bool, ready: bool, stale: list[str],
            headroom: float) -> bool:
    """Set the pair's status; True when it should be tuned."""
    nothing, failure = pair.nothing_fits, pair.failure
    if tuning:
        pair.status = "tuning"
    elif ready:
        pair.status, pair.detail = "ready", None
    elif nothing and nothing["spec_hash"] == spec.spec_hash and nothing["headroom"] == headroom:
        pair.status, pair.detail = "nothing fits", nothing["message"]
    elif failure and failure.get("spec_hash") == spec.spec_hash and (
            failure.get("final") or (failure.get("retry_after_unix_s") or 0) > time.time()):
        # Final after MAX_ATTEMPTS timeouts or crashes; else waiting out its back-off.
        pair.status = "failed" if failure.get("final") else "retrying"
        pair.detail = retry_text(failure)
    else:
        if failure and failure.get("spec_hash") == spec.spec_hash:
            pair.status, pair.detail = "queued", f"back-off over, to retry after: {retry_text(failure)}"
        elif pair.status != "interrupted":  # keep saying why it stopped until it runs again
            pair.status = "queued"
            pair.detail = ("stale: " + "; ".join(stale)) if stale else "no profile for this GPU kind"
        return True
    return False


def kinds(spec: ModelSpec, gpus: list[Gpu], *, multi_gpu: bool) -> list[tuple[str, DeviceInfo, int]]:
    """(fingerprint, device, ranks) of each profile `spec` should have on this host: one per
    GPU kind, and with `multi_gpu` one over all N > 1 GPUs of a kind whose global batch
    splits N ways."""
    by_kind: dict[str, list[Gpu]] = {}
    for gpu in gpus:
        by_kind.setdefault(gpu.device.fingerprint, []).append(gpu)
    out = [(fingerprint, same[0].device, 1) for fingerprint, same in by_kind.items()]
    if multi_gpu:
        out += [(device_for_ranks(same[0].device, len(same)).fingerprint, same[0].device, len(same))
                for same in by_kind.values()
                if len(same) > 1 and spec.train.global_batch_size % len(same) == 0]
    return out


def profile_summary(path: Path, profile, stale: list[str]) -> dict:
    return {"path": str(path), "spec_hash": profile.model.spec_hash, "config": profile.config.short(),
            "samples_per_s": profile.measured.samples_per_s, "created": profile.created, "stale": stale,
            # Which hosts sharing the study measured its trials, and which one validated it.
            "workers": profile.search.workers, "validated_by": profile.search.validated_by,
            "mfu": profile.search.mfu}
