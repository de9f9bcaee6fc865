"""The grpc handler: one grpc.health.v1.Health/Check over plaintext, like the kubelet's, or over
TLS without verifying the server's certificate for ``mode: TLS`` (KEP-4939, where the kubelet's
gate is on). grpc python cannot skip verification, so that call is made on ``http2.H2Exchange``
over an asyncio TLS connection with ``CERT_NONE``, as the kubelet's ``InsecureSkipVerify: true``.

Every outcome from the target is a verdict: the kubelet's grpc prober never returns an error,
and neither does this, with one exception it cannot have: when cri-prober itself is out of
descriptors, memory or socket buffers, grpc core cannot even open a socket, and what looks like
a connect timeout says nothing about the target (``ProbeError``; see ``tcp.local_exhaustion``).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import ssl
from typing import Final
from urllib.parse import unquote

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cri_prober.probing.handlers import deadline as lag_aware
from cri_prober.probing.handlers import http, tcp
from cri_prober.probing.handlers.http2 import H2Exchange
from cri_prober.probing.outcome import ProbeOutcome, ProbeResult, Reason

_SERVING = health_pb2.HealthCheckResponse.SERVING
# Every SERVING answer has the same (frozen) outcome: one object for all of them.
_HEALTHY = ProbeOutcome(ProbeResult.SUCCESS, "service healthy")


# A worker's probe dials the same target with the same options every period: built once each.
@functools.lru_cache(maxsize=1024)
def _channel_options(
    host: str, port: int, timeout: float, user_agent: str
) -> tuple[tuple[str, str | int], ...]:
    return (
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
        # "kube-probe/1.37 grpc-python-asyncio/… grpc-c/…" where grpc-go's adds "grpc-go/…".
        ("grpc.primary_user_agent", user_agent),
        ("grpc.default_authority", _authority(host, port)),
    )


def _authority(host: str, port: int) -> str:
    # grpc-go names an endpoint that starts with ":" after localhost, e.g. "localhost:8080".
    if not host:
        return f"localhost:{port}"
    return tcp.join_host_port(host, port)


@functools.lru_cache(maxsize=1024)
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
    host: str,
    port: int,
    *,
    service: str,
    timeout: float,
    withhold: str | None = None,
    tls: bool = False,
    user_agent: str | None = None,
) -> ProbeOutcome:
    """Ask ``host:port`` whether ``service`` ("" for the whole server) is SERVING.

    One deadline covers connecting and the call. As with the kubelet's blocking dial, a server
    that refuses connections is retried until the deadline and reported as a connect timeout.
    An empty ``host`` is the local system, as for the kubelet's dial of ``:port``. ``withhold``,
    when set, keeps the server's error details out of the output and says why (see
    ``http.probe_http``); the status is kept. ``tls``: over TLS, the server's certificate
    unverified (``mode: TLS``). ``user_agent``: the kubelet's ``kube-probe/1.<minor>``, which
    leads the header (None: ``http.USER_AGENT``, read at call time).

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
    agent = http.USER_AGENT if user_agent is None else user_agent
    if tls:
        return await _check_over_tls(host, port, service, timeout, withhold, agent)
    try:
        channel = grpc.aio.insecure_channel(
            _target(host, port), options=_channel_options(host, port, timeout, agent)
        )
    except OSError as exc:  # grpc's aio engine could not start: it needs descriptors too
        if tcp.local_exhaustion(exc):
            raise tcp.exhaustion_error(f"grpc probe of {address}", exc) from exc
        raise
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        # wait_for_ready makes the call wait out connection failures, as the kubelet's
        # grpc.WithBlock dial does, so the deadline bounds connect and call together.
        response = await stub.Check(_check_request(service), timeout=timeout, wait_for_ready=True)
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
    return _HEALTHY


@functools.lru_cache(maxsize=256)
def _check_request(service: str) -> health_pb2.HealthCheckRequest:
    """The request message for ``service``, shared by every call: grpc only serializes it."""
    return health_pb2.HealthCheckRequest(service=service)


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


# -- mode: TLS ---------------------------------------------------------------------------------

_CHECK_PATH: Final = b"/grpc.health.v1.Health/Check"
# grpc-go's default connect backoff (base 1 s, factor 1.6, capped at 120 s); the kubelet's
# blocking dial retries a failed connection on it until the probe's deadline.
_BACKOFF_BASE = 1.0
_BACKOFF_FACTOR = 1.6
_BACKOFF_MAX = 120.0
_MAX_RESPONSE = 4096  # bytes of a health response read (one enum field; a gRPC frame header)


