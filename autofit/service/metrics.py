"""The service's Prometheus metrics, through `prometheus_client`'s registry and exposition.

Most figures describe the service's state, which the main loop owns: after each turn it
publishes the state dict it writes to state.json (`ServiceMetrics.publish`; a fresh dict
each time, never mutated after), and a custom collector turns the latest one into metric
families when a scrape comes, in the HTTP server's thread. Trial outcomes are a live
`Counter`, incremented by tune worker threads (the library's counters are thread-safe).

Labels are bounded: `model` (the spec files in the models folder), `gpu_kind` (the GPU
fingerprints on this host), `state` and `status` (fixed sets below). Docs: docs/service.md
§ Metrics and health.
"""

import datetime as dt
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from autofit.base.version import VERSION
from autofit.service.health import Verdict

# A pair's state for monitoring: the service's statuses (state.PAIR_STATUSES), with `ready`
# named `tuned` and a queued pair whose profile went stale told apart as `stale`.
PAIR_STATES = ("queued", "tuning", "tuned", "failed", "interrupted", "stale", "retrying", "nothing_fits",
               "inactive")
_GPU_STATES = ("idle", "tuning", "busy")  # busy: another job, not idle long enough, unreadable
# TrialRecord.status: the measurement's (measure/measurement.STATUSES) or `pruned`, an estimate
# over the budget that was never run.
TRIAL_STATUSES = ("ok", "oom", "unhealthy", "error", "timeout", "compile_error", "pruned")


def pair_state(pair: dict) -> str:
    """The monitoring state of a state.json pair row."""
    status = pair["status"]
    if status == "ready":
        return "tuned"
    if status == "queued" and (pair.get("profile") or {}).get("stale"):
        return "stale"
    return status.replace(" ", "_")


def unix_s(iso_utc: str | None) -> float | None:
    """An ISO-8601 UTC time the service wrote, as unix seconds; None when absent or unreadable."""
    try:
        return dt.datetime.fromisoformat(iso_utc).timestamp()
    except (TypeError, ValueError):
        return None


def age_s(iso_utc: str | None, now_unix_s: float) -> float | None:
    then_s = unix_s(iso_utc)
    return None if then_s is None else now_unix_s - then_s


def tune_wall_s(last_tune: dict | None) -> float | None:
    """The wall time of a pair's last finished tune."""
    start_s, end_s = unix_s((last_tune or {}).get("started")), unix_s((last_tune or {}).get("ended"))
    return None if start_s is None or end_s is None else end_s - start_s


class ServiceMetrics:
    """The registry `autofit serve` exposes, and the hooks that feed it."""

    def __init__(self, verdict: Callable[[], Verdict]):
        self.registry = CollectorRegistry(auto_describe=True)
        self._snapshot: dict = {}
        self._verdict = verdict
        self.trials = Counter("autofit_trials", "Trials reported by this service's tunes since it started, by outcome "
                              "(oom: measured out of memory; pruned: estimated over the budget, not run)",
                              ["model", "gpu_kind", "status"], registry=self.registry)
        self.registry.register(_StateCollector(self))

    def publish(self, state: dict) -> None:
        """The main loop's latest state (the state.json document); replaces the last one whole."""
        self._snapshot = state

    def count_trial(self, model: str, gpu_kind: str, status: str) -> None:
        """One trial record of a running tune (called from its worker thread)."""
        status = status if status in TRIAL_STATUSES else "other"  # a status added later: still bounded
        self.trials.labels(model=model, gpu_kind=gpu_kind, status=status).inc()


class _StateCollector(Collector):
    def __init__(self, metrics: ServiceMetrics):
        self._metrics = metrics

    def describe(self):
        return []  # built per scrape from the snapshot: nothing to pre-register

    def collect(self):
        state, verdict = self._metrics._snapshot, self._metrics._verdict()
        now_unix_s = time.time()
        yield from _service_families(state, verdict, now_unix_s)
        yield from _pair_families(state.get("pairs", []), now_unix_s)


