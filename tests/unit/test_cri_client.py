"""CriClient against the in-process fake runtime: retries, error mapping, exec deadlines and cap.

The exec tests follow the kubelet's CRI client (cri-client remote_runtime.go ExecSync and its
16 MiB receive limit) and containerd's ExecSync, which answers only once the exec's output has
drained: the fake runtime's ``exec_drain`` plays the background child that delays it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.errors import CriError, CriNotFound, CriUnavailable, CriUnimplemented
from cri_prober.probing.outcome import MAX_OUTPUT_BYTES
from cri_prober.runtime.client import (
    DEFAULT_EXEC_SLOT_MARGIN,
    DEFAULT_RUNTIME_REQUEST_TIMEOUT,
    MAX_RECEIVE_MESSAGE_BYTES,
    CriClient,
)
from cri_prober.runtime.exec_slots import ExecSlot
from cri_prober.runtime.model import MAX_EXEC_OUTPUT_BYTES, ContainerState, SandboxState
from tests.support.fake_runtime import FakeContainer, FakeRuntime, FakeRuntimeServer
from tests.support.waiting import HANG_GUARD

# Short stand-ins for the runtime request timeout and the slot margin, so deadlines end quickly.
RUNTIME_REQUEST_TIMEOUT = 0.5
SLOT_MARGIN = 0.2
MiB = 1024 * 1024


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
        server.target,
        max_concurrent_execs=3,
        runtime_request_timeout=RUNTIME_REQUEST_TIMEOUT,
        exec_slot_margin=SLOT_MARGIN,
        retry_wait_max=0.05,
    ) as client:
        yield client


@pytest.fixture(name="cri_one_slot")
async def _cri_one_slot(server: FakeRuntimeServer) -> AsyncIterator[CriClient]:
    """A client with a single exec slot, to see when an exec gives its slot back at timeout +
    margin. The start hold is out of the way (it is as long as the hold): giving the slot to a
    waiting call earlier is test_exec_fairness's business."""
    async with CriClient.connect(
        server.target,
        max_concurrent_execs=1,
        runtime_request_timeout=5.0,
        exec_slot_margin=SLOT_MARGIN,
        exec_start_hold=3600,
    ) as client:
        yield client


async def hang(_c: FakeContainer, _cmd: list[str], _t: int) -> api_pb2.ExecSyncResponse:
    """A command that never ends by itself."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def record_exec_deadlines(client: CriClient, monkeypatch: pytest.MonkeyPatch) -> list[float | None]:
    """The gRPC deadline (``timeout=``) of each ExecSync call the client makes, as it makes it:
    the deadline it computed, where a measured duration would only say how busy the machine was."""
    deadlines: list[float | None] = []
    stub = client._stub
    call = stub.ExecSync

    def recording(request: api_pb2.ExecSyncRequest, *, timeout: float | None = None) -> Any:
        deadlines.append(timeout)
        return call(request, timeout=timeout)

    monkeypatch.setattr(stub, "ExecSync", recording)
    return deadlines


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
    runtime.exec_handler = hang
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    result = await cri.exec_sync(container.id, ["sleep", "9"], timeout=1)
    assert result.timed_out
    assert result.exit_code is None
    assert "timeout 1s exceeded" in result.message
    # Answered at the timeout, as a killed command is: nothing was waited out past it.
    assert not result.drained_after_timeout


def test_defaults_are_the_kubelets() -> None:
    """The kubelet's --runtime-request-timeout default (2 min) and its 16 MiB receive limit."""
    assert DEFAULT_RUNTIME_REQUEST_TIMEOUT == 120.0
    assert MAX_RECEIVE_MESSAGE_BYTES == 16 * 1024 * 1024
    assert 0 < DEFAULT_EXEC_SLOT_MARGIN <= 2.0


def test_probing_and_the_runtime_cap_exec_output_alike() -> None:
    """Probing keeps its own output cap (it imports nothing from the runtime): the two agree."""
    assert MAX_OUTPUT_BYTES == MAX_EXEC_OUTPUT_BYTES == 10 * 1024


