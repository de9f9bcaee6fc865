"""A mirror worker (serve --mirror): for a probe the kubelet runs, it runs nothing and instead
records the kubelet's own attempts, read from its per-probe counters, and publishes the
kubelet's verdicts, so every surface shows them through the same observer path as a probe
worker's (marked ``source: kubelet-mirror``).

What a mirror cannot know: the order of several attempts that fell between two reads, the
exact instant of each (only the window between the two reads), and a failure's text (the
counters carry none); see docs/kubelet-mirror.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import structlog

from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.outcome import Reason
from cri_prober.probing.results import MIRROR_SOURCE, ProbeRecord, Published
from cri_prober.probing.worker import (
    INITIAL_VALUE,
    ContainerView,
    ProbeWorker,
    Wake,
    predates_prober,
)

__all__ = ["FailureText", "FailureTexts", "KubeletStatus", "MirrorWorker", "MirroredAttempts"]

log = structlog.get_logger(__name__)

# How many records one window may add: a window of many attempts (a long gap between good
# reads) is summed up in this many records, the last of which says how many it stands for.
MAX_RECORDS_PER_WINDOW = 8
# --mirror-explain rerun: at most one explaining attempt per probe this often (a flapping probe
# fails anew at every flap; the explanation is for a person, who needs no more than this).
EXPLAIN_MIN_INTERVAL = 10.0
EXPLAIN_NOTE = (
    "cri-prober ran it once to explain the kubelet's failure (--mirror-explain rerun), after "
    "it: it counts for nothing"
)


# A kubelet event's time has whole seconds (lastTimestamp): it may be this much before the
# instant it stands for, so an event only counts as older than a window by more than this.
EVENT_TIME_SLACK = 1.0


@dataclass(frozen=True, slots=True)
class FailureText:
    """The kubelet's newest ``Unhealthy`` event text of a probe and its time (epoch seconds),
    from the API server (podspecs/unhealthy_events.py): what a mirrored failure shows."""

    text: str
    at: float


class FailureTexts(Protocol):
    """Where a mirror worker finds its probe's newest kubelet failure text."""

    def get(self, pod_uid: str, container: str, kind: ProbeKind) -> FailureText | None: ...


@dataclass(frozen=True, slots=True)
class MirroredAttempts:
    """The kubelet's attempts of one probe between two reads of its counters.

    ``since`` and ``until`` are the wall-clock times of the two reads; ``duration`` is the mean
    duration of the window's timed attempts (the kubelet times successful and unknown ones only),
    None when it has none.
    """

    pod_uid: str
    container: str
    kind: ProbeKind
    successes: int
    failures: int
    unknowns: int
    since: float
    until: float
    duration: float | None = None

    @property
    def total(self) -> int:
        return self.successes + self.failures + self.unknowns


@dataclass(frozen=True, slots=True)
class KubeletStatus:
    """What the kubelet's pod status says of one container (``containerStatuses[]``)."""

    container_id: str  # without the runtime's scheme ("containerd://")
    ready: bool
    started: bool | None


_RESULTS = {
    Published.SUCCESS: ("success", Reason.OK),
    Published.FAILURE: ("failure", Reason.KUBELET),
    Published.UNKNOWN: ("unknown", Reason.UNKNOWN),
}


