"""The in-memory CRI channel (tests/support/memory_cri.py): calls round-trip through bytes, errors
reach CriClient as they do over gRPC (compared with FakeRuntimeServer), deadlines fire, the events
stream works, and closing cancels what is in flight without leaving a servicer running."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from cri_prober._gen.runtime.v1 import api_pb2, api_pb2_grpc
from cri_prober.errors import CriError, CriNotFound, CriUnavailable, CriUnimplemented
from cri_prober.runtime.client import MAX_RECEIVE_MESSAGE_BYTES, CriClient
from cri_prober.runtime.model import ContainerEventType, ContainerState
from tests.support.fake_runtime import FakeContainer, FakeRuntime, FakeRuntimeServer
from tests.support.memory_cri import MemoryChannel, memory_client
from tests.support.waiting import until

MiB = 1024 * 1024


async def hang(_c: FakeContainer, _cmd: list[str], _t: int) -> api_pb2.ExecSyncResponse:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


@contextlib.asynccontextmanager
async def over(transport: str, runtime: FakeRuntime, tmp_path: Path) -> AsyncIterator[CriClient]:
    """A CriClient on ``runtime`` over the in-memory channel or a real gRPC socket."""
    if transport == "memory":
        async with memory_client(runtime, retry_wait_max=0.01) as cri:
            yield cri
        return
    async with (
        FakeRuntimeServer(str(tmp_path / "cri.sock"), runtime) as server,
        CriClient.connect(server.target, retry_wait_max=0.01) as cri,
    ):
        yield cri


@pytest.fixture(name="runtime")
def _runtime() -> FakeRuntime:
    return FakeRuntime()


@pytest.fixture(name="cri")
async def _cri(runtime: FakeRuntime) -> AsyncIterator[CriClient]:
    async with memory_client(runtime, retry_wait_max=0.01) as cri:
        yield cri


async def test_calls_round_trip(cri: CriClient, runtime: FakeRuntime) -> None:
    sandbox = runtime.add_sandbox("web", ip="10.0.0.7")
    container = runtime.add_container(sandbox, "app", env={"MODE": "blue"})

    version = await cri.version()
    sandboxes = await cri.list_pod_sandboxes()
    containers = await cri.list_containers(pod_sandbox_id=sandbox.id)
    status = await cri.container_status(container.id, verbose=True)
    sandbox_status = await cri.pod_sandbox_status(sandbox.id)

    assert (version.runtime_name, version.runtime_api_version) == ("fake", "v1")
    assert [(s.id, s.name) for s in sandboxes] == [(sandbox.id, "web")]
    assert [(c.id, c.name, c.state) for c in containers] == [
        (container.id, "app", ContainerState.CONTAINER_RUNNING)
    ]
    assert status.env == {"MODE": "blue"}
    assert sandbox_status.ip == "10.0.0.7"
    assert runtime.calls == [
        "Version",
        "ListPodSandbox",
        "ListContainers",
        "ContainerStatus",
        "PodSandboxStatus",
    ]


async def test_exec_round_trips(cri: CriClient, runtime: FakeRuntime) -> None:
    container = runtime.add_container(runtime.add_sandbox("web"), "app")

    async def echo(_c: FakeContainer, cmd: list[str], timeout: int) -> api_pb2.ExecSyncResponse:
        return api_pb2.ExecSyncResponse(exit_code=3, stdout=f"{cmd} {timeout}".encode())

    runtime.exec_handler = echo
    result = await cri.exec_sync(container.id, ["cat", "/ready"], timeout=2)
    assert (result.exit_code, result.stdout) == (3, b"['cat', '/ready'] 2")


async def test_requests_travel_as_bytes(runtime: FakeRuntime) -> None:
    """The servicer gets the request parsed from the bytes the client's serializer wrote, as its
    own message type: a request of the wrong type arrives as what its bytes say."""
    container = runtime.add_container(runtime.add_sandbox("web"), "app")
    async with MemoryChannel(runtime) as channel:
        call = channel.unary_unary(
            "/runtime.v1.RuntimeService/ContainerStatus",
            # PodSandboxStatusRequest's field 1 is pod_sandbox_id; ContainerStatusRequest's is
            # container_id.
            request_serializer=api_pb2.PodSandboxStatusRequest.SerializeToString,
            response_deserializer=api_pb2.ContainerStatusResponse.FromString,
        )
        response = await call(api_pb2.PodSandboxStatusRequest(pod_sandbox_id=container.id))
    assert isinstance(response, api_pb2.ContainerStatusResponse)
    assert response.status.id == container.id


async def _unavailable(runtime: FakeRuntime, cri: CriClient) -> object:
    runtime.fail_next("Version", *[grpc.StatusCode.UNAVAILABLE] * 3)
    return await cri.version()


async def _not_found(runtime: FakeRuntime, cri: CriClient) -> object:
    return await cri.container_status("nope")


async def _unimplemented_events(runtime: FakeRuntime, cri: CriClient) -> object:
    runtime.unimplemented.add("GetContainerEvents")
    return [event async for event in cri.container_events()]


async def _handler_bug(runtime: FakeRuntime, cri: CriClient) -> object:
    container = runtime.add_container(runtime.add_sandbox("web"), "app")

    async def broken(_c: FakeContainer, _cmd: list[str], _t: int) -> api_pb2.ExecSyncResponse:
        raise RuntimeError("kaput")

    runtime.exec_handler = broken
    return await cri.exec_sync(container.id, ["true"], timeout=1)


async def _oversized_reply(runtime: FakeRuntime, cri: CriClient) -> object:
    container = runtime.add_container(runtime.add_sandbox("web"), "app")

    async def flood(_c: FakeContainer, _cmd: list[str], _t: int) -> api_pb2.ExecSyncResponse:
        return api_pb2.ExecSyncResponse(stdout=b"x" * (MAX_RECEIVE_MESSAGE_BYTES + 1))

    runtime.exec_handler = flood
    return await cri.exec_sync(container.id, ["true"], timeout=1)


@pytest.mark.parametrize(
    ("failing_call", "error_type"),
    [
        (_unavailable, CriUnavailable),
        (_not_found, CriNotFound),
        (_unimplemented_events, CriUnimplemented),
        (_handler_bug, CriError),
        (_oversized_reply, CriError),
    ],
)
async def test_errors_match_the_grpc_server(
    failing_call: Callable[[FakeRuntime, CriClient], Awaitable[object]],
    error_type: type[CriError],
    tmp_path: Path,
) -> None:
    """The same failure raises the same CriError, code and details in memory as over gRPC."""
    seen: dict[str, tuple[type[CriError], grpc.StatusCode, str]] = {}
    for transport in ("socket", "memory"):
        runtime = FakeRuntime()
        async with over(transport, runtime, tmp_path) as cri:
            with pytest.raises(CriError) as caught:
                await failing_call(runtime, cri)
        seen[transport] = (type(caught.value), caught.value.code, caught.value.details)
    assert seen["memory"] == seen["socket"]
    assert seen["memory"][0] is error_type


async def test_a_call_deadline_fires_and_cancels_the_servicer(runtime: FakeRuntime) -> None:
    container = runtime.add_container(runtime.add_sandbox("web"), "app")
    runtime.exec_handler = hang
    async with MemoryChannel(runtime) as channel:
        stub = api_pb2_grpc.RuntimeServiceStub(channel)  # type: ignore[call-overload]
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ExecSync(
                api_pb2.ExecSyncRequest(container_id=container.id, cmd=["sleep"]), timeout=0.05
            )
        assert runtime.execs_in_flight == 0  # the servicer ended before the caller heard
        assert channel.calls_in_flight == 0
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert caught.value.details() == "Deadline Exceeded"


async def test_an_exec_past_its_deadline_is_a_timeout(runtime: FakeRuntime) -> None:
    """Through CriClient: an ExecSync the runtime never answers ends at the client's deadline
    (timeout 0: the runtime request timeout) as a timed-out result."""
    container = runtime.add_container(runtime.add_sandbox("web"), "app")
    runtime.exec_handler = hang
    async with memory_client(runtime, runtime_request_timeout=0.05) as cri:
        result = await cri.exec_sync(container.id, ["sleep"], timeout=0)
    assert result.timed_out
    assert result.message == "Deadline Exceeded"
    assert runtime.execs_in_flight == 0


async def test_the_servicer_sees_the_deadline(runtime: FakeRuntime) -> None:
    remaining: list[float | None] = []

    class Watching(FakeRuntime):
        async def Version(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
            remaining.append(context.time_remaining())
            return await super().Version(request, context)  # type: ignore[no-untyped-call]

    async with memory_client(Watching(), call_timeout=5.0) as cri:
        await cri.version()
    assert len(remaining) == 1
    assert remaining[0] is not None
    assert 4.0 < remaining[0] <= 5.0


@pytest.mark.parametrize("transport", ["socket", "memory"])
async def test_set_code_ends_the_call_with_it(transport: str, tmp_path: Path) -> None:
    class Refusing(FakeRuntime):
        async def Status(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
            context.set_code(grpc.StatusCode.FAILED_PRECONDITION)
            context.set_details("not today")
            return api_pb2.StatusResponse()

    async with over(transport, Refusing(), tmp_path) as cri:
        with pytest.raises(CriError) as caught:
            await cri.status()
    assert (caught.value.code, caught.value.details) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "not today",
    )


async def test_events_stream(cri: CriClient, runtime: FakeRuntime) -> None:
    sandbox = runtime.add_sandbox("web")
    events = cri.container_events()
    first = asyncio.ensure_future(anext(events))
    await until(lambda: runtime.event_subscribers == 1, changed=runtime.subscribers_changed)
    container = runtime.add_container(sandbox, "app")
    event = await first
    assert (event.container_id, event.type) == (
        container.id,
        ContainerEventType.CONTAINER_STARTED_EVENT,
    )
    assert event.sandbox is not None
    assert event.sandbox.sandbox.id == sandbox.id
    assert [status.id for status in event.containers] == [container.id]

    runtime.end_event_streams()  # a stream the runtime ends ends the iteration
    with pytest.raises(StopAsyncIteration):
        await anext(events)
    await until(lambda: runtime.event_subscribers == 0, changed=runtime.subscribers_changed)


async def test_a_reader_that_stops_ends_the_stream(cri: CriClient, runtime: FakeRuntime) -> None:
    sandbox = runtime.add_sandbox("web")
    events = cri.container_events()
    first = asyncio.ensure_future(anext(events))
    await until(lambda: runtime.event_subscribers == 1, changed=runtime.subscribers_changed)
    runtime.add_container(sandbox, "app")
    await first
    await events.aclose()  # type: ignore[attr-defined]  # an async generator
    await until(lambda: runtime.event_subscribers == 0, changed=runtime.subscribers_changed)


async def test_a_cancelled_caller_cancels_its_call(cri: CriClient, runtime: FakeRuntime) -> None:
    container = runtime.add_container(runtime.add_sandbox("web"), "app")
    runtime.exec_handler = hang
    task = asyncio.create_task(cri.exec_sync(container.id, ["sleep"], timeout=0))
    await until(lambda: runtime.execs_in_flight == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert runtime.execs_in_flight == 0
    assert cri.execs_outstanding == 0


async def test_close_cancels_calls_in_flight(runtime: FakeRuntime) -> None:
    """As with grpc.aio: calls cut by close() raise CancelledError in their callers, their
    servicers have ended by the time close() returns, and new calls are a UsageError."""
    container = runtime.add_container(runtime.add_sandbox("web"), "app")
    runtime.exec_handler = hang
    channel = MemoryChannel(runtime)
    cri = CriClient(channel)  # type: ignore[arg-type]  # the part of grpc.aio.Channel it uses

    async def read_events() -> None:
        async for _ in cri.container_events():
            pass

    exec_call = asyncio.create_task(cri.exec_sync(container.id, ["sleep"], timeout=0))
    events = asyncio.create_task(read_events())
    await until(lambda: runtime.execs_in_flight == 1 and runtime.event_subscribers == 1)

    await cri.close()

    assert channel.calls_in_flight == 0
    assert (runtime.execs_in_flight, runtime.event_subscribers) == (0, 0)
    for task in (exec_call, events):
        with pytest.raises(asyncio.CancelledError):
            await task
    with pytest.raises(grpc.aio.UsageError, match="Channel is closed"):
        await cri.version()
