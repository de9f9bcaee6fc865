"""The ``cri-prober`` command line: a click group whose commands each run one asyncio program.

User mistakes end with one clear message and a documented exit status, never a traceback.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import NoReturn, TypeVar

import click

from cri_prober import __version__, logs
from cri_prober.cri import CriClient
from cri_prober.endpoints import resolve_endpoint
from cri_prober.errors import ConfigError, CriError

_T = TypeVar("_T")

# Exit statuses shared by every command (``health`` and ``check`` add their own, see interface.md).
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


def _fail(message: str, status: int) -> NoReturn:
    click.echo(f"cri-prober: {message}", err=True)
    sys.exit(status)


def _run(main: Callable[[], Awaitable[_T]]) -> _T:
    """Run one async command; turn cri-prober's own errors into a message and an exit status."""
    try:
        return asyncio.run(main())  # type: ignore[arg-type]
    except ConfigError as exc:
        _fail(str(exc), EXIT_USAGE)
    except KeyboardInterrupt:
        sys.exit(130)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-v", prog_name="cri-prober")
def main() -> None:
    """Kubelet-exact liveness, readiness and startup probes over CRI."""
    # Client commands speak through their output and exit status; only warnings are logged.
    logs.configure(level="warning")


@main.command()
@runtime_endpoint_option
@click.option(
    "-t", "--timeout", default=2.0, show_default=True, metavar="SECONDS", help="Per-call timeout."
)
def version(runtime_endpoint: str | None, timeout: float) -> None:
    """Print cri-prober's version and the runtime's name, version and CRI API version."""

    async def run() -> None:
        endpoint = resolve_endpoint(runtime_endpoint)
        async with CriClient.connect(endpoint.target, call_timeout=timeout) as cri:
            try:
                info = await cri.version()
            except CriError as exc:
                _fail(
                    f"cannot reach the container runtime at {endpoint.uri} "
                    f"({exc.code.name}: {exc.details})",
                    EXIT_RUNTIME_ERROR,
                )
        click.echo(f"cri-prober version:  {__version__}")
        click.echo(f"Version:  {info.version}")
        click.echo(f"RuntimeName:  {info.runtime_name}")
        click.echo(f"RuntimeVersion:  {info.runtime_version}")
        click.echo(f"RuntimeApiVersion:  {info.runtime_api_version}")

    _run(run)
