"""probe_http's response parsing (httptools/llhttp) against servers that write raw bytes:
malformed, oddly framed and oddly segmented responses, each a verdict or a ProbeError."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import pytest

from cri_prober.probing.handlers.http import probe_http
from cri_prober.probing.outcome import MAX_OUTPUT_BYTES, ProbeError, ProbeOutcome, ProbeResult
from tests.support.local_server import LocalServer

# Handlers drive sockets and timers themselves: run every test on both of serve's loops.
pytestmark = pytest.mark.both_loops

# A pause between two writes, so they arrive in separate segments.
PAUSE = object()
# Stays connected after the last write instead of closing.
HOLD = object()

_Script = Sequence[bytes | object]


@dataclass
class _RawServer(LocalServer):
    """Answers every connection with one script of writes, then closes (or holds) it."""

    scripts: dict[str, _Script] = field(default_factory=dict)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1].decode()
            for step in self.scripts[path]:
                if step is PAUSE:
                    await asyncio.sleep(0.02)
                elif step is HOLD:
                    await asyncio.Event().wait()
                else:
                    assert isinstance(step, bytes)
                    writer.write(step)
                    await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the probe hung up first


@pytest.fixture(name="raw")
async def _raw() -> AsyncIterator[_RawServer]:
    server = _RawServer()
    await server.start()
    yield server
    await server.stop()


async def _probe(raw: _RawServer, *script: bytes | object, timeout: float = 2) -> ProbeOutcome:
    raw.scripts["/t"] = script
    return await probe_http(raw.url("/t"), headers=[], timeout=timeout)


_OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


# -- malformed responses: a failure naming the problem, never an exception ------------------------


@pytest.mark.parametrize(
    ("answer", "detail"),
    [
        pytest.param(
            b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\nok",
            "malformed HTTP response: Invalid header token",
            id="header-line-without-colon",
        ),
        pytest.param(
            b"HTTP/1.1 2x0 OK\r\n\r\n", "malformed HTTP response: Invalid status code", id="status"
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\nok",
            "malformed HTTP response: Invalid character in Content-Length",
            id="content-length",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\rContent-Length: 2\r\n\r\nok",
            "malformed HTTP response: Expected LF after CR",
            id="bare-cr",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nok",
            "unsupported transfer encoding: 'gzip'",
            id="transfer-encoding",
        ),
    ],
)
async def test_malformed_head_is_a_failure(raw: _RawServer, answer: bytes, detail: str) -> None:
    """A head llhttp (or Go's client) refuses fails the probe with a message saying why."""
    outcome = await _probe(raw, answer)
    assert outcome.result is ProbeResult.FAILURE
    assert outcome.output.startswith(f'Get "{raw.url("/t")}": ')
    assert outcome.output.endswith(detail)
    assert outcome.http_status is None


async def test_non_http_answer_is_quoted_and_clipped(raw: _RawServer) -> None:
    """A long answer that is no HTTP at all is quoted up to 200 bytes of its first line."""
    outcome = await _probe(raw, b"\x00\xff garbage" * 1000)
    assert outcome.result is ProbeResult.FAILURE
    assert "malformed HTTP response '\\x00ÿ garbage" in outcome.output
    assert len(outcome.output) < 400


async def test_duplicate_content_length_is_a_failure(raw: _RawServer) -> None:
    """Two Content-Length headers fail, even when equal: llhttp refuses them (Go's client
    would accept equal ones). Servers that send them are broken enough to be told."""
    outcome = await _probe(
        raw, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok"
    )
    assert outcome.result is ProbeResult.FAILURE
    assert outcome.output.endswith("malformed HTTP response: Duplicate Content-Length")


async def test_malformed_chunk_is_a_body_error(raw: _RawServer) -> None:
    """A broken chunked body comes after the head: the attempt errors, as a body read does."""
    with pytest.raises(ProbeError, match="reading body: malformed chunked encoding"):
        await _probe(raw, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nok\r\n")


async def test_reset_after_head_is_a_body_error(raw: _RawServer) -> None:
    """A connection that ends inside a chunked body is an error, not a verdict."""
    with pytest.raises(ProbeError, match="reading body: unexpected EOF"):
        await _probe(raw, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab")


# -- framing as Go's client reads it ------------------------------------------------------------


async def test_chunked_wins_over_content_length(raw: _RawServer) -> None:
    """With both Transfer-Encoding: chunked and Content-Length, the chunks frame the body."""
    outcome = await _probe(
        raw,
        b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nok\r\n0\r\n\r\n",
    )
    assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, "ok")


async def test_folded_header_line_is_accepted(raw: _RawServer) -> None:
    """An obsolete folded header line continues the header before it, as in Go."""
    outcome = await _probe(
        raw, b"HTTP/1.1 200 OK\r\nX-Long: a\r\n  b\r\nContent-Length: 2\r\n\r\nok"
    )
    assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, "ok")


@pytest.mark.parametrize("status", [204, 304])
async def test_no_body_statuses_do_not_wait_for_one(raw: _RawServer, status: int) -> None:
    """204 and 304 have no body whatever their Content-Length: the probe ends at the head."""
    head = f"HTTP/1.1 {status} X\r\nContent-Length: 10\r\n\r\n".encode()
    outcome = await _probe(raw, head, HOLD, timeout=5)
    assert outcome.http_status == status
    assert outcome.result is (ProbeResult.SUCCESS if status == 204 else ProbeResult.WARNING)


async def test_switching_protocols_ends_the_exchange(raw: _RawServer) -> None:
    """A 101 is the final answer (a failure); what follows it is another protocol."""
    outcome = await _probe(raw, b"HTTP/1.1 101 Switching Protocols\r\n\r\n\x00\x01binary", HOLD)
    assert (outcome.result, outcome.http_status) == (ProbeResult.FAILURE, 101)


async def test_five_informational_responses_are_skipped(raw: _RawServer) -> None:
    outcome = await _probe(raw, b"HTTP/1.1 100 Continue\r\n\r\n" * 5, PAUSE, _OK)
    assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, "ok")


