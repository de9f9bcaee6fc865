"""The API client commands: ``ps``, ``inspect``, ``watch`` and ``health`` ask a running ``serve``
over its local API and print what it says, in crictl's style.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click
import grpc
import yaml
from click.core import ParameterSource
from google.protobuf import json_format
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cri_prober._gen.criprober.v1 import query_pb2, query_pb2_grpc
from cri_prober.cli.common import EXIT_RUNTIME_ERROR, EXIT_USAGE, fail, run_async
from cri_prober.cli.tables import (
    PS_HEADERS,
    PS_WIDE_HEADERS,
    WATCH_COLUMNS,
    container_summary,
    not_serving_lines,
    ps_row,
    ps_wide_row,
    table,
    transition_cells,
    watch_line,
)
from cri_prober.errors import ConfigError, CriProberError
from cri_prober.serving.address import parse_listen
from cri_prober.serving.health import REASON_METADATA_KEY, WARNING_METADATA_KEY
from cri_prober.text import CELL, ONE_LINE, json_escaped, sanitize

if TYPE_CHECKING:
    from cri_prober._gen.criprober.v1.query_pb2_grpc import CriProberAsyncStub

_T = TypeVar("_T")

DEFAULT_ADDRESS = "unix:///run/cri-prober/cri-prober.sock"  # serve --listen's default
# grpc-health-probe's exit statuses, which `health` keeps.
EXIT_CANNOT_CONNECT = 2
EXIT_RPC_FAILED = 3
EXIT_NOT_SERVING = 4
EXIT_PROBE_FAILED = 1
# A whole node's containers in one ListContainers answer may exceed gRPC's default 4 MiB.
MAX_RECEIVE_MESSAGE_BYTES = 64 * 1024 * 1024
address_option = click.option(
    "--address",
    metavar="URI",
    envvar="CRI_PROBER_ADDRESS",
    default=DEFAULT_ADDRESS,
    show_default=True,
    help="cri-prober's API (what serve --listen was given): unix:///PATH or tcp://HOST:PORT. "
    "Env: CRI_PROBER_ADDRESS.",
)
no_trunc_option = click.option(
    "--no-trunc",
    is_flag=True,
    default=False,
    help="Show full container IDs and cells whole (crictl's flag); columns may then not line up.",
)
timeout_option = click.option(
    "-t",
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=5.0,
    show_default=True,
    metavar="SECONDS",
    help="Time allowed for connecting to the daemon and for each answer (a watch stream has no "
    "limit).",
)
filter_options = [
    click.option("--name", metavar="RE", default="", help="Regular expression on container names."),
    click.option("--namespace", metavar="RE", default="", help="Regular expression on namespaces."),
    click.option("--pod", metavar="RE", default="", help="Regular expression on pod names."),
]


def _resume_point(
    _ctx: click.Context, _param: click.Parameter, value: str | None
) -> tuple[str | None, int] | None:
    """``watch --since``: ``INCARNATION:SEQ``, or ``0`` alone (everything still buffered).

    A bare sequence above 0 is refused: sequences start again at 1 whenever cri-prober restarts,
    so without its incarnation it could silently name another process's transitions.
    """
    if value is None:
        return None
    incarnation, colon, number = value.rpartition(":")
    sequence = int(number) if number.isdecimal() and number.isascii() else -1
    if not 0 <= sequence < 2**64 or (colon and not incarnation):
        raise click.BadParameter(f"{value!r} is not INCARNATION:SEQ (SEQ a number >= 0)")
    if not colon and sequence > 0:
        raise click.BadParameter(
            f"{value}: a sequence above 0 needs the incarnation it came from, as "
            f"INCARNATION:{sequence} (watch -o json prints it with each transition); "
            "sequences start again at 1 when cri-prober restarts. 0 alone replays everything "
            "still buffered."
        )
    return (incarnation or None, sequence)


def _with_filters(command: Callable[..., _T]) -> Callable[..., _T]:
    for option in reversed(filter_options):
        command = option(command)
    return command


class ApiUnreachable(CriProberError):
    """The daemon's API cannot be reached; the message says why."""


