"""probe_grpc against real grpc.aio servers started in-process on ephemeral ports."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cri_prober.probing.handlers.grpc import probe_grpc
from cri_prober.probing.handlers.http import KUBELET_VERSION
from cri_prober.probing.outcome import ProbeError, ProbeOutcome, ProbeResult
from tests.unit.fd_exhaustion import out_of_descriptors

# Handlers drive sockets and timers themselves: run every test on both of serve's loops.
pytestmark = pytest.mark.both_loops

_Status = health_pb2.HealthCheckResponse


class _RecordingHealth(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """Answers ``status`` after ``release`` is set, and records each caller's metadata."""

    def __init__(self) -> None:
        self.status: int = _Status.SERVING
        self.release = asyncio.Event()
        self.called = asyncio.Event()
        self.metadata: dict[str, str | bytes] = {}

    async def Check(  # noqa: N802 - the generated servicer's method name
        self,
        request: health_pb2.HealthCheckRequest,
        context: grpc.aio.ServicerContext[
            health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
        ],
    ) -> health_pb2.HealthCheckResponse:
        self.metadata = dict(context.invocation_metadata() or ())
        self.called.set()
        await self.release.wait()
        return _Status(status=self.status)


async def _serve(servicer: object | None) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    if servicer is not None:
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


@pytest.fixture(name="health_port")
async def _health_port() -> AsyncIterator[int]:
    servicer = health.aio.HealthServicer()
    await servicer.set("", _Status.SERVING)
    await servicer.set("down", _Status.NOT_SERVING)
    await servicer.set("undecided", _Status.UNKNOWN)
    server, port = await _serve(servicer)
    yield port
    await server.stop(None)


@pytest.fixture(name="bare_port")
async def _bare_port() -> AsyncIterator[int]:
    server, port = await _serve(None)
    yield port
    await server.stop(None)


@pytest.fixture(name="recording")
async def _recording() -> AsyncIterator[tuple[_RecordingHealth, int]]:
    servicer = _RecordingHealth()
    server, port = await _serve(servicer)
    yield servicer, port
    await server.stop(None)


@pytest.fixture(name="closed_port")
def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_serving_is_success(health_port: int) -> None:
    """SERVING for the whole server is a success."""
    outcome = await probe_grpc("127.0.0.1", health_port, service="", timeout=2)
    assert outcome == ProbeOutcome(ProbeResult.SUCCESS, "service healthy")


async def test_hostname_target_is_resolved(health_port: int) -> None:
    """A host name goes through grpc's resolver and still reaches the server."""
    outcome = await probe_grpc("localhost", health_port, service="", timeout=2)
    assert outcome.result == ProbeResult.SUCCESS


@pytest.mark.parametrize(("service", "status"), [("down", "NOT_SERVING"), ("undecided", "UNKNOWN")])
async def test_not_serving_is_failure(health_port: int, service: str, status: str) -> None:
    """Any status but SERVING is a failure naming that status."""
    outcome = await probe_grpc("127.0.0.1", health_port, service=service, timeout=2)
    expected = f'service unhealthy (responded with "{status}")'
    assert outcome == ProbeOutcome(ProbeResult.FAILURE, expected, reason="grpc-status")


async def test_unknown_status_value_is_failure(recording: tuple[_RecordingHealth, int]) -> None:
    """A status number this client has no name for fails with the number, not an exception."""
    servicer, port = recording
    servicer.status = 42
    servicer.release.set()
    outcome = await probe_grpc("127.0.0.1", port, service="", timeout=2)
    assert outcome == ProbeOutcome(
        ProbeResult.FAILURE, 'service unhealthy (responded with "42")', reason="grpc-status"
    )


async def test_unknown_service_is_failure(health_port: int) -> None:
    """A service the server doesn't know (NOT_FOUND) is a failure with the rpc error."""
    outcome = await probe_grpc("127.0.0.1", health_port, service="nope", timeout=2)
    assert outcome.result == ProbeResult.FAILURE
    assert outcome.output.startswith("error: health rpc probe failed: rpc error: code = NOT_FOUND")


async def test_server_without_health_service_is_failure(bare_port: int) -> None:
    """A server without grpc.health.v1 (UNIMPLEMENTED) is a failure that says so."""
    outcome = await probe_grpc("127.0.0.1", bare_port, service="", timeout=2)
    assert outcome.result == ProbeResult.FAILURE
    assert outcome.output.startswith(
        "error: this server does not implement the grpc health protocol (grpc.health.v1.Health)"
    )


