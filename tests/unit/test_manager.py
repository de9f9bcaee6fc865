"""The probe manager on the in-process fake runtime: reconciling, restarts, reloads, stop, scale."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

import pytest
import structlog

from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.discovery.pleg import Discovery
from cri_prober.manager.probe_manager import ProbeManager, grace_period
from cri_prober.manager.state import ProbeState
from cri_prober.probing.prober import Prober
from cri_prober.probing.results import Published
from cri_prober.probing.spec import ProbeKind, RulesFile, load_rules, parse_probe
from cri_prober.runtime.client import CriClient
from tests.support.fake_runtime import FakeContainer, FakeRuntime
from tests.support.memory_cri import memory_client
from tests.support.waiting import HANG_GUARD, until
from tests.support.watchers import ManagerWatcher

RULES = """
probes:
  - match: {namespace: shop, container: app}
    livenessProbe: {exec: {command: [check-live]}, periodSeconds: 1, failureThreshold: 1}
    readinessProbe: {exec: {command: [check-ready]}, periodSeconds: 1}
"""


ANNOTATION = "probes.cri-prober.io/"


def rules(text: str = RULES) -> RulesFile:
    return load_rules(text, source="rules.yaml")


class World:
    """A fake runtime, a discovery over it and a manager reconciled after every relist."""

    def __init__(self, runtime: FakeRuntime, cri: CriClient, manager: ProbeManager) -> None:
        self.runtime = runtime
        self.cri = cri
        self.discovery = Discovery(cri)
        self.manager = manager
        self.watcher = ManagerWatcher(manager)
        self.exec_results: dict[str, int] = {}  # container name -> exit code

    async def relist(self) -> None:
        events = await self.discovery.relist()
        self.manager.on_lifecycle(events, self.discovery.containers().values())

    def probe(self, container_id: str, kind: ProbeKind) -> ProbeState:
        """The container's configured ``kind`` probe as it stands now."""
        [state] = [p for p in self.manager.probe_states(container_id) if p.kind is kind]
        return state

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Wait until ``predicate`` holds, re-checking after every probe the manager reports."""
        await self.watcher.until(predicate, timeout)


@pytest.fixture(name="world")
async def _world() -> AsyncIterator[World]:
    exit_codes: dict[str, int] = {}

    async def exec_handler(
        container: FakeContainer, _cmd: list[str], _timeout: int
    ) -> api_pb2.ExecSyncResponse:
        return api_pb2.ExecSyncResponse(exit_code=exit_codes.get(container.name, 0))

    runtime = FakeRuntime(exec_handler=exec_handler)
    async with memory_client(runtime) as cri:
        manager = ProbeManager(
            prober=Prober(cri),
            rules=rules(),
            prober_started_at=0,  # long ago: no start-up jitter, workers probe at once
            on_failure="stop",
            stopper=cri,
        )
        world = World(runtime, cri, manager)
        world.exec_results = exit_codes
        yield world
        await manager.shutdown(grace=2)


async def test_workers_follow_containers(world: World) -> None:
    """A matching container gets one worker per configured kind; removal stops them."""
    sandbox = world.runtime.add_sandbox("web", namespace="shop")
    app = world.runtime.add_container(sandbox, "app")
    world.runtime.add_container(sandbox, "sidecar")  # matches no rule
    await world.relist()
    [probed] = world.manager.probed()
    assert probed.label == "shop/web/app"
    assert [p.kind for p in probed.probes if p.active] == [ProbeKind.LIVENESS, ProbeKind.READINESS]
    await world.wait_for(
        lambda: world.manager.results.get(app.id, ProbeKind.READINESS) is Published.SUCCESS
    )
    assert world.manager.container_health(probed.container).serving

    world.runtime.remove_sandbox(sandbox.id)
    await world.relist()
    assert world.manager.probed() == []
    assert world.manager.worker_count() == 0
    # Each stopped worker ends on its own and forgets its results.
    await world.wait_for(lambda: len(world.watcher.stopped) == 2, HANG_GUARD)
    assert len(world.manager.results) == 0


async def test_restarted_container_gets_fresh_state(world: World) -> None:
    """A new attempt (new ID, same pod and name) is adopted by the same worker, reset to initial."""
    sandbox = world.runtime.add_sandbox("web", namespace="shop")
    old = world.runtime.add_container(sandbox, "app")
    world.exec_results["app"] = 1
    await world.relist()
    await world.wait_for(lambda: world.probe(old.id, ProbeKind.LIVENESS).on_hold)  # failed
    assert world.manager.results.get(old.id, ProbeKind.LIVENESS) is Published.FAILURE
    attempts_before = world.probe(old.id, ProbeKind.LIVENESS).attempts

    world.exec_results["app"] = 0
    new = world.runtime.add_container(sandbox, "app", attempt=1)
    await world.relist()
    [probed] = world.manager.probed()
    assert probed.container.id == new.id
    assert world.manager.probe_states(old.id) == ()  # only the newest attempt is shown
    # The same worker goes on (no worker stopped), adopts the new container and leaves hold.
    await world.wait_for(lambda: world.probe(new.id, ProbeKind.LIVENESS).attempts > attempts_before)
    liveness = world.probe(new.id, ProbeKind.LIVENESS)
    assert not liveness.on_hold
    assert liveness.last_record is not None
    assert liveness.last_record.container_id == new.id
    assert world.manager.results.get(new.id, ProbeKind.LIVENESS) is Published.SUCCESS
    assert world.watcher.stopped == []
    assert world.manager.results.get(old.id, ProbeKind.LIVENESS) is None
    new_updates = [u for u in world.watcher.transitions if u.container.id == new.id]
    assert (new_updates[0].kind, new_updates[0].result) in {
        (ProbeKind.LIVENESS, Published.SUCCESS),
        (ProbeKind.READINESS, Published.FAILURE),
    }


async def test_liveness_failure_stops_container_with_grace(world: World) -> None:
    """--on-failure stop: a published liveness failure calls StopContainer with the grace rule."""
    sandbox = world.runtime.add_sandbox("web", namespace="shop")
    app = world.runtime.add_container(
        sandbox, "app", annotations={"io.kubernetes.pod.terminationGracePeriod": "7"}
    )
    world.exec_results["app"] = 1
    await world.relist()
    await asyncio.wait_for(world.runtime.container_stopped.wait(), HANG_GUARD)
    assert world.runtime.stop_requests == [(app.id, 7)]
    assert world.runtime.containers[app.id].state == api_pb2.CONTAINER_EXITED


async def test_report_mode_never_stops(world: World) -> None:
    """--on-failure report: a liveness failure is published but the container keeps running."""
    world.manager.on_failure = "report"
    sandbox = world.runtime.add_sandbox("web", namespace="shop")
    app = world.runtime.add_container(sandbox, "app")
    world.exec_results["app"] = 1
    await world.relist()
    await world.wait_for(
        lambda: world.manager.results.get(app.id, ProbeKind.LIVENESS) is Published.FAILURE
    )
    assert "StopContainer" not in world.runtime.calls
    assert world.runtime.containers[app.id].state == api_pb2.CONTAINER_RUNNING


async def test_reload_keeps_unchanged_workers(world: World) -> None:
    """set_rules: unchanged probes keep worker, task and counters; changed restart; removed stop."""
    sandbox = world.runtime.add_sandbox("web", namespace="shop")
    world.runtime.add_container(sandbox, "app")
    await world.relist()
    [probed] = world.manager.probed()
    app = probed.container.id
    await world.wait_for(lambda: world.probe(app, ProbeKind.LIVENESS).attempts >= 2)
    runs = world.probe(app, ProbeKind.LIVENESS).attempts

    changed = """
