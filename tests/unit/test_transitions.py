"""The transition log: numbering, the replay buffer, resuming and its limits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from cri_prober.cri import ExecResult
from cri_prober.manager import ProbeManager, Slot
from cri_prober.prober import Prober
from cri_prober.results import Published, ResultUpdate
from cri_prober.spec import ProbeKind, RulesFile
from cri_prober.transitions import Transition, TransitionGap, TransitionLog
from tests.unit.slots import make_slot


class NoExec:
    """An exec runner for a manager whose workers never run."""

    async def exec_sync(self, container_id: str, cmd: Sequence[str], *, timeout: int) -> ExecResult:
        raise AssertionError("no probe runs in these tests")


@pytest.fixture(name="manager")
def _manager() -> ProbeManager:
    return ProbeManager(prober=Prober(NoExec()), rules=RulesFile(probes=()))


def publish(log: TransitionLog, slot: Slot, result: Published, previous: Published | None) -> None:
    log.transition(
        slot, ResultUpdate(slot.container.id, ProbeKind.READINESS, previous, result), None
    )


def flip(log: TransitionLog, slot: Slot, count: int) -> None:
    """Log ``count`` readiness transitions alternating failure and success."""
    previous: Published | None = None
    for index in range(count):
        result = Published.SUCCESS if index % 2 else Published.FAILURE
        publish(log, slot, result, previous)
        previous = result


async def take(stream: AsyncIterator[Transition], count: int) -> list[Transition]:
    async with asyncio.timeout(2):
        return [await anext(stream) for _ in range(count)]


class TestNumbering:
    async def test_sequences_start_at_one_and_snapshot_the_container(
        self, manager: ProbeManager
    ) -> None:
        """Each transition gets the next number and the container's state right after it."""
        changes: list[None] = []
        log = TransitionLog(manager, on_change=lambda: changes.append(None), clock=lambda: 42.0)
        slot = make_slot()
        flip(log, slot, 2)
        assert log.sequence == 2
        assert len(changes) == 2
        replay = await take(log.follow(since=0), 2)
        assert [t.sequence for t in replay] == [1, 2]
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
        # No probes configured for the slot: a running container is started, ready, healthy.
        assert (first.started, first.ready, first.healthy) == (True, True, True)


class TestFollow:
    async def test_live_only_without_since(self, manager: ProbeManager) -> None:
        """Without ``since`` a reader gets only what happens after it started."""
        log = TransitionLog(manager)
        slot = make_slot()
        flip(log, slot, 2)
        stream = log.follow()
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        publish(log, slot, Published.FAILURE, Published.SUCCESS)
        assert (await asyncio.wait_for(pending, 2)).sequence == 3

    async def test_resume_replays_what_followed(self, manager: ProbeManager) -> None:
        """With ``since`` a reader first gets the buffered transitions after it, then live ones."""
        log = TransitionLog(manager)
        slot = make_slot()
        flip(log, slot, 3)
        stream = log.follow(since=1)
        assert [t.sequence for t in await take(stream, 2)] == [2, 3]
        publish(log, slot, Published.SUCCESS, Published.FAILURE)
        assert [t.sequence for t in await take(stream, 1)] == [4]

    async def test_too_old_is_a_gap(self, manager: ProbeManager) -> None:
        """Asking for transitions that fell out of the buffer raises TransitionGap."""
        log = TransitionLog(manager, size=3)
        flip(log, make_slot(), 5)  # 3, 4 and 5 are kept
        with pytest.raises(TransitionGap, match="transition 2 is no longer buffered"):
            await anext(log.follow(since=1))
        assert [t.sequence for t in await take(log.follow(since=2), 3)] == [3, 4, 5]

    async def test_never_issued_is_a_gap(self, manager: ProbeManager) -> None:
        """A sequence beyond the newest one (another daemon's) raises TransitionGap."""
        log = TransitionLog(manager)
        flip(log, make_slot(), 1)
        with pytest.raises(TransitionGap, match="never issued"):
            await anext(log.follow(since=2))

    async def test_slow_reader_that_falls_behind_gets_a_gap(self, manager: ProbeManager) -> None:
        """A reader that lets the buffer overrun what it has not read yet is told so."""
        log = TransitionLog(manager, size=2)
        slot = make_slot()
        stream = log.follow(since=0)
        flip(log, slot, 1)
        assert [t.sequence for t in await take(stream, 1)] == [1]
        flip(log, slot, 3)  # 2, 3, 4 while the reader sleeps; 2 is dropped
        with pytest.raises(TransitionGap):
            await anext(stream)

    async def test_close_ends_readers(self, manager: ProbeManager) -> None:
        """Closing the log ends every follower after what it has not read yet."""
        log = TransitionLog(manager)
        stream = log.follow()
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        log.close()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(pending, 2)


def test_buffer_needs_room(manager: ProbeManager) -> None:
    """A buffer of no transitions is refused."""
    with pytest.raises(ValueError, match="at least one"):
        TransitionLog(manager, size=0)
