"""The probe manager on the in-process fake runtime: reconciling, restarts, reloads, stop, scale."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import structlog

from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.discovery.pleg import Discovery
from cri_prober.manager.probe_manager import ProbeManager, grace_period
from cri_prober.probing.prober import Prober
from cri_prober.probing.results import Published, ResultUpdate
from cri_prober.probing.spec import ProbeKind, RulesFile, load_rules, parse_probe
from cri_prober.runtime.client import CriClient
from tests.support.fake_runtime import FakeContainer, FakeRuntime, FakeRuntimeServer
from tests.support.waiting import until
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
        self.updates: list[ResultUpdate] = []
        manager.results.subscribe(self.updates.append)
        self.watcher = ManagerWatcher(manager)
        self.exec_results: dict[str, int] = {}  # container name -> exit code

    async def relist(self) -> None:
        events = await self.discovery.relist()
        self.manager.on_lifecycle(events, self.discovery.containers().values())

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Wait until ``predicate`` holds, re-checking after every probe the manager reports."""
        await self.watcher.until(predicate, timeout)


@pytest.fixture(name="world")
async def _world(tmp_path: Path) -> AsyncIterator[World]:
    exit_codes: dict[str, int] = {}

    async def exec_handler(
        container: FakeContainer, _cmd: list[str], _timeout: int
    ) -> api_pb2.ExecSyncResponse:
        return api_pb2.ExecSyncResponse(exit_code=exit_codes.get(container.name, 0))

    runtime = FakeRuntime(exec_handler=exec_handler)
    async with (
        FakeRuntimeServer(str(tmp_path / "cri.sock"), runtime) as server,
        CriClient.connect(server.target) as cri,
    ):
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
    [slot] = world.manager.slots()
    assert slot.label == "shop/web/app"
    assert set(slot.workers) == {ProbeKind.LIVENESS, ProbeKind.READINESS}
    await world.wait_for(
        lambda: world.manager.results.get(app.id, ProbeKind.READINESS) is Published.SUCCESS
    )
    assert world.manager.health(slot).serving

    tasks = list(slot.tasks.values())
    world.runtime.remove_sandbox(sandbox.id)
    await world.relist()
    assert world.manager.slots() == []
    assert world.manager.worker_count() == 0
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert len(world.manager.results) == 0


async def test_restarted_container_gets_fresh_state(world: World) -> None:
    """A new attempt (new ID, same pod and name) is adopted by the same worker, reset to initial."""
    sandbox = world.runtime.add_sandbox("web", namespace="shop")
    old = world.runtime.add_container(sandbox, "app")
    world.exec_results["app"] = 1
    await world.relist()
    [slot] = world.manager.slots()
    liveness = slot.workers[ProbeKind.LIVENESS]
    await world.wait_for(lambda: liveness.on_hold)  # failed liveness: on hold
    assert world.manager.results.get(old.id, ProbeKind.LIVENESS) is Published.FAILURE

    world.exec_results["app"] = 0
    new = world.runtime.add_container(sandbox, "app", attempt=1)
    await world.relist()
    assert slot.container.id == new.id
    assert slot.workers[ProbeKind.LIVENESS] is liveness
    await world.wait_for(lambda: liveness.container_id == new.id and not liveness.on_hold)
    assert world.manager.results.get(old.id, ProbeKind.LIVENESS) is None
    new_updates = [u for u in world.updates if u.container_id == new.id]
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
    await asyncio.wait_for(world.runtime.container_stopped.wait(), 10)
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
    [slot] = world.manager.slots()
    liveness, readiness = slot.workers[ProbeKind.LIVENESS], slot.workers[ProbeKind.READINESS]
    liveness_task = slot.tasks[ProbeKind.LIVENESS]
    await world.wait_for(lambda: liveness.probes_run >= 2)
    runs = liveness.probes_run

    changed = """
probes:
  - match: {namespace: shop, container: app}
    livenessProbe: {exec: {command: [check-live]}, periodSeconds: 1, failureThreshold: 1}
    startupProbe: {exec: {command: [check-start]}, periodSeconds: 2}
"""
    world.manager.set_rules(rules(changed), world.discovery.containers().values())
    assert slot.workers[ProbeKind.LIVENESS] is liveness
    assert slot.tasks[ProbeKind.LIVENESS] is liveness_task
    assert liveness.probes_run >= runs
    assert ProbeKind.READINESS not in slot.workers
    assert readiness.stopped
    assert ProbeKind.STARTUP in slot.workers

    # Same kind, different spec: a new worker.
    world.manager.set_rules(
        rules(changed.replace("failureThreshold: 1", "failureThreshold: 2")),
        world.discovery.containers().values(),
    )
    assert slot.workers[ProbeKind.LIVENESS] is not liveness
    assert liveness.stopped


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
    by_pod = {slot.pod.name: slot for slot in world.manager.slots()}
    assert by_pod["good"].specs[ProbeKind.READINESS].probe.period_seconds == 5
    assert by_pod["bad"].specs[ProbeKind.READINESS].probe.period_seconds == 1


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
    assert sorted(slot.pod.name for slot in world.manager.slots()) == ["a", "c"]
    assert len(world.manager._override_cache) == 3
    # Parsed once, refused once: not on every relist.
    [refusal] = [entry for entry in logs if entry["event"] == "bad_probe_annotation"]
    assert len(refusal["error"]) <= 2048 + 1

    world.runtime.remove_sandbox(sandboxes[1].id)  # the slot-less pod leaves
    await world.relist()
    assert len(world.manager._override_cache) == 2
    for sandbox in sandboxes:
        world.runtime.remove_sandbox(sandbox.id)
    await world.relist()
    assert world.manager._override_cache == {}


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
    tasks = [t for slot in world.manager.slots() for t in slot.tasks.values()]
    for batch in range(4):
        for sandbox in sandboxes[batch * 500 : (batch + 1) * 500]:
            world.runtime.remove_sandbox(sandbox.id)
        await world.relist()
        assert world.manager.worker_count() == 2 * 500 * (3 - batch)
    assert world.manager.slots() == []
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    # The pod resync clock ends at its next tick (1 s) after the last pod left.
    await until(lambda: len(asyncio.all_tasks()) <= baseline, timeout=5)
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
    [slot] = world.manager.slots()
    await world.wait_for(lambda: all(w.probes_run == 1 for w in slot.workers.values()))
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
    [slot] = world.manager.slots()
    readiness = slot.workers[ProbeKind.READINESS]
    for _ in range(20):  # let the requested pod sync and any wrongly woken worker run
        await asyncio.sleep(0)
    assert readiness._trigger_pending or readiness._wakeup is not None
    assert readiness.container_id is None
    assert readiness.probes_run == 0
