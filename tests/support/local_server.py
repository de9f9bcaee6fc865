"""A loopback asyncio server for handler tests, whose connections all end with it.

Subclasses answer a connection in ``serve``; ``stop`` cancels every handler still running (a
stalled one included) and each connection's writer is closed when its handler ends.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass, field


@dataclass
class LocalServer:
    port: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self, host: str = "127.0.0.1", *, tls: ssl.SSLContext | None = None) -> None:
        self._server = await asyncio.start_server(self._handle, host, 0, ssl=tls)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self.serve(reader, writer)
        finally:
            writer.close()
            self._tasks.discard(task)
