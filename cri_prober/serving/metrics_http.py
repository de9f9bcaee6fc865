"""The ``/metrics`` endpoint: a small, bounded asyncio HTTP/1.1 server for ``Metrics``, and
``start_metrics``, which the daemon calls to export them.

What a client may hold is bounded (``ServerLimits``), and expositions are made in a thread, one
at a time, shared by every request waiting for one (``MetricsServer``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import prometheus_client
import structlog
from prometheus_client.exposition import gzip_accepted

from cri_prober import fdlimit, malloc
from cri_prober.discovery.source import NodeSource
from cri_prober.errors import ConfigError
from cri_prober.podspecs.kubelet_metrics import KubeletMetricsReader
from cri_prober.podspecs.registry import PodSpecs
from cri_prober.runtime.client import CriClient
from cri_prober.serving.metrics import FollowedManager, Metrics
from cri_prober.serving.metrics_render import negotiate

# The name its lines had before the server left metrics.py, for whoever filters logs on it.
log = structlog.get_logger("cri_prober.serving.metrics")

# gzip level of compressed answers. On a 5,000-container exposition (24 MB) level 1 takes 0.05 s
# for 1.3 MB, 6 0.17 s for 1.1 MB, 9 (gzip.compress's default) 0.5 s for 1.0 MB: CPU is what a
# node is short of, bytes are not.
GZIP_LEVEL = 1
_GZIP_WBITS = 16 + zlib.MAX_WBITS  # zlib's way of asking for the gzip container


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
        # Expositions: the one being made, how many were started, the variants the next one must
        # make, and the latest made (its number, and its body by variant).
        self._generation: asyncio.Task[None] | None = None
        self._generations_started = 0
        self._wanted: set[_Variant] = set()
        self._latest: tuple[int, dict[_Variant, bytes]] = (0, {})
        self._last_generation = (0.0, 0.0)  # (when it ended, how long it took), loop time
        self._requests_waiting = 0

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return len(self._connections)

    @property
    def requests_waiting(self) -> int:
        """Requests waiting for an exposition now."""
        return self._requests_waiting

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
                answer_head, body = response
                if len(body) < _SEND_APART:
                    await loop.sock_sendall(conn, answer_head + body)
                else:  # an exposition: not copied to put its head before it
                    await loop.sock_sendall(conn, answer_head)
                    await loop.sock_sendall(conn, body)
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

    async def _respond(self, head: bytes) -> tuple[bytes, bytes]:
        lines = head.split(b"\r\n")
        parts = lines[0].decode("latin-1").split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _response(400, "Bad Request", b"bad request\n")
        method, target, _version = parts
        if target.split("?", 1)[0] != "/metrics":
            return _response(404, "Not Found", b"not found: metrics are at /metrics\n")
        if method not in ("GET", "HEAD"):
            return _response(405, "Method Not Allowed", b"use GET\n", ("Allow", "GET, HEAD"))
        fields = _header_fields(lines[1:], ("accept", "accept-encoding"))
        # As prometheus_client's own servers: its content negotiation, and gzip when accepted.
        _encoder, content_type = negotiate(fields.get("accept"))
        gzipped = gzip_accepted(fields.get("accept-encoding", ""))
        body = await self._exposition((content_type, gzipped))
        # The answer depends on both headers (caches must not mix them up), so Vary names both,
        # whether or not this one is compressed.
        extra = [("Vary", "Accept, Accept-Encoding")]
        if gzipped:
            extra.append(("Content-Encoding", "gzip"))
        return _response(
            200, "OK", body, *extra, content_type=content_type, head_only=method == "HEAD"
        )

    # -- the exposition -------------------------------------------------------------------------

    async def _exposition(self, variant: _Variant) -> bytes:
        """The metrics in ``variant``, made after this call began; concurrent requests share.

        Making an exposition is mostly pure Python (0.2 s for 5,000 containers' 10,000 workers,
        bench/metrics_scrape.py). It is made on the event loop a piece at a time (``_render``),
        giving the loop a turn after each piece, and compressed in a thread (zlib lets go of
        the GIL while it works). Not the whole of it in a thread: a thread running Python holds
        the GIL for its switch interval at every turn, and the loop, which lets go of the GIL at
        every poll, waited for it each time: at 5,000 containers every scrape stopped probes
        for about half a second (docs/benchmarks.md §0). One generation at a time, each making
        every variant (format, gzip) its requests asked for: a request that arrives while one
        is being made waits for the next, which then answers every request that waited. An
        answer is never older than its request, and however many requests arrive, at most one
        generation is being made.
        """
        wanted = self._generations_started + 1  # the first one that starts after now
        self._requests_waiting += 1
        try:
            while True:
                number, bodies = self._latest
                if number >= wanted and variant in bodies:
                    return bodies[variant]
                self._wanted.add(variant)
                if self._generation is None:
                    self._generations_started += 1
                    variants, self._wanted = self._wanted, set()
                    self._generation = asyncio.get_running_loop().create_task(
                        self._generate(self._generations_started, variants),
                        name="metrics:exposition",
                    )
                # Shielded: a request that times out must not cancel the one others wait for.
                await asyncio.shield(self._generation)
        finally:
            self._requests_waiting -= 1

    async def _generate(self, number: int, variants: set[_Variant]) -> None:
        loop = asyncio.get_running_loop()
        try:
            # Back to back (a flood of scrapes), expositions would keep a core busy: leave at
            # least as long as the last one took between two, so they use at most half of one.
            ended, took = self._last_generation
            if (delay := ended + took - loop.time()) > 0:
                await asyncio.sleep(delay)
            started = loop.time()
            bodies = await self._make_bodies(variants)
            # The pages the exposition's transient strings freed, given back to the system
            # (without it, RSS stayed about 100 MiB above its needs at 5,000 containers).
            await asyncio.to_thread(malloc.give_back_free_pages)
            self._last_generation = (loop.time(), loop.time() - started)
            # Only the latest generation's bodies are kept: a body is large (a 5,000-container
            # text exposition is 24 MB), and a request whose variant it lacks asks for the next.
            self._latest = (number, bodies)
        finally:
            self._generation = None

    async def _make_bodies(self, variants: set[_Variant]) -> dict[_Variant, bytes]:
        """Every variant asked for, each format made once. A gzipped one is compressed piece by
        piece in a thread, never joined uncompressed."""
        bodies: dict[_Variant, bytes] = {}
        for content_type in {content_type for content_type, _gzipped in variants}:
            pieces = await self._render(content_type)
            if (content_type, False) in variants:
                bodies[content_type, False] = b"".join(pieces)
            if (content_type, True) in variants:
                bodies[content_type, True] = await asyncio.to_thread(_gzip, pieces)
        return bodies

    async def _render(self, content_type: str) -> list[bytes]:
        """The exposition's pieces (about a hundred workers' lines each, 1–2 ms of work), giving
        the event loop a turn whenever they took ``RENDER_SLICE`` since the last: due ticks and
        answers go on meanwhile. A turn per piece instead made an exposition wait a whole loop
        iteration per piece, and while the loop was busiest (thousands of workers' first steps)
        a 5,000-container one outlasted the request's 10 s limit."""
        pieces = []
        turn_ends = time.monotonic() + RENDER_SLICE
        for piece in self.metrics.exposition_pieces(content_type):
            pieces.append(piece)
            if time.monotonic() >= turn_ends:
                await asyncio.sleep(0)
                turn_ends = time.monotonic() + RENDER_SLICE
        return pieces


def _gzip(pieces: list[bytes]) -> bytes:
    compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, _GZIP_WBITS)
    compressed = [compressor.compress(piece) for piece in pieces]
    return b"".join([*compressed, compressor.flush()])