def _address_source() -> str:
    """What to call the address in messages: ``CRI_PROBER_ADDRESS`` when it came from there,
    else ``--address``."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.get_parameter_source("address") is ParameterSource.ENVIRONMENT:
        return "CRI_PROBER_ADDRESS"
    return "--address"


@contextlib.asynccontextmanager
async def _channel(address: str, timeout: float) -> AsyncIterator[grpc.aio.Channel]:
    """A channel to the daemon, ready to use; raises ``ApiUnreachable`` or ``ConfigError``."""
    listen = parse_listen(address, flag=_address_source())
    hint = "is `cri-prober serve` running there?"
    if listen.unix_path is not None:
        if not listen.unix_path.exists():
            raise ApiUnreachable(
                f"cannot connect to cri-prober at {address}: no such socket ({hint})"
            )
        if not os.access(listen.unix_path, os.R_OK | os.W_OK):
            raise ApiUnreachable(
                f"cannot connect to cri-prober at {address}: permission denied "
                "(the socket is mode 0600: run as its owner, usually root)"
            )
    channel = grpc.aio.insecure_channel(
        listen.grpc_address,
        options=[
            ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
            ("grpc.enable_http_proxy", 0),
        ],
    )
    try:
        try:
            async with asyncio.timeout(timeout):
                await channel.channel_ready()
        except TimeoutError:
            raise ApiUnreachable(
                f"cannot connect to cri-prober at {address} within {timeout:g}s ({hint})"
            ) from None
        yield channel
    finally:
        await channel.close()


def _call_api(
    address: str, timeout: float, call: Callable[[CriProberAsyncStub], Awaitable[_T]]
) -> _T:
    """Connect, run ``call(stub)`` and map every way it can fail to a message and exit 1."""

    async def run() -> _T:
        try:
            async with _channel(address, timeout) as channel:
                return await call(query_pb2_grpc.CriProberStub(channel))
        except ApiUnreachable as exc:
            fail(str(exc), EXIT_RUNTIME_ERROR)
        except grpc.aio.AioRpcError as exc:
            fail(f"{exc.code().name}: {exc.details()}", EXIT_RUNTIME_ERROR)

    return run_async(run)


async def daemon_kubelet(address: str, timeout: float) -> str:
    """What ``version`` says of the kubelet semantics the daemon at ``address`` follows: its
    line's value, or why it is not known (never an error: the runtime's part stands alone)."""
    try:
        async with _channel(address, timeout) as channel:
            info = await query_pb2_grpc.CriProberStub(channel).GetInfo(
                query_pb2.GetInfoRequest(), timeout=timeout
            )
    except (ApiUnreachable, ConfigError) as exc:
        return f"unknown ({exc})"
    except grpc.aio.AioRpcError as exc:
        return f"unknown (cri-prober at {address}: {exc.code().name}: {exc.details()})"
    return kubelet_value(info.kubelet)


def kubelet_value(kubelet: query_pb2.KubeletSemantics) -> str:
    """``1.37`` and the gates set explicitly, for people."""
    return kubelet.text or kubelet.version


def kubelet_line(kubelet: query_pb2.KubeletSemantics) -> str:
    """The line ``inspect`` ends with: which kubelet's probe behaviour was followed."""
    return sanitize(f"Kubelet semantics: {kubelet_value(kubelet)}", ONE_LINE)


# -- output helpers -------------------------------------------------------------------------------


def _to_dict(message: Message) -> dict[str, Any]:
    """Protobuf JSON with every field (false booleans too), keys in the proto's field order."""
    data = json_format.MessageToDict(message, always_print_fields_with_no_presence=True)
    return _in_field_order(message, data)


def _in_field_order(message: Message, data: dict[str, Any]) -> dict[str, Any]:
    # MessageToDict puts the fields that are set first and the defaults after them.
    ordered: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        if field.json_name not in data:
            continue
        value = data[field.json_name]
        nested = field.message_type
        # Maps and well-known types (a Timestamp is a string in JSON) keep their own shape.
        if nested is not None and not nested.GetOptions().map_entry:
            if field.is_repeated:
                items = getattr(message, field.name)
                value = [
                    _in_field_order(m, d) if isinstance(d, dict) else d
                    for m, d in zip(items, value, strict=True)
                ]
            elif isinstance(value, dict):
                value = _in_field_order(getattr(message, field.name), value)
        ordered[field.json_name] = value
    return ordered


