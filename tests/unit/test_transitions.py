"""The transition log: numbering, incarnations, the replay buffer, resuming and its limits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from cri_prober.discovery.model import ContainerInfo
from cri_prober.manager.events import ResultChanged
from cri_prober.manager.state import Health
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.results import Published
from cri_prober.probing.worker import HISTORY_OUTPUT_BYTES
from cri_prober.serving.transitions import (
    IncarnationRequired,
    OtherIncarnation,
    Transition,
    TransitionGap,
    TransitionLog,
)
from tests.support.waiting import HANG_GUARD
from tests.unit.slots import make_slot

# Running and started, not ready: serving needs ready, so the snapshot's ``healthy`` is False.
NOT_READY = Health(running=True, started=True, ready=False, live=True)


def publish(
    log: TransitionLog,
    container: ContainerInfo,
    result: Published,
    previous: Published | None,
    *,
    consecutive: int = 1,
    output: str = "",
) -> Transition:
    return log.record(
        ResultChanged(
            container, ProbeKind.READINESS, previous, result, consecutive, output, NOT_READY
        )
    )


def flip(log: TransitionLog, container: ContainerInfo, count: int) -> list[Transition]:
    """Log ``count`` readiness transitions alternating failure and success."""
    previous: Published | None = None
    logged = []
    for index in range(count):
        result = Published.SUCCESS if index % 2 else Published.FAILURE
        logged.append(publish(log, container, result, previous))
        previous = result
    return logged


async def take(stream: AsyncIterator[Transition], count: int) -> list[Transition]:
    async with asyncio.timeout(HANG_GUARD):
        return [await anext(stream) for _ in range(count)]


class TestNumbering:
    async def test_sequences_start_at_one_and_snapshot_the_container(self) -> None:
        """Each transition gets the next number and the container's state right after it."""
        log = TransitionLog(clock=lambda: 42.0)
        logged = flip(log, make_slot().container, 2)
        assert log.sequence == 2
        assert [t.sequence for t in logged] == [1, 2]
        replay = await take(log.follow(since=0), 2)
        assert replay == logged
        first = replay[0]
        assert (first.container_id, first.container_name, first.pod_name) == (
            "id-app",
            "app",
            "web-0",
        )
        assert (first.pod_namespace, first.pod_uid, first.time) == ("shop", "uid-1", 42.0)
        assert (first.kind, first.previous, first.result) == (
            ProbeKind.READINESS,
            None,
            Published.FAILURE,
        )
        # The event's health snapshot: started, not ready, hence not healthy.
        assert (first.started, first.ready, first.healthy) == (True, False, False)

    def test_keeps_the_run_and_a_shortened_output(self) -> None:
        """The run that published the result is kept, and its output cut to the history's size."""
        log = TransitionLog()
        output = "x" * (HISTORY_OUTPUT_BYTES + 10)
        container = make_slot().container
        logged = publish(log, container, Published.FAILURE, None, consecutive=3, output=output)
        assert (logged.consecutive, logged.output) == (3, output[:HISTORY_OUTPUT_BYTES])


class TestFollow:
    async def test_live_only_without_since(self) -> None:
        """Without ``since`` a reader gets only what happens after it started."""
        log = TransitionLog()
        container = make_slot().container
        flip(log, container, 2)
        stream = log.follow()
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        publish(log, container, Published.FAILURE, Published.SUCCESS)
        assert (await asyncio.wait_for(pending, HANG_GUARD)).sequence == 3

    async def test_resume_replays_what_followed(self) -> None:
        """With ``since`` a reader first gets the buffered transitions after it, then live ones."""
        log = TransitionLog()
        container = make_slot().container
        flip(log, container, 3)
        stream = log.follow(since=1, incarnation=log.incarnation)
        assert [t.sequence for t in await take(stream, 2)] == [2, 3]
        publish(log, container, Published.SUCCESS, Published.FAILURE)
        assert [t.sequence for t in await take(stream, 1)] == [4]

    async def test_too_old_is_a_gap(self) -> None:
        """Asking for transitions that fell out of the buffer raises TransitionGap."""
        log = TransitionLog(size=3)
        flip(log, make_slot().container, 5)  # 3, 4 and 5 are kept
        with pytest.raises(TransitionGap, match="transition 2 is no longer buffered"):
            await anext(log.follow(since=1, incarnation=log.incarnation))
        stream = log.follow(since=2, incarnation=log.incarnation)
        assert [t.sequence for t in await take(stream, 3)] == [3, 4, 5]

    async def test_never_issued_is_a_gap(self) -> None:
        """A sequence of this incarnation beyond the newest one raises TransitionGap."""
        log = TransitionLog()
        flip(log, make_slot().container, 1)
        with pytest.raises(TransitionGap, match="never issued"):
            await anext(log.follow(since=2, incarnation=log.incarnation))

    async def test_slow_reader_that_falls_behind_gets_a_gap(self) -> None:
        """A reader that lets the buffer overrun what it has not read yet is told so."""
        log = TransitionLog(size=2)
        container = make_slot().container
        stream = log.follow(since=0)
        flip(log, container, 1)
        assert [t.sequence for t in await take(stream, 1)] == [1]
        flip(log, container, 3)  # 2, 3, 4 while the reader sleeps; 2 is dropped
        with pytest.raises(TransitionGap):
            await anext(stream)

    async def test_close_ends_readers(self) -> None:
        """Closing the log ends every follower after what it has not read yet."""
        log = TransitionLog()
        stream = log.follow()
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        log.close()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(pending, HANG_GUARD)


