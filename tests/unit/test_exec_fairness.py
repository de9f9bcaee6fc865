"""Fair exec slots: no container can hold the node's exec slots, and waiting containers take turns.

The finding (issue 15): four containers whose exec probes run ``sleep 3600`` with
``timeoutSeconds: 3600`` held all 8 slots for an hour, and every other exec probe on the node
made no attempt at all. Then a container held one slot at a time, for at most
``min(timeout, exec_slot_hold_max) + exec_slot_margin``, and containers waiting for a slot were
served in turn; but 16 such containers still delayed everyone else's exec probes by 11 s per
turn (issue 21). Now a slot past its start hold goes to any waiting call, and containers whose
execs overran are served after the others, within a share of the slots. ``ExecSlots`` is tested
on its own first (event by event, no timers), then through ``CriClient`` against the in-process
fake runtime.
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
    DEFAULT_EXEC_START_HOLD,
    DEFAULT_MAX_CONCURRENT_EXECS,
    EXEC_SLOTS_PER_CONTAINER,
    CriClient,
)
from cri_prober.runtime.exec_slots import (
    PACE_MIN_SAMPLES,
    PACE_WINDOW,
    ExecSlot,
    ExecSlots,
    Standing,
)
from tests.support.fake_runtime import FakeContainer, FakeRuntime, FakeRuntimeServer
from tests.support.waiting import HANG_GUARD

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


async def test_past_its_start_hold_a_slot_goes_to_a_waiting_call() -> None:
    """A slot whose exec is past its start hold is kept while nobody waits, and goes to the
    first call that does (the exec runs on without it); its container has overrun."""
    slots = ExecSlots(1)
    hog = await slots.acquire("hog")
    hog.soften()
    assert (slots.in_use, hog.released, slots.preemptions) == (1, False, 0)
    assert slots.standing("hog") is Standing.OVERRAN
    other = await slots.acquire("other")  # preempts the soft slot at once
    assert hog.released
    assert (slots.in_use, slots.preemptions, slots.overruns) == (1, 1, 1)
    # Softened while a call waits: it goes back on the spot.
    waiting = asyncio.create_task(slots.acquire("third"))
    await asyncio.sleep(0)
    assert not waiting.done()
    other.soften()
    assert (await waiting).key == "third"
    assert (slots.preemptions, slots.overruns) == (2, 2)
    hog.finish()  # answered at last: long past its start hold, so still overrunning
    assert slots.standing("hog") is Standing.OVERRAN


async def test_a_container_is_judged_by_its_last_answered_exec() -> None:
    """Overran once: OVERRAN until one of its execs is answered within its start hold; a call
    cancelled (release) says nothing; an unknown container is NEW."""
    slots = ExecSlots(2)
    assert slots.standing("c") is Standing.NEW
    slot = await slots.acquire("c")
    slot.finish()
    assert slots.standing("c") is Standing.GOOD
    slot = await slots.acquire("c")
    slot.soften()
    slot.finish()
    assert slots.standing("c") is Standing.OVERRAN
    (await slots.acquire("c")).release()
    assert slots.standing("c") is Standing.OVERRAN
    (await slots.acquire("c")).finish()
    assert slots.standing("c") is Standing.GOOD


async def test_overrunning_containers_are_served_last() -> None:
    """With both slots taken, calls wait: a container in good standing goes first, then a new
    one, then those that overran (in turn among themselves), whatever order they came in."""
    slots = ExecSlots(2, overrun_share=2)
    for key in ("h1", "h2"):
        slot = await slots.acquire(key)
        slot.soften()
        slot.finish()
    (await slots.acquire("good")).finish()
    holders = [await slots.acquire("x"), await slots.acquire("y")]
    order: list[str] = []

    async def call(key: str) -> None:
        slot = await slots.acquire(key)
        order.append(key)
        slot.release()

    tasks = []
    for key in ("h1", "h2", "new", "good", "h1"):
        tasks.append(asyncio.create_task(call(key)))
        await asyncio.sleep(0)  # each parks in line in this order
    assert slots.waiting == 5
    for holder in holders:
        holder.release()
    await asyncio.gather(*tasks)
    assert order == ["good", "new", "h1", "h2", "h1"]


async def test_overrunning_containers_hold_at_most_their_share() -> None:
    """Four slots, share 2: four overrunning containers hold two and the others wait, though two
    slots are free; a well-behaved container gets one of those at once. A container that
    overran while waiting moves to the overrunning line."""
    slots = ExecSlots(4, overrun_share=2)
    hogs = [f"h{i}" for i in range(4)]
    for key in hogs:
        slot = await slots.acquire(key)
        slot.soften()
        slot.finish()
    granted = [await slots.acquire("h0"), await slots.acquire("h1")]
    more = [asyncio.create_task(slots.acquire(key)) for key in ("h2", "h3")]
    await asyncio.sleep(0)
    assert not any(task.done() for task in more)
    assert (slots.in_use, slots.waiting) == (2, 2)
    well_behaved = await slots.acquire("canary")
    late_hog = await slots.acquire("late")  # NEW: not held back by the share
    assert slots.in_use == 4
    # A slot of the share comes back: the next overrunning container in line takes it.
    granted[0].release()
    assert (await more[0]).key == "h2"
    # A NEW container that overruns while its second call waits loses its place in front.
    second = asyncio.create_task(slots.acquire("late"))
    behind = asyncio.create_task(slots.acquire("new"))
    await asyncio.sleep(0)
    late_hog.soften()  # preempted for the waiting calls
    well_behaved.finish()
    assert (await behind).key == "new"
    assert not second.done()
    assert slots.standing("late") is Standing.OVERRAN
    for task in (second, more[1]):
        task.cancel()
    await asyncio.gather(second, more[1], return_exceptions=True)
    assert slots.waiting == 0


async def test_standings_are_remembered_for_a_bounded_number_of_containers() -> None:
    """Containers come and go unannounced: only the last ``remember`` judged are kept."""
    slots = ExecSlots(1, remember=2)
    for key in ("a", "b", "c"):
        slot = await slots.acquire(key)
        slot.soften()
        slot.finish()
    assert [slots.standing(k) for k in ("a", "b", "c")] == [
        Standing.NEW,
        Standing.OVERRAN,
        Standing.OVERRAN,
    ]


async def test_preempted_and_cancelled_calls_leak_nothing() -> None:
    """Preemption, cancellation and late answers together leave no slot taken or call waiting."""
    slots = ExecSlots(2, overrun_share=1)
    hog = await slots.acquire("hog")
    hog.soften()
    hog.finish()
    first = await slots.acquire("a")
    overrun = await slots.acquire("hog")  # the share of one
    waiting = asyncio.create_task(slots.acquire("hog"))  # its own second call
    queued = asyncio.create_task(slots.acquire("b"))
    await asyncio.sleep(0)
    overrun.soften()  # goes to b (the hog's second call waits for its own first)
    assert (await queued).key == "b"
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    overrun.finish()
    overrun.release()
    first.release()
    (await queued).release()
    assert (slots.in_use, slots.waiting) == (0, 0)


class Stopwatch:
    """The slots' clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def answer_all_after(slots: ExecSlots, clock: Stopwatch, seconds: float, n: int) -> None:
    """``n`` execs, one container each, every one answered ``seconds`` after its grant."""
    for i in range(n):
        slot = await slots.acquire(f"pace-{i}")
        clock.now += seconds
        if seconds > 0.25:
            slot.soften()  # past the start hold of these tests (0.5 s, slow_after 0.25)
        slot.finish()


