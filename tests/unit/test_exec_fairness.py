"""Fair exec slots: no container can hold the node's exec slots, and waiting containers take turns.

The finding (issue 15): four containers whose exec probes run ``sleep 3600`` with
``timeoutSeconds: 3600`` held all 8 slots for an hour, and every other exec probe on the node
made no attempt at all. Now a container holds one slot at a time, a slot is held for at most
``min(timeout, exec_slot_hold_max) + exec_slot_margin``, and containers waiting for a slot are
served in turn. ``ExecSlots`` is tested on its own first, then through ``CriClient`` against
the in-process fake runtime.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.probing.handlers.exec import probe_exec
from cri_prober.probing.outcome import ProbeResult
from cri_prober.runtime.client import (
    DEFAULT_EXEC_SLOT_HOLD_MAX,
    DEFAULT_MAX_CONCURRENT_EXECS,
    EXEC_SLOTS_PER_CONTAINER,
    CriClient,
)
from cri_prober.runtime.exec_slots import ExecSlot, ExecSlots
from tests.support.fake_runtime import FakeContainer, FakeRuntime, FakeRuntimeServer

# -- ExecSlots on its own -------------------------------------------------------------------------


async def test_one_slot_per_container_and_the_cap_holds() -> None:
    """A container's second call waits although slots are free; other containers get them."""
    slots = ExecSlots(3, per_key=1)
    first = await slots.acquire("a")
    second_a = asyncio.create_task(slots.acquire("a"))
    await asyncio.sleep(0)  # one loop iteration: the task parks in the line
    b = await slots.acquire("b")
    c = await slots.acquire("c")
    assert (slots.in_use, slots.waiting) == (3, 1)
    d = asyncio.create_task(slots.acquire("d"))
    await asyncio.sleep(0)
    assert not second_a.done()
    assert not d.done()
    # a's slot comes back: a has waited longer than d, and a holds nothing now.
    first.release()
    assert (await second_a).key == "a"
    assert not d.done()
    b.release()
    assert (await d).key == "d"
    assert (slots.in_use, slots.waiting) == (3, 0)
    c.release()
    assert slots.in_use == 2


async def test_waiting_containers_take_turns() -> None:
    """A container with many waiting calls gets one turn per round, not one per call: with one
    slot, a's four queued calls alternate with b's and c's instead of going first."""
    slots = ExecSlots(1, per_key=1)
    holder = await slots.acquire("x")
    order: list[str] = []

    async def call(key: str) -> None:
        slot = await slots.acquire(key)
        order.append(key)
        slot.release()

    tasks = [asyncio.create_task(call(k)) for k in ["a", "a", "b", "a", "c", "a"]]
    await asyncio.sleep(0)
    holder.release()
    await asyncio.gather(*tasks)
    assert order == ["a", "b", "c", "a", "a", "a"]


async def test_cancelled_waiters_leak_nothing() -> None:
    """A caller cancelled while waiting leaves the line; one cancelled just as it was granted a
    slot gives the slot back; release() twice gives back one slot."""
    slots = ExecSlots(1)
    holder = await slots.acquire("x")
    waiting = asyncio.create_task(slots.acquire("a"))
    behind = asyncio.create_task(slots.acquire("b"))
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert slots.waiting == 1
    # Granted and cancelled in the same loop iteration: the slot must not stay taken.
    holder.release()
    behind.cancel()
    await asyncio.gather(behind, return_exceptions=True)
    assert (slots.in_use, slots.waiting) == (0, 0)
    slot: ExecSlot = await slots.acquire("c")
    slot.release()
    slot.release()
    assert slots.in_use == 0
    assert (await slots.acquire("d")).key == "d"


def test_defaults_are_documented_values() -> None:
    """One slot per container, a 10 s hold at most, eight slots."""
    assert EXEC_SLOTS_PER_CONTAINER == 1
    assert DEFAULT_EXEC_SLOT_HOLD_MAX == 10.0
    assert DEFAULT_MAX_CONCURRENT_EXECS == 8


# -- through CriClient against the fake runtime ---------------------------------------------------


@pytest.fixture(name="server")
async def _server(tmp_path: Path) -> AsyncIterator[FakeRuntimeServer]:
    async with FakeRuntimeServer(str(tmp_path / "cri.sock")) as server:
        yield server


@pytest.fixture(name="runtime")
def _runtime(server: FakeRuntimeServer) -> FakeRuntime:
    return server.runtime


class Hanging:
    """An exec handler: ``true`` exits at once, anything else runs until the runtime's timeout.

    ``until(n)`` waits until ``n`` hanging commands are running in the runtime at once.
    """

    def __init__(self) -> None:
        self.running = 0
        self._changed = asyncio.Condition()

    async def __call__(
        self, _c: FakeContainer, cmd: list[str], _t: int
    ) -> api_pb2.ExecSyncResponse:
        if cmd != ["true"]:
            async with self._changed:
                self.running += 1
                self._changed.notify_all()
            try:
                await asyncio.Event().wait()
            finally:
                self.running -= 1
        return api_pb2.ExecSyncResponse(exit_code=0)

    async def until(self, count: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.running >= count)