probes:
  - match: {namespace: shop, container: app}
    livenessProbe: {exec: {command: [check-live]}, periodSeconds: 1, failureThreshold: 1}
    startupProbe: {exec: {command: [check-start]}, periodSeconds: 2}
"""
    world.manager.set_rules(rules(changed), world.discovery.containers().values())
    # Liveness is unchanged: its worker goes on with its counters. Readiness went: its worker
    # stops. Startup is new.
    assert [p.kind for p in world.manager.probe_states(app)] == [
        ProbeKind.LIVENESS,
        ProbeKind.STARTUP,
    ]
    assert world.probe(app, ProbeKind.LIVENESS).attempts >= runs
    await world.wait_for(lambda: len(world.watcher.stopped) == 1)
    [stopped] = world.watcher.stopped
    assert (stopped.kind, stopped.replaced) == (ProbeKind.READINESS, False)
    assert world.probe(app, ProbeKind.STARTUP).active

    # Same kind, different spec: a new worker, with new counters; the old one stops.
    world.manager.set_rules(
        rules(changed.replace("failureThreshold: 1", "failureThreshold: 2")),
        world.discovery.containers().values(),
    )
    assert world.probe(app, ProbeKind.LIVENESS).attempts == 0
    await world.wait_for(lambda: len(world.watcher.stopped) == 2)
    assert (world.watcher.stopped[1].kind, world.watcher.stopped[1].replaced) == (
        ProbeKind.LIVENESS,
        True,
    )


async def test_annotation_overrides_file_and_bad_one_is_ignored(world: World) -> None:
    """The pod annotation replaces the file's probe for that container; a bad one is skipped."""
    override = {"readinessProbe": {"exec": {"command": ["x"]}, "periodSeconds": 5}}
    good = world.runtime.add_sandbox(
        "good", namespace="shop", annotations={"probes.cri-prober.io/app": json.dumps(override)}
    )
    bad = world.runtime.add_sandbox(
        "bad", namespace="shop", annotations={"probes.cri-prober.io/app": '{"readinessProbe": 1}'}
    )
    world.runtime.add_container(good, "app")
    world.runtime.add_container(bad, "app")
    await world.relist()
    by_pod = {p.container.pod.name: p for p in world.manager.probed()}
    good_probe = by_pod["good"].probe(ProbeKind.READINESS)
    bad_probe = by_pod["bad"].probe(ProbeKind.READINESS)
    assert good_probe is not None
    assert good_probe.probe.period_seconds == 5
    assert bad_probe is not None
    assert bad_probe.probe.period_seconds == 1


