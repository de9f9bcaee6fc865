"""The results store: the latest published probe result per (container ID, probe kind), and the
record of one probe attempt.

The store is a plain cache, like the kubelet's results managers without their update channel: a
worker tells its owner about a change itself (``WorkerObserver.result_changed``), with the attempt
that caused it, so nothing has to read the worker's state back to explain a transition.
"""

from __future__ import annotations

import dataclasses
import enum
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.outcome import ProbeOutcome, Reason, reason_of
from cri_prober.probing.pressure import Pressure

# A record's ``source`` when the kubelet ran the attempt and cri-prober read it (serve --mirror).
MIRROR_SOURCE = "kubelet-mirror"


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
    # How late it started after the tick it served (seconds), and how many ticks were dropped
    # just before it because the attempt before ran past them (a Go ticker keeps one pending).
    late: float = 0.0
    dropped: int = 0
    # Who ran it: "" for cri-prober itself, ``MIRROR_SOURCE`` for a kubelet attempt read from
    # its counters (serve --mirror), whose ``started_at`` is the read that showed it and
    # ``window`` how long before that read (the previous one) it may have started (it served
    # no tick of cri-prober's, so its ``late`` is 0: the history keeps one in the other's place).
    source: str = ""
    window: float = 0.0

    @classmethod
    def of(
        cls,
        container_id: str,
        started_at: float,
        duration: float,
        outcome: ProbeOutcome,
        *,
        pressure: Pressure | None = None,
        run: int = 0,
        threshold: int = 0,
        changed: bool = False,
        held: bool = False,
        late: float = 0.0,
        dropped: int = 0,
    ) -> ProbeRecord:
        """The record of an attempt that ran (workers, RunProbe and ``check`` all build it here);
        a worker gives what it made of it at once (see ``counted``), in one record."""
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
            run,
            threshold,
            changed,
            held,
            pressure,
            late,
            dropped,
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

    def counted(
        self,
        run: int,
        threshold: int,
        *,
        changed: bool,
        held: bool,
        late: float = 0.0,
        dropped: int = 0,
    ) -> ProbeRecord:
        """This record with what the worker made of it, and when it came."""
        return dataclasses.replace(
            self,
            run=run,
            threshold=threshold,
            changed=changed,
            held=held,
            late=late,
            dropped=dropped,
        )


# History columns. A missing exit code or HTTP status is stored as this; the flags pack
# timed_out, changed and held.
_NONE = -(2**31)
_TIMED_OUT, _CHANGED, _HELD = 1, 2, 4
# started_at, duration, and late, or, for a mirrored attempt (``source`` set), which has no tick
# to be late for, its window: no column of its own, so a probe cri-prober runs pays nothing.
_FLOATS = 3
_INTS = 6  # exit code, HTTP status, run, threshold, flags, dropped
# container ID, result, output, note, reason, source and the pressure's cpu, memory and io (None
# for none): one palette entry for all of them, a flat tuple the collector untracks at once.
_Words = tuple[str, str, str, str, str, str, float | None, float | None, float | None]


