"""The liveness hold by failureThreshold, and what lifts it (issue 22).

The report: "in report mode a liveness failure with ``failureThreshold: 1`` is lifted within a
second once the container recovers, with ``failureThreshold: 2`` it stays on hold for ever."

What the worker does (``cri_prober/probing/worker.py``), as the kubelet's ``doProbe`` does
(``pkg/kubelet/prober/worker.go``): a published liveness Failure puts the worker on hold
(step 16, and ``resultRun = 0``); on hold it probes no more (step 6); only a new container ID
lifts the hold (step 5). The threshold is read in one place, step 14, before anything is
published, so it decides *when* the hold starts, never whether it ends:

* a container that recovers in place stays on hold (and Failure), for both thresholds: the
  kubelet's behaviour, which in the kubelet never lasts because it kills the container and the
  restarted one has a new ID (in report mode nothing restarts it: issue 24);
* a new container ID lifts the hold at the next step, for both thresholds;
* for the same observations, threshold 2 never ends up released where threshold 1 is held.

What the report saw is the one path the kubelet does not have (D21 in docs/kubelet-fidelity.md):
changing the threshold is a reload, and a changed spec is a new probe, whose worker starts over
off hold. The tests at the end pin that down, with the transition it shows and the old worker
keeping out of the new one's way.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import pytest

from cri_prober.probing.outcome import ProbeError, ProbeOutcome, ProbeResult
from cri_prober.probing.results import Published, ResultsStore
from cri_prober.probing.spec import ProbeKind, RulesFile, load_rules
from cri_prober.probing.worker import ContainerView, ProbeWorker
from tests.support.clock import WALL0, WorkerClock
from tests.support.manager_world import World, manager_world
from tests.support.waiting import HANG_GUARD
from tests.support.worker_reports import WorkerReports

OK = ProbeOutcome(ProbeResult.SUCCESS, "ok")
BAD = ProbeOutcome(ProbeResult.FAILURE, "bad")
ERROR = ProbeError("could not run")
# An attempt's outcome by observation; the others are container views (attempt: success).
OUTCOMES: dict[str, ProbeOutcome | ProbeError] = {"ok": OK, "bad": BAD, "error": ERROR}


@dataclass(frozen=True)
class Timing:
    initial_delay_seconds: int = 0
    period_seconds: int = 10
    success_threshold: int = 1
    failure_threshold: int = 1


class Liveness:
    """A liveness worker on a fake container whose next attempt's outcome the test sets."""

    def __init__(self, failure_threshold: int) -> None:
        self.clock = WorkerClock()
        self.view = ContainerView(id="c1", running=True, started_at=WALL0 - 100, started=True)
        self.outcome: ProbeOutcome | ProbeError = OK
        self.probe_calls = 0
        self.results = ResultsStore()
        self.worker = ProbeWorker(
            ProbeKind.LIVENESS,
            Timing(failure_threshold=failure_threshold),
            status=lambda: self.view,
            run_probe=self._run_probe,
            results=self.results,
            prober_started_at=WALL0 - 3600,  # long ago: no KEP-4781 adoption
            clock=self.clock,
            rng=random.Random(1),
        )

    async def _run_probe(self, _view: ContainerView) -> ProbeOutcome:
        self.probe_calls += 1
        if isinstance(self.outcome, ProbeError):
            raise self.outcome
        return self.outcome

    @property
    def published(self) -> Published | None:
        return self.results.get(self.view.id, ProbeKind.LIVENESS)

    async def tick(self, outcome: ProbeOutcome | ProbeError | None = None) -> None:
        """One period: one step, with ``outcome`` for its attempt (if it makes one)."""
        if outcome is not None:
            self.outcome = outcome
        self.clock.now += 10
        assert await self.worker.step()


@pytest.mark.parametrize("threshold", [1, 2])
async def test_recovering_in_place_stays_on_hold_for_ever(threshold: int) -> None:
    """Kubelet-identical: after the published Failure the worker probes no more, so a
    container that recovers under the same ID keeps its Failure, whatever the threshold."""
    h = Liveness(threshold)
    await h.tick(OK)
    assert h.results.get("c1", ProbeKind.LIVENESS) is Published.SUCCESS
    for _ in range(threshold):
        await h.tick(BAD)
    assert h.published is Published.FAILURE
    assert (h.worker.on_hold, h.worker.result_run) == (True, 0)
    calls = h.probe_calls
    for _ in range(100):  # the container recovered: 100 periods of would-be successes
        await h.tick(OK)
    assert h.probe_calls == calls  # step 6: never probed again
    # The report says threshold 1 is lifted: here it is not, for either threshold.
    assert h.published is Published.FAILURE
    assert h.worker.on_hold


@pytest.mark.parametrize("threshold", [1, 2])
async def test_a_new_container_id_lifts_the_hold_at_the_next_step(threshold: int) -> None:
    """Step 5: a new ID (the kubelet's restart, or any replacement) publishes the initial
    Success and leaves the hold; the recovered container then probes Success."""
    h = Liveness(threshold)
    for _ in range(threshold):
        await h.tick(BAD)
    assert h.worker.on_hold
    h.view = replace(h.view, id="c2")
    await h.tick(OK)
    assert h.results.get("c1", ProbeKind.LIVENESS) is None
    assert h.published is Published.SUCCESS
    assert not h.worker.on_hold
    assert h.worker.result_run == 1  # lastResult was Failure (§3.4): a new run of one


