"""serve --mirror: the kubelet's own probe verdicts, read from its ``/metrics/probes`` counters
instead of running its probes again.

``parse_probe_metrics`` reads one exposition (bounded, and only the families used:
``prober_probe_total``, ``prober_probe_duration_seconds`` and ``process_start_time_seconds``);
``CounterTracker`` turns two successive reads into each probe's attempts between them
(``MirroredAttempts``), and detects a kubelet restart or a counter reset, after which it invents
no attempt; ``KubeletMetricsReader`` polls the kubelet (with the pod source's HTTP, TLS and
credentials) and hands each read's windows on.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

import httpx2
import structlog

from cri_prober.errors import ConfigError
from cri_prober.files import describe_size
from cri_prober.podspecs.kubelet import KubeletSource, _clip, _ReadFailed
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.mirror import MirroredAttempts

__all__ = [
    "DEFAULT_METRICS_URL",
    "MAX_METRICS_BYTES",
    "CounterTracker",
    "KubeletMetricsReader",
    "MetricsError",
    "ProbeCounters",
    "TrackerUpdate",
    "parse_probe_metrics",
]

log = structlog.get_logger(__name__)

DEFAULT_METRICS_URL: Final = "https://127.0.0.1:10250/metrics/probes"
READ_ONLY_METRICS_URL: Final = "http://127.0.0.1:10255/metrics/probes"
# A full node (110 pods, a few containers each, three kinds) answers some 100-500 KiB (the
# recorded node: 40 KiB for 12 containers); far more is not the kubelet's prober metrics.
MAX_METRICS_BYTES: Final = 16 * 1024 * 1024
# The most probe series one read may hold (three results per probe).
MAX_SERIES: Final = 100_000
# The kubelet's probe_type label values (pkg/kubelet/prober/prober.go probeType.String()).
_KINDS: Final = {
    "Liveness": ProbeKind.LIVENESS,
    "Readiness": ProbeKind.READINESS,
    "Startup": ProbeKind.STARTUP,
}
# The kubelet's result label values (pkg/kubelet/prober/prober_manager.go).
_RESULTS: Final = ("successful", "failed", "unknown")

# A probe as the counters key it: pod UID, container name, kind.
ProbeKey = tuple[str, str, ProbeKind]
# The histogram's key: namespace, pod name, container name, kind (it has no pod UID).
DurationKey = tuple[str, str, str, ProbeKind]


class MetricsError(ValueError):
    """An exposition cri-prober cannot use; the message says why, on one line."""


@dataclass(frozen=True, slots=True)
class ProbeCounters:
    """One read of ``/metrics/probes``: each probe's counts by result (successful, failed,
    unknown), its namespace and pod name, the duration histograms' (sum, count) and the
    kubelet's start time."""

    read_at: float  # wall-clock seconds
    process_start: float | None
    counts: Mapping[ProbeKey, tuple[int, int, int]]
    names: Mapping[ProbeKey, tuple[str, str]] = field(default_factory=dict)
    durations: Mapping[DurationKey, tuple[float, float]] = field(default_factory=dict)