async def test_a_saturated_runtime_overruns_no_container_and_starts_fewer_execs() -> None:
    """Issue 25's finding: beside a paced loop (the kubelet's stand-in) whose own execs took
    containerd past its ceiling, every exec took about a second, so every container 'overran' its
    start hold and was served within the overrun share, by accident. Now a start hold judges no
    container once the median answer is past ``slow_after`` (each is judged by its answer
    against the median: within twice it is on time), and the node starts at most
    ``saturated_share`` young execs at a time, on purpose: more only take the runtime from the
    kubelet's probes, whose liveness timeouts restart containers."""
    clock = Stopwatch()
    slots = ExecSlots(4, overrun_share=2, saturated_share=2, slow_after=0.25, clock=clock)
    await answer_all_after(slots, clock, 0.05, 8)
    assert slots.runtime_pace == pytest.approx(0.05)
    assert not slots.runtime_slow
    await answer_all_after(slots, clock, 1.0, 8)
    assert slots.runtime_pace == pytest.approx(0.525)  # the median of 8 fast and 8 slow
    await answer_all_after(slots, clock, 1.0, 1)
    assert slots.runtime_pace == pytest.approx(1.0)
    assert slots.runtime_slow
    # Those judged overrunning while the runtime turned slow are on time at their next answer.
    assert slots.standing("pace-1") is Standing.OVERRAN
    await answer_all_after(slots, clock, 1.0, 8)
    assert [slots.standing(f"pace-{i}") for i in range(8)] == [Standing.GOOD] * 8

    # Two young execs at a time, though four slots exist; past their start hold, their slots go
    # to the next two in line, and nobody is held back as overrunning.
    first = [await slots.acquire(f"c{i}") for i in range(2)]
    more = [asyncio.create_task(slots.acquire(f"d{i}")) for i in range(3)]
    await asyncio.sleep(0)
    assert (slots.in_use, slots.waiting) == (2, 3)
    clock.now += 0.5
    for slot in first:
        slot.soften()
    await asyncio.sleep(0)
    assert [task.done() for task in more] == [True, True, False]
    assert {slots.standing(f"c{i}") for i in range(2)} == {Standing.NEW}
    # Judged by their answers: within twice the median (1 s) is on time, later overran.
    clock.now += 1.0  # c*: 1.5 s after their grant
    for slot in first:
        slot.finish()
    assert {slots.standing(f"c{i}") for i in range(2)} == {Standing.GOOD}
    clock.now += 2.5  # d0, d1: 2.5 s after theirs
    for task in more[:2]:
        task.result().soften()
        task.result().finish()
    assert {slots.standing(f"d{i}") for i in range(2)} == {Standing.OVERRAN}
    last = await more[2]
    # The runtime answers fast again: all four slots are open once the median comes down.
    await answer_all_after(slots, clock, 0.0, PACE_WINDOW)
    assert not slots.runtime_slow
    last.finish()
    assert [await slots.acquire(f"e{i}") for i in range(4)] != []
    assert (slots.in_use, slots.waiting) == (4, 0)