async def test_slow_check_times_out(recording: tuple[_RecordingHealth, int]) -> None:
    """A call that outlives the deadline is a failure once the deadline passes: gRPC's
    DEADLINE_EXCEEDED (timed_out) on a connected channel, worded with the probe's timeout."""
    servicer, port = recording
    outcome = await probe_grpc("127.0.0.1", port, service="", timeout=0.5)
    assert servicer.called.is_set()
    expected = "timeout: health rpc did not complete within 0.5s"
    assert outcome == ProbeOutcome(ProbeResult.FAILURE, expected, timed_out=True, reason="timeout")


async def test_closed_port_waits_out_the_deadline(closed_port: int) -> None:
    """A refused connection is retried until the deadline, then reported as a connect timeout.

    Retried until the deadline: a refusal that ended the call would be UNAVAILABLE, reported as
    an rpc error; only the call's deadline passing gives DEADLINE_EXCEEDED (``timed_out``) on a
    channel that never connected."""
    outcome = await probe_grpc("127.0.0.1", closed_port, service="", timeout=0.5)
    assert outcome.timed_out
    assert outcome.result == ProbeResult.FAILURE
    assert outcome.output.startswith(
        f'timeout: failed to connect service "127.0.0.1:{closed_port}" within 0.5s'
    )


async def test_sends_kube_probe_user_agent(recording: tuple[_RecordingHealth, int]) -> None:
    """The call carries a kube-probe/ User-Agent, as the kubelet's does."""
    servicer, port = recording
    servicer.release.set()
    outcome = await probe_grpc("127.0.0.1", port, service="", timeout=2)
    assert outcome.result == ProbeResult.SUCCESS
    user_agent = servicer.metadata["user-agent"]
    assert isinstance(user_agent, str)
    assert user_agent.startswith("kube-probe/1.")


