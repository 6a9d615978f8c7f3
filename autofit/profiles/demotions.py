"""Out-of-memory demotions, recorded beside the profile they happened under
(`<profile stem>.demotions.json`): `autofit train` and `plan.step(batch=...)` append each
one; the next `autofit tune` of that spec starts from where training went on."""

import json
from pathlib import Path
from typing import Literal, TypedDict

from loguru import logger

from autofit.base.atomic import atomic_write_text, guarded_write
from autofit.base.documents import read_json
from autofit.base.errors import AutofitError, ProfileError
from autofit.config.reader import read_as
from autofit.config.train_config import Demotion

DEMOTIONS_SUFFIX = ".demotions.json"  # beside a profile: its runs' out-of-memory recoveries


class _Event(TypedDict):
    """`Demotion.to_dict()` and the spec hash of the run it happened in."""

    step: int
    from_config: dict
    to_config: dict
    reason: str
    time: str
    spec_hash: str


class _Document(TypedDict):
    schema: Literal[1]
    demotions: list[_Event]


def demotions_path(profile_path: str | Path) -> Path:
    """`<profile stem>.demotions.json` beside the profile (which need not exist yet)."""
    profile_path = Path(profile_path)
    return profile_path.with_name(profile_path.stem + DEMOTIONS_SUFFIX)


def read_demotions(profile_path: str | Path, *, spec_hash: str | None = None) -> list[Demotion]:
    """The recorded demotions of a profile's runs, oldest first; with `spec_hash`, only those
    of that version of the model.yaml. An unreadable file is warned about and skipped."""
    return [Demotion.from_dict(e) for e in _demotion_events(demotions_path(profile_path))
            if spec_hash is None or e.get("spec_hash") == spec_hash]


def record_demotion(profile_path: str | Path, event: Demotion, *, spec_hash: str) -> Path:
    """Append `event` to the profile's demotions file (rewritten atomically)."""
    path = demotions_path(profile_path)
    events = _demotion_events(path)
    if path.exists() and not events:
        # Unreadable: kept aside rather than overwritten.
        with guarded_write(path):
            path.replace(path.with_name(path.name + ".unreadable"))
    events.append(event.to_dict() | {"spec_hash": spec_hash})
    return atomic_write_text(path, json.dumps({"schema": 1, "demotions": events}, indent=2) + "\n")


def _demotion_events(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    try:
        events = read_as(read_json(path, error=ProfileError), _Document, document=str(path),
                         error=ProfileError)["demotions"]
        for e in events:
            Demotion.from_dict(e)  # every event must parse, or none is trusted
        return events
    except AutofitError as exc:
        logger.warning("skipping unreadable demotions file: {}", exc)
        return []