async def test_a_healthy_runtime_still_judges_by_the_start_hold() -> None:
    """With the runtime answering on time, a container past its start hold overran at once, as
    before (a hanging exec is told apart from the others by the hold alone)."""
    clock = Stopwatch()
    slots = ExecSlots(2, slow_after=0.25, clock=clock)
    await answer_all_after(slots, clock, 0.05, 8)
    hog = await slots.acquire("hog")
    clock.now += 0.5
    hog.soften()
    assert slots.standing("hog") is Standing.OVERRAN
    hog.finish()
    hog.finish()  # again: nothing more is counted
    assert slots.runtime_pace == pytest.approx(0.05)
    assert slots.standing("hog") is Standing.OVERRAN


async def test_hanging_commands_never_make_the_runtime_look_saturated() -> None:
    """Only answers with an exit status within the command's timeout tell the runtime's pace
    (``finish(paced=False)`` for the others, as the client says): a node whose exec probes all
    time out or wait for a background child keeps every slot (found by the real-containerd
    test of hanging execs, which the first version throttled)."""
    clock = Stopwatch()
    slots = ExecSlots(4, slow_after=0.25, clock=clock)
    for i in range(PACE_WINDOW):
        slot = await slots.acquire(f"hang-{i}")
        clock.now += 6.0
        slot.soften()
        slot.finish(paced=False)
    assert slots.runtime_pace is None
    assert not slots.runtime_slow
    assert len([await slots.acquire(f"next-{i}") for i in range(4)]) == slots.in_use == 4


async def test_a_small_cap_still_tells_a_saturated_runtime() -> None:
    """With as few slots as its saturated share (a cap of 1 to 3 by default) nothing is held
    back, but a saturated runtime still judges no container by the start hold."""
    clock = Stopwatch()
    slots = ExecSlots(2, saturated_share=2, slow_after=0.25, clock=clock)
    await answer_all_after(slots, clock, 1.0, PACE_MIN_SAMPLES)
    assert slots.runtime_slow
    slot = await slots.acquire("c")
    clock.now += 0.5
    slot.soften()
    assert slots.standing("c") is Standing.NEW


