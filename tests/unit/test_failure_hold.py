"""Issue 24: in report mode with rules or annotations nothing acts on a liveness or startup
failure, so the kubelet's hold (which waits for the container its kill brings) would freeze the
verdict for good. There the probe keeps running and publishes the recovery; where something acts
(``--on-failure stop``, a pod spec's probe that the kubelet runs) or with
``--failure-hold always`` it holds as the kubelet's does, and every surface says so."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from cri_prober.manager.api import ProbeOnHold
from cri_prober.manager.events import ManagerEvent, ResultChanged
from cri_prober.manager.probe_manager import FailureHold, OnFailure
from cri_prober.probing.outcome import Reason
from cri_prober.probing.results import Published
from cri_prober.probing.spec import ProbeKind, ResolvedProbe, RulesFile, load_rules
from cri_prober.serving.convert import probe_status_pb
from cri_prober.serving.metrics import Metrics
from cri_prober.serving.transitions import Transition, TransitionLog
from tests.support.manager_world import World, manager_world
from tests.support.waiting import HANG_GUARD

RULES = """
probes:
  - match: {container: app}
    livenessProbe: {exec: {command: [check-live]}, periodSeconds: 1, failureThreshold: 2}
    startupProbe: {exec: {command: [check-start]}, periodSeconds: 1, failureThreshold: 1}
"""


def _rules() -> RulesFile:
    return load_rules(RULES, source="rules.yaml")


MakeWorld = Callable[..., Awaitable[World]]


@pytest.fixture(name="make_world")
async def _make_world() -> AsyncIterator[MakeWorld]:
    async def make(failure_hold: FailureHold = "auto", on_failure: OnFailure = "report") -> World:
        exit_codes = {"check-live": 1, "check-start": 0}
        return await stack.enter_async_context(
            manager_world(_rules(), exit_codes, failure_hold=failure_hold, on_failure=on_failure)
        )

    async with contextlib.AsyncExitStack() as stack:
        yield make


async def test_report_mode_liveness_keeps_probing_and_publishes_the_recovery(
    make_world: MakeWorld,
) -> None:
    world: World = await make_world()
    app = await world.start()
    live = ProbeKind.LIVENESS
    await world.watcher.until(lambda: world.published(app.id, live) is Published.FAILURE, 10)
    failing = world.state(app.id, live)
    assert (failing.on_hold, failing.hold, failing.holds_failures) == (False, "", False)
    # It goes on counting the failures after the one that published.
    await world.watcher.until(lambda: world.state(app.id, live).consecutive_failures >= 3, 10)

    world.exit_codes["check-live"] = 0  # the container recovers in place (same ID)
    await world.watcher.until(lambda: world.published(app.id, live) is Published.SUCCESS, 10)
    changes = [
        (t.previous, t.result, t.reason) for t in world.watcher.transitions if t.kind is live
    ]
    assert changes[-2:] == [
        (Published.SUCCESS, Published.FAILURE, Reason.EXIT_CODE),
        (Published.FAILURE, Published.SUCCESS, Reason.OK),
    ]
    world.manager.probe_now(app.id, live)  # a running probe can be triggered


async def test_always_holds_as_the_kubelet_does_and_every_surface_says_so(
    make_world: MakeWorld,
) -> None:
    world: World = await make_world("always")
    app = await world.start()
    live = ProbeKind.LIVENESS
    await world.watcher.until(lambda: world.state(app.id, live).on_hold, 10)
    held = world.state(app.id, live)
    assert held.published is Published.FAILURE
    assert held.hold == "on hold until the container restarts"
    # The failures that led to the hold, not the kubelet's reset run (it showed 0).
    assert (held.consecutive_failures, held.threshold) == (2, 2)
    status = probe_status_pb(held, detail=False)
    assert (status.hold, status.consecutive_failures, status.threshold) == (held.hold, 2, 2)
    assert (status.last_attempt.held, status.last_attempt.changed) == (True, True)
    assert (status.last_attempt.run, status.last_attempt.threshold) == (2, 2)
    assert status.last_attempt.reason == Reason.EXIT_CODE
    [transition] = [
        t for t in world.watcher.transitions if t.kind is live and t.result is Published.FAILURE
    ]
    assert (transition.held, transition.threshold, transition.reason) == (True, 2, "exit-code")

    with pytest.raises(ProbeOnHold, match="on hold until the container restarts"):
        world.manager.probe_now(app.id, live)
    # A startup probe that passed runs no more either, and says why.
    assert world.state(app.id, ProbeKind.STARTUP).hold == "passed"
    with pytest.raises(ProbeOnHold, match="passed"):
        world.manager.probe_now(app.id, ProbeKind.STARTUP)


async def test_report_mode_startup_failure_keeps_probing_until_it_passes(
    make_world: MakeWorld,
) -> None:
    world: World = await make_world()
    world.exit_codes["check-start"] = 1
    app = await world.start()
    start = ProbeKind.STARTUP
    await world.watcher.until(lambda: world.published(app.id, start) is Published.FAILURE, 10)
    assert not world.state(app.id, start).on_hold
    world.exit_codes["check-start"] = 0
    await world.watcher.until(lambda: world.published(app.id, start) is Published.SUCCESS, 10)
    assert world.state(app.id, start).hold == "passed"


@pytest.mark.parametrize(
    ("failure_hold", "on_failure", "origin", "holds"),
    [
        ("auto", "report", "rules", False),
        ("auto", "report", "annotation", False),
        ("auto", "report", "pod-spec", True),  # the kubelet acts on its own spec's probe
        ("auto", "stop", "rules", True),  # cri-prober stops the container
        ("always", "report", "rules", True),
    ],
)
async def test_who_holds(
    make_world: MakeWorld, failure_hold: str, on_failure: str, origin: str, holds: bool
) -> None:
    world: World = await make_world(failure_hold, on_failure)
    probe = _rules().probes[0].liveness_probe
    assert probe is not None
    assert world.manager.holds_failures(ResolvedProbe(probe, {}, origin=origin)) is holds  # type: ignore[arg-type]


async def test_in_stop_mode_the_transition_says_it_stops_the_container(
    make_world: MakeWorld,
) -> None:
    world = await make_world("auto", "stop")
    app = await world.start()
    live = ProbeKind.LIVENESS

    def failures() -> list[tuple[bool, bool, str]]:
        return [
            (t.held, t.stop_requested, t.reason)
            for t in world.watcher.transitions
            if t.kind is live and t.result is Published.FAILURE
        ]

    await world.watcher.until(lambda: bool(failures()), 10)
    assert failures()[0] == (True, True, Reason.EXIT_CODE)
    # And the manager acts on it: one StopContainer for that container.
    await asyncio.wait_for(world.runtime.container_stopped.wait(), HANG_GUARD)
    assert [stop[0] for stop in world.runtime.stop_requests] == [app.id]


# -- issue 34 (9): an exit is always published ---------------------------------------------------

LIVENESS_ONLY = """
probes:
  - match: {container: app}
    livenessProbe: {exec: {command: [check-live]}, periodSeconds: 1, failureThreshold: 1}
