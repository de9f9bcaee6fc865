"""Discovery against real containerd: relisting everywhere, events on 2.1 and 1.7, fallback on 1.6.

The testbeds are shared by the whole session, so every assertion looks only at the pods and
containers its own test created.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import structlog

from cri_prober.discovery.pleg import Discovery, EventKind, LifecycleEvent
from cri_prober.runtime.client import CriClient
from cri_prober.runtime.model import Container, ContainerState
from tests.support.testbed import ContainerSpec, PodFactory, Testbed
from tests.support.watchers import DiscoveryRecorder, event_object_id

SLEEPER = ContainerSpec("app", env={"GREETING": "hello"})
HUGE = 3600.0  # a period long enough that it never elapses during a test


class CountingCri(CriClient):
    """Counts ListContainers calls, so a test can tell relist-made events from stream-made ones."""

    lists = 0

    async def list_containers(
        self, *, pod_sandbox_id: str = "", state: ContainerState | None = None
    ) -> list[Container]:
        self.lists += 1
        return await super().list_containers(pod_sandbox_id=pod_sandbox_id, state=state)


# A real runtime on a shared 2-core machine gets more time than the fake one.
REAL_RUNTIME_TIMEOUT = 20.0


def _mine(events: list[LifecycleEvent], *ids: str) -> list[tuple[EventKind, str]]:
    """(kind, ID) of the events about these containers or sandboxes, in order."""
    return [
        (event.kind, event_object_id(event)) for event in events if event_object_id(event) in ids
    ]


@contextlib.asynccontextmanager
async def running(discovery: Discovery, **kwargs: Any) -> AsyncIterator[None]:
    """Run discovery in a task for the duration of the block, then stop it."""
    stop = asyncio.Event()
    task = asyncio.create_task(discovery.run(stop=stop, **kwargs))
    try:
        yield
    finally:
        stop.set()
        await task


@pytest.fixture(name="cri")
async def _cri(testbed: Testbed) -> AsyncIterator[CountingCri]:
    async with CountingCri.connect(testbed.endpoint) as client:
        assert isinstance(client, CountingCri)
        yield client


@pytest.fixture(name="discovery")
def _discovery(cri: CountingCri) -> Discovery:
    return Discovery(cri)


async def test_relist_detects_start_exit_and_removal(
    discovery: Discovery, pods: PodFactory
) -> None:
    """Relists report a container's start, exit and removal with its pod's metadata."""
    await discovery.relist()  # whatever earlier tests left behind is not this test's business
    pod = await pods.create_pod(
        "disc-web",
        namespace="shop",
        host_network=False,
        labels={"tier": "web"},
        containers=[SLEEPER],
    )
    cid = pod.container_ids["app"]

    events = await discovery.relist()
    assert _mine(events, pod.sandbox_id, cid) == [
        (EventKind.POD_CHANGED, pod.sandbox_id),
        (EventKind.STARTED, cid),
    ]
    info = discovery.container(cid)
    assert info is not None
    assert (info.name, info.attempt, info.state) == ("app", 0, ContainerState.CONTAINER_RUNNING)
    assert info.started_at > 0
    assert info.finished_at == 0
    assert info.env is not None
    assert info.env["GREETING"] == "hello"
    assert (info.pod.name, info.pod.namespace, info.pod.uid) == ("disc-web", "shop", pod.uid)
    assert (info.pod.ready, info.pod.host_network, info.pod.ip) == (True, False, pod.ip)
    assert info.pod.ip != ""
    assert info.pod.labels["tier"] == "web"

    await pods.stop_container(cid, timeout=0)
    assert _mine(await discovery.relist(), pod.sandbox_id, cid) == [(EventKind.DIED, cid)]
    died = discovery.container(cid)
    assert died is not None
    assert died.state is ContainerState.CONTAINER_EXITED
    assert died.exit_code == 137
    assert died.finished_at >= died.started_at == info.started_at

    await pods.remove_container(cid)
    assert _mine(await discovery.relist(), pod.sandbox_id, cid) == [(EventKind.REMOVED, cid)]
    assert discovery.container(cid) is None

    await pods.remove_pod(pod)
    assert _mine(await discovery.relist(), pod.sandbox_id) == [
        (EventKind.POD_REMOVED, pod.sandbox_id)
    ]
    assert discovery.pod(pod.sandbox_id) is None


async def test_restarted_container_is_a_new_container(
    discovery: Discovery, pods: PodFactory
) -> None:
    """A kubelet-style restart shows up as the old attempt dying and a new ID starting."""
    pod = await pods.create_pod("disc-restart", containers=[SLEEPER])
    old = pod.container_ids["app"]
    await discovery.relist()

    pod = await pods.restart_container(pod, "app")
    new = pod.container_ids["app"]
    events = await discovery.relist()

    assert new != old
    # Containers within one relist come in the runtime's listing order, which is arbitrary.
    assert sorted(_mine(events, old, new)) == sorted(
        [(EventKind.DIED, old), (EventKind.STARTED, new)]
    )
    restarted = discovery.container(new)
    exited = discovery.container(old)
    assert restarted is not None
    assert exited is not None
    assert (restarted.attempt, restarted.pod_sandbox_id) == (1, pod.sandbox_id)
    assert restarted.state is ContainerState.CONTAINER_RUNNING
    assert exited.state is ContainerState.CONTAINER_EXITED


@pytest.mark.containerd(versions=["2.1", "1.7"])
async def test_events_mode_sees_an_exit_through_the_stream(
    cri: CountingCri, discovery: Discovery, pods: PodFactory
) -> None:
    """With relisting effectively off, an exit still arrives: the stream delivered it."""
    recorder = DiscoveryRecorder(discovery)
    pod = await pods.create_pod("disc-events", containers=[SLEEPER])
    cid = pod.container_ids["app"]
    async with running(discovery, mode="events", relist_period=HUGE, safety_relist_period=HUGE):
        await recorder.wait_for(
            EventKind.STARTED, cid, timeout=REAL_RUNTIME_TIMEOUT
        )  # from the relist on connect
        lists = cri.lists
        await pods.stop_container(cid, timeout=0)
        died = await recorder.wait_for(EventKind.DIED, cid, timeout=REAL_RUNTIME_TIMEOUT)
        assert cri.lists == lists
        assert discovery.effective_mode == "events"
    assert died.container is not None
    assert died.container.exit_code == 137
    assert died.container.pod.uid == pod.uid


@pytest.mark.containerd(versions=["1.6"])
async def test_events_mode_falls_back_to_relist_on_16(
    discovery: Discovery, pods: PodFactory
) -> None:
    """containerd 1.6 answers UNIMPLEMENTED, so discovery relists for good instead."""
    recorder = DiscoveryRecorder(discovery)
    pod = await pods.create_pod("disc-fallback", containers=[SLEEPER])
    cid = pod.container_ids["app"]
    with structlog.testing.capture_logs() as logs:
        async with running(discovery, mode="events", relist_period=0.1, safety_relist_period=HUGE):
            await recorder.wait_for(EventKind.STARTED, cid, timeout=REAL_RUNTIME_TIMEOUT)
            await pods.stop_container(cid, timeout=0)
            # Events mode relists once per connect, so only the relist loop can report this.
            await recorder.wait_for(EventKind.DIED, cid, timeout=REAL_RUNTIME_TIMEOUT)
            assert discovery.effective_mode == "relist"
    [fallback] = [entry for entry in logs if entry["event"] == "pleg_fallback_relist"]
    assert "UNIMPLEMENTED" in fallback["error"]


async def test_auto_picks_events_only_on_containerd_2(
    testbed: Testbed, discovery: Discovery, pods: PodFactory
) -> None:
    """auto relists on containerd 1.6 and 1.7 and follows events on 2.1."""
    recorder = DiscoveryRecorder(discovery)
    pod = await pods.create_pod("disc-auto", containers=[SLEEPER])
    async with running(discovery, mode="auto", relist_period=0.1):
        await recorder.wait_for(
            EventKind.STARTED, pod.container_ids["app"], timeout=REAL_RUNTIME_TIMEOUT
        )
        assert discovery.effective_mode == ("events" if testbed.version == "2.1" else "relist")