def test_defaults_are_documented_values() -> None:
    """One slot per container, a 0.5 s start hold, a 10 s hold at most, sixteen slots (a quarter of
    them at most for overrunning containers)."""
    assert EXEC_SLOTS_PER_CONTAINER == 1
    assert DEFAULT_EXEC_START_HOLD == 0.5
    assert DEFAULT_EXEC_SLOT_HOLD_MAX == 10.0
    assert DEFAULT_MAX_CONCURRENT_EXECS == 16
    assert ExecSlots(DEFAULT_MAX_CONCURRENT_EXECS).overrun_share == 4


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

    ``until(n)`` waits until ``n`` hanging commands are running in the runtime at once; ``log``
    has every command's first word in the order they reached the runtime.
    """

    def __init__(self) -> None:
        self.running = 0
        self.log: list[str] = []
        self._changed = asyncio.Condition()

    async def __call__(
        self, _c: FakeContainer, cmd: list[str], _t: int
    ) -> api_pb2.ExecSyncResponse:
        self.log.append(cmd[0])
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
    ran; now each holds one slot at a time, and only while nobody else waits once its exec is
    past its start hold: the second probe of each gets the slot of its first, all eight hang at
    the runtime holding four slots, and the canary's probes, passing and failing, run at once."""
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
            async with asyncio.timeout(HANG_GUARD):
                await hanging_commands.until(len(hanging))
                passing = await probe_exec(cri, canary.id, ["true"], timeout=1)
            assert passing.result is ProbeResult.SUCCESS
            # One slot per hog (its second exec's, past its start hold); the canary's is back.
            assert (cri.execs_in_flight, cri.execs_waiting) == (len(hogs), 0)
            assert cri.execs_outstanding == len(hanging)
            assert cri.exec_slot_preemptions == len(hogs)  # each first exec's, for the second

            async def failing(
                _c: FakeContainer, _cmd: list[str], _t: int
            ) -> api_pb2.ExecSyncResponse:
                return api_pb2.ExecSyncResponse(exit_code=1, stdout=b"unhealthy")

            runtime.exec_handler = failing  # the canary's liveness made to fail
            async with asyncio.timeout(HANG_GUARD):
                failed = await probe_exec(cri, canary.id, ["check"], timeout=1)
            assert failed.result is ProbeResult.FAILURE
        finally:
            for task in hanging:
                task.cancel()
            await asyncio.gather(*hanging, return_exceptions=True)
        assert (cri.execs_in_flight, cri.execs_waiting, cri.execs_outstanding) == (0, 0, 0)


async def test_a_hanging_exec_gives_its_slot_to_a_waiting_call_past_its_start_hold(
    server: FakeRuntimeServer, runtime: FakeRuntime
) -> None:
    """An exec with timeout 3600 that hangs gives its only slot to the next container's exec
    once past its start hold, long before its hold (10 s + margin) would end: the other exec
    runs to completion while the first still hangs, slotless, and the hog has overrun. (Told by
    what happened, not by the clock: the hold's timer has not fired, so nothing is overdue.)"""
    hanging_commands = runtime.exec_handler = Hanging()
    sandbox = runtime.add_sandbox("p")
    hog = runtime.add_container(sandbox, "hog")
    other = runtime.add_container(sandbox, "other")
    async with CriClient.connect(server.target, max_concurrent_execs=1) as cri:
        hanging = asyncio.create_task(cri.exec_sync(hog.id, ["sleep", "3600"], timeout=3600))
        try:
            await hanging_commands.until(1)
            # Generous: the start hold is 0.5 s, the hold 11 s (the old way's wait).
            async with asyncio.timeout(DEFAULT_EXEC_SLOT_HOLD_MAX / 2):
                result = await cri.exec_sync(other.id, ["true"], timeout=1)
            assert result.exit_code == 0
            assert not hanging.done()  # still waiting for its answer, without a slot
            assert (cri.execs_in_flight, cri.execs_outstanding, cri.execs_overdue) == (0, 1, 0)
            assert (cri.exec_slot_preemptions, cri.exec_overruns) == (1, 1)
            assert cri.exec_slot_wait_seconds > 0
        finally:
            hanging.cancel()
            await asyncio.gather(hanging, return_exceptions=True)