def parse_probe_metrics(
    text: str, *, read_at: float, max_series: int = MAX_SERIES
) -> ProbeCounters:
    """The probe counters in one exposition of the kubelet's ``/metrics/probes``.

    Series of a probe type or result this version does not know are skipped (a newer
    kubelet's); everything else not used is ignored. Blocking (about 1 ms per 10 KiB): run it
    in a worker thread.

    Raises:
        MetricsError: not the Prometheus text format, a counter that is not a non-negative
            integer, or more than ``max_series`` probe series.
    """
    counts: dict[ProbeKey, list[int]] = {}
    names: dict[ProbeKey, tuple[str, str]] = {}
    durations: dict[DurationKey, list[float]] = {}
    process_start: float | None = None
    series = 0
    # Imported here: an idle serve (no --mirror) holds no prometheus_client (bench/idle_rss).
    from prometheus_client.parser import text_string_to_metric_families

    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name, labels, value = sample.name, sample.labels, sample.value
                if name == "prober_probe_total":
                    series += 1
                    if series > max_series:
                        raise MetricsError(f"more than {max_series} probe series")
                    kind = _KINDS.get(labels.get("probe_type", ""))
                    result = labels.get("result", "")
                    uid, container = labels.get("pod_uid", ""), labels.get("container", "")
                    if kind is None or result not in _RESULTS or not uid or not container:
                        continue
                    if not (math.isfinite(value) and value >= 0 and value == int(value)):
                        raise MetricsError(
                            f"prober_probe_total of {labels.get('namespace', '')}/"
                            f"{labels.get('pod', '')}/{container}: {value!r} is not a count"
                        )
                    key = (uid, container, kind)
                    counts.setdefault(key, [0, 0, 0])[_RESULTS.index(result)] = int(value)
                    names[key] = (labels.get("namespace", ""), labels.get("pod", ""))
                elif name in (
                    "prober_probe_duration_seconds_sum",
                    "prober_probe_duration_seconds_count",
                ):
                    kind = _KINDS.get(labels.get("probe_type", ""))
                    if kind is None or not math.isfinite(value):
                        continue
                    dkey = (
                        labels.get("namespace", ""),
                        labels.get("pod", ""),
                        labels.get("container", ""),
                        kind,
                    )
                    slot = 0 if name.endswith("_sum") else 1
                    durations.setdefault(dkey, [0.0, 0.0])[slot] = value
                elif name == "process_start_time_seconds" and math.isfinite(value):
                    process_start = value
    except MetricsError:
        raise
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        # The text parser raises these for a line it cannot read.
        raise MetricsError(f"not the Prometheus text format: {_clip(str(exc))}") from None
    return ProbeCounters(
        read_at=read_at,
        process_start=process_start,
        counts={key: (c[0], c[1], c[2]) for key, c in counts.items()},
        names=names,
        durations={key: (d[0], d[1]) for key, d in durations.items()},
    )


@dataclass(frozen=True, slots=True)
class TrackerUpdate:
    """What one read added: each probe's attempts since the read before, or, where the two
    reads cannot be compared (the first read, a kubelet restart, a counter reset), none and
    why (``baseline``)."""

    attempts: tuple[MirroredAttempts, ...]
    baseline: str = ""  # why this read only set the baseline; "" when it was compared
    gone: tuple[ProbeKey, ...] = ()  # probes whose series vanished (their pod's workers ended)


class CounterTracker:
    """Successive reads of the kubelet's probe counters, as each probe's attempts between them.

    A counter only grows while the kubelet runs; the kubelet deletes a probe's series when its
    worker ends (pkg/kubelet/prober/worker.go, ``run``'s clean-up, release-1.28) and starts
    from zero when it restarts. So: a series new since the last read counts whole (its attempts
    all came after that read: the series appears at its first attempt of that result); a
    series that vanished adds nothing; and a kubelet whose start time changed, or any counter
    that went down, makes the read a new baseline with no attempts at all, never a guess.
    """

    def __init__(self) -> None:
        self._last: ProbeCounters | None = None
        self.resets = 0  # reads that could not be compared with the one before (restarts)

    @property
    def last(self) -> ProbeCounters | None:
        return self._last

    def update(self, counters: ProbeCounters) -> TrackerUpdate:
        previous, self._last = self._last, counters
        if previous is None:
            return TrackerUpdate((), baseline="the first read")
        gone = tuple(key for key in previous.counts if key not in counters.counts)
        if (
            previous.process_start is not None
            and counters.process_start is not None
            and previous.process_start != counters.process_start
        ):
            self.resets += 1
            return TrackerUpdate((), baseline="the kubelet restarted", gone=gone)
        attempts: list[MirroredAttempts] = []
        for key, now in counters.counts.items():
            before = previous.counts.get(key, (0, 0, 0))
            delta = tuple(n - b for n, b in zip(now, before, strict=True))
            if any(d < 0 for d in delta):
                self.resets += 1
                return TrackerUpdate((), baseline="a counter went down (reset)", gone=gone)
            if not any(delta):
                continue
            uid, container, kind = key
            attempts.append(
                MirroredAttempts(
                    pod_uid=uid,
                    container=container,
                    kind=kind,
                    successes=delta[0],
                    failures=delta[1],
                    unknowns=delta[2],
                    since=previous.read_at,
                    until=counters.read_at,
                    duration=self._duration(previous, counters, key, delta[0] + delta[2]),
                )
            )
        return TrackerUpdate(tuple(attempts), gone=gone)

    @staticmethod
    def _duration(
        previous: ProbeCounters, counters: ProbeCounters, key: ProbeKey, timed: int
    ) -> float | None:
        """The mean duration of the window's timed attempts (successful and unknown), from the
        histogram, when it is this probe's alone and counted exactly those attempts."""
        names = counters.names.get(key)
        if names is None or timed <= 0:
            return None
        dkey = (names[0], names[1], key[1], key[2])
        # The histogram has no pod UID: two pods of one name (a replaced pod still going)
        # share it, and then it says nothing about either.
        if sum(1 for k, n in counters.names.items() if n == names and k[1:] == key[1:]) > 1:
            return None
        now, before = counters.durations.get(dkey), previous.durations.get(dkey, (0.0, 0.0))
        if now is None:
            return None
        spent, count = now[0] - before[0], now[1] - before[1]
        if count != timed or spent < 0:
            return None
        return spent / count