def _service_families(state: dict, verdict: Verdict, now_unix_s: float):
    service = state.get("service", {})
    info = InfoMetricFamily("autofit_build", "The autofit version this service runs")
    info.add_metric([], {"version": VERSION})
    yield info
    yield GaugeMetricFamily("autofit_service_healthy", "1 while the main loop turns and reports itself well "
                            "(the judgement behind WATCHDOG=1 and /healthz)", value=float(verdict.healthy))
    yield GaugeMetricFamily("autofit_loop_last_turn_age_seconds", "Seconds since the main loop last turned",
                            value=verdict.last_turn_age_s)
    if (started_s := unix_s(service.get("started"))) is not None:
        yield GaugeMetricFamily("autofit_service_start_time_seconds", "Unix time the service started",
                                value=started_s)
    yield GaugeMetricFamily("autofit_models", "Model specs read from the models folder",
                            value=len(state.get("models", [])))
    yield GaugeMetricFamily("autofit_model_spec_errors", "Model spec files skipped because they do not parse",
                            value=len(state.get("spec_errors", [])))
    yield GaugeMetricFamily("autofit_queued_pairs", "(model, GPU kind) pairs waiting for a tune",
                            value=len(state.get("queue", [])))
    gpus = GaugeMetricFamily("autofit_gpus", "GPUs in the inventory by kind and state", labels=["gpu_kind", "state"])
    counts: dict[tuple[str, str], int] = {}
    for gpu in state.get("inventory", {}).get("gpus", []):
        kind_state = gpu["state"] if gpu["state"] in ("idle", "tuning") else "busy"
        counts[(gpu["fingerprint"], kind_state)] = counts.get((gpu["fingerprint"], kind_state), 0) + 1
    for kind in sorted({kind for kind, _ in counts}):
        for gpu_state in _GPU_STATES:
            gpus.add_metric([kind, gpu_state], counts.get((kind, gpu_state), 0))
    yield gpus
    yield GaugeMetricFamily("autofit_gpu_kinds", "Distinct GPU kinds (fingerprints) in the inventory",
                            value=len({kind for kind, _ in counts}))


def _pair_families(pairs: list[dict], now_unix_s: float):
    labels = ["model", "gpu_kind"]
    state = GaugeMetricFamily("autofit_pair_state", "1 for the state each (model, GPU kind) pair is in, else 0",
                              labels=[*labels, "state"])
    tunes = CounterMetricFamily("autofit_pair_tunes", "Tunes started for the pair, ever (kept across restarts)",
                                labels=labels)
    completed = CounterMetricFamily("autofit_pair_tunes_completed", "Tunes of the pair that ended with a profile",
                                    labels=labels)
    wall = GaugeMetricFamily("autofit_last_tune_duration_seconds", "Wall time of the pair's last finished tune",
                             labels=labels)
    speed = GaugeMetricFamily("autofit_profile_samples_per_second", "The pair's newest profile's validated "
                              "throughput", labels=labels)
    mfu = GaugeMetricFamily("autofit_profile_mfu_ratio", "The pair's newest profile's model FLOPs utilisation "
                            "(0-1; absent where the card's peak is unknown)", labels=labels)
    age = GaugeMetricFamily("autofit_profile_age_seconds", "Seconds since the pair's newest profile was written",
                            labels=labels)
    for pair in pairs:
        key = [pair["model"], pair["fingerprint"]]
        current = pair_state(pair)
        for name in PAIR_STATES:
            state.add_metric([*key, name], float(name == current))
        tunes.add_metric(key, pair.get("tunes", 0))
        completed.add_metric(key, pair.get("completed", 0))
        if (wall_s := tune_wall_s(pair.get("last_tune"))) is not None:
            wall.add_metric(key, wall_s)
        profile = pair.get("profile") or {}
        if profile:
            speed.add_metric(key, profile["samples_per_s"])
            if profile.get("mfu") is not None:
                mfu.add_metric(key, profile["mfu"])
            if (profile_age_s := age_s(profile.get("created"), now_unix_s)) is not None:
                age.add_metric(key, profile_age_s)
    yield from (state, tunes, completed, wall, speed, mfu, age)