async def test_override_cache_follows_the_node(world: World) -> None:
    """Parsed annotations are kept only for containers on the node now. A pod whose bad
    annotation gave it no probe never gets a slot, and its entry (with the annotation's text)
    used to stay forever: the churn leak of issue 15."""
    bad = '{"readinessProbe": {"tcpSocket": {"port": "' + "x" * 5000 + '"}}}'
    good = json.dumps({"readinessProbe": {"exec": {"command": ["x"]}, "periodSeconds": 600}})
    sandboxes = [
        # shop/app matches a rule: a slot. elsewhere/* matches none: no slot for the bad one.
        world.runtime.add_sandbox("a", namespace="shop", annotations={ANNOTATION + "app": good}),
        world.runtime.add_sandbox(
            "b", namespace="elsewhere", annotations={ANNOTATION + "app": bad}
        ),
        world.runtime.add_sandbox(
            "c", namespace="elsewhere", annotations={ANNOTATION + "app": good}
        ),
    ]
    for sandbox in sandboxes:
        world.runtime.add_container(sandbox, "app")
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            await world.relist()
    assert sorted(p.container.pod.name for p in world.manager.probed()) == ["a", "c"]
    assert world.manager.selection.cached_overrides() == 3
    # Parsed once, refused once: not on every relist.
    [refusal] = [entry for entry in logs if entry["event"] == "bad_probe_annotation"]
    assert len(refusal["error"]) <= 2048 + 1

    world.runtime.remove_sandbox(sandboxes[1].id)  # the slot-less pod leaves
    await world.relist()
    assert world.manager.selection.cached_overrides() == 2
    for sandbox in sandboxes:
        world.runtime.remove_sandbox(sandbox.id)
    await world.relist()
    assert world.manager.selection.cached_overrides() == 0


