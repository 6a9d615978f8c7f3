"""What an operator's monitoring sees of `autofit serve`: the loop's health, its metrics and
the HTTP endpoint serving both, as one object the daemon holds.

The daemon calls `start` once it holds its lock, `publish` with each state it builds,
`turned` on every turn of its loop, asks `healthy` before each watchdog ping, counts trial
records from tune workers through `count_trial`, and calls `stop` on its way out.
"""

from loguru import logger

from autofit.base.errors import AutofitError
from autofit.service.config import ServiceConfig
from autofit.service.endpoint import DEFAULT_METRICS_ADDRESS, Endpoint, format_address
from autofit.service.health import LoopHealth
from autofit.service.metrics import ServiceMetrics


class Monitor:
    def __init__(self, config: ServiceConfig, *, stall_limit_s: float | None = None):
        self.config = config
        self.health = LoopHealth(stall_limit_s)
        self.metrics = ServiceMetrics(self.health.verdict)
        self.endpoint = Endpoint(self.metrics.registry, self.health.verdict)
        self.url: str | None = None  # http://host:port once serving
        self.error: str | None = None  # why it is not serving, when it was meant to

    def start(self) -> None:
        """Serve /metrics and /healthz where the config says. An address the operator chose
        that cannot be served is a config error (exit 2); the default one taken by something
        else only costs the metrics, never the tuning: logged, and shown by `autofit status`."""
        listen = self.config.metrics_listen
        if listen is None:
            return
        try:
            self.url = self.endpoint.start(*listen)
        except OSError as exc:
            what = f"metrics_address {format_address(*listen)}: cannot listen: {exc.strerror or exc}"
            if self.config.metrics_address is not None:
                raise AutofitError(f"{what}; choose another address or `off`") from None
            self.error = what
            logger.error("{} (the default; set metrics_address to serve metrics elsewhere)", what)
            return
        logger.info("metrics on {}/metrics, health on {}/healthz", self.url, self.url)

    def stop(self) -> None:
        self.endpoint.stop()

    def turned(self, *, ok: bool, why: str = "") -> None:
        self.health.turned(ok=ok, why=why)

    def healthy(self) -> bool:
        return self.health.verdict().healthy

    def publish(self, state: dict) -> None:
        self.metrics.publish(state)

    def count_trial(self, model: str, gpu_kind: str, status: str) -> None:
        self.metrics.count_trial(model, gpu_kind, status)

    def to_dict(self) -> dict:
        """For state.json, so `autofit status` can say where the metrics are."""
        address = self.config.metrics_address or DEFAULT_METRICS_ADDRESS
        return {"address": address, "url": f"{self.url}/metrics" if self.url else None,
                "healthz": f"{self.url}/healthz" if self.url else None, "error": self.error}
