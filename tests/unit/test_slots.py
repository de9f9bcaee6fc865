"""The manager's slots: a slot's per-kind maps behave as the dicts they replaced (issue 36)."""

from __future__ import annotations

import sys
import tracemalloc
from typing import Any

import pytest

from cri_prober.manager.slots import KindMap
from cri_prober.probing.kinds import ProbeKind
from tests.unit.slots import make_slot

L, R, S = ProbeKind.LIVENESS, ProbeKind.READINESS, ProbeKind.STARTUP

# Every way the manager uses a slot's maps, applied to a KindMap and to a dict alike.
STEPS: list[tuple[str, tuple[object, ...]]] = [
    ("set", (R, "r1")),
    ("set", (L, "l1")),
    ("set", (R, "r2")),  # replacing keeps the order
    ("pop", (R, None)),
    ("set", (S, "s1")),
    ("set", (R, "r3")),
    ("del", (L,)),
    ("pop", (L, "default")),
    ("set", (L, "l2")),
    ("pop", (S, None)),
]


def _apply(mapping: Any, step: str, args: tuple[Any, ...]) -> object:
    if step == "set":
        mapping[args[0]] = args[1]
        return None
    if step == "del":
        del mapping[args[0]]
        return None
    return mapping.pop(*args)


def _view(mapping: dict[ProbeKind, str] | KindMap[str]) -> object:
    return (
        list(mapping),
        list(mapping.values()),
        list(mapping.items()),
        len(mapping),
        bool(mapping),
        [kind in mapping for kind in ProbeKind],
        [mapping.get(kind) for kind in ProbeKind],
        [mapping.get(kind, "none") for kind in ProbeKind],
    )


def test_a_kind_map_behaves_as_a_dict_order_included() -> None:
    kinds: KindMap[str] = KindMap()
    plain: dict[ProbeKind, str] = {}
    assert _view(kinds) == _view(plain)
    for step, args in STEPS:
        assert _apply(kinds, step, args) == _apply(plain, step, args), (step, args)
        assert _view(kinds) == _view(plain), (step, args)
    assert dict(kinds) == plain


def test_a_kind_map_refuses_what_a_dict_refuses() -> None:
    kinds: KindMap[str] = KindMap()
    with pytest.raises(KeyError):
        kinds[L]
    with pytest.raises(KeyError):
        del kinds[L]
    with pytest.raises(KeyError):
        kinds.pop(L)
    other: Any = "liveness"  # not a kind: absent, as in a dict keyed by kinds
    assert other not in kinds
    assert kinds.get(other, 1) == 1


def test_a_slot_is_smaller_than_with_a_dict_and_dicts() -> None:
    """The point of the change: a node has one slot per probed container. The old slot (a
    dataclass with a __dict__, and a dict per map) took 720 bytes with two workers and tasks."""
    template = make_slot()
    count = 1000
    tracemalloc.start()
    try:
        slots = []
        for _ in range(count):
            slot = type(template)(key=template.key, container=template.container)
            slot.workers[L] = slot.workers[R] = None  # type: ignore[assignment]
            slot.tasks[L] = slot.tasks[R] = None  # type: ignore[assignment]
            slots.append(slot)
        size = tracemalloc.get_traced_memory()[0] - sys.getsizeof(slots)
    finally:
        tracemalloc.stop()
    assert size / count < 400
    assert not hasattr(template, "__dict__")
