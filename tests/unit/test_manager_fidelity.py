"""Issue #12 divergences the probe manager decides, on the in-process fake runtime.

Each test names its row of the issue's table (D5, D6, D9, D10, D13, D19) and fails on the
behaviour cri-prober had before.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.discovery.pleg import Discovery
from cri_prober.manager.memory import Remembered
from cri_prober.manager.probe_manager import ProbeManager, kill_grace
from cri_prober.manager.slots import SlotKey, SlotTable
from cri_prober.manager.state import ProbeState
from cri_prober.manager.status import StatusModel
from cri_prober.probing import worker as worker_module
from cri_prober.probing.prober import Prober
from cri_prober.probing.results import Published, ResultsStore
from cri_prober.probing.spec import ProbeKind, load_rules, parse_probe
from cri_prober.runtime.client import CriClient
from tests.support.fake_runtime import (
    FakeContainer,
    FakeRuntime,
    FakeSandbox,
)
from tests.support.memory_cri import memory_client
from tests.support.waiting import HANG_GUARD
from tests.support.watchers import ManagerWatcher

RULES = """
probes:
  - match: {namespace: shop, container: app}
    livenessProbe: {exec: {command: [check-live]}, periodSeconds: 600, failureThreshold: 1}
    readinessProbe: {exec: {command: [check-ready]}, periodSeconds: 600}
    startupProbe: {exec: {command: [check-start]}, periodSeconds: 600}
"""
HOUR_NS = 3600 * 10**9


@dataclass
class Node:
    """A fake runtime whose exec calls are recorded, a discovery and a manager over it."""

    runtime: FakeRuntime
    cri: CriClient
    discovery: Discovery
    manager: ProbeManager
    exit_codes: dict[str, int] = field(default_factory=dict)  # command -> exit code
    execs: list[tuple[str, list[str], float]] = field(default_factory=list)
    exec_seconds: dict[str, float] = field(default_factory=dict)  # command -> how long it runs
    watcher: ManagerWatcher = field(init=False)

    def __post_init__(self) -> None:
        self.watcher = ManagerWatcher(self.manager)

    async def relist(self) -> None:
        events = await self.discovery.relist()
        self.manager.on_lifecycle(events, self.discovery.containers().values())

    def old_pod(self, name: str) -> FakeSandbox:
        """A sandbox created an hour ago, before the prober started (no admission grid)."""
        sandbox = self.runtime.add_sandbox(name, namespace="shop")
        sandbox.created_at = time.time_ns() - HOUR_NS
        return sandbox


@pytest.fixture(name="node")
async def _node() -> AsyncIterator[Node]:
    holder: list[Node] = []

    async def exec_handler(
        container: FakeContainer, cmd: list[str], _timeout: int
    ) -> api_pb2.ExecSyncResponse:
        node = holder[0]
        node.execs.append((container.id, cmd, time.monotonic()))
        await asyncio.sleep(node.exec_seconds.get(cmd[0], 0))
        return api_pb2.ExecSyncResponse(exit_code=node.exit_codes.get(cmd[0], 0))

    runtime = FakeRuntime(exec_handler=exec_handler)
    async with memory_client(runtime) as cri:
        manager = ProbeManager(
            prober=Prober(cri),
            rules=load_rules(RULES, source="rules.yaml"),
            prober_started_at=time.time() - 1800,  # half an hour ago: no start-up jitter
            on_failure="stop",
            stopper=cri,
        )
        holder.append(Node(runtime, cri, Discovery(cri), manager))
        yield holder[0]
        holder[0].watcher.unsubscribe()
        await manager.shutdown(grace=2)


class _NoJitter(random.Random):
    """Every draw is its lower bound."""

    def uniform(self, a: float, b: float) -> float:
        return a


def _probe(node: Node, container_id: str, kind: ProbeKind) -> ProbeState:
    """The container's configured ``kind`` probe as it stands now."""
    [state] = [p for p in node.manager.probe_states(container_id) if p.kind is kind]
    return state


def _attempts(node: Node, container_id: str, kind: ProbeKind) -> int:
    return _probe(node, container_id, kind).attempts


async def test_d19_created_container_publishes_nothing_until_it_runs(node: Node) -> None:
    """D19: a container seen CREATED (events mode sees it before it starts) is not there yet
    for the workers: no liveness/startup Failure is published before it runs."""
    sandbox = node.old_pod("web")
    app = node.runtime.add_container(sandbox, "app", state=api_pb2.CONTAINER_CREATED)
    await node.relist()
    for _ in range(20):
        await asyncio.sleep(0)
    assert {k: node.manager.results.get(app.id, k) for k in ProbeKind} == dict.fromkeys(ProbeKind)
    # It starts: at their next steps the workers adopt it with the initial values (liveness
    # Success, startup Unknown), and the startup probe runs.
    app.state = api_pb2.CONTAINER_RUNNING
    app.started_at = time.time_ns()
    await node.relist()
    node.manager.probe_now(app.id, ProbeKind.LIVENESS)
    node.manager.probe_now(app.id, ProbeKind.STARTUP)
    await node.watcher.until(lambda: _attempts(node, app.id, ProbeKind.STARTUP) >= 1)
    assert node.manager.results.get(app.id, ProbeKind.LIVENESS) is Published.SUCCESS


