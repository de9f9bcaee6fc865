"""probe_tcp against real local sockets: a listener, a closed port, a full backlog, names."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
from collections.abc import AsyncIterator, Iterator

import pytest

from cri_prober.probing.handlers.tcp import dial_error, join_host_port, local_exhaustion, probe_tcp
from cri_prober.probing.outcome import ProbeError, ProbeOutcome, ProbeResult
from tests.support.timers import record_probe_deadlines
from tests.support.waiting import HANG_GUARD
from tests.unit.fd_exhaustion import out_of_descriptors

# Handlers drive sockets and timers themselves: run every test on both of serve's loops.
pytestmark = pytest.mark.both_loops


class _Listener:
    """An asyncio TCP server that accepts, records and closes each connection."""

    def __init__(self) -> None:
        self.accepted = asyncio.Event()
        self.port = 0

    def handle(self, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted.set()
        writer.close()


@pytest.fixture(name="listener")
async def _listener() -> AsyncIterator[_Listener]:
    listener = _Listener()
    server = await asyncio.start_server(listener.handle, "127.0.0.1", 0)
    listener.port = server.sockets[0].getsockname()[1]
    async with server:
        yield listener


@pytest.fixture(name="closed_port")
def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.fixture(name="full_backlog_port")
def _full_backlog_port() -> Iterator[int]:
    """A port whose accept queue is full, so the kernel drops new SYNs and connects hang."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port: int = server.getsockname()[1]
        fillers = [socket.socket() for _ in range(4)]
        try:
            for filler in fillers:
                filler.setblocking(False)
                filler.connect_ex(("127.0.0.1", port))
            yield port
        finally:
            for filler in fillers:
                filler.close()


async def test_open_port_succeeds(listener: _Listener) -> None:
    """A port that accepts connections is a success with empty output."""
    outcome = await probe_tcp("127.0.0.1", listener.port, timeout=1)
    assert outcome == ProbeOutcome(ProbeResult.SUCCESS)
    await asyncio.wait_for(listener.accepted.wait(), HANG_GUARD)


async def test_hostname_is_resolved(listener: _Listener) -> None:
    """A host name is resolved without blocking and then connected to."""
    outcome = await probe_tcp("localhost", listener.port, timeout=2)
    assert outcome.result == ProbeResult.SUCCESS


async def test_closed_port_fails_with_dial_error(closed_port: int) -> None:
    """A refused connection is a failure worded like Go's dialer."""
    outcome = await probe_tcp("127.0.0.1", closed_port, timeout=1)
    assert outcome.result == ProbeResult.FAILURE
    assert outcome.output == f"dial tcp 127.0.0.1:{closed_port}: connect: connection refused"


async def test_unknown_host_fails_with_lookup_error() -> None:
    """A name that does not resolve is a failure naming the lookup."""
    outcome = await probe_tcp("does-not-exist.invalid", 80, timeout=2)
    assert outcome.result == ProbeResult.FAILURE
    assert outcome.output.startswith("dial tcp: lookup does-not-exist.invalid: ")


