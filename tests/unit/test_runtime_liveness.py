"""Runtime liveness: a silent runtime is told apart from a failing container.

Three layers: ``RuntimeLiveness``'s rules on their own (a fake clock), ``CriClient`` against a
fake runtime that can be frozen (an exec timeout that falls into the freeze is an error, not the
container's failure), and the health service's ``""`` (NOT_SERVING while the runtime is silent,
SERVING again when it answers; container services untouched).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from grpc_health.v1 import health_pb2

from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.probing.handlers.exec import probe_exec
from cri_prober.probing.outcome import ProbeError, ProbeResult
from cri_prober.runtime.client import CriClient, CriRuntimeStalled
from cri_prober.runtime.liveness import (
    DEFAULT_STALL_SECONDS,
    DEFAULT_UNRESPONSIVE_AFTER,
    RuntimeLiveness,
)
from tests.support.clock import ManualClock
from tests.support.fake_runtime import FakeContainer, FakeRuntime, FakeRuntimeServer
from tests.support.health import health_stub
from tests.support.timers import record_timers
from tests.support.waiting import HANG_GUARD

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# -- the rules ------------------------------------------------------------------------------------


def test_a_read_left_unanswered_is_a_silence_and_any_answer_ends_it() -> None:
    clock = ManualClock()
    live = RuntimeLiveness(clock=clock, stall_seconds=2.0)
    assert live.silent_since() is None
    listing = live.call_started("ListContainers")
    assert live.silent_since() == 1000.0
    clock.now += 3.0
    assert live.stalled_during(1001.0, 1001.5)  # an ongoing silence counts
    # NOT_FOUND is the runtime talking: an answer.
    status = live.call_started("ContainerStatus")
    live.call_ended(status, "ContainerStatus", "NOT_FOUND")
    assert live.last_answer == 1003.0
    # The listing still in flight was sent before that answer: the silence, if any, restarts.
    assert live.silent_since() == 1003.0
    live.call_ended(listing, "ListContainers", "OK")
    assert live.silent_since() is None
    # The ended silence is remembered for windows that overlap it, and only for those.
    assert live.stalled_during(1002.0, 1010.0)
    assert not live.stalled_during(1003.5, 1010.0)


def test_execs_and_stops_do_not_open_a_silence_but_end_one() -> None:
    """An exec takes as long as its command: slow is not silent. Its answer still counts."""
    clock = ManualClock()
    live = RuntimeLiveness(clock=clock, stall_seconds=2.0)
    exec_call = live.call_started("ExecSync")
    stop = live.call_started("StopContainer")
    clock.now += 60.0
    assert live.silent_since() is None
    assert live.responsive
    live.call_ended(stop, "StopContainer", "OK")
    listing = live.call_started("ListPodSandbox")
    clock.now += 1.5
    live.call_ended(exec_call, "ExecSync", "OK")  # an answer 1.5 s into the listing's wait
    assert live.silent_since() == clock.now  # the listing is still out: counted from here
    clock.now += 1.5
    live.call_ended(listing, "ListPodSandbox", "OK")
    # Never 2 s without any answer: no stall anywhere.
    assert not live.stalled_during(0, clock.now)


def test_an_unreachable_runtime_is_silent_until_it_answers() -> None:
    """UNAVAILABLE (runtime down) opens a silence even though the call itself ended."""
    clock = ManualClock()
    live = RuntimeLiveness(clock=clock, stall_seconds=2.0)
    version = live.call_started("Version")
    live.call_ended(version, "Version", "OK")
    clock.now += 1.0
    exec_call = live.call_started("ExecSync")
    live.call_ended(exec_call, "ExecSync", "UNAVAILABLE")
    assert live.silent_since() == clock.now
    clock.now += 4.0
    listing = live.call_started("ListContainers")
    live.call_ended(listing, "ListContainers", "DEADLINE_EXCEEDED")
    assert live.silent_since() == 1001.0
    assert live.stalled_during(1002.0, 1003.0)
    # A cancelled call (our shutdown) is neither an answer nor a failure.
    version = live.call_started("Version")
    live.call_ended(version, "Version", "CANCELLED")
    assert live.silent_since() == 1001.0
    version = live.call_started("Version")
    live.call_ended(version, "Version", "OK")
    assert live.silent_since() is None


def test_defaults() -> None:
    """10 s without an answer makes "" NOT_SERVING; 5 s of silence makes an exec timeout moot."""
    assert DEFAULT_UNRESPONSIVE_AFTER == 10.0
    assert DEFAULT_STALL_SECONDS == 5.0


async def test_responsive_flips_after_the_threshold_and_back_at_the_next_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The flip to unresponsive comes from a timer at the moment the silence reaches the
    threshold (no polling); the next answer flips it back. Each flip is published once.

    The silence is measured on a clock the test moves, so that the one timer armed, for the
    threshold, is what makes the flip (no answer and no other call comes meanwhile)."""
    clock = ManualClock()
    armed = record_timers(monkeypatch)
    live = RuntimeLiveness(unresponsive_after=0.2, stall_seconds=0.1, clock=clock)
    flips: list[bool] = []
    flipped = asyncio.Event()

    def on_change(responsive: bool) -> None:
        flips.append(responsive)
        flipped.set()

    live.changes.subscribe(on_change)
    listing = live.call_started("ListContainers")
    # When the silence will reach the threshold (1000 + 0.2 - 1000 on the manual clock).
    assert [(round(delay, 9), name) for delay, name in armed] == [(0.2, "_on_timer")]
    clock.advance(0.2)  # by the time that timer fires, it has
    async with asyncio.timeout(HANG_GUARD):  # a guard against a flip that never comes
        await flipped.wait()
    assert len(armed) == 1  # that one timer, and no polling
    assert flips == [False]
    assert not live.responsive
    flipped.clear()
    live.call_ended(listing, "ListContainers", "OK")
    assert flips == [False, True]
    assert live.responsive


