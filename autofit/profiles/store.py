"""The profile store: a folder of profile YAMLs, one per (model, device kind), and
`load_profile`, which picks the one made for the GPU this process will train on.

    autofit profiles list [--store DIR] [--json]
    profile = autofit.load_profile("tiny-gpt")            # by model name, for this device
    profile = autofit.load_profile("profiles/tiny-gpt--cpu.yaml")

The folder is `$AUTOFIT_STORE`, else `./profiles`. Devices are probed through NVML, so
loading a profile never creates a CUDA context in the caller's process.
"""

# `ProfileStore.list` shadows the builtin in the class body; string annotations keep
# `list[...]` meaning the builtin there.
from __future__ import annotations

import os
import re
from pathlib import Path

from loguru import logger

from autofit.base.errors import ProfileError
from autofit.base.paths import check_path_text, default_store_dir
from autofit.base.sizes import format_bytes
from autofit.config.spec import ModelSpec
from autofit.device.budget import Budget, budget_for
from autofit.device.probe import DeviceInfo, probe_devices, select_device, torch_version, with_memory_budget
from autofit.profiles.profile import device_from_info, Profile

_LISTED_IN_ERRORS = 8  # profiles named in a "not found" message before "... and N more"


class ProfileStore:
    """Profiles on disk, found by model name and device fingerprint."""

    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root is not None else default_store_dir()
        self._devices: list[DeviceInfo] | None = None

    def __repr__(self) -> str:
        return f"ProfileStore({str(self.root)!r})"

    def list(self) -> list[tuple[Path, Profile]]:
        """Every readable profile, by file name. A file that does not parse is skipped with
        a warning: one bad file must not hide the others."""
        if not self.root.is_dir():
            return []
        found = []
        # Dot files are atomic-write temporaries (or editor swap files), never profiles.
        paths = [p for p in self.root.iterdir() if p.suffix in (".yaml", ".yml") and not p.name.startswith(".")]
        for path in sorted(paths):
            try:
                found.append((path, Profile.load(path)))
            except ProfileError as exc:
                logger.warning("skipping {}", exc)
        return found

    def find(self, name: str, fingerprint: str | None = None, *,
             spec_hash: str | None = None) -> list[tuple[Path, Profile]]:
        """Profiles of model `name` (for one device kind / spec version if given), newest first."""
        matches = [(path, p) for path, p in self.list()
                   if p.model.name == name
                   and (fingerprint is None or p.device.fingerprint == fingerprint)
                   and (spec_hash is None or p.model.spec_hash == spec_hash)]
        return sorted(matches, key=lambda item: item[1].created, reverse=True)

    def save(self, profile: Profile) -> Path:
        """Atomically, as root/<model>--<device>.yaml: re-tuning replaces the old profile."""
        return profile.save(self.root / profile.file_name)

    def select(self, name: str, device: DeviceInfo) -> tuple[Path, Profile]:
        """The profile of `name` for `device`: its fingerprint, else the closest one for the
        same GPU name (with a warning saying what differs), else a ProfileError."""
        here = device_from_info(device)
        candidates = self.find(name)
        exact = [c for c in candidates if c[1].device.fingerprint == here.fingerprint]
        if exact:
            return exact[0]
        # An emulated card's profile (a smaller budget, an inventory file's GPU) is used only
        # when that card is asked for, and so by its exact fingerprint: never as the closest.
        same_gpu = [c for c in candidates if c[1].device.name == here.name
                    and not c[1].device.is_emulated and not here.is_emulated]
        if not same_gpu:
            raise ProfileError(self._not_found(name, here.name))
        # min() keeps the first of equals, and candidates are newest first.
        path, profile = min(same_gpu, key=lambda c: len(c[1].device_differences(here)))
        logger.warning("no profile of {} for this exact device ({}); using the closest, {}, which differs: {}",
                       name, here.fingerprint, path, _differences(profile, here))
        return path, profile

    def stale_reasons(self, profile: Profile, spec: ModelSpec | None = None, *,
                      devices: list[DeviceInfo] | None = None) -> list[str]:
        """Why `profile` may no longer be the fastest choice (empty: it is current).

        `spec`, when it is the profile's model, is compared by spec hash. The driver is
        compared with this machine's GPUs of the profile's kind (`devices`, probed if not
        given); a profile for a GPU that is not here cannot be judged on its driver.
        """
        reasons = []
        if spec is not None and spec.name == profile.model.name and spec.spec_hash != profile.model.spec_hash:
            reasons.append("spec hash changed: the model.yaml was edited since it was tuned")
        # Minor torch releases change kernels and fusion; patch releases do not (as the fingerprint).
        if _torch_minor(profile.device.torch) != _torch_minor(torch_version()):
            reasons.append(f"torch changed: tuned with {profile.device.torch}, running {torch_version()}")
        if profile.device.driver is not None:
            if devices is None:
                devices = self._probed()
            drivers = {d.driver_version for d in devices if d.name == profile.device.name and d.driver_version}
            tuned_major = _major(profile.device.driver)
            if drivers and tuned_major not in {_major(v) for v in drivers}:
                reasons.append(f"driver major changed: tuned with {profile.device.driver}, "
                               f"here {', '.join(sorted(drivers))}")
        return reasons

    def _probed(self) -> list[DeviceInfo]:
        # One NVML probe per store object: listing 50 profiles must not probe 50 times.
        if self._devices is None:
            self._devices = probe_devices()
        return self._devices

    def _not_found(self, name: str, device_name: str) -> str:
        everything = self.list()
        if not everything:
            has = f"the store {self.root}/ has no profiles"
        else:
            listed = [f"{p.model.name} on {p.device.name} ({path.name})" for path, p in everything[:_LISTED_IN_ERRORS]]
            more = len(everything) - _LISTED_IN_ERRORS
            has = f"the store {self.root}/ has: " + "; ".join(listed) + (f"; and {more} more" if more > 0 else "")
        budgets = sorted({b for _, p in everything
                          if p.model.name == name and p.device.name == device_name and (b := tuned_budget(p))})
        if budgets:
            # Tuned under emulated budgets only: those are what the user can ask for, not the store's listing.
            return (f"no profile of model {name!r} for the whole of this device ({device_name}); it has profiles "
                    f"tuned under --memory-budget {', '.join(budgets)} (an emulated card): pass one (`autofit profiles show {name} "
                    f"--memory-budget {budgets[0]}`), or tune it whole: `{tune_hint(self.root)}`")
        emulated = any(p.model.name == name and p.device.is_emulated for _, p in everything)
        hint = (" (a profile tuned for an emulated card is used only when asked for: by its file name, or by "
                "the --memory-budget it was tuned under)" if emulated else "")
        return (f"no profile of model {name!r} for this device ({device_name}); {has}{hint}. Make one "
                f"here with `{tune_hint(self.root)}` (the model.yaml named {name})")


