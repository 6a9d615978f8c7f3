"""Where autofit keeps its state on this host."""

import os
from pathlib import Path

STATE_DIR_ENV = "AUTOFIT_STATE_DIR"
STORE_ENV = "AUTOFIT_STORE"


def default_state_dir() -> Path:
    """Where studies live: $AUTOFIT_STATE_DIR, else $XDG_STATE_HOME/autofit (~/.local/state/autofit)."""
    if os.environ.get(STATE_DIR_ENV):
        return Path(os.environ[STATE_DIR_ENV])
    return Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "autofit"


def default_store_dir() -> Path:
    """The profile store: $AUTOFIT_STORE, else ./profiles."""
    return Path(os.environ.get(STORE_ENV) or "profiles")