# -- through CriClient: a frozen runtime ----------------------------------------------------------


class FreezableRuntime(FakeRuntime):
    """A fake runtime that can be frozen like a SIGSTOPped containerd: no call gets in until it
    is thawed, and an exec whose timeout passes while it is frozen is answered with the runtime's
    timeout error only after the thaw (containerd's timer fired while it could not see the
    command exit). ``timer_fired`` is set at that moment."""

    def __init__(self) -> None:
        super().__init__(exec_handler=self._exit_zero_unless_asked_to_hang)
        self.exec_entered = asyncio.Event()
        self.version_arrived = asyncio.Event()
        self.thawed = asyncio.Event()
        self.thawed.set()
        self.timer_fired = asyncio.Event()
        self.exec_drain = self._wait_for_thaw
        self.arrived: list[str] = []

    def freeze(self) -> None:
        self.thawed.clear()

    def thaw(self) -> None:
        self.thawed.set()

    async def _exit_zero_unless_asked_to_hang(
        self, _c: FakeContainer, cmd: list[str], _t: int
    ) -> api_pb2.ExecSyncResponse:
        if cmd[0] == "hang":
            self.exec_entered.set()
            await asyncio.Event().wait()
        return api_pb2.ExecSyncResponse(exit_code=0)

    async def _wait_for_thaw(self, _c: FakeContainer, _cmd: list[str]) -> None:
        self.timer_fired.set()
        await self.thawed.wait()

    async def _enter(self, method: str, context: Any) -> None:
        self.arrived.append(method)  # ``calls`` records only what got in
        if method == "Version":
            self.version_arrived.set()
        await self.thawed.wait()
        await super()._enter(method, context)


@pytest.fixture(name="runtime")
def _runtime() -> FreezableRuntime:
    return FreezableRuntime()


@pytest.fixture(name="server")
async def _server(tmp_path: Path, runtime: FreezableRuntime) -> AsyncIterator[FakeRuntimeServer]:
    async with FakeRuntimeServer(str(tmp_path / "cri.sock"), runtime) as server:
        yield server


@pytest.fixture(name="cri")
async def _cri(server: FakeRuntimeServer) -> AsyncIterator[CriClient]:
    # Short stand-ins: silent for 0.3 s is a stall, for 0.4 s unresponsive; slots held 1.1 s.
    liveness = RuntimeLiveness(unresponsive_after=0.4, stall_seconds=0.3)
    async with CriClient.connect(
        server.target,
        exec_slot_margin=0.1,
        runtime_request_timeout=0.5,
        liveness=liveness,
        retry_wait_max=0.05,
    ) as client:
        yield client


async def silent(cri: CriClient) -> None:
    """Wait until the client's liveness calls the runtime unresponsive."""
    went_silent = asyncio.Event()
    unsubscribe = cri.liveness.changes.subscribe(lambda ok: None if ok else went_silent.set())
    try:
        if cri.liveness.responsive:
            await went_silent.wait()
    finally:
        unsubscribe()


async def test_exec_timeout_caused_by_a_frozen_runtime_is_an_error(
    cri: CriClient, runtime: FreezableRuntime
) -> None:
    """The runtime freezes with an exec in flight while discovery is relisting; it comes back and
    answers the exec with its timeout error. Before, that was the container's failure (with
    --on-failure stop, three in a row stopped it); now it is an error, discarded and retried."""
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    await cri.version()
    probe = asyncio.create_task(probe_exec(cri, container.id, ["hang"], timeout=1))
    async with asyncio.timeout(HANG_GUARD):
        await runtime.exec_entered.wait()
        runtime.freeze()
        listing = asyncio.create_task(cri.list_containers())  # a relist, stuck in the freeze
        await runtime.timer_fired.wait()
        await silent(cri)
        runtime.thaw()
        with pytest.raises(ProbeError, match="answered nothing") as caught:
            await probe
        assert isinstance(caught.value.__cause__, CriRuntimeStalled)
        await listing
    assert cri.liveness.responsive