_BUDGET_TAG = re.compile(r"-budget-(\d+)(?:_(\d+))?(b|kib|mib|gib)(?:-|$)")  # device.probe's fingerprint tag
_UNITS = {"b": "B", "kib": "KiB", "mib": "MiB", "gib": "GiB"}


def tuned_budget(profile: Profile) -> str | None:
    """The `--memory-budget` a profile was tuned under ("256.00MiB"), read from its device's
    fingerprint tag; None for one tuned for the whole device."""
    found = _BUDGET_TAG.search(profile.device.fingerprint)
    if found is None:
        return None
    whole, fraction, unit = found.groups()
    return f"{whole}{'.' + fraction if fraction else ''}{_UNITS[unit]}"


def tune_hint(root: Path) -> str:
    """The command that writes a profile into the store at `root`."""
    out = "" if root == Path("profiles") else f" --out {root}"
    return f"autofit tune MODEL.yaml{out}"


def _major(version: str) -> str:
    return version.split(".")[0]


def _torch_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def _differences(profile: Profile, here) -> str:
    diffs = profile.device_differences(here)
    # Same name and numbers but another fingerprint: MIG slice, core count, emulation.
    return "; ".join(diffs) or f"fingerprint {profile.device.fingerprint} vs {here.fingerprint}"


def _as_store(store: ProfileStore | str | Path | None) -> ProfileStore:
    return store if isinstance(store, ProfileStore) else ProfileStore(store)


def _device_info(device: DeviceInfo | str | int | None) -> DeviceInfo:
    """NVML only: the caller's process keeps its CUDA uninitialised until it wants it."""
    return device if isinstance(device, DeviceInfo) else select_device(device)


def _file_in(store: ProfileStore, text: str) -> Path | None:
    """`text` as a profile file: a path, or a file name / stem inside the store."""
    path = Path(text)
    if path.is_file():
        return path
    for candidate in (store.root / text, store.root / f"{text}.yaml"):
        if candidate.is_file():
            return candidate
    # Meant as a file but missing: Profile.load says so, rather than a lookup by name.
    return path if path.suffix in (".yaml", ".yml") or os.sep in text else None


