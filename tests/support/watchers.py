"""Listeners that let a test await what discovery or the probe manager does, instead of sleeping."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from cri_prober.discovery.model import EventKind, LifecycleEvent
from cri_prober.discovery.source import DiscoveryUpdate, NodeSource, ViewChanged
from cri_prober.manager.events import AttemptFinished, ManagerEvent, ResultChanged, WorkerStopped
from cri_prober.manager.probe_manager import ProbeManager
from tests.support.waiting import HANG_GUARD, until


class ManagerWatcher:
    """Follows a manager's event stream and wakes a test on every event.

    ``await until(predicate)`` instead of sleeping; it also records what it saw.
    """

    def __init__(self, manager: ProbeManager | None = None) -> None:
        self.changed = asyncio.Event()
        self.records: list[AttemptFinished] = []
        self.transitions: list[ResultChanged] = []
        self.stopped: list[WorkerStopped] = []
        # Called on every attempt; tests sample state there.
        self.on_probe: list[Callable[[AttemptFinished], None]] = []
        self.unsubscribe: Callable[[], None] = lambda: None
        if manager is not None:
            self.follow(manager)

    def follow(self, manager: ProbeManager) -> None:
        """Start following ``manager``'s events."""
        self.unsubscribe = manager.events.subscribe(self)

    def __call__(self, event: ManagerEvent) -> None:
        if isinstance(event, AttemptFinished):
            self.records.append(event)
            for hook in self.on_probe:
                hook(event)
        elif isinstance(event, ResultChanged):
            self.transitions.append(event)
        elif isinstance(event, WorkerStopped):
            self.stopped.append(event)
        self.changed.set()

    async def until(
        self,
        predicate: Callable[[], object],
        timeout: float = HANG_GUARD,
        *,
        message: str | None = None,
    ) -> None:
        """`waiting.until` re-checking ``predicate()`` on every manager event."""
        await until(predicate, timeout=timeout, message=message, changed=self.changed)

    async def events(self, count: int, timeout: float = HANG_GUARD) -> None:
        """Wait for ``count`` more manager events."""
        async with asyncio.timeout(timeout):
            for _ in range(count):
                self.changed.clear()
                await self.changed.wait()


def event_object_id(event: LifecycleEvent) -> str:
    """The container ID of a container event, the sandbox ID of a pod event."""
    if event.container is not None:
        return event.container.id
    assert event.pod is not None
    return event.pod.sandbox_id


class DiscoveryRecorder:
    """Keeps every lifecycle event a node source publishes and lets a test await one."""

    def __init__(self, node: NodeSource) -> None:
        self.seen: list[LifecycleEvent] = []
        self._queue: asyncio.Queue[LifecycleEvent] = asyncio.Queue()
        self.unsubscribe = node.updates.subscribe(self._on_update)

    def _on_update(self, update: DiscoveryUpdate) -> None:
        if isinstance(update, ViewChanged):
            for event in update.events:
                self.seen.append(event)
                self._queue.put_nowait(event)

    async def wait_for(
        self, kind: EventKind, object_id: str, *, timeout: float = HANG_GUARD
    ) -> LifecycleEvent:
        """The next event of this kind for this container (or, for pod kinds, sandbox)."""
        async with asyncio.timeout(timeout):
            while True:
                event = await self._queue.get()
                if event.kind is kind and event_object_id(event) == object_id:
                    return event
