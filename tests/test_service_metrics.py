"""`autofit serve`'s Prometheus metrics and `/healthz`, read over HTTP as a monitoring system
would: a real client (urllib) and prometheus_client's own text parser."""

import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from autofit.base.errors import SpecError
from autofit.service.config import load_service_config
from autofit.service.daemon import Service
from autofit.service.health import LoopHealth
from autofit.service.metrics import PAIR_STATES, pair_state
from autofit.service.monitor import Monitor
from autofit.service.status import render_status
from conftest import run_cli, write_spec
from test_daemon import H100, model, NotifyListener, Serve, write_config, write_inventory

ANY_PORT = "127.0.0.1:0"  # the kernel picks a free loopback port; the state file says which


def get(url: str, timeout_s: float = 30.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape, parsed by prometheus_client."""
    status, text = get(url)
    assert status == 200, text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def current_state(samples: dict, model_name: str, gpu_kind: str) -> str | None:
    on = [s for s in PAIR_STATES if value(samples, "autofit_pair_state", model=model_name, gpu_kind=gpu_kind,
                                          state=s) == 1.0]
    assert len(on) <= 1, on  # a pair is in one state at a time
    return on[0] if on else None


@pytest.mark.slow
def test_metrics_follow_a_tune_over_http(tmp_path):
    config = write_config(tmp_path, metrics_address=ANY_PORT)
    write_spec(tmp_path / "models", model("alpha", trials=2), "alpha.yaml")
    inventory = write_inventory(tmp_path, H100)
    serve = Serve(config, inventory)
    try:
        state = serve.wait_for("the metrics URL", lambda s: (s["service"].get("metrics") or {}).get("url"), 120)
        url, healthz = state["service"]["metrics"]["url"], state["service"]["metrics"]["healthz"]
        seen, kind = [], None
        deadline_s = time.monotonic() + 240
        while time.monotonic() < deadline_s:
            samples = scrape(url)
            kind = kind or next((dict(ls)["gpu_kind"] for (n, ls) in samples if n == "autofit_pair_state"), None)
            now = current_state(samples, "alpha", kind) if kind else None
            if now and (not seen or seen[-1][0] != now):
                seen.append((now, total(samples, "autofit_trials_total", model="alpha")))
            if now == "tuned":
                break
            time.sleep(0.2)
        states = [s for s, _ in seen]
        assert states[-1:] == ["tuned"], (states, serve.log()[-3000:])
        assert "tuning" in states, states  # scraped while the tune ran
        trials_at = dict(seen)
        assert trials_at["tuning"] < trials_at["tuned"], seen  # the counter moved during the tune
        # The final figures: counters, the profile's speed and age, the service itself.
        assert value(samples, "autofit_pair_tunes_total", model="alpha", gpu_kind=kind) == 1
        assert value(samples, "autofit_pair_tunes_completed_total", model="alpha", gpu_kind=kind) == 1
        assert total(samples, "autofit_trials_total", model="alpha", gpu_kind=kind, status="ok") >= 1
        assert value(samples, "autofit_profile_samples_per_second", model="alpha", gpu_kind=kind) > 0
        assert value(samples, "autofit_profile_age_seconds", model="alpha", gpu_kind=kind) >= 0
        assert value(samples, "autofit_last_tune_duration_seconds", model="alpha", gpu_kind=kind) > 0
        assert value(samples, "autofit_models") == 1 and value(samples, "autofit_gpu_kinds") == 1
        assert value(samples, "autofit_gpus", gpu_kind=kind, state="idle") == 1
        assert value(samples, "autofit_service_healthy") == 1
        assert get(healthz)[0] == 200
        text = run_cli("status", "--config", config).stdout
        assert f"metrics: {url}" in text, text
        rc, _ = serve.terminate()
        assert rc == 0, serve.log()
    finally:
        serve.kill()
    with pytest.raises(urllib.error.URLError):  # nothing of ours listens after the command ends
        get(url, timeout_s=5)


class BlockingInventory:
    """The seam: wraps the service's inventory; once `armed`, reading it blocks the main loop
    (as a hung NVML call or NFS mount would) until `release` is set."""

    def __init__(self, inner):
        self.inner, self.emulated, self.description = inner, inner.emulated, inner.description
        self.armed, self.entered, self.release = threading.Event(), threading.Event(), threading.Event()

    def gpus(self):
        if self.armed.is_set():
            self.entered.set()
            self.release.wait(timeout=300)  # bounded: a broken test must not hang the suite
        return self.inner.gpus()

    def activity(self, gpu, own_pids):
        return self.inner.activity(gpu, own_pids)


def _wait(what: str, predicate, timeout_s: float = 60.0):
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        if result := predicate():
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.timing
def test_a_stuck_loop_fails_healthz_and_stops_the_watchdog(tmp_path, monkeypatch):
    listener = NotifyListener()
    monkeypatch.setenv("NOTIFY_SOCKET", listener.address)
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")  # stuck after 2 s without a turn; pings every 1 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    config = write_config(tmp_path, metrics_address=ANY_PORT)  # no models: the loop only polls
    service = Service(config, inventory_path=write_inventory(tmp_path, H100))
    seam = service.inventory = BlockingInventory(service.inventory)
    seen: dict = {}

    def pings() -> int:
        return listener.lines().count("WATCHDOG=1")

    def operator():  # runs beside the service, which needs the main thread for its signals
        try:
            base = _wait("the endpoint", lambda: service.monitor.url)
            seen["healthy"] = _wait("200 from /healthz", lambda: get(f"{base}/healthz")[0] == 200)
            _wait("a watchdog ping", lambda: pings() >= 1)
            seam.armed.set()
            _wait("the loop to block", seam.entered.is_set)
            seen["stuck"] = _wait("503 from /healthz", lambda: (lambda r: r if r[0] == 503 else None)(
                get(f"{base}/healthz")))
            seen["metric"] = value(scrape(f"{base}/metrics"), "autofit_service_healthy")
            before = pings()
            time.sleep(3.0)  # three ping intervals: a live loop would have pinged
            seen["pings_while_stuck"] = pings() - before
            seam.armed.clear()
            seam.release.set()
            seen["recovered"] = _wait("200 again", lambda: get(f"{base}/healthz")[0] == 200)
            after = pings()
            seen["pinged_again"] = _wait("pings again", lambda: pings() > after)
            seen["port"] = int(base.rsplit(":", 1)[1])
        finally:
            seam.release.set()
            os.kill(os.getpid(), signal.SIGTERM)  # the service's own handler: a clean stop

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    thread = threading.Thread(target=operator)
    thread.start()
    try:
        assert service.run() == 0
    finally:
        thread.join(timeout=120)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        listener.close()
    status, body = seen["stuck"]
    assert "has not turned" in body, body
    assert seen["metric"] == 0
    assert seen["pings_while_stuck"] == 0
    assert seen["recovered"] and seen["pinged_again"]
    # The server thread ended with run(): no thread of ours is left, the port is closed.
    assert not [t for t in threading.enumerate() if t.name == "metrics-http"]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", seen["port"]), timeout=5).close()


def test_loop_health_is_one_judgement_of_age_and_self_report(monkeypatch):
    health = LoopHealth(limit_s=60.0)
    assert not health.verdict().healthy  # before the first turn
    health.turned(ok=True)
    assert health.verdict().healthy
    health.turned(ok=False, why="cannot write the state file")
    assert health.verdict().reason == "cannot write the state file" and not health.verdict().healthy
    clock = [1000.0]
    monkeypatch.setattr("autofit.service.health.time.monotonic", lambda: clock[0])
    health.turned(ok=True)
    clock[0] += 61.0
    verdict = health.verdict()
    assert not verdict.healthy and "not turned for 61.0 s" in verdict.reason


def test_stall_limit_follows_the_watchdog(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "120000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert LoopHealth().limit_s == 120.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    monkeypatch.setenv("WATCHDOG_USEC", "5000000")
    assert LoopHealth().limit_s == 120.0  # the default, the unit's WatchdogSec


@pytest.mark.parametrize("text", ["localhost", "127.0.0.1:70000", "a b:1"])
def test_a_bad_metrics_address_is_one_line_and_exit_2(tmp_path, text):
    config = write_config(tmp_path, metrics_address=text)
    result = run_cli("serve", "--config", config, "--inventory", write_inventory(tmp_path, H100), timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "metrics_address" in result.stderr
    result = run_cli("serve", "--config", write_config(tmp_path), "--metrics-address", text, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "--metrics-address" in result.stderr


def test_off_in_yaml_turns_the_endpoint_off(tmp_path):
    config = write_config(tmp_path)
    config.write_text(config.read_text() + "metrics_address: off\n")  # YAML 1.1: a boolean
    assert load_service_config(config).metrics_listen is None
    with pytest.raises(SpecError, match="metrics_address"):
        config.write_text(config.read_text().replace("metrics_address: off", "metrics_address: 9851"))
        load_service_config(config)


def test_an_explicit_address_in_use_is_exit_2_and_the_default_only_costs_the_metrics(tmp_path, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("serve", "--config", write_config(tmp_path), "--inventory", write_inventory(tmp_path, H100),
                         "--metrics-address", f"127.0.0.1:{port}", timeout=120)
        assert result.returncode == 2 and "cannot listen" in result.stderr and result.stderr.count("\n") == 1
        # The default address taken by something else: the service runs on, without metrics.
        monkeypatch.setattr("autofit.service.config.DEFAULT_METRICS_ADDRESS", f"127.0.0.1:{port}")
        monitor = Monitor(load_service_config(write_config(tmp_path)))
        monitor.start()
        assert monitor.url is None and "cannot listen" in monitor.error
        assert "cannot listen" in render_status({"service": {"metrics": monitor.to_dict()}})


def test_status_shows_age_staleness_and_the_last_error_in_one_line():
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 3 * 3600))
    profile = {"path": "/p/alpha--h100.yaml", "config": "bf16-mixed mb=8x1", "samples_per_s": 10.0,
               "created": created, "stale": ["torch 2.10 -> 2.11"]}
    pair = {"model": "alpha", "device": "H100", "status": "queued", "tunes": 2, "profile": profile,
            "failure": {"kind": "crash", "error": "RuntimeError: boom\n  at line 3\n" + "x" * 400}}
    text = render_status({"service": {"metrics": {"address": "off"}}, "pairs": [pair]})
    assert "queued (stale)" in text and "3.0 h" in text and "metrics: off" in text
    (error,) = [line for line in text.splitlines() if "alpha on H100" in line]
    assert "crash: RuntimeError: boom at line 3" in error and len(error) < 200


def test_pair_states_name_tuned_and_stale():
    assert pair_state({"status": "ready"}) == "tuned"
    assert pair_state({"status": "queued", "profile": {"stale": ["torch 2.10 -> 2.11"]}}) == "stale"
    assert pair_state({"status": "queued", "profile": None}) == "queued"
    assert pair_state({"status": "nothing fits"}) == "nothing_fits"
    assert {pair_state({"status": s}) for s in ("tuning", "failed", "interrupted", "retrying", "inactive")} <= set(
        PAIR_STATES)
