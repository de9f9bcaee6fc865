"""The httpGet handler: one HTTP/1.1 GET per probe with the kubelet's headers, redirects, verdict.

It speaks HTTP/1.1 itself over asyncio streams: httpx cost about five times the CPU of a bare
asyncio exchange per probe, and a probe needs only a GET, one connection, and a capped body.
"""

from __future__ import annotations

import asyncio
import functools
import re
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote, urljoin, urlsplit

from cri_prober.probing.handlers import tcp
from cri_prober.probing.outcome import (
    MAX_OUTPUT_BYTES,
    ProbeError,
    ProbeOutcome,
    ProbeResult,
    truncate_output,
)

# The one kubelet version cri-prober mimics: what its User-Agent (HTTP and gRPC) claims to be.
KUBELET_VERSION = "1.34"
# Exactly the kubelet's kube-probe/<major>.<minor>: apps and proxies match on the whole value.
USER_AGENT = f"kube-probe/{KUBELET_VERSION}"

# Go's client stops when the 10th request in a chain answers with yet another redirect.
MAX_REQUESTS = 10

# Go's transport default; the probe timeout still bounds the handshake as a whole.
_TLS_HANDSHAKE_TIMEOUT = 10.0
# asyncio waits up to 30 s for the peer's close_notify after we close; a probe socket need not.
_TLS_SHUTDOWN_TIMEOUT = 1.0
# Bounds the status line and headers we buffer, so a server can't feed us headers forever.
_MAX_HEAD_BYTES = 1 << 20
_MAX_INFORMATIONAL = 5  # 1xx responses skipped before the real one, as Go allows

_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_NO_BODY_STATUSES = frozenset({204, 304})
# Headers Go writes itself or never takes from the caller; Connection is always "close" here.
_CALLER_EXCLUDED = frozenset({"Content-Length", "Transfer-Encoding", "Trailer", "Connection"})

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_CHUNK_SIZE = re.compile(rb"[0-9a-fA-F]+")
_BLANK = " \t"  # Go trims these around header values it writes
# Characters Go leaves as written in a path (url.URL.EscapedPath); the query also keeps "?".
_PATH_SAFE = "/!$&'()*+,;=:@[]%"
_QUERY_SAFE = _PATH_SAFE + "?"

_AWAITING_HEADERS = "context deadline exceeded (Client.Timeout exceeded while awaiting headers)"
_READING_BODY = (
    "context deadline exceeded (Client.Timeout or context cancellation while reading body)"
)

# Framing markers for _read_body besides a Content-Length.
_UNTIL_EOF = -1
_CHUNKED = -2


@dataclass(frozen=True, slots=True)
class TLSOptions:
    """How an https probe checks the server's certificate (the kubelet never does).

    ``ca_file`` replaces the system trust store and requires ``verify``.
    """

    verify: bool = False
    ca_file: str | None = None

    def __post_init__(self) -> None:
        if self.ca_file is not None and not self.verify:
            raise ValueError("TLSOptions.ca_file needs verify=True")


def build_url(scheme: str, host: str, port: int, path: str) -> str:
    """Return the URL the kubelet would probe for an httpGet action.

    The scheme is lower-cased (empty means ``http``), an IPv6 host is bracketed, ``path`` may
    carry a ``?query`` (kept) and a ``#fragment`` (dropped), a path without a leading ``/`` gets
    one, and characters that may not appear in a URL are percent-encoded.
    """
    path, _, _ = path.partition("#")
    path, question, query = path.partition("?")
    if path and not path.startswith("/"):
        path = "/" + path
    return (
        f"{scheme.lower() or 'http'}://{tcp.join_host_port(host, port)}"
        f"{quote(path, safe=_PATH_SAFE)}{question}{quote(query, safe=_QUERY_SAFE)}"
    )


