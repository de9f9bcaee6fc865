"""The grpc handler: one grpc.health.v1.Health/Check over plaintext, like the kubelet's.

Every outcome from the target is a verdict: the kubelet's grpc prober never returns an error,
and neither does this, with one exception it cannot have: when cri-prober itself is out of
descriptors, memory or socket buffers, grpc core cannot even open a socket, and what looks like
a connect timeout says nothing about the target (``ProbeError``; see ``tcp.local_exhaustion``).
"""

from __future__ import annotations

import ipaddress
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cri_prober.probing.handlers import http, tcp
from cri_prober.probing.outcome import ProbeOutcome, ProbeResult, Reason

_SERVING = health_pb2.HealthCheckResponse.SERVING


def _channel_options(host: str, port: int, timeout: float) -> list[tuple[str, str | int]]:
    return [
        # grpc core keeps a connection attempt open for at least its minimum connect timeout
        # (20 s) even after the channel is closed; bound it by the probe's own timeout so a
        # target that never finishes the handshake does not leave sockets behind.
        ("grpc.min_reconnect_backoff_ms", max(1, int(timeout * 1000))),
        # The kubelet dials a fresh connection per probe; the default global subchannel pool
        # would share one (and its reconnect backoff) between probes of the same target.
        ("grpc.use_local_subchannel_pool", 1),
        # grpc core honours http_proxy/https_proxy; the kubelet's custom dialer bypasses them.
        ("grpc.enable_http_proxy", 0),
        # grpc core always appends its own product tokens after this one: the header reads
        # "kube-probe/1.34 grpc-python-asyncio/… grpc-c/…" where grpc-go's adds "grpc-go/…".
        ("grpc.primary_user_agent", http.USER_AGENT),
        ("grpc.default_authority", _authority(host, port)),
    ]


def _authority(host: str, port: int) -> str:
    # grpc-go names an endpoint that starts with ":" after localhost, e.g. "localhost:8080".
    if not host:
        return f"localhost:{port}"
    return tcp.join_host_port(host, port)


def _target(host: str, port: int) -> str:
    # Literal addresses skip the resolver: less work per probe than the default dns: scheme.
    # An empty host is Go's local system (tcp.dial_host); grpc's resolver can't parse ":port".
    dial = tcp.dial_host(host)
    try:
        version = ipaddress.ip_address(dial).version
    except ValueError:
        return tcp.join_host_port(dial, port)
    return f"ipv{version}:{tcp.join_host_port(dial, port)}"


def _check_local_resources(address: str) -> None:
    """Raise ``ProbeError`` if this process cannot open a socket for want of resources.

    grpc core opens its sockets in C and, when that fails, only logs it and retries until the
    deadline: the attempt would read as the target's connect timeout. One socket opened and
    closed here costs two system calls and tells the two apart.
    """
    try:
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()
    except OSError as exc:
        if tcp.local_exhaustion(exc):
            raise tcp.exhaustion_error(f"grpc probe of {address}", exc) from exc


def _seconds(timeout: float) -> str:
    """Format like a Go duration in the kubelet's messages: ``1s``, ``0.5s``."""
    return f"{timeout:g}s"


async def probe_grpc(
    host: str, port: int, *, service: str, timeout: float, withhold: str | None = None
) -> ProbeOutcome:
    """Ask ``host:port`` whether ``service`` ("" for the whole server) is SERVING.

    One deadline covers connecting and the call. As with the kubelet's blocking dial, a server
    that refuses connections is retried until the deadline and reported as a connect timeout.
    An empty ``host`` is the local system, as for the kubelet's dial of ``:port``. ``withhold``,
    when set, keeps the server's error details out of the output and says why (see
    ``http.probe_http``); the status is kept.

    Raises:
        ProbeError: cri-prober is out of descriptors, memory or socket buffers.
    """
    address = tcp.join_host_port(host, port)
    if tcp.invalid_port(port) is not None:
        # Go's blocking dial retries an address it can't dial until the deadline and reports
        # the connect timeout; give that verdict at once (grpc core would only log a parse error).
        return ProbeOutcome(
            ProbeResult.FAILURE,
            _connect_timeout(address, timeout),
            timed_out=True,
            reason=Reason.INVALID_TARGET,  # Go's text is a timeout's; the cause is the port
        )
    _check_local_resources(address)
    try:
        channel = grpc.aio.insecure_channel(
            _target(host, port), options=_channel_options(host, port, timeout)
        )
    except OSError as exc:  # grpc's aio engine could not start: it needs descriptors too
        if tcp.local_exhaustion(exc):
            raise tcp.exhaustion_error(f"grpc probe of {address}", exc) from exc
        raise
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        # wait_for_ready makes the call wait out connection failures, as the kubelet's
        # grpc.WithBlock dial does, so the deadline bounds connect and call together.
        response = await stub.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout, wait_for_ready=True
        )
    except grpc.aio.AioRpcError as exc:
        connected = channel.get_state() == grpc.ChannelConnectivity.READY
        if not connected:
            # Never connected: the target's fault, or ours if we ran out of sockets meanwhile.
            _check_local_resources(address)
        timed_out = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        return ProbeOutcome(
            ProbeResult.FAILURE,
            _rpc_failure(exc, connected, address, timeout, withhold),
            timed_out=timed_out,
            reason=Reason.TIMEOUT if timed_out else Reason.GRPC_STATUS,
        )
    finally:
        await channel.close()
    if response.status != _SERVING:
        name = _status_name(response.status)
        return ProbeOutcome(
            ProbeResult.FAILURE,
            f'service unhealthy (responded with "{name}")',
            reason=Reason.GRPC_STATUS,
        )
    return ProbeOutcome(ProbeResult.SUCCESS, "service healthy")


def _connect_timeout(address: str, timeout: float) -> str:
    return (
        f'timeout: failed to connect service "{address}" within {_seconds(timeout)}: '
        "context deadline exceeded"
    )


def _status_name(status: int) -> str:
    # Like Go's enum String(): a value this client doesn't know is shown as its number.
    try:
        name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    except ValueError:
        return str(status)
    return name


def _rpc_failure(
    exc: grpc.aio.AioRpcError,
    connected: bool,
    address: str,
    timeout: float,
    withhold: str | None,
) -> str:
    code = exc.code()
    # The details are the server's own words, like an HTTP body.
    details = exc.details() if withhold is None else f"(details not kept{withhold})"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        # A channel that never got READY timed out connecting, not in the call.
        if not connected:
            return _connect_timeout(address, timeout)
        return f"timeout: health rpc did not complete within {_seconds(timeout)}"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return (
            "error: this server does not implement the grpc health protocol "
            f"(grpc.health.v1.Health): {details}"
        )
    return f"error: health rpc probe failed: rpc error: code = {code.name} desc = {details}"