def _json(data: Any, indent: int | None = None) -> str:
    """JSON with the exact text, readable, yet no control character raw (`json_escaped`)."""
    return json_escaped(json.dumps(data, indent=indent, ensure_ascii=False))


def _yaml(data: Any) -> str:
    """YAML with the exact text and no control character raw. PyYAML escapes C0 and C1
    controls itself, but with allow_unicode it writes bidi overrides raw; a document that
    holds one is written with every non-ASCII character escaped instead (still exact)."""
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    if sanitize(text) != text:  # an unsafe character other than its own newlines
        text = yaml.safe_dump(data, sort_keys=False, allow_unicode=False)
    return text


def _emit(data: Any, output: str) -> None:
    if output == "yaml":
        click.echo(_yaml(data), nl=False)
    else:
        click.echo(_json(data, indent=2))


# -- ps -------------------------------------------------------------------------------------------

# crictl ps --state: these four, any case (crictl lowercases the value); anything else is refused.
STATE_VALUES = {
    "created": query_pb2.CONTAINER_CREATED,
    "running": query_pb2.CONTAINER_RUNNING,
    "exited": query_pb2.CONTAINER_EXITED,
    "unknown": query_pb2.CONTAINER_UNKNOWN,
}


def _container_state(
    _ctx: click.Context, _param: click.Parameter, value: str | None
) -> query_pb2.ContainerState.ValueType | None:
    """``ps --state``: crictl's values in any case; an unknown one is refused with crictl's
    message (a usage error here)."""
    if value is None:
        return None
    state = STATE_VALUES.get(value.lower())
    if state is None:
        raise click.BadParameter("--state should be one of created, running, exited or unknown")
    return state


@click.command()
@click.option(
    "-a", "--all", "show_all", is_flag=True, help="Show every container, not only running ones."
)
@click.option(
    "-s",
    "--state",
    default=None,
    callback=_container_state,
    metavar="STATE",
    help="Only containers in STATE: created, running, exited or unknown (any case; as crictl, "
    "it replaces the running-only default, with or without -a).",
)
@_with_filters
@click.option("-q", "--quiet", is_flag=True, help="Only print container IDs, one per line.")
@no_trunc_option
@click.option(
    "-o",
    "--output",
    type=click.Choice(["table", "wide", "json", "yaml"]),
    default="table",
    show_default=True,
    help="table: fits 120 columns; wide: every column (STARTED, each probe's result, SOURCE).",
)
@address_option
@timeout_option
def ps(
    show_all: bool,
    state: query_pb2.ContainerState.ValueType | None,
    name: str,
    namespace: str,
    pod: str,
    quiet: bool,
    no_trunc: bool,
    output: str,
    address: str,
    timeout: float,
) -> None:
    """List containers with their probe state (running ones unless -a or --state), newest first.

    PROBES lists each configured probe's published result: L liveness, R readiness, S startup;
    ok, fail, or ? before the first result. S:? on a container that is READY stays so: it was
    running when cri-prober started and counts as started (its startup probe is not run), as
    the kubelet does after its own restart.
    """
    request = query_pb2.ListContainersRequest(
        filter=query_pb2.ContainerFilter(name=name, namespace=namespace, pod=pod), all=show_all
    )
    if state is not None:
        request.state = state
    response = _call_api(
        address, timeout, lambda stub: stub.ListContainers(request, timeout=timeout)
    )
    _print_ps(response, quiet=quiet, output=output, no_trunc=no_trunc)
    # What the daemon said of itself goes after the listing, where a person looks last.
    if response.HasField("not_serving"):
        why = response.not_serving
        if why.view_stale:
            click.echo(
                "cri-prober: the daemon cannot see the runtime's containers (what is listed is "
                "the last state it knew):",
                err=True,
            )
        else:
            click.echo("cri-prober: warning: the daemon is NOT_SERVING:", err=True)
        for reason in why.reasons:
            click.echo(f"  {sanitize(reason, ONE_LINE)}", err=True)
        if why.view_stale:
            sys.exit(EXIT_RUNTIME_ERROR)


