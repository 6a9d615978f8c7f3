"""The fleet's experience with a spec, for a GPU kind that has none yet: the profiles in the
store and the studies in the shared storage that the same spec (by `spec_hash`) has on other
kinds, as one `search.warm_start.WarmStart`.

One source kind is used, the one with the most evidence: a profile (validated) before a study
alone, then the most measured trials. Its ranking is its profile's config first, then its
study's measured configs by their speed; `search.warm_start` translates them to the new card.
"""

import optuna
from loguru import logger

from autofit.config.spec import ModelSpec
from autofit.config.train_config import TrainConfig
from autofit.profiles.store import ProfileStore
from autofit.search.shared import creation_lock
from autofit.search.study import read_records
from autofit.search.warm_start import WarmStart
from autofit.tuning.space import study_prefix

_RANKED_LIMIT = 8  # configs read per source: the translation uses the leaders only


def fleet_warm_start(spec: ModelSpec, fingerprint: str, world_size: int, *, store_dir, storage: str) -> WarmStart | None:
    """The best other kind's experience with `spec`, or None (a cold start)."""
    evidence: dict[str, tuple[bool, int, list[tuple[float, TrainConfig]]]] = {}
    for kind, profile_config, speed in _profiles(spec, fingerprint, world_size, store_dir):
        evidence[kind] = (True, 0, [(speed, profile_config)])
    for kind, measured in _studies(spec, fingerprint, world_size, storage).items():
        has_profile, _, ranked = evidence.get(kind, (False, 0, []))
        evidence[kind] = (has_profile, len(measured), ranked + sorted(measured, key=lambda m: -m[0]))
    if not evidence:
        return None
    kind = max(evidence, key=lambda k: evidence[k][:2])
    configs = tuple(dict.fromkeys(c for _, c in evidence[kind][2]))[:_RANKED_LIMIT]
    logger.info("{}: no study on {} yet; warm start from {} ({} config(s) ranked there)", spec.name, fingerprint,
                kind, len(configs))
    return WarmStart(from_kind=kind, ranked=configs)


def _profiles(spec: ModelSpec, fingerprint: str, world_size: int, store_dir):
    for _, profile in ProfileStore(store_dir).list():
        if (profile.model.spec_hash == spec.spec_hash and profile.device.fingerprint != fingerprint
                and profile.config.world_size == world_size):
            yield profile.device.fingerprint, profile.config, profile.measured.samples_per_s


def _studies(spec: ModelSpec, fingerprint: str, world_size: int, storage: str) -> dict[str, list]:
    """{other kind: [(samples/s, config) of its measured trials]} from the storage's studies."""
    prefix = study_prefix(spec)
    out: dict[str, list] = {}
    try:
        with creation_lock(storage):
            names = [n for n in optuna.get_all_study_names(storage) if n.startswith(prefix)]
        for name in names:
            kind = name.removeprefix(prefix)
            if kind == fingerprint or "-budget" in kind:  # its own, or an emulated budget's
                continue
            study = optuna.load_study(study_name=name, storage=storage)
            measured = [(r.samples_per_s, r.config) for r in read_records(study)
                        if r.status == "ok" and not r.repeat and r.config.world_size == world_size]
            if measured:
                out[kind] = measured
    except Exception as exc:  # experience is a bonus: a storage that cannot be read means a cold start
        logger.warning("{}: cannot read other GPU kinds' studies ({}); starting cold", spec.name, exc)
    return out
