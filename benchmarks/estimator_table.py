"""The estimator, the search's calibrated prediction and the measured peak, side by side,
from a stored benchmark run (docs/estimator.md).

    python benchmarks/estimator_table.py benchmarks/results/2026-11-22-cpu-quick.json

The memory model is fitted on the first two configs of each model's grid, as the search
would be after its first two trials, and predicts every config of the grid.
"""

import json
import sys

from autofit.search.memory import fit_points

MiB = 2**20


def table(results: dict) -> str:
    rows = ["| model | config | estimate (MiB) | calibrated (MiB) | measured (MiB) | calibrated error |",
            "|---|---|---:|---:|---:|---:|"]
    for name, model in results["models"].items():
        grid = [e for e in model["grid"] if e["status"] == "ok" and e.get("predicted_peak_bytes")]
        fit = fit_points([(e["predicted_peak_bytes"], e["total_peak_bytes"]) for e in grid[:2]])
        for e in grid:
            calibrated = fit.predict(e["predicted_peak_bytes"])
            error = calibrated / e["total_peak_bytes"] - 1
            rows.append(f"| {name} | {e['short']} | {e['predicted_peak_bytes'] / MiB:.2f} | {calibrated / MiB:.2f} "
                        f"| {e['total_peak_bytes'] / MiB:.2f} | {error:+.1%} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(json.loads(open(sys.argv[1]).read())))
