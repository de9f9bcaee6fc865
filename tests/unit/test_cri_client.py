"""CriClient against the in-process fake runtime: retries, error mapping, exec deadlines and cap."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.errors import CriError, CriNotFound, CriUnavailable, CriUnimplemented
from cri_prober.probing.outcome import MAX_OUTPUT_BYTES
from cri_prober.runtime.client import ContainerState, CriClient
from tests.support.fake_runtime import FakeContainer, FakeRuntime, FakeRuntimeServer


@pytest.fixture(name="server")
async def _server(tmp_path: Path) -> AsyncIterator[FakeRuntimeServer]:
    async with FakeRuntimeServer(str(tmp_path / "cri.sock")) as server:
        yield server


@pytest.fixture(name="runtime")
def _runtime(server: FakeRuntimeServer) -> FakeRuntime:
    return server.runtime


@pytest.fixture(name="cri")
async def _cri(server: FakeRuntimeServer) -> AsyncIterator[CriClient]:
    async with CriClient.connect(
        server.target, max_concurrent_execs=3, exec_deadline_margin=0.5, retry_wait_max=0.05
    ) as client:
        yield client


async def test_version_round_trips(cri: CriClient) -> None:
    """Version returns the runtime's fields as our dataclass."""
    info = await cri.version()
    assert (
        info.runtime_name,
        info.runtime_version,
        info.runtime_api_version,
    ) == ("fake", "0.0.0-fake", "v1")


async def test_unavailable_is_retried_then_succeeds(cri: CriClient, runtime: FakeRuntime) -> None:
    """Two UNAVAILABLE answers to an idempotent read are retried away."""
    sandbox = runtime.add_sandbox("web")
    runtime.add_container(sandbox, "app")
    runtime.fail_next("ListContainers", grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE)
    containers = await cri.list_containers()
    assert [c.name for c in containers] == ["app"]
    assert runtime.calls.count("ListContainers") == 3


async def test_unavailable_gives_up_after_three_attempts(
    cri: CriClient, runtime: FakeRuntime
) -> None:
    """A runtime that stays UNAVAILABLE surfaces as CriUnavailable after 3 attempts."""
    runtime.fail_next("Version", *[grpc.StatusCode.UNAVAILABLE] * 5)
    with pytest.raises(CriUnavailable):
        await cri.version()
    assert runtime.calls.count("Version") == 3


async def test_not_found_is_not_retried(cri: CriClient, runtime: FakeRuntime) -> None:
    """NOT_FOUND is final: one call, CriNotFound."""
    with pytest.raises(CriNotFound) as caught:
        await cri.container_status("f" * 64)
    assert runtime.calls.count("ContainerStatus") == 1
    assert caught.value.code == grpc.StatusCode.NOT_FOUND


async def test_other_codes_map_to_plain_cri_error(cri: CriClient, runtime: FakeRuntime) -> None:
    """An unmapped code (INTERNAL) is a CriError carrying the code and is not retried."""
    runtime.fail_next("ListPodSandbox", grpc.StatusCode.INTERNAL)
    with pytest.raises(CriError) as caught:
        await cri.list_pod_sandboxes()
    assert type(caught.value) is CriError
    assert caught.value.code == grpc.StatusCode.INTERNAL
    assert runtime.calls.count("ListPodSandbox") == 1


async def test_unimplemented_events_surface_as_such(cri: CriClient, runtime: FakeRuntime) -> None:
    """A runtime without GetContainerEvents raises CriUnimplemented on first read."""
    runtime.unimplemented.add("GetContainerEvents")
    with pytest.raises(CriUnimplemented):
        async for _ in cri.container_events():
            pass


