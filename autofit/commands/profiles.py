"""`autofit profiles list|show|export`: the profile store, a profile with its frontier as a
table, and a profile in another tool's terms (HF TrainingArguments, Lightning, env).

    autofit profiles list --json
    autofit profiles show tiny-gpt --memory-budget 16MiB
    autofit profiles export tiny-gpt --format hf --n-blocks 12
"""

import json
import sys
from pathlib import Path

from autofit.base.errors import ProfileError
from autofit.config.spec import load_spec
from autofit.device.probe import select_device
from autofit.profiles.export import FORMATS, render
from autofit.profiles.fitting import fit_now
from autofit.profiles.store import frontier_table, list_rows, locate, ProfileStore, render_table
from autofit.commands.args import check_count


def list_command(*, store: str | Path | None = None, spec_paths: tuple[str | Path, ...] = (),
                 as_json: bool = False) -> str:
    store = ProfileStore(store)
    rows = list_rows(store, tuple(load_spec(path) for path in spec_paths))
    if as_json:
        return json.dumps({"store": str(store.root), "profiles": rows}, indent=2) + "\n"
    return render_table(rows, store.root)


def show_command(name_or_path: str, *, store: str | Path | None = None, device: str | None = None,
                 memory_budget: str | None = None) -> str:
    """The profile's YAML, headed by comments naming its file, any staleness and its frontier."""
    path, profile, reasons = locate(name_or_path, store=store, device=device, memory_budget=memory_budget)
    header = f"# {path}\n" + "".join(f"# stale: {reason}\n" for reason in reasons) + frontier_table(profile)
    return header + profile.to_yaml()


def export_command(name_or_path: str, fmt: str, *, store: str | Path | None = None, device: str | None = None,
                   n_blocks: int | None = None, memory_budget: str | None = None) -> str:
    """One profile in `fmt`, at the fastest frontier point that fits the memory available now
    on `device` (or `memory_budget`)."""
    if fmt not in FORMATS:  # checked before any probing or file reading
        raise ProfileError(f"--format: must be one of {', '.join(FORMATS)}, got {fmt!r}")
    check_count("--n-blocks", n_blocks, maximum=100_000)
    info = select_device(device)  # NVML only: no CUDA context here
    path, profile, _reasons = locate(name_or_path, store=store, device=info, memory_budget=memory_budget)
    return render(fit_now(profile, memory_budget=memory_budget, device=info, name=str(path), export=True), fmt,
                  n_blocks=n_blocks)


def main(args) -> int:
    if args.profiles_command == "list":
        text = list_command(store=args.store, spec_paths=tuple(args.spec or ()), as_json=args.json)
    elif args.profiles_command == "show":
        text = show_command(args.profile, store=args.store, device=args.device, memory_budget=args.memory_budget)
    else:
        text = export_command(args.profile, args.format, store=args.store, device=args.device,
                              n_blocks=args.n_blocks, memory_budget=args.memory_budget)
    sys.stdout.write(text)
    return 0
