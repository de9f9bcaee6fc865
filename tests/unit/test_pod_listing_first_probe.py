"""A new pod's first probe on the kubelet's schedule with ``--probes-from kubelet`` (issue 23).

The kubelet's worker starts at pod admission and probes on that grid (D4). cri-prober learns of
the pod from discovery first; it used to wait for the kubelet source's next poll (every few
seconds) and miss the first tick or more. Now a pod no source lists makes the polled sources read
at once (``PolledSource.poll_soon``, coalesced and at most once per ``POLL_NOW_MIN_GAP``), so the
spec comes within a round trip and the worker joins the admission grid before its first tick.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cri_prober.discovery.pleg import Discovery
from cri_prober.manager.probe_manager import ProbeManager
from cri_prober.podspecs import source as source_module
from cri_prober.podspecs.decode import decode_pod_list
from cri_prober.podspecs.model import CONFIG_SEEN_ANNOTATION, parse_pod
from cri_prober.podspecs.registry import PodSpecs
from cri_prober.podspecs.source import POLL_NOW_MIN_GAP, PolledSource
from cri_prober.probing import worker as worker_module
from cri_prober.probing.prober import Prober
from cri_prober.probing.spec import ProbeKind, load_rules
from tests.support.clock import WALL0, WorkerClock
from tests.support.fake_runtime import FakeRuntime
from tests.support.memory_cri import memory_client
from tests.support.waiting import HANG_GUARD
from tests.support.watchers import ManagerWatcher

HOUR = 3600.0
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kubelet-1.28.7"


class FakeKubelet(PolledSource):
    """The kubelet's ``/pods``: what ``pods`` holds when it is read; every read is counted."""

    def __init__(self, interval: float = HOUR) -> None:
        super().__init__("kubelet", interval=interval)
        self.pods_now: list[dict[str, Any]] = []
        self.read_at: list[float] = []  # the loop's time at each read
        self.read = asyncio.Event()

    async def poll(self) -> bool:
        self.read_at.append(asyncio.get_running_loop().time())
        self.read.set()
        changed = self.replace_all(list(self.pods_now))
        self.succeeded()
        return changed

    async def wait_reads(self, count: int) -> None:
        async with asyncio.timeout(HANG_GUARD):
            while len(self.read_at) < count:
                self.read.clear()
                await self.read.wait()