async def test_six_informational_responses_are_too_many(raw: _RawServer) -> None:
    outcome = await _probe(raw, b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" * 6, _OK)
    assert outcome.result is ProbeResult.FAILURE
    assert outcome.output.endswith("net/http: too many 1xx informational responses")


async def test_bytes_after_the_response_are_ignored(raw: _RawServer) -> None:
    """Whatever follows a complete response (here garbage) is never parsed as an answer."""
    outcome = await _probe(raw, _OK + b"\x00garbage\r\n\r\n", HOLD)
    assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, "ok")


# -- segmentation ---------------------------------------------------------------------------------


async def test_response_trickled_byte_by_byte(raw: _RawServer) -> None:
    """Every split point of head and chunked body parses to the same result."""
    response = (
        b"HTTP/1.1 200 OK\r\nX-A: 1\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    )
    script: list[bytes | object] = []
    for byte in response:
        script += [bytes([byte]), PAUSE if byte == 0x0A else b""]
    outcome = await _probe(raw, *script, timeout=10)
    assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, "abcde")


async def test_body_after_the_head_in_a_later_segment(raw: _RawServer) -> None:
    outcome = await _probe(raw, b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n", PAUSE, b"late")
    assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, "late")


async def test_body_cap_on_a_body_without_length_held_open(raw: _RawServer) -> None:
    """10 KiB of a body with no length end the probe although the server never closes."""
    block = b"x" * 4096
    outcome = await _probe(raw, b"HTTP/1.1 200 OK\r\n\r\n", block, PAUSE, block, block, HOLD)
    assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, "x" * MAX_OUTPUT_BYTES)


async def test_followed_redirect_does_not_wait_for_its_body(raw: _RawServer) -> None:
    """A same-host redirect is followed as soon as its head is in, its body unread."""
    raw.scripts["/ok"] = [_OK]
    outcome = await _probe(
        raw, b"HTTP/1.1 302 Found\r\nLocation: /ok\r\nContent-Length: 100\r\n\r\n", HOLD
    )
    assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, "ok")


async def test_headers_past_the_cap_fail(raw: _RawServer) -> None:
    """One header value growing past 1 MiB is cut off rather than buffered."""
    junk = b"j" * 65536
    outcome = await _probe(raw, b"HTTP/1.1 200 OK\r\nX-Junk: ", *([junk] * 20), HOLD, timeout=10)
    assert outcome.result is ProbeResult.FAILURE
    assert outcome.output.endswith("net/http: server response headers exceeded the limit")


async def test_connection_reset_before_the_head_fails(raw: _RawServer) -> None:
    """A reset (RST) before any answer is a failure worded like Go's read error."""

    async def reset_handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        writer.transport.abort()

    server = await asyncio.start_server(reset_handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        outcome = await probe_http(f"http://127.0.0.1:{port}/", headers=[], timeout=2)
    finally:
        server.close()
        await server.wait_closed()
    assert outcome.result is ProbeResult.FAILURE
    assert "read tcp: " in outcome.output or outcome.output.endswith(": EOF")
