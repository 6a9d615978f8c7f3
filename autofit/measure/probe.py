"""The batch-dimension probe (`autofit.workload.probe`) of a spec, in a child process of its
own (`autofit.measure.probe_child`): it runs the user's forward, which may hang, crash or
exit, and `tune` and `trial` run user forwards only in children, with a timeout
(`autofit train` runs it in its own process, as it runs the training). The parent side
imports neither torch nor the workload.
"""

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from autofit.base import stopping
from autofit.base.errors import InputError, TrialError, TrialTimeoutError
from autofit.config.spec import ModelSpec
from autofit.measure.process import child_env, failure_reason, kill_group, wait_for_child

_SKIP = "declare model.batch_dim to skip the probe (0: forward takes the batch in dim 0)"


def probe_batch_dim(spec: ModelSpec, *, timeout_s: float | None = None) -> None:
    """Refuse the spec's model as `workload.probe.check_batch_dim` would, run in a child:
    InputError (exit 2) for a model the probe refuses or whose code raised; TrialError for
    a child that crashed, TrialTimeoutError for one that hung. Nothing for a spec whose
    model needs no probe (`ModelSpec.probes_batch_dim`)."""
    if not spec.probes_batch_dim:
        return
    timeout_s = spec.search.trial_timeout_s if timeout_s is None else timeout_s
    started = time.perf_counter()
    # "autofit-trial-": a child whose parent was SIGKILLed removes a folder of that name.
    with tempfile.TemporaryDirectory(prefix="autofit-trial-probe-") as tmp:
        request, result, log = Path(tmp, "request.json"), Path(tmp, "result.json"), Path(tmp, "log")
        request.write_text(json.dumps({"spec": spec.to_dict(), "source_dir": str(spec.source_dir)}, default=str))
        with open(log, "wb") as log_file:
            proc = None
            try:
                with stopping.spawning():
                    proc = subprocess.Popen([sys.executable, "-m", "autofit.measure.probe_child", str(request),
                                             str(result)],
                                            stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                            env=child_env("cpu"), start_new_session=True)
                ended = wait_for_child(proc, timeout_s, None)
            finally:
                if proc is not None:
                    kill_group(proc)
        out = json.loads(result.read_text()) if ended == "exited" and result.exists() else None
        log_tail = log.read_text(errors="replace")[-4000:]
    if out is not None and out["status"] == "ok":
        return
    if out is not None and out["status"] == "refused":
        raise InputError(out["message"], traceback_text=out.get("traceback"))
    if out is not None:
        raise TrialError(f"model: the batch-dimension probe failed: {out['message']}; {_SKIP}")
    _status, reason = failure_reason(ended, proc.returncode, timeout_s, log_tail)
    error = TrialTimeoutError if ended == "timeout" else TrialError
    raise error(f"model: the batch-dimension probe (3 samples on the CPU) gave no answer: {reason} "
                f"(after {time.perf_counter() - started:.0f} s); {_SKIP}")
