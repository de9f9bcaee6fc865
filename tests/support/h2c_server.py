"""Loopback servers for the 1.37 probe fields: an HTTP/2 cleartext server (prior knowledge, the
``h2`` library's server side), an HTTP/1.1-only one that answers 200 to anything it is sent,
and a gRPC health server over TLS only (grpc.aio with a trustme certificate)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import h2.config
import h2.connection
import h2.events
import trustme
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.support.local_server import LocalServer

# path -> (status, extra headers, body)
Route = tuple[int, tuple[tuple[str, str], ...], bytes]


@dataclass
class H2cServer(LocalServer):
    """Answers each request of an h2c connection by its path from ``routes`` (404 else), and
    records every request's headers."""

    routes: dict[str, Route] = field(default_factory=dict)
    requests: list[dict[str, str]] = field(default_factory=list)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        config = h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        conn = h2.connection.H2Connection(config)
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        while data := await reader.read(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    headers = {str(k): str(v) for k, v in event.headers or []}
                    self.requests.append(headers)
                    status, extra, body = self.routes.get(headers[":path"], (404, (), b""))
                    assert event.stream_id is not None
                    conn.send_headers(
                        event.stream_id,
                        [(":status", str(status)), ("content-length", str(len(body))), *extra],
                        end_stream=not body,
                    )
                    size = conn.max_outbound_frame_size  # bodies within the first window
                    for start in range(0, len(body), size):
                        end = start + size >= len(body)
                        conn.send_data(event.stream_id, body[start : start + size], end_stream=end)
            writer.write(conn.data_to_send())
            await writer.drain()


@dataclass
class Http1OnlyServer(LocalServer):
    """Speaks HTTP/1.1 only, and says 200 to whatever it is sent (an h2c preface included)."""

    received: list[bytes] = field(default_factory=list)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            self.received.append(await reader.readuntil(b"\r\n\r\n"))
        except asyncio.IncompleteReadError:
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()


@asynccontextmanager
async def tls_health_server(
    statuses: dict[str, int] | None = None, *, servicer: object | None = None
) -> AsyncIterator[int]:
    """A grpc.aio health server on a TLS-only port, its certificate from a CA nobody trusts
    (the probe must not verify it); yields the port. ``servicer`` replaces the standard one."""
    ca = trustme.CA()
    leaf = ca.issue_cert("health.example")
    credentials = grpc.ssl_server_credentials(
        [(leaf.private_key_pem.bytes(), leaf.cert_chain_pems[0].bytes())]
    )
    if servicer is None:
        standard = health.aio.HealthServicer()
        for service, status in (statuses or {"": health_pb2.HealthCheckResponse.SERVING}).items():
            await standard.set(service, status)
        servicer = standard
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    try:
        yield port
    finally:
        await server.stop(None)
