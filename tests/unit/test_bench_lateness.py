"""bench/scale.py's lateness measure (issue 25): a worker whose first tick on the grid (the
anchor) was late must not make its on-time ticks read as a period late, which gave the p99 of
10.0 s; dropped ticks are the grid points no start served."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from bench.scale import LeanObserver, worker_lateness
from cri_prober.manager.events import AttemptFinished
from cri_prober.probing.kinds import ProbeKind

PERIOD = 10.0


def test_on_time_ticks_after_a_late_anchor_are_on_time() -> None:
    # The grid is at 0, 10, 20, ...; the anchor came 1.5 s late (past the old 1 s slack).
    anchor = 1001.5
    starts = [1010.0, 1020.001, 1030.0, 1040.002]
    late, ticks, dropped = worker_lateness(anchor, starts, PERIOD)
    assert max(late) == pytest.approx(0.002)
    assert (ticks, dropped) == (4, 0)


def test_a_late_start_is_late_by_its_own_delay() -> None:
    anchor = 1000.0
    starts = [1010.0, 1020.3, 1030.0]
    late, _, _ = worker_lateness(anchor, starts, PERIOD)
    assert late == pytest.approx([0.0, 0.3, 0.0])


def test_a_grid_point_no_start_served_is_dropped() -> None:
    anchor = 1000.0
    starts = [1010.0, 1020.0, 1040.0, 1050.1]
    late, ticks, dropped = worker_lateness(anchor, starts, PERIOD)
    assert (ticks, dropped) == (5, 1)
    assert max(late) == pytest.approx(0.1)


def test_a_phase_near_the_period_boundary_wraps() -> None:
    # On-time phase 9.95 s: a start 0.1 s late lands at phase 0.05 of the next period.
    anchor = 1000.0
    starts = [1009.95, 1019.95, 1030.05, 1039.95]
    late, ticks, dropped = worker_lateness(anchor, starts, PERIOD)
    assert late == pytest.approx([0.0, 0.0, 0.1, 0.0])
    assert (ticks, dropped) == (4, 0)


def _finished(uid: str, kind: ProbeKind, started_at: float, result: str = "success") -> Any:
    container = SimpleNamespace(pod=SimpleNamespace(uid=uid), pod_sandbox_id="s", name="app")
    record = SimpleNamespace(started_at=started_at, result=result, timed_out=False)
    return AttemptFinished(container=container, kind=kind, record=record)  # type: ignore[arg-type]


def test_the_observer_measures_each_worker_on_its_own_grid() -> None:
    """Its numbers kept in flat arrays (issue 36) give what worker_lateness gives per worker:
    the first step is left out, the second is the anchor, the rest counted once counting."""
    observer = LeanObserver()
    live, ready = ProbeKind.LIVENESS, ProbeKind.READINESS
    for event in (_finished("a", live, 3.0), _finished("b", live, 7.0), _finished("a", ready, 1.0)):
        observer(event)
    assert observer.first_probes == 3
    assert observer.first_probe == 7.0
    observer(_finished("a", live, 10.0))  # anchors
    observer(_finished("b", live, 15.0))
    observer(_finished("a", live, 20.0))  # not counting yet: left out
    observer.counting = True
    for event in (
        _finished("a", live, 30.2),
        _finished("b", live, 25.0),
        _finished("a", live, 50.0),  # 40 was dropped
        _finished("b", live, 35.0, result="failure"),
        _finished("a", ready, 11.0),  # its anchor: not counted
    ):
        observer(event)
    assert (observer.probes, observer.unsuccessful) == (4, 1)
    assert sorted(observer.lateness()) == pytest.approx([0.0, 0.0, 0.0, 0.2])
    assert (observer.ticks, observer.dropped) == (3 + 2, 1)
