"""``cri-prober check``: run a probe spec on a container straight through the runtime, no daemon.

The container is found and aimed at exactly as the daemon would (same naming, same probe
target), and the probe is sent as the daemon's are, from the same flags (``--node-address``,
``--runtime-request-timeout``, ``--https-verify``, ``--https-ca-file``), so a verdict here is the
verdict ``serve`` would reach.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NoReturn

import click

from cri_prober.cli.common import (
    EXIT_RUNTIME_ERROR,
    EXIT_USAGE,
    fail,
    https_ca_file_option,
    https_verify_option,
    node_address_option,
    run_async,
    runtime_endpoint_option,
    runtime_request_timeout_option,
    tls_options,
)
from cri_prober.discovery.model import container_info, pod_info
from cri_prober.discovery.naming import ContainerRef, TargetError, TargetNotFound, find_container
from cri_prober.errors import CriError, CriNotFound
from cri_prober.probing.kinds import KINDS, parse_kind
from cri_prober.probing.prober import Prober, ProberOptions, ProbeTarget, run_once
from cri_prober.probing.results import ProbeRecord
from cri_prober.probing.spec import SpecError, parse_probe_json
from cri_prober.runtime.client import CriClient
from cri_prober.runtime.endpoints import resolve_endpoint
from cri_prober.text import sanitize

EXIT_PROBE_FAILED = 1


@click.command()
@click.argument("target")
@click.option(
    "--probe",
    "probe_arg",
    required=True,
    metavar="JSON|@FILE",
    help="A core/v1 Probe as JSON (camelCase), or @FILE to read it from a file.",
)
@click.option(
    "--kind",
    type=click.Choice(list(KINDS)),
    default="liveness",
    show_default=True,
    help="Validate the spec as this kind of probe.",
)
@runtime_endpoint_option
@click.option(
    "--count",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Run the probe this many times, back to back.",
)
@node_address_option
@runtime_request_timeout_option
@https_verify_option
@https_ca_file_option
def check(
    target: str,
    probe_arg: str,
    kind: str,
    runtime_endpoint: str | None,
    count: int,
    node_address: str,
    runtime_request_timeout: float,
    https_verify: bool,
    https_ca_file: Path | None,
) -> None:
    """Run a probe once (or --count times) on TARGET directly through the runtime, no daemon.

    TARGET is a container ID, a unique ID prefix or namespace/pod/container. Exit status 0 when
    every attempt succeeded, 1 when one did not (or the runtime failed), 2 for a usage error
    such as an invalid spec (the message names the field). The options that say how probes are
    sent are serve's, with serve's defaults.
    """
    options = ProberOptions(node_address=node_address, tls=tls_options(https_verify, https_ca_file))
    source = "--probe"
    text = probe_arg
    if probe_arg.startswith("@"):
        source = probe_arg[1:]
        try:
            text = Path(source).read_text(encoding="utf-8")
        except OSError as exc:
            fail(f"{source}: cannot read: {exc.strerror}", EXIT_USAGE)
    try:
        probe = parse_probe_json(text, parse_kind(kind), source=source)
    except SpecError as exc:
        fail("invalid probe:\n" + str(exc), EXIT_USAGE)

    async def run() -> NoReturn:
        endpoint = resolve_endpoint(runtime_endpoint)
        async with CriClient.connect(
            endpoint.target, runtime_request_timeout=runtime_request_timeout
        ) as cri:
            try:
                probe_target = await _probe_target(cri, target)
            except TargetError as exc:
                fail(str(exc), EXIT_USAGE)
            except CriError as exc:
                fail(
                    f"cannot reach the container runtime at {endpoint.uri} "
                    f"({exc.code.name}: {exc.details})",
                    EXIT_RUNTIME_ERROR,
                )
            prober = Prober.from_options(cri, options)
            failed = False
            for attempt in range(1, count + 1):
                record = await run_once(prober, probe, probe_target)
                failed |= record.result not in ("success", "warning")
                _print_record(record, attempt, count)
        sys.exit(EXIT_PROBE_FAILED if failed else 0)

    run_async(run)


async def _probe_target(cri: CriClient, target: str) -> ProbeTarget:
    """Resolve ``target`` over the runtime's containers and aim a probe at it like ``serve``."""
    sandboxes = {sandbox.id: sandbox for sandbox in await cri.list_pod_sandboxes()}
    refs = [
        ContainerRef(
            id=container.id,
            name=container.name,
            attempt=container.attempt,
            created_at=container.created_at,
            pod_name=sandbox.name,
            pod_namespace=sandbox.namespace,
            pod_uid=sandbox.uid,
            pod_sandbox_id=sandbox.id,
            pod_created_at=sandbox.created_at,
        )
        for container in await cri.list_containers()
        if (sandbox := sandboxes.get(container.pod_sandbox_id)) is not None
    ]
    ref = find_container(target, refs)
    try:
        pod = pod_info(await cri.pod_sandbox_status(ref.pod_sandbox_id))
        status = await cri.container_status(ref.id, verbose=True)
    except CriNotFound as exc:
        raise TargetNotFound(f"container {ref.label} went away") from exc
    # No rule names its ports here: named ports resolve from the kubelet's ports annotation.
    return ProbeTarget.of(container_info(status, pod, None), ports={})


def _print_record(record: ProbeRecord, attempt: int, count: int) -> None:
    details = []
    if record.exit_code is not None:
        details.append(f"exit code {record.exit_code}")
    if record.http_status is not None:
        details.append(f"HTTP {record.http_status}")
    if record.timed_out:
        details.append("timed out")
    prefix = f"attempt {attempt}/{count}: " if count > 1 else ""
    suffix = f" ({', '.join(details)})" if details else ""
    click.echo(f"{prefix}{record.result}{suffix} in {record.duration:.3f}s")
    if record.output:
        click.echo(sanitize(record.output.rstrip("\n")))