# How long an exposition renders before it gives the event loop a turn: what it may add to a
# probe's lateness, once per loop iteration while it is being made.
RENDER_SLICE = 0.01

# Bodies from this size on are sent after their head rather than copied behind it (a small one
# sent apart could wait for the head's acknowledgement: Nagle's algorithm).
_SEND_APART = 1 << 16

# An exposition variant: its content type (the format negotiated) and whether it is gzipped.
_Variant = tuple[str, bool]


def _header_fields(lines: list[bytes], names: tuple[str, ...]) -> dict[str, str]:
    """The request header fields named (lower case), repeated ones joined with commas."""
    fields: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.decode("latin-1").partition(":")
        name = name.strip().lower()
        if sep and name in names:
            value = value.strip()
            fields[name] = f"{fields[name]}, {value}" if name in fields else value
    return fields


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
) -> tuple[bytes, bytes]:
    """The answer's head, and its body (apart: an exposition's is tens of MB, not copied)."""
    headers = [
        f"HTTP/1.1 {status} {reason}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in extra),
    ]
    return ("\r\n".join(headers) + "\r\n\r\n").encode("latin-1"), b"" if head_only else body


async def start_metrics(
    address: str,
    *,
    manager: FollowedManager,
    node: NodeSource,
    cri: CriClient,
    pod_specs: PodSpecs | None = None,
    attempt_durations: bool = False,
    mirror: KubeletMetricsReader | None = None,
) -> MetricsServer:
    """Export metrics at ``http://address/metrics`` until the returned server's ``stop()``;
    ``attempt_durations`` adds ``cri_prober_probe_duration_seconds`` (every attempt's duration).

    Raises:
        ConfigError: ``address`` is malformed or cannot be bound.
    """
    # The kubelet exports no *_created series; neither do we (a process-wide switch).
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped there
    metrics = Metrics(attempt_durations=attempt_durations)
    server = MetricsServer(metrics)
    await server.start(address)
    server.unfollow = metrics.follow(manager=manager, node=node, cri=cri)
    if pod_specs is not None:
        metrics.follow_pod_sources(pod_specs)
    if mirror is not None:
        metrics.follow_mirror(mirror)
    return server


__all__ = [
    "MetricsServer",
    "ServerLimits",
    "parse_address",
    "start_metrics",
]