@pytest.fixture(name="kubelet")
async def _kubelet() -> AsyncIterator[FakeKubelet]:
    kubelet = FakeKubelet()
    task = asyncio.create_task(kubelet.run(lambda: None))
    yield kubelet
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_poll_soon_reads_at_once_and_coalesces(
    kubelet: FakeKubelet, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(source_module, "POLL_NOW_MIN_GAP", 0.0)
    await kubelet.wait_reads(1)
    for _ in range(5):
        kubelet.poll_soon()
    await kubelet.wait_reads(2)  # not an hour later
    await asyncio.sleep(0)
    assert len(kubelet.read_at) == 2  # five requests, one read
    assert kubelet.polls_requested == 1


async def test_poll_soon_reads_at_most_once_per_gap(
    kubelet: FakeKubelet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node whose pods churn cannot make the source read continuously (the real gap is
    POLL_NOW_MIN_GAP, 1 s; a shorter one keeps the test short)."""
    assert POLL_NOW_MIN_GAP == 1.0
    gap = 0.2
    monkeypatch.setattr(source_module, "POLL_NOW_MIN_GAP", gap)
    await kubelet.wait_reads(1)
    kubelet.poll_soon()
    await kubelet.wait_reads(2)
    kubelet.poll_soon()
    await kubelet.wait_reads(3)
    # The loop's timers may fire up to a millisecond early (uvloop rounds them).
    assert kubelet.read_at[1] - kubelet.read_at[0] >= gap - 0.002
    assert kubelet.read_at[2] - kubelet.read_at[1] >= gap - 0.002


def _pod(uid: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "web", "namespace": "shop", "uid": uid},
        "spec": {
            "containers": [
                {
                    "name": "app",
                    # Liveness: a pod sync re-triggers readiness at once (§3.8), not liveness.
                    "livenessProbe": {"exec": {"command": ["true"]}, "periodSeconds": 10},
                }
            ]
        },
        "status": {"phase": "Running"},
    }


@dataclass
class Node:
    runtime: FakeRuntime
    discovery: Discovery
    manager: ProbeManager
    kubelet: FakeKubelet
    registry: PodSpecs
    clock: WorkerClock


@pytest.fixture(name="node")
async def _node(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Node]:
    # Every worker runs on one virtual clock: its waits end at once at their deadline, so the
    # time an attempt records is the tick it ran on, exactly.
    clock = WorkerClock()
    monkeypatch.setattr(worker_module, "LOOP_CLOCK", clock)
    # The first read was a moment ago: let the "poll now" read follow without the gap.
    monkeypatch.setattr(source_module, "POLL_NOW_MIN_GAP", 0.0)
    runtime = FakeRuntime()
    kubelet = FakeKubelet()
    registry = PodSpecs([kubelet])
    async with memory_client(runtime) as cri:
        discovery = Discovery(cri)
        manager = ProbeManager(
            prober=Prober(cri),
            rules=load_rules("probes: []\n", source="rules.yaml"),
            prober_started_at=WALL0 - 1800,
            pod_specs=registry,
        )
        registry.start(lambda: manager.on_pod_specs(discovery.containers().values()))
        try:
            await kubelet.wait_reads(1)  # the node had no pods yet
            yield Node(runtime, discovery, manager, kubelet, registry, clock)
        finally:
            await registry.stop()
            await manager.shutdown(grace=5)


async def test_first_attempt_at_the_kubelets_first_tick_not_a_period_later(node: Node) -> None:
    """The kubelet admits the pod (its /pods lists it), creates the sandbox 0.3 s later and the
    container; discovery sees the container. The kubelet's worker ticks every 10 s from
    admission (here the sandbox's creation stands in for it): its first attempt comes at
    created + 10 s. cri-prober's must come at that same tick: the kubelet source reads at once
    instead of an hour (its interval) later."""
    node.kubelet.pods_now = [_pod("uid-web")]
    sandbox = node.runtime.add_sandbox("web", namespace="shop")
    sandbox.uid = "uid-web"
    created = WALL0 - 0.3  # 0.3 s before the virtual clock's now
    sandbox.created_at = int(created * 1e9)
    app = node.runtime.add_container(sandbox, "app")
    app.started_at = int((WALL0 - 0.1) * 1e9)
    watcher = ManagerWatcher(node.manager)
    events = await node.discovery.relist()
    node.manager.on_lifecycle(events, node.discovery.containers().values())
    assert node.manager.tracked() == 0  # waiting for the pod's spec
    await node.kubelet.wait_reads(2)  # read at once, not an hour later
    await watcher.until(lambda: watcher.records)
    first = watcher.records[0]
    assert first.kind is ProbeKind.LIVENESS
    assert first.record.started_at == pytest.approx(created + 10, abs=1e-6)
    watcher.unsubscribe()


async def test_a_pod_there_before_the_prober_ticks_on_a_drawn_phase(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod that was there when the prober started, found by a discovery that took longer
    than a period (on a big node): its worker draws its first step and its phase from a whole
    period, as the kubelet's (which holds the pod at its start) does, rather than probing at
    once (10,000 such first steps took every descriptor) and ticking a period after discovery
    reached it (which bunched a big node's workers into discovery's bursts)."""
    rng = random.Random(11)
    monkeypatch.setattr(worker_module, "_SHARED_RNG", rng)
    twin = random.Random(11)
    node.kubelet.pods_now = [_pod("uid-web")]
    sandbox = node.runtime.add_sandbox("web", namespace="shop")
    sandbox.uid = "uid-web"
    sandbox.created_at = int((WALL0 - HOUR) * 1e9)  # half an hour before the prober started
    app = node.runtime.add_container(sandbox, "app")
    app.started_at = int((WALL0 - HOUR) * 1e9)
    await node.kubelet.poll()
    node.registry.rebuild()
    watcher = ManagerWatcher(node.manager)
    events = await node.discovery.relist()
    node.manager.on_lifecycle(events, node.discovery.containers().values())
    await watcher.until(lambda: len(watcher.records) >= 2)
    first, second = (event.record.started_at for event in watcher.records[:2])
    jitter, phase = twin.uniform(0, 10), twin.uniform(0, 10)
    assert first == pytest.approx(WALL0 + jitter, abs=1e-6)
    expected = WALL0 + phase + (math.floor((jitter - phase) / 10) + 1) * 10
    assert second == pytest.approx(expected, abs=1e-6)
    assert second != pytest.approx(first + 10, abs=1e-3)
    watcher.unsubscribe()


async def test_a_new_sandbox_alone_makes_the_kubelet_source_read(node: Node) -> None:
    """The sandbox comes before its containers: the read need not wait for them."""
    node.kubelet.pods_now = [_pod("uid-web")]
    sandbox = node.runtime.add_sandbox("web", namespace="shop")
    sandbox.uid = "uid-web"
    events = await node.discovery.relist()
    node.manager.on_lifecycle(events, node.discovery.containers().values())
    await node.kubelet.wait_reads(2)
    assert "uid-web" in node.kubelet.pods


async def test_admission_time_from_the_kubelet_anchors_the_grid(node: Node) -> None:
    """D4/D9: the kubelet's /pods says when it first saw the pod (kubernetes.io/config.seen, set
    just before it admits the pod and starts its workers); the sandbox comes later (0.2-0.3 s in
    the recorded kubelet 1.28.7). The grid is the admission's, so a tick the kubelet's worker
    runs before its own sync restarts a container is cri-prober's too (issue 23, item 3)."""
    admitted = WALL0 - 0.5
    pod = _pod("uid-web")
    seen = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(int(admitted)))
    pod["metadata"]["annotations"] = {
        "kubernetes.io/config.seen": f"{seen}.{round((admitted % 1) * 1e9):09d}Z"
    }
    node.kubelet.pods_now = [pod]
    sandbox = node.runtime.add_sandbox("web", namespace="shop")
    sandbox.uid = "uid-web"
    sandbox.created_at = int((admitted + 0.25) * 1e9)
    app = node.runtime.add_container(sandbox, "app")
    app.started_at = int((WALL0 - 0.1) * 1e9)
    # The spec is there before discovery sees the pod (this test is not about "poll now").
    await node.kubelet.poll()
    node.registry.rebuild()
    watcher = ManagerWatcher(node.manager)
    events = await node.discovery.relist()
    node.manager.on_lifecycle(events, node.discovery.containers().values())
    await watcher.until(lambda: watcher.records)
    # Not created + 10 s: the sandbox's creation was the anchor before.
    assert watcher.records[0].record.started_at == pytest.approx(admitted + 10, abs=1e-6)
    watcher.unsubscribe()


def test_the_recorded_kubelets_config_seen_is_read_to_the_nanosecond() -> None:
    """tests/fixtures/kubelet-1.28.7: config.seen 11:23:52.650437875Z; its containers were
    created at 52.947 (CRI), so the sandbox came about 0.3 s after admission."""
    listing = (FIXTURES / "pods-running.json").read_bytes()
    specs = {
        spec.name: spec
        for spec in (parse_pod(p.obj, source="k") for p in decode_pod_list(listing).pods)
    }
    assert specs["web-kd-node"].admitted_at == pytest.approx(1795433032.650437875, abs=1e-6)
    offset = {
        "metadata": {
            "name": "p",
            "annotations": {CONFIG_SEEN_ANNOTATION: "2026-11-23T12:23:52.5+01:00"},
        },
        "spec": {},
    }
    assert parse_pod(offset, source="k").admitted_at == pytest.approx(1795433032.5, abs=1e-6)
    bad = {
        "metadata": {"name": "p", "annotations": {CONFIG_SEEN_ANNOTATION: "yesterday"}},
        "spec": {},
    }
    assert parse_pod(bad, source="k").admitted_at is None
