"""`autofit serve` and `autofit status`: the service that keeps every model tuned for every GPU kind.

`daemon.py` is the loop; `pairs.py` decides which (model, GPU kind) pairs need a tune;
`scheduler.py` starts, watches and reaps the tunes; `job.py` is one tune in a worker thread;
`config.py` the service's YAML; `state.py` the state file and its lock; `status.py` the
status view; `inventory.py` the GPUs (NVML or an emulated file) and the idle rule;
`guard.py` stops a trial when another job appears on its GPU; `notify.py` speaks systemd's
notify protocol; `monitor.py` holds what monitoring sees: `health.py` (is the loop alive:
the watchdog's and `/healthz`'s one judgement), `metrics.py` (Prometheus collectors) and
`endpoint.py` (the HTTP server of both).
"""
