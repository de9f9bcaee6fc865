"""The manager's slots: one per (pod UID, container name), holding the newest attempt of that
container, its resolved probe specs and its workers, indexed by key, container ID and pod.

The table is the manager's own bookkeeping; readers outside the manager get frozen read models
(``cri_prober.manager.state``) instead of slots.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cri_prober.discovery.model import ContainerInfo, PodInfo
from cri_prober.manager.state import Health
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.spec import ResolvedProbe
from cri_prober.probing.worker import ProbeWorker

if TYPE_CHECKING:
    from cri_prober.podspecs.model import PodSpec


@dataclass(frozen=True, slots=True)
class SlotKey:
    """A container slot: the kubelet keys probe workers by pod UID and container name."""

    pod_uid: str
    container: str

    @classmethod
    def of(cls, info: ContainerInfo) -> SlotKey:
        return cls(info.pod.uid or info.pod_sandbox_id, info.name)


@dataclass
class Slot:
    """The newest attempt of one container of one pod, its probe specs and workers."""

    key: SlotKey
    container: ContainerInfo
    specs: dict[ProbeKind, ResolvedProbe] = field(default_factory=dict)
    workers: dict[ProbeKind, ProbeWorker] = field(default_factory=dict)
    tasks: dict[ProbeKind, asyncio.Task[None]] = field(default_factory=dict)
    # Workers that ended on their own; a worker started later for the same kind inherits their
    # counters and history (the kubelet's worker lives as long as the pod).
    retired: dict[ProbeKind, ProbeWorker] = field(default_factory=dict)
    # The pod's spec from serve --probes-from, when a source lists the pod.
    pod_spec: PodSpec | None = None
    # The health the last ResultChanged of this slot carried (what the gauges and the watch
    # last said); None before the first.
    published: Health | None = None

    @property
    def pod(self) -> PodInfo:
        return self.container.pod

    @property
    def label(self) -> str:
        """``namespace/pod/container``, the name users and the health service use."""
        return f"{self.pod.namespace}/{self.pod.name}/{self.key.container}"


class SlotTable:
    """Every slot with at least one probe configured, by key, by container ID and by pod."""

    def __init__(self) -> None:
        self._by_key: dict[SlotKey, Slot] = {}
        self._by_container_id: dict[str, Slot] = {}
        self._by_pod: dict[str, set[SlotKey]] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[Slot]:
        return iter(list(self._by_key.values()))

    def keys(self) -> set[SlotKey]:
        return set(self._by_key)

    def get(self, key: SlotKey) -> Slot | None:
        return self._by_key.get(key)

    def for_container(self, container_id: str) -> Slot | None:
        """The slot whose newest attempt has this container ID."""
        return self._by_container_id.get(container_id)

    def of_pod(self, pod_uid: str) -> list[Slot]:
        """The pod's slots (none when the pod has no probed container)."""
        return [self._by_key[key] for key in self._by_pod.get(pod_uid, ())]

    def has_pod(self, pod_uid: str) -> bool:
        return pod_uid in self._by_pod

    def pods(self) -> list[str]:
        """The UIDs of every pod with a probed container."""
        return list(self._by_pod)

    def add(self, key: SlotKey, info: ContainerInfo) -> Slot:
        """A new slot for ``key``, holding ``info`` (bind it once its specs are known)."""
        slot = Slot(key=key, container=info)
        self._by_key[key] = slot
        self._by_pod.setdefault(key.pod_uid, set()).add(key)
        return slot

    def bind(self, slot: Slot, info: ContainerInfo) -> None:
        """``info`` is now the slot's newest attempt."""
        if slot.container.id != info.id:
            self._by_container_id.pop(slot.container.id, None)
        slot.container = info
        self._by_container_id[info.id] = slot

    def remove(self, slot: Slot) -> bool:
        """Forget the slot; True when it was its pod's last."""
        self._by_key.pop(slot.key, None)
        if self._by_container_id.get(slot.container.id) is slot:
            del self._by_container_id[slot.container.id]
        pod_slots = self._by_pod.get(slot.key.pod_uid)
        if pod_slots is None:
            return False
        pod_slots.discard(slot.key)
        if pod_slots:
            return False
        del self._by_pod[slot.key.pod_uid]
        return True
