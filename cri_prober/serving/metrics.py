"""Prometheus metrics on a private registry, served at ``/metrics`` by a small asyncio HTTP server.

``prober_probe_total`` and ``prober_probe_duration_seconds`` are the kubelet's prober metrics with
its names, labels, values and buckets (docs/kubelet-semantics.md §6), so existing dashboards and
alerts work unchanged; the ``cri_prober_*`` metrics cover what the kubelet does not export (every
attempt's duration, transitions, timeouts, CRI calls, discovery freshness). A worker's series are
deleted when it stops, as the kubelet's are.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import prometheus_client
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cri_prober.discovery.model import ContainerInfo
from cri_prober.discovery.source import DiscoveryUpdate, NodeSource, Relisted
from cri_prober.errors import ConfigError
from cri_prober.manager.events import AttemptFinished, ManagerEvent, ResultChanged, WorkerStopped
from cri_prober.manager.probe_manager import ProbeManager
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.results import ProbeRecord, Published
from cri_prober.runtime.client import CriCall, CriClient

log = structlog.get_logger(__name__)

# The text exposition format generate_latest() writes.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REQUEST_TIMEOUT_SECONDS = 5.0
MAX_REQUEST_HEAD_BYTES = 8192

PROBE_TYPES = {
    ProbeKind.LIVENESS: "Liveness",
    ProbeKind.READINESS: "Readiness",
    ProbeKind.STARTUP: "Startup",
}
# The kubelet's result label values; it counts an attempt that could not run ("error") nowhere.
KUBELET_RESULTS = {
    "success": "successful",
    "warning": "successful",  # the kubelet publishes a warning as a success
    "failure": "failed",
    "unknown": "failed",  # our worker, like the kubelet's, publishes an unknown verdict as failure
}
ATTEMPT_RESULTS = ("success", "warning", "failure", "unknown", "error")
# Prometheus' Go client's DefBuckets, which the kubelet's histograms use; prometheus_client's own
# defaults differ (they add .075, .75 and 7.5), so they are spelled out.
GO_DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """Every metric cri-prober exports, fed by the manager's, discovery's and CRI's streams."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        worker_labels = ["probe_type", "container", "pod", "namespace"]
        self.probe_total = Counter(
            "prober_probe_total",
            # The kubelet's help text, word for word.
            "Cumulative number of a liveness, readiness or startup probe for a container by "
            "result.",
            ["probe_type", "result", "container", "pod", "namespace", "pod_uid"],
            registry=self.registry,
        )
        self.probe_duration = Histogram(
            "prober_probe_duration_seconds",
            "Duration in seconds for a probe response.",
            worker_labels,
            buckets=GO_DEFAULT_BUCKETS,
            registry=self.registry,
        )
        self.attempt_duration = Histogram(
            "cri_prober_probe_duration_seconds",
            "Duration in seconds of every probe attempt, by attempt result "
            "(success, warning, failure, unknown, or error: could not run).",
            [*worker_labels, "result"],
            buckets=GO_DEFAULT_BUCKETS,
            registry=self.registry,
        )
        self.transitions = Counter(
            "cri_prober_probe_transitions_total",
            "Changes of a published probe result, by the new result.",
            [*worker_labels, "result"],
            registry=self.registry,
        )
        self.timeouts = Counter(
            "cri_prober_probe_timeouts_total",
            "Probe attempts that failed because their timeoutSeconds expired.",
            worker_labels,
            registry=self.registry,
        )
        self.cri_requests = Counter(
            "cri_prober_cri_requests_total",
            "CRI calls made to the runtime, by method and gRPC status code.",
            ["method", "code"],
            registry=self.registry,
        )
        self.cri_duration = Histogram(
            "cri_prober_cri_request_duration_seconds",
            "Duration in seconds of CRI calls, by method and gRPC status code.",
            ["method", "code"],
            buckets=GO_DEFAULT_BUCKETS,
            registry=self.registry,
        )
        self.relist_duration = Histogram(
            "cri_prober_relist_duration_seconds",
            "Duration in seconds of relisting pods and containers from the runtime.",
            buckets=GO_DEFAULT_BUCKETS,
            registry=self.registry,
        )
        self.relist_staleness = Gauge(
            "cri_prober_relist_staleness_seconds",
            "Seconds since the last successful relist (+Inf before the first).",
            registry=self.registry,
        )
        self.execs_in_flight = Gauge(
            "cri_prober_execs_in_flight",
            "ExecSync calls holding an exec slot right now.",
            registry=self.registry,
        )
        self.execs_overdue = Gauge(
            "cri_prober_execs_overdue",
            "ExecSync calls past their probe's timeout, waiting for the runtime's answer without "
            "a slot (the exec's output is still open).",
            registry=self.registry,
        )
        self.containers_tracked = Gauge(
            "cri_prober_containers_tracked",
            "Containers with at least one probe configured.",
            registry=self.registry,
        )

    def follow(
        self, *, manager: ProbeManager, node: NodeSource, cri: CriClient
    ) -> Callable[[], None]:
        """Follow the manager, discovery and CRI calls; returns a function that stops it."""
        self.execs_in_flight.set_function(lambda: cri.execs_in_flight)
        self.execs_overdue.set_function(lambda: cri.execs_overdue)
        self.containers_tracked.set_function(lambda: manager.tracked())

        def staleness() -> float:
            # Discovery stamps relists with its default clock, time.monotonic.
            last = node.last_relist_ok
            return float("inf") if last is None else time.monotonic() - last

        self.relist_staleness.set_function(staleness)
        stops = [
            manager.events.subscribe(self.manager_event),
            node.updates.subscribe(self.discovery_update),
            cri.calls.subscribe(self.cri_call),
        ]

        def stop() -> None:
            for unsubscribe in stops:
                unsubscribe()

        return stop

    # -- the streams ----------------------------------------------------------------------------

    def manager_event(self, event: ManagerEvent) -> None:
        """Count attempts and transitions; forget a stopped worker's series."""
        if isinstance(event, AttemptFinished):
            self._attempt(event.container, event.kind, event.record)
        elif isinstance(event, ResultChanged):
            labels = _worker_labels(event.container, event.kind)
            self.transitions.labels(*labels, event.result.value).inc()
        elif isinstance(event, WorkerStopped) and not event.replaced:
            # A replaced worker (a changed spec) ends after its replacement started; its series
            # are the replacement's now (the labels name no worker), so deleting would reset them.
            self._forget(event.container, event.kind)

    def _attempt(self, container: ContainerInfo, kind: ProbeKind, record: ProbeRecord) -> None:
        """Count one attempt: the kubelet's metrics skip attempts that could not run."""
        labels = _worker_labels(container, kind)
        self.attempt_duration.labels(*labels, record.result).observe(record.duration)
        if record.timed_out:
            self.timeouts.labels(*labels).inc()
        result = KUBELET_RESULTS.get(record.result)
        if result is None:
            return
        self.probe_total.labels(labels[0], result, *labels[1:], container.pod.uid).inc()
        if result == "successful":
            # As the kubelet: only successful attempts are timed.
            self.probe_duration.labels(*labels).observe(record.duration)

    def _forget(self, container: ContainerInfo, kind: ProbeKind) -> None:
        labels = _worker_labels(container, kind)
        # Older prometheus_client versions raise KeyError for a series never created.
        with contextlib.suppress(KeyError):
            self.probe_duration.remove(*labels)
        with contextlib.suppress(KeyError):
            self.timeouts.remove(*labels)
        for result in ("successful", "failed", "unknown"):
            with contextlib.suppress(KeyError):
                self.probe_total.remove(labels[0], result, *labels[1:], container.pod.uid)
        for result in ATTEMPT_RESULTS:
            with contextlib.suppress(KeyError):
                self.attempt_duration.remove(*labels, result)
        for published in Published:
            with contextlib.suppress(KeyError):
                self.transitions.remove(*labels, published.value)

    def cri_call(self, call: CriCall) -> None:
        """Count one CRI call."""
        self.cri_requests.labels(call.method, call.code).inc()
        self.cri_duration.labels(call.method, call.code).observe(call.seconds)

    def discovery_update(self, update: DiscoveryUpdate) -> None:
        """Time relists; their failures show in the CRI call codes."""
        if isinstance(update, Relisted):
            self.relist_duration.observe(update.seconds)

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format."""
        return prometheus_client.generate_latest(self.registry)


def _worker_labels(container: ContainerInfo, kind: ProbeKind) -> tuple[str, str, str, str]:
    return (PROBE_TYPES[kind], container.name, container.pod.name, container.pod.namespace)


# -- the HTTP endpoint ----------------------------------------------------------------------------


def parse_address(address: str) -> tuple[str | None, int]:
    """Parse ``HOST:PORT`` (``[v6]:PORT``; an empty host means every interface)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"--metrics-address {address!r}: expected HOST:PORT")
    host = host.removeprefix("[").removesuffix("]")
    return host or None, int(port)


