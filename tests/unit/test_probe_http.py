"""probe_http against a real HTTP/1.1 server started in-process on an ephemeral port."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

import pytest

from cri_prober.probing.handlers.http import (
    KUBELET_VERSION,
    MAX_REQUESTS,
    TLSOptions,
    build_url,
    probe_http,
)
from cri_prober.probing.outcome import MAX_OUTPUT_BYTES, ProbeError, ProbeResult
from tests.support.local_server import LocalServer
from tests.support.timers import record_probe_deadlines
from tests.unit.fd_exhaustion import out_of_descriptors

# Handlers drive sockets and timers themselves: run every test on both of serve's loops.
pytestmark = pytest.mark.both_loops


@dataclass
class _Request:
    target: str
    headers: list[tuple[str, str]]


def _response(status: int, body: bytes = b"", headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    lines = [f"HTTP/1.1 {status} Whatever", f"Content-Length: {len(body)}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@dataclass
class _HttpServer(LocalServer):
    """A small HTTP/1.1 responder; every handler answers one request and closes."""

    tls: ssl.SSLContext | None = None
    requests: list[_Request] = field(default_factory=list)
    # Handlers wait on this to stall; nothing sets it, teardown cancels them.
    never: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def origin(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return self.origin + path

    def targets(self) -> list[str]:
        return [request.target for request in self.requests]

    async def start(self, host: str = "127.0.0.1", *, tls: ssl.SSLContext | None = None) -> None:
        await super().start(host, tls=tls or self.tls)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            request_line, *header_lines = head.split("\r\n")[:-2]
            pairs = (line.partition(": ") for line in header_lines)
            headers = [(name, value) for name, _, value in pairs]
            request = _Request(request_line.split(" ")[1], headers)
            self.requests.append(request)
            route = _ROUTES.get(request.target.split("?")[0], _not_found)
            await route(self, request, writer)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass  # the probe went away first, as it does after 10 KiB of an endless body


_Route = Callable[[_HttpServer, _Request, asyncio.StreamWriter], Awaitable[None]]


async def _ok(_server: _HttpServer, _request: _Request, writer: asyncio.StreamWriter) -> None:
    writer.write(_response(200, b"ok"))


async def _not_found(_s: _HttpServer, _r: _Request, writer: asyncio.StreamWriter) -> None:
    writer.write(_response(404, b"secret-body"))


async def _error(_s: _HttpServer, _r: _Request, writer: asyncio.StreamWriter) -> None:
    writer.write(_response(500, b"secret-body"))


async def _no_content(_s: _HttpServer, _r: _Request, writer: asyncio.StreamWriter) -> None:
    writer.write(_response(204))


async def _echo(_s: _HttpServer, request: _Request, writer: asyncio.StreamWriter) -> None:
    writer.write(_response(200, json.dumps(request.headers).encode()))


def _redirect(location: str, body: bytes = b"") -> _Route:
    async def route(server: _HttpServer, _r: _Request, writer: asyncio.StreamWriter) -> None:
        resolved = location.format(port=server.port)
        writer.write(_response(302, body, (("Location", resolved),)))

    return route


async def _chain(_s: _HttpServer, request: _Request, writer: asyncio.StreamWriter) -> None:
    left = int(request.target.split("=")[1])
    if left:
        writer.write(_response(302, headers=(("Location", f"/chain?left={left - 1}"),)))
    else:
        writer.write(_response(200, b"end of chain"))


async def _redirect_port(_s: _HttpServer, request: _Request, writer: asyncio.StreamWriter) -> None:
    port = request.target.split("=")[1]
    writer.write(_response(302, headers=(("Location", f"http://127.0.0.1:{port}/ok"),)))


async def _no_location(_s: _HttpServer, _r: _Request, writer: asyncio.StreamWriter) -> None:
    writer.write(_response(302, b"nowhere to go"))


async def _slow(server: _HttpServer, _r: _Request, _w: asyncio.StreamWriter) -> None:
    await server.never.wait()


async def _slow_body(server: _HttpServer, _r: _Request, writer: asyncio.StreamWriter) -> None:
    writer.write(_response(200, b"x" * 100)[:-90])
    await writer.drain()
    await server.never.wait()


async def _short_body(_s: _HttpServer, _r: _Request, writer: asyncio.StreamWriter) -> None:
    writer.write(_response(200, b"x" * 100)[:-90])


async def _huge(_s: _HttpServer, _r: _Request, writer: asyncio.StreamWriter) -> None:
    writer.write(_response(200, b"y" * (1 << 20)))


async def _endless(_s: _HttpServer, _r: _Request, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (4096, b"z" * 4096)
    while True:  # until the probe hangs up
        writer.write(chunk)
        await writer.drain()


async def _chunked(_s: _HttpServer, _r: _Request, writer: asyncio.StreamWriter) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"7;ext=1\r\nhello, \r\n5\r\nworld\r\n0\r\nTrailer: x\r\n\r\n"
    )


async def _until_eof(_s: _HttpServer, _r: _Request, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.0 200 OK\r\n\r\nbody until close")


async def _informational(_s: _HttpServer, _r: _Request, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + _response(200, b"after 100"))


async def _bare_lf(_s: _HttpServer, _r: _Request, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\nContent-Length: 2\n\nlf")


async def _garbage(_s: _HttpServer, _r: _Request, writer: asyncio.StreamWriter) -> None:
    writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")


async def _hang_up(_s: _HttpServer, _r: _Request, _w: asyncio.StreamWriter) -> None:
    return  # closes without a response


# Handlers of the kubelet's pkg/probe/http/http_test.go. Go's server lists the request headers
# without Host (that is r.Host), so the header echoes below leave it out too.


def _query(request: _Request) -> dict[str, str]:
    return {key: values[0] for key, values in parse_qs(urlsplit(request.target).query).items()}


def _go_headers(request: _Request) -> list[tuple[str, str]]:
    return [(name, value) for name, value in request.headers if name != "Host"]


def _request_host(request: _Request) -> str:
    return next(value for name, value in request.headers if name == "Host")


def _status_body(status: int, body: bytes) -> _Route:
    async def route(_s: _HttpServer, _r: _Request, writer: asyncio.StreamWriter) -> None:
        writer.write(_response(status, body))

    return route


async def _go_header_echo(_s: _HttpServer, request: _Request, writer: asyncio.StreamWriter) -> None:
    lines = "".join(f"{name}: {value}\n" for name, value in _go_headers(request))
    writer.write(_response(200, lines.encode()))


async def _go_header_count(_s: _HttpServer, request: _Request, w: asyncio.StreamWriter) -> None:
    w.write(_response(200, str(len({name for name, _ in _go_headers(request)})).encode()))


async def _go_header_keys(_s: _HttpServer, request: _Request, w: asyncio.StreamWriter) -> None:
    keys = sorted({name for name, _ in _go_headers(request)})
    w.write(_response(200, "\n".join(keys).encode()))


async def _host_echo(_s: _HttpServer, request: _Request, writer: asyncio.StreamWriter) -> None:
    writer.write(_response(200, _request_host(request).encode()))


async def _go_redirect(_s: _HttpServer, request: _Request, writer: asyncio.StreamWriter) -> None:
    # redirectHandler(s, bad): "/" answers s with a relative Location, "/new" 500 if bad else 200.
    query = _query(request)
    location = f"/k8s/new?bad={query['bad']}"
    writer.write(_response(int(query["status"]), headers=(("Location", location),)))


async def _go_redirect_new(
    _s: _HttpServer, request: _Request, writer: asyncio.StreamWriter
) -> None:
    writer.write(_response(500 if _query(request)["bad"] == "1" else 200))


async def _go_redirect_body(_s: _HttpServer, request: _Request, w: asyncio.StreamWriter) -> None:
    # redirectHandlerWithBody(s, body): "/" redirects with 308, "/new" answers s and the body
    # without a Location, so the redirect can't be followed further.
    query = _query(request)
    location = f"/k8s/new-body?status={query['status']}&body={quote(query.get('body', ''))}"
    w.write(_response(308, headers=(("Location", location),)))


async def _go_redirect_body_new(
    _s: _HttpServer, request: _Request, w: asyncio.StreamWriter
) -> None:
    query = _query(request)
    w.write(_response(int(query["status"]), query.get("body", "").encode()))


async def _go_redirect_to(_s: _HttpServer, request: _Request, w: asyncio.StreamWriter) -> None:
    # TestHTTPProbeChecker_NonLocalRedirects' "/redirect?loc=...".
    w.write(_response(302, headers=(("Location", _query(request)["loc"]),)))


async def _go_host_redirect(_s: _HttpServer, _r: _Request, w: asyncio.StreamWriter) -> None:
    w.write(_response(302, headers=(("Location", "/k8s/host-success"),)))


async def _go_host_success(_s: _HttpServer, request: _Request, w: asyncio.StreamWriter) -> None:
    w.write(_response(200 if _request_host(request) == "www.success.com" else 400))


async def _go_payload(_s: _HttpServer, request: _Request, w: asyncio.StreamWriter) -> None:
    if _request_host(request) != "www.success.com":
        w.write(_response(400))
    else:
        w.write(_response(200, b"a" * int(_query(request)["size"])))


async def _relay(server: _HttpServer, request: _Request, writer: asyncio.StreamWriter) -> None:
    # Redirects to the Location template in ?to=, filled with {port}, for Host-override chains.
    location = _query(request)["to"].format(port=server.port)
    writer.write(_response(302, headers=(("Location", location),)))


_ROUTES: dict[str, _Route] = {
    "/k8s/ok-body": _status_body(200, b"ok body"),
    "/k8s/fail-body": _status_body(500, b"fail body"),
    "/k8s/success": _status_body(200, b""),
    "/k8s/fail": _status_body(500, b""),
    "/k8s/loop": _redirect("/k8s/loop"),
    "/k8s/header-echo": _go_header_echo,
    "/k8s/header-count": _go_header_count,
    "/k8s/header-keys": _go_header_keys,
    "/k8s/host-echo": _host_echo,
    "/k8s/redirect": _go_redirect,
    "/k8s/new": _go_redirect_new,
    "/k8s/redirect-body": _go_redirect_body,
    "/k8s/new-body": _go_redirect_body_new,
    "/k8s/redirect-to": _go_redirect_to,
    "/k8s/host-redirect": _go_host_redirect,
    "/k8s/host-success": _go_host_success,
    "/k8s/payload": _go_payload,
    "/relay": _relay,
    "/ok": _ok,
    "/notfound": _not_found,
    "/error": _error,
    "/nocontent": _no_content,
    "/echo": _echo,
    "/redirect-same": _redirect("/ok"),
    "/redirect-cross-host": _redirect("http://127.0.0.2:{port}/ok", b"moved elsewhere"),
    "/redirect-echo-relative": _redirect("/echo"),
    "/redirect-echo-absolute": _redirect("http://127.0.0.1:{port}/echo"),
    "/redirect-port": _redirect_port,
    "/redirect-slow": _redirect("/slow"),
    "/loop": _redirect("/loop"),
    "/chain": _chain,
    "/no-location": _no_location,
    "/slow": _slow,
    "/slow-body": _slow_body,
    "/short-body": _short_body,
    "/huge": _huge,
    "/endless": _endless,
    "/chunked": _chunked,
    "/until-eof": _until_eof,
    "/informational": _informational,
    "/bare-lf": _bare_lf,
    "/garbage": _garbage,
    "/hang-up": _hang_up,
}


@pytest.fixture(name="server")
async def _server() -> AsyncIterator[_HttpServer]:
    server = _HttpServer()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture(name="other_server")
async def _other_server() -> AsyncIterator[_HttpServer]:
    server = _HttpServer()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture(name="certificate")
def _certificate(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"),
            *("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
            *("-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.fixture(name="tls_server")
async def _tls_server(certificate: tuple[Path, Path]) -> AsyncIterator[_HttpServer]:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*certificate)
    server = _HttpServer(tls=context)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture(name="closed_port")
def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def _echoed(server: _HttpServer, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    outcome = await probe_http(server.url("/echo"), headers=headers, timeout=2)
    assert outcome.result == ProbeResult.SUCCESS
    return [(name, value) for name, value in json.loads(outcome.output)]


# --- verdicts ---------------------------------------------------------------------------------


async def test_200_is_success_with_body(server: _HttpServer) -> None:
    """A 200 is a success whose output is the body."""
    outcome = await probe_http(server.url("/ok"), headers=[], timeout=2)
    assert (outcome.result, outcome.output, outcome.http_status) == (ProbeResult.SUCCESS, "ok", 200)


async def test_204_is_success_without_body(server: _HttpServer) -> None:
    """A 204 has no body to wait for."""
    outcome = await probe_http(server.url("/nocontent"), headers=[], timeout=2)
    assert (outcome.result, outcome.output, outcome.http_status) == (ProbeResult.SUCCESS, "", 204)


@pytest.mark.parametrize(("path", "status"), [("/notfound", 404), ("/error", 500)])
async def test_error_status_fails_without_body(server: _HttpServer, path: str, status: int) -> None:
    """4xx and 5xx fail with only the status code: the body may hold secrets."""
    outcome = await probe_http(server.url(path), headers=[], timeout=2)
    assert outcome.result == ProbeResult.FAILURE
    assert outcome.output == f"HTTP probe failed with statuscode: {status}"
    assert outcome.http_status == status


async def test_chunked_body_is_decoded(server: _HttpServer) -> None:
    """A chunked body is reassembled, chunk extensions and trailers ignored."""
    outcome = await probe_http(server.url("/chunked"), headers=[], timeout=2)
    assert outcome.output == "hello, world"


async def test_body_without_length_is_read_to_eof(server: _HttpServer) -> None:
    """An HTTP/1.0 body without Content-Length ends when the server closes."""
    outcome = await probe_http(server.url("/until-eof"), headers=[], timeout=2)
    assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, "body until close")


async def test_informational_response_is_skipped(server: _HttpServer) -> None:
    """A 100 Continue before the real response does not count as the answer."""
    outcome = await probe_http(server.url("/informational"), headers=[], timeout=2)
    assert (
        outcome.result,
        outcome.output,
        outcome.http_status,
    ) == (ProbeResult.SUCCESS, "after 100", 200)


async def test_bare_lf_line_endings_are_accepted(server: _HttpServer) -> None:
    """Responses with LF-only line endings parse, as Go's client accepts them."""
    outcome = await probe_http(server.url("/bare-lf"), headers=[], timeout=2)
    assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, "lf")


