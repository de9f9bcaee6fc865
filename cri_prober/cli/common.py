"""What every command shares: exit statuses, the runtime endpoint option, and running one async
program with cri-prober's own errors turned into a message and an exit status (no traceback).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import NoReturn, TypeVar

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


def run_async(main: Callable[[], Awaitable[_T]]) -> _T:
    """Run one async command; turn cri-prober's own errors into a message and an exit status."""
    try:
        return asyncio.run(main())  # type: ignore[arg-type]
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
    "fail",
    "resolve_runtime_endpoint",
    "run_async",
    "runtime_endpoint_option",
]
