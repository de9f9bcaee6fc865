"""bench/scale.py's lateness measure (issue 25): a worker whose first tick on the grid (the
anchor) was late must not make its on-time ticks read as a period late, which gave the p99 of
10.0 s; dropped ticks are the grid points no start served."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from bench.scale import LeanObserver, worker_lateness
from cri_prober.manager.events import AttemptFinished, AttemptsRepeated
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


def _container(uid: str) -> Any:
    return SimpleNamespace(pod=SimpleNamespace(uid=uid), pod_sandbox_id="s", name="app")


def _record(started_at: float, result: str = "success", timed_out: bool = False) -> Any:
    return SimpleNamespace(started_at=started_at, result=result, timed_out=timed_out)


def _finished(uid: str, kind: ProbeKind, started_at: float, result: str = "success") -> Any:
    return AttemptFinished(_container(uid), kind, _record(started_at, result))


def _repeated(uid: str, kind: ProbeKind, starts: list[float], **record: Any) -> Any:
    """A run of repeated attempts as the manager tells it: ``record`` is the newest."""
    durations = tuple(0.001 for _ in starts)
    return AttemptsRepeated(
        _container(uid), kind, _record(starts[-1], **record), durations, tuple(starts)
    )


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
    observer.count_from(25.0)
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


def test_repeated_attempts_told_in_runs_count_as_each_attempt_would() -> None:
    """The benchmark takes repeats in runs, as serve's listeners do (a listener that takes
    every attempt turns the steady fast path off): a run told late, across the window's ends,
    counts exactly the starts stamped in the window, as one event per attempt would have."""
    live, ready = ProbeKind.LIVENESS, ProbeKind.READINESS
    a_starts = [1.0, 10.0, 20.0, 30.0, 40.2, 60.0, 70.0, 80.0]  # 50 dropped
    b_starts = [2.0, 12.0, 22.0, 32.0, 42.0, 52.0, 62.0, 72.0, 82.0]  # failing from 32 on
    each, runs = LeanObserver(), LeanObserver()
    for observer in (each, runs):
        observer.count_from(25.0)
        observer.count_until(75.0)
    for start in a_starts:
        each(_finished("a", live, start))
    for start in b_starts:
        each(_finished("b", ready, start, result="success" if start < 30 else "failure"))
    # The same attempts in runs: a's first step alone, then everything else in two runs, the
    # second told after the window (catch_up); b's change to failure ends its first run.
    runs(_finished("a", live, 1.0))
    runs(_repeated("a", live, [10.0, 20.0, 30.0]))
    runs(_finished("b", ready, 2.0))
    runs(_repeated("b", ready, [12.0, 22.0]))
    runs(_finished("b", ready, 32.0, result="failure"))
    runs(_repeated("a", live, [40.2, 60.0, 70.0, 80.0]))
    runs(_repeated("b", ready, [42.0, 52.0, 62.0, 72.0, 82.0], result="failure"))

    assert (runs.probes, runs.unsuccessful, runs.first_probes) == (4 + 5, 5, 2)
    assert (runs.probes, runs.unsuccessful, runs.timed_out) == (
        each.probes,
        each.unsuccessful,
        each.timed_out,
    )
    assert sorted(runs.lateness()) == pytest.approx(sorted(each.lateness()))
    assert max(runs.lateness()) == pytest.approx(0.2)
    assert (runs.ticks, runs.dropped) == (each.ticks, each.dropped) == (5 + 5, 1)


def test_a_run_of_timed_out_repeats_counts_each_one() -> None:
    observer = LeanObserver()
    observer.count_from(0.0)
    observer(_finished("a", ProbeKind.LIVENESS, 1.0))
    observer(
        _repeated("a", ProbeKind.LIVENESS, [10.0, 20.0, 30.0], result="failure", timed_out=True)
    )
    assert (observer.probes, observer.unsuccessful, observer.timed_out) == (2, 2, 2)