async def test_non_http_answer_fails(server: _HttpServer) -> None:
    """A server that does not speak HTTP is a failure naming the malformed response."""
    outcome = await probe_http(server.url("/garbage"), headers=[], timeout=2)
    assert outcome.result == ProbeResult.FAILURE
    assert "malformed HTTP response 'SSH-2.0-OpenSSH_9.6'" in outcome.output


async def test_hang_up_before_response_fails_with_eof(server: _HttpServer) -> None:
    """A server that closes without answering is a failure, not an error."""
    outcome = await probe_http(server.url("/hang-up"), headers=[], timeout=2)
    assert outcome.result == ProbeResult.FAILURE
    assert outcome.output == f'Get "{server.url("/hang-up")}": EOF'


# --- body cap ---------------------------------------------------------------------------------


async def test_huge_body_is_truncated_to_cap(server: _HttpServer) -> None:
    """Only the first 10 KiB of a 1 MiB body are kept."""
    outcome = await probe_http(server.url("/huge"), headers=[], timeout=2)
    assert outcome.result == ProbeResult.SUCCESS
    assert outcome.output == "y" * MAX_OUTPUT_BYTES


async def test_endless_body_stops_at_cap(server: _HttpServer) -> None:
    """An endless chunked body is cut at 10 KiB and the probe ends well before its timeout:
    with a timeout of an hour, only the cap can have ended it."""
    outcome = await probe_http(server.url("/endless"), headers=[], timeout=3600)
    assert outcome.result == ProbeResult.SUCCESS
    assert outcome.output == "z" * MAX_OUTPUT_BYTES


