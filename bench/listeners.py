"""Probe targets for the benchmarks, run in their own process so their CPU is not the prober's.

``python -m bench.listeners --http 2 --tcp 2 --grpc 1`` binds that many 127.0.0.1 ports of each
kind (HTTP/1.1 200 "ok" with Connection: close; TCP accept-and-close; grpc.health.v1 SERVING),
prints one JSON line ``{"http": [...], "tcp": [...], "grpc": [...]}`` and serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n"
    b"Connection: close\r\n\r\nok"
)


class _Http(asyncio.Protocol):
    """Answers the first request on a connection with 200 "ok", then closes."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if b"\r\n\r\n" in self._buffer and self._transport is not None:
            self._transport.write(_RESPONSE)
            self._transport.close()
            self._transport = None


class _Tcp(asyncio.Protocol):
    """Accepts a connection and closes it at once."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class _Health(health_pb2_grpc.HealthServicer):  # type: ignore[misc]  # untyped package
    async def Check(  # noqa: N802 - gRPC method name
        self, request: health_pb2.HealthCheckRequest, context: object
    ) -> health_pb2.HealthCheckResponse:
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def serve(http: int, tcp: int, grpc_ports: int) -> None:
    loop = asyncio.get_running_loop()
    ports: dict[str, list[int]] = {"http": [], "tcp": [], "grpc": []}
    servers: list[asyncio.Server] = []
    for kind, count, factory in (("http", http, _Http), ("tcp", tcp, _Tcp)):
        for _ in range(count):
            server = await loop.create_server(factory, "127.0.0.1", 0, backlog=4096)
            servers.append(server)
            ports[kind].append(server.sockets[0].getsockname()[1])
    grpc_server: grpc.aio.Server | None = None
    if grpc_ports:
        grpc_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(_Health(), grpc_server)
        for _ in range(grpc_ports):
            ports["grpc"].append(grpc_server.add_insecure_port("127.0.0.1:0"))
        await grpc_server.start()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    sys.stdout.write(json.dumps(ports) + "\n")
    sys.stdout.flush()
    await stop.wait()
    for server in servers:
        server.close()
    if grpc_server is not None:
        await grpc_server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--http", type=int, default=1)
    parser.add_argument("--tcp", type=int, default=1)
    parser.add_argument("--grpc", type=int, default=1)
    args = parser.parse_args()
    asyncio.run(serve(args.http, args.tcp, args.grpc))


if __name__ == "__main__":
    main()