async def test_d13_started_at_is_whole_seconds(node: Node) -> None:
    """D13: the worker sees StartedAt truncated to whole seconds, as the kubelet's status does."""
    sandbox = node.old_pod("web")
    app = node.runtime.add_container(sandbox, "app")
    app.started_at = 1_700_000_123_987_654_321
    await node.relist()
    # What the workers see, from the manager's read model over the container as discovered.
    [info] = node.discovery.containers().values()
    table = SlotTable()
    slot = table.add(SlotKey.of(info), info)
    table.bind(slot, info)
    view = StatusModel(table, ResultsStore(), prober_started_at=time.time()).view(slot)
    assert view is not None
    assert view.started_at == 1_700_000_123.0


async def test_d10_worker_outlives_a_long_dead_container_while_the_pod_lives(node: Node) -> None:
    """D10: an exited container of a live pod keeps its workers however long it has been dead
    (the kubelet's worker lives as long as the pod); counters survive into the next attempt."""
    sandbox = node.old_pod("web")
    app = node.runtime.add_container(sandbox, "app")
    await node.relist()
    watcher = ManagerWatcher(node.manager)
    await node.watcher.until(lambda: _attempts(node, app.id, ProbeKind.READINESS) >= 1)
    node.runtime.exit_container(app.id)
    app.finished_at = time.time_ns() - HOUR_NS  # dead for an hour (the old limit was 330 s)
    await node.relist()
    await node.watcher.until(
        lambda: node.manager.results.get(app.id, ProbeKind.READINESS) is Published.FAILURE
    )
    node.manager.probe_now(app.id, ProbeKind.READINESS)
    for _ in range(20):
        await asyncio.sleep(0)
    assert _probe(node, app.id, ProbeKind.READINESS).active
    attempts = _attempts(node, app.id, ProbeKind.READINESS)
    new = node.runtime.add_container(sandbox, "app", attempt=1)
    await node.relist()
    assert watcher.stopped == []  # the same workers go on
    assert _attempts(node, new.id, ProbeKind.READINESS) >= attempts


async def test_d10_pod_gone_ends_workers(node: Node) -> None:
    """The workers of an exited container end once its sandbox is down (the pod is over)."""
    sandbox = node.old_pod("web")
    app = node.runtime.add_container(sandbox, "app")
    await node.relist()
    watcher = ManagerWatcher(node.manager)
    node.runtime.exit_container(app.id)
    sandbox.ready = False
    await node.relist()
    await watcher.until(lambda: len(watcher.stopped) == 3, 10)
    assert not any(p.replaced for p in watcher.stopped)
    assert node.manager.worker_count() == 0
    assert not any(p.has_worker for p in node.manager.probe_states(app.id))