class TestIncarnation:
    def test_every_transition_carries_its_logs_incarnation(self) -> None:
        """Each log (each cri-prober start) has its own random incarnation, on every transition."""
        first, second = TransitionLog(), TransitionLog()
        assert first.incarnation != second.incarnation
        assert len(first.incarnation) == 16
        container = make_slot().container
        assert {t.incarnation for t in flip(first, container, 3)} == {first.incarnation}
        assert TransitionLog(incarnation="fixed").incarnation == "fixed"

    async def test_resume_across_a_restart_is_refused_not_replayed(self) -> None:
        """The finding: sequence 2 of the old process must not replay the new one's 3, 4, 5."""
        container = make_slot().container
        old = TransitionLog(incarnation="0ld0ld0ld0ld0ld0")
        seen = flip(old, container, 2)[-1]
        # cri-prober restarts: a new log numbers its own transitions from 1 again.
        new = TransitionLog(incarnation="5ee5ee5ee5ee5ee5", clock=lambda: 1_700_000_000.0)
        flip(new, container, 5)
        stream = new.follow(since=seen.sequence, incarnation=seen.incarnation)
        with pytest.raises(OtherIncarnation) as error:
            await anext(stream)
        assert str(error.value).startswith(
            "sequence 2 belongs to incarnation 0ld0ld0ld0ld0ld0; this cri-prober is "
            "5ee5ee5ee5ee5ee5, started at 2023-11-14T22:13:20Z. Sequences start again at 1"
        )
        assert isinstance(error.value, TransitionGap)  # the API answers OUT_OF_RANGE for both
        # The same resume point of the new incarnation itself replays as before.
        stream = new.follow(since=2, incarnation=new.incarnation)
        assert [t.sequence for t in await take(stream, 3)] == [3, 4, 5]

    async def test_a_sequence_without_its_incarnation_is_refused(self) -> None:
        """since > 0 alone is ambiguous (which process issued it?): refused, never guessed."""
        log = TransitionLog()
        flip(log, make_slot().container, 3)
        with pytest.raises(IncarnationRequired, match="since_sequence 1 needs the incarnation"):
            await anext(log.follow(since=1))

    async def test_zero_and_live_need_no_incarnation(self) -> None:
        """since 0 (everything still buffered) and a live follow claim no position: still fine."""
        log = TransitionLog()
        container = make_slot().container
        flip(log, container, 2)
        assert [t.sequence for t in await take(log.follow(since=0), 2)] == [1, 2]
        stream = log.follow()
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        publish(log, container, Published.SUCCESS, Published.FAILURE)
        assert (await asyncio.wait_for(pending, HANG_GUARD)).sequence == 3

    async def test_a_stream_of_another_incarnation_is_refused(self) -> None:
        """An incarnation that is not this one is refused even without a sequence."""
        log = TransitionLog()
        with pytest.raises(OtherIncarnation, match=r"^incarnation abc is not running; this "):
            await anext(log.follow(incarnation="abc"))


def test_buffer_needs_room() -> None:
    """A buffer of no transitions is refused."""
    with pytest.raises(ValueError, match="at least one"):
        TransitionLog(size=0)
