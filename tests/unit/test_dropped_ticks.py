"""The node-wide ``probe_ticks_dropped`` warning: once per interval, with the exec cap's part."""

from __future__ import annotations

import dataclasses

import structlog
from structlog.testing import capture_logs

from cri_prober.manager.dropped_ticks import DroppedTicks, ExecPressure
from cri_prober.manager.events import AttemptFinished
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.results import ProbeRecord
from tests.support.clock import ManualClock
from tests.unit.slots import make_slot

CONTAINER = make_slot().container


def attempt(kind: ProbeKind, dropped: int) -> AttemptFinished:
    record = ProbeRecord("id-app", 0.0, 1.2, "success", "", late=0.2, dropped=dropped)
    return AttemptFinished(CONTAINER, kind, record)


def test_one_line_per_interval_counts_what_came_between() -> None:
    clock = ManualClock()
    ticks = DroppedTicks(clock=clock, interval=60.0)
    # As in a worker's task, whose context names its container: not the node-wide line's.
    structlog.contextvars.bind_contextvars(container="shop/web-0/app", probe="liveness")
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        ticks.on_event(attempt(ProbeKind.LIVENESS, 0))  # on time: nothing to say
        ticks.on_event(attempt(ProbeKind.LIVENESS, 2))
        clock.advance(30)
        ticks.on_event(attempt(ProbeKind.READINESS, 1))
        ticks.on_event(attempt(ProbeKind.LIVENESS, 1))
        clock.advance(30)
        ticks.on_event(attempt(ProbeKind.LIVENESS, 1))
    assert [line["dropped"] for line in logs] == [
        {"liveness": 2},
        {"liveness": 2, "readiness": 1},
    ]
    assert [line["seconds"] for line in logs] == [0.0, 30.0]
    assert {line["log_level"] for line in logs} == {"warning"}
    assert "past their period" in logs[0]["why"]
    assert not any("container" in line or "probe" in line for line in logs)
    structlog.contextvars.clear_contextvars()


def test_the_line_says_when_the_exec_cap_held_execs_back() -> None:
    """Waits for exec slots since the last line, and the runtime's pace when it is slow for
    everyone: the cap protects the runtime, and the line says that is why ticks were lost."""
    clock = ManualClock()
    pressure = ExecPressure(cap=8, waiting=3, slot_wait_seconds=10.0, pace=0.3, runtime_slow=False)
    ticks = DroppedTicks(execs=lambda: pressure, clock=clock, interval=60.0)
    with capture_logs() as logs:
        ticks.on_event(attempt(ProbeKind.LIVENESS, 1))  # no slot wait since start
        clock.advance(61)
        pressure = dataclasses.replace(pressure, slot_wait_seconds=10.4)
        ticks.on_event(attempt(ProbeKind.LIVENESS, 1))  # 0.4 s: a container's turns, no more
        clock.advance(61)
        pressure = dataclasses.replace(
            pressure, slot_wait_seconds=52.5, pace=1.04, runtime_slow=True
        )
        ticks.on_event(attempt(ProbeKind.LIVENESS, 3))
    assert logs[0]["exec_slot_wait_seconds"] == 0.0
    assert "exec" not in logs[0]["why"]
    assert logs[1]["exec_slot_wait_seconds"] == 0.4
    assert "exec" not in logs[1]["why"]
    logs = [logs[0], logs[2]]
    assert logs[1]["exec_slot_wait_seconds"] == 42.1
    assert (logs[1]["execs_waiting"], logs[1]["max_concurrent_execs"]) == (3, 8)
    assert logs[1]["exec_pace_seconds"] == 1.04
    assert "--max-concurrent-execs 8" in logs[1]["why"]
    assert "1.04 s on median, for everyone" in logs[1]["why"]
