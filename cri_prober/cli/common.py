"""What every command shares: exit statuses, the runtime endpoint option, and running one async
program with cri-prober's own errors turned into a message and an exit status (no traceback).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Literal, NoReturn, TypeVar

import click

from cri_prober.errors import ConfigError
from cri_prober.runtime.endpoints import Endpoint, resolve_endpoint

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


def fail(message: str, status: int) -> NoReturn:
    """Print ``cri-prober: message`` on stderr and exit with ``status``."""
    click.echo(f"cri-prober: {message}", err=True)
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
    "loop_factory",
    "resolve_runtime_endpoint",
    "run_async",
    "runtime_endpoint_option",
]
