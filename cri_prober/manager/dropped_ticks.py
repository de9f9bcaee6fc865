"""One node-wide warning when probe ticks are dropped: attempts ran past their period.

A worker keeps one pending tick, like the kubelet's Go ticker, so an attempt that runs past its
period delays the next and drops the ones after it. Each attempt's record says how late it came
and how many ticks went before it (``late``, ``dropped``); this says so in the log, once per
interval for the whole node, with the exec cap's part in it.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from cri_prober.manager.events import AttemptFinished, ManagerEvent
from cri_prober.probing.kinds import ProbeKind

log = structlog.get_logger(__name__)

# At most one line per this many seconds; drops in between are counted into the next line.
LOG_INTERVAL_SECONDS = 60.0
# Seconds of exec slot waits since the last line from which the line names the exec cap.
CAP_WAIT_WORTH_NAMING = 1.0


@dataclass(frozen=True, slots=True)
class ExecPressure:
    """What the runtime client says of its exec slots (CriClient's counters)."""

    cap: int  # --max-concurrent-execs
    waiting: int  # calls waiting for a slot now
    slot_wait_seconds: float  # all the time calls spent waiting for a slot (a counter)
    pace: float | None  # the median seconds from slot to answer of the last execs
    runtime_slow: bool


class DroppedTicks:
    """Follows the manager's attempts and logs ``probe_ticks_dropped`` at most once per
    ``interval``: how many ticks each probe type dropped since the last line, and whether the
    exec cap held execs back meanwhile (the cap protects the runtime: on a node past its exec
    ceiling, the kubelet's own probes must not time out because of ours)."""

    def __init__(
        self,
        *,
        execs: Callable[[], ExecPressure] | None = None,
        clock: Callable[[], float] = time.monotonic,
        interval: float = LOG_INTERVAL_SECONDS,
    ) -> None:
        self._execs = execs
        self._clock = clock
        self._interval = interval
        self._dropped: dict[ProbeKind, int] = {}
        self._since: float | None = None  # when the counts started (None: nothing counted)
        self._logged_at: float | None = None
        self._slot_wait_at_log = execs().slot_wait_seconds if execs is not None else 0.0

    def on_event(self, event: ManagerEvent) -> None:
        if not isinstance(event, AttemptFinished) or not event.record.dropped:
            return
        now = self._clock()
        self._dropped[event.kind] = self._dropped.get(event.kind, 0) + event.record.dropped
        if self._since is None:
            self._since = now
        if self._logged_at is None or now - self._logged_at >= self._interval:
            # In an empty context: the line is the node's, not the worker's whose attempt
            # happened to report the drop (its task binds container and probe to every line).
            contextvars.Context().run(self._log, now)

    def _log(self, now: float) -> None:
        assert self._since is not None
        fields: dict[str, object] = {
            "dropped": {kind.value: n for kind, n in self._dropped.items()},
            "seconds": round(now - self._since, 1),
        }
        why = "attempts ran past their period (slow targets, or a busy node or runtime)"
        if self._execs is not None:
            execs = self._execs()
            waited = execs.slot_wait_seconds - self._slot_wait_at_log
            self._slot_wait_at_log = execs.slot_wait_seconds
            fields.update(
                exec_slot_wait_seconds=round(waited, 1),
                execs_waiting=execs.waiting,
                exec_pace_seconds=None if execs.pace is None else round(execs.pace, 3),
                max_concurrent_execs=execs.cap,
            )
            # A container's own probes take turns at its one slot, which costs them
            # milliseconds: the cap is named only when execs waited for it for real.
            if waited >= CAP_WAIT_WORTH_NAMING:
                why = (
                    f"exec probes waited {waited:.1f} s for the runtime's exec slots"
                    f" (--max-concurrent-execs {execs.cap}, which protects the runtime"
                )
                if execs.runtime_slow and execs.pace is not None:
                    why += f"; it answers execs in {execs.pace:.2f} s on median, for everyone"
                why += ")"
        log.warning("probe_ticks_dropped", why=why, **fields)
        self._logged_at = now
        self._dropped = {}
        self._since = None


__all__ = ["LOG_INTERVAL_SECONDS", "DroppedTicks", "ExecPressure"]
