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
import errno
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import prometheus_client
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cri_prober import fdlimit
from cri_prober.discovery.model import ContainerInfo
from cri_prober.discovery.source import DiscoveryUpdate, NodeSource, Relisted
from cri_prober.errors import ConfigError
from cri_prober.manager.events import AttemptFinished, ManagerEvent, ResultChanged, WorkerStopped
from cri_prober.manager.probe_manager import ProbeManager
from cri_prober.podspecs.registry import PodSpecs
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.results import ProbeRecord, Published
from cri_prober.runtime.client import CriCall, CriClient

log = structlog.get_logger(__name__)

# The text exposition format generate_latest() writes.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What metrics clients may hold, each and together (see ``MetricsServer``).

    64 connections are far more than any number of Prometheus servers scraping one node, and
    with the reserve they stay clear of probes even at a 1,024 limit: 64 + serve's ~20 own
    descriptors leave 940 for probes, and the reserve keeps 256 free whatever else is open.
    """

    max_connections: int = 64
    request_timeout: float = 5.0  # from accept to the last byte of the answer
    max_head_bytes: int = 8192
    fd_reserve: int = 256
    log_interval: float = 10.0
    accept_retry: float = 1.0  # after a failed accept (EMFILE): what asyncio waits too


# Connections taken from the backlog per readiness callback, and the backlog itself (asyncio's).
ACCEPT_BATCH = 100
BACKLOG = 100
# Input read and thrown away after an answer, waiting for the client to close (see _serve).
MAX_DISCARD_BYTES = 65536
# SO_LINGER on, 0 s: close() resets the connection and frees it at once.
_LINGER_RESET = struct.pack("ii", 1, 0)

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

    def follow_pod_sources(self, pod_specs: PodSpecs) -> None:
        """Export the ``--probes-from`` sources' freshness, pods and reads."""
        self.registry.register(_PodSourceCollector(pod_specs))

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
    """A minimal HTTP/1.1 server for ``GET /metrics``: one request per connection, bounded.

    The port is often reachable by anyone who reaches the node (the DaemonSet binds it on the
    host network), and every connection costs a file descriptor, the resource tcp, http and gRPC
    probes need too. So what a client can hold is bounded: at most ``max_connections`` at a
    time (more are closed as soon as they are accepted), ``request_timeout`` from accept to the
    last byte of the answer (so a half-sent request, or an answer never read, cannot hold one
    longer), a request head of at most ``max_head_bytes``, no keep-alive (one request per
    connection), and no connection at all while the process is within ``fd_reserve``
    descriptors of its limit. Connections turned away are counted and logged as one summary
    line per ``log_interval``, never a line (or a traceback) each.

    The accept loop is our own rather than ``asyncio.start_server``'s: asyncio accepts without
    any cap and logs a traceback for every failed accept (EMFILE), once a second per socket.
    """

    def __init__(self, metrics: Metrics, limits: ServerLimits | None = None) -> None:
        self.metrics = metrics
        self.limits = limits or ServerLimits()
        self.port = 0
        # What stops the metrics following the daemon's streams; called by ``stop()``.
        self.unfollow: Callable[[], None] | None = None
        self._sockets: list[socket.socket] = []
        self._paused: dict[int, asyncio.TimerHandle] = {}  # fd -> resume timer after EMFILE
        self._connections: set[asyncio.Task[None]] = set()
        self._refusals = _RefusalLog(self.limits)
        # Expositions: the one being made, how many were started, and the latest made.
        self._generation: asyncio.Task[None] | None = None
        self._generations_started = 0
        self._latest: tuple[int, bytes] = (0, b"")
        self._last_generation = (0.0, 0.0)  # (when it ended, how long it took), loop time

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return len(self._connections)

    async def start(self, address: str) -> None:
        """Bind ``address`` and serve; raises ``ConfigError`` when it cannot be bound."""
        host, port = parse_address(address)
        try:
            self._sockets = await _bind(host, port)
        except OSError as exc:
            raise ConfigError(f"--metrics-address {address}: cannot bind: {exc.strerror}") from exc
        self.port = self._sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        for sock in self._sockets:
            loop.add_reader(sock.fileno(), self._accept, sock)
        log.info(
            "metrics_listening",
            address=address,
            port=self.port,
            max_connections=self.limits.max_connections,
            fd_reserve=self.limits.fd_reserve,
        )

    async def stop(self) -> None:
        """Stop following and accepting, and end the connections being served (a scrape has
        nothing to lose). Calling it twice is harmless."""
        if self.unfollow is not None:
            self.unfollow()
            self.unfollow = None
        loop = asyncio.get_running_loop()
        for timer in self._paused.values():
            timer.cancel()
        self._paused.clear()
        for sock in self._sockets:
            loop.remove_reader(sock.fileno())
            sock.close()
        self._sockets = []
        for task in self._connections:
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._generation is not None:
            # Its thread cannot be interrupted; let it end rather than leave it to the loop's
            # shutdown (bounded by one exposition's time).
            await asyncio.wait([self._generation])
        self._refusals.flush()

    # -- accepting ------------------------------------------------------------------------------

    def _accept(self, sock: socket.socket) -> None:
        # Called when the listening socket is readable; takes what the backlog holds, up to a
        # batch, so one callback cannot hold the loop for long under a flood.
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _peer = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the client gave up while in the backlog
            except OSError as exc:
                # EMFILE, ENFILE, ENOBUFS, ENOMEM: nothing to accept with. The socket stays
                # readable, so stop watching it for a while instead of spinning; the kernel's
                # backlog holds (or drops) what arrives meanwhile.
                self._refusals.count("accept_failed", error=exc.strerror)
                self._pause(sock)
                return
            reason = self._refusal(conn)
            if reason is not None:
                conn.close()
                self._refusals.count(reason)
                continue
            conn.setblocking(False)
            task = asyncio.get_running_loop().create_task(self._serve(conn), name="metrics:conn")
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    def _refusal(self, conn: socket.socket) -> str | None:
        """Why ``conn`` (just accepted) must be closed at once, or None to serve it."""
        if len(self._connections) >= self.limits.max_connections:
            return "busy"
        limit = fdlimit.soft_limit()
        if limit is None:
            return None
        # Without /proc, the new descriptor's number is a lower bound: the kernel hands out the
        # lowest free one, so every number below it is taken.
        in_use = fdlimit.open_fds()
        if in_use is None:
            in_use = conn.fileno() + 1
        if limit - in_use < self.limits.fd_reserve:
            return "fd_reserve"
        return None

    def _pause(self, sock: socket.socket) -> None:
        fd = sock.fileno()
        if fd in self._paused:
            return
        loop = asyncio.get_running_loop()
        loop.remove_reader(fd)

        def resume() -> None:
            del self._paused[fd]
            loop.add_reader(fd, self._accept, sock)

        self._paused[fd] = loop.call_later(self.limits.accept_retry, resume)

    # -- one connection -------------------------------------------------------------------------

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        abort = answered = False
        try:
            async with asyncio.timeout(self.limits.request_timeout):
                try:
                    head = await self._read_head(conn)
                except _HeadTooLarge:
                    self._refusals.count("too_large")
                    response = _response(
                        431, "Request Header Fields Too Large", b"request head too large\n"
                    )
                else:
                    if head is None:
                        return  # the client closed before sending a whole request head
                    response = await self._respond(head)
                await loop.sock_sendall(conn, response)
                answered = True
                # Closing with unread input (a body, the rest of a head too large) would reset
                # the connection, and a reset can destroy the answer before the client reads
                # it: end our side, then read until the client closes, within the same limit.
                conn.shutdown(socket.SHUT_WR)
                await self._discard_until_eof(conn)
        except TimeoutError:
            # A half-sent request, an answer the client does not read, or a client that does
            # not close: reset rather than leave the kernel holding the unsent rest.
            if not answered:
                self._refusals.count("timed_out")
            abort = True
        except OSError:
            pass  # the client went away
        except Exception as exc:
            # A bug making the answer: counted in the summary line like the rest, rather than
            # a traceback per request, which a flood of requests would make a flood of lines.
            self._refusals.count("failed", error=f"{type(exc).__name__}: {exc}")
        finally:
            if abort:
                with contextlib.suppress(OSError):
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            conn.close()

    async def _read_head(self, conn: socket.socket) -> bytes | None:
        """The request head up to its blank line; None at EOF; ``_HeadTooLarge`` past the limit."""
        loop = asyncio.get_running_loop()
        limit = self.limits.max_head_bytes
        head = bytearray()
        while True:
            chunk = await loop.sock_recv(conn, 4096)
            if not chunk:
                return None
            head += chunk
            end = head.find(b"\r\n\r\n")
            if end >= 0 and end + 4 <= limit:
                return bytes(head[: end + 4])
            if len(head) >= limit:
                raise _HeadTooLarge

    async def _discard_until_eof(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        discarded = 0
        while discarded < MAX_DISCARD_BYTES and (chunk := await loop.sock_recv(conn, 4096)):
            discarded += len(chunk)

    async def _respond(self, head: bytes) -> bytes:
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _response(400, "Bad Request", b"bad request\n")
        method, target, _version = parts
        if target.split("?", 1)[0] != "/metrics":
            return _response(404, "Not Found", b"not found: metrics are at /metrics\n")
        if method not in ("GET", "HEAD"):
            return _response(405, "Method Not Allowed", b"use GET\n", ("Allow", "GET, HEAD"))
        body = await self._exposition()
        return _response(200, "OK", body, content_type=CONTENT_TYPE, head_only=method == "HEAD")

    # -- the exposition -------------------------------------------------------------------------

    async def _exposition(self) -> bytes:
        """The registry as text, made after this call began; concurrent requests share one.

        Making it is pure Python and takes about 1 ms per probe worker (0.5-0.8 s for 400-600
        workers, measured). On the loop, 64 concurrent scrapes would each stop every probe for
        that long, one after the other; so it is made in a thread (prometheus_client is
        thread-safe, and the gauges' callbacks only read numbers), one at a time: a request
        that arrives while one is being made waits for the next, which then answers every
        request that waited. An answer is never older than its request, and however many
        requests arrive, at most one exposition is being made.
        """
        wanted = self._generations_started + 1  # the first one that starts after now
        while self._latest[0] < wanted:
            if self._generation is None:
                self._generations_started += 1
                self._generation = asyncio.get_running_loop().create_task(
                    self._generate(self._generations_started), name="metrics:exposition"
                )
            # Shielded: a request that times out must not cancel the one others wait for.
            await asyncio.shield(self._generation)
        return self._latest[1]

    async def _generate(self, number: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            # Back to back (a flood of scrapes), expositions would keep a core busy: leave at
            # least as long as the last one took between two, so they use at most half of one.
            ended, took = self._last_generation
            if (delay := ended + took - loop.time()) > 0:
                await asyncio.sleep(delay)
            started = loop.time()
            body = await asyncio.to_thread(self.metrics.exposition)
            self._last_generation = (loop.time(), loop.time() - started)
            self._latest = (number, body)
        finally:
            self._generation = None


class _HeadTooLarge(Exception):
    """A request head longer than ``ServerLimits.max_head_bytes``."""


class _RefusalLog:
    """Counts connections the limits turned away; logs them as one line per interval.

    The first one arms a timer; when it fires, the interval's counts are logged as a single
    warning and reset, so a flood of any size costs one line per ``log_interval``.
    """

    REASONS = ("busy", "fd_reserve", "accept_failed", "timed_out", "too_large", "failed")

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.counts = dict.fromkeys(self.REASONS, 0)
        self.error: str | None = None
        self._timer: asyncio.TimerHandle | None = None

    def count(self, reason: str, *, error: str | None = None) -> None:
        self.counts[reason] += 1
        if error is not None:
            self.error = error
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.limits.log_interval, self.flush)

    def flush(self) -> None:
        """Log what was counted since the last line, if anything."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        total = sum(self.counts.values())
        if total == 0:
            return
        log.warning(
            "metrics_connections_refused",
            count=total,
            seconds=self.limits.log_interval,
            **self.counts,
            error=self.error,
            max_connections=self.limits.max_connections,
        )
        self.counts = dict.fromkeys(self.REASONS, 0)
        self.error = None


async def _bind(host: str | None, port: int) -> list[socket.socket]:
    """Listening sockets for ``host`` (None: every interface, IPv4 and IPv6), as asyncio's
    ``create_server`` makes them: SO_REUSEADDR, IPv6 sockets IPv6-only, non-blocking."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _name, sockaddr in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:
                continue  # a family this kernel lacks (IPv6 disabled): asyncio skips it too
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(sockaddr)
            sock.listen(BACKLOG)
            sock.setblocking(False)
        if not sockets:
            raise OSError(errno.EAFNOSUPPORT, os.strerror(errno.EAFNOSUPPORT))
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


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


class _PodSourceCollector(Collector):
    """The pod spec sources' state, read at scrape time (it is a handful of numbers each)."""

    def __init__(self, pod_specs: PodSpecs) -> None:
        self._pod_specs = pod_specs

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "cri_prober_pod_source_up",
            "1 while a --probes-from source's view is fresh, 0 while it is stale (its last good "
            "view is still used).",
            labels=["source"],
        )
        pods = GaugeMetricFamily(
            "cri_prober_pod_source_pods",
            "Pods in a --probes-from source's last good view.",
            labels=["source"],
        )
        invalid = GaugeMetricFamily(
            "cri_prober_pod_source_invalid_pods",
            "Pods a --probes-from source lists whose spec cri-prober cannot use (logged).",
            labels=["source"],
        )
        reads = CounterMetricFamily(
            "cri_prober_pod_source_reads",
            "Reads of a --probes-from source by result: polls, lists, and watch streams, "
            "events and bookmarks.",
            labels=["source", "result"],
        )
        for source in self._pod_specs.sources:
            up.add_metric([source.name], 0.0 if source.stale() else 1.0)
            pods.add_metric([source.name], float(len(source.pods)))
            invalid.add_metric([source.name], float(source.invalid_pods))
            reads.add_metric([source.name, "ok"], float(source.reads - source.read_errors))
            reads.add_metric([source.name, "error"], float(source.read_errors))
        yield from (up, pods, invalid, reads)


async def start_metrics(
    address: str,
    *,
    manager: ProbeManager,
    node: NodeSource,
    cri: CriClient,
    pod_specs: PodSpecs | None = None,
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
    if pod_specs is not None:
        metrics.follow_pod_sources(pod_specs)
    return server


__all__ = [
    "KUBELET_RESULTS",
    "Metrics",
    "MetricsServer",
    "ServerLimits",
    "parse_address",
    "start_metrics",
]