async def probe_http(
    url: str,
    *,
    headers: Sequence[tuple[str, str]],
    timeout: float,
    tls: TLSOptions | None = None,
) -> ProbeOutcome:
    """GET ``url`` as the kubelet does and judge the response.

    2xx is a success and 3xx a warning (a redirect that was not followed), both with the body as
    output; anything else is a failure naming the status code. Same-host redirects are followed
    for at most ``MAX_REQUESTS`` requests. Connecting, every redirect and reading the body share
    one ``timeout``; a target that can't be reached or doesn't answer in time is a failure.

    Raises:
        ProbeError: the body could not be read after the headers arrived (timeout, reset, early
            EOF), or the CA file can't be loaded; the kubelet discards such an attempt instead
            of counting it. Also when cri-prober itself ran out of descriptors, memory or
            buffers (``tcp.local_exhaustion``): that is no verdict on the target.
    """
    deadline = asyncio.get_running_loop().time() + timeout
    try:
        fields, user_agent, host_header = _caller_headers(headers, url)
        target = _parse_target(url)
        original_host = target.host
        referer: str | None = None
        sent = 0
        while True:
            sent += 1
            response = await _round_trip(
                target, fields, user_agent, host_header, referer, tls, deadline
            )
            try:
                location = response.location
                if response.status in _REDIRECT_STATUSES and location:
                    next_target = _redirect_target(target, location)
                    # A redirect to another hostname is not followed: its 3xx is the answer.
                    if next_target.host == original_host:
                        if sent == MAX_REQUESTS:
                            raise _RequestFailed(
                                location, f"stopped after {MAX_REQUESTS} redirects"
                            )
                        if host_header == target.authority or urlsplit(location).scheme:
                            # Go's client carries a caller's Host to the next hop only when
                            # the Location is relative and that Host differs from the URL's
                            # own; once dropped it stays dropped, whatever follows.
                            host_header = None
                        referer = _referer(target, next_target)
                        target = next_target
                        continue
                body = await _read_body(response, target.url, deadline)
            finally:
                response.writer.close()
            return _verdict(response.status, body)
    except _RequestFailed as exc:
        return ProbeOutcome(ProbeResult.FAILURE, str(exc), timed_out=exc.timed_out)
    except (UnicodeError, ValueError) as exc:
        # A URL that cannot be put on the wire (a lone surrogate in the path, a bad host name):
        # the kubelet fails to build such a request, which makes the attempt an error.
        raise ProbeError(f"cannot build a request for {url!r}: {exc}") from exc


def _verdict(status: int, body: bytes) -> ProbeOutcome:
    if 200 <= status < 300:
        return ProbeOutcome(ProbeResult.SUCCESS, truncate_output(body), http_status=status)
    if 300 <= status < 400:
        output = "Probe terminated redirects, Response body: " + truncate_output(body)
        return ProbeOutcome(ProbeResult.WARNING, output, http_status=status)
    # The body stays out of the output (kubernetes#99425): it may hold secrets.
    output = f"HTTP probe failed with statuscode: {status}"
    return ProbeOutcome(ProbeResult.FAILURE, output, http_status=status)


class _RequestFailed(Exception):
    """The request got no usable response; becomes a FAILURE worded like Go's client error."""

    def __init__(self, url: str, detail: str, *, timed_out: bool = False) -> None:
        super().__init__(f'Get "{url}": {detail}')
        self.timed_out = timed_out


@dataclass(frozen=True, slots=True)
class _Target:
    url: str
    scheme: str
    host: str  # brackets stripped, case kept: the redirect check compares it as Go does
    port: int
    authority: str  # the default Host header
    request_target: str


@dataclass(frozen=True, slots=True)
class _Response:
    status: int
    location: str
    framing: int  # a Content-Length, _UNTIL_EOF or _CHUNKED
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter


# Probes hit the same few URLs every period, so parsing each once is worth a small cache.
@functools.lru_cache(maxsize=1024)
def _parse_target(url: str) -> _Target:
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise _RequestFailed(url, str(exc)) from exc
    if parts.scheme not in ("http", "https"):
        raise _RequestFailed(url, f"unsupported protocol scheme {parts.scheme!r}")
    authority = parts.netloc.rpartition("@")[2]
    if authority.startswith("["):
        host, _, port_text = authority[1:].partition("]")
        port_text = port_text.removeprefix(":")
    else:
        host, _, port_text = authority.partition(":")
    if not authority:
        raise _RequestFailed(url, "http: no Host in request URL")
    # An empty hostname with a port (``http://:8080/``, a pod without an IP) is valid for Go:
    # it dials the local system, see tcp.dial_host.
    if not port_text:
        port = 443 if parts.scheme == "https" else 80
    elif port_text.isdigit() and int(port_text) <= 65535:
        port = int(port_text)
    else:
        raise _RequestFailed(url, f"invalid port {':' + port_text!r} after host")
    # Re-escaping is a no-op for URLs from build_url but cleans up a raw Location header.
    request_target = quote(parts.path, safe=_PATH_SAFE) or "/"
    if parts.query:
        request_target += "?" + quote(parts.query, safe=_QUERY_SAFE)
    return _Target(url, parts.scheme, host, port, authority, request_target)


def _redirect_target(current: _Target, location: str) -> _Target:
    try:
        return _parse_target(urljoin(current.url, location))
    except (_RequestFailed, ValueError) as exc:
        raise _RequestFailed(
            current.url, f"failed to parse Location header {location!r}: {exc}"
        ) from exc


def _caller_headers(
    headers: Sequence[tuple[str, str]], url: str
) -> tuple[list[tuple[str, str]], str, str | None]:
    """Apply the kubelet's header rules: return (fields to send, User-Agent, Host override)."""
    fields: list[tuple[str, str]] = []
    user_agent: str | None = None
    host: str | None = None
    accept: str | None = None
    for raw_name, value in headers:
        name = _canonical_name(raw_name)
        if not _TOKEN.fullmatch(name):
            raise _RequestFailed(url, f"net/http: invalid header field name {raw_name!r}")
        if _CONTROL.search(value):
            raise _RequestFailed(url, f"net/http: invalid header field value for {name!r}")
        # Go writes only the first value of these two.
        if name == "User-Agent":
            user_agent = value if user_agent is None else user_agent
        elif name == "Host":
            host = value if host is None else host
        elif name not in _CALLER_EXCLUDED:
            if name == "Accept" and accept is None:
                accept = value
            fields.append((name, value))
    if accept is None:
        fields.append(("Accept", "*/*"))
    elif accept == "":
        # An Accept whose first value is empty means "send no Accept at all".
        fields = [field for field in fields if field[0] != "Accept"]
    return fields, USER_AGENT if user_agent is None else user_agent, host or None


@functools.lru_cache(maxsize=256)
def _canonical_name(name: str) -> str:
    """Go's CanonicalMIMEHeaderKey: ``x-custom-id`` becomes ``X-Custom-Id``."""
    if not _TOKEN.fullmatch(name):
        return name
    return "-".join(part[:1].upper() + part[1:].lower() for part in name.split("-"))


def _referer(previous: _Target, following: _Target) -> str | None:
    # Go sends the previous URL as Referer on a redirect, except from https to http.
    if previous.scheme == "https" and following.scheme == "http":
        return None
    return previous.url


def _request_head(
    target: _Target,
    fields: list[tuple[str, str]],
    user_agent: str,
    host_header: str | None,
    referer: str | None,
) -> bytes:
    lines = [
        f"GET {target.request_target} HTTP/1.1",
        f"Host: {host_header or target.authority}",
    ]
    if user_agent:
        lines.append(f"User-Agent: {user_agent.strip(_BLANK)}")
    lines.extend(f"{name}: {value.strip(_BLANK)}" for name, value in fields)
    if referer is not None and not any(name == "Referer" for name, _ in fields):
        lines.append(f"Referer: {referer}")
    lines.append("Connection: close\r\n\r\n")
    return "\r\n".join(lines).encode()