def _observations(rng: random.Random, length: int) -> list[str]:
    return rng.choices(["ok", "bad", "error", "not-running", "new-id"], k=length)


async def test_for_the_same_observations_threshold_2_is_never_released_where_1_is_held() -> None:
    """The threshold only moves the hold earlier: on the same container views and attempt
    outcomes, whenever threshold 2 is on hold (or publishes Failure) so is threshold 1. A
    threshold-1 worker released while a threshold-2 one stays held cannot come from the worker."""
    rng = random.Random(20261126)
    both_held = only_one_held = 0
    for _ in range(300):
        one, two = Liveness(1), Liveness(2)
        containers = 1
        for observation in _observations(rng, 30):
            for h in (one, two):
                if observation == "new-id":
                    h.view = replace(h.view, id=f"c{containers + 1}", running=True)
                elif observation == "not-running":
                    h.view = replace(h.view, running=False)
                else:
                    h.view = replace(h.view, running=True)
                await h.tick(OUTCOMES.get(observation, OK))
            if observation == "new-id":
                containers += 1
            if two.worker.on_hold:
                assert one.worker.on_hold
                both_held += 1
            elif one.worker.on_hold:
                only_one_held += 1
            if two.published is Published.FAILURE:
                assert one.published is Published.FAILURE
    # Not vacuous: both kinds of moment happened many times.
    assert both_held > 100
    assert only_one_held > 100


# -- through the manager: the one lift cri-prober has and the kubelet does not -------------------

RULES = """
probes:
  - match: {{container: app}}
    livenessProbe: {{exec: {{command: [check-live]}}, periodSeconds: 1, failureThreshold: {}}}
"""


def _rules(threshold: int) -> RulesFile:
    return load_rules(RULES.format(threshold), source="rules.yaml")


@pytest.fixture(name="world")
async def _world() -> AsyncIterator[World]:
    # The liveness command fails until the test says otherwise; the kubelet's hold
    # (test_failure_hold.py has "auto").
    async with manager_world(_rules(2), {"check-live": 1}, failure_hold="always") as world:
        yield world


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
async def test_a_reload_that_changes_the_spec_starts_the_probe_over(
    world: World, before: int, after: int
) -> None:
    """D21: a rules change replaces the worker (``set_rules``: "changed ones restart"); the new
    one starts off hold for the same container, and its first publish is a transition from the
    old worker's Failure (not from nothing), then it probes. The kubelet has no such path: a
    pod's probe specs never change."""
    world.manager.set_rules(_rules(before), [])
    app = await world.start()
    live = ProbeKind.LIVENESS
    await world.watcher.until(lambda: world.state(app.id, live).on_hold, timeout=HANG_GUARD)
    assert world.published(app.id, live) is Published.FAILURE
    attempts = world.state(app.id, live).attempts
    assert attempts == before

    world.exit_codes["check-live"] = 0  # the container recovers in place (same ID)
    mark = len(world.watcher.transitions)
    world.manager.set_rules(_rules(after), world.discovery.containers().values())
    # The old verdict stays published until the new worker's first step replaces it.
    assert world.published(app.id, live) is Published.FAILURE
    replacement = world.state(app.id, live)
    assert (replacement.on_hold, replacement.attempts) == (False, 0)  # a new probe
    await world.watcher.until(lambda: world.state(app.id, live).attempts >= 1, timeout=HANG_GUARD)
    assert not world.state(app.id, live).on_hold
    assert world.published(app.id, live) is Published.SUCCESS
    changes = [(t.previous, t.result) for t in world.watcher.transitions[mark:]]
    assert changes == [(Published.FAILURE, Published.SUCCESS)]
    # The old worker ended without taking the new result away.
    await world.watcher.until(lambda: len(world.watcher.stopped) == 1, timeout=HANG_GUARD)
    assert world.published(app.id, live) is Published.SUCCESS


async def test_a_replaced_workers_attempt_in_progress_publishes_nothing() -> None:
    """A worker stopped for a successor (``stop(handover=True)``) mid-attempt: the attempt's
    verdict is not published, and its exit leaves the result to the successor."""
    results = ResultsStore()
    reports = WorkerReports()
    started, finish = asyncio.Event(), asyncio.Event()

    async def slow_failure(_view: ContainerView) -> ProbeOutcome:
        started.set()
        await finish.wait()
        return BAD

    view = ContainerView(id="c1", running=True, started_at=WALL0 - 100, started=True)
    old = ProbeWorker(
        ProbeKind.LIVENESS,
        Timing(failure_threshold=1),
        status=lambda: view,
        run_probe=slow_failure,
        results=results,
        prober_started_at=WALL0 - 3600,
        clock=WorkerClock(),
        observer=reports,
    )
    step = asyncio.create_task(old.step())
    await started.wait()
    assert results.get("c1", ProbeKind.LIVENESS) is Published.SUCCESS  # its initial value
    old.stop(handover=True)
    results.set("c1", ProbeKind.LIVENESS, Published.SUCCESS)  # what the successor published
    finish.set()
    assert await step
    assert results.get("c1", ProbeKind.LIVENESS) is Published.SUCCESS
    assert [(u.previous, u.result) for u in reports.updates] == [(None, Published.SUCCESS)]
    assert [r.result for r in reports.attempts] == ["failure"]  # the attempt is still recorded
    await old.run()  # stopped: it exits at once and cleans up
    assert results.get("c1", ProbeKind.LIVENESS) is Published.SUCCESS