# --- timeouts and transport errors ------------------------------------------------------------


async def test_slow_headers_time_out_as_failure(
    server: _HttpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No response head within the timeout is a failure when the probe's deadline, armed for
    the timeout, passes (the server never answers: only that deadline ends the probe)."""
    armed = record_probe_deadlines(monkeypatch)
    outcome = await probe_http(server.url("/slow"), headers=[], timeout=0.3)
    assert [deadline.is_for(0.3) for deadline in armed] == [True]
    assert outcome.result == ProbeResult.FAILURE
    assert outcome.output.endswith("(Client.Timeout exceeded while awaiting headers)")
    assert outcome.timed_out
    assert outcome.http_status is None


async def test_slow_body_is_an_error_not_a_verdict(
    server: _HttpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body that stalls after the headers raises ProbeError, which the kubelet discards, once
    the probe's one deadline (the head's, armed for the timeout) passes."""
    armed = record_probe_deadlines(monkeypatch)
    with pytest.raises(ProbeError, match="while reading body"):
        await probe_http(server.url("/slow-body"), headers=[], timeout=0.3)
    assert [deadline.is_for(0.3) for deadline in armed] == [True, True]  # the head, the body
    assert armed[0].at == armed[1].at


async def test_body_cut_short_is_an_error(server: _HttpServer) -> None:
    """A body shorter than its Content-Length raises ProbeError."""
    with pytest.raises(ProbeError, match="unexpected EOF"):
        await probe_http(server.url("/short-body"), headers=[], timeout=2)


async def test_connection_refused_fails(closed_port: int) -> None:
    """A refused connection is a failure worded like Go's client error."""
    url = f"http://127.0.0.1:{closed_port}/healthz"
    outcome = await probe_http(url, headers=[], timeout=2)
    assert outcome.result == ProbeResult.FAILURE
    expected = f'Get "{url}": dial tcp 127.0.0.1:{closed_port}: connect: connection refused'
    assert outcome.output == expected


async def test_unsupported_scheme_fails() -> None:
    """A scheme other than http or https is a failure, as in Go's client."""
    outcome = await probe_http("ftp://127.0.0.1:21/", headers=[], timeout=1)
    assert outcome.result == ProbeResult.FAILURE
    assert "unsupported protocol scheme 'ftp'" in outcome.output


async def test_environment_proxy_is_ignored(
    server: _HttpServer, monkeypatch: pytest.MonkeyPatch, closed_port: int
) -> None:
    """HTTP_PROXY in the environment is not used: the probe goes straight to the target."""
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{closed_port}")
    outcome = await probe_http(server.url("/ok"), headers=[], timeout=2)
    assert outcome.result == ProbeResult.SUCCESS
    assert server.targets() == ["/ok"]


# --- headers ----------------------------------------------------------------------------------


async def test_default_headers(server: _HttpServer) -> None:
    """Without overrides the probe sends the kubelet's headers and nothing more."""
    headers = dict(await _echoed(server, []))
    assert headers.pop("Host") == f"127.0.0.1:{server.port}"
    assert headers.pop("User-Agent").startswith("kube-probe/1.")
    assert headers == {"Accept": "*/*", "Connection": "close"}


async def test_caller_headers_are_canonicalised_and_repeated(server: _HttpServer) -> None:
    """Header names are canonicalised as Go does and repeated names are all sent."""
    headers = await _echoed(server, [("x-custom-id", "1"), ("X-CUSTOM-ID", "2"), ("x-a", " v ")])
    assert [header for header in headers if header[0].startswith("X-")] == [
        ("X-Custom-Id", "1"),
        ("X-Custom-Id", "2"),
        ("X-A", "v"),
    ]


async def test_user_agent_and_accept_can_be_overridden(server: _HttpServer) -> None:
    """A caller's User-Agent and Accept replace the defaults."""
    headers = await _echoed(server, [("user-agent", "mine/1"), ("accept", "application/json")])
    assert [
        tuple(value for name, value in headers if name == wanted)
        for wanted in ("User-Agent", "Accept")
    ] == [("mine/1",), ("application/json",)]


async def test_empty_accept_removes_the_header(server: _HttpServer) -> None:
    """An explicitly empty Accept means no Accept header at all."""
    headers = await _echoed(server, [("Accept", "")])
    assert "Accept" not in dict(headers)


async def test_empty_user_agent_removes_the_header(server: _HttpServer) -> None:
    """An explicitly empty User-Agent means no User-Agent header, as with Go's client."""
    headers = await _echoed(server, [("User-Agent", "")])
    assert "User-Agent" not in dict(headers)


async def test_host_header_sets_request_host(server: _HttpServer) -> None:
    """A caller's Host header becomes the request's Host (virtual hosts)."""
    headers = await _echoed(server, [("Host", "app.example.com")])
    assert [header for header in headers if header[0] == "Host"] == [("Host", "app.example.com")]


async def test_header_injection_is_refused(server: _HttpServer) -> None:
    """A header value with a line break fails the probe before anything is sent."""
    outcome = await probe_http(
        server.url("/ok"), headers=[("X-Bad", "a\r\nInjected: yes")], timeout=2
    )
    assert outcome.result == ProbeResult.FAILURE
    assert "invalid header field value for 'X-Bad'" in outcome.output
    assert server.requests == []


# --- redirects --------------------------------------------------------------------------------


async def test_same_host_redirect_is_followed(server: _HttpServer) -> None:
    """A redirect to the same host is followed to its final answer."""
    outcome = await probe_http(server.url("/redirect-same"), headers=[], timeout=2)
    assert (outcome.result, outcome.output, outcome.http_status) == (ProbeResult.SUCCESS, "ok", 200)
    assert server.targets() == ["/redirect-same", "/ok"]


async def test_redirect_to_other_port_on_same_host_is_followed(
    server: _HttpServer, other_server: _HttpServer
) -> None:
    """Only the hostname is compared: another port on the same host is followed."""
    url = server.url(f"/redirect-port?port={other_server.port}")
    outcome = await probe_http(url, headers=[], timeout=2)
    assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, "ok")
    assert other_server.targets() == ["/ok"]


