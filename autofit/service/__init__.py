"""`autofit serve` and `autofit status`: the service that keeps every model tuned for every GPU kind.

`daemon.py` is the loop; `job.py` one tune in a worker thread; `config.py` the service's YAML;
`state.py` the state file, its lock and the status view; `inventory.py` the GPUs (NVML or an
emulated file) and the idle rule; `guard.py` stops a trial when another job appears on its
GPU; `notify.py` speaks systemd's notify protocol. Nothing is imported here, so a trial child
that needs only `guard` does not pay for the rest.
"""
