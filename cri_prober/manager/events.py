"""The manager's one event stream: what servers, metrics and tests follow.

Every event carries the container as discovery last saw it (a frozen ``ContainerInfo``), so a
listener needs nothing else to label it. Listeners run in the publishing task: keep them quick.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cri_prober.discovery.model import ContainerInfo
from cri_prober.manager.state import Health
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.results import ProbeRecord, Published
from cri_prober.topic import Topic


@dataclass(frozen=True, slots=True)
class AttemptFinished:
    """A worker finished one attempt (errored ones included: ``record.result == "error"``)."""

    container: ContainerInfo
    kind: ProbeKind
    record: ProbeRecord


@dataclass(frozen=True, slots=True)
class AttemptsRepeated:
    """A steady probe's repeated attempts, told in one event (``ManagerTopic``): each was like
    ``record`` (its container, result, reason, output and threshold; none changed the result,
    was held or dropped a tick) but for its duration and start, ``durations`` and ``starts``
    (each its ``started_at``) oldest first. ``record`` is the newest of them."""

    container: ContainerInfo
    kind: ProbeKind
    record: ProbeRecord
    durations: tuple[float, ...]
    starts: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class ResultChanged:
    """A published result changed (a transition), with the container's health right after."""

    container: ContainerInfo
    kind: ProbeKind
    previous: Published | None
    result: Published
    consecutive: int  # the run of identical attempt results that published it
    output: str  # the output of the attempt that published it ("" when none did)
    health: Health
    reason: str = ""  # an ``outcome.Reason``: the attempt's, or why none was needed
    threshold: int = 0  # the threshold ``consecutive`` met (0 without an attempt)
    held: bool = False  # the probe went on hold until the container restarts
    stop_requested: bool = False  # --on-failure stop: it makes the manager stop the container
    source: str = ""  # who decided it: "" cri-prober, "kubelet-mirror" the kubelet (--mirror)


@dataclass(frozen=True, slots=True)
class WorkerStopped:
    """A worker ended; ``replaced`` when a new worker for the same probe already runs."""

    container: ContainerInfo
    kind: ProbeKind
    replaced: bool


@dataclass(frozen=True, slots=True)
class Reconciled:
    """The workers were brought in line with the node and the rules."""

    tracked: int  # containers with at least one probe


@dataclass(frozen=True, slots=True)
class ContainerGone:
    """A container slot was dropped: no probes for it any more."""

    container: ContainerInfo


ManagerEvent = (
    AttemptFinished | AttemptsRepeated | ResultChanged | WorkerStopped | Reconciled | ContainerGone
)


class ManagerTopic(Topic[ManagerEvent]):
    """The manager's event stream, which tells a steady probe's repeated attempts in runs
    (``AttemptsRepeated``) while every listener takes them so (``subscribe(..., runs=True)``).

    A listener subscribed plainly gets an ``AttemptFinished`` for every attempt, as it happens:
    while one is subscribed, workers hold nothing back. A listener that counts attempts calls
    ``catch_up`` before it reads its counts, to be told the repeats held back so far.
    """

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._every_attempt = 0  # listeners that need an AttemptFinished per attempt
        # Set by the manager: tells every worker's held-back repeats, a few hundred workers per
        # step of the iterator, so that a reader on the loop can give it a turn between steps.
        self.flush: Callable[[], Iterator[None]] | None = None

    def subscribe(
        self, listener: Callable[[ManagerEvent], None], *, runs: bool = False
    ) -> Callable[[], None]:
        """Call ``listener`` for every event from now on; with ``runs`` it takes repeated
        attempts as ``AttemptsRepeated``. Returns a function that unsubscribes."""
        unsubscribe = super().subscribe(listener)
        if runs:
            return unsubscribe
        self._every_attempt += 1
        subscribed = True

        def unsubscribe_every() -> None:
            nonlocal subscribed
            unsubscribe()
            if subscribed:
                subscribed = False
                self._every_attempt -= 1

        return unsubscribe_every

    @property
    def takes_runs(self) -> bool:
        """Whether workers may hold repeated attempts back (no listener needs each one)."""
        return self._every_attempt == 0

    def catch_up(self) -> None:
        """Have the workers tell the repeats they hold back (``AttemptsRepeated``) now."""
        for _ in self.catch_up_in_steps():
            pass

    def catch_up_in_steps(self) -> Iterator[None]:
        """``catch_up``, a few hundred workers per step: at 10,000 containers telling every
        worker's repeats at once held the loop for tens of milliseconds (issue 36)."""
        if self.flush is not None:
            yield from self.flush()


def subscribe_runs(
    events: Topic[ManagerEvent], listener: Callable[[ManagerEvent], None]
) -> Callable[[], None]:
    """Subscribe ``listener``, which takes repeated attempts in runs (``AttemptsRepeated``), to
    ``events``; a plain ``Topic`` (a test's stand-in for the manager) tells every attempt."""
    if isinstance(events, ManagerTopic):
        return events.subscribe(listener, runs=True)
    return events.subscribe(listener)


def catch_up(events: Topic[ManagerEvent]) -> None:
    """Have the manager behind ``events`` tell the repeated attempts held back so far."""
    if isinstance(events, ManagerTopic):
        events.catch_up()


def catch_up_in_steps(events: Topic[ManagerEvent]) -> Iterator[None]:
    """``catch_up(events)`` in steps of a few hundred workers (``ManagerTopic``)."""
    if isinstance(events, ManagerTopic):
        yield from events.catch_up_in_steps()


__all__ = [
    "AttemptFinished",
    "AttemptsRepeated",
    "ContainerGone",
    "ManagerEvent",
    "ManagerTopic",
    "Reconciled",
    "ResultChanged",
    "WorkerStopped",
    "catch_up",
    "catch_up_in_steps",
    "subscribe_runs",
]
