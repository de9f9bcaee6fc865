"""The tcpSocket handler: open a TCP connection and close it at once, like the kubelet.

It also holds the dialing helpers the HTTP and gRPC handlers share: address formatting, where an
empty host is dialled, the Go-style text a failed dial turns into, and the test for errors that
mean cri-prober itself ran out of something (descriptors, memory, buffers), which make an
attempt an error rather than the target's failure.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket

from cri_prober.probing.handlers import deadline
from cri_prober.probing.outcome import ProbeError, ProbeOutcome, ProbeResult, Reason

# The process or the host is out of descriptors (EMFILE, ENFILE), memory (ENOMEM) or socket
# buffers (ENOBUFS). Those say nothing about the target, and anyone who can make cri-prober
# run out of them (a flood of connections to its metrics port) must not be able to fail, and
# in stop mode kill, every container on the node: such an attempt is an error, discarded.
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
# getaddrinfo reports the same as EAI_MEMORY, or EAI_SYSTEM with the errno lost (it fails that
# way when it cannot open a socket or /etc/hosts).
_EXHAUSTED_LOOKUP = frozenset({socket.EAI_MEMORY, socket.EAI_SYSTEM})
_EXHAUSTED_TEXT = tuple(os.strerror(code) for code in sorted(_EXHAUSTED))

# A note on SO_LINGER. The kubelet dials probes with SO_LINGER{on, 1 s} (kubernetes#89898) hoping
# to shorten TIME-WAIT. On Linux it does not: the socket still sits in TIME-WAIT for 60 s, and
# close() blocks until the peer acknowledges our FIN (about 4 ms on loopback, because the peer
# delays that ACK; up to the full second if the peer has gone). In Go that parks one thread; here
# it would stall the event loop on every probe that closes first. So these sockets close
# normally: the packets and the TIME-WAIT count are the same as the kubelet's.


# Go dials an empty host (``:8080``, what the kubelet builds for a pod without an IP) as "the local
# system": on Linux an IPv4 connect to 0.0.0.0, which the kernel delivers to 127.0.0.1. Dialling
# the same literal keeps the same reach (an IPv6-only listener on ::1 is not reached, as with Go).
_LOCAL_SYSTEM = "0.0.0.0"

# Every successful attempt has the same (frozen) outcome: one object for all of them.
_CONNECTED = ProbeOutcome(ProbeResult.SUCCESS)


def dial_host(host: str) -> str:
    """The address a dial to ``host`` connects to: ``host`` itself, or Go's local system for ""."""
    return host or _LOCAL_SYSTEM


def invalid_port(port: int) -> str | None:
    """Go's resolver error for a port outside 0-65535 (``address -1: invalid port``), else None."""
    if 0 <= port <= 65535:
        return None
    return f"address {port}: invalid port"


def join_host_port(host: str, port: int) -> str:
    """Return ``host:port``, with an IPv6 host in brackets (Go's ``net.JoinHostPort``)."""
    if ":" in host:
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def local_exhaustion(exc: OSError) -> bool:
    """Whether ``exc`` says cri-prober ran out of descriptors, memory or buffers."""
    if isinstance(exc, socket.gaierror):
        return exc.errno in _EXHAUSTED_LOOKUP
    if exc.errno is not None:
        return exc.errno in _EXHAUSTED
    # asyncio joins the errors of several addresses into one message without an errno: one
    # address it could not even try leaves the attempt incomplete.
    return any(text in str(exc) for text in _EXHAUSTED_TEXT)


def exhaustion_error(what: str, exc: OSError) -> ProbeError:
    """The ``ProbeError`` for an attempt that failed because cri-prober is out of resources."""
    return ProbeError(f"{what}: cri-prober is out of local resources, not a verdict: {exc}")


def dial_reason(exc: OSError) -> str:
    """The ``Reason`` of a failed connect: refused, or another connection error."""
    if isinstance(exc, ConnectionRefusedError) or exc.errno == errno.ECONNREFUSED:
        return Reason.CONNECTION_REFUSED
    return Reason.CONNECTION_ERROR


def dial_error(host: str, port: int, exc: OSError) -> str:
    """Describe a failed connect the way Go's dialer does, e.g. ``dial tcp …: connect: …``."""
    if isinstance(exc, socket.gaierror):
        return f"dial tcp: lookup {host}: {exc.strerror}"
    address = join_host_port(host, port)
    if exc.errno is None:
        # Several addresses failed in different ways; asyncio already joined their messages.
        return f"dial tcp {address}: {exc}"
    reason = os.strerror(exc.errno)
    return f"dial tcp {address}: connect: {reason[:1].lower()}{reason[1:]}"


async def probe_tcp(host: str, port: int, *, timeout: float) -> ProbeOutcome:
    """Succeed if a TCP connection to ``host:port`` opens within ``timeout`` seconds.

    An empty ``host`` is the local system, as in Go: the kubelet dials ``:port`` for a pod that
    has no IP yet, and that attempt counts.

    Raises:
        ProbeError: cri-prober ran out of descriptors, memory or buffers (``local_exhaustion``).
    """
    if (bad_port := invalid_port(port)) is not None:
        # Go's dialer rejects the address before connecting; asyncio would raise OverflowError.
        return ProbeOutcome(
            ProbeResult.FAILURE, f"dial tcp: {bad_port}", reason=Reason.INVALID_TARGET
        )
    loop = asyncio.get_running_loop()
    try:
        # Lag-aware: a connection that opened while the loop was stalled is not a timeout.
        async with deadline.timeout_after(timeout) as scope:
            # create_connection resolves names in the executor and skips resolution for literal
            # addresses, so nothing here blocks the loop.
            transport, _ = await loop.create_connection(asyncio.Protocol, dial_host(host), port)
    except TimeoutError as exc:
        if scope.expired():
            address = join_host_port(host, port)
            return ProbeOutcome(
                ProbeResult.FAILURE, f"dial tcp {address}: i/o timeout", timed_out=True
            )
        return ProbeOutcome(
            ProbeResult.FAILURE, dial_error(host, port, exc), reason=dial_reason(exc)
        )
    except OSError as exc:
        if local_exhaustion(exc):
            raise exhaustion_error(f"dial tcp {join_host_port(host, port)}", exc) from exc
        return ProbeOutcome(
            ProbeResult.FAILURE, dial_error(host, port, exc), reason=dial_reason(exc)
        )
    except (UnicodeError, ValueError) as exc:
        # A host name that cannot even be looked up (an empty or over-long IDNA label, a NUL):
        # Go's dialer fails the lookup, so this is a failure too, not a crash.
        return ProbeOutcome(ProbeResult.FAILURE, f"dial tcp: lookup {host!r}: {exc}")
    transport.close()
    return _CONNECTED