async def test_scale_two_thousand_containers_no_leaks(world: World) -> None:
    """2,000 containers appear and disappear in batches; no worker or task is left behind."""
    world.manager.rules = rules(RULES.replace("periodSeconds: 1", "periodSeconds: 600"))
    baseline = len(asyncio.all_tasks())
    sandboxes = []
    for batch in range(4):
        for i in range(500):
            sandbox = world.runtime.add_sandbox(f"p{batch}-{i}", namespace="shop")
            world.runtime.add_container(sandbox, "app")
            sandboxes.append(sandbox)
        await world.relist()
        assert world.manager.worker_count() == 2 * 500 * (batch + 1)
    for batch in range(4):
        for sandbox in sandboxes[batch * 500 : (batch + 1) * 500]:
            world.runtime.remove_sandbox(sandbox.id)
        await world.relist()
        assert world.manager.worker_count() == 2 * 500 * (3 - batch)
    assert world.manager.probed() == []
    await world.wait_for(lambda: len(world.watcher.stopped) == 2 * 2000, HANG_GUARD)
    # The pod resync clock ends at its next tick (1 s) after the last pod left.
    await until(lambda: len(asyncio.all_tasks()) <= baseline, timeout=HANG_GUARD)
    assert len(world.manager.results) == 0


@pytest.mark.parametrize(
    ("probe_grace", "annotation", "expected"),
    [(5, "500", 5), (None, "45", 45), (None, None, 30), (1, None, 2), (None, "junk", 30)],
)
def test_grace_period_rule(probe_grace: int | None, annotation: str | None, expected: int) -> None:
    """§5.3: probe terminationGracePeriodSeconds, else the pod's, else 30; at least 2 s."""
    spec: dict[str, object] = {"exec": {"command": ["x"]}}
    if probe_grace is not None:
        spec["terminationGracePeriodSeconds"] = probe_grace
    probe = parse_probe(spec, kind=ProbeKind.LIVENESS, path="livenessProbe")
    annotations = {"io.kubernetes.pod.terminationGracePeriod": annotation} if annotation else {}
    from cri_prober.probing.spec import ResolvedProbe

    assert grace_period(ResolvedProbe(probe, {}), annotations) == expected


async def test_died_container_publishes_failure_at_once(world: World) -> None:
    """D9: a container that died is re-checked at once, not at its workers' next tick."""
    world.manager.rules = rules(RULES.replace("periodSeconds: 1", "periodSeconds: 600"))
    # A pod older than the prober: its workers probe at once instead of joining the pod's grid.
    world.manager.prober_started_at = time.time() - 1000
    sandbox = world.runtime.add_sandbox("web", namespace="shop")
    sandbox.created_at = time.time_ns() - 2000 * 10**9
    app = world.runtime.add_container(sandbox, "app")
    await world.relist()
    await world.wait_for(lambda: all(p.attempts == 1 for p in world.manager.probe_states(app.id)))
    world.runtime.exit_container(app.id, exit_code=1)
    await world.relist()
    # Period 600 s: only the trigger on `died` can publish within the timeout.
    await world.wait_for(
        lambda: (
            world.manager.results.get(app.id, ProbeKind.LIVENESS) is Published.FAILURE
            and world.manager.results.get(app.id, ProbeKind.READINESS) is Published.FAILURE
        ),
        timeout=5,
    )


async def test_first_relist_trigger_waits_for_the_jitter(world: World) -> None:
    """Containers found at start keep their jittered first probe: the sync's readiness trigger
    stays pending until the worker's first step, like the kubelet's buffered trigger."""
    world.manager.prober_started_at = time.time()  # the prober just started: jitter applies
    world.manager.rules = rules(RULES.replace("periodSeconds: 1", "periodSeconds: 600"))
    sandbox = world.runtime.add_sandbox("web", namespace="shop")
    world.runtime.add_container(sandbox, "app")
    await world.relist()
    [probed] = world.manager.probed()
    for _ in range(20):  # let the requested pod sync and any wrongly woken worker run
        await asyncio.sleep(0)
    readiness = world.probe(probed.container.id, ProbeKind.READINESS)
    assert readiness.published is None  # not even its first step (the initial value) ran
    assert readiness.attempts == 0
    assert world.watcher.records == []