Attempted = Callable[[TrackerUpdate], None]


class KubeletMetricsReader(KubeletSource):
    """Polls the kubelet's ``/metrics/probes`` every ``interval`` seconds (at most once a
    second) and hands each read's ``TrackerUpdate`` to ``attempted``.

    It speaks to the kubelet exactly as the ``/pods`` source does (TLS, client certificate,
    bearer token, one deadline per read, a size cap, one clear line per failed read), but
    lists no pods: it is not a pod source of the registry.
    """

    def __init__(
        self,
        url: str = DEFAULT_METRICS_URL,
        *,
        name: str = "kubelet-mirror",
        interval: float = 1.0,
        max_body_bytes: int = MAX_METRICS_BYTES,
        max_series: int = MAX_SERIES,
        wall: Callable[[], float] = time.time,
        **kwargs: object,
    ) -> None:
        if interval < 1.0:
            raise ConfigError("--mirror: the kubelet's counters are read at most once a second")
        super().__init__(
            url,
            name=name,
            interval=interval,
            max_body_bytes=max_body_bytes,
            **kwargs,  # type: ignore[arg-type]
        )
        self.max_series = max_series
        self.tracker = CounterTracker()
        self._wall = wall
        self._attempted: Attempted | None = None
        self.last_update: TrackerUpdate | None = None

    def attach(self, attempted: Attempted) -> None:
        """Where each read's attempts go (the manager's ``on_mirrored``)."""
        self._attempted = attempted

    async def poll(self) -> bool:
        """Read the counters once and hand on what they add; returns False (no pods change)."""
        self._read_bytes = 0
        try:
            counters = await self._read_counters()
        except _ReadFailed as exc:
            self.failed(str(exc))
            return False
        except Exception as exc:  # a bug here must not stop the mirror: report it and go on
            self.own_logger.exception("mirror_read_bug")
            self.failed(f"unexpected error reading the kubelet's counters at {self.url}: {exc!r}")
            return False
        update = self.tracker.update(counters)
        self.last_update = update
        if update.baseline and self.tracker.resets:
            self.own_logger.warning(
                "kubelet_counters_reset",
                reason=update.baseline,
                detail="the attempts since the read before are not mirrored (none is "
                "invented); published results stay as they were",
            )
        self.succeeded()
        if self._attempted is not None:
            self._attempted(update)
        return False

    async def _read_counters(self) -> ProbeCounters:
        body = await self._request("text/plain")
        read_at = self._wall()
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise _ReadFailed(
                f"the kubelet at {self.url} answered text that is not UTF-8"
            ) from None
        try:
            return await asyncio.to_thread(
                parse_probe_metrics, text, read_at=read_at, max_series=self.max_series
            )
        except MetricsError as exc:
            raise _ReadFailed(
                f"the kubelet at {self.url} answered counters cri-prober cannot use: {exc}"
            ) from None

    def _status_message(self, response: httpx2.Response, head: str) -> str:
        if response.status_code == 403:
            said = f" (it said: {head})" if head else ""
            return (
                f"the kubelet at {self.url} forbade the request (403 Forbidden): the identity "
                f"needs `get` on `nodes/metrics`{said}"
            )
        return super()._status_message(response, head)

    def _too_large(self) -> str:
        return (
            f"the kubelet's counters at {self.url} are larger than "
            f"{describe_size(self.max_body_bytes)}: stopped reading"
        )
