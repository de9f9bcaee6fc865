"""Fair exec slots: the node-wide cap on ExecSync calls, shared so that no container can hog it.

A plain semaphore hands slots out first come, first served, so whoever asks most holds most:
four containers with two hanging exec probes each held all eight slots and every other exec
probe on the node waited behind them (issue 15). Here a container (the key) holds at most
``per_key`` slots at a time, and when slots are short the containers waiting for one take turns
in the order they started waiting (round robin): a container that just got a slot goes to the
back of the line. How long a slot is held is bounded by the caller (``CriClient.exec_sync``),
so every waiting container gets a slot within a bounded time, whatever the others run.
"""

from __future__ import annotations

import asyncio
from collections import deque


class ExecSlot:
    """One granted slot; ``release()`` gives it back (again is a no-op, so a timer and a
    ``finally`` clause may both call it)."""

    __slots__ = ("_owner", "_released", "key")

    def __init__(self, owner: ExecSlots, key: str) -> None:
        self._owner = owner
        self.key = key
        self._released = False

    @property
    def released(self) -> bool:
        """True once the slot went back."""
        return self._released

    def release(self) -> None:
        """Give the slot back and hand it to the next container in line."""
        if not self._released:
            self._released = True
            self._owner._release(self.key)


class ExecSlots:
    """``capacity`` slots, at most ``per_key`` of them held by one key, handed out fairly."""

    def __init__(self, capacity: int, *, per_key: int = 1) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        if per_key < 1:
            raise ValueError("per_key must be >= 1")
        self.capacity = capacity
        self.per_key = per_key
        self._free = capacity
        self._held: dict[str, int] = {}
        self._waiters: dict[str, deque[asyncio.Future[ExecSlot]]] = {}
        # Keys with waiters, in turn order (dicts keep insertion order; re-inserting a key moves
        # it to the back). Keys that hold their full share stay where they are, so they are
        # first in line again as soon as their slot comes back.
        self._line: dict[str, None] = {}

    @property
    def in_use(self) -> int:
        """Slots held right now."""
        return self.capacity - self._free

    @property
    def waiting(self) -> int:
        """Calls waiting for a slot right now."""
        return sum(len(waiters) for waiters in self._waiters.values())

    def held_by(self, key: str) -> int:
        """Slots ``key`` holds right now."""
        return self._held.get(key, 0)

    async def acquire(self, key: str) -> ExecSlot:
        """Wait for a slot for ``key``; a slot granted to a call cancelled meanwhile goes back."""
        if self._free > 0 and key not in self._waiters and self.held_by(key) < self.per_key:
            # After every release the line has been served as far as it can be, so a free slot
            # means nobody who may take it is waiting: no one is overtaken here.
            return self._grant(key)
        future: asyncio.Future[ExecSlot] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, deque()).append(future)
        self._line.setdefault(key, None)
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                future.result().release()  # granted just as the caller was cancelled
            else:
                self._forget(key, future)
            raise

    def _grant(self, key: str) -> ExecSlot:
        self._free -= 1
        self._held[key] = self._held.get(key, 0) + 1
        return ExecSlot(self, key)

    def _release(self, key: str) -> None:
        self._free += 1
        if (held := self._held[key] - 1) > 0:
            self._held[key] = held
        else:
            del self._held[key]
        self._serve_line()

    def _serve_line(self) -> None:
        while self._free > 0:
            # Skips only keys that hold their full share: at most ``capacity`` of them.
            key = next((k for k in self._line if self.held_by(k) < self.per_key), None)
            if key is None:
                return
            waiters = self._waiters[key]
            future = waiters.popleft()
            if not future.cancelled():  # a cancelled caller forgets its own entry later
                future.set_result(self._grant(key))
            del self._line[key]
            if waiters:
                self._line[key] = None  # its next call waits for its next turn, at the back
            else:
                del self._waiters[key]

    def _forget(self, key: str, future: asyncio.Future[ExecSlot]) -> None:
        waiters = self._waiters.get(key)
        if waiters is None or future not in waiters:
            return  # already taken out of the line
        waiters.remove(future)
        if not waiters:
            del self._waiters[key]
            self._line.pop(key, None)


__all__ = ["ExecSlot", "ExecSlots"]
