"""``cri-prober version``: cri-prober's version and the runtime's, like ``crictl version``."""

from __future__ import annotations

import click

from cri_prober import __version__
from cri_prober.cli.common import (
    EXIT_RUNTIME_ERROR,
    fail,
    run_async,
    runtime_endpoint_option,
)
from cri_prober.errors import CriError
from cri_prober.runtime.client import CriClient
from cri_prober.runtime.endpoints import resolve_endpoint


@click.command()
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
                fail(
                    f"cannot reach the container runtime at {endpoint.uri} "
                    f"({exc.code.name}: {exc.details})",
                    EXIT_RUNTIME_ERROR,
                )
        click.echo(f"cri-prober version:  {__version__}")
        click.echo(f"Version:  {info.version}")
        click.echo(f"RuntimeName:  {info.runtime_name}")
        click.echo(f"RuntimeVersion:  {info.runtime_version}")
        click.echo(f"RuntimeApiVersion:  {info.runtime_api_version}")

    run_async(run)