async def test_environment_proxy_is_ignored(
    health_port: int, closed_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """grpc's support for http_proxy is switched off: the probe goes straight to the target."""
    for name in ("http_proxy", "https_proxy", "grpc_proxy"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{closed_port}")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    outcome = await probe_grpc("127.0.0.1", health_port, service="", timeout=2)
    assert outcome.result == ProbeResult.SUCCESS


async def test_user_agent_leads_with_exactly_the_kubelets(
    recording: tuple[_RecordingHealth, int],
) -> None:
    """The User-Agent starts with the kubelet's exact kube-probe/<major>.<minor> token; only
    grpc's own product tokens follow it (grpc-go adds "grpc-go/…" the same way)."""
    servicer, port = recording
    servicer.release.set()
    await probe_grpc("127.0.0.1", port, service="", timeout=2)
    user_agent = servicer.metadata["user-agent"]
    assert isinstance(user_agent, str)
    first, _, rest = user_agent.partition(" ")
    assert first == f"kube-probe/{KUBELET_VERSION}"
    assert rest.startswith("grpc-")
    assert "cri-prober" not in user_agent


async def test_empty_host_dials_the_local_system(health_port: int) -> None:
    """A pod without an IP: the kubelet dials ":<port>", the local system, so a health server on
    the node answers."""
    outcome = await probe_grpc("", health_port, service="", timeout=2)
    assert outcome == ProbeOutcome(ProbeResult.SUCCESS, "service healthy")


# --- mirrored: kubernetes pkg/probe/grpc/grpc_test.go (TestGrpcProber_Probe) ------------------


async def test_kubelet_cant_find_host(closed_port: int) -> None:
    """ "Should: failed but return nil error because cant find host": host "" dials the local
    system; nothing serves there, so the blocking dial times out (upstream uses port 32)."""
    outcome = await probe_grpc("", closed_port, service="", timeout=1)
    expected = (
        f'timeout: failed to connect service ":{closed_port}" within 1s: context deadline exceeded'
    )
    assert outcome == ProbeOutcome(ProbeResult.FAILURE, expected, timed_out=True, reason="timeout")


async def test_kubelet_connection_closed() -> None:
    """ "Should: return nil error because connection closed": a plain HTTP/1.1 server is a
    failure, never an error."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nres")
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        outcome = await probe_grpc("127.0.0.1", port, service="", timeout=1)
    assert outcome.result == ProbeResult.FAILURE


async def test_kubelet_not_serving(recording: tuple[_RecordingHealth, int]) -> None:
    """ "Should: return nil error because server response not served": NOT_SERVING, probed at
    0.0.0.0 as upstream does (Linux delivers that to the loopback listener)."""
    servicer, port = recording
    servicer.status = _Status.NOT_SERVING
    servicer.release.set()
    outcome = await probe_grpc("0.0.0.0", port, service="", timeout=1)
    expected = 'service unhealthy (responded with "NOT_SERVING")'
    assert outcome == ProbeOutcome(ProbeResult.FAILURE, expected, reason="grpc-status")


async def test_kubelet_not_response_in_time(recording: tuple[_RecordingHealth, int]) -> None:
    """ "Should: return nil-error because server not response in time": the upstream server
    sleeps 4 s against a 2 s timeout; this one never answers."""
    _servicer, port = recording
    outcome = await probe_grpc("0.0.0.0", port, service="", timeout=2)
    expected = "timeout: health rpc did not complete within 2s"
    assert outcome == ProbeOutcome(ProbeResult.FAILURE, expected, timed_out=True, reason="timeout")


@pytest.mark.parametrize(
    "case",
    [
        "Should: not return error because check was success",
        "Should: not return error because check was success, when listen port is 0",
    ],
)
async def test_kubelet_check_success(recording: tuple[_RecordingHealth, int], case: str) -> None:
    """The two success cases (both listen on port 0, probe 0.0.0.0 with a 2 s timeout)."""
    servicer, port = recording
    servicer.release.set()
    outcome = await probe_grpc("0.0.0.0", port, service="", timeout=2)
    assert outcome == ProbeOutcome(ProbeResult.SUCCESS, "service healthy"), case


@pytest.mark.parametrize("port", [-1, 65536])
async def test_port_out_of_range_is_a_connect_timeout(port: int) -> None:
    """A port no socket can have never connects: the kubelet's blocking dial ends in its connect
    timeout, and so does this, as a verdict and without grpc core's parse errors."""
    outcome = await probe_grpc("127.0.0.1", port, service="", timeout=1)
    expected = (
        f'timeout: failed to connect service "127.0.0.1:{port}" within 1s: '
        "context deadline exceeded"
    )
    assert outcome == ProbeOutcome(
        ProbeResult.FAILURE, expected, timed_out=True, reason="invalid-target"
    )


# -- cri-prober out of resources: an error, never the target's failure ---------------------------


async def test_out_of_descriptors_is_an_error_not_a_failure(health_port: int) -> None:
    """EMFILE: grpc core cannot open a socket, logs it and retries until the deadline, which
    used to read as the target's connect timeout (a failure counted against the container)."""
    with out_of_descriptors(), pytest.raises(ProbeError, match="out of local resources"):
        await probe_grpc("127.0.0.1", health_port, service="", timeout=1)
    outcome = await probe_grpc("127.0.0.1", health_port, service="", timeout=1)
    assert outcome.result is ProbeResult.SUCCESS


# Patches Python's socket.socket, which uvloop (sockets made in C) never calls; the real
# descriptor-exhaustion tests cover uvloop.
@pytest.mark.asyncio(loop_factories=["asyncio"])
@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS])
async def test_socket_creation_out_of_resources_is_an_error(
    health_port: int, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """Every kind of local exhaustion a socket() reports is an error."""

    def exhausted(*_args: object, **_kwargs: object) -> socket.socket:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(socket, "socket", exhausted)
    with pytest.raises(ProbeError, match=os.strerror(code)):
        await probe_grpc("127.0.0.1", health_port, service="", timeout=1)


async def test_running_out_while_connecting_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sockets run out after the attempt began, while the connection is still pending: the
    connect timeout that follows is ours, not the target's. (Only the handler's own socket check
    is patched: grpc core opens its sockets in C, and with real exhaustion its own churn may free
    a descriptor at any moment, which would make this test a race.)"""
    accepted = asyncio.Event()
    hold = asyncio.Event()

    async def accept_and_hold(_r: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        await hold.wait()  # never speaks HTTP/2, so the channel stays CONNECTING
        writer.close()

    def exhausted(*_args: object, **_kwargs: object) -> socket.socket:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    server = await asyncio.start_server(accept_and_hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        probe = asyncio.create_task(probe_grpc("127.0.0.1", port, service="", timeout=1))
        await accepted.wait()
        monkeypatch.setattr(socket, "socket", exhausted)
        with pytest.raises(ProbeError, match="out of local resources"):
            await probe
    finally:
        monkeypatch.undo()
        hold.set()
        server.close()
        await server.wait_closed()
