"""What every command shares: exit statuses, the runtime endpoint option, the options that say
how probes are sent (``serve`` and ``check`` take the same ones), and running one async program
with cri-prober's own errors turned into a message and an exit status (no traceback).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal, NoReturn, TypeVar

import click

from cri_prober.errors import ConfigError
from cri_prober.probing.handlers.http import TLSOptions
from cri_prober.probing.prober import DEFAULT_NODE_ADDRESS
from cri_prober.runtime.client import DEFAULT_RUNTIME_REQUEST_TIMEOUT
from cri_prober.runtime.endpoints import Endpoint, resolve_endpoint
from cri_prober.text import sanitize

_T = TypeVar("_T")

# Exit statuses shared by every command (``health`` and ``check`` add their own; docs/interface.md).
EXIT_RUNTIME_ERROR = 1
EXIT_USAGE = 2

runtime_endpoint_option = click.option(
    "-r",
    "--runtime-endpoint",
    "runtime_endpoint",
    metavar="URI",
    default=None,
    help="CRI runtime endpoint (unix:///PATH, /PATH or tcp://HOST:PORT). Default: "
    "$CONTAINER_RUNTIME_ENDPOINT, then runtime-endpoint in $CRI_CONFIG_FILE or "
    "/etc/crictl.yaml, then the first default socket that exists.",
)

# How probes are sent: ``serve`` and ``check`` take these alike (one definition, so a probe run
# by hand with the daemon's flags goes out as the daemon's would).
node_address_option = click.option(
    "--node-address",
    envvar="CRI_PROBER_NODE_ADDRESS",
    default=DEFAULT_NODE_ADDRESS,
    show_default=True,
    metavar="IP",
    help="Address probes use for host-network pods (the kubelet uses the node's IP); its family "
    "picks which IP of a dual-stack pod is probed (set the node's IPv6 address on an "
    "IPv6-primary node). Env: CRI_PROBER_NODE_ADDRESS.",
)
runtime_request_timeout_option = click.option(
    "--runtime-request-timeout",
    type=click.FloatRange(min=1),
    default=DEFAULT_RUNTIME_REQUEST_TIMEOUT,
    show_default=True,
    metavar="SECONDS",
    help="Like the kubelet's flag: an exec probe's call waits up to its timeout plus this long "
    "for the runtime's answer (containerd answers once the exec's output closes). Its exec slot "
    "is freed at the probe's timeout (at most 10 s).",
)
https_verify_option = click.option(
    "--https-verify",
    is_flag=True,
    default=False,
    help="Verify the certificates of HTTPS probe targets against the system trust store "
    "(the kubelet never verifies; off by default for the same behaviour).",
)
https_ca_file_option = click.option(
    "--https-ca-file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="Verify HTTPS probe targets against this CA bundle instead (implies --https-verify).",
)


def tls_options(https_verify: bool, https_ca_file: Path | None) -> TLSOptions:
    """What ``--https-verify`` and ``--https-ca-file`` ask for (a CA file implies verifying)."""
    return TLSOptions(
        verify=https_verify or https_ca_file is not None,
        ca_file=str(https_ca_file) if https_ca_file else None,
    )


def fail(message: str, status: int) -> NoReturn:
    """Print ``cri-prober: message`` on stderr (sanitized: it may quote a name, a runtime's or
    the daemon's answer) and exit with ``status``."""
    click.echo(sanitize(f"cri-prober: {message}"), err=True)
    sys.exit(status)


EventLoop = Literal["auto", "uvloop", "asyncio"]


def loop_factory(event_loop: EventLoop) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory for ``event_loop``: uvloop's (libuv) loop, or None for asyncio's own.

    ``auto`` takes uvloop where it is installed (a dependency everywhere but Windows): grpc.aio
    runs on it, and serve's probes and relists cost less CPU on it (docs/benchmarks.md).
    """
    if event_loop == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if event_loop == "uvloop":
            fail("--event-loop uvloop: uvloop is not installed", EXIT_USAGE)
        return None
    return uvloop.new_event_loop


def run_async(main: Callable[[], Awaitable[_T]], *, event_loop: EventLoop = "asyncio") -> _T:
    """Run one async command; turn cri-prober's own errors into a message and an exit status."""
    try:
        with asyncio.Runner(loop_factory=loop_factory(event_loop)) as runner:
            return runner.run(main())  # type: ignore[arg-type]
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    except KeyboardInterrupt:
        sys.exit(130)


def resolve_runtime_endpoint(runtime_endpoint: str | None) -> Endpoint:
    """The runtime endpoint crictl would use; a bad one is a usage error."""
    try:
        return resolve_endpoint(runtime_endpoint)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)


__all__ = [
    "EXIT_RUNTIME_ERROR",
    "EXIT_USAGE",
    "EventLoop",
    "fail",
    "https_ca_file_option",
    "https_verify_option",
    "loop_factory",
    "node_address_option",
    "resolve_runtime_endpoint",
    "run_async",
    "runtime_endpoint_option",
    "runtime_request_timeout_option",
    "tls_options",
]
