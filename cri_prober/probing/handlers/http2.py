"""One HTTP/2 request on one connection, with prior knowledge: the h2c httpGet probe (KEP-5999)
and the gRPC health call over TLS (KEP-4939) both send a single request this way.

The ``h2`` library (pure Python, the HTTP/2 state machine without I/O) frames the request and
reads the answer in an asyncio Protocol, like the HTTP/1.1 exchange in ``http``: no stream
buffer, one future per wait. What is kept of the answer is bounded: the head, the body (cut at
``max_body``) and the few header and trailer fields a probe reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, cast

from cri_prober.probing.handlers.exchange import AwaitedExchange

if TYPE_CHECKING:
    # Imported where an exchange uses them: h2 (1.2 MiB) only once an h2c or gRPC-over-TLS probe
    # runs, not in a serve that has none (issue 36, idle RSS).
    import h2.connection
    import h2.events
    import h2.exceptions

_STREAM: Final = 1  # the one request of a connection is its first client stream
_MAX_HEAD_BYTES: Final = 1 << 20  # as for HTTP/1.1: bytes received for the head (and frames)
_MAX_INFORMATIONAL: Final = 5  # 1xx responses skipped before the real one, as Go allows
# The response fields a probe reads (headers or trailers); any other is dropped unread.
_KEPT_FIELDS: Final = frozenset({b"location", b"content-type", b"grpc-status", b"grpc-message"})
_MAX_FIELD_BYTES: Final = 4096  # of each kept field's value
# What an HTTP/1.x answer's first bytes read as an HTTP/2 frame header: Go's framer says so.
_HTTP1_ANSWER: Final = b"HTTP/"
_MAX_QUOTED: Final = 200  # characters of an h2 error kept (they may quote what the server sent)

Header = tuple[bytes, bytes]


class H2Exchange(AwaitedExchange):
    """Sends the HTTP/2 connection preface and one request as soon as the connection is made,
    and wakes the probe when the final response head is in and again when the stream is over.

    It has the attributes and methods of the HTTP/1.1 exchange that the httpGet handler reads
    (``has_head``, ``status``, ``location``, ``finished``, ``problem``, ``cause``, ``head``,
    ``end``, ``body_bytes``, ``close``), so both share its redirect and verdict rules.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        headers: Sequence[Header],
        body: bytes = b"",
        *,
        max_body: int,
        finish_at_cap: bool = True,
        withhold: str | None = None,
    ) -> None:
        super().__init__(loop)
        self._withhold = withhold  # see http.probe_http: h2's errors may quote what was sent
        self._headers = list(headers)
        self._body_to_send = body
        self._max_body = max_body
        # True: a body cut at max_body ends the exchange (a probe reads no more of it); False:
        # the cap is an error (a gRPC message must be whole).
        self._finish_at_cap = finish_at_cap
        import h2.config
        import h2.connection

        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self._conn: h2.connection.H2Connection | None = h2.connection.H2Connection(config)
        self._transport: asyncio.BaseTransport | None = None
        self._first = b""
        self._head_bytes = 0
        self._informational = 0
        self.status = 0
        self.location = ""
        self.fields: dict[bytes, bytes] = {}  # _KEPT_FIELDS from headers, then trailers
        self.body_size = 0
        self.problem: str | None = None
        self.cause: OSError | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        import h2.exceptions

        self._transport = transport
        conn = self._conn
        assert conn is not None
        try:
            conn.initiate_connection()
            conn.send_headers(_STREAM, self._headers, end_stream=not self._body_to_send)
            if self._body_to_send:
                conn.send_data(_STREAM, self._body_to_send, end_stream=True)
        except h2.exceptions.H2Error as exc:  # a header HTTP/2 cannot carry
            self._fail(f"http2: invalid request: {exc}")
            return
        self._flush()

    def data_received(self, data: bytes) -> None:
        import h2.exceptions

        conn = self._conn
        if self.finished or conn is None:
            return
        if not self._first:
            self._first = data
            if data.startswith(_HTTP1_ANSWER):
                # An HTTP/1.x server answering the preface: its first bytes read as a frame
                # header of some 4.7 MB, which Go's framer refuses with these words (h2 would
                # wait for the whole "frame" instead).
                self._fail(
                    "http2: failed reading the frame payload: http2: frame too large, note "
                    "that the frame header looked like an HTTP/1.1 header"
                )
                return
        # h2 buffers a whole frame before it checks its length (up to 16 MiB): bound what
        # this exchange lets it hold, head and body together.
        self._head_bytes += len(data)
        if self._head_bytes > _MAX_HEAD_BYTES + self._max_body:
            if self.has_head and self._finish_at_cap:
                self._finish()  # judged on the head and what body came whole, as at the cap
            else:
                self._fail("net/http: server response headers exceeded the limit")
            return
        try:
            events = conn.receive_data(data)
        except h2.exceptions.H2Error as exc:
            self._fail(self._h2_error(exc))
            return
        for event in events:
            self._event(event)
            if self.finished:
                return
        self._flush()

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self.finished:
            return
        if isinstance(exc, OSError):
            self.cause = exc
        if exc is None:
            self._fail("unexpected EOF" if self.has_head else "EOF")
        else:
            self._fail(f"read tcp: {exc}")

    # -- h2 events ---------------------------------------------------------------------------------

    def _event(self, event: h2.events.Event) -> None:
        import h2.events

        if isinstance(event, h2.events.InformationalResponseReceived):
            self._informational += 1
            if self._informational > _MAX_INFORMATIONAL:
                self._fail("net/http: too many 1xx informational responses")
        elif isinstance(event, h2.events.ResponseReceived):
            self._keep(event.headers or [])
            status = self.fields.pop(b":status", b"")
            self.status = int(status) if status.isdigit() else 0
            self.location = self.fields.get(b"location", b"").decode("latin-1").strip(" \t")
            self.has_head = True
            self._first = b""
            self._wake()
        elif isinstance(event, h2.events.TrailersReceived):
            self._keep(event.headers or [])
        elif isinstance(event, h2.events.DataReceived):
            self._data(event)
        elif isinstance(event, h2.events.StreamEnded):
            self._finish()
        elif isinstance(event, h2.events.StreamReset):
            self._fail(
                f"stream error: stream ID {_STREAM}; {_code(event.error_code)}; received from peer"
            )
        elif isinstance(event, h2.events.ConnectionTerminated):
            self._fail(
                "http2: server sent GOAWAY and closed the connection; "
                f"ErrCode={_code(event.error_code)}"
            )

    def _h2_error(self, exc: h2.exceptions.H2Error) -> str:
        # h2's messages can quote the server's header bytes: bounded, or only named.
        if self._withhold is not None:
            return f"http2: {type(exc).__name__} (details not kept{self._withhold})"
        return f"http2: {str(exc)[:_MAX_QUOTED]}"

    def _keep(self, headers: Sequence[tuple[bytes | str, bytes | str]]) -> None:
        for raw_name, raw_value in headers:
            name = raw_name if isinstance(raw_name, bytes) else raw_name.encode()
            value = raw_value if isinstance(raw_value, bytes) else raw_value.encode()
            if (name in _KEPT_FIELDS or name == b":status") and name not in self.fields:
                self.fields[name] = value[:_MAX_FIELD_BYTES]

    def _data(self, event: h2.events.DataReceived) -> None:
        data = event.data or b""
        conn = self._conn
        if conn is not None and event.flow_controlled_length:
            # Give the window back: a server must never stall on a probe that still reads.
            conn.acknowledge_received_data(event.flow_controlled_length, _STREAM)
        if not self.has_head:
            return
        room = self._max_body - self.body_size
        if len(data) > room:
            if not self._finish_at_cap:
                self._fail("message larger than the probe reads")
                return
            self.body.append(data[:room])
            self.body_size = self._max_body
            self._finish()
            return
        self.body.append(data)
        self.body_size += len(data)
        if self._finish_at_cap and self.body_size == self._max_body:
            self._finish()

    # -- for the probe (head, end and body_bytes: AwaitedExchange) ------------------------------

    def close(self) -> None:
        """Hang up and end the exchange (the h2 state goes with it)."""
        self.finished = True
        self._conn = None
        if self._transport is not None:
            if self._transport.get_extra_info("sslcontext") is not None:
                # A TLS close waits for the peer's close_notify (up to the loop's TLS shutdown
                # timeout), holding the socket past the probe, or past its loop in a test: the
                # probe is done with it, so it goes at once.
                cast("asyncio.Transport", self._transport).abort()
            else:
                self._transport.close()

    def _flush(self) -> None:
        conn, transport = self._conn, self._transport
        if conn is None or transport is None:
            return
        if data := conn.data_to_send():
            cast("asyncio.WriteTransport", transport).write(data)

    def _fail(self, problem: str) -> None:
        if self.finished:
            return
        self.problem = problem
        self._finish()


def _code(code: object) -> str:
    """An HTTP/2 error code by its name, as Go writes it (``REFUSED_STREAM``)."""
    import h2.errors

    if isinstance(code, h2.errors.ErrorCodes):
        return code.name
    return f"unknown error code {code}"