async def test_sixteen_hanging_containers_cannot_delay_a_well_behaved_one(
    server: FakeRuntimeServer, runtime: FakeRuntime
) -> None:
    """Issue 21's finding, in process: 16 containers whose two exec probes each hang (timeout
    3600) against 8 slots. Before, every slot went round them for 11 s a turn and a healthy
    container's exec waited 22 s and more; now the hogs' execs give their slots up after the
    start hold, and once overrun are served after the healthy container, which ran one exec
    before the hogs came and so is in good standing: each of its execs overtakes every hog
    exec still in line (told by who reached the runtime first, not by the clock)."""
    hanging_commands = runtime.exec_handler = Hanging()
    sandbox = runtime.add_sandbox("tenant")
    hogs = [runtime.add_container(sandbox, f"hog-{i}") for i in range(16)]
    canary = runtime.add_container(runtime.add_sandbox("canary"), "app")
    async with CriClient.connect(server.target) as cri:
        assert (await cri.exec_sync(canary.id, ["true"], timeout=1)).exit_code == 0
        hanging = [
            asyncio.create_task(cri.exec_sync(hog.id, ["sleep", "3600"], timeout=3600))
            for hog in hogs
            for _probe in ("liveness", "readiness")
        ]
        try:
            # The hogs hold every slot, the rest of their execs wait.
            async with asyncio.timeout(HANG_GUARD):
                await hanging_commands.until(DEFAULT_MAX_CONCURRENT_EXECS)
            for _tick in range(5):
                hanging_commands.log.append("canary asks")
                # Generous: the start hold is 0.5 s; the old way's first turn came after 11 s.
                async with asyncio.timeout(DEFAULT_EXEC_SLOT_HOLD_MAX / 2):
                    result = await cri.exec_sync(canary.id, ["true"], timeout=1)
                assert result.exit_code == 0
                # Served ahead of every hog exec in line. Hog execs may still reach the runtime
                # between the canary's asking and its exec's arrival: those already holding a
                # slot when it asked (8 at most), and, arrival order not being grant order on a
                # busy machine, those granted a slot freed while the canary's own call was on
                # its way (at most 8 more). Behind the 24 waiting hog execs in turn, as before,
                # it would have been all 24, after 11 s turns.
                log = hanging_commands.log
                asked = len(log) - 1 - log[::-1].index("canary asks")
                arrived = asked + log[asked:].index("true")
                overtaking = log[asked:arrived].count("sleep")
                assert overtaking <= 2 * DEFAULT_MAX_CONCURRENT_EXECS, log[asked:arrived]
            async with asyncio.timeout(HANG_GUARD):
                await hanging_commands.until(len(hanging))  # late, not lost
        finally:
            for task in hanging:
                task.cancel()
            await asyncio.gather(*hanging, return_exceptions=True)
        assert (cri.execs_in_flight, cri.execs_waiting, cri.execs_outstanding) == (0, 0, 0)


async def test_a_container_never_waits_longer_than_the_holds_ahead_of_it(
    server: FakeRuntimeServer, runtime: FakeRuntime
) -> None:
    """Starvation is impossible by construction: eight hogs keep re-running hanging execs on two
    slots (each held 0.2 s), and a ninth container queued behind them gets a slot within the
    holds of those ahead of it (4 rounds of 2), not whenever the hogs let go: no more hog execs
    get in before it than those turns allow."""
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
            async with asyncio.timeout(HANG_GUARD):  # guards against a hang, not bounds on speed
                await hanging_commands.until(2)  # both slots taken, everyone else in line
            log = hanging_commands.log
            log.append("canary asks")
            async with asyncio.timeout(HANG_GUARD):
                result = await cri.exec_sync(canary.id, ["true"], timeout=1)
            assert result.exit_code == 0
            # Counted in turns rather than timed: the hog execs that reached the runtime between
            # the canary's asking and its own exec are at most the 4 rounds of 2 slots ahead of
            # it (one exec of each hog not in a slot when it asked: 6, plus up to the two
            # granted a slot freed while the canary's call was on its way, arrival order not
            # being grant order on a busy machine). Behind every waiting hog exec in line, 22.
            asked = log.index("canary asks")
            overtaking = log[asked : log.index("true", asked)].count("sleep")
            ahead = len(hogs) // 2  # rounds of two slots before the canary's turn
            assert overtaking <= ahead * 2, log[asked:]
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)


