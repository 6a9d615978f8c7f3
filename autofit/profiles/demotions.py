"""Out-of-memory demotions, recorded beside the profile they happened under
(`<profile stem>.demotions.json`): `autofit train` and `plan.step(batch=...)` append each
one; the next `autofit tune` of that spec starts from where training went on."""

import json
from pathlib import Path

from loguru import logger

from autofit.base.atomic import atomic_write_text
from autofit.base.errors import SpecError
from autofit.train.recover import Demotion

DEMOTIONS_SUFFIX = ".demotions.json"  # beside a profile: its runs' out-of-memory recoveries


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
        path.replace(path.with_name(path.name + ".unreadable"))
    events.append(event.to_dict() | {"spec_hash": spec_hash})
    return atomic_write_text(path, json.dumps({"schema": 1, "demotions": events}, indent=2) + "\n")


def _demotion_events(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    try:
        events = json.loads(path.read_text())["demotions"]
        for e in events:
            Demotion.from_dict(e)  # every event must parse, or none is trusted
        return events
    except (OSError, ValueError, KeyError, TypeError, AttributeError, SpecError) as exc:
        logger.warning("skipping unreadable demotions file {}: {}", path, exc)
        return []