def locate(path_or_name: str | Path, *, store: ProfileStore | str | Path | None = None,
           device: DeviceInfo | str | int | None = None,
           memory_budget: str | int | Budget | None = None) -> tuple[Path, Profile, list[str]]:
    """(path, profile, stale reasons) for a file or a model name; warns about a device
    mismatch and staleness. `load_profile`, `autofit train` and `autofit profiles
    show/export` use it. With `memory_budget`, a name finds first the profile tuned under
    that emulated budget (`tune --memory-budget`), else the whole device's; without it, a
    profile tuned under an emulated budget or for an emulated GPU is never handed out. A
    `Budget` is one a command already parsed."""
    if not isinstance(path_or_name, (str, os.PathLike)):
        raise ProfileError(f"profile: a model name or a profile file, got {type(path_or_name).__name__}")
    check_path_text(os.fspath(path_or_name), "profile", ProfileError)
    store = _as_store(store)
    info = _device_info(device)
    if not isinstance(memory_budget, Budget):
        memory_budget = budget_for(info, memory_budget, headroom=0.0)
    budget_bytes = memory_budget.requested_bytes
    emulated = None if budget_bytes is None else device_from_info(with_memory_budget(info, budget_bytes))
    here = device_from_info(info)
    path = _file_in(store, str(path_or_name))
    if path is not None:
        profile = Profile.load(path)
        # Tuned here, or under a budget or over ranks on this same device: asked for by name.
        tags = (f"{here.fingerprint}-budget-", f"{here.fingerprint}-x")
        if profile.device.fingerprint != here.fingerprint and not profile.device.fingerprint.startswith(tags):
            logger.warning("profile {} was tuned on another device ({}); here: {}. Differences: {}",
                           path, profile.device.name, here.name, _differences(profile, here))
    else:
        tuned = [] if emulated is None else store.find(str(path_or_name), emulated.fingerprint)
        path, profile = tuned[0] if tuned else store.select(str(path_or_name), info)
    reasons = store.stale_reasons(profile, devices=[info])
    if reasons:
        logger.warning("profile {} is stale ({}); re-run `autofit tune` to refresh it", path, "; ".join(reasons))
    return path, profile, reasons


def load_profile(path_or_name: str | Path, *, store: ProfileStore | str | Path | None = None,
                 device: DeviceInfo | str | int | None = None, memory_budget: str | int | None = None) -> Profile:
    """A profile from a file, or by model name from the store for this device.

    `device` is a GPU index, "cpu", or a probed `DeviceInfo`; None is the first GPU (else
    the CPU). No exact match falls back to the closest profile of the same GPU name with a
    warning; nothing for this GPU is a ProfileError naming what the store has. A profile
    tuned under an emulated budget is found only by that `memory_budget` ("16MiB", as
    given to `autofit tune`) or by its file name.
    """
    return locate(path_or_name, store=store, device=device, memory_budget=memory_budget)[1]


# --- `autofit profiles list` -----------------------------------------------------------


def list_rows(store: ProfileStore | str | Path | None = None, specs: tuple[ModelSpec, ...] = ()) -> list[dict]:
    """One plain dict per profile; `specs` lets stale detection compare spec hashes."""
    store = _as_store(store)
    by_name = {spec.name: spec for spec in specs}
    rows = []
    for path, p in store.list():
        c = p.config
        rows.append({
            "file": path.name, "path": str(path), "model": p.model.name, "device": p.device.name,
            "fingerprint": p.device.fingerprint, "precision": c.precision,
            "micro_batch_size": c.micro_batch_size, "grad_accum_steps": c.grad_accum_steps,
            "checkpoint_blocks": c.checkpoint_blocks, "freeze_blocks": c.freeze_blocks,
            "parallelism": c.parallelism, "world_size": c.world_size,
            "samples_per_s": p.measured.samples_per_s, "created": p.created,
            "memory_budget": tuned_budget(p),  # the --memory-budget it was tuned under; None: the whole device
            "stale": store.stale_reasons(p, by_name.get(p.model.name)),
        })
    return rows


def render_table(rows: list[dict], root: Path) -> str:
    if not rows:
        return f"no profiles in {root}/ (make one with `{tune_hint(root)}`)\n"
    header = ("FILE", "MODEL", "DEVICE", "BUDGET", "RANKS", "PRECISION", "MICROxACCUM", "CKPT", "FREEZE",
              "SAMPLES/S", "STALE")
    # RANKS: a profile is for one world size (`-xN` in its file name); 1 is one process.
    table = [header] + [(
        r["file"], r["model"], r["device"], r.get("memory_budget") or "-",
        "1" if r["world_size"] == 1 else f"{r['world_size']} {r['parallelism']}",
        r["precision"], f"{r['micro_batch_size']}x{r['grad_accum_steps']}",
        str(r["checkpoint_blocks"]), str(r["freeze_blocks"]), _number(r["samples_per_s"]),
        "; ".join(r["stale"]) if r["stale"] else "no",
    ) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    # The last column (stale reasons) is left unpadded: it can be long.
    return "".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] + "\n"
                   for row in table)


def _number(value) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) else str(value)


def frontier_table(profile: Profile) -> str:
    """The profile's points, smallest peak first, as comment lines (the output stays YAML)."""
    points = profile.points
    rows = [("#", "PEAK", "SAMPLES/S", "CONFIG")] + [
        (str(i), format_bytes(p.measured.peak_memory_bytes), _number(p.measured.samples_per_s),
         p.config.short() + ("  (winner)" if i == len(points) else ""))
        for i, p in enumerate(points, 1)]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3] for row in rows]
    title = ("frontier (at start the fastest point whose peak fits the memory available is run):"
             if profile.frontier else "frontier: the winner only (a profile written before frontiers)")
    return f"# {title}\n" + "".join(f"#   {line}\n" for line in lines)