async def test_hanging_connect_times_out(
    full_backlog_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connect that never completes fails with an i/o timeout when the probe's deadline,
    armed for the timeout, passes (the i/o timeout is only ever that deadline's verdict)."""
    armed = record_probe_deadlines(monkeypatch)
    outcome = await probe_tcp("127.0.0.1", full_backlog_port, timeout=0.3)
    assert [deadline.is_for(0.3) for deadline in armed] == [True]
    expected = f"dial tcp 127.0.0.1:{full_backlog_port}: i/o timeout"
    assert outcome == ProbeOutcome(ProbeResult.FAILURE, expected, timed_out=True)


@pytest.mark.parametrize(
    ("host", "expected"),
    [("10.0.0.1", "10.0.0.1:80"), ("fd00::1", "[fd00::1]:80"), ("pod.local", "pod.local:80")],
)
def test_join_host_port_brackets_ipv6(host: str, expected: str) -> None:
    """IPv6 literals are bracketed, like Go's net.JoinHostPort."""
    assert join_host_port(host, 80) == expected


def test_dial_error_without_errno_keeps_asyncio_text() -> None:
    """When several addresses fail differently, asyncio's combined message is kept."""
    error = OSError("Multiple exceptions: [Errno 111] a, [Errno 101] b")
    assert (
        dial_error("h", 1, error)
        == "dial tcp h:1: Multiple exceptions: [Errno 111] a, [Errno 101] b"
    )


# --- a pod without an IP: the kubelet dials ":port", the local system (D15) -------------------


async def test_empty_host_dials_the_local_system(listener: _Listener) -> None:
    """An empty host connects to the node itself, as Go's dial of ":<port>" does."""
    outcome = await probe_tcp("", listener.port, timeout=1)
    assert outcome == ProbeOutcome(ProbeResult.SUCCESS)
    await asyncio.wait_for(listener.accepted.wait(), HANG_GUARD)


async def test_empty_host_refused_fails_with_gos_text(closed_port: int) -> None:
    """Nothing listening on the node is a failure naming ":<port>", as Go's dialer words it."""
    outcome = await probe_tcp("", closed_port, timeout=1)
    expected = f"dial tcp :{closed_port}: connect: connection refused"
    assert outcome == ProbeOutcome(ProbeResult.FAILURE, expected, reason="connection-refused")


@pytest.mark.parametrize("port", [-1, 65536])
async def test_port_out_of_range_fails_without_a_traceback(port: int) -> None:
    """A port no socket can have is Go's resolver error, a failure, not an OverflowError."""
    outcome = await probe_tcp("127.0.0.1", port, timeout=1)
    assert outcome == ProbeOutcome(
        ProbeResult.FAILURE, f"dial tcp: address {port}: invalid port", reason="invalid-target"
    )


# --- mirrored: kubernetes pkg/probe/tcp/tcp_test.go -------------------------------------------


@pytest.mark.parametrize(
    ("use_listener_port", "result"),
    [
        pytest.param(True, ProbeResult.SUCCESS, id="TestTcpHealthChecker-connection-made"),
        pytest.param(False, ProbeResult.FAILURE, id="TestTcpHealthChecker-port-minus-1"),
    ],
)
async def test_kubelet_tcp_health_checker(
    listener: _Listener, use_listener_port: bool, result: ProbeResult
) -> None:
    """TestTcpHealthChecker: a listening port succeeds and port -1 fails, both without an error
    (here: a verdict, never an exception), with the upstream 1 s timeout."""
    port = listener.port if use_listener_port else -1
    outcome = await probe_tcp("127.0.0.1", port, timeout=1)
    assert outcome.result == result


# -- cri-prober out of resources: an error, never the target's failure ---------------------------


async def test_out_of_descriptors_is_an_error_not_a_failure(listener: _Listener) -> None:
    """EMFILE (a flood used up serve's descriptors) says nothing about the target: before, the
    attempt was a failure, "connect: too many open files", and counted against the container."""
    with out_of_descriptors(), pytest.raises(ProbeError, match="out of local resources"):
        await probe_tcp("127.0.0.1", listener.port, timeout=1)
    # And with descriptors back, the same target is a success.
    assert (await probe_tcp("127.0.0.1", listener.port, timeout=1)).result is ProbeResult.SUCCESS


# Patches Python's socket.socket, which uvloop (sockets made in C) never calls; the real
# descriptor-exhaustion tests cover uvloop.
@pytest.mark.asyncio(loop_factories=["asyncio"])
@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS])
async def test_socket_creation_out_of_resources_is_an_error(
    listener: _Listener, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """Every kind of local exhaustion while creating the socket is an error."""

    def exhausted(*_args: object, **_kwargs: object) -> socket.socket:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(socket, "socket", exhausted)
    with pytest.raises(ProbeError, match=os.strerror(code)):
        await probe_tcp("127.0.0.1", listener.port, timeout=1)


def test_joined_errors_of_several_addresses_are_recognised() -> None:
    """asyncio joins the errors of several addresses into one message with no errno."""
    joined = OSError("Multiple exceptions: [Errno 24] Too many open files, [Errno 111] refused")
    assert local_exhaustion(joined)
    assert not local_exhaustion(OSError("Multiple exceptions: [Errno 111] Connect call failed"))
    assert local_exhaustion(socket.gaierror(socket.EAI_MEMORY, "Memory allocation failure"))
    assert not local_exhaustion(socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
    assert not local_exhaustion(ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
