"""Discovery on the in-process fake runtime: relist diffing, events mode, fallbacks and scale.

Tests wait for the lifecycle events they expect through a subscriber, never for time to pass; the
only polling is for the fake's subscriber count, which nothing can be awaited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog

import cri_prober
from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.discovery.pleg import (
    RELIST_THRESHOLD,
    Discovery,
    EventKind,
    LifecycleEvent,
    containerd_version,
    pick_mode,
)
from cri_prober.discovery.source import DiscoveryUpdate, Relisted
from cri_prober.errors import CriError
from cri_prober.runtime.client import CriClient
from cri_prober.runtime.model import (
    ContainerState,
    ContainerStatus,
    PodSandbox,
    RuntimeVersion,
    SandboxStatus,
)
from tests.support.fake_runtime import FakeRuntime
from tests.support.memory_cri import memory_channel, memory_client
from tests.support.waiting import until
from tests.support.watchers import DiscoveryRecorder, event_object_id

HUGE = 3600.0  # a period long enough that it never elapses during a test


def _kinds(events: list[LifecycleEvent]) -> list[tuple[EventKind, str]]:
    return [(event.kind, event_object_id(event)) for event in events]


def discovery_tasks() -> set[asyncio.Task[Any]]:
    """Pending tasks running cri_prober code (grpc's own internal tasks wind down by themselves)."""
    package = Path(cri_prober.__file__).parent
    return {
        task
        for task in asyncio.all_tasks()
        if not task.done()
        and (code := getattr(task.get_coro(), "cr_code", None)) is not None
        and Path(code.co_filename).is_relative_to(package)
    }


@contextlib.asynccontextmanager
async def running(discovery: Discovery, **kwargs: Any) -> AsyncIterator[None]:
    """Run discovery in a task for the duration of the block, then stop it."""
    stop = asyncio.Event()
    task = asyncio.create_task(discovery.run(stop=stop, **kwargs), name="run")
    try:
        yield
    finally:
        stop.set()
        await task


@pytest.fixture(name="runtime")
def _runtime() -> FakeRuntime:
    return FakeRuntime()


@pytest.fixture(name="cri")
async def _cri(runtime: FakeRuntime) -> AsyncIterator[CriClient]:
    async with memory_client(runtime, retry_wait_max=0.01) as client:
        yield client


@pytest.fixture(name="discovery")
def _discovery(cri: CriClient) -> Discovery:
    return Discovery(cri, backoff_initial=0.01, backoff_max=0.05)


@pytest.fixture(name="recorder")
def _recorder(discovery: Discovery) -> DiscoveryRecorder:
    return DiscoveryRecorder(discovery)


def status_calls(runtime: FakeRuntime) -> tuple[int, int]:
    """(PodSandboxStatus, ContainerStatus) calls so far."""
    return runtime.calls.count("PodSandboxStatus"), runtime.calls.count("ContainerStatus")


class TestRelist:
    """relist() diffs the listings against the last view like the kubelet's generic PLEG."""

    async def test_first_relist_reports_pods_and_containers(
        self, discovery: Discovery, runtime: FakeRuntime
    ) -> None:
        """New pods, then new containers by state: running started, exited died, created changed."""
        sandbox = runtime.add_sandbox(
            "web", namespace="shop", ip="10.1.2.3", labels={"tier": "web"}, annotations={"a": "b"}
        )
        app = runtime.add_container(sandbox, "app", attempt=2, env={"GREETING": "hi"})
        done = runtime.add_container(sandbox, "init", state=api_pb2.CONTAINER_EXITED)
        done.exit_code, done.finished_at = 3, done.created_at + 1
        fresh = runtime.add_container(sandbox, "sidecar", state=api_pb2.CONTAINER_CREATED)

        events = await discovery.relist()

        assert _kinds(events) == [
            (EventKind.POD_CHANGED, sandbox.id),
            (EventKind.STARTED, app.id),
            (EventKind.DIED, done.id),
            (EventKind.CHANGED, fresh.id),
        ]
        pod = discovery.pod(sandbox.id)
        assert pod is not None
        assert (pod.name, pod.namespace, pod.uid, pod.ready) == ("web", "shop", sandbox.uid, True)
        assert (pod.ip, pod.host_network, pod.labels, pod.annotations) == (
            "10.1.2.3",
            False,
            {"tier": "web"},
            {"a": "b"},
        )
        info = discovery.container(app.id)
        assert info is not None
        assert (info.name, info.attempt, info.state) == ("app", 2, ContainerState.CONTAINER_RUNNING)
        assert info.started_at == app.started_at > 0
        assert info.env == {"GREETING": "hi"}
        assert info.labels["io.kubernetes.container.name"] == "app"
        assert info.pod is pod
        died = discovery.container(done.id)
        assert died is not None
        assert (died.exit_code, died.finished_at) == (3, done.finished_at)
        assert set(discovery.containers()) == {app.id, done.id, fresh.id}
        assert set(discovery.pods()) == {sandbox.id}

    async def test_exit_is_died_with_exit_details(
        self, discovery: Discovery, runtime: FakeRuntime
    ) -> None:
        """A running container seen exited is reported died, with its exit code and finish time."""
        app = runtime.add_container(runtime.add_sandbox("web"), "app")
        await discovery.relist()
        runtime.exit_container(app.id, exit_code=137)

        [event] = await discovery.relist()

        assert event.kind is EventKind.DIED
        assert event.container is not None
        assert event.container.state is ContainerState.CONTAINER_EXITED
        assert (event.container.exit_code, event.container.finished_at) == (137, app.finished_at)

    async def test_removal_after_exit_is_only_removed(
        self, discovery: Discovery, runtime: FakeRuntime
    ) -> None:
        """A container already reported dead is just removed when it goes away."""
        app = runtime.add_container(runtime.add_sandbox("web"), "app")
        runtime.exit_container(app.id)
        await discovery.relist()
        runtime.remove_container(app.id)

        assert _kinds(await discovery.relist()) == [(EventKind.REMOVED, app.id)]
        assert discovery.container(app.id) is None

    async def test_vanished_running_container_dies_then_is_removed(
        self, discovery: Discovery, runtime: FakeRuntime
    ) -> None:
        """A running container that disappears between relists yields died, then removed."""
        app = runtime.add_container(runtime.add_sandbox("web"), "app")
        await discovery.relist()
        runtime.remove_container(app.id)

        events = await discovery.relist()

        assert _kinds(events) == [(EventKind.DIED, app.id), (EventKind.REMOVED, app.id)]
        # Nobody saw it exit: both events carry its last known (running) info.
        assert events[0].container == events[1].container
        assert events[0].container is not None
        assert events[0].container.state is ContainerState.CONTAINER_RUNNING

    async def test_sandbox_state_change_is_pod_changed(
        self, discovery: Discovery, runtime: FakeRuntime
    ) -> None:
        """A sandbox going not-ready is refetched, reported, and its containers point at it."""
        sandbox = runtime.add_sandbox("web", ip="10.1.2.3")
        app = runtime.add_container(sandbox, "app")
        await discovery.relist()
        sandbox.ready, sandbox.ip = False, ""

        [event] = await discovery.relist()

        assert event.kind is EventKind.POD_CHANGED
        assert event.pod is not None
        assert (event.pod.ready, event.pod.ip) == (False, "")
        info = discovery.container(app.id)
        assert info is not None
        assert info.pod is event.pod

    async def test_removed_pod_reports_containers_first(
        self, discovery: Discovery, runtime: FakeRuntime
    ) -> None:
        """Removing a sandbox reports its containers' removal, then the pod's."""
        sandbox = runtime.add_sandbox("web")
        app = runtime.add_container(sandbox, "app")
        await discovery.relist()
        runtime.remove_sandbox(sandbox.id)

        assert _kinds(await discovery.relist()) == [
            (EventKind.DIED, app.id),
            (EventKind.REMOVED, app.id),
            (EventKind.POD_REMOVED, sandbox.id),
        ]
        assert (dict(discovery.pods()), dict(discovery.containers())) == ({}, {})

    async def test_statuses_are_fetched_only_for_new_or_changed_objects(
        self, discovery: Discovery, runtime: FakeRuntime
    ) -> None:
        """Nothing changed means no status calls; one exit means one ContainerStatus call."""
        sandbox = runtime.add_sandbox("web")
        app = runtime.add_container(sandbox, "app")
        runtime.add_container(sandbox, "sidecar")
        await discovery.relist()
        assert status_calls(runtime) == (1, 2)

        assert await discovery.relist() == []
        assert status_calls(runtime) == (1, 2)

        runtime.exit_container(app.id)
        await discovery.relist()
        assert status_calls(runtime) == (1, 3)

    async def test_container_of_an_unlisted_sandbox_fetches_that_sandbox(
        self, runtime: FakeRuntime
    ) -> None:
        """A sandbox created between ListPodSandbox and ListContainers is fetched, not skipped."""

        class LateSandboxCri(CriClient):
            """Lists sandboxes as if the newest one did not exist yet."""

            async def list_pod_sandboxes(self) -> list[PodSandbox]:
                return (await super().list_pod_sandboxes())[:-1]

        runtime.add_sandbox("old")
        late = runtime.add_sandbox("late")
        app = runtime.add_container(late, "app")
        async with LateSandboxCri(memory_channel(runtime)) as cri:
            discovery = Discovery(cri)
            await discovery.relist()

        info = discovery.container(app.id)
        assert info is not None
        assert info.pod.name == "late"

    async def test_listing_error_keeps_the_view_and_is_retried(
        self, discovery: Discovery, runtime: FakeRuntime
    ) -> None:
        """A failed relist raises, leaves the view as it was, and the next one catches up."""
        app = runtime.add_container(runtime.add_sandbox("web"), "app")
        await discovery.relist()
        before = dict(discovery.containers())
        runtime.exit_container(app.id)
        runtime.fail_next("ListContainers", grpc.StatusCode.INTERNAL)

        with pytest.raises(CriError):
            await discovery.relist()

        assert dict(discovery.containers()) == before
        assert _kinds(await discovery.relist()) == [(EventKind.DIED, app.id)]

    async def test_status_error_leaves_the_object_for_the_next_relist(
        self, discovery: Discovery, runtime: FakeRuntime
    ) -> None:
        """A new container whose status call fails is not reported until a relist gets it."""
        sandbox = runtime.add_sandbox("web")
        await discovery.relist()
        app = runtime.add_container(sandbox, "app")
        runtime.fail_next("ContainerStatus", grpc.StatusCode.INTERNAL)

        with structlog.testing.capture_logs() as logs:
            assert await discovery.relist() == []

        assert discovery.container(app.id) is None
        assert [entry["event"] for entry in logs] == ["status_refresh_failed"]
        assert _kinds(await discovery.relist()) == [(EventKind.STARTED, app.id)]

    async def test_health_follows_the_last_successful_relist(
        self, cri: CriClient, runtime: FakeRuntime
    ) -> None:
        """Healthy until the last successful relist is older than the kubelet's 3 minutes."""
        now = 1000.0
        discovery = Discovery(cri, clock=lambda: now)
        assert not discovery.healthy()
        await discovery.relist()
        assert discovery.last_relist_ok == now
        runtime.fail_next("ListPodSandbox", grpc.StatusCode.INTERNAL)
        now += RELIST_THRESHOLD
        with pytest.raises(CriError):
            await discovery.relist()
        assert discovery.last_relist_ok == 1000.0
        assert discovery.healthy()
        assert not discovery.healthy(now + 1)

    async def test_a_failing_subscriber_does_not_stop_others(
        self, discovery: Discovery, recorder: DiscoveryRecorder, runtime: FakeRuntime
    ) -> None:
        """A subscriber that raises is logged; later subscribers still get every event."""

        def broken(_update: DiscoveryUpdate) -> None:
            raise RuntimeError("boom")

        unsubscribe = discovery.updates.subscribe(broken)
        late = DiscoveryRecorder(discovery)
        sandbox = runtime.add_sandbox("web")
        with structlog.testing.capture_logs() as logs:
            await discovery.relist()
        assert _kinds(late.seen) == [(EventKind.POD_CHANGED, sandbox.id)]
        # Once for the view change, once for the relist itself.
        assert [entry["event"] for entry in logs] == ["listener_failed", "listener_failed"]

        unsubscribe()
        recorder.unsubscribe()
        unsubscribe()  # idempotent
        runtime.remove_sandbox(sandbox.id)
        with structlog.testing.capture_logs() as logs:
            await discovery.relist()
        assert logs == []
        assert len(recorder.seen) == 1
        assert len(late.seen) == 2


class TestIncrementalRelist:
    """A relist converts and publishes only what is new or changed, reusing the rest as it was."""

    async def test_unchanged_node_keeps_every_object_and_publishes_no_change(
        self, discovery: Discovery, runtime: FakeRuntime
    ) -> None:
        """Nothing changed: the same view objects, no ViewChanged, but still a Relisted."""
        for name in ("web", "db"):
            sandbox = runtime.add_sandbox(name)
            runtime.add_container(sandbox, "app")
            runtime.add_container(sandbox, "sidecar", state=api_pb2.CONTAINER_EXITED)
        await discovery.relist()
        pods, containers = dict(discovery.pods()), dict(discovery.containers())
        updates: list[DiscoveryUpdate] = []
        discovery.updates.subscribe(updates.append)

        assert await discovery.relist() == []
        assert await discovery.relist() == []

        assert [type(update) for update in updates] == [Relisted, Relisted]
        assert all(isinstance(u, Relisted) and u.ok for u in updates)
        assert all(discovery.pod(i) is pod for i, pod in pods.items())
        assert all(discovery.container(i) is info for i, info in containers.items())
        assert len(discovery.containers()) == 4
        assert status_calls(runtime) == (2, 4)

    async def test_state_change_is_noticed_and_the_rest_kept(
        self, discovery: Discovery, runtime: FakeRuntime
    ) -> None:
        """One exit makes one new object; the others stay identical and a snapshot stays old."""
        sandbox = runtime.add_sandbox("web")
        app = runtime.add_container(sandbox, "app")
        sidecar = runtime.add_container(sandbox, "sidecar")
        await discovery.relist()
        before = discovery.containers()
        kept, old_app = discovery.container(sidecar.id), discovery.container(app.id)
        runtime.exit_container(app.id, exit_code=1)

        [event] = await discovery.relist()

        assert (event.kind, event.container) == (EventKind.DIED, discovery.container(app.id))
        assert event.container is not None
        assert event.container is not old_app
        assert event.container.exit_code == 1
        assert discovery.container(sidecar.id) is kept
        assert before[app.id] is old_app  # a mapping handed out earlier is a stable snapshot
        assert before[app.id].state is ContainerState.CONTAINER_RUNNING

    async def test_recreated_container_is_a_new_object(
        self, discovery: Discovery, runtime: FakeRuntime
    ) -> None:
        """Removed and created again (a new ID, as CRI does): the old goes, the new is new."""
        sandbox = runtime.add_sandbox("web")
        old = runtime.add_container(sandbox, "app")
        await discovery.relist()
        old_info = discovery.container(old.id)
        runtime.remove_container(old.id)
        new = runtime.add_container(sandbox, "app", attempt=1)

        events = await discovery.relist()

        assert _kinds(events) == [
            (EventKind.STARTED, new.id),
            (EventKind.DIED, old.id),
            (EventKind.REMOVED, old.id),
        ]
        assert events[1].container is old_info
        info = discovery.container(new.id)
        assert info is not None
        assert info is not old_info
        assert (info.name, info.attempt) == ("app", 1)
        assert discovery.container(old.id) is None
        assert set(discovery.containers()) == {new.id}

    async def test_sandbox_state_change_rebinds_only_its_containers(
        self, discovery: Discovery, runtime: FakeRuntime
    ) -> None:
        """A sandbox going not-ready is noticed; other pods and their containers are untouched."""
        web, db = runtime.add_sandbox("web"), runtime.add_sandbox("db")
        app, store = runtime.add_container(web, "app"), runtime.add_container(db, "store")
        await discovery.relist()
        db_pod, store_info = discovery.pod(db.id), discovery.container(store.id)
        app_info = discovery.container(app.id)
        web.ready = False

        assert _kinds(await discovery.relist()) == [(EventKind.POD_CHANGED, web.id)]

        pod = discovery.pod(web.id)
        info = discovery.container(app.id)
        assert pod is not None
        assert info is not None
        assert not pod.ready
        assert info is not app_info
        assert info.pod is pod
        assert (discovery.pod(db.id), discovery.container(store.id)) == (db_pod, store_info)
        assert discovery.pod(db.id) is db_pod
        assert discovery.container(store.id) is store_info

    async def test_known_sandbox_missing_from_a_listing_is_refetched(
        self, runtime: FakeRuntime
    ) -> None:
        """A listed container whose known sandbox is not listed keeps it if its status answers."""
        hidden: set[str] = set()

        class GappyCri(CriClient):
            """Leaves the hidden sandboxes out of the listing."""

            async def list_pod_sandboxes(self) -> list[PodSandbox]:
                return [s for s in await super().list_pod_sandboxes() if s.id not in hidden]

        web = runtime.add_sandbox("web")
        app = runtime.add_container(web, "app")
        async with GappyCri(memory_channel(runtime)) as cri:
            discovery = Discovery(cri)
            await discovery.relist()
            hidden.add(web.id)
            assert await discovery.relist() == []
            assert discovery.container(app.id) is not None
            assert runtime.calls.count("PodSandboxStatus") == 2

            runtime.remove_container(app.id)
            assert _kinds(await discovery.relist()) == [
                (EventKind.DIED, app.id),
                (EventKind.REMOVED, app.id),
                (EventKind.POD_REMOVED, web.id),
            ]
        assert (dict(discovery.pods()), dict(discovery.containers())) == ({}, {})

    async def test_events_refresh_only_the_named_objects(
        self, discovery: Discovery, recorder: DiscoveryRecorder, runtime: FakeRuntime
    ) -> None:
        """In events mode an event replaces its object only; every other one stays identical."""
        sandbox = runtime.add_sandbox("web")
        app = runtime.add_container(sandbox, "app")
        sidecar = runtime.add_container(sandbox, "sidecar")
        async with running(discovery, mode="events", relist_period=HUGE, safety_relist_period=HUGE):
            await recorder.wait_for(EventKind.STARTED, sidecar.id)
            await until(lambda: runtime.event_subscribers == 1, changed=runtime.subscribers_changed)
            pod, kept = discovery.pod(sandbox.id), discovery.container(sidecar.id)
            runtime.exit_container(app.id)
            died = await recorder.wait_for(EventKind.DIED, app.id)
        assert died.container is discovery.container(app.id)
        assert discovery.container(sidecar.id) is kept
        assert discovery.pod(sandbox.id) is pod

    async def test_a_view_changed_by_events_is_checked_in_full_by_the_next_relist(
        self, discovery: Discovery, recorder: DiscoveryRecorder, runtime: FakeRuntime
    ) -> None:
        """An unchanged listing is not taken as an unchanged view once events changed the view."""
        sandbox = runtime.add_sandbox("web")
        app = runtime.add_container(sandbox, "app")
        async with running(discovery, mode="events", relist_period=HUGE, safety_relist_period=HUGE):
            await recorder.wait_for(EventKind.STARTED, app.id)
            await until(lambda: runtime.event_subscribers == 1, changed=runtime.subscribers_changed)
            assert await discovery.relist() == []  # finds the listing matching the view
            assert await discovery.relist() == []
            # A stray deletion event: the view drops a container the runtime still lists.
            runtime.emit(app.id, api_pb2.CONTAINER_DELETED_EVENT)
            await recorder.wait_for(EventKind.REMOVED, app.id)

            assert _kinds(await discovery.relist()) == [(EventKind.STARTED, app.id)]
        assert discovery.container(app.id) is not None


class TestRelistMode:
    """run(mode="relist") relists on a period and survives a runtime that stops answering."""

    async def test_relist_mode_detects_changes(
        self, discovery: Discovery, recorder: DiscoveryRecorder, runtime: FakeRuntime
    ) -> None:
        """Containers appearing and exiting are reported by the periodic relist."""
        sandbox = runtime.add_sandbox("web")
        async with running(discovery, mode="relist", relist_period=0.01):
            app = runtime.add_container(sandbox, "app")
            await recorder.wait_for(EventKind.STARTED, app.id)
            runtime.exit_container(app.id, exit_code=1)
            died = await recorder.wait_for(EventKind.DIED, app.id)
            assert discovery.effective_mode == "relist"
        assert died.container is not None
        assert died.container.exit_code == 1
        assert "GetContainerEvents" not in runtime.calls
        assert "Version" not in runtime.calls

    async def test_unavailable_runtime_is_retried_every_period(
        self, discovery: Discovery, recorder: DiscoveryRecorder, runtime: FakeRuntime
    ) -> None:
        """Relists failing with UNAVAILABLE (a containerd restart) are logged and retried."""
        app = runtime.add_container(runtime.add_sandbox("web"), "app")
        # The client itself tries each read 3 times: this fails two whole relists.
        runtime.fail_next("ListPodSandbox", *[grpc.StatusCode.UNAVAILABLE] * 6)
        with structlog.testing.capture_logs() as logs:
            async with running(discovery, mode="relist", relist_period=0.01):
                await recorder.wait_for(EventKind.STARTED, app.id)
        failures = [entry for entry in logs if entry["event"] == "relist_failed"]
        assert len(failures) == 2
        assert all("UNAVAILABLE" in entry["error"] for entry in failures)

    async def test_stopping_leaves_no_tasks(self, discovery: Discovery) -> None:
        """After run() returns, every task it started is gone."""
        async with running(discovery, mode="relist", relist_period=0.01):
            await until(lambda: discovery.last_relist_ok is not None)
            assert {task.get_name() for task in discovery_tasks()} == {"run", "discovery"}
        assert discovery_tasks() == set()


class TestEventsMode:
    """run(mode="events") follows GetContainerEvents and relists only when it must."""

    async def test_relists_on_connect_then_applies_events(
        self, discovery: Discovery, recorder: DiscoveryRecorder, runtime: FakeRuntime
    ) -> None:
        """The connect relist finds existing containers; later changes come from the stream."""
        sandbox = runtime.add_sandbox("web")
        existing = runtime.add_container(sandbox, "existing")
        async with running(discovery, mode="events", relist_period=HUGE, safety_relist_period=HUGE):
            await recorder.wait_for(EventKind.STARTED, existing.id)
            await until(lambda: runtime.event_subscribers == 1, changed=runtime.subscribers_changed)
            assert discovery.effective_mode == "events"
            lists = runtime.calls.count("ListContainers")

            app = runtime.add_container(sandbox, "app", env={"A": "1"})
            started = await recorder.wait_for(EventKind.STARTED, app.id)
            runtime.exit_container(app.id, exit_code=2)
            died = await recorder.wait_for(EventKind.DIED, app.id)
            runtime.remove_container(app.id)
            await recorder.wait_for(EventKind.REMOVED, app.id)

            assert runtime.calls.count("ListContainers") == lists == 1
        assert started.container is not None
        assert started.container.env == {"A": "1"}
        assert died.container is not None
        assert died.container.exit_code == 2
        assert died.container.env == {"A": "1"}  # kept from the verbose status of the start
        assert discovery.container(app.id) is None
        assert discovery_tasks() == set()

    async def test_sandbox_events_refresh_the_pod(
        self, discovery: Discovery, recorder: DiscoveryRecorder, runtime: FakeRuntime
    ) -> None:
        """An event whose ID is a known sandbox refreshes that sandbox with PodSandboxStatus."""
        sandbox = runtime.add_sandbox("web", ip="10.1.2.3")
        async with running(discovery, mode="events", relist_period=HUGE, safety_relist_period=HUGE):
            await recorder.wait_for(EventKind.POD_CHANGED, sandbox.id)
            await until(lambda: runtime.event_subscribers == 1, changed=runtime.subscribers_changed)
            sandbox.ready, sandbox.ip = False, ""
            runtime.emit(sandbox.id, api_pb2.CONTAINER_STOPPED_EVENT)
            changed = await recorder.wait_for(EventKind.POD_CHANGED, sandbox.id)
        assert changed.pod is not None
        assert (changed.pod.ready, changed.pod.ip) == (False, "")
        assert runtime.calls.count("ListPodSandbox") == 1

    async def test_event_for_an_unplaceable_id_relists(
        self, discovery: Discovery, recorder: DiscoveryRecorder, runtime: FakeRuntime
    ) -> None:
        """An unknown ID whose event names no sandbox is resolved by a full relist."""
        async with running(discovery, mode="events", relist_period=HUGE, safety_relist_period=HUGE):
            await until(lambda: runtime.event_subscribers == 1 and discovery.healthy())
            sandbox = runtime.add_sandbox("web")
            runtime.emit(sandbox.id, api_pb2.CONTAINER_CREATED_EVENT)
            await recorder.wait_for(EventKind.POD_CHANGED, sandbox.id)
        assert runtime.calls.count("ListPodSandbox") == 2

    async def test_failed_refresh_relists_soon(
        self, discovery: Discovery, recorder: DiscoveryRecorder, runtime: FakeRuntime
    ) -> None:
        """A status call failing after an event makes the next relist due after relist_period."""
        sandbox = runtime.add_sandbox("web")
        async with running(discovery, mode="events", relist_period=0.01, safety_relist_period=HUGE):
            await recorder.wait_for(EventKind.POD_CHANGED, sandbox.id)
            await until(lambda: runtime.event_subscribers == 1, changed=runtime.subscribers_changed)
            runtime.fail_next("ContainerStatus", grpc.StatusCode.INTERNAL)
            app = runtime.add_container(sandbox, "app")
            await recorder.wait_for(EventKind.STARTED, app.id)
        assert runtime.calls.count("ListContainers") == 2

    async def test_stream_end_reconnects_and_relists(
        self, discovery: Discovery, recorder: DiscoveryRecorder, runtime: FakeRuntime
    ) -> None:
        """A change made while the stream is down is found by the relist after reconnecting."""
        app = runtime.add_container(runtime.add_sandbox("web"), "app")
        with structlog.testing.capture_logs() as logs:
            async with running(
                discovery, mode="events", relist_period=HUGE, safety_relist_period=HUGE
            ):
                await recorder.wait_for(EventKind.STARTED, app.id)
                await until(
                    lambda: runtime.event_subscribers == 1, changed=runtime.subscribers_changed
                )
                runtime.end_event_streams()
                # Queued behind the end-of-stream marker, so the old stream never delivers it.
                runtime.exit_container(app.id, exit_code=9)
                died = await recorder.wait_for(EventKind.DIED, app.id)
        assert died.container is not None
        assert died.container.exit_code == 9
        assert runtime.calls.count("GetContainerEvents") == 2
        assert runtime.calls.count("ListContainers") == 2
        assert [
            entry["error"] for entry in logs if entry["event"] == "events_stream_reconnect"
        ] == ["stream ended"]

    async def test_stream_errors_back_off_exponentially(
        self, cri: CriClient, runtime: FakeRuntime
    ) -> None:
        """Failed connects are retried after doubling delays, capped at backoff_max."""
        discovery = Discovery(cri, backoff_initial=0.05, backoff_max=0.2)
        recorder = DiscoveryRecorder(discovery)
        runtime.fail_next("GetContainerEvents", *[grpc.StatusCode.UNAVAILABLE] * 4)
        with structlog.testing.capture_logs() as logs:
            async with running(
                discovery, mode="events", relist_period=HUGE, safety_relist_period=HUGE
            ):
                await until(
                    lambda: runtime.event_subscribers == 1, changed=runtime.subscribers_changed
                )
                app = runtime.add_container(runtime.add_sandbox("web"), "app")
                await recorder.wait_for(EventKind.STARTED, app.id)
        reconnects = [entry for entry in logs if entry["event"] == "events_stream_reconnect"]
        assert [entry["retry_in"] for entry in reconnects] == [0.05, 0.1, 0.2, 0.2]
        assert all("UNAVAILABLE" in entry["error"] for entry in reconnects)
        assert runtime.calls.count("GetContainerEvents") == 5

    async def test_unimplemented_falls_back_to_relist_for_good(
        self, discovery: Discovery, recorder: DiscoveryRecorder, runtime: FakeRuntime
    ) -> None:
        """A runtime without GetContainerEvents (containerd 1.6) is relisted instead."""
        runtime.unimplemented.add("GetContainerEvents")
        app = runtime.add_container(runtime.add_sandbox("web"), "app")
        with structlog.testing.capture_logs() as logs:
            async with running(
                discovery, mode="events", relist_period=0.01, safety_relist_period=HUGE
            ):
                await recorder.wait_for(EventKind.STARTED, app.id)
                runtime.exit_container(app.id)
                # Events mode relists once per connect: only the relist loop can see this.
                await recorder.wait_for(EventKind.DIED, app.id)
                assert discovery.effective_mode == "relist"
        assert runtime.calls.count("GetContainerEvents") == 1
        assert [entry["event"] for entry in logs].count("pleg_fallback_relist") == 1


class TestModeSelection:
    """auto picks events only on containerd >= 2.0, which broadcasts events to every stream."""

    @pytest.mark.parametrize(
        ("name", "version", "expected"),
        [
            ("containerd", "v2.1.9", "events"),
            ("containerd", "2.1.9+unknown", "events"),
            ("containerd", "v2.0.0", "events"),
            ("containerd", "v1.7.27", "relist"),
            ("containerd", "1.6.20~ds1", "relist"),
            ("containerd", "devel", "relist"),
            ("cri-o", "1.31.0", "relist"),
            ("fake", "0.0.0-fake", "relist"),
        ],
    )
    def test_pick_mode(self, name: str, version: str, expected: str) -> None:
        """The runtime name and a leniently parsed version decide the mode."""
        assert expected == pick_mode(RuntimeVersion("0.1.0", name, version, "v1"))

    def test_containerd_version_parses_distro_builds(self) -> None:
        """Release tags and distro version strings give (major, minor)."""
        versions = ["v2.1.9", "2.1.9+unknown", "1.6.20~ds1"]
        parsed = [
            containerd_version(RuntimeVersion("0.1.0", "containerd", v, "v1")) for v in versions
        ]
        assert parsed == [(2, 1), (2, 1), (1, 6)]

    @pytest.mark.parametrize(("version", "expected"), [("v2.1.9", "events"), ("v1.7.27", "relist")])
    async def test_auto_asks_the_runtime(
        self,
        discovery: Discovery,
        recorder: DiscoveryRecorder,
        runtime: FakeRuntime,
        version: str,
        expected: str,
    ) -> None:
        """run(mode="auto") calls Version and follows events or relists accordingly."""
        runtime.runtime_name, runtime.runtime_version = "containerd", version
        sandbox = runtime.add_sandbox("web")
        async with running(discovery, mode="auto", relist_period=0.01):
            await recorder.wait_for(EventKind.POD_CHANGED, sandbox.id)
            assert discovery.effective_mode == expected
        assert ("GetContainerEvents" in runtime.calls) == (expected == "events")

    async def test_auto_retries_an_unavailable_runtime(
        self, discovery: Discovery, recorder: DiscoveryRecorder, runtime: FakeRuntime
    ) -> None:
        """Version failing (containerd still starting) is retried until it answers."""
        runtime.runtime_name, runtime.runtime_version = "containerd", "v2.1.9"
        runtime.fail_next("Version", *[grpc.StatusCode.UNAVAILABLE] * 3)
        sandbox = runtime.add_sandbox("web")
        with structlog.testing.capture_logs() as logs:
            async with running(discovery, mode="auto"):
                await recorder.wait_for(EventKind.POD_CHANGED, sandbox.id)
                assert discovery.effective_mode == "events"
        assert [entry["event"] for entry in logs].count("runtime_version_failed") == 1

    @pytest.mark.parametrize(("version", "warned"), [("v1.7.27", True), ("v2.1.9", False)])
    async def test_forced_events_on_containerd_17_warns(
        self,
        discovery: Discovery,
        recorder: DiscoveryRecorder,
        runtime: FakeRuntime,
        version: str,
        warned: bool,
    ) -> None:
        """Forcing events on containerd 1.7 warns that it steals the kubelet's events."""
        runtime.runtime_name, runtime.runtime_version = "containerd", version
        sandbox = runtime.add_sandbox("web")
        with structlog.testing.capture_logs() as logs:
            async with running(discovery, mode="events", safety_relist_period=HUGE):
                await recorder.wait_for(EventKind.POD_CHANGED, sandbox.id)
                assert discovery.effective_mode == "events"
        warnings = [entry for entry in logs if entry["event"] == "events_mode_splits_events"]
        assert bool(warnings) is warned
        if warned:
            assert warnings[0]["log_level"] == "warning"
            assert "only one subscriber" in warnings[0]["reason"]
            assert "kubelet" in warnings[0]["reason"]


class TestScale:
    """Thousands of containers coming and going in batches stay exact and cheap."""

    async def test_two_thousand_containers_in_batches(
        self, discovery: Discovery, recorder: DiscoveryRecorder, runtime: FakeRuntime
    ) -> None:
        """Each relist reports exactly its batch; statuses are fetched once per new object."""
        batches = []
        for _ in range(4):
            batch = []
            for _ in range(50):
                sandbox = runtime.add_sandbox("pod")
                batch.append(
                    (sandbox, [runtime.add_container(sandbox, f"c{i}") for i in range(10)])
                )
            events = await discovery.relist()
            assert sorted(_kinds(events)) == sorted(
                [(EventKind.POD_CHANGED, s.id) for s, _ in batch]
                + [(EventKind.STARTED, c.id) for _, cs in batch for c in cs]
            )
            batches.append(batch)
        assert len(discovery.containers()) == 2000
        assert status_calls(runtime) == (200, 2000)
        assert await discovery.relist() == []

        for batch in batches:
            for _, containers in batch:
                for container in containers[:5]:
                    runtime.exit_container(container.id)
            events = await discovery.relist()
            assert sorted(_kinds(events)) == sorted(
                (EventKind.DIED, c.id) for _, cs in batch for c in cs[:5]
            )
            for sandbox, _ in batch:
                runtime.remove_sandbox(sandbox.id)
            events = await discovery.relist()
            expected = []
            for sandbox, containers in batch:
                expected += [(EventKind.REMOVED, c.id) for c in containers]
                expected += [(EventKind.DIED, c.id) for c in containers[5:]]  # never seen exited
                expected.append((EventKind.POD_REMOVED, sandbox.id))
            assert sorted(_kinds(events)) == sorted(expected)

        assert (dict(discovery.containers()), dict(discovery.pods())) == ({}, {})
        # One status call per exit; disappearances need none.
        assert status_calls(runtime) == (200, 3000)
        assert len(recorder.seen) == (200 + 2000) + 1000 + (2000 + 1000 + 200)
        assert discovery_tasks() == set()


class TestViewMemory:
    """The view holds one object per container of a node (issue 36): it keeps the strings the
    CRI client already holds for its listings, and one copy of the names every pod shares."""

    async def test_the_view_shares_the_listings_strings(
        self, discovery: Discovery, runtime: FakeRuntime, cri: CriClient
    ) -> None:
        for i in range(2):
            runtime.add_container(runtime.add_sandbox(f"web-{i}", namespace="shop"), "app")

        await discovery.relist()

        # An unchanged listing answers with the very objects it holds (and the view's came
        # from it): one copy of each ID and name, not a second from the status call.
        sandboxes = {s.id: s for s in await cri.list_pod_sandboxes()}
        for listed in await cri.list_containers():
            info = discovery.container(listed.id)
            assert info is not None
            sandbox = sandboxes[listed.pod_sandbox_id]
            assert info.id is listed.id
            assert info.pod.sandbox_id is sandbox.id
            assert info.pod_sandbox_id is sandbox.id
            assert (info.pod.name, info.pod.uid) == (sandbox.name, sandbox.uid)
            assert info.pod.name is sandbox.name
            assert info.pod.uid is sandbox.uid
        first, second = discovery.containers().values()
        # What every pod of a namespace and every replica shares: one string each.
        assert first.pod.namespace == "shop"
        assert first.pod.namespace is second.pod.namespace
        assert first.name == "app"
        assert first.name is second.name

    async def test_envs_share_their_names_and_values(
        self, discovery: Discovery, runtime: FakeRuntime
    ) -> None:
        service = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
        with_env = [
            runtime.add_container(runtime.add_sandbox(f"web-{i}"), "app", env=service)
            for i in range(2)
        ]
        without = [runtime.add_container(runtime.add_sandbox(f"db-{i}"), "db") for i in range(2)]

        await discovery.relist()

        first, second = (discovery.container(c.id) for c in with_env)
        assert first is not None
        assert second is not None
        assert first.env == second.env == service
        assert first.env is not None
        assert second.env is not None
        for (name, value), (other_name, other_value) in zip(
            first.env.items(), second.env.items(), strict=True
        ):
            assert name is other_name
            assert value is other_value
        empty = [discovery.container(c.id) for c in without]
        assert [info.env for info in empty if info is not None] == [{}, {}]
        assert empty[0] is not None
        assert empty[1] is not None
        assert empty[0].env is empty[1].env  # one shared empty map, not a dict each

    async def test_statuses_are_not_held_while_the_view_is_committed(
        self, discovery: Discovery, runtime: FakeRuntime
    ) -> None:
        """Each status becomes its view object as it arrives: when the view is published (and
        the manager starts a node's workers from it) no status of the relist is alive. Holding
        them all meanwhile left their memory as pymalloc's unused pools at 5,000 containers."""
        for i in range(40):
            runtime.add_container(runtime.add_sandbox(f"web-{i}"), "app")

        def statuses() -> int:
            # Counted against what was alive before (another test's leftovers, say).
            return sum(isinstance(o, ContainerStatus | SandboxStatus) for o in gc.get_objects())

        alive: list[int] = []

        def count(update: DiscoveryUpdate) -> None:
            if not isinstance(update, Relisted):  # the view's change, published by the commit
                alive.append(statuses() - before)

        discovery.updates.subscribe(count)
        gc.collect()
        before = statuses()
        await discovery.relist()

        assert len(discovery.containers()) == 40
        assert alive == [0]
