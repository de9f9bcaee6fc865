"""Network probes against targets that misbehave on purpose: bounded by the timeout, no leaks;
and exec probes from pod annotations built to make cri-prober itself blow up.

Every server here runs in-process on 127.0.0.1 (no containerd). Each hostile case is probed a few
times at the kubelet's minimum timeout (1 s) to check the attempt ends in time with the right
verdict, then 200 more times at a short timeout while Python allocations (tracemalloc), RSS,
open fds and asyncio tasks are watched: a probe that left a socket, a task, a gRPC channel or a
buffer behind would show up as growth.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import socket
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2_grpc

from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.discovery.pleg import Discovery
from cri_prober.manager.probe_manager import ProbeManager
from cri_prober.probing.handlers.grpc import probe_grpc
from cri_prober.probing.handlers.http import probe_http
from cri_prober.probing.handlers.tcp import probe_tcp
from cri_prober.probing.outcome import MAX_OUTPUT_BYTES, ProbeError, ProbeOutcome, ProbeResult
from cri_prober.probing.prober import Prober
from cri_prober.probing.spec import load_rules
from cri_prober.runtime.client import CriClient
from tests.reliability.support import STALL_BOUND, LoopStalls, open_fds, rss_bytes
from tests.support.fake_runtime import FakeContainer, FakeRuntime, FakeRuntimeServer
from tests.support.timers import record_probe_deadlines
from tests.support.waiting import HANG_GUARD
from tests.support.watchers import ManagerWatcher

TIMEOUT = 1.0
# The timeout of an attempt that must end by itself (a limit, a verdict), never by its timeout:
# far past the test's hang guard, so an attempt that waited for it fails the test.
NEVER = 3600.0
SHORT_TIMEOUT = 0.2
RUNS = 200
WARM_UP = 100
BATCH = 50
# 200 attempts that each leaked a socket, a task or a 1 KiB buffer would exceed these.
MAX_TRACED_GROWTH = 150 * 1024
MAX_RSS_GROWTH = 16 * 1024 * 1024
FD_SLACK = 2
TASK_SLACK = 2

Behaviour = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
Attempt = ProbeOutcome | ProbeError
Probe = Callable[[float], Awaitable[ProbeOutcome]]


# -- hostile behaviours ---------------------------------------------------------------------------


async def _read_request(reader: asyncio.StreamReader) -> None:
    await reader.readuntil(b"\r\n\r\n")


async def silent(reader: asyncio.StreamReader, _writer: asyncio.StreamWriter) -> None:
    """Accept, read whatever comes, never say a word."""
    while await reader.read(65536):
        pass


async def _trickle(writer: asyncio.StreamWriter, data: bytes, *, then: bytes = b"") -> None:
    """Write ``data`` one byte per 100 ms, then ``then`` (one byte) the same way, forever."""
    for i in range(len(data)):
        writer.write(data[i : i + 1])
        await writer.drain()
        await asyncio.sleep(0.1)
    while then:
        writer.write(then)
        await writer.drain()
        await asyncio.sleep(0.1)


async def trickle_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Send the response head one byte per 100 ms."""
    await _read_request(reader)
    await _trickle(writer, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Slow: " + b"s" * 200)


async def trickle_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Send the head at once, then the body one byte per 100 ms."""
    await _read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
    await _trickle(writer, b"", then=b"b")


async def _endless(writer: asyncio.StreamWriter, head: bytes, block: bytes) -> None:
    writer.write(head)
    while True:
        writer.write(block)
        await writer.drain()


async def endless_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A body without a length that never ends."""
    await _read_request(reader)
    await _endless(writer, b"HTTP/1.1 200 OK\r\n\r\n", b"x" * 65536)


async def endless_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A chunked body whose chunks never end."""
    await _read_request(reader)
    chunk = b"4000\r\n" + b"c" * 0x4000 + b"\r\n"
    await _endless(writer, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", chunk)


async def endless_headers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Header lines, forever, as fast as the client reads them."""
    await _read_request(reader)
    await _endless(writer, b"HTTP/1.1 200 OK\r\n", b"X-Junk: " + b"j" * 8000 + b"\r\n")


async def redirect_loop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Redirect to the very same URL, forever."""
    await _read_request(reader)
    writer.write(b"HTTP/1.1 302 Found\r\nLocation: /loop\r\nContent-Length: 0\r\n\r\n")
    await writer.drain()


async def slow_redirect_loop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The same redirect loop, each hop taking 300 ms."""
    await _read_request(reader)
    await asyncio.sleep(0.3)
    writer.write(b"HTTP/1.1 302 Found\r\nLocation: /loop\r\nContent-Length: 0\r\n\r\n")
    await writer.drain()


async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer anything with bytes that are no protocol at all, then hang up."""
    writer.write(b"\x00\xff garbage \x17\x03\x03" * 100)
    await writer.drain()


# Loop turns from an accepted socket to its transport closed: the accept task, connection_made,
# the stream callback, and the close's connection_lost, with room to spare.
ACCEPT_TURNS = 10


class HostileServer:
    """An asyncio TCP server running one behaviour per connection, counting live connections."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.accepted = 0
        self.active = 0
        self.idle = asyncio.Event()
        self.idle.set()
        # Each connection's handler task and its writer (a task cancelled before it ran never
        # closes its writer itself).
        self._handlers: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}
        self._server: asyncio.Server | None = None
        self._stopping = False
        self.port = 0

    def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A connection accepted just before the server stopped arrives a few loop turns later:
        # hang it up, start nothing.
        if self._stopping:
            writer.close()
            return
        # The handler's task is known from the moment the connection is: one that has not run
        # yet when the server stops is cancelled and awaited with the rest, not left pending.
        task = asyncio.create_task(self._handle(reader, writer), name="HostileServer._handle")
        self._handlers[task] = writer
        task.add_done_callback(lambda done: self._handlers.pop(done, None))

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.active += 1
        self.idle.clear()
        try:
            await self.behaviour(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        except asyncio.CancelledError:
            # Cancelled at teardown; ending normally keeps asyncio's stream callback quiet.
            pass
        finally:
            writer.close()
            self.active -= 1
            if self.active == 0:
                self.idle.set()

    async def __aenter__(self) -> HostileServer:
        self._server = await asyncio.start_server(self._connected, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._stopping = True
        self._server.close()
        handlers = dict(self._handlers)
        for task, writer in handlers.items():
            task.cancel()
            writer.close()
        await asyncio.gather(*handlers, return_exceptions=True)
        await self._server.wait_closed()
        # A connection the listener accepted just before it closed is still being made into a
        # transport by a task asyncio queued (Python 3.11's wait_closed does not wait for it):
        # let it run to ``_connected``, which hangs it up, instead of leaving an unclosed socket
        # for a later test's garbage collection to report. These are loop turns, not time.
        for _ in range(ACCEPT_TURNS):
            await asyncio.sleep(0)


@contextlib.contextmanager
def blackhole() -> Any:
    """A port whose accept queue is full: SYNs are dropped and connecting hangs."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        yield port
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


class NeverReplies(health_pb2_grpc.HealthServicer):  # type: ignore[misc]  # untyped package
    """A gRPC health service whose Check never answers."""

    async def Check(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC method name
        await asyncio.Event().wait()


# -- cases ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One hostile target, how to probe it, and what a bounded attempt must come back with."""

    name: str
    target: Callable[[], contextlib.AbstractAsyncContextManager[tuple[Probe, HostileServer | None]]]
    check: Callable[[Attempt], bool]
    hangs: bool  # the attempt can only end by its timeout


def http_case(behaviour: Behaviour, *, scheme: str = "http") -> Callable[..., Any]:
    @contextlib.asynccontextmanager
    async def target() -> AsyncIterator[tuple[Probe, HostileServer | None]]:
        async with HostileServer(behaviour) as server:
            url = f"{scheme}://127.0.0.1:{server.port}/loop"

            async def probe(timeout: float) -> ProbeOutcome:
                return await probe_http(url, headers=[], timeout=timeout)

            yield probe, server

    return target


def tcp_case(behaviour: Behaviour) -> Callable[..., Any]:
    @contextlib.asynccontextmanager
    async def target() -> AsyncIterator[tuple[Probe, HostileServer | None]]:
        async with HostileServer(behaviour) as server:

            async def probe(timeout: float) -> ProbeOutcome:
                return await probe_tcp("127.0.0.1", server.port, timeout=timeout)

            yield probe, server

    return target


def grpc_on(behaviour: Behaviour) -> Callable[..., Any]:
    @contextlib.asynccontextmanager
    async def target() -> AsyncIterator[tuple[Probe, HostileServer | None]]:
        async with HostileServer(behaviour) as server:

            async def probe(timeout: float) -> ProbeOutcome:
                return await probe_grpc("127.0.0.1", server.port, service="", timeout=timeout)

            yield probe, server

    return target


@contextlib.asynccontextmanager
async def blackhole_http() -> AsyncIterator[tuple[Probe, HostileServer | None]]:
    with blackhole() as port:

        async def probe(timeout: float) -> ProbeOutcome:
            return await probe_http(f"http://127.0.0.1:{port}/", headers=[], timeout=timeout)

        yield probe, None


@contextlib.asynccontextmanager
async def blackhole_tcp() -> AsyncIterator[tuple[Probe, HostileServer | None]]:
    with blackhole() as port:

        async def probe(timeout: float) -> ProbeOutcome:
            return await probe_tcp("127.0.0.1", port, timeout=timeout)

        yield probe, None


@contextlib.asynccontextmanager
async def grpc_never_replies() -> AsyncIterator[tuple[Probe, HostileServer | None]]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(NeverReplies(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:

        async def probe(timeout: float) -> ProbeOutcome:
            return await probe_grpc("127.0.0.1", port, service="", timeout=timeout)

        yield probe, None
    finally:
        await server.stop(0)


def timed_out(attempt: Attempt) -> bool:
    return (
        isinstance(attempt, ProbeOutcome)
        and attempt.result is ProbeResult.FAILURE
        and attempt.timed_out
    )


def body_read_timed_out(attempt: Attempt) -> bool:
    # The kubelet discards an attempt whose body read failed after the headers arrived.
    return isinstance(attempt, ProbeError) and "while reading body" in str(attempt)


def capped_success(attempt: Attempt) -> bool:
    return (
        isinstance(attempt, ProbeOutcome)
        and attempt.result is ProbeResult.SUCCESS
        and len(attempt.output.encode()) == MAX_OUTPUT_BYTES
    )


def failed_with(text: str) -> Callable[[Attempt], bool]:
    def check(attempt: Attempt) -> bool:
        return (
            isinstance(attempt, ProbeOutcome)
            and attempt.result is ProbeResult.FAILURE
            and text in attempt.output
        )

    return check


def connected(attempt: Attempt) -> bool:
    return isinstance(attempt, ProbeOutcome) and attempt.result is ProbeResult.SUCCESS


CASES = [
    Case("http-silent", http_case(silent), timed_out, hangs=True),
    Case("http-trickle-head", http_case(trickle_head), timed_out, hangs=True),
    Case("http-trickle-body", http_case(trickle_body), body_read_timed_out, hangs=True),
    Case("http-endless-body", http_case(endless_body), capped_success, hangs=False),
    Case("http-endless-chunked", http_case(endless_chunked), capped_success, hangs=False),
    Case(
        "http-endless-headers",
        http_case(endless_headers),
        failed_with("headers exceeded the limit"),
        hangs=False,
    ),
    Case(
        "http-redirect-loop",
        http_case(redirect_loop),
        failed_with("stopped after 10 redirects"),
        hangs=False,
    ),
    Case("http-slow-redirect-loop", http_case(slow_redirect_loop), timed_out, hangs=True),
    Case("https-silent", http_case(silent, scheme="https"), timed_out, hangs=True),
    Case("http-blackhole", blackhole_http, timed_out, hangs=True),
    Case("tcp-accepts-and-hangs", tcp_case(silent), connected, hangs=False),
    Case("tcp-blackhole", blackhole_tcp, timed_out, hangs=True),
    Case("grpc-silent-tcp", grpc_on(silent), timed_out, hangs=True),
    Case("grpc-garbage", grpc_on(garbage), timed_out, hangs=True),
    Case("grpc-never-replies", grpc_never_replies, timed_out, hangs=True),
]


async def attempt(probe: Probe, timeout: float) -> tuple[float, Attempt]:
    started = time.monotonic()
    try:
        result: Attempt = await probe(timeout)
    except ProbeError as exc:
        result = exc
    return time.monotonic() - started, result


async def settle(server: HostileServer | None) -> None:
    """Wait until the server side has seen every connection close, and the loop has run the
    transports' close callbacks (a closed StreamWriter releases its socket a loop turn later).
    """
    if server is not None:
        async with asyncio.timeout(HANG_GUARD):
            await server.idle.wait()
    unchanged = 0
    for _ in range(200):  # loop turns, not time: stop once the fd count holds for three turns
        before = open_fds()
        await asyncio.sleep(0)
        unchanged = unchanged + 1 if open_fds() == before else 0
        if unchanged == 3:
            return


async def run_many(probe: Probe, server: HostileServer | None, runs: int) -> None:
    """Probe ``runs`` times, ``BATCH`` at a time, keeping no result (they would count as growth)."""
    for start in range(0, runs, BATCH):
        batch = await asyncio.gather(
            *(attempt(probe, SHORT_TIMEOUT) for _ in range(min(BATCH, runs - start)))
        )
        # Under the short timeout a slow case may end either way, but only in sanctioned ways.
        assert all(isinstance(result, ProbeOutcome | ProbeError) for _, result in batch)
        del batch
    await settle(server)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
async def test_hostile_target_is_bounded_and_leaks_nothing(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An attempt the target would hold for ever ends by its timeout (armed for it, not before
    it) with the expected verdict; one the target cannot hold ends by its own limit, with a
    timeout it never reaches. 200 more leave no residue. (How long past its timeout an attempt
    ends says how busy the machine is: bench/ measures that, not this test.)"""
    armed = record_probe_deadlines(monkeypatch)
    async with case.target() as (probe, server):
        timeout = TIMEOUT if case.hangs else NEVER
        async with asyncio.timeout(HANG_GUARD):  # a hang guard, not a bound
            timings = await asyncio.gather(*(attempt(probe, timeout) for _ in range(3)))
        for elapsed, result in timings:
            assert case.check(result), result
            if case.hangs:
                assert elapsed >= TIMEOUT - 0.05, (elapsed, result)  # never before it
        # The http and tcp probes bound an attempt by one lag-aware deadline, armed for its
        # timeout (gRPC's is the call's own deadline): nothing waits past it unbounded.
        assert all(deadline.is_for(timeout) for deadline in armed), armed
        if server is not None:
            assert server.accepted > 0  # the target really was in play
        del timings
        monkeypatch.undo()

        tracemalloc.start()
        try:
            # Warm-up: caches, lazily created objects, dicts and allocator arenas at full size.
            await run_many(probe, server, WARM_UP)
            gc.collect()
            traced_before = tracemalloc.get_traced_memory()[0]
            rss_before = rss_bytes()
            fds_before = open_fds()
            tasks_before = len(asyncio.all_tasks())
            started = time.monotonic()
            await run_many(probe, server, RUNS)
            elapsed = time.monotonic() - started
            gc.collect()
            traced_growth = tracemalloc.get_traced_memory()[0] - traced_before
        finally:
            tracemalloc.stop()
        rss_growth = rss_bytes() - rss_before
        print(
            f"{case.name}: {RUNS} attempts in {elapsed:.1f}s, traced {traced_growth / 1024:+.0f} "
            f"KiB, rss {rss_growth / 1024:+.0f} KiB, fds {open_fds() - fds_before:+d}"
        )
        assert traced_growth < MAX_TRACED_GROWTH
        assert rss_growth < MAX_RSS_GROWTH
        assert open_fds() <= fds_before + FD_SLACK
        assert len(asyncio.all_tasks()) <= tasks_before + TASK_SLACK


# grpc core keeps a connection attempt open for its minimum connect timeout (20 s) even after
# the channel is closed, unless the probe bounds it (handlers/grpc.py); half of that tells the two
# apart however busy the machine is.
GRPC_CONNECT_LINGER = 20.0


async def test_grpc_probe_closes_its_socket_when_the_handshake_never_completes() -> None:
    """After a gRPC probe times out in the handshake, its connection is closed, not left open
    for grpc core's 20 s minimum connect timeout."""
    async with HostileServer(silent) as server:
        outcome = await probe_grpc("127.0.0.1", server.port, service="", timeout=TIMEOUT)
        assert timed_out(outcome)
        assert server.accepted >= 1  # grpc may retry the connect within the timeout
        # The server sees the probe's socket close (it reads EOF) long before grpc would.
        async with asyncio.timeout(GRPC_CONNECT_LINGER / 2):
            await server.idle.wait()


async def test_hostile_server_stops_every_handler_it_started() -> None:
    """A connection the server accepted just before it stopped gets no handler left behind (the
    teardown error of the test above: a handler task still pending after its fixtures ended).
    The server stops 3-7 loop turns after the connections came: as their handlers are being set
    up (3-4 on CPython 3.11: accepted, handler task created, not yet run) and once those run.
    (Fewer turns stop it while asyncio itself is still accepting them, its own business.)"""
    for turns in range(3, 8):
        clients: list[socket.socket] = []
        try:
            async with HostileServer(silent) as server:
                for _ in range(5):
                    clients.append(socket.create_connection(("127.0.0.1", server.port)))
                for _ in range(turns):
                    await asyncio.sleep(0)
            for _ in range(20):  # loop turns for anything the accept had set in motion
                await asyncio.sleep(0)
            handlers = [
                task
                for task in asyncio.all_tasks()
                if "HostileServer._handle" in getattr(task.get_coro(), "__qualname__", "")
            ]
            assert handlers == [], turns
        finally:
            for client in clients:
                client.close()


UNUSABLE = [
    ("tcp", "a..b", "/"),  # an empty DNS label
    ("tcp", "a" * 64 + ".svc", "/"),  # a DNS label over 63 characters
    ("tcp", "bad\x00host", "/"),  # NUL
    ("http", "127.0.0.1", "/\ud800"),  # a lone surrogate, which JSON's \ud800 escape produces
]


@pytest.mark.parametrize(("kind", "host", "path"), UNUSABLE, ids=lambda v: repr(v)[:20])
async def test_unusable_host_or_path_is_a_verdict_not_a_crash(
    kind: str, host: str, path: str
) -> None:
    """A host that cannot be looked up fails the probe (the kubelet: "no such host")."""
    try:
        if kind == "tcp":
            result: Attempt = await probe_tcp(host, 1, timeout=TIMEOUT)
        else:
            url = f"http://{host}:1{path}"
            result = await probe_http(url, headers=[], timeout=TIMEOUT)
    except ProbeError as exc:
        result = exc
    assert isinstance(result, ProbeError) or result.result is ProbeResult.FAILURE


# -- hostile annotations --------------------------------------------------------------------------
# Any pod author sets probes.cri-prober.io/<container>; these pods aim it at cri-prober itself.

ARG_MAX_STRLEN = 128 * 1024  # Linux refuses a single argument longer than this (E2BIG)


class LogSizes:
    """A structlog processor that counts and measures the events it drops (keeping none)."""

    def __init__(self) -> None:
        self.events = 0
        self.chars = 0
        self.largest = 0

    def __call__(self, _logger: Any, _method: str, event: MutableMapping[str, Any]) -> Any:
        size = len(repr(event))
        self.events += 1
        self.chars += size
        self.largest = max(self.largest, size)
        raise structlog.DropEvent


@contextlib.contextmanager
def measured_logs() -> Iterator[LogSizes]:
    sizes = LogSizes()
    previous = structlog.get_config()["processors"]
    structlog.configure(processors=[sizes])
    try:
        yield sizes
    finally:
        structlog.configure(processors=previous)


async def exec_like_linux(
    _container: FakeContainer, cmd: list[str], _timeout: int
) -> api_pb2.ExecSyncResponse:
    """Run ``true``; refuse what execve would, quoting the argv back as containerd does."""
    if any(len(arg.encode()) > ARG_MAX_STRLEN for arg in cmd):
        raise RuntimeError("OCI runtime exec failed: argument list too long")
    if cmd[0] != "true":
        raise RuntimeError(f'OCI runtime exec failed: exec: "{cmd[0]}": executable file not found')
    return api_pb2.ExecSyncResponse(exit_code=0)


HOSTILE_RULES = """
probes:
  - match: {namespace: canary}
    livenessProbe: {exec: {command: ["true"]}, periodSeconds: 1}
"""


def _liveness(command: list[str]) -> dict[str, str]:
    spec = {"livenessProbe": {"exec": {"command": command}, "periodSeconds": 1}}
    return {"probes.cri-prober.io/app": json.dumps(spec)}


@pytest.mark.parametrize(
    ("annotation", "env"),
    [
        # 6 KB of annotation: 1,000 references to a 100 KB variable (100 MB per attempt).
        (_liveness(["sh", "-c", "$(BIG)" * 1000]), {"BIG": "x" * 100_000}),
        # The biggest annotation the API server takes (a 250 KB command): the runtime refuses
        # it, and its error used to quote the whole argv on every attempt.
        (_liveness(["/bin/check", "y" * 250_000]), {}),
        # 60 KB: under every cap, so it runs; a missing binary quoted it back in full.
        (_liveness(["/no/such/binary", "z" * 60_000]), {}),
    ],
    ids=["amplified", "250kb-annotation", "60kb-command"],
)
async def test_hostile_exec_annotation_is_bounded(
    tmp_path: Path, annotation: dict[str, str], env: dict[str, str]
) -> None:
    """The findings: 2.8 GB peak RSS and 763 MB of logs in 20 s from the first, a 1 MB log line
    per period from the others. Now an attempt holds at most the 64 KiB command cap, each log
    line stays short, nothing holds the event loop (its longest stretch of CPU work between two
    turns of a 50 ms timer is counted in CPU time, which a busy machine does not inflate as it
    does wall-clock time), and a canary next door keeps pace with the hostile probe of the
    same 1 s period."""
    runtime = FakeRuntime(exec_handler=exec_like_linux)
    async with (
        FakeRuntimeServer(str(tmp_path / "cri.sock"), runtime),
        CriClient.connect(f"unix://{tmp_path / 'cri.sock'}") as cri,
    ):
        manager = ProbeManager(
            prober=Prober(cri),
            rules=load_rules(HOSTILE_RULES, source="rules.yaml"),
            prober_started_at=0,
        )
        discovery = Discovery(cri)
        watcher = ManagerWatcher(manager)
        hostile = runtime.add_sandbox("hostile", annotations=annotation)
        runtime.add_container(hostile, "app", env=env)
        canary = runtime.add_container(runtime.add_sandbox("canary", namespace="canary"), "app")

        def attempts(container_id: str, result: str | None = None) -> list[float]:
            return [
                r.record.started_at
                for r in watcher.records
                if r.container.id == container_id and result in (None, r.record.result)
            ]

        tracemalloc.start()
        try:
            async with LoopStalls() as stalls:
                with measured_logs() as logs:
                    manager.on_lifecycle(await discovery.relist(), discovery.containers().values())
                    # An annotation over the size cap is refused outright: no probe, no attempt.
                    probed = next(
                        (p for p in manager.probed() if p.container.pod.name == "hostile"), None
                    )
                    hostile_id = probed.container.id if probed is not None else ""
                    await watcher.until(
                        lambda: (
                            (not hostile_id or len(attempts(hostile_id, "error")) >= 3)
                            and len(attempts(canary.id)) >= 4
                        ),
                        timeout=HANG_GUARD,
                    )
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            await manager.shutdown(grace=2)
    gaps = [b - a for a, b in itertools.pairwise(attempts(canary.id))]
    hostile_attempts = len(attempts(hostile_id)) if hostile_id else 0
    errors = {r.record.output for r in watcher.records if r.container.id == hostile_id}
    print(
        f"peak {peak / 2**20:.1f} MiB, {logs.events} log events ({logs.chars / 1024:.0f} KiB, "
        f"largest {logs.largest} chars), longest loop stall {stalls.longest * 1000:.0f} ms CPU, "
        f"canary gaps {[round(g, 2) for g in gaps]}, hostile attempts {hostile_attempts}, "
        f"errors {[e[:80] for e in errors]}"
    )
    assert peak < 8 * 2**20
    assert logs.events > 0  # the refusal or the errored attempts were seen (not a cached logger)
    assert logs.largest < 4096
    assert logs.chars < logs.events * 4096
    # Same period, started together: a canary the hostile probe held up would fall behind it.
    assert len(attempts(canary.id)) >= hostile_attempts - 1, (gaps, hostile_attempts)
    assert stalls.longest < STALL_BOUND