async def test_the_pace_is_the_runtimes_time_not_the_loops() -> None:
    """Issue 36: on a starved loop an exec's slot is granted, the call goes out and its answer
    is seen each an iteration or more apart. The runtime's pace is the time its caller says the
    runtime took (``took``), so that a loop's own delays do not make a quick runtime pass for a
    saturated one, which would hold its execs to a quarter of the slots."""
    clock = Stopwatch()
    slots = ExecSlots(4, saturated_share=1, slow_after=0.25, clock=clock)
    for n in range(8):
        slot = await slots.acquire(f"c{n}")
        clock.now += 1.0  # the loop got to the call, and to its answer, late
        slot.finish(took=0.05)  # the runtime itself answered within 50 ms
    assert slots.runtime_pace == pytest.approx(0.05)
    assert not slots.runtime_slow


async def test_a_slot_past_its_bounds_is_softened_or_given_back_by_the_clock() -> None:
    """Issue 36: a slot's start hold and longest hold hold even when their timers run late (a
    starved loop): the next call asking for a slot checks them first."""
    clock = Stopwatch()
    slots = ExecSlots(1, clock=clock)
    given_back: list[str] = []
    first = await slots.acquire("a")

    def on_due() -> None:
        given_back.append("a")
        first.release()

    first.bound(soft_at=0.5, due=2.0, on_due=on_due)
    clock.now = 0.6  # past its start hold, its timer not run: softened, so a waiter gets it
    second = asyncio.create_task(slots.acquire("b"))
    async with asyncio.timeout(HANG_GUARD):
        got = await second
    assert (first.soft, first.released, given_back) == (True, True, [])

    def on_due_b() -> None:
        given_back.append("b")
        got.release()

    got.bound(soft_at=3600, due=1.0, on_due=on_due_b)
    clock.now = 1.5  # past its longest hold, its timer not run: given back at the next ask
    third = await slots.acquire("c")
    assert (got.released, given_back, third.released) == (True, ["b"], False)


async def test_a_call_whose_slot_went_to_the_line_is_still_overdue_at_its_longest_hold() -> None:
    """A slot past its start hold goes to whoever waits, and its exec runs on without it; its
    call still reaches its longest hold (overdue: counted, and the runtime asked whether it is
    alive). One timer for every slot's bounds (issue 36) first dropped the bound with the slot,
    so such a call was never overdue (tests/reliability/test_exec_hangs.py saw 1 of 8)."""
    clock = Stopwatch()
    slots = ExecSlots(1, clock=clock)
    overdue: list[str] = []
    first = await slots.acquire("a")
    first.bound(soft_at=0.5, due=2.0, on_due=lambda: overdue.append("a"))
    clock.now = 0.6
    async with asyncio.timeout(HANG_GUARD):
        second = await slots.acquire("b")  # a's slot, preempted past its start hold
    assert (first.released, second.released) == (True, False)
    assert first.next_bound() == 2.0  # the call's longest hold is still kept
    clock.now = 2.1
    slots.check_bounds()
    assert overdue == ["a"]
    slots.check_bounds()  # once only
    assert overdue == ["a"]
    assert first.next_bound() is None


async def test_an_answered_call_is_never_overdue() -> None:
    """Once its call is answered (``finish``) or ended (``unbind``), a slot keeps no bound."""
    clock = Stopwatch()
    slots = ExecSlots(2, clock=clock)
    overdue: list[str] = []
    answered = await slots.acquire("a")
    answered.bound(soft_at=0.5, due=2.0, on_due=lambda: overdue.append("a"))
    cancelled = await slots.acquire("b")
    cancelled.bound(soft_at=0.5, due=2.0, on_due=lambda: overdue.append("b"))
    answered.finish(took=0.1)
    cancelled.unbind()
    cancelled.release()
    clock.now = 3.0
    slots.check_bounds()
    assert overdue == []
    assert (answered.next_bound(), cancelled.next_bound()) == (None, None)