class MirrorWorker(ProbeWorker):
    """Stands for one kubelet probe worker: keeps its attempts and publishes its verdicts.

    The manager calls ``mirror`` with each window of the kubelet's attempts and ``kubelet_status``
    with the kubelet's pod status; both run in the caller's task and publish through the
    observer. The worker's own task only waits, so that it is stopped and cleaned up like any
    worker; a trigger (a container exit) makes it publish step (7)'s failure for a container
    that is not running, as the kubelet's worker does.
    """

    __slots__ = (
        "_explain_due",
        "_explained_at",
        "counted_for",
        "explain",
        "failure_text",
        "mirrored",
    )
    publishes_as: ClassVar[str] = MIRROR_SOURCE

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mirrored = 0  # the kubelet attempts recorded
        # The container whose attempts this worker counted: from then on the counters, which
        # are read every second, decide its results; the pod status (read less often, and
        # possibly older than the counters) only sets where a container starts.
        self.counted_for: str | None = None
        # --mirror-explain rerun: on a new kubelet failure, run the probe once (cri-prober's own
        # attempt, recorded and counted for nothing) to capture its output.
        self.explain = False
        self._explain_due = False
        self._explained_at: float | None = None
        # serve --mirror with --probes-from apiserver: the kubelet's newest Unhealthy event text
        # of this probe (None: no event source, or no event yet), for its failures' output.
        self.failure_text: Callable[[], FailureText | None] | None = None

    async def run(self) -> None:
        structlog.contextvars.bind_contextvars(**self._log_context)
        loop = asyncio.get_running_loop()
        try:
            while not self._stop_requested:
                wakeup: asyncio.Future[Wake] = loop.create_future()
                self._wakeup = wakeup
                if self._trigger_pending:
                    wakeup.set_result(Wake.TRIGGER)
                wake = self._woken(await wakeup)
                if wake is Wake.STOP:
                    break
                self._urgent = False
                self._check_exit()
                if self._explain_due:
                    self._explain_due = False
                    await self._explain()
        finally:
            self._cleanup()

    async def _explain(self) -> None:
        """Run the probe once, after a new kubelet failure, to show what it answers now: the
        kubelet's counters carry no output. Recorded as cri-prober's own attempt (no source),
        counted toward nothing and publishing nothing."""
        view = self._current()
        if view is None or not view.running or self._stop_requested:
            return
        now = self._clock.monotonic()
        if self._explained_at is not None and now - self._explained_at < EXPLAIN_MIN_INTERVAL:
            return
        self._explained_at = now
        started_wall = self._clock.wall()
        self.probing_since = started_wall
        try:
            outcome, error = await self._probe_with_retries(view)
        finally:
            self.probing_since = None
        duration = self._clock.monotonic() - now
        if outcome is None:
            record = ProbeRecord.errored(view.id, started_wall, duration, str(error))
        else:
            record = ProbeRecord.of(view.id, started_wall, duration, outcome)
        note = f"{record.note}; {EXPLAIN_NOTE}" if record.note else EXPLAIN_NOTE
        self._record(dataclasses.replace(record, note=note))

    def _current(self) -> ContainerView | None:
        """The container's view, starting over (as the kubelet's step 5 does) on a new one."""
        view = self._status()
        if view is None:
            return None
        if view.id != self.container_id:
            self.container_id = view.id
            self._log_context["container_id"] = view.id[:13]
            self.last_result = Published.SUCCESS
            self.result_run = 0
            self.on_hold = False
            self.held_after = 0
            # The kubelet's step (5) publishes the initial value for a new container; one that
            # predates cri-prober keeps its state until the pod status says it (KEP-4781).
            old = predates_prober(
                running=view.running,
                started_at=view.started_at,
                prober_started_at=self._prober_started_at,
            )
            if self._results.get(view.id, self.kind) is None and not old:
                self._publish(view.id, INITIAL_VALUE[self.kind], reason=Reason.INITIAL)
        return view

    def _check_exit(self) -> None:
        view = self._current()
        if view is not None and not view.running and not self.on_hold:
            # (7) The kubelet publishes Failure for a container that is not running.
            self._publish(view.id, Published.FAILURE, reason=Reason.NOT_RUNNING)

    def mirror(self, attempts: MirroredAttempts) -> int:
        """Record the window's attempts and publish what the kubelet's worker published after
        them (its thresholds and hold, §3.3); returns how many attempts were recorded."""
        view = self._current()
        if view is None or self._stop_requested or attempts.total <= 0:
            return 0
        container_id = view.id
        counts = {
            Published.SUCCESS: attempts.successes,
            Published.FAILURE: attempts.failures,
            Published.UNKNOWN: attempts.unknowns,
        }
        mixed = sum(1 for count in counts.values() if count) > 1
        if self.explain and attempts.failures and self.last_result is not Published.FAILURE:
            # A new failure (the run was not failing): explain it once the window is recorded.
            self._explain_due = True
            self.trigger()
        # Within one window the order is unknown. The result the run was on goes first: a run
        # goes on more often than it changes, so the differing result is the likelier newest.
        order = sorted(counts, key=lambda result: result is not self.last_result)
        window = max(0.0, attempts.until - attempts.since)
        kept = 0
        for result in order:
            count = counts[result]
            if not count:
                continue
            for index in range(count):
                stands_for = 1
                if count > MAX_RECORDS_PER_WINDOW and index >= MAX_RECORDS_PER_WINDOW - 1:
                    if index > MAX_RECORDS_PER_WINDOW - 1:
                        self._count(result, container_id, record=None)
                        continue
                    stands_for = count - index
                record = self._record_of(
                    container_id, result, attempts, window, mixed=mixed, stands_for=stands_for
                )
                self._count(result, container_id, record=record)
                kept += 1
        self.mirrored += attempts.total
        return kept

    def _record_of(
        self,
        container_id: str,
        result: Published,
        attempts: MirroredAttempts,
        window: float,
        *,
        mixed: bool,
        stands_for: int,
    ) -> ProbeRecord:
        text, reason = _RESULTS[result]
        notes = []
        if attempts.total > 1:
            notes.append(f"one of {attempts.total} kubelet attempts between two reads")
        if mixed:
            notes.append("their order within the window is unknown")
        if stands_for > 1:
            notes.append(f"stands for {stands_for} attempts with this result")
        timed = result is not Published.FAILURE and attempts.duration is not None
        output = ""
        if result is Published.FAILURE:
            explained = self.failure_text() if self.failure_text is not None else None
            if explained is None:
                notes.append("the kubelet's Unhealthy event says why")
            else:
                output = explained.text
                notes.append(_event_note(explained, attempts.since))
        return ProbeRecord(
            container_id,
            attempts.until,
            attempts.duration if timed and attempts.duration is not None else 0.0,
            text,
            output,
            note="; ".join(notes),
            reason=reason,
            source=MIRROR_SOURCE,
            window=window,
        )

    def _count(self, result: Published, container_id: str, *, record: ProbeRecord | None) -> None:
        """The kubelet's doProbe after its probe ran: the run, the thresholds, the hold."""
        if self.last_result is result:
            self.result_run += 1
        else:
            self.last_result = result
            self.result_run = 1
        timing = self.timing
        below = (result is Published.FAILURE and self.result_run < timing.failure_threshold) or (
            result is Published.SUCCESS and self.result_run < timing.success_threshold
        )
        publishes = not below and not self.on_hold
        hold = publishes and self.kind is not ProbeKind.READINESS and result is Published.FAILURE
        if record is not None:
            previous = self._results.get(container_id, self.kind)
            changed = publishes and previous is not result
            self._record(
                record.counted(
                    self.result_run,
                    timing.failure_threshold
                    if result is Published.FAILURE
                    else timing.success_threshold,
                    changed=changed,
                    held=hold,
                )
            )
            record = self.last_record
        else:
            self.probes_run += 1
        self.counted_for = container_id
        if publishes:
            self._publish(container_id, result, record)
        if hold:
            # The kubelet's worker holds until a new container and zeroes its run.
            self.on_hold = True
            self.held_after = self.result_run
            self.failed_container = container_id
            self.result_run = 0

    def kubelet_status(self, status: KubeletStatus | None) -> None:
        """Publish what the kubelet's pod status says of this container (ready, started), when
        it is about the container this worker mirrors and no counted attempt of it has spoken
        yet: the kubelet's verdict from before the mirror's first read, or a new container's."""
        view = self._current()
        if view is None or status is None or status.container_id != view.id:
            return
        if self.counted_for == view.id:
            return
        if not view.running:
            return  # the exit is step (7)'s
        if self.kind is ProbeKind.STARTUP and status.started is not None:
            if status.started:
                self._publish(view.id, Published.SUCCESS, reason=Reason.KUBELET)
        elif self.kind is ProbeKind.READINESS and status.started is not False:
            result = Published.SUCCESS if status.ready else Published.FAILURE
            self._publish(view.id, result, reason=Reason.KUBELET)


def _event_note(explained: FailureText, since: float) -> str:
    """Where a mirrored failure's output comes from, and whether it may be another failure's:
    the kubelet's recorder lets 25 events through per object, then about one per 5 minutes."""
    if explained.at + EVENT_TIME_SLACK < since:
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(explained.at))
        return (
            f"text from the kubelet's event at {at}, before this failure: the kubelet "
            "rate-limits its events"
        )
    return "text from the kubelet's Unhealthy event"