def _print_ps(
    response: query_pb2.ListContainersResponse, *, quiet: bool, output: str, no_trunc: bool
) -> None:
    if quiet:
        # crictl ps -q: full IDs, whatever -o and --no-trunc say.
        for c in response.containers:
            click.echo(sanitize(c.id, CELL))
        return
    if output in ("json", "yaml"):
        _emit(_to_dict(response), output)
        return
    now = time.time()
    if output == "wide":
        rows = [ps_wide_row(c, now, no_trunc=no_trunc) for c in response.containers]
        click.echo(table(PS_WIDE_HEADERS, rows))
        return
    rows = [ps_row(c, now, no_trunc=no_trunc) for c in response.containers]
    click.echo(table(PS_HEADERS, rows, gap=2))


# -- inspect --------------------------------------------------------------------------------------


@click.command()
@click.argument("target")
@click.option(
    "-o",
    "--output",
    type=click.Choice(["table", "json", "yaml"]),
    default="table",
    show_default=True,
    help="table: a short summary per probe; json and yaml: everything.",
)
@no_trunc_option
@address_option
@timeout_option
def inspect(target: str, output: str, no_trunc: bool, address: str, timeout: float) -> None:
    """Show one container (ID, ID prefix or namespace/pod/container): its state and, per probe,
    the result, counts, last attempt and history (-o json|yaml: specs and every attempt)."""
    request = query_pb2.GetContainerRequest(target=target)
    response = _call_api(address, timeout, lambda stub: stub.GetContainer(request, timeout=timeout))
    if output == "table":
        lines = container_summary(response.container, time.time(), no_trunc=no_trunc)
        if response.HasField("kubelet"):  # an older daemon does not say
            lines.append(kubelet_line(response.kubelet))
        click.echo("\n".join(lines))
        return
    # The JSON stays the container's as it always was; GetInfo (and the table) say the kubelet.
    container = _to_dict(response.container)
    for status in container["probes"].values():
        # Lift the detail into the probe and show the spec as an object, not as JSON text.
        detail = status.pop("detail", {})
        status["spec"] = json.loads(detail.get("specJson") or "{}")
        status["namedPorts"] = detail.get("namedPorts", {})
        status["history"] = detail.get("history", [])
    _emit(container, output)


# -- watch ----------------------------------------------------------------------------------------


@click.command()
@_with_filters
@click.option("--id", "container_id", metavar="PREFIX", default="", help="Container ID prefix.")
@click.option(
    "--since",
    default=None,
    callback=_resume_point,
    metavar="[INCARNATION:]SEQ",
    help="First replay the buffered transitions after sequence SEQ of INCARNATION (both as "
    "watch -o json prints them); fails if cri-prober restarted since. 0 alone: all still "
    "buffered.",
)
@click.option(
    "-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True
)
@no_trunc_option
@address_option
@timeout_option
def watch(
    name: str,
    namespace: str,
    pod: str,
    container_id: str,
    since: tuple[str | None, int] | None,
    output: str,
    no_trunc: bool,
    address: str,
    timeout: float,
) -> None:
    """Stream probe result transitions as they happen (-o json: one JSON object per line)."""
    request = query_pb2.WatchTransitionsRequest(
        filter=query_pb2.ContainerFilter(id=container_id, name=name, namespace=namespace, pod=pod)
    )
    if since is not None:
        incarnation, sequence = since
        request.since_sequence = sequence
        request.incarnation = incarnation or ""

    async def follow(stub: CriProberAsyncStub) -> None:
        if output == "table":
            click.echo(watch_line([header for header, _ in WATCH_COLUMNS], no_trunc=no_trunc))
        try:
            await stream(stub)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.OUT_OF_RANGE:
                raise
            fail(f"OUT_OF_RANGE: {_in_flag_words(exc.details() or '', since)}", EXIT_RUNTIME_ERROR)

    async def stream(stub: CriProberAsyncStub) -> None:
        async for transition in stub.WatchTransitions(request):
            if output == "json":
                data = _to_dict(transition)
                data["sequence"] = int(
                    data["sequence"]
                )  # protobuf JSON writes 64-bit ints as strings
                click.echo(_json(data))
            else:
                cells = transition_cells(transition, no_trunc=no_trunc)
                click.echo(watch_line(cells, no_trunc=no_trunc))
            sys.stdout.flush()

    _call_api(address, timeout, follow)


