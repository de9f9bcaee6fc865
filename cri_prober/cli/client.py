"""The API client commands: ``ps``, ``inspect``, ``watch`` and ``health`` ask a running ``serve``
over its local API and print what it says, in crictl's style.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypeVar

import click
import grpc
import yaml
from google.protobuf import json_format, timestamp_pb2
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cri_prober._gen.criprober.v1 import query_pb2, query_pb2_grpc
from cri_prober.cli.common import EXIT_RUNTIME_ERROR, EXIT_USAGE, fail, run_async
from cri_prober.errors import ConfigError, CriProberError
from cri_prober.serving.address import parse_listen

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
ID_WIDTH = 13  # crictl's truncated IDs
# Fixed column widths for `watch -o table`: a stream cannot size columns to its rows.
WATCH_COLUMNS = (
    ("TIME", 12),
    ("SEQ", 6),
    ("CONTAINER", 13),
    ("POD", 24),
    ("NAMESPACE", 16),
    ("NAME", 16),
    ("PROBE", 9),
    ("RESULT", 0),
)
KIND_NAMES: tuple[Literal["liveness", "readiness", "startup"], ...] = (
    "liveness",
    "readiness",
    "startup",
)

address_option = click.option(
    "--address",
    metavar="URI",
    default=DEFAULT_ADDRESS,
    show_default=True,
    help="cri-prober's API (what serve --listen was given): unix:///PATH or tcp://HOST:PORT.",
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


@contextlib.asynccontextmanager
async def _channel(address: str, timeout: float) -> AsyncIterator[grpc.aio.Channel]:
    """A channel to the daemon, ready to use; raises ``ApiUnreachable`` or ``ConfigError``."""
    listen = parse_listen(address, flag="--address")
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


def _emit(data: Any, output: str) -> None:
    if output == "yaml":
        click.echo(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), nl=False)
    else:
        click.echo(json.dumps(data, indent=2, ensure_ascii=False))


def human_duration(seconds: float) -> str:
    """Go's units.HumanDuration, which crictl uses for ages ("2 minutes", "About an hour")."""
    whole = int(seconds)
    minutes = int(seconds / 60)
    hours = round(seconds / 3600)
    if whole < 1:
        text = "Less than a second"
    elif whole == 1:
        text = "1 second"
    elif whole < 60:
        text = f"{whole} seconds"
    elif minutes == 1:
        text = "About a minute"
    elif minutes < 60:
        text = f"{minutes} minutes"
    elif hours == 1:
        text = "About an hour"
    elif hours < 48:
        text = f"{hours} hours"
    elif hours < 24 * 7 * 2:
        text = f"{hours // 24} days"
    elif hours < 24 * 30 * 2:
        text = f"{hours // 24 // 7} weeks"
    elif hours < 24 * 365 * 2:
        text = f"{hours // 24 // 30} months"
    else:
        text = f"{int(seconds / 3600) // 24 // 365} years"
    return text


