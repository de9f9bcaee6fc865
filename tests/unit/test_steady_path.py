"""The worker's steady path (issue 36): an attempt like the one before is counted and kept in the
history's columns, with no record, report or metric call of its own; its run is told later in
one ``AttemptsRepeated``, and everything read from it (history, counters, metrics) is what the
path that reports every attempt gives."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from cri_prober.discovery.model import ContainerInfo
from cri_prober.manager.events import (
    AttemptFinished,
    AttemptsRepeated,
    ManagerEvent,
    ManagerTopic,
    ResultChanged,
)
from cri_prober.manager.state import Health
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.outcome import ProbeOutcome, ProbeResult
from cri_prober.probing.results import ProbeRecord, ResultsStore, ResultUpdate
from cri_prober.probing.worker import ContainerView, ProbeWorker
from cri_prober.serving.metrics import Metrics
from tests.support.clock import WALL0, WorkerClock
from tests.unit.slots import make_slot

HISTORY = 8


@dataclass(frozen=True)
class Timing:
    initial_delay_seconds: int = 0
    period_seconds: int = 10
    success_threshold: int = 1
    failure_threshold: int = 3


class Owner:
    """A worker's observer and runs taker that turns its reports into the manager's events,
    in the order they come, and feeds them to a ``Metrics``."""

    def __init__(self, container: ContainerInfo, kind: ProbeKind, *, runs: bool) -> None:
        self.container, self.kind = container, kind
        self.takes_runs = runs
        self.events: list[ManagerEvent] = []
        self.metrics = Metrics(wall=lambda: WALL0)

    def _publish(self, event: ManagerEvent) -> None:
        self.events.append(event)
        self.metrics.manager_event(event)

    def attempt_finished(self, worker: ProbeWorker, record: ProbeRecord) -> None:
        self._publish(AttemptFinished(self.container, self.kind, record))

    def attempts_repeated(self, worker: ProbeWorker, count: int) -> None:
        history = worker.history
        self._publish(
            AttemptsRepeated(
                self.container,
                self.kind,
                history[-1],
                history.durations(count),
                history.starts(count),
            )
        )

    def result_changed(self, worker: ProbeWorker, update: ResultUpdate) -> None:
        health = Health(running=True, started=True, ready=False, live=True)
        self._publish(
            ResultChanged(
                self.container,
                self.kind,
                update.previous,
                update.result,
                update.consecutive,
                "",
                health,
                update.reason,
            )
        )

    def worker_stopped(self, worker: ProbeWorker) -> None:
        pass

    def of(self, kind: type[object]) -> list[ManagerEvent]:
        return [event for event in self.events if isinstance(event, kind)]


class Twin:
    """One worker, given the same script as its twin: with ``runs`` it takes the steady path."""

    def __init__(self, kind: ProbeKind, *, runs: bool) -> None:
        self.clock = WorkerClock()
        self.container = dataclasses.replace(make_slot().container, id="c1")
        self.owner = Owner(self.container, kind, runs=runs)
        self.outcome = ProbeOutcome(ProbeResult.SUCCESS, "ok")
        self.worker = ProbeWorker(
            kind,
            Timing(),
            status=lambda: ContainerView(
                id="c1", running=True, started_at=WALL0 - 100, started=True
            ),
            run_probe=self._run,
            results=ResultsStore(),
            prober_started_at=WALL0 - 3600,
            clock=self.clock,
            rng=random.Random(7),
            observer=self.owner,
            runs=self.owner if runs else None,
            history_size=HISTORY,
        )
        self.attempts = 0

    async def _run(self, _view: ContainerView) -> ProbeOutcome:
        # Each attempt takes its own time: the durations the histograms see differ.
        self.attempts += 1
        self.clock.now += 0.001 * (self.attempts % 7)
        # A new outcome each time, equal to the one before: as a handler makes them.
        return dataclasses.replace(self.outcome)

    async def steps(self, outcome: ProbeOutcome, count: int) -> None:
        self.outcome = outcome
        for _ in range(count):
            self.clock.now += 10.0
            assert await self.worker.step()


OK = ProbeOutcome(ProbeResult.SUCCESS, "ok")
BAD = ProbeOutcome(ProbeResult.FAILURE, "refused", reason="connection-refused")


async def twins(kind: ProbeKind, *script: tuple[ProbeOutcome, int]) -> tuple[Twin, Twin]:
    every, steady = Twin(kind, runs=False), Twin(kind, runs=True)
    for outcome, count in script:
        await every.steps(outcome, count)
        await steady.steps(outcome, count)
    return every, steady


def exposition(twin: Twin) -> bytes:
    """The twin's metrics, without the ``_created`` samples (when each metric was made)."""
    lines = twin.owner.metrics.exposition().splitlines(keepends=True)
    return b"".join(line for line in lines if b"_created" not in line)