"""


async def test_an_exit_while_liveness_is_held_publishes_not_started_and_not_ready() -> None:
    """A held liveness probe runs nothing, so no worker publishes the container's exit; the
    kubelet derives ready and started from the container's state and reports both false at
    once. cri-prober used to leave its gauges at 1 and its watch silent for the whole restart
    back-off (9.4 minutes measured); now the exit is published on every surface."""
    async with manager_world(
        load_rules(LIVENESS_ONLY, source="rules.yaml"), {"check-live": 1}, failure_hold="always"
    ) as world:
        metrics = Metrics()
        log = TransitionLog()

        def record(event: ManagerEvent) -> None:  # what the API server does for `watch`
            if isinstance(event, ResultChanged):
                log.record(event)

        stops = [
            world.manager.events.subscribe(metrics.manager_event),
            world.manager.events.subscribe(record),
        ]
        app = await world.start()
        live = ProbeKind.LIVENESS
        await world.watcher.until(lambda: world.state(app.id, live).on_hold, 10)
        held = world.watcher.transitions[-1]
        assert (held.result, held.held, held.health.started, held.health.ready) == (
            Published.FAILURE,
            True,
            True,
            True,
        )
        assert _gauge(metrics, "cri_prober_container_ready") == 1.0
        counted = _transitions_counted(metrics)

        world.runtime.exit_container(app.id, 137)  # the kubelet's kill (or a crash)
        events = await world.discovery.relist()
        world.manager.on_lifecycle(events, world.discovery.containers().values())

        exited = world.watcher.transitions[-1]
        assert exited.container.id == app.id
        assert (exited.health.running, exited.health.started, exited.health.ready) == (
            False,
            False,
            False,
        )
        # The held probe's result stands (the kubelet's does too): the transition restates it.
        assert (exited.kind, exited.previous, exited.result, exited.reason) == (
            live,
            Published.FAILURE,
            Published.FAILURE,
            Reason.NOT_RUNNING,
        )
        assert _gauge(metrics, "cri_prober_container_ready") == 0.0
        assert _gauge(metrics, "cri_prober_container_started") == 0.0
        assert _transitions_counted(metrics) == counted  # a restatement is no transition
        [watched] = [t for t in _buffered(log) if t.container_id == app.id][-1:]
        assert (watched.started, watched.ready, watched.reason) == (False, False, "not-running")
        assert world.state(app.id, live).on_hold  # still held until the new container
        # Published once: another relist of the same exited container says nothing more.
        seen = len(world.watcher.transitions)
        events = await world.discovery.relist()
        world.manager.on_lifecycle(events, world.discovery.containers().values())
        assert len(world.watcher.transitions) == seen
        for stop in stops:
            stop()


def _gauge(metrics: Metrics, name: str) -> float:
    """The value of gauge ``name`` for container ``app`` (whatever its pod's UID)."""
    [value] = [
        sample.value
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name == name and sample.labels["container"] == "app"
    ]
    return value


def _transitions_counted(metrics: Metrics) -> float:
    return sum(
        sample.value
        for family in metrics.registry.collect()
        if family.name == "cri_prober_probe_transitions"
        for sample in family.samples
        if sample.name.endswith("_total")
    )


def _buffered(log: TransitionLog) -> list[Transition]:
    return log._after(0)  # what a `watch --since 0` replays
