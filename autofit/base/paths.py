"""Where autofit keeps its state on this host."""

import os
from pathlib import Path

from autofit.base.errors import AutofitError, SpecError

STATE_DIR_ENV = "AUTOFIT_STATE_DIR"
STORE_ENV = "AUTOFIT_STORE"


def home_dir(setting: str) -> Path:
    """The user's home, asked for only when no variable names the folder: a service or a
    container may run without HOME (and without a passwd entry), and with XDG_* or
    AUTOFIT_* set it needs none. `setting` names the variables that would do instead."""
    try:
        home = Path.home()
    except (RuntimeError, KeyError, OSError):  # no HOME, and no passwd entry to fall back on
        home = None
    if home is None or str(home) in ("", "~"):
        raise AutofitError(f"no home folder (HOME is not set); set {setting}")
    return home


def default_state_dir() -> Path:
    """Where studies live: $AUTOFIT_STATE_DIR, else $XDG_STATE_HOME/autofit (~/.local/state/autofit)."""
    if os.environ.get(STATE_DIR_ENV):
        return Path(os.environ[STATE_DIR_ENV])
    if os.environ.get("XDG_STATE_HOME"):
        return Path(os.environ["XDG_STATE_HOME"]) / "autofit"
    return home_dir(f"{STATE_DIR_ENV} or XDG_STATE_HOME, or pass --state-dir") / ".local" / "state" / "autofit"


def sqlite_storage(state_dir: Path) -> str:
    """The default study storage: one SQLite file in the state folder."""
    return f"sqlite:///{Path(state_dir).resolve() / 'studies.db'}"


def default_store_dir() -> Path:
    """The profile store: $AUTOFIT_STORE, else ./profiles."""
    return Path(os.environ.get(STORE_ENV) or "profiles")


def default_cache_dir() -> Path:
    """$AUTOFIT_CACHE_DIR, else $XDG_CACHE_HOME/autofit (~/.cache/autofit)."""
    if os.environ.get("AUTOFIT_CACHE_DIR"):
        return Path(os.environ["AUTOFIT_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "autofit"
    return home_dir("AUTOFIT_CACHE_DIR or XDG_CACHE_HOME") / ".cache" / "autofit"


def ensure_folder(folder: Path, what: str) -> Path:
    """Create `folder` now, so a bad path fails before the work rather than after it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecError(f"{what}: cannot create {folder}: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK):
        raise SpecError(f"{what}: {folder} is not writable")
    return folder


# Linux's limits (NAME_MAX, PATH_MAX), in bytes: a longer name is refused by the kernel with
# ENAMETOOLONG at the first stat, which would otherwise surface as an untyped OSError.
NAME_MAX_BYTES = 255
PATH_MAX_BYTES = 4095


def check_path_text(text: str, what: str, error: type[AutofitError] = AutofitError) -> None:
    """`text` (a name or a path a store resolves) is one the file system can be asked
    about: not empty, no control character, each part and the whole within the kernel's
    limits. `error` naming `what` otherwise, before any file is looked at."""
    shown = repr(text) if len(text) <= 60 else f"{text[:40]!r}... ({len(text):,} characters)"
    if not text:
        raise error(f"{what}: empty; give a model name or a profile file")
    control = next((c for c in text if ord(c) < 32 or ord(c) == 127), None)
    if control is not None:
        raise error(f"{what}: {shown} contains the control character {control!r}")
    encoded = text.encode("utf-8", "surrogateescape")
    if len(encoded) > PATH_MAX_BYTES:
        raise error(f"{what}: {shown} is {len(encoded):,} bytes long; a path is at most {PATH_MAX_BYTES:,}")
    longest = max(encoded.split(b"/"), key=len)
    if len(longest) > NAME_MAX_BYTES:
        raise error(f"{what}: {shown} has a name of {len(longest):,} bytes; a file name is at most "
                    f"{NAME_MAX_BYTES}")