@functools.lru_cache(maxsize=8)
def _ssl_context(tls: TLSOptions | None) -> ssl.SSLContext:
    """Build one context per TLS setting: building one per probe would dominate its cost."""
    if tls is None or not tls.verify:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        context = ssl.create_default_context(cafile=tls.ca_file)
    # This client speaks HTTP/1.1 only; the kubelet's Go client could also negotiate h2.
    context.set_alpn_protocols(["http/1.1"])
    return context


async def _connect(
    target: _Target, tls: TLSOptions | None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    if target.scheme == "https":
        try:
            context = _ssl_context(tls)
        except OSError as exc:  # an unreadable CA file is a bad spec, not a verdict
            raise ProbeError(f"cannot set up TLS with {tls}: {exc}") from exc
    try:
        host = tcp.dial_host(target.host)
        if target.scheme == "http":
            return await asyncio.open_connection(host, target.port, limit=_MAX_HEAD_BYTES)
        return await asyncio.open_connection(
            host,
            target.port,
            limit=_MAX_HEAD_BYTES,
            ssl=context,
            server_hostname=target.host or None,
            ssl_handshake_timeout=_TLS_HANDSHAKE_TIMEOUT,
            ssl_shutdown_timeout=_TLS_SHUTDOWN_TIMEOUT,
        )
    except ssl.SSLError as exc:
        raise _RequestFailed(target.url, f"tls: {exc}") from exc
    except OSError as exc:
        if tcp.local_exhaustion(exc):
            raise tcp.exhaustion_error(f'Get "{target.url}"', exc) from exc
        raise _RequestFailed(target.url, tcp.dial_error(target.host, target.port, exc)) from exc


async def _round_trip(
    target: _Target,
    fields: list[tuple[str, str]],
    user_agent: str,
    host_header: str | None,
    referer: str | None,
    tls: TLSOptions | None,
    deadline: float,
) -> _Response:
    """Connect, send the request and read the response head, all before ``deadline``."""
    head = _request_head(target, fields, user_agent, host_header, referer)
    try:
        async with asyncio.timeout_at(deadline) as scope:
            reader, writer = await _connect(target, tls)
            try:
                writer.write(head)
                status, location, framing = await _read_head(reader, target.url)
                return _Response(status, location, framing, reader, writer)
            except BaseException:
                writer.close()
                raise
    except asyncio.IncompleteReadError as exc:
        raise _RequestFailed(target.url, "EOF") from exc
    except (OSError, ValueError) as exc:
        # ValueError: a header line longer than _MAX_HEAD_BYTES.
        if isinstance(exc, TimeoutError) and scope.expired():
            raise _RequestFailed(target.url, _AWAITING_HEADERS, timed_out=True) from exc
        if isinstance(exc, OSError) and tcp.local_exhaustion(exc):  # e.g. ENOBUFS on send
            raise tcp.exhaustion_error(f'Get "{target.url}"', exc) from exc
        raise _RequestFailed(target.url, f"read tcp: {exc}") from exc


async def _read_head(reader: asyncio.StreamReader, url: str) -> tuple[int, str, int]:
    """Read the final response head: return its status, Location and body framing."""
    for _ in range(_MAX_INFORMATIONAL + 1):
        status = _parse_status_line(await _read_line(reader), url)
        header_lines = await _read_header_lines(reader, url)
        # 101 ends the exchange (and fails the probe); other 1xx precede the real response.
        if status >= 200 or status == 101:
            break
    else:
        raise _RequestFailed(url, "net/http: too many 1xx informational responses")
    location = ""
    content_length: int | None = None
    chunked = False
    for line in header_lines:
        name, colon, value = line.partition(":")
        if not colon:
            raise _RequestFailed(url, f"malformed MIME header line: {line}")
        name = name.lower()
        value = value.strip(_BLANK)
        if name == "location" and not location:
            location = value
        elif name == "transfer-encoding":
            if value.lower() != "chunked":
                raise _RequestFailed(url, f"unsupported transfer encoding: {value!r}")
            chunked = True
        elif name == "content-length":
            if not value.isdigit() or content_length not in (None, int(value)):
                raise _RequestFailed(url, f"bad Content-Length {value!r}")
            content_length = int(value)
    if status < 200 or status in _NO_BODY_STATUSES:
        framing = 0
    elif chunked:
        framing = _CHUNKED
    elif content_length is not None:
        framing = content_length
    else:
        framing = _UNTIL_EOF
    return status, location, framing


async def _read_line(reader: asyncio.StreamReader) -> str:
    """Read one head line; bare LF line endings are accepted, as Go does."""
    raw = await reader.readline()
    if not raw.endswith(b"\n"):
        raise asyncio.IncompleteReadError(raw, None)
    return raw.rstrip(b"\r\n").decode("latin-1")


async def _read_header_lines(reader: asyncio.StreamReader, url: str) -> list[str]:
    lines: list[str] = []
    size = 0
    while line := await _read_line(reader):
        size += len(line)
        if size > _MAX_HEAD_BYTES:
            raise _RequestFailed(url, "net/http: server response headers exceeded the limit")
        # Obsolete folded continuation lines can only extend headers we don't read.
        if line[0] not in _BLANK:
            lines.append(line)
    return lines


def _parse_status_line(line: str, url: str) -> int:
    version, _, rest = line.partition(" ")
    code = rest.lstrip(" ").partition(" ")[0]
    if not version.startswith("HTTP/") or len(code) != 3 or not code.isdigit():
        raise _RequestFailed(
            url, f"net/http: HTTP/1.x transport connection broken: malformed HTTP response {line!r}"
        )
    return int(code)


class BodyReadError(ProbeError):
    """The response head arrived but reading its body failed (the attempt errored)."""


async def _read_body(response: _Response, url: str, deadline: float) -> bytes:
    """Read at most MAX_OUTPUT_BYTES of the body and leave the rest unread."""
    try:
        async with asyncio.timeout_at(deadline) as scope:
            if response.framing == _CHUNKED:
                return await _read_chunked(response.reader)
            if response.framing == _UNTIL_EOF:
                return await _read_until_eof(response.reader)
            return await response.reader.readexactly(min(response.framing, MAX_OUTPUT_BYTES))
    except asyncio.IncompleteReadError as exc:
        raise BodyReadError(f'Get "{url}": reading body: unexpected EOF') from exc
    except (OSError, ValueError) as exc:
        if isinstance(exc, TimeoutError) and scope.expired():
            raise BodyReadError(f'Get "{url}": {_READING_BODY}') from exc
        raise BodyReadError(f'Get "{url}": reading body: {exc}') from exc


async def _read_until_eof(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while len(body) < MAX_OUTPUT_BYTES:
        data = await reader.read(MAX_OUTPUT_BYTES - len(body))
        if not data:
            break
        body += data
    return bytes(body)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while len(body) < MAX_OUTPUT_BYTES:
        line = await reader.readline()
        if not line.endswith(b"\n"):
            raise asyncio.IncompleteReadError(line, None)
        size_text = line.partition(b";")[0].strip()
        if not _CHUNK_SIZE.fullmatch(size_text):
            raise ValueError(f"malformed chunked encoding: bad chunk size {size_text!r}")
        size = int(size_text, 16)
        if size == 0:
            break  # trailers, if any, are of no interest
        wanted = min(size, MAX_OUTPUT_BYTES - len(body))
        body += await reader.readexactly(wanted)
        if wanted < size:
            break
        if await reader.readline() not in (b"\r\n", b"\n"):
            raise ValueError("malformed chunked encoding: chunk not followed by CRLF")
    return bytes(body)
