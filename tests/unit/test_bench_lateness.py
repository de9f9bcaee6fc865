"""bench/scale.py's lateness measure (issue 25): a worker whose first tick on the grid (the
anchor) was late must not make its on-time ticks read as a period late, which gave the p99 of
10.0 s; dropped ticks are the grid points no start served."""

from __future__ import annotations

import pytest

from bench.scale import worker_lateness

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