@functools.lru_cache(maxsize=1)
def _tls_context() -> ssl.SSLContext:
    """The kubelet's ``tls.Config{InsecureSkipVerify: true}``: TLS, no certificate checks."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])  # gRPC servers refuse a handshake without it
    return context


def _health_request(
    host: str, port: int, service: str, timeout: float, user_agent: str
) -> tuple[list[tuple[bytes, bytes]], bytes]:
    message = health_pb2.HealthCheckRequest(service=service).SerializeToString()
    headers = [
        (b":method", b"POST"),
        (b":scheme", b"https"),
        (b":path", _CHECK_PATH),
        (b":authority", _authority(host, port).encode()),
        (b"content-type", b"application/grpc"),
        # Exactly the kubelet's product token, which grpc-go follows with its own (D12).
        (b"user-agent", user_agent.encode()),
        (b"te", b"trailers"),
        (b"grpc-timeout", f"{max(1, int(timeout * 1000))}m".encode()),
    ]
    # One uncompressed length-prefixed message.
    return headers, b"\x00" + len(message).to_bytes(4, "big") + message


async def _check_over_tls(
    host: str, port: int, service: str, timeout: float, withhold: str | None, user_agent: str
) -> ProbeOutcome:
    """Health/Check over TLS on one HTTP/2 stream: what grpc-go does for the kubelet."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    address = tcp.join_host_port(host, port)
    headers, body = _health_request(host, port, service, timeout, user_agent)
    backoff = _BACKOFF_BASE
    while True:
        exchange = H2Exchange(
            loop, headers, body, max_body=_MAX_RESPONSE, finish_at_cap=False, withhold=withhold
        )
        try:
            async with lag_aware.timeout_at(deadline, timeout):
                await loop.create_connection(
                    lambda: exchange,  # noqa: B023 - awaited before the loop moves on
                    tcp.dial_host(host),
                    port,
                    ssl=_tls_context(),
                    # Go sends the authority's host as SNI (none for an IP address).
                    server_hostname=host or "localhost",
                    ssl_handshake_timeout=max(timeout, 0.001),
                )
            break
        except TimeoutError:
            exchange.close()
            return _connect_failure(address, timeout)
        except (OSError, ssl.SSLError) as exc:
            exchange.close()
            if tcp.local_exhaustion(exc):
                raise tcp.exhaustion_error(f"grpc probe of {address}", exc) from exc
            # Refused, reset, a failed handshake: the blocking dial tries again after its
            # backoff, until the deadline ends it as a connect timeout.
            if loop.time() + backoff >= deadline:
                await _sleep_until(deadline, timeout)
                return _connect_failure(address, timeout)
            await asyncio.sleep(backoff)
            backoff = min(backoff * _BACKOFF_FACTOR, _BACKOFF_MAX)
    try:
        async with lag_aware.timeout_at(deadline, timeout):
            await exchange.end()
    except TimeoutError:
        return ProbeOutcome(
            ProbeResult.FAILURE,
            f"timeout: health rpc did not complete within {_seconds(timeout)}",
            timed_out=True,
            reason=Reason.TIMEOUT,
        )
    finally:
        exchange.close()
    return _tls_verdict(exchange, withhold)


async def _sleep_until(deadline: float, timeout: float) -> None:
    try:
        async with lag_aware.timeout_at(deadline, timeout):
            await asyncio.Event().wait()
    except TimeoutError:
        pass


def _connect_failure(address: str, timeout: float) -> ProbeOutcome:
    return ProbeOutcome(
        ProbeResult.FAILURE,
        _connect_timeout(address, timeout),
        timed_out=True,
        reason=Reason.TIMEOUT,
    )


def _tls_verdict(exchange: H2Exchange, withhold: str | None) -> ProbeOutcome:
    """The health call's verdict from its HTTP/2 answer, worded like grpc-go's errors."""
    if exchange.problem is not None:
        return _rpc_status_failure("UNAVAILABLE", exchange.problem, withhold)
    fields = exchange.fields
    if exchange.status != 200:
        # grpc-go turns a non-200 HTTP status into a status of its own (Unavailable for 502-504,
        # Unimplemented for 404, Unknown else), before any grpc-status the server sent.
        code = {404: "UNIMPLEMENTED", 502: "UNAVAILABLE", 503: "UNAVAILABLE", 504: "UNAVAILABLE"}
        name = code.get(exchange.status, "UNKNOWN")
        if name == "UNIMPLEMENTED":
            return _unimplemented("unexpected HTTP status code received from server: 404")
        return _rpc_status_failure(
            name, f"unexpected HTTP status code received from server: {exchange.status}", None
        )
    status_text = fields.get(b"grpc-status", b"").decode("latin-1")
    if not status_text.isdigit():
        return _rpc_status_failure(
            "INTERNAL", "server closed the stream without sending trailers", None
        )
    code_number = int(status_text)
    if code_number != 0:
        name = _code_name(code_number)
        details = unquote(fields.get(b"grpc-message", b"").decode("utf-8", "replace"))
        if name == "UNIMPLEMENTED":
            return _unimplemented(details if withhold is None else f"(details not kept{withhold})")
        return _rpc_status_failure(name, details, withhold)
    body = exchange.body_bytes()
    if len(body) < 5 or body[0] != 0 or int.from_bytes(body[1:5], "big") != len(body) - 5:
        return _rpc_status_failure("INTERNAL", "grpc: failed to read the health response", None)
    try:
        response = health_pb2.HealthCheckResponse.FromString(body[5:])
    except Exception:  # protobuf's DecodeError: the server sent no HealthCheckResponse
        return _rpc_status_failure("INTERNAL", "grpc: failed to unmarshal the response", None)
    if response.status != _SERVING:
        name = _status_name(response.status)
        return ProbeOutcome(
            ProbeResult.FAILURE,
            f'service unhealthy (responded with "{name}")',
            reason=Reason.GRPC_STATUS,
        )
    return _HEALTHY


def _code_name(number: int) -> str:
    for code in grpc.StatusCode:
        if code.value[0] == number:
            return str(code.name)  # as the plaintext path shows codes
    return f"Code({number})"


def _unimplemented(details: str) -> ProbeOutcome:
    return ProbeOutcome(
        ProbeResult.FAILURE,
        "error: this server does not implement the grpc health protocol "
        f"(grpc.health.v1.Health): {details}",
        reason=Reason.GRPC_STATUS,
    )


def _rpc_status_failure(code: str, details: str, withhold: str | None) -> ProbeOutcome:
    shown = details if withhold is None else f"(details not kept{withhold})"
    return ProbeOutcome(
        ProbeResult.FAILURE,
        f"error: health rpc probe failed: rpc error: code = {code} desc = {shown}",
        reason=Reason.GRPC_STATUS,
    )
