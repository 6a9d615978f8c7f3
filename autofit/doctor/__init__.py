"""`autofit doctor`: proves, on this machine's own device, that autofit's device paths hold.

    autofit doctor                      # the first GPU, else the CPU; one line per check
    autofit doctor --device 1 --json    # GPU 1, the report as JSON
    autofit doctor --check memory-cap   # one check (repeatable)

Each check runs in a child process of its own with a timeout (`run.py`), so a check that
crashes, hangs or breaks its CUDA context cannot take the others down. The checks are in
`checks.py` and `training.py` (one function each), their names in `names.py`, the table and
JSON in `report.py`; docs/doctor.md says what each one measures, its tolerance and what to
do when it fails.
"""
