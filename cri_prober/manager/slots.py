"""The manager's slots: one per (pod UID, container name), holding the newest attempt of that
container, its resolved probe specs and its workers, indexed by key, container ID and pod.

The table is the manager's own bookkeeping; readers outside the manager get frozen read models
(``cri_prober.manager.state``) instead of slots.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

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


_V = TypeVar("_V")
_KINDS = tuple(ProbeKind)
# Every order a map's kinds can have been set in (16 in all), shared by every map: a map holds
# one of these, never a list of its own.
_ORDERS: dict[tuple[ProbeKind, ...], tuple[ProbeKind, ...]] = {
    order: order
    for size in range(len(_KINDS) + 1)
    for order in itertools.permutations(_KINDS, size)
}
_MISSING: Any = object()


class KindMap(MutableMapping[ProbeKind, _V]):
    """A slot's per-kind map (its workers, their tasks, the retired workers): a dict's
    behaviour, insertion order included, in 64 bytes instead of a dict's 224 (issue 36: three
    of them per probed container).

    A value per kind in a slot of its own, and the order the kinds were set in as one of the
    ``_ORDERS`` tuples every map shares.
    """

    __slots__ = ("_liveness", "_order", "_readiness", "_startup")

    def __init__(self) -> None:
        self._liveness: _V = _MISSING
        self._readiness: _V = _MISSING
        self._startup: _V = _MISSING
        self._order: tuple[ProbeKind, ...] = ()

    def __getitem__(self, kind: ProbeKind) -> _V:
        value: _V = getattr(self, _FIELD[kind])
        if value is _MISSING:
            raise KeyError(kind)
        return value

    def get(self, kind: object, default: Any = None) -> Any:
        field_name = _FIELD.get(kind)  # any key, as dict.get takes
        value = _MISSING if field_name is None else getattr(self, field_name)
        return default if value is _MISSING else value

    def __setitem__(self, kind: ProbeKind, value: _V) -> None:
        field_name = _FIELD[kind]
        if getattr(self, field_name) is _MISSING:
            self._order = _ORDERS[(*self._order, kind)]
        setattr(self, field_name, value)

    def __delitem__(self, kind: ProbeKind) -> None:
        field_name = _FIELD[kind]
        if getattr(self, field_name) is _MISSING:
            raise KeyError(kind)
        setattr(self, field_name, _MISSING)
        self._order = _ORDERS[tuple(k for k in self._order if k is not kind)]

    def pop(self, kind: ProbeKind, default: Any = _MISSING) -> Any:
        value = self.get(kind, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise KeyError(kind)
            return default
        del self[kind]
        return value

    def __contains__(self, kind: object) -> bool:
        field_name = _FIELD.get(kind)
        return field_name is not None and getattr(self, field_name) is not _MISSING

    def __iter__(self) -> Iterator[ProbeKind]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __repr__(self) -> str:
        return f"KindMap({dict(self.items())!r})"


_FIELD: dict[object, str] = {kind: f"_{kind.value}" for kind in ProbeKind}


class Slot:
    """The newest attempt of one container of one pod, its probe specs and workers.

    Slotted, with ``KindMap``s for its per-kind maps: a node has one per probed container
    (issue 36: 720 bytes each with a ``__dict__`` and dicts, 350 now, an empty ``specs`` in both).
    """

    __slots__ = (
        "container",
        "key",
        "pod_spec",
        "published",
        "retired",
        "specs",
        "tasks",
        "workers",
    )

    def __init__(
        self,
        key: SlotKey,
        container: ContainerInfo,
        specs: dict[ProbeKind, ResolvedProbe] | None = None,
        pod_spec: PodSpec | None = None,
        published: Health | None = None,
    ) -> None:
        self.key = key
        self.container = container
        # The selection's answer for the newest attempt (replaced whole, never mutated here).
        self.specs: dict[ProbeKind, ResolvedProbe] = {} if specs is None else specs
        self.workers: KindMap[ProbeWorker] = KindMap()
        self.tasks: KindMap[asyncio.Task[None]] = KindMap()
        # Workers that ended on their own; a worker started later for the same kind inherits
        # their counters and history (the kubelet's worker lives as long as the pod).
        self.retired: KindMap[ProbeWorker] = KindMap()
        # The pod's spec from serve --probes-from, when a source lists the pod.
        self.pod_spec = pod_spec
        # The health the last ResultChanged of this slot carried (what the gauges and the watch
        # last said); None before the first.
        self.published = published

    def __repr__(self) -> str:
        return f"Slot({self.key!r}, {self.container.id!r}, workers={list(self.workers)})"

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
