"""Running the suite in several sittings: a deadline that stops it between measurements,
and the state that --resume picks up. The GPU machines this project borrows end a command
at 10 minutes; a full-size model's quick run takes longer than that.
"""

import json
import time
from pathlib import Path

from autofit.base.atomic import atomic_write_text
from autofit.base.errors import AutofitError

_started = time.monotonic()


def elapsed_s() -> float:
    return time.monotonic() - _started


def say(text: str) -> None:
    """One progress line, with the time since the suite started."""
    print(f"[{elapsed_s():6.0f}s] {text}", flush=True)


class Incomplete(Exception):
    """The deadline came before the suite finished; what it measured is saved for --resume."""


class Clock:
    """Stops the suite between measurements when the next one might not end before the
    deadline (the GPU machines here end a command at 10 minutes)."""

    def __init__(self, deadline_s: float | None):
        self.deadline_s, self.slowest_s = deadline_s, 0.0

    def left_s(self) -> float | None:
        return None if self.deadline_s is None else self.deadline_s - elapsed_s()

    def note(self, seconds: float) -> None:
        self.slowest_s = max(self.slowest_s, seconds)

    def room_for(self, seconds: float | None = None) -> bool:
        left = self.left_s()
        return left is None or left >= 1.5 * (self.slowest_s if seconds is None else seconds) + 20

    def check(self, what: str, seconds: float | None = None) -> None:
        if not self.room_for(seconds):
            raise Incomplete(f"stopped before {what}: {self.left_s():.0f}s left before the deadline")


class State:
    """Everything measured so far, saved after each measurement: --resume picks it up, so a
    suite longer than one sitting runs in several. Tune's study lives beside it in SQLite."""

    def __init__(self, folder: Path, *, identity: dict, resume: bool):
        self.folder, self.path, self.db = folder, folder / "state.json", folder / "studies.db"
        folder.mkdir(parents=True, exist_ok=True)
        if resume and self.path.exists():
            self.data = json.loads(self.path.read_text())
            if self.data["identity"] != identity:
                raise AutofitError(f"--resume: {self.path} belongs to another run ({self.data['identity']}); "
                                   f"drop --resume to start afresh, or pass another --state-dir")
            say(f"resuming from {self.path}: {sum(len(m['measured']) for m in self.data['models'].values())} "
                f"measurements already taken")
        else:
            self.db.unlink(missing_ok=True)  # a fresh study: tune starts from nothing
            self.data = {"identity": identity, "models": {}, "runner_overhead": None, "wall_s": 0.0}
        self.sitting_started = time.monotonic()

    def model(self, name: str) -> dict:
        return self.data["models"].setdefault(name, {"measured": {}, "predicted": {}, "tune": None,
                                                     "tune_wall_s": 0.0})

    @property
    def storage(self) -> str:
        return f"sqlite:///{self.db.resolve()}"

    def save(self) -> None:
        atomic_write_text(self.path, json.dumps(self.data, default=str) + "\n")

    def total_wall_s(self) -> float:
        return self.data["wall_s"] + time.monotonic() - self.sitting_started

    def close_sitting(self) -> None:
        self.data["wall_s"] = self.total_wall_s()
        self.sitting_started = time.monotonic()
        self.save()
