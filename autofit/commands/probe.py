"""`autofit probe`: the GPUs NVML sees (no CUDA context) and the CPU, with fingerprints and
the precisions each supports.

    autofit probe --json
"""

import json

from autofit.base.sizes import format_bytes
from autofit.device.probe import probe_devices


def main(args) -> int:
    devices = probe_devices()
    if args.json:
        print(json.dumps({"devices": [d.to_dict() for d in devices]}, indent=2))
        return 0
    for d in devices:
        where = "cpu" if d.index is None else f"cuda:{d.index}"
        cc = "" if d.compute_capability is None else f"  sm_{d.compute_capability[0]}{d.compute_capability[1]}"
        precisions = ",".join(k for k, ok in d.supports.items() if ok)
        print(f"{where:<7} {d.name}  {format_bytes(d.memory_total_bytes)} total, {format_bytes(d.memory_free_bytes)} "
              f"free, {format_bytes(d.memory_used_by_others_bytes)} used by others{cc}  [{precisions}]")
        print(f"        fingerprint {d.fingerprint}")
    return 0
