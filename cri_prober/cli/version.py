"""``cri-prober version``: cri-prober's version and the runtime's, like ``crictl version``."""

from __future__ import annotations

import click

from cri_prober import __version__
from cri_prober.cli.client import address_option, daemon_kubelet
from cri_prober.cli.common import (
    EXIT_RUNTIME_ERROR,
    fail,
    run_async,
    runtime_endpoint_option,
)
from cri_prober.errors import CriError
from cri_prober.runtime.client import CriClient
from cri_prober.runtime.endpoints import resolve_endpoint
from cri_prober.runtime.model import RuntimeVersion
from cri_prober.text import ONE_LINE, sanitize


def version_lines(
    own_version: str, endpoint_uri: str, info: RuntimeVersion, kubelet: str = ""
) -> list[str]:
    """What ``version`` prints: cri-prober's version, then the runtime's answer under crictl's
    keys (the same keys and values, so what parses ``crictl version`` parses these), each line
    labelled. crictl's ``Version`` is the CRI VersionResponse's ``version`` field, the version
    of the kubelet runtime API the runtime speaks ("0.1.0" for years), not cri-prober's nor the
    runtime's own: its label comes after the value, two spaces on, so a parser reading the
    second word (``awk '$1 == "Version:" {print $2}'``) still gets the value alone.
    ``kubelet``: the kubelet release and gates the daemon's probes follow (its API's GetInfo),
    or why that is not known; a last line of its own.
    """
    lines = [
        f"cri-prober version:  {own_version}",
        f"RuntimeEndpoint:  {endpoint_uri}",
        f"Version:  {info.version}  (CRI VersionResponse.version: the kubelet runtime API version)",
        f"RuntimeName:  {info.runtime_name}",
        f"RuntimeVersion:  {info.runtime_version}",
        f"RuntimeApiVersion:  {info.runtime_api_version}",
    ]
    if kubelet:
        lines.append(f"Kubelet semantics:  {kubelet}")
    # The runtime's strings are shown, never obeyed (each stays one line).
    return [sanitize(line, ONE_LINE) for line in lines]


@click.command()
@runtime_endpoint_option
@address_option
@click.option(
    "-t", "--timeout", default=2.0, show_default=True, metavar="SECONDS", help="Per-call timeout."
)
def version(runtime_endpoint: str | None, address: str, timeout: float) -> None:
    """Print cri-prober's version, the runtime's name, version and CRI API version, and the
    kubelet release (and gates) whose probe behaviour the daemon at --address follows."""

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
        kubelet = await daemon_kubelet(address, timeout)
        click.echo("\n".join(version_lines(__version__, endpoint.uri, info, kubelet)))

    run_async(run)