def _age(timestamp: timestamp_pb2.Timestamp, now: float) -> str:
    seconds = timestamp.seconds + timestamp.nanos / 1e9
    return human_duration(now - seconds) + " ago"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [
        max([len(header), *(len(row[i]) for row in rows)]) for i, header in enumerate(headers)
    ]
    lines = [headers, *rows]
    return "\n".join(
        "   ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def _state_name(state: query_pb2.ContainerState.ValueType) -> str:
    # CONTAINER_RUNNING -> Running, as crictl shows it.
    return query_pb2.ContainerState.Name(state).removeprefix("CONTAINER_").capitalize()


def _yes_no(value: bool) -> str:
    return "true" if value else "false"


# -- ps -------------------------------------------------------------------------------------------


@click.command()
@click.option(
    "-a", "--all", "show_all", is_flag=True, help="Show every container, not only running ones."
)
@_with_filters
@click.option(
    "-o",
    "--output",
    type=click.Choice(["table", "json", "yaml"]),
    default="table",
    show_default=True,
)
@address_option
@timeout_option
def ps(
    show_all: bool, name: str, namespace: str, pod: str, output: str, address: str, timeout: float
) -> None:
    """List containers with their probe state (running ones unless -a), newest first."""
    request = query_pb2.ListContainersRequest(
        filter=query_pb2.ContainerFilter(name=name, namespace=namespace, pod=pod), all=show_all
    )
    response = _call_api(
        address, timeout, lambda stub: stub.ListContainers(request, timeout=timeout)
    )
    if output != "table":
        _emit(_to_dict(response), output)
        return
    now = time.time()
    headers = (
        "CONTAINER",
        "POD",
        "NAMESPACE",
        "NAME",
        "ATTEMPT",
        "STATE",
        "STARTED",
        "READY",
        "HEALTHY",
        "LIVENESS",
        "READINESS",
        "STARTUP",
        "CREATED",
        "SOURCE",
    )
    rows = []
    for c in response.containers:
        probes = [
            getattr(c.probes, kind).result if c.probes.HasField(kind) else "-"
            for kind in KIND_NAMES
        ]
        # Who wrote the probes, in liveness/readiness/startup order, each named once.
        origins = dict.fromkeys(
            getattr(c.probes, kind).origin for kind in KIND_NAMES if c.probes.HasField(kind)
        )
        rows.append(
            (
                c.id[:ID_WIDTH],
                c.pod_name,
                c.pod_namespace,
                c.name,
                str(c.attempt),
                _state_name(c.state),
                _yes_no(c.started),
                _yes_no(c.ready),
                _yes_no(c.healthy),
                *probes,
                _age(c.created_at, now),
                ",".join(origin for origin in origins if origin) or "-",
            )
        )
    click.echo(_table(headers, rows))


# -- inspect --------------------------------------------------------------------------------------


@click.command()
@click.argument("target")
@click.option(
    "-o", "--output", type=click.Choice(["json", "yaml"]), default="json", show_default=True
)
@address_option
@timeout_option
def inspect(target: str, output: str, address: str, timeout: float) -> None:
    """Show one container (ID, ID prefix or namespace/pod/container): specs, state, history."""
    request = query_pb2.GetContainerRequest(target=target)
    response = _call_api(address, timeout, lambda stub: stub.GetContainer(request, timeout=timeout))
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
@address_option
@timeout_option
def watch(
    name: str,
    namespace: str,
    pod: str,
    container_id: str,
    since: tuple[str | None, int] | None,
    output: str,
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
            click.echo(_watch_row([header for header, _ in WATCH_COLUMNS]))
        async for transition in stub.WatchTransitions(request):
            if output == "json":
                data = _to_dict(transition)
                data["sequence"] = int(
                    data["sequence"]
                )  # protobuf JSON writes 64-bit ints as strings
                click.echo(json.dumps(data, ensure_ascii=False))
            else:
                click.echo(_watch_row(_transition_cells(transition)))
            sys.stdout.flush()

    _call_api(address, timeout, follow)


def _watch_row(cells: Sequence[str]) -> str:
    return "  ".join(
        cell.ljust(width) for cell, (_, width) in zip(cells, WATCH_COLUMNS, strict=True)
    ).rstrip()


def _transition_cells(transition: query_pb2.Transition) -> list[str]:
    moment = datetime.datetime.fromtimestamp(transition.time.seconds + transition.time.nanos / 1e9)
    change = f"{transition.previous or '(none)'} -> {transition.result}"
    return [
        moment.strftime("%H:%M:%S.%f")[:12],
        str(transition.sequence),
        transition.container_id[:ID_WIDTH],
        transition.pod_name,
        transition.pod_namespace,
        transition.container_name,
        transition.kind,
        change,
    ]


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
                response = await stub.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=timeout
                )
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
        sys.exit(0 if serving or answering else EXIT_NOT_SERVING)

    run_async(run)


# -- check ----------------------------------------------------------------------------------------