class History:
    """A worker's newest attempts, oldest first, at most ``size`` of them, kept in columns.

    A node keeps 32 attempts per probe: 320,000 at 5,000 containers. As a tuple and two floats
    per attempt they took about 6.8 KiB per probe (68 MiB for 10,000 probes) before any output,
    and the collector walked them on every full collection. Here numbers live in ``array``s
    (8 bytes a float, 4 an int). An attempt's words (container ID, result, output,
    note, reason, pressure) are one entry of a small palette, and the attempt keeps its index
    (2 bytes): a steady probe's attempts all share one entry, and a flapping one's alternate
    between two. Six references an attempt were 1.5 KiB of every full history (issue 25: a
    node's memory, by what is kept): a steady probe's full history took 3.5 KiB, and now 2.2 KiB
    (tracemalloc, the object and its arrays' spare room included), and five objects
    per probe for the collector to see. Reading gives ``ProbeRecord``s.
    """

    __slots__ = ("_codes", "_floats", "_ints", "_next", "_palette", "_size")

    def __init__(self, size: int) -> None:
        self._size = size
        self._next = 0  # the slot the next attempt goes to, once the columns are full
        self._floats = array("d")  # started_at, duration, late (or a mirror's window)
        self._ints = array("i")  # _INTS per attempt
        self._codes = array("H")  # each attempt's palette index (a size is at most 10,000)
        # Distinct words, in no order; entries no attempt uses any more are dropped when it
        # reaches twice the size, so it holds at most that many.
        self._palette: list[_Words] = []

    @property
    def maxlen(self) -> int:
        return self._size

    def append(self, r: ProbeRecord) -> None:
        flags = (
            (_TIMED_OUT if r.timed_out else 0)
            | (_CHANGED if r.changed else 0)
            | (_HELD if r.held else 0)
        )
        ints = (
            _NONE if r.exit_code is None else _clamp(r.exit_code),
            _NONE if r.http_status is None else _clamp(r.http_status),
            _clamp(r.run),
            _clamp(r.threshold),
            flags,
            _clamp(r.dropped),
        )
        p = r.pressure
        cpu, memory, io = (None, None, None) if p is None else (p.cpu, p.memory, p.io)
        code = self._code(
            (r.container_id, r.result, r.output, r.note, r.reason, r.source, cpu, memory, io)
        )
        self._put(r.started_at, r.duration, r.window if r.source else r.late, ints, code)

    def repeat(self, started_at: float, duration: float, late: float, run: int) -> None:
        """One more attempt like the newest (its words, codes and threshold; not changed, held
        or dropped), with its own times and run: a steady probe's attempt, kept without a record.
        Read back it is the record ``append`` would have kept for it."""
        newest = self._slot(len(self) - 1)
        ints, base = self._ints, _INTS * newest
        flags = ints[base + 4] & _TIMED_OUT
        repeated = (ints[base], ints[base + 1], _clamp(run), ints[base + 3], flags, 0)
        self._put(started_at, duration, late, repeated, self._codes[newest])

    def _put(
        self, started_at: float, duration: float, late: float, ints: tuple[int, ...], code: int
    ) -> None:
        if len(self) < self._size:
            self._floats.extend((started_at, duration, late))
            self._ints.extend(ints)
            self._codes.append(code)
            return
        slot = self._next
        self._next = (slot + 1) % self._size
        # In place, item by item: no temporary arrays for the collector to count.
        self._floats[_FLOATS * slot] = started_at
        self._floats[_FLOATS * slot + 1] = duration
        self._floats[_FLOATS * slot + 2] = late
        for offset, value in enumerate(ints):
            self._ints[_INTS * slot + offset] = value
        self._codes[slot] = code

    def durations(self, count: int) -> tuple[float, ...]:
        """The durations of the newest ``count`` attempts, oldest first."""
        return self._newest(count, 1)

    def starts(self, count: int) -> tuple[float, ...]:
        """The start stamps (``started_at``) of the newest ``count`` attempts, oldest first."""
        return self._newest(count, 0)

    def _newest(self, count: int, column: int) -> tuple[float, ...]:
        size = len(self)
        return tuple(
            self._floats[_FLOATS * self._slot(index) + column]
            for index in range(max(0, size - count), size)
        )

    def _code(self, words: _Words) -> int:
        """The palette index of ``words``, added if new (equal tuples compare in C: a steady
        probe's are found at once, a changed one's after at most twice the size)."""
        palette = self._palette
        count = len(self)
        if count and palette[newest := self._codes[self._slot(count - 1)]] == words:
            return newest
        try:
            return palette.index(words)
        except ValueError:
            pass
        if len(palette) >= 2 * self._size:
            self._compact()
        palette.append(words)
        return len(palette) - 1

    def _compact(self) -> None:
        """Keep only the entries some attempt uses (the oldest attempt's is about to be
        overwritten, but may still be read until then)."""
        used = sorted(set(self._codes))
        renumber = {old: new for new, old in enumerate(used)}
        self._palette[:] = [self._palette[old] for old in used]
        for slot, old in enumerate(self._codes):
            self._codes[slot] = renumber[old]

    def extend(self, records: Iterable[ProbeRecord]) -> None:
        for record in records:
            self.append(record)

    def __len__(self) -> int:
        return len(self._codes)

    def __iter__(self) -> Iterator[ProbeRecord]:
        return (self[index] for index in range(len(self)))

    def __getitem__(self, index: int) -> ProbeRecord:
        count = len(self)
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError("history index out of range")
        slot = self._slot(index)
        started_at, duration, late = self._floats[_FLOATS * slot : _FLOATS * (slot + 1)]
        exit_code, http_status, run, threshold, flags, dropped = self._ints[
            _INTS * slot : _INTS * (slot + 1)
        ]
        container_id, result, output, note, reason, source, cpu, memory, io = self._palette[
            self._codes[slot]
        ]
        window, late = (late, 0.0) if source else (0.0, late)
        return ProbeRecord(
            container_id,
            started_at,
            duration,
            result,
            output,
            None if exit_code == _NONE else exit_code,
            None if http_status == _NONE else http_status,
            bool(flags & _TIMED_OUT),
            note,
            reason,
            run,
            threshold,
            bool(flags & _CHANGED),
            bool(flags & _HELD),
            None if cpu is None or memory is None or io is None else Pressure(cpu, memory, io),
            late,
            dropped,
            source,
            window,
        )

    def _slot(self, index: int) -> int:
        """The column slot of the ``index``-th oldest attempt."""
        if len(self) < self._size:
            return index
        return (self._next + index) % self._size


def _clamp(value: int) -> int:
    """An int the columns can hold (exit codes and statuses fit; anything else is clamped)."""
    return max(_NONE + 1, min(value, 2**31 - 1))


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
    source: str = ""  # who decided it: "" cri-prober, ``MIRROR_SOURCE`` the kubelet (--mirror)


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
