"""Issue 24: every attempt says why, as one word from a documented set (``outcome.Reason``),
whichever handler ran it; and a failed attempt records the node's pressure (PSI)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf import json_format

from cri_prober.cli.tables import attempt_lines
from cri_prober.errors import CriError
from cri_prober.probing.handlers.exec import probe_exec
from cri_prober.probing.handlers.http import probe_http
from cri_prober.probing.handlers.tcp import probe_tcp
from cri_prober.probing.outcome import (
    ProbeError,
    ProbeOutcome,
    ProbeResult,
    Reason,
    reason_of,
)
from cri_prober.probing.pressure import Pressure
from cri_prober.probing.results import History, ProbeRecord
from cri_prober.serving.convert import attempt_pb


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def _serving(answer: Answer) -> AsyncIterator[int]:
    """A local TCP server running ``answer`` for each connection; yields its port."""
    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1]


@pytest.fixture(name="eager_port")
async def _eager_port() -> AsyncIterator[int]:
    """A plain-text server that speaks first: a TLS client's handshake gets HTTP back."""

    async def answer(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    async with _serving(answer) as port:
        yield port


@pytest.fixture(name="http_port")
async def _http_port() -> AsyncIterator[int]:
    """A server answering every request with 503."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    async with _serving(answer) as port:
        yield port


async def test_http_reasons(http_port: int, eager_port: int) -> None:
    refused = await probe_http(f"http://127.0.0.1:{_closed_port()}/", headers=[], timeout=1)
    assert (refused.result, refused.reason) == (ProbeResult.FAILURE, Reason.CONNECTION_REFUSED)
    status = await probe_http(f"http://127.0.0.1:{http_port}/", headers=[], timeout=1)
    assert reason_of(status) == Reason.HTTP_STATUS
    # An https probe of a plain HTTP server fails its handshake.
    tls = await probe_http(f"https://127.0.0.1:{eager_port}/", headers=[], timeout=1)
    assert (tls.result, tls.reason) == (ProbeResult.FAILURE, Reason.TLS)
    bad = await probe_http("ftp://127.0.0.1/", headers=[], timeout=1)
    assert bad.reason == Reason.INVALID_TARGET


async def test_tcp_reasons() -> None:
    refused = await probe_tcp("127.0.0.1", _closed_port(), timeout=1)
    assert refused.reason == Reason.CONNECTION_REFUSED
    assert (await probe_tcp("127.0.0.1", 70000, timeout=1)).reason == Reason.INVALID_TARGET


@dataclass(frozen=True)
class _Reply:
    exit_code: int | None
    stdout: bytes = b""
    stderr: bytes = b""
    timed_out: bool = False
    elapsed: float = 0.01
    drained_after_timeout: bool = False


class _Runner:
    def __init__(self, reply: _Reply | None) -> None:
        self.reply = reply

    async def exec_sync(self, container_id: str, cmd: Sequence[str], *, timeout: int) -> _Reply:
        if self.reply is None:
            raise CriError("ExecSync", grpc.StatusCode.UNAVAILABLE, "runtime down")
        return self.reply


async def test_exec_reasons() -> None:
    failed = await probe_exec(_Runner(_Reply(exit_code=3)), "c1", ["check"], timeout=1)
    assert reason_of(failed) == Reason.EXIT_CODE
    passed = await probe_exec(_Runner(_Reply(exit_code=0)), "c1", ["check"], timeout=1)
    assert reason_of(passed) == Reason.OK
    late = await probe_exec(_Runner(_Reply(None, timed_out=True)), "c1", ["check"], timeout=1)
    assert reason_of(late) == Reason.TIMEOUT
    with pytest.raises(ProbeError) as raised:
        await probe_exec(_Runner(None), "c1", ["check"], timeout=1)
    assert raised.value.reason == Reason.RUNTIME_ERROR


def test_records_carry_the_reason_and_history_keeps_it() -> None:
    import gc

    record = ProbeRecord.of(
        "c1",
        1.0,
        0.1,
        ProbeOutcome(ProbeResult.FAILURE, "refused", reason=Reason.CONNECTION_REFUSED),
        pressure=Pressure(cpu=80.5, memory=0.0, io=1.25),
    ).counted(2, 3, changed=False, held=False)
    history = History(4)
    history.append(record)
    assert history[0] == record
    assert (history[0].reason, history[0].run, history[0].threshold) == ("connection-refused", 2, 3)
    assert str(history[0].pressure) == "cpu 80.5%, memory 0%, io 1.25%"
    gc.collect()
    assert not any(gc.is_tracked(o) for o in history._palette)
    assert ProbeRecord.errored("c1", 1.0, 0.1, "no port").reason == Reason.NOT_RUN


def test_an_attempt_says_how_late_it_came_from_the_history_to_inspect() -> None:
    """``late`` and ``dropped`` survive the history's columns (also once it wraps), reach the
    API as ``late`` and ``ticksDropped``, and inspect says them when they are worth a look."""
    on_time = ProbeRecord.of("c1", 1.0, 0.1, ProbeOutcome(ProbeResult.SUCCESS, "ok")).counted(
        1, 1, changed=False, held=False, late=0.002
    )
    behind = dataclasses.replace(on_time, started_at=2.0, late=1.25, dropped=3)
    history = History(2)
    history.extend([on_time, behind, on_time])
    assert [(r.late, r.dropped) for r in history] == [(1.25, 3), (0.002, 0)]

    def came(record: ProbeRecord) -> list[str]:
        lines = attempt_lines(attempt_pb(record), now=10.0)
        return [line for line in lines if line.startswith("  Came: ")]

    assert json_format.MessageToDict(attempt_pb(behind))["late"] == "1.250s"
    assert json_format.MessageToDict(attempt_pb(behind))["ticksDropped"] == 3
    assert came(behind) == [
        "  Came: 1.2s after its tick, 3 ticks dropped before it (the attempt before ran past them)"
    ]
    assert came(on_time) == []  # 2 ms late: nothing worth saying
    assert "ticksDropped" not in json_format.MessageToDict(attempt_pb(on_time))