class MetricsServer:
    """A minimal HTTP/1.1 server for ``GET /metrics``; one request per connection."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._server: asyncio.Server | None = None
        self.port = 0
        # What stops the metrics following the daemon's streams; called by ``stop()``.
        self.unfollow: Callable[[], None] | None = None

    async def start(self, address: str) -> None:
        """Bind ``address`` and serve; raises ``ConfigError`` when it cannot be bound."""
        host, port = parse_address(address)
        try:
            self._server = await asyncio.start_server(
                self._handle, host, port, limit=MAX_REQUEST_HEAD_BYTES
            )
        except OSError as exc:
            raise ConfigError(f"--metrics-address {address}: cannot bind: {exc.strerror}") from exc
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("metrics_listening", address=address, port=self.port)

    async def stop(self) -> None:
        """Stop following and accepting; requests being answered finish on their own (each is
        bounded). Calling it twice is harmless."""
        if self.unfollow is not None:
            self.unfollow()
            self.unfollow = None
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_SECONDS):
                head = await reader.readuntil(b"\r\n\r\n")
                writer.write(self._respond(head))
                await writer.drain()
        except (
            TimeoutError,
            ConnectionError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
        ):
            pass  # a client that went away or never sent a whole request gets nothing
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def _respond(self, head: bytes) -> bytes:
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _response(400, "Bad Request", b"bad request\n")
        method, target, _version = parts
        if target.split("?", 1)[0] != "/metrics":
            return _response(404, "Not Found", b"not found: metrics are at /metrics\n")
        if method not in ("GET", "HEAD"):
            return _response(405, "Method Not Allowed", b"use GET\n", ("Allow", "GET, HEAD"))
        body = self.metrics.exposition()
        return _response(200, "OK", body, content_type=CONTENT_TYPE, head_only=method == "HEAD")


def _response(
    status: int,
    reason: str,
    body: bytes,
    *extra: tuple[str, str],
    content_type: str = "text/plain; charset=utf-8",
    head_only: bool = False,
) -> bytes:
    headers = [
        f"HTTP/1.1 {status} {reason}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in extra),
    ]
    return ("\r\n".join(headers) + "\r\n\r\n").encode("latin-1") + (b"" if head_only else body)


async def start_metrics(
    address: str, *, manager: ProbeManager, node: NodeSource, cri: CriClient
) -> MetricsServer:
    """Export metrics at ``http://address/metrics`` until the returned server's ``stop()``.

    Raises:
        ConfigError: ``address`` is malformed or cannot be bound.
    """
    # The kubelet exports no *_created series; neither do we (a process-wide switch).
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped there
    metrics = Metrics()
    server = MetricsServer(metrics)
    await server.start(address)
    server.unfollow = metrics.follow(manager=manager, node=node, cri=cri)
    return server


__all__ = [
    "KUBELET_RESULTS",
    "Metrics",
    "MetricsServer",
    "parse_address",
    "start_metrics",
]