async def test_cross_host_redirect_is_a_warning(server: _HttpServer) -> None:
    """A redirect to another hostname is not followed and is a warning carrying the body."""
    outcome = await probe_http(server.url("/redirect-cross-host"), headers=[], timeout=2)
    assert outcome.result == ProbeResult.WARNING
    assert outcome.output == "Probe terminated redirects, Response body: moved elsewhere"
    assert outcome.http_status == 302
    assert server.targets() == ["/redirect-cross-host"]


async def test_redirect_without_location_is_a_warning(server: _HttpServer) -> None:
    """A 3xx without Location is the final answer: a warning."""
    outcome = await probe_http(server.url("/no-location"), headers=[], timeout=2)
    assert outcome.result == ProbeResult.WARNING
    assert outcome.output.endswith("Response body: nowhere to go")


async def test_redirect_loop_stops_after_ten_requests(server: _HttpServer) -> None:
    """A redirect loop fails after exactly ten requests, with Go's message."""
    outcome = await probe_http(server.url("/loop"), headers=[], timeout=2)
    assert outcome.result == ProbeResult.FAILURE
    assert outcome.output == 'Get "/loop": stopped after 10 redirects'
    assert server.targets() == ["/loop"] * MAX_REQUESTS


async def test_nine_redirects_are_followed(server: _HttpServer) -> None:
    """Nine redirects make ten requests in all, which is still within the limit."""
    outcome = await probe_http(server.url("/chain?left=9"), headers=[], timeout=2)
    assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, "end of chain")
    assert len(server.requests) == 10