@pytest.mark.parametrize(
    ("remembered", "started", "startup_probes"),
    [
        (Remembered(started=False, ready=False), False, True),
        (Remembered(started=True, ready=True), True, False),
        (None, True, False),
    ],
    ids=["was-starting", "was-started", "no-memory"],
)
async def test_d5_adopted_container_keeps_its_previous_started(
    node: Node,
    remembered: Remembered | None,
    started: bool,
    startup_probes: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """D5 (KEP-4781): a container that predates the prober keeps the started flag the previous
    cri-prober left in its state file; one still starting keeps its startup probe gating."""
    # It ran before the prober started, so its workers draw their first step from the period
    # (600 s here): draws of 0 make them probe at once (this test is about adoption).
    monkeypatch.setattr(worker_module, "_SHARED_RNG", _NoJitter())
    sandbox = node.old_pod("web")
    app = node.runtime.add_container(sandbox, "app")
    app.started_at = time.time_ns() - HOUR_NS  # long before the prober started
    if remembered is not None:
        node.manager.status.remembered = {app.id: remembered}
    node.exit_codes["check-start"] = 1  # not up yet: a startup attempt fails (threshold 3)
    await node.relist()
    [probed] = node.manager.probed()
    # Adopted without an initial value (KEP-4781): the health is what was remembered.
    assert node.manager.container_health(probed.container).started is started

    def started_now() -> bool:
        return node.manager.container_health(probed.container).started

    if startup_probes:
        # Still starting: only the startup probe runs; liveness is gated until it passes.
        await node.watcher.until(lambda: _attempts(node, app.id, ProbeKind.STARTUP) == 1)
        assert _attempts(node, app.id, ProbeKind.LIVENESS) == 0
        node.exit_codes["check-start"] = 0
        node.manager.probe_now(app.id, ProbeKind.STARTUP)
        await node.watcher.until(started_now)
    else:
        # Started: the startup worker idles and liveness probes.
        await node.watcher.until(lambda: _attempts(node, app.id, ProbeKind.LIVENESS) == 1)
        assert _attempts(node, app.id, ProbeKind.STARTUP) == 0
        assert started_now()


async def test_d9_no_probe_on_exit_keeps_the_kubelet_timing(node: Node) -> None:
    """D9: with probe_on_exit off, a container's death is published at each worker's next tick,
    not at once (period 600 s: nothing within the wait); on (the default) it is at once."""
    node.manager.probe_on_exit = False
    sandbox = node.old_pod("web")
    app = node.runtime.add_container(sandbox, "app")
    await node.relist()

    def ready(container: FakeContainer) -> bool:
        return node.manager.results.get(container.id, ProbeKind.READINESS) is Published.SUCCESS

    await node.watcher.until(lambda: ready(app))
    node.runtime.exit_container(app.id, exit_code=1)
    await node.relist()
    await asyncio.sleep(0.5)  # an absence: nothing to await
    assert ready(app)
    node.manager.probe_on_exit = True  # the default: published at once
    other = node.runtime.add_container(sandbox, "app", attempt=1)
    await node.relist()
    for kind in ProbeKind:
        node.manager.probe_now(other.id, kind)
    await node.watcher.until(lambda: ready(other))
    node.runtime.exit_container(other.id, exit_code=1)
    await node.relist()
    await node.watcher.until(
        lambda: node.manager.results.get(other.id, ProbeKind.READINESS) is Published.FAILURE
    )


async def test_d6_pre_stop_hook_runs_before_the_stop_and_shortens_the_grace(node: Node) -> None:
    """D6: a probe-triggered stop runs the container's preStop hook first and passes
    StopContainer the grace period less the hook's whole seconds."""
    sandbox = node.old_pod("web")
    app = node.runtime.add_container(
        sandbox,
        "app",
        annotations={
            "io.kubernetes.pod.terminationGracePeriod": "30",
            "io.kubernetes.container.preStopHandler": '{"exec":{"command":["drain"]}}',
        },
    )
    node.exit_codes["check-live"] = 1
    node.exec_seconds["drain"] = 1.2
    await node.relist()
    await node.watcher.until(lambda: _attempts(node, app.id, ProbeKind.STARTUP) == 1)
    node.manager.probe_now(app.id, ProbeKind.LIVENESS)
    await asyncio.wait_for(node.runtime.container_stopped.wait(), HANG_GUARD)
    assert ["drain"] in [cmd for cid, cmd, _ in node.execs if cid == app.id]
    assert node.runtime.stop_requests == [(app.id, 29)]


async def test_d6_pre_stop_hook_is_skipped_with_zero_grace(node: Node) -> None:
    """A grace period of 0 leaves no time for the hook: it is skipped, and the stop gets 2 s."""
    sandbox = node.old_pod("web")
    app = node.runtime.add_container(
        sandbox,
        "app",
        annotations={
            "io.kubernetes.pod.terminationGracePeriod": "0",
            "io.kubernetes.container.preStopHandler": '{"exec":{"command":["drain"]}}',
        },
    )
    node.exit_codes["check-live"] = 1
    await node.relist()
    await node.watcher.until(lambda: _attempts(node, app.id, ProbeKind.STARTUP) == 1)
    node.manager.probe_now(app.id, ProbeKind.LIVENESS)
    await asyncio.wait_for(node.runtime.container_stopped.wait(), HANG_GUARD)
    assert ["drain"] not in [cmd for _, cmd, _ in node.execs]
    assert node.runtime.stop_requests == [(app.id, 2)]


@pytest.mark.parametrize(
    ("deletion", "probe_grace", "pod_grace", "expected"),
    [
        ("9", 5, "500", 9),  # a deleted pod's grace wins
        (None, 5, "500", 5),  # then the probe's
        (None, None, "500", 500),  # then the pod's
        (None, None, None, 30),  # not made by a kubelet: 30
        (None, None, "0", 0),  # 0 stays 0 here; the 2 s floor comes after the hook
    ],
)
def test_kill_grace_precedence(
    deletion: str | None, probe_grace: int | None, pod_grace: str | None, expected: int
) -> None:
    """§5.3 setTerminationGracePeriod, with deletionGracePeriodSeconds first."""
    from cri_prober.probing.spec import ResolvedProbe

    spec: dict[str, object] = {"exec": {"command": ["x"]}}
    if probe_grace is not None:
        spec["terminationGracePeriodSeconds"] = probe_grace
    probe = parse_probe(spec, kind=ProbeKind.LIVENESS, path="livenessProbe")
    annotations = {}
    if deletion is not None:
        annotations["io.kubernetes.pod.deletionGracePeriod"] = deletion
    if pod_grace is not None:
        annotations["io.kubernetes.pod.terminationGracePeriod"] = pod_grace
    assert kill_grace(ResolvedProbe(probe, {}), annotations) == expected
