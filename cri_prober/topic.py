"""``Topic``: the one publish/subscribe mechanism between cri-prober's parts.

Discovery publishes view changes, the results store published results, the manager its event
stream and the CRI client its calls, each on a ``Topic``. Listeners run synchronously in the
publisher's task, so they must be quick: record or queue the work, don't do it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import structlog

log = structlog.get_logger(__name__)

_E = TypeVar("_E")

Listener = Callable[[_E], None]


class Topic(Generic[_E]):
    """Delivers every published event to every current listener, in subscription order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._listeners: list[Callable[[_E], None]] = []

    def subscribe(self, listener: Callable[[_E], None]) -> Callable[[], None]:
        """Call ``listener`` for every event from now on; returns a function that unsubscribes."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def publish(self, event: _E) -> None:
        """Hand ``event`` to every listener; one that raises is logged and the rest still run."""
        for listener in tuple(self._listeners):
            try:
                listener(event)
            except Exception:
                log.exception("listener_failed", topic=self.name, event_type=type(event).__name__)

    def __len__(self) -> int:
        return len(self._listeners)


__all__ = ["Listener", "Topic"]