async def test_exec_client_deadline_is_timeout_plus_runtime_request_timeout(
    cri: CriClient, runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runtime that never answers is cut off at timeout + runtime request timeout, not sooner:
    that is the deadline the call carries, and gRPC's deadline is what ended it."""
    runtime.exec_handler = hang
    runtime.enforce_exec_timeout = False
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    deadlines = record_exec_deadlines(cri, monkeypatch)
    result = await cri.exec_sync(container.id, ["sh", "-c", "sleep 1d &"], timeout=1)
    assert deadlines == [1 + RUNTIME_REQUEST_TIMEOUT]
    assert result.timed_out
    assert result.message == "Deadline Exceeded"  # gRPC's own words: no answer came
    assert not result.drained_after_timeout  # our deadline, not an answer from the runtime
    assert (cri.execs_in_flight, cri.execs_overdue) == (0, 0)


async def test_exec_answer_after_the_timeout_is_kept_and_frees_its_slot_early(
    cri_one_slot: CriClient, runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """containerd answers a command whose child holds stdout once the output drains: exit 0 long
    after timeout 1 s is still exit 0. Meanwhile the exec slot went back at timeout + margin, so
    another exec ran to completion while the first call was still waiting."""
    bounds: list[float] = []  # each slot's longest hold, as bound (loop time)
    armed: list[tuple[float, str]] = []  # the exec slots' timer: when, and what it runs
    bound = ExecSlot.bound

    def recording_bound(slot: ExecSlot, *, soft_at: float, due: float, on_due: Any) -> None:
        bounds.append(due)
        bound(slot, soft_at=soft_at, due=due, on_due=on_due)

    loop = asyncio.get_running_loop()
    call_at = loop.call_at

    def recording_call_at(when: float, callback: Any, *args: Any, **kwargs: Any) -> Any:
        armed.append((when, getattr(callback, "__qualname__", repr(callback))))
        return call_at(when, callback, *args, **kwargs)

    monkeypatch.setattr(ExecSlot, "bound", recording_bound)
    monkeypatch.setattr(loop, "call_at", recording_call_at)
    drained = asyncio.Event()

    async def background_child(_c: FakeContainer, cmd: list[str]) -> None:
        if cmd[0] == "bg":
            await drained.wait()

    runtime.exec_drain = background_child
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    holding = asyncio.create_task(cri_one_slot.exec_sync(container.id, ["bg"], timeout=1))
    queued = asyncio.create_task(cri_one_slot.exec_sync(container.id, ["true"], timeout=1))
    other = await queued
    assert other.exit_code == 0
    # The queued exec got the only slot from the first call's give-back, bound at timeout +
    # margin (the start hold is out of the way), while the first call waited on; the slots'
    # one timer was armed for exactly that bound. (The second bound is the queued exec's own,
    # armed once it had the slot.)
    assert cri_one_slot.exec_call(container.id, ["bg"], timeout=1).hold == 1 + SLOT_MARGIN
    assert [when for when, name in armed if name == "ExecSlots._on_timer"] == bounds
    assert len(bounds) == 2
    assert not holding.done()
    assert (cri_one_slot.execs_in_flight, cri_one_slot.execs_overdue) == (0, 1)
    assert runtime.execs_in_flight == 1  # the runtime is still on it

    drained.set()
    result = await holding
    assert (result.exit_code, result.timed_out) == (0, False)
    # It answered once drained, so after its slot went back (above), and says it came late.
    assert result.drained_after_timeout
    assert (cri_one_slot.execs_in_flight, cri_one_slot.execs_overdue) == (0, 0)


async def test_exec_timeout_error_after_a_drain_is_marked(
    cri_one_slot: CriClient, runtime: FakeRuntime
) -> None:
    """Killed at its timeout, the command's output is still held: the runtime's timeout error
    comes late, and the result says it did."""
    drained = asyncio.Event()

    async def background_child(_c: FakeContainer, cmd: list[str]) -> None:
        if cmd[0] == "sh":
            await drained.wait()

    async def hang_unless_true(
        c: FakeContainer, cmd: list[str], t: int
    ) -> api_pb2.ExecSyncResponse:
        if cmd == ["true"]:
            return api_pb2.ExecSyncResponse(exit_code=0)
        return await hang(c, cmd, t)

    runtime.exec_handler = hang_unless_true
    runtime.exec_drain = background_child
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    call = asyncio.create_task(
        cri_one_slot.exec_sync(container.id, ["sh", "-c", "sleep 9 & sleep 60"], timeout=1)
    )
    # Queued behind the first call, this exec can only run once that call gave its slot back.
    queued = asyncio.create_task(cri_one_slot.exec_sync(container.id, ["true"], timeout=1))
    assert (await queued).exit_code == 0
    assert not call.done()
    drained.set()
    result = await call
    assert result.timed_out
    # Only a timeout error later than timeout + margin (here: after the slot went back and the
    # queued exec ran) is marked so.
    assert result.drained_after_timeout


async def test_exec_without_timeout_is_bounded_by_the_runtime_request_timeout(
    cri: CriClient, runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """timeout 0 asks the runtime for no limit; the runtime request timeout still ends the call."""
    deadlines = record_exec_deadlines(cri, monkeypatch)
    seen: list[int] = []

    async def record(_c: FakeContainer, _cmd: list[str], timeout: int) -> api_pb2.ExecSyncResponse:
        seen.append(timeout)
        return await hang(_c, _cmd, timeout)

    runtime.exec_handler = record
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    result = await cri.exec_sync(container.id, ["sleep", "1d"], timeout=0)
    assert seen == [0]
    assert deadlines == [RUNTIME_REQUEST_TIMEOUT]
    assert result.timed_out
    assert result.message == "Deadline Exceeded"  # gRPC's deadline, not the runtime's answer
    assert not result.drained_after_timeout  # there was no timeout to be late for


async def test_exec_output_is_capped_like_the_kubelet(cri: CriClient, runtime: FakeRuntime) -> None:
    """stdout then stderr are kept up to 10 KiB in total; a 15 MiB reply still arrives."""

    async def chatty(_c: FakeContainer, _cmd: list[str], _t: int) -> api_pb2.ExecSyncResponse:
        return api_pb2.ExecSyncResponse(
            stdout=b"o" * (8 * 1024), stderr=b"e" * (15 * MiB), exit_code=3
        )

    runtime.exec_handler = chatty
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    result = await cri.exec_sync(container.id, ["x"], timeout=5)
    assert result.exit_code == 3
    assert result.stdout == b"o" * (8 * 1024)
    assert result.stderr == b"e" * (MAX_OUTPUT_BYTES - 8 * 1024)


@pytest.mark.parametrize(
    ("stdout_bytes", "stderr_bytes"),
    [(17 * MiB, 0), (9 * MiB, 9 * MiB)],
    ids=["stdout-17MiB", "stdout+stderr-18MiB"],
)
async def test_exec_reply_over_16_mib_is_an_error(
    cri: CriClient, runtime: FakeRuntime, stdout_bytes: int, stderr_bytes: int
) -> None:
    """Like the kubelet's client, a reply over 16 MiB is RESOURCE_EXHAUSTED, an error and not a
    result (also when each stream alone is under containerd's 16 MiB per-stream cap)."""

    async def flood(_c: FakeContainer, _cmd: list[str], _t: int) -> api_pb2.ExecSyncResponse:
        return api_pb2.ExecSyncResponse(
            stdout=b"o" * stdout_bytes, stderr=b"e" * stderr_bytes, exit_code=0
        )

    runtime.exec_handler = flood
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    with pytest.raises(CriError) as caught:
        await cri.exec_sync(container.id, ["x"], timeout=5)
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (cri.execs_in_flight, cri.execs_overdue) == (0, 0)


@pytest.mark.parametrize(
    ("overhead", "fits"), [(0, True), (1, False)], ids=["exactly-16MiB", "one-byte-over"]
)
async def test_exec_receive_limit_is_exactly_16_mib(
    cri: CriClient, runtime: FakeRuntime, overhead: int, fits: bool
) -> None:
    """The limit applies to the encoded reply: 16 MiB passes, one byte more does not."""
    # An ExecSyncResponse with only stdout set encodes as 1 tag byte, a 4-byte length, the data.
    payload = 16 * MiB - 5 + overhead

    async def exact(_c: FakeContainer, _cmd: list[str], _t: int) -> api_pb2.ExecSyncResponse:
        response = api_pb2.ExecSyncResponse(stdout=b"o" * payload)
        assert response.ByteSize() == 16 * MiB + overhead
        return response

    runtime.exec_handler = exact
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    if fits:
        result = await cri.exec_sync(container.id, ["x"], timeout=5)
        assert (result.exit_code, len(result.stdout)) == (0, MAX_OUTPUT_BYTES)
    else:
        with pytest.raises(CriError) as caught:
            await cri.exec_sync(container.id, ["x"], timeout=5)
        assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_cancelled_exec_gives_its_slot_back(
    cri_one_slot: CriClient, runtime: FakeRuntime
) -> None:
    """Cancelling a call (its worker stopping), in its slot or past it, leaks neither the slot
    nor the counts."""
    entered = asyncio.Event()

    async def hang_unless_true(
        c: FakeContainer, cmd: list[str], t: int
    ) -> api_pb2.ExecSyncResponse:
        if cmd == ["true"]:
            return api_pb2.ExecSyncResponse(exit_code=0)
        entered.set()
        return await hang(c, cmd, t)

    runtime.exec_handler = hang_unless_true
    runtime.enforce_exec_timeout = False
    container = runtime.add_container(runtime.add_sandbox("p"), "c")

    in_slot = asyncio.create_task(cri_one_slot.exec_sync(container.id, ["a"], timeout=30))
    await entered.wait()
    in_slot.cancel()
    await asyncio.gather(in_slot, return_exceptions=True)
    assert (cri_one_slot.execs_in_flight, cri_one_slot.execs_overdue) == (0, 0)

    overdue = asyncio.create_task(cri_one_slot.exec_sync(container.id, ["b"], timeout=1))
    queued = asyncio.create_task(cri_one_slot.exec_sync(container.id, ["true"], timeout=1))
    assert (await queued).exit_code == 0
    assert cri_one_slot.execs_overdue == 1
    overdue.cancel()
    await asyncio.gather(overdue, return_exceptions=True)
    assert (cri_one_slot.execs_in_flight, cri_one_slot.execs_overdue) == (0, 0)
    # The single slot is free again: an exec gets it at once (no one holds it, no one waits
    # for it; a slot leaked by the cancelled calls would leave this exec waiting for ever).
    assert (cri_one_slot.execs_in_flight, cri_one_slot.execs_waiting) == (0, 0)
    async with asyncio.timeout(HANG_GUARD):  # a guard against that hang, not a bound on speed
        assert (await cri_one_slot.exec_sync(container.id, ["true"], timeout=1)).exit_code == 0


async def test_exec_concurrency_cap_holds(cri: CriClient, runtime: FakeRuntime) -> None:
    """With a cap of 3, never more than 3 ExecSync calls (of 12 containers) reach the runtime at
    once."""
    release = asyncio.Event()
    entered = asyncio.Condition()

    async def gated(_c: FakeContainer, _cmd: list[str], _t: int) -> api_pb2.ExecSyncResponse:
        async with entered:
            entered.notify_all()
        await release.wait()
        return api_pb2.ExecSyncResponse(exit_code=0)

    runtime.exec_handler = gated
    sandbox = runtime.add_sandbox("p")
    # Twelve containers: one container alone would hold one slot at a time (test_exec_fairness).
    containers = [runtime.add_container(sandbox, f"c{i}") for i in range(12)]
    calls = [
        asyncio.create_task(cri.exec_sync(container.id, ["true"], timeout=30))
        for container in containers
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


async def test_listings_reuse_unchanged_objects(cri: CriClient, runtime: FakeRuntime) -> None:
    """Relisting returns the very objects it returned before unless their state changed."""
    web = runtime.add_sandbox("web", labels={"tier": "web"})
    app, sidecar = runtime.add_container(web, "app"), runtime.add_container(web, "sidecar")
    first_sandboxes, first = await cri.list_pod_sandboxes(), await cri.list_containers()

    runtime.exit_container(app.id)
    web.ready = False
    [sandbox] = await cri.list_pod_sandboxes()
    # A filtered listing neither forgets the others nor stops them being reused afterwards.
    assert [c.id for c in await cri.list_containers(pod_sandbox_id="f" * 64)] == []
    second = {c.id: c for c in await cri.list_containers()}

    assert sandbox is not first_sandboxes[0]
    assert (sandbox.state, sandbox.labels) == (SandboxState.SANDBOX_NOTREADY, {"tier": "web"})
    old = {c.id: c for c in first}
    assert second[sidecar.id] is old[sidecar.id]
    assert second[app.id] is not old[app.id]
    assert second[app.id].state is ContainerState.CONTAINER_EXITED
    assert second[app.id].labels == old[app.id].labels
    # Unchanged, the answer is the last one, object for object and in its order.
    again = await cri.list_containers()
    assert [id(c) for c in again] == [id(c) for c in second.values()]
    runtime.remove_container(sidecar.id)
    assert [c.id for c in await cri.list_containers()] == [app.id]


async def test_statuses_share_their_listings_maps(cri: CriClient, runtime: FakeRuntime) -> None:
    """CRI fixes labels and annotations at creation: a status keeps its listing's maps (one
    copy per container, not two), and its own when they differ from what was listed."""
    web = runtime.add_sandbox("web", labels={"tier": "web"}, annotations={"note": "x" * 100})
    app = runtime.add_container(web, "app")
    [sandbox], [container] = await cri.list_pod_sandboxes(), await cri.list_containers()
    sandbox_status = await cri.pod_sandbox_status(web.id)
    status = await cri.container_status(app.id)
    assert sandbox_status.sandbox.labels is sandbox.labels
    assert sandbox_status.sandbox.annotations is sandbox.annotations
    assert status.labels is container.labels
    assert status.annotations is container.annotations
    # A runtime that answered other maps than it listed is believed, not overwritten.
    runtime.containers[app.id].labels["extra"] = "1"
    changed = await cri.container_status(app.id)
    assert changed.labels == {**container.labels, "extra": "1"}
    assert changed.labels is not container.labels


async def test_stop_container_treats_not_found_as_stopped(
    cri: CriClient, runtime: FakeRuntime
) -> None:
    """Older containerd answers NOT_FOUND for an unknown ID: that is already stopped."""
    runtime.fail_next("StopContainer", grpc.StatusCode.NOT_FOUND)
    await cri.stop_container("a" * 64, grace_seconds=2)
    assert runtime.calls == ["StopContainer"]


async def test_a_slot_past_its_hold_goes_to_the_next_call_on_a_starved_loop(
    cri_one_slot: CriClient, runtime: FakeRuntime
) -> None:
    """Issue 36: a starved loop runs an overdue slot's give-back timer late, after the calls
    queued before it. The slot's bound is kept by the clock: the next call that asks for a slot
    finds it past its hold and takes it at once, instead of waiting for the late timer."""
    entered = asyncio.Event()

    async def hang_unless_true(
        c: FakeContainer, cmd: list[str], t: int
    ) -> api_pb2.ExecSyncResponse:
        if cmd == ["true"]:
            return api_pb2.ExecSyncResponse(exit_code=0)
        entered.set()
        return await hang(c, cmd, t)

    runtime.exec_handler = hang_unless_true
    runtime.enforce_exec_timeout = False
    sandbox = runtime.add_sandbox("p")
    first, second = runtime.add_container(sandbox, "a"), runtime.add_container(sandbox, "b")
    holding = asyncio.create_task(cri_one_slot.exec_sync(first.id, ["hang"], timeout=1))
    await entered.wait()
    assert cri_one_slot.execs_in_flight == 1
    loop = asyncio.get_running_loop()
    seen: list[tuple[int, int, int]] = []
    # The loop is starved past the slot's hold (timeout 1 + margin); the next call was queued
    # behind the starvation, so it runs in the same iteration, before the late timer does.
    loop.call_soon(time.sleep, 1 + SLOT_MARGIN + 0.1)
    queued = asyncio.create_task(cri_one_slot.exec_sync(second.id, ["true"], timeout=1))
    loop.call_soon(
        lambda: seen.append(
            (cri_one_slot.execs_waiting, cri_one_slot.execs_in_flight, cri_one_slot.execs_overdue)
        )
    )
    async with asyncio.timeout(HANG_GUARD):
        assert (await queued).exit_code == 0
    # Right after its first step the queued call held the slot and waited for nothing; the
    # first call had given it back as overdue (and waits on without one).
    assert seen == [(0, 1, 1)]
    assert not holding.done()
    holding.cancel()
    await asyncio.gather(holding, return_exceptions=True)
    assert (cri_one_slot.execs_in_flight, cri_one_slot.execs_overdue) == (0, 0)


async def test_an_answered_exec_gives_its_slot_back_when_grpc_delivers_it(
    cri_one_slot: CriClient, runtime: FakeRuntime
) -> None:
    """Issue 36: the slot goes back from the call's completion, before the awaiting coroutine
    resumes (on a busy loop that is an iteration or more later): when the answered call's own
    bookkeeping runs, the call queued behind it already has the slot."""
    release = asyncio.Event()
    entered = asyncio.Event()

    async def gated(_c: FakeContainer, cmd: list[str], _t: int) -> api_pb2.ExecSyncResponse:
        if cmd == ["gated"]:
            entered.set()
            await release.wait()
        return api_pb2.ExecSyncResponse(exit_code=0)

    runtime.exec_handler = gated
    sandbox = runtime.add_sandbox("p")
    first, second = runtime.add_container(sandbox, "a"), runtime.add_container(sandbox, "b")
    answered = asyncio.create_task(cri_one_slot.exec_sync(first.id, ["gated"], timeout=30))
    await entered.wait()
    queued = asyncio.create_task(cri_one_slot.exec_sync(second.id, ["true"], timeout=30))
    waiting_at_answer: list[int] = []
    subscription = cri_one_slot.calls.subscribe(
        lambda call: (
            waiting_at_answer.append(cri_one_slot.execs_waiting)
            if call.method == "ExecSync"
            else None
        )
    )
    try:
        await asyncio.sleep(0)  # one iteration: the queued call's first step, into the line
        assert cri_one_slot.execs_waiting == 1
        async with asyncio.timeout(HANG_GUARD):
            release.set()
            results = await asyncio.gather(answered, queued)
    finally:
        subscription()
    assert [r.exit_code for r in results] == [0, 0]
    # The first ExecSync to finish its own bookkeeping found nobody waiting any more.
    assert waiting_at_answer[0] == 0


async def test_a_starved_loop_does_not_make_a_quick_answer_late(
    cri: CriClient, runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36: an exec's elapsed time (and the runtime's pace) is the call's own, from when it
    went out to when grpc delivered the answer. A loop starved between that delivery and the
    caller's resumption (here: blocked for longer than the exec's timeout) does not turn an
    answer that came at once into one that "arrived after the timeout"."""
    stub = cri._stub
    send = stub.ExecSync
    blocked = 1.5  # seconds the loop is starved for, past the exec's 1 s timeout

    class Starved:
        """The call, but its caller resumes only after the loop was blocked (grpc's done
        callbacks, which run first, go to the real call)."""

        def __init__(self, call: Any) -> None:
            self._call = call

        def add_done_callback(self, callback: Any) -> None:
            self._call.add_done_callback(callback)

        def __await__(self) -> Any:
            return self._wait().__await__()

        async def _wait(self) -> Any:
            response = await self._call
            time.sleep(blocked)  # noqa: ASYNC251 - the starved loop this test is about
            return response

    def starved(request: api_pb2.ExecSyncRequest, *, timeout: float | None = None) -> Any:
        return Starved(send(request, timeout=timeout))

    monkeypatch.setattr(stub, "ExecSync", starved)
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    result = await cri.exec_sync(container.id, ["true"], timeout=1)
    assert result.exit_code == 0
    assert result.elapsed < blocked
    assert not result.drained_after_timeout
