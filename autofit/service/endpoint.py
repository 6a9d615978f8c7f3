"""The service's HTTP endpoint: `/metrics` (prometheus_client's WSGI app) and `/healthz`.

    metrics_address: 127.0.0.1:9851   # in autofit.yaml, or `autofit serve --metrics-address`
    metrics_address: off              # no HTTP endpoint at all

It is served by the standard library's WSGI server, one thread per request, in a thread
the service starts after taking its lock and stops (shutdown, close, join) before it exits.
"""

import ipaddress
import socket
import socketserver
import threading
from collections.abc import Callable
from wsgiref.simple_server import make_server, WSGIRequestHandler, WSGIServer

from prometheus_client import make_wsgi_app
from prometheus_client.registry import CollectorRegistry

from autofit.base.errors import SpecError
from autofit.service.health import Verdict

DEFAULT_METRICS_ADDRESS = "127.0.0.1:9851"  # loopback: nothing is exposed beyond the host unless asked
_JOIN_S = 5.0


def parse_address(text: str, key: str) -> tuple[str, int] | None:
    """`HOST:PORT`, `[IPv6]:PORT` or `off` (None); a SpecError names `key` otherwise.
    Port 0 asks the kernel for a free one (tests)."""
    text = text.strip()
    if text.lower() == "off":
        return None
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise SpecError(f"{key}: HOST:PORT (such as {DEFAULT_METRICS_ADDRESS}, [::1]:9851) or off, got {text!r}")
    if not _plausible_host(host):
        raise SpecError(f"{key}: {host!r} is neither an IP address nor a host name")
    return host, int(port)


def _plausible_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        labels = host.split(".")
        return all(label and len(label) <= 63 and label.replace("-", "").isalnum() for label in labels)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight never holds the service's exit


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # scrapes every 15 s would flood the journal
        pass


def _server_class(host: str) -> type[_Server]:
    if ":" not in host:
        return _Server
    # An IPv6 address: the family is a class attribute of socketserver's servers.
    return type("_Server6", (_Server,), {"address_family": socket.AF_INET6})


def health_app(metrics_app: Callable, verdict: Callable[[], Verdict]) -> Callable:
    """The WSGI app: /healthz answers the verdict (200 or 503), anything else the metrics."""

    def app(environ, start_response):
        if environ.get("PATH_INFO") == "/healthz":
            current = verdict()
            status = "200 OK" if current.healthy else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Cache-Control", "no-store")])
            return [(current.reason + "\n").encode()]
        return metrics_app(environ, start_response)

    return app


class Endpoint:
    """The HTTP server in its thread; `start` binds (OSError when it cannot), `stop` ends both."""

    def __init__(self, registry: CollectorRegistry, verdict: Callable[[], Verdict]):
        self._app = health_app(make_wsgi_app(registry), verdict)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, host: str, port: int) -> str:
        """Listen on (host, port); returns the base URL actually served (port 0 resolved)."""
        self._server = make_server(host, port, self._app, server_class=_server_class(host),
                                   handler_class=_QuietHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="metrics-http", daemon=True)
        self._thread.start()
        return f"http://{format_address(host, self._server.server_port)}"

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()  # returns once serve_forever has left its loop
        self._server.server_close()
        self._thread.join(timeout=_JOIN_S)
        self._server = self._thread = None