def _in_flag_words(details: str, since: tuple[str | None, int] | None) -> str:
    """The server's OUT_OF_RANGE advice, which names the API's ``since_sequence``, in the
    words of ``watch --since``."""
    details = re.sub(
        r"resume without since_sequence, or from 0 with incarnation (\S+) to",
        r"run watch without --since, or with --since \1:0 to",
        details,
    )
    incarnation = (since[0] if since else None) or "INCARNATION"
    details = re.sub(
        r"resume without since_sequence, or from (\d+) to",
        lambda m: f"run watch without --since, or with --since {incarnation}:{m[1]} to",
        details,
    )
    return details.replace("since_sequence", "--since")


# -- health ---------------------------------------------------------------------------------------


@click.command()
@click.argument("service", default="")
@address_option
@click.option(
    "-t",
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    metavar="SECONDS",
    help="Time allowed for connecting and for the call (each, as grpc-health-probe).",
)
@click.option(
    "--answering",
    is_flag=True,
    default=False,
    help="Exit 0 when the daemon answers at all, NOT_SERVING included: a liveness check for "
    "cri-prober's own process, which a restart would not help while the runtime or a "
    "--probes-from source is down.",
)
def health(service: str, address: str, timeout: float, answering: bool) -> None:
    """Check SERVICE over grpc.health.v1 ("" is cri-prober itself; or namespace/pod[/container],
    a container ID or ID prefix).

    Exit status as grpc-health-probe: 0 SERVING, 4 NOT_SERVING, 3 NOT_FOUND or another RPC
    error, 2 cannot connect. With --answering, NOT_SERVING exits 0 too.
    """

    async def run() -> NoReturn:
        try:
            async with _channel(address, timeout) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                call = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
                response = await call
                # Why "" is NOT_SERVING and what serve warned of (older daemons send neither).
                trailing = await call.trailing_metadata() or ()
        except ApiUnreachable as exc:
            fail(str(exc), EXIT_CANNOT_CONNECT)
        except ConfigError as exc:
            fail(str(exc), EXIT_USAGE)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                fail(f"service {service!r} not found: {exc.details()}", EXIT_RPC_FAILED)
            fail(f"health rpc failed: {exc.code().name}: {exc.details()}", EXIT_RPC_FAILED)
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        click.echo(f"status: {name}")
        serving = response.status == health_pb2.HealthCheckResponse.SERVING
        for key, value in trailing:
            if key == WARNING_METADATA_KEY:
                click.echo(f"cri-prober: warning: {sanitize(value, ONE_LINE)}", err=True)
            elif key == REASON_METADATA_KEY:
                click.echo(f"cri-prober: {sanitize(value, ONE_LINE)}", err=True)
        if response.status == health_pb2.HealthCheckResponse.NOT_SERVING and service:
            for line in await _why_not_serving(address, timeout, service):
                click.echo(sanitize(line, ONE_LINE), err=True)
        sys.exit(0 if serving or answering else EXIT_NOT_SERVING)

    run_async(run)


async def _why_not_serving(address: str, timeout: float, service: str) -> list[str]:
    """For stderr: the probes that keep ``service`` (a pod or a container) from SERVING, each
    with its reason, count, hold and last output. Best effort: the verdict was already given."""
    try:
        async with _channel(address, timeout) as channel:
            stub = query_pb2_grpc.CriProberStub(channel)
            parts = service.split("/")
            if len(parts) == 2:  # namespace/pod: every running container of the pod
                namespace, pod = (re.escape(part) for part in parts)
                listing = await stub.ListContainers(
                    query_pb2.ListContainersRequest(
                        filter=query_pb2.ContainerFilter(namespace=f"^{namespace}$", pod=f"^{pod}$")
                    ),
                    timeout=timeout,
                )
                containers = list(listing.containers)
            else:
                reply = await stub.GetContainer(
                    query_pb2.GetContainerRequest(target=service), timeout=timeout
                )
                containers = [reply.container]
    except (ApiUnreachable, ConfigError, grpc.aio.AioRpcError) as exc:
        return [f"(why: cannot ask cri-prober: {exc})"]
    return not_serving_lines(containers)


# -- check ----------------------------------------------------------------------------------------
