"""``NodeSource``: what the layers above need from anything that discovers a node's containers.

``pleg.Discovery`` implements it over CRI; another runtime or source (a recording, a different
runtime API) is one new module implementing the same protocol. Changes are published on one
``Topic`` as ``ViewChanged`` (a batch of lifecycle events, after the new view is in place) and
``Relisted`` (every full listing, successful or not).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from cri_prober.discovery.model import ContainerInfo, LifecycleEvent, PodInfo
from cri_prober.topic import Topic

# The kubelet calls its PLEG unhealthy when the last successful relist is older than 3 minutes.
RELIST_THRESHOLD = 180.0

Mode = Literal["auto", "relist", "events"]
EffectiveMode = Literal["relist", "events"]


@dataclass(frozen=True, slots=True)
class ViewChanged:
    """The view changed; ``events`` say how, in order (the new view is already readable)."""

    events: tuple[LifecycleEvent, ...]


@dataclass(frozen=True, slots=True)
class Relisted:
    """One full listing finished: how long it took and whether it succeeded."""

    seconds: float
    ok: bool


DiscoveryUpdate = ViewChanged | Relisted


class NodeSource(Protocol):
    """A live, read-only view of the node's pods and containers."""

    @property
    def updates(self) -> Topic[DiscoveryUpdate]:
        """Where changes of the view and relists are published."""
        ...

    @property
    def last_relist_ok(self) -> float | None:
        """Monotonic time of the last successful full listing; None before the first."""
        ...

    @property
    def effective_mode(self) -> EffectiveMode | None:
        """How the view is kept fresh, once decided."""
        ...

    def containers(self) -> Mapping[str, ContainerInfo]:
        """Every known container by ID (a consistent, read-only snapshot)."""
        ...

    def pods(self) -> Mapping[str, PodInfo]:
        """Every known pod sandbox by sandbox ID (a consistent, read-only snapshot)."""
        ...

    def healthy(self, now: float | None = None) -> bool:
        """Whether a full listing succeeded within ``RELIST_THRESHOLD``."""
        ...

    async def run(self, mode: Mode, *, relist_period: float, stop: asyncio.Event) -> None:
        """Keep the view fresh until ``stop`` is set."""
        ...


__all__ = [
    "RELIST_THRESHOLD",
    "DiscoveryUpdate",
    "EffectiveMode",
    "Mode",
    "NodeSource",
    "Relisted",
    "ViewChanged",
]
