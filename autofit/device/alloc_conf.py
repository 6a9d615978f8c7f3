"""The CUDA caching allocator's settings that a config may change: expandable segments.

With `expandable_segments:True` the allocator grows one virtual segment per stream instead
of carving fixed-size segments, so a step's peak is not inflated by fragmentation (what a
larger micro batch often trips over near the cap). PyTorch reads the setting from
`PYTORCH_CUDA_ALLOC_CONF` when the allocator starts, so it is set before CUDA starts: in the
trial child before its device is touched, and by `autofit train` / `profile.apply` before
the model moves to the GPU. Other settings the user put in the variable are kept.
"""

import os
import sys

ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
_EXPANDABLE = "expandable_segments"


def with_expandable_segments(conf: str | None, enabled: bool) -> str:
    """`conf` (the variable's value) with expandable segments on or off, other settings kept."""
    items = [item.strip() for item in (conf or "").split(",") if item.strip()]
    items = [item for item in items if item.split(":", 1)[0].strip() != _EXPANDABLE]
    return ",".join(items + [f"{_EXPANDABLE}:{'True' if enabled else 'False'}"])


def expandable_segments_in(conf: str | None) -> bool:
    """Whether `conf` turns expandable segments on (the last mention wins, as in PyTorch)."""
    value = False
    for item in (conf or "").split(","):
        key, _, setting = item.partition(":")
        if key.strip() == _EXPANDABLE:
            value = setting.strip() == "True"
    return value


def set_expandable_segments(enabled: bool, env: dict | None = None) -> bool:
    """Set the allocator's setting for this process (before CUDA starts) or for `env` (a
    child's environment); returns whether a started allocator would have ignored it."""
    target = os.environ if env is None else env
    if not enabled and not expandable_segments_in(target.get(ALLOC_CONF_ENV)):
        return False  # nothing to undo: leave the user's variable untouched
    target[ALLOC_CONF_ENV] = with_expandable_segments(target.get(ALLOC_CONF_ENV), enabled)
    if env is not None:
        return False
    # Not imported: CUDA cannot have started (and the tune's parent need not pay torch's import).
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
