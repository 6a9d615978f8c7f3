"""The child of `autofit.measure.probe`: the batch-dimension probe of one spec, on the CPU.

    python -m autofit.measure.probe_child request.json result.json

Writes `{"status": "ok"}`, `{"status": "refused", "message", "traceback"}` (the probe refused
the model, or the user's code raised: exit 2 in the parent) or `{"status": "error", ...}`.
"""

import json
import sys
import traceback
from pathlib import Path

from autofit.base.atomic import atomic_write_text
from autofit.base.errors import AutofitError
from autofit.config.spec import parse_spec
from autofit.workload import build_workload
from autofit.workload.probe import check_batch_dim
from autofit.measure.process import exit_with_parent

_TRACEBACK_CHARS = 8000


def run(request: dict) -> dict:
    try:
        spec = parse_spec(request["spec"], source_dir=Path(request["source_dir"]))
        check_batch_dim(build_workload(spec))
    except AutofitError as exc:  # the probe's refusal, or the user's code raised
        cause = exc.__cause__ or exc
        return {"status": "refused", "message": str(exc),
                "traceback": "".join(traceback.format_exception(cause))[-_TRACEBACK_CHARS:]}
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the parent says what happened
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        return {"status": "error", "message": f"{type(exc).__name__}: {first}"}
    return {"status": "ok"}


def main(request_path: str, result_path: str) -> int:
    exit_with_parent(Path(request_path).parent)
    atomic_write_text(result_path, json.dumps(run(json.loads(Path(request_path).read_text()))) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