async def test_ten_redirects_are_too_many(server: _HttpServer) -> None:
    """A tenth redirect fails the probe without an eleventh request."""
    outcome = await probe_http(server.url("/chain?left=10"), headers=[], timeout=2)
    assert outcome.result == ProbeResult.FAILURE
    assert outcome.output.endswith("stopped after 10 redirects")
    assert len(server.requests) == 10


async def test_host_override_survives_relative_redirect(server: _HttpServer) -> None:
    """A caller's Host is kept across a relative redirect, and Referer names the first URL."""
    outcome = await probe_http(
        server.url("/redirect-echo-relative"), headers=[("Host", "vhost")], timeout=2
    )
    headers = dict(json.loads(outcome.output))
    assert ("vhost", server.url("/redirect-echo-relative")) == (
        headers["Host"],
        headers["Referer"],
    )


async def test_host_override_dropped_on_absolute_redirect(server: _HttpServer) -> None:
    """Go drops a caller's Host when the redirect's Location is an absolute URL."""
    outcome = await probe_http(
        server.url("/redirect-echo-absolute"), headers=[("Host", "vhost")], timeout=2
    )
    assert dict(json.loads(outcome.output))["Host"] == f"127.0.0.1:{server.port}"


async def test_redirects_share_one_timeout(
    server: _HttpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A redirect into a stalled endpoint fails when the single deadline passes."""
    armed = record_probe_deadlines(monkeypatch)
    outcome = await probe_http(server.url("/redirect-slow"), headers=[], timeout=0.3)
    # The redirect and the request it leads to: one deadline, armed for the probe's timeout.
    assert [deadline.is_for(0.3) for deadline in armed] == [True, True]
    assert armed[0].at == armed[1].at
    assert outcome.result == ProbeResult.FAILURE
    assert outcome.output.startswith(f'Get "{server.url("/slow")}"')


# --- TLS --------------------------------------------------------------------------------------


async def test_https_skips_verification_by_default(tls_server: _HttpServer) -> None:
    """A self-signed certificate is accepted, as the kubelet never verifies."""
    outcome = await probe_http(tls_server.url("/ok"), headers=[], timeout=2)
    assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, "ok")


async def test_https_verification_rejects_unknown_ca(tls_server: _HttpServer) -> None:
    """With verification on, a certificate from an unknown CA fails the probe."""
    outcome = await probe_http(
        tls_server.url("/ok"), headers=[], timeout=2, tls=TLSOptions(verify=True)
    )
    assert outcome.result == ProbeResult.FAILURE
    assert "tls: " in outcome.output
    assert "CERTIFICATE_VERIFY_FAILED" in outcome.output


async def test_https_verification_with_ca_file(
    tls_server: _HttpServer, certificate: tuple[Path, Path]
) -> None:
    """With the server's certificate as CA file, verification succeeds."""
    tls = TLSOptions(verify=True, ca_file=str(certificate[0]))
    outcome = await probe_http(tls_server.url("/ok"), headers=[], timeout=2, tls=tls)
    assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, "ok")


async def test_missing_ca_file_is_an_error(tls_server: _HttpServer, tmp_path: Path) -> None:
    """An unreadable CA file means the probe can't run: ProbeError, not a failure."""
    tls = TLSOptions(verify=True, ca_file=str(tmp_path / "missing.pem"))
    with pytest.raises(ProbeError, match=r"missing\.pem"):
        await probe_http(tls_server.url("/ok"), headers=[], timeout=2, tls=tls)


def test_ca_file_without_verify_is_rejected() -> None:
    """A CA file that would be ignored is a configuration mistake."""
    with pytest.raises(ValueError, match="verify"):
        TLSOptions(ca_file="/etc/ca.pem")


# --- URLs -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scheme", "host", "path", "expected"),
    [
        ("HTTP", "10.0.0.1", "/healthz", "http://10.0.0.1:8080/healthz"),
        ("", "10.0.0.1", "healthz", "http://10.0.0.1:8080/healthz"),
        ("https", "fd00::1", "/ready?full=1&x=2#frag", "https://[fd00::1]:8080/ready?full=1&x=2"),
        ("http", "pod.local", "", "http://pod.local:8080"),
        ("http", "10.0.0.1", "/a b/ü", "http://10.0.0.1:8080/a%20b/%C3%BC"),
        ("http", "10.0.0.1", "/a%2Fb;v=1", "http://10.0.0.1:8080/a%2Fb;v=1"),
        ("http", "10.0.0.1", "/q?x=a b", "http://10.0.0.1:8080/q?x=a%20b"),
    ],
)
def test_build_url(scheme: str, host: str, path: str, expected: str) -> None:
    """URLs are built with the kubelet's rules for scheme, IPv6 hosts, paths and queries."""
    assert build_url(scheme, host, 8080, path) == expected


