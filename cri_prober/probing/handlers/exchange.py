"""What the HTTP/1.1 and HTTP/2 exchanges share: a protocol on one connection that the probe
awaits twice at most (the final response head, then the end), woken from the transport's
callbacks without a stream buffer or a task of its own."""

from __future__ import annotations

import asyncio


class AwaitedExchange(asyncio.Protocol):
    """One request's connection; subclasses set ``has_head``, append to ``body`` and call
    ``_finish`` (``finished``) from their callbacks."""

    __slots__ = ("_loop", "_waiter", "body", "finished", "has_head")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiter: asyncio.Future[None] | None = None
        self.has_head = False
        self.body: list[bytes] = []
        self.finished = False

    async def head(self) -> None:
        """Return once the final response head is in, or the exchange is over."""
        if not self.has_head and not self.finished:
            await self._wait()

    async def end(self) -> None:
        """Return once the body is complete (capped, or its stream ended), or the exchange is
        over."""
        if not self.finished:
            await self._wait()

    def body_bytes(self) -> bytes:
        return b"".join(self.body)

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _finish(self) -> None:
        self.finished = True
        self._wake()


__all__ = ["AwaitedExchange"]
