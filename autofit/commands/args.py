"""Checks of command-line arguments, in one place: every command (and the doctor) checks its
counts, durations, folders and output files here, before any work, with one clear line.
`--memory-budget` has its parser in `autofit.base.sizes.parse_budget`; counts and durations
theirs in `autofit.config.arguments`, shared with the Python API."""

from pathlib import Path

from autofit.base.atomic import check_writable
from autofit.base.errors import SpecError
from autofit.config.arguments import check_count, check_seconds  # noqa: F401 - the commands' import


def parse_sets(pairs: list[str] | None) -> dict[str, str]:
    """`--set KEY=VALUE` pairs as a mapping."""
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key or not value:
            raise SpecError(f"--set: expected KEY=VALUE, got {pair!r}")
        out[key.strip()] = value.strip()
    return out


def check_output_file(path: str | None, what: str) -> None:
    """A file the command will write at its end, checked before the work: not a folder,
    and in a folder that exists (or can be made) and that we may write."""
    if path is not None:
        check_writable(Path(path), what)


def check_run_folder(folder: Path, *, resume: bool, overwrite: bool) -> None:
    """An earlier run's checkpoint is never replaced silently: --resume continues it,
    --overwrite replaces it, anything else is refused before any work."""
    if folder.exists() and not folder.is_dir():
        raise SpecError(f"--checkpoint-dir: {folder} is a file, not a folder")
    # checkpoint.pt of one process; `checkpoint` (and its `.old` twin) of several ranks
    held = [p.name for p in (folder / "checkpoint.pt", folder / "checkpoint", folder / "checkpoint.old") if p.exists()]
    if held and not (resume or overwrite):
        raise SpecError(f"{folder} already holds a run ({held[0]}); --resume continues it, --overwrite "
                        f"replaces it, --checkpoint-dir DIR starts another")