async def test_ipv6_target() -> None:
    """A URL with a bracketed IPv6 host connects to that address."""
    v6 = _HttpServer()
    try:
        await v6.start("::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        outcome = await probe_http(
            build_url("http", "::1", v6.port, "/echo"), headers=[], timeout=2
        )
        assert dict(json.loads(outcome.output))["Host"] == f"[::1]:{v6.port}"
    finally:
        await v6.stop()


# --- the kubelet's User-Agent (D12) -----------------------------------------------------------


async def test_default_user_agent_is_exactly_the_kubelets(server: _HttpServer) -> None:
    """Without a caller's User-Agent the probe sends kube-probe/<major>.<minor> and nothing more."""
    headers = await _echoed(server, [])
    assert [value for name, value in headers if name == "User-Agent"] == [
        f"kube-probe/{KUBELET_VERSION}"
    ]
    assert re.fullmatch(r"\d+\.\d+", KUBELET_VERSION)


# --- a pod without an IP: the kubelet dials the local system (D15) ----------------------------


async def test_empty_host_dials_the_local_system(server: _HttpServer) -> None:
    """The kubelet's URL for a pod without an IP is http://:<port>/…; Go dials the local system,
    so a listener on the node answers, and the Host header is the URL's ":<port>"."""
    url = build_url("http", "", server.port, "/k8s/host-echo")
    assert url == f"http://:{server.port}/k8s/host-echo"
    outcome = await probe_http(url, headers=[], timeout=2)
    assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, f":{server.port}")


async def test_empty_host_with_nothing_listening_fails_like_the_kubelet(closed_port: int) -> None:
    """Nothing on the node's port is a failure with Go's text, not a discarded attempt."""
    url = build_url("http", "", closed_port, "/healthz")
    outcome = await probe_http(url, headers=[], timeout=2)
    assert outcome.result == ProbeResult.FAILURE
    assert outcome.output == (
        f'Get "http://:{closed_port}/healthz": dial tcp :{closed_port}: connect: connection refused'
    )


async def test_url_without_any_host_fails() -> None:
    """A URL with no host and no port at all is Go's "no Host in request URL" failure."""
    outcome = await probe_http("http:///healthz", headers=[], timeout=1)
    assert (outcome.result, outcome.output) == (
        ProbeResult.FAILURE,
        'Get "http:///healthz": http: no Host in request URL',
    )


# --- a caller's Host across redirect chains, as Go's client carries it (D16) ------------------


def _relay_path(*hops: str) -> str:
    """A path that redirects through ``hops`` (Location templates, {port} = the server's)."""
    path = ""
    for hop in reversed(hops):
        path = hop if not path else hop + quote(path, safe="")
    return path


@pytest.mark.parametrize(
    ("hops", "expected_host"),
    [
        pytest.param(["/relay?to=", "/redirect-echo-relative"], "vhost", id="relative-relative"),
        pytest.param(
            ["/relay?to=", "http://127.0.0.1:{port}/redirect-echo-relative"],
            "127.0.0.1:{port}",
            id="absolute-then-relative-stays-dropped",
        ),
        pytest.param(
            ["/relay?to=", "/relay?to=", "http://127.0.0.1:{port}/redirect-echo-relative"],
            "127.0.0.1:{port}",
            id="relative-absolute-relative",
        ),
        pytest.param(
            ["/relay?to=", "//127.0.0.1:{port}/echo"], "vhost", id="scheme-relative-is-not-absolute"
        ),
    ],
)
async def test_host_override_across_redirect_chains(
    server: _HttpServer, hops: list[str], expected_host: str
) -> None:
    """Go keeps a caller's Host across relative Locations (a scheme-relative "//host/…" is
    relative: url.IsAbs is false) and drops it at the first absolute one, for good."""
    outcome = await probe_http(
        server.url(_relay_path(*hops)), headers=[("Host", "vhost")], timeout=2
    )
    assert outcome.result == ProbeResult.SUCCESS
    assert dict(json.loads(outcome.output))["Host"] == expected_host.format(port=server.port)


async def test_host_override_equal_to_the_url_host_is_not_carried(
    server: _HttpServer, other_server: _HttpServer
) -> None:
    """Go carries a Host only when it differs from the request URL's host: one that equals it is
    not an override, so a hop to another port is sent that port's own host."""
    own_host = f"127.0.0.1:{server.port}"
    path = _relay_path("/relay?to=", f"//127.0.0.1:{other_server.port}/echo")
    outcome = await probe_http(server.url(path), headers=[("Host", own_host)], timeout=2)
    assert dict(json.loads(outcome.output))["Host"] == f"127.0.0.1:{other_server.port}"


# --- mirrored: kubernetes pkg/probe/http/http_test.go -----------------------------------------
# Each id or docstring names the upstream test and case; docs/kubelet-map rows point here.

_GO_UA = ("User-Agent", "foo/1.0")