async def test_a_quiet_node_notices_the_freeze_through_the_overdue_exec(
    cri: CriClient, runtime: FreezableRuntime
) -> None:
    """No relist in flight (events mode on a quiet node): the exec that outlives its slot asks
    the runtime for its Version, and that unanswered question is what shows the silence."""
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    await cri.version()
    runtime.arrived.clear()
    call = asyncio.create_task(cri.exec_sync(container.id, ["hang"], timeout=1))
    async with asyncio.timeout(HANG_GUARD):
        await runtime.exec_entered.wait()
        runtime.freeze()
        await runtime.timer_fired.wait()
        await silent(cri)
        runtime.thaw()
        with pytest.raises(CriRuntimeStalled):
            await call
    assert runtime.arrived == ["ExecSync", "Version"]


async def test_a_runtime_frozen_past_the_deadline_is_not_the_containers_failure(
    cri: CriClient, runtime: FreezableRuntime
) -> None:
    """Frozen before the exec even got in, for longer than timeout + runtime request timeout:
    our own deadline ends the call, during a silence, so it is an error too."""
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    await cri.version()
    runtime.freeze()
    try:
        with pytest.raises(CriRuntimeStalled):
            await cri.exec_sync(container.id, ["true"], timeout=1)
    finally:
        runtime.thaw()


async def test_a_genuine_timeout_while_the_runtime_answers_is_still_a_failure(
    cri: CriClient, runtime: FreezableRuntime
) -> None:
    """The command hangs, the runtime answers everything else, and its timeout error comes late
    because the output drained slowly: the container's failure, as for the kubelet."""
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    drained = asyncio.Event()

    async def slow_drain(_c: FakeContainer, _cmd: list[str]) -> None:
        runtime.timer_fired.set()
        await drained.wait()

    runtime.exec_drain = slow_drain
    call = asyncio.create_task(probe_exec(cri, container.id, ["hang"], timeout=1))
    async with asyncio.timeout(HANG_GUARD):
        await runtime.timer_fired.wait()
        # Past its slot (1.1 s) the exec asks the runtime, which answers at once.
        await runtime.version_arrived.wait()
        await cri.list_containers()
        drained.set()
        outcome = await call
    assert (outcome.result, outcome.timed_out) == (ProbeResult.FAILURE, True)
    assert cri.liveness.responsive


async def test_a_freeze_long_before_the_timeout_excuses_nothing(
    cri: CriClient, runtime: FreezableRuntime
) -> None:
    """The runtime froze early in a 2 s exec and came back well before the exec's timeout: its
    timer then fired on time, so the timeout is the command's, a failure."""
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    await cri.version()
    probe = asyncio.create_task(probe_exec(cri, container.id, ["hang"], timeout=2))
    async with asyncio.timeout(HANG_GUARD):
        await runtime.exec_entered.wait()
        runtime.freeze()
        listing = asyncio.create_task(cri.list_containers())
        await silent(cri)  # 0.4 s without an answer: longer than a stall (0.3 s)
        runtime.thaw()
        await listing
        outcome = await probe
    assert (outcome.result, outcome.timed_out) == (ProbeResult.FAILURE, True)


# -- the health service's "" ----------------------------------------------------------------------


@pytest.fixture(name="health")
async def _health(tmp_path: Path) -> AsyncIterator[tuple[Any, RuntimeLiveness]]:
    liveness = RuntimeLiveness(unresponsive_after=0.2, stall_seconds=0.1)
    async with health_stub(tmp_path, containers=["default/web/app"], runtime=liveness) as stub:
        yield stub, liveness


async def check(stub: Any, service: str) -> int:
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=HANG_GUARD)
    status: int = response.status
    return status


async def test_health_follows_the_runtime_and_leaves_containers_alone(
    health: tuple[Any, RuntimeLiveness],
) -> None:
    """ "" is NOT_SERVING while the runtime is silent past the threshold and SERVING again at its
    next answer, in Check, List and Watch alike; a container's own service is unaffected.
    Before, "" followed discovery's 3-minute PLEG threshold only and stayed SERVING."""
    stub, liveness = health
    watch = stub.Watch(health_pb2.HealthCheckRequest(service=""))
    assert (await watch.read()).status == SERVING
    listing = liveness.call_started("ListContainers")  # asked, and never answered
    async with asyncio.timeout(HANG_GUARD):
        assert (await watch.read()).status == NOT_SERVING  # woken by the flip, not by polling
    assert await check(stub, "") == NOT_SERVING
    assert await check(stub, "default/web/app") == SERVING
    listed = await stub.List(health_pb2.HealthListRequest(), timeout=HANG_GUARD)
    assert listed.statuses[""].status == NOT_SERVING
    assert listed.statuses["default/web/app"].status == SERVING
    liveness.call_ended(listing, "ListContainers", "OK")
    async with asyncio.timeout(HANG_GUARD):
        assert (await watch.read()).status == SERVING
    assert await check(stub, "") == SERVING
    watch.cancel()
