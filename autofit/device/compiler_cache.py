"""Where inductor keeps its compiled graphs: autofit's state folder (`<state>/inductor`),
set in the environment before any child starts, so trials, the validation and `autofit train`
of a config load the graphs a tune compiled. No torch at import: `autofit tune`, whose process
never imports torch, sets it before it starts its trial worker.
"""

import os
from pathlib import Path

from autofit.base.errors import AutofitError
from autofit.base.paths import default_state_dir

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"  # read by inductor at each compile

_inductor_folder_set: str | None = None  # the folder this process put in the variable, if any


def use_inductor_cache(state_dir=None) -> str | None:
    """Keep inductor's compiled graphs in autofit's state folder (`<state>/inductor`), so
    a re-tune, a validation and `autofit train` of the same config load them instead of
    compiling again, across reboots (torch's default is a temp folder). Children inherit
    the setting. A folder the user set wins (one set here gives way to a later `state_dir`);
    without a state folder (no HOME) torch's default stays. Returns the folder in use, if any."""
    global _inductor_folder_set
    current = os.environ.get(INDUCTOR_CACHE_ENV)
    if not current or current == _torch_default_cache() or (current == _inductor_folder_set and state_dir is not None):
        try:
            folder = (default_state_dir() if state_dir is None else Path(state_dir)) / "inductor"
        except AutofitError:
            return None
        os.environ[INDUCTOR_CACHE_ENV] = _inductor_folder_set = str(folder)
    return os.environ[INDUCTOR_CACHE_ENV]


def _torch_default_cache() -> str:
    """Inductor's temp folder, which inductor writes into the variable the first time it asks
    for its folder (importing Dynamo's counters is enough): that value is torch's, not the
    user's. A private torch function; tests/test_fast_paths.py fails loudly if it moves."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(default_cache_dir())
