"""The results store: the latest published probe result per (container ID, probe kind), and the
record of one probe attempt.

The store is a plain cache, like the kubelet's results managers without their update channel: a
worker tells its owner about a change itself (``WorkerObserver.result_changed``), with the attempt
that caused it, so nothing has to read the worker's state back to explain a transition.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.outcome import ProbeOutcome, Reason, reason_of
from cri_prober.probing.pressure import Pressure


@dataclass(frozen=True, slots=True)
class ProbeRecord:
    """One probe attempt as workers keep it in their history and the API reports it: what it
    said, why (``reason``), whether it counted and what it caused."""

    container_id: str
    started_at: float  # wall-clock seconds since the epoch
    duration: float  # seconds
    result: str  # success, warning, failure, unknown, or error (could not run; not counted)
    output: str
    exit_code: int | None = None
    http_status: int | None = None
    timed_out: bool = False  # a failure because the probe's timeout expired
    note: str = ""  # what else the attempt showed, e.g. an exec answer that came after its timeout
    reason: str = ""  # an ``outcome.Reason``
    # The run of identical results this attempt made, out of the threshold that publishes it
    # (failure 2/3: run 2, threshold 3); 0/0 for an attempt no worker counted (an errored one,
    # RunProbe's, check's).
    run: int = 0
    threshold: int = 0
    changed: bool = False  # it changed the published result
    held: bool = False  # it put the probe on hold until the container restarts
    pressure: Pressure | None = None  # the node's pressure when it failed (failures only)

    @classmethod
    def of(
        cls,
        container_id: str,
        started_at: float,
        duration: float,
        outcome: ProbeOutcome,
        *,
        pressure: Pressure | None = None,
    ) -> ProbeRecord:
        """The record of an attempt that ran (workers, RunProbe and ``check`` all build it here)."""
        return cls(
            container_id,
            started_at,
            duration,
            outcome.result.value,
            outcome.output,
            outcome.exit_code,
            outcome.http_status,
            outcome.timed_out,
            outcome.note,
            reason_of(outcome),
            pressure=pressure,
        )

    @classmethod
    def errored(
        cls,
        container_id: str,
        started_at: float,
        duration: float,
        error: str,
        *,
        reason: str = Reason.NOT_RUN,
        pressure: Pressure | None = None,
    ) -> ProbeRecord:
        """The record of an attempt that could not run: never counted, the reason as output."""
        return cls(
            container_id, started_at, duration, "error", error, reason=reason, pressure=pressure
        )

    def counted(self, run: int, threshold: int, *, changed: bool, held: bool) -> ProbeRecord:
        """This record with what the worker made of it."""
        return dataclasses.replace(self, run=run, threshold=threshold, changed=changed, held=held)


_Row = tuple[
    str,
    float,
    float,
    str,
    str,
    int | None,
    int | None,
    bool,
    str,
    str,
    int,
    int,
    bool,
    bool,
    tuple[float, float, float] | None,  # a Pressure, as a tuple the collector can untrack
]


class History:
    """A worker's newest attempts, oldest first, at most ``size`` of them.

    Rows are kept as plain tuples of strings, numbers and None, which the garbage collector
    stops tracking once it has seen them: a node keeps 32 per probe (320,000 at 5,000
    containers), and as tracked objects they lengthened every full collection, a stall of the
    whole event loop (measured ~0.3 s at 5,000 containers). Reading gives ``ProbeRecord``s.
    """

    __slots__ = ("_rows",)

    def __init__(self, size: int) -> None:
        self._rows: deque[_Row] = deque(maxlen=size)

    @property
    def maxlen(self) -> int | None:
        return self._rows.maxlen

    def append(self, r: ProbeRecord) -> None:
        self._rows.append(
            (
                r.container_id,
                r.started_at,
                r.duration,
                r.result,
                r.output,
                r.exit_code,
                r.http_status,
                r.timed_out,
                r.note,
                r.reason,
                r.run,
                r.threshold,
                r.changed,
                r.held,
                None if r.pressure is None else (r.pressure.cpu, r.pressure.memory, r.pressure.io),
            )
        )

    def extend(self, records: Iterable[ProbeRecord]) -> None:
        for record in records:
            self.append(record)

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[ProbeRecord]:
        return (_record(row) for row in self._rows)

    def __getitem__(self, index: int) -> ProbeRecord:
        return _record(self._rows[index])


def _record(row: _Row) -> ProbeRecord:
    pressure = row[-1]
    return ProbeRecord(*row[:-1], None if pressure is None else Pressure(*pressure))


class Published(enum.Enum):
    """A published result: warnings count as success; errored attempts are never published."""

    SUCCESS = "success"
    FAILURE = "failure"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class ResultUpdate:
    """One change of a published result (``previous`` is None for a container's first value).

    ``record`` is the attempt that made it (None when no attempt did: the initial value, a
    container that is not running, a deleted pod's quiet end), and ``consecutive`` how many
    attempts in a row gave that result (0 without an attempt).
    """

    container_id: str
    kind: ProbeKind
    previous: Published | None
    result: Published
    consecutive: int = 0
    record: ProbeRecord | None = None
    reason: str = ""  # the record's, or why it was published without one (``Reason``)


class ResultsStore:
    """Published results keyed by container ID and probe kind: a plain cache."""

    def __init__(self) -> None:
        self._results: dict[tuple[str, ProbeKind], Published] = {}

    def get(self, container_id: str, kind: ProbeKind) -> Published | None:
        """The cached result, or None when nothing was published for this container yet."""
        return self._results.get((container_id, kind))

    def set(self, container_id: str, kind: ProbeKind, result: Published) -> Published | None:
        """Store ``result``; return what it replaced (None: nothing was published yet)."""
        key = (container_id, kind)
        previous = self._results.get(key)
        self._results[key] = result
        return previous

    def remove(self, container_id: str, kind: ProbeKind) -> None:
        """Forget a result (the kubelet's Remove); nobody is told."""
        self._results.pop((container_id, kind), None)

    def __len__(self) -> int:
        return len(self._results)