async def test_a_steady_probe_is_counted_without_an_event_per_attempt() -> None:
    every, steady = await twins(ProbeKind.READINESS, (OK, 5))

    # The worker reporting every attempt told five; the steady one told its first only, and
    # holds the other four back.
    assert len(every.owner.of(AttemptFinished)) == 5
    assert len(steady.owner.of(AttemptFinished)) == 1
    assert steady.owner.of(AttemptsRepeated) == []
    # What it keeps is the same: its counters and its history, record for record.
    assert steady.worker.probes_run == every.worker.probes_run == 5
    assert list(steady.worker.history) == list(every.worker.history)
    assert steady.worker.snapshot(records=True) == every.worker.snapshot(records=True)

    # A scrape asks for the repeats: the metrics then count all five, exactly as per attempt
    # (prober_probe_total, the duration histogram, the reasons' counter).
    steady.worker.tell_repeats()
    (repeated,) = steady.owner.of(AttemptsRepeated)
    assert isinstance(repeated, AttemptsRepeated)
    assert len(repeated.durations) == 4
    # Each repeat's own start stamp, oldest first (what a lateness measure needs).
    newest = list(steady.worker.history)[-4:]
    assert repeated.starts == tuple(record.started_at for record in newest)
    assert repeated.durations == tuple(record.duration for record in newest)
    text = exposition(steady)
    assert b'result="successful"} 5.0' in text
    assert b'cri_prober_probe_attempts_by_reason_total{probe_type="Readiness",reason="ok"} 5.0' in (
        text
    )
    assert text == exposition(every)


async def test_repeats_are_told_at_least_once_per_history() -> None:
    # The history holds the durations of the repeats not told yet: a run as long as it is
    # told at once, without being asked.
    every, steady = await twins(ProbeKind.LIVENESS, (OK, 1 + HISTORY + 3))

    told = steady.owner.of(AttemptsRepeated)
    assert [len(event.durations) for event in told if isinstance(event, AttemptsRepeated)] == [
        HISTORY
    ]
    steady.worker.tell_repeats()
    assert list(steady.worker.history) == list(every.worker.history)
    assert exposition(steady) == exposition(every)


async def test_a_change_after_a_steady_run_is_reported_with_its_run() -> None:
    every, steady = await twins(ProbeKind.READINESS, (OK, 6), (BAD, 3), (OK, 4))

    # The failures' run was reported attempt by attempt where they differed from the one
    # before (the first) or changed the result (the third), with the run and threshold.
    failures = [
        event.record
        for event in steady.owner.of(AttemptFinished)
        if isinstance(event, AttemptFinished) and event.record.result == "failure"
    ]
    assert [(r.run, r.threshold, r.changed) for r in failures] == [(1, 3, False), (3, 3, True)]
    # Every run held back was told before what came after it, so per-attempt metrics that
    # depend on the order (failures in a row) come out as they would.
    kinds = [type(event).__name__ for event in steady.owner.events]
    first_failure = next(
        index
        for index, event in enumerate(steady.owner.events)
        if isinstance(event, AttemptFinished) and event.record.result == "failure"
    )
    assert kinds[first_failure - 1] == "AttemptsRepeated"
    changes = [
        (event.previous, event.result, event.consecutive)
        for event in steady.owner.of(ResultChanged)
        if isinstance(event, ResultChanged)
    ]
    assert changes == [
        (event.previous, event.result, event.consecutive)
        for event in every.owner.of(ResultChanged)
        if isinstance(event, ResultChanged)
    ]
    steady.worker.tell_repeats()
    assert list(steady.worker.history) == list(every.worker.history)
    assert steady.worker.snapshot() == every.worker.snapshot()
    assert exposition(steady) == exposition(every)


@pytest.mark.parametrize("runs", [False, True])
def test_the_manager_topic_holds_repeats_back_only_if_no_listener_needs_each(runs: bool) -> None:
    topic = ManagerTopic("manager")
    flushed: list[bool] = []

    def flush() -> Iterator[None]:
        flushed.append(True)
        yield

    topic.flush = flush
    unsubscribe_runs = topic.subscribe(lambda event: None, runs=True)
    assert topic.takes_runs
    unsubscribe = topic.subscribe(lambda event: None, runs=runs)
    assert topic.takes_runs is runs
    unsubscribe()
    unsubscribe()  # twice: counted once
    assert topic.takes_runs
    unsubscribe_runs()
    topic.catch_up()
    assert flushed == [True]


def test_a_catch_up_for_the_metrics_server_tells_repeats_in_steps() -> None:
    """At 10,000 containers, telling every worker's repeats at once held the loop for tens of
    milliseconds at each scrape. The exposition the metrics server renders in slices tells
    them a step at a time, an empty piece after each (where the server may give the loop a
    turn), and nothing before it is read; the counts it renders include every step's."""
    topic = ManagerTopic("manager")
    told: list[int] = []

    def flush() -> Iterator[None]:
        for step in range(3):
            told.append(step)
            yield

    topic.flush = flush
    steps = topic.catch_up_in_steps()
    assert told == []  # lazy: nothing is told before the reader asks
    assert next(steps) is None
    assert told == [0]
    assert list(steps) == [None, None]
    assert told == [0, 1, 2]
    topic.catch_up()
    assert told == [0, 1, 2, 0, 1, 2]

    # The exposition: one empty piece per step, before any line (``Metrics.follow`` wires the
    # manager's steps to the collector's ``before_read`` the same way).
    told.clear()
    metrics = Metrics(wall=lambda: WALL0)
    metrics._workers.before_read = flush
    pieces = metrics.exposition_pieces()
    assert told == []
    assert [next(pieces) for _ in range(3)] == [b"", b"", b""]
    assert told == [0, 1, 2]
    rest = b"".join(pieces)
    assert b"# HELP" in rest
    assert told == [0, 1, 2]