@pytest.mark.parametrize(
    ("path", "headers", "result", "acc_body", "not_body"),
    [
        pytest.param("/k8s/ok-body", [], ProbeResult.SUCCESS, "ok body", None, id="handleReq-200"),
        pytest.param("/k8s/header-count", [], ProbeResult.SUCCESS, "3", None, id="headerCounter"),
        pytest.param(
            "/k8s/header-keys",
            [],
            ProbeResult.SUCCESS,
            "Accept\nConnection\nUser-Agent",
            None,
            id="headerKeysNames",
        ),
        pytest.param(
            "/k8s/header-echo",
            [("Accept-Encoding", "gzip")],
            ProbeResult.SUCCESS,
            "Accept-Encoding: gzip",
            None,
            id="echo-Accept-Encoding-gzip",
        ),
        pytest.param(
            "/k8s/header-echo",
            [("Accept-Encoding", "foo")],
            ProbeResult.SUCCESS,
            "Accept-Encoding: foo",
            None,
            id="echo-Accept-Encoding-foo",
        ),
        pytest.param(
            "/k8s/header-echo",
            [("Accept-Encoding", "")],
            ProbeResult.SUCCESS,
            "Accept-Encoding: \n",
            None,
            id="echo-Accept-Encoding-empty",
        ),
        pytest.param(
            "/k8s/header-echo",
            [("X-Muffins-Or-Cupcakes", "muffins")],
            ProbeResult.SUCCESS,
            "X-Muffins-Or-Cupcakes: muffins",
            None,
            id="echo-custom-header",
        ),
        pytest.param(
            "/k8s/header-echo",
            [_GO_UA],
            ProbeResult.SUCCESS,
            "User-Agent: foo/1.0",
            None,
            id="echo-User-Agent-set",
        ),
        pytest.param(
            "/k8s/header-echo",
            [("User-Agent", "")],
            ProbeResult.SUCCESS,
            "",
            "User-Agent",
            id="echo-User-Agent-empty",
        ),
        pytest.param(
            "/k8s/header-echo",
            [],
            ProbeResult.SUCCESS,
            f"User-Agent: kube-probe/{KUBELET_VERSION}\n",
            None,
            id="echo-User-Agent-default",
        ),
        pytest.param(
            "/k8s/header-echo",
            [_GO_UA, ("Accept", "text/html")],
            ProbeResult.SUCCESS,
            "Accept: text/html",
            None,
            id="echo-User-Agent-and-Accept-text/html",
        ),
        pytest.param(
            "/k8s/header-echo",
            [_GO_UA, ("Accept", "foo/*")],
            ProbeResult.SUCCESS,
            "User-Agent: foo/1.0",
            None,
            id="echo-User-Agent-and-Accept-foo/*",
        ),
        pytest.param(
            "/k8s/header-echo",
            [("X-Muffins-Or-Cupcakes", "muffins"), ("Accept", "foo/*")],
            ProbeResult.SUCCESS,
            "X-Muffins-Or-Cupcakes: muffins",
            None,
            id="echo-custom-header-and-Accept",
        ),
        pytest.param(
            "/k8s/header-echo",
            [("Accept", "foo/*")],
            ProbeResult.SUCCESS,
            "Accept: foo/*",
            None,
            id="echo-Accept-set",
        ),
        pytest.param(
            "/k8s/header-echo",
            [("Accept", "")],
            ProbeResult.SUCCESS,
            "",
            "Accept:",
            id="echo-Accept-empty",
        ),
        pytest.param(
            "/k8s/header-echo",
            [_GO_UA, ("Accept", "")],
            ProbeResult.SUCCESS,
            "",
            "Accept:",
            id="echo-User-Agent-and-Accept-empty",
        ),
        pytest.param(
            "/k8s/header-echo",
            [],
            ProbeResult.SUCCESS,
            "Accept: */*",
            None,
            id="echo-Accept-default",
        ),
        pytest.param(
            "/k8s/host-echo",
            [("Host", "muffins.cupcakes.org")],
            ProbeResult.SUCCESS,
            "muffins.cupcakes.org",
            None,
            id="host-echo-Host-override",
        ),
        # handleReq(FailureCode=-1): Go's WriteHeader panics and the server drops the connection.
        pytest.param("/hang-up", [], ProbeResult.FAILURE, "", None, id="handleReq-FailureCode"),
        pytest.param("/k8s/fail-body", [], ProbeResult.FAILURE, "", None, id="handleReq-500"),
        pytest.param("/slow", [], ProbeResult.FAILURE, "", None, id="handler-sleeps-past-timeout"),
        *(
            pytest.param(
                f"/k8s/redirect?status={status}&bad={int(bad)}",
                [],
                ProbeResult.FAILURE if bad else ProbeResult.SUCCESS,
                "",
                None,
                id=f"redirectHandler-{status}-{'bad' if bad else 'good'}",
            )
            for status in (301, 302, 307, 308)
            for bad in (False, True)
        ),
        pytest.param(
            "/k8s/redirect-body?status=308",
            [],
            ProbeResult.WARNING,
            "Probe terminated redirects, Response body:",
            None,
            id="redirectHandlerWithBody-308-empty",
        ),
        pytest.param(
            "/k8s/redirect-body?status=308&body=ok%20body",
            [],
            ProbeResult.WARNING,
            "Probe terminated redirects, Response body: ok body",
            None,
            id="redirectHandlerWithBody-308-ok-body",
        ),
    ],
)
async def test_kubelet_http_probe_checker(
    server: _HttpServer,
    path: str,
    headers: list[tuple[str, str]],
    result: ProbeResult,
    acc_body: str,
    not_body: str | None,
) -> None:
    """TestHTTPProbeChecker: one row of its table, with its 1 s timeout and the same checks
    (the body is checked only when the result is not a failure)."""
    outcome = await probe_http(server.url(path), headers=headers, timeout=1)
    assert outcome.result == result
    if result != ProbeResult.FAILURE:
        assert acc_body in outcome.output
        if not_body is not None:
            assert not_body not in outcome.output