async def test_exec_sync_is_never_retried(cri: CriClient, runtime: FakeRuntime) -> None:
    """ExecSync may have side effects: UNAVAILABLE is raised at once, not retried."""
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    runtime.fail_next("ExecSync", grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(CriUnavailable):
        await cri.exec_sync(container.id, ["true"], timeout=1)
    assert runtime.calls.count("ExecSync") == 1


async def test_exec_runtime_timeout_is_a_timeout(cri: CriClient, runtime: FakeRuntime) -> None:
    """The runtime's DEADLINE_EXCEEDED comes back as a timed-out result, not an error."""

    async def hang(_c: FakeContainer, _cmd: list[str], _t: int) -> api_pb2.ExecSyncResponse:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    runtime.exec_handler = hang
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    result = await cri.exec_sync(container.id, ["sleep", "9"], timeout=1)
    assert result.timed_out
    assert result.exit_code is None
    assert "timeout 1s exceeded" in result.message


async def test_exec_client_deadline_bounds_a_hung_runtime(
    cri: CriClient, runtime: FakeRuntime
) -> None:
    """When the runtime ignores its timeout (child holding stdout), the client deadline ends it."""

    async def hang(_c: FakeContainer, _cmd: list[str], _t: int) -> api_pb2.ExecSyncResponse:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    runtime.exec_handler = hang
    runtime.enforce_exec_timeout = False
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    loop = asyncio.get_running_loop()
    started = loop.time()
    result = await cri.exec_sync(container.id, ["sh", "-c", "sleep 1d &"], timeout=1)
    assert result.timed_out
    # timeout (1 s) + margin (0.5 s), with slack for a loaded machine.
    assert loop.time() - started < 1.5 + 2.0


async def test_exec_output_is_capped_like_the_kubelet(cri: CriClient, runtime: FakeRuntime) -> None:
    """stdout then stderr are kept up to 10 KiB in total; huge replies still arrive."""

    async def chatty(_c: FakeContainer, _cmd: list[str], _t: int) -> api_pb2.ExecSyncResponse:
        return api_pb2.ExecSyncResponse(
            stdout=b"o" * (8 * 1024), stderr=b"e" * (20 * 1024 * 1024), exit_code=3
        )

    runtime.exec_handler = chatty
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    result = await cri.exec_sync(container.id, ["x"], timeout=5)
    assert result.exit_code == 3
    assert result.stdout == b"o" * (8 * 1024)
    assert result.stderr == b"e" * (MAX_OUTPUT_BYTES - 8 * 1024)


async def test_exec_concurrency_cap_holds(cri: CriClient, runtime: FakeRuntime) -> None:
    """With a cap of 3, never more than 3 ExecSync calls reach the runtime at once."""
    release = asyncio.Event()
    entered = asyncio.Condition()

    async def gated(_c: FakeContainer, _cmd: list[str], _t: int) -> api_pb2.ExecSyncResponse:
        async with entered:
            entered.notify_all()
        await release.wait()
        return api_pb2.ExecSyncResponse(exit_code=0)

    runtime.exec_handler = gated
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    calls = [
        asyncio.create_task(cri.exec_sync(container.id, ["true"], timeout=30)) for _ in range(12)
    ]
    async with entered:
        await entered.wait_for(lambda: runtime.execs_in_flight >= 3)
    # Asserting that something does *not* happen needs a window: give the other nine calls
    # time to (wrongly) reach the runtime before looking.
    await asyncio.sleep(0.3)
    assert runtime.execs_in_flight == 3
    assert cri.execs_in_flight == 3
    release.set()
    results = await asyncio.gather(*calls)
    assert all(r.exit_code == 0 for r in results)
    assert runtime.max_execs_in_flight == 3
    assert cri.execs_in_flight == 0


async def test_list_and_status_map_fields(cri: CriClient, runtime: FakeRuntime) -> None:
    """Sandbox and container listings carry metadata, labels, state and timestamps."""
    sandbox = runtime.add_sandbox("web-1", namespace="shop", ip="10.0.0.7", labels={"tier": "web"})
    container = runtime.add_container(sandbox, "app", attempt=2)
    [listed_sandbox] = await cri.list_pod_sandboxes()
    assert ("web-1", "shop", sandbox.uid, {"tier": "web"}) == (
        listed_sandbox.name,
        listed_sandbox.namespace,
        listed_sandbox.uid,
        listed_sandbox.labels,
    )
    [listed] = await cri.list_containers(state=ContainerState.CONTAINER_RUNNING)
    assert (container.id, "app", 2, ContainerState.CONTAINER_RUNNING) == (
        listed.id,
        listed.name,
        listed.attempt,
        listed.state,
    )
    assert listed.labels["io.kubernetes.pod.namespace"] == "shop"
    assert await cri.list_containers(state=ContainerState.CONTAINER_CREATED) == []
    status = await cri.container_status(container.id[:12])
    assert status.id == container.id
    assert status.started_at > 0
    sandbox_status = await cri.pod_sandbox_status(sandbox.id)
    assert (sandbox_status.ip, sandbox_status.host_network) == ("10.0.0.7", False)


async def test_stop_container_treats_not_found_as_stopped(
    cri: CriClient, runtime: FakeRuntime
) -> None:
    """Older containerd answers NOT_FOUND for an unknown ID: that is already stopped."""
    runtime.fail_next("StopContainer", grpc.StatusCode.NOT_FOUND)
    await cri.stop_container("a" * 64, grace_seconds=2)
    assert runtime.calls == ["StopContainer"]