async def test_four_hanging_containers_cannot_starve_the_node(
    server: FakeRuntimeServer, runtime: FakeRuntime
) -> None:
    """The finding: four containers with two `sleep 3600` exec probes each (timeout 3600) and
    eight slots. Before, they held all eight for an hour and a fifth container's probe never
    ran; now they hold four, and the canary's probes, passing and failing, run at once."""
    hanging_commands = runtime.exec_handler = Hanging()
    sandbox = runtime.add_sandbox("tenant")
    hogs = [runtime.add_container(sandbox, f"hog-{i}") for i in range(4)]
    canary = runtime.add_container(runtime.add_sandbox("canary"), "app")
    async with CriClient.connect(server.target) as cri:
        hanging = [
            asyncio.create_task(cri.exec_sync(hog.id, ["sleep", "3600"], timeout=3600))
            for hog in hogs
            for _probe in ("liveness", "readiness")
        ]
        try:
            async with asyncio.timeout(2):
                await hanging_commands.until(len(hogs))
                passing = await probe_exec(cri, canary.id, ["true"], timeout=1)
            assert passing.result is ProbeResult.SUCCESS
            assert cri.execs_in_flight == len(hogs)  # one slot per hog; the canary's is back
            assert cri.execs_waiting == len(hogs)  # each hog's second probe waits its turn

            async def failing(
                _c: FakeContainer, _cmd: list[str], _t: int
            ) -> api_pb2.ExecSyncResponse:
                return api_pb2.ExecSyncResponse(exit_code=1, stdout=b"unhealthy")

            runtime.exec_handler = failing  # the canary's liveness made to fail
            async with asyncio.timeout(2):
                failed = await probe_exec(cri, canary.id, ["check"], timeout=1)
            assert failed.result is ProbeResult.FAILURE
        finally:
            for task in hanging:
                task.cancel()
            await asyncio.gather(*hanging, return_exceptions=True)
        assert (cri.execs_in_flight, cri.execs_waiting) == (0, 0)


async def test_a_slot_is_held_at_most_hold_max_plus_margin(
    server: FakeRuntimeServer, runtime: FakeRuntime
) -> None:
    """An exec with timeout 3600 that hangs gives its slot back after hold max + margin (here
    0.3 + 0.1 s), not after 3600 s: with a single slot, the next container's exec runs then."""
    hanging_commands = runtime.exec_handler = Hanging()
    sandbox = runtime.add_sandbox("p")
    hog = runtime.add_container(sandbox, "hog")
    other = runtime.add_container(sandbox, "other")
    async with CriClient.connect(
        server.target, max_concurrent_execs=1, exec_slot_hold_max=0.3, exec_slot_margin=0.1
    ) as cri:
        loop = asyncio.get_running_loop()
        hanging = asyncio.create_task(cri.exec_sync(hog.id, ["sleep", "3600"], timeout=3600))
        try:
            await hanging_commands.until(1)
            started = loop.time()
            async with asyncio.timeout(2):
                result = await cri.exec_sync(other.id, ["true"], timeout=1)
            waited = loop.time() - started
            assert result.exit_code == 0
            assert 0.4 <= waited < 0.9, waited
            assert not hanging.done()  # still waiting for its answer, without a slot
            assert (cri.execs_in_flight, cri.execs_overdue) == (0, 1)
        finally:
            hanging.cancel()
            await asyncio.gather(hanging, return_exceptions=True)


async def test_a_container_never_waits_longer_than_the_holds_ahead_of_it(
    server: FakeRuntimeServer, runtime: FakeRuntime
) -> None:
    """Starvation is impossible by construction: eight hogs keep re-running hanging execs on two
    slots (each held 0.2 s), and a ninth container queued behind them gets a slot within the
    holds of those ahead of it (4 rounds of 2), not whenever the hogs let go."""
    hanging_commands = runtime.exec_handler = Hanging()
    sandbox = runtime.add_sandbox("p")
    hogs = [runtime.add_container(sandbox, f"hog-{i}") for i in range(8)]
    canary = runtime.add_container(sandbox, "canary")
    hold = 0.2
    async with CriClient.connect(
        server.target, max_concurrent_execs=2, exec_slot_hold_max=hold, exec_slot_margin=0.0
    ) as cri:

        async def hog_worker(container_id: str) -> None:
            while True:  # like probe workers with three kinds each: always one more exec
                await asyncio.gather(
                    *(cri.exec_sync(container_id, ["sleep", "1d"], timeout=1) for _ in range(3))
                )

        workers = [asyncio.create_task(hog_worker(h.id)) for h in hogs]
        try:
            async with asyncio.timeout(2):
                await hanging_commands.until(2)  # both slots taken, everyone else in line
            loop = asyncio.get_running_loop()
            started = loop.time()
            async with asyncio.timeout(5):
                result = await cri.exec_sync(canary.id, ["true"], timeout=1)
            waited = loop.time() - started
            assert result.exit_code == 0
            ahead = len(hogs) // 2  # rounds of two slots before the canary's turn
            assert waited <= (ahead + 1) * hold + 0.3, waited
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