@pytest.mark.parametrize(
    ("loc", "result"),
    [
        pytest.param("/k8s/success", ProbeResult.SUCCESS, id="local success-local"),
        pytest.param("/k8s/fail", ProbeResult.FAILURE, id="local fail-local"),
        pytest.param("{other}/k8s/success", ProbeResult.SUCCESS, id="newport success-local"),
        pytest.param("{other}/k8s/fail", ProbeResult.FAILURE, id="newport fail-local"),
        pytest.param("http://0.0.0.0/fail", ProbeResult.WARNING, id="bogus nonlocal-local"),
        pytest.param("/k8s/loop", ProbeResult.FAILURE, id="redirect loop-local"),
    ],
)
async def test_kubelet_non_local_redirects(
    server: _HttpServer, other_server: _HttpServer, loc: str, result: ProbeResult
) -> None:
    """TestHTTPProbeChecker_NonLocalRedirects, the kubelet's followNonLocalRedirects=false rows:
    same-host redirects (any port) are followed, another host's 3xx is a warning."""
    location = loc.format(other=other_server.origin)
    url = server.url("/k8s/redirect-to?loc=" + quote(location, safe=""))
    outcome = await probe_http(url, headers=[], timeout=5)
    assert outcome.result == result


@pytest.mark.parametrize(
    ("host", "result"),
    [
        pytest.param("www.success.com", ProbeResult.SUCCESS, id="successlocal"),
        pytest.param("www.fail.com", ProbeResult.FAILURE, id="faillocal"),
    ],
)
async def test_kubelet_host_header_preserved_after_redirect(
    server: _HttpServer, host: str, result: ProbeResult
) -> None:
    """TestHTTPProbeChecker_HostHeaderPreservedAfterRedirect: a relative redirect keeps Host."""
    outcome = await probe_http(
        server.url("/k8s/host-redirect"), headers=[("Host", host)], timeout=5
    )
    assert outcome.result == result
    assert server.targets() == ["/k8s/host-redirect", "/k8s/host-success"]


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        pytest.param(MAX_OUTPUT_BYTES + 1, MAX_OUTPUT_BYTES, id="PayloadTruncated"),
        pytest.param(MAX_OUTPUT_BYTES - 1, MAX_OUTPUT_BYTES - 1, id="PayloadNormal"),
    ],
)
async def test_kubelet_payload(server: _HttpServer, size: int, expected: int) -> None:
    """TestHTTPProbeChecker_PayloadTruncated / _PayloadNormal: the body is cut at 10 KiB,
    without an error, and a shorter one is kept whole."""
    url = server.url(f"/k8s/payload?size={size}")
    outcome = await probe_http(url, headers=[("Host", "www.success.com")], timeout=5)
    assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, "a" * expected)


async def test_kubelet_http_probe_proxy(
    server: _HttpServer, other_server: _HttpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TestHTTPProbeProxy: with http_proxy/HTTP_PROXY naming a live proxy and no_proxy unset,
    the probe still goes straight to its target and the proxy sees nothing."""
    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, other_server.origin + "/")
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    outcome = await probe_http(server.url("/k8s/ok-body"), headers=[], timeout=3)
    assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, "ok body")
    assert other_server.requests == []


# --- mirrored: kubernetes pkg/probe/http/request_test.go --------------------------------------


@pytest.mark.parametrize(
    ("scheme", "path", "expected"),
    [
        pytest.param("http", "", "http://localhost:93", id="TestFormatURL-empty-path"),
        pytest.param("https", "/path", "https://localhost:93/path", id="TestFormatURL-path"),
        pytest.param("http", "?foo", "http://localhost:93?foo", id="TestFormatURL-query-only"),
        pytest.param(
            "https", "/path?bar", "https://localhost:93/path?bar", id="TestFormatURL-path-query"
        ),
    ],
)
def test_kubelet_format_url(scheme: str, path: str, expected: str) -> None:
    """TestFormatURL: host localhost, port 93."""
    assert build_url(scheme, "localhost", 93, path) == expected


async def test_kubelet_v1_header_case_insensitive(server: _HttpServer) -> None:
    """Test_v1HeaderToHTTPHeader "case insensitive": HOST and FOO-bAR become Host and Foo-Bar,
    so HOST is the Host override and Foo-Bar is sent canonicalised."""
    url = server.url("/k8s/header-echo")
    outcome = await probe_http(
        url, headers=[("HOST", "example.com"), ("FOO-bAR", "value")], timeout=2
    )
    assert "Foo-Bar: value\n" in outcome.output
    assert server.requests[0].headers[0] == ("Host", "example.com")


# -- cri-prober out of resources: an error, never the target's failure ---------------------------


async def test_out_of_descriptors_is_an_error_not_a_failure(server: _HttpServer) -> None:
    """EMFILE (a flood used up serve's descriptors) says nothing about the target: before, the
    attempt was a failure, "connect: too many open files", and counted against the container."""
    with out_of_descriptors(), pytest.raises(ProbeError, match="out of local resources"):
        await probe_http(server.url("/ok"), headers=[], timeout=2)
    assert (await probe_http(server.url("/ok"), headers=[], timeout=2)).result is (
        ProbeResult.SUCCESS
    )


# Patches Python's socket.socket, which uvloop (sockets made in C) never calls; the real
# descriptor-exhaustion tests cover uvloop.
@pytest.mark.asyncio(loop_factories=["asyncio"])
@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS])
async def test_socket_creation_out_of_resources_is_an_error(
    server: _HttpServer, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """Every kind of local exhaustion while creating the socket is an error."""

    def exhausted(*_args: object, **_kwargs: object) -> socket.socket:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(socket, "socket", exhausted)
    with pytest.raises(ProbeError, match=os.strerror(code)):
        await probe_http(server.url("/ok"), headers=[], timeout=2)
