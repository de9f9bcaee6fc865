"""The per-worker series: each probe worker's counts as plain numbers, their metric families, and
the collector that exports them.

These are the kubelet's ``prober_probe_total`` and ``prober_probe_duration_seconds`` (its names,
labels, values and buckets: docs/kubelet-semantics.md §6) and cri-prober's own transitions,
timeouts, consecutive failures and, on request, every attempt's duration; with them, one ready and
one started gauge per probed container. ``Metrics`` (``metrics.py``) feeds them;
``metrics_render.py`` writes them fast.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from cri_prober.discovery.model import ContainerInfo
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.results import ProbeRecord

PROBE_TYPES = {
    ProbeKind.LIVENESS: "Liveness",
    ProbeKind.READINESS: "Readiness",
    ProbeKind.STARTUP: "Startup",
}
# The kubelet's result label values; it counts an attempt that could not run ("error") nowhere.
KUBELET_RESULTS = {
    "success": "successful",
    "warning": "successful",  # the kubelet publishes a warning as a success
    "failure": "failed",
    "unknown": "failed",  # our worker, like the kubelet's, publishes an unknown verdict as failure
}
ATTEMPT_RESULTS = ("success", "warning", "failure", "unknown", "error")


def go_float(value: float) -> str:
    """How the encoders write a sample value (prometheus_client's floatToGoString, typed)."""
    text: str = floatToGoString(value)  # type: ignore[no-untyped-call]  # untyped there
    return text


# Prometheus' Go client's DefBuckets, which the kubelet's histograms use; prometheus_client's own
# defaults differ (they add .075, .75 and 7.5), so they are spelled out.
GO_DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LE_VALUES = (*(go_float(bound) for bound in GO_DEFAULT_BUCKETS), "+Inf")

# The per-worker series' labels: the kubelet's, in its order.
WORKER_LABELS = ("probe_type", "container", "pod", "namespace")
# The per-container gauges' labels: the worker series' (so they join on them) and the pod's UID,
# as prober_probe_total and kube-state-metrics carry it: a pod recreated under its name may
# briefly run beside the old one, and two series with the same labels would be invalid.
CONTAINER_LABELS = ("container", "pod", "namespace", "pod_uid")
# Attempt results that count as failures (the worker publishes an unknown verdict as failure).
FAILED_RESULTS = frozenset(("failure", "unknown"))


class HistogramSeries:
    """One histogram series: counts per bucket (not cumulative; the last is +Inf), and the sum.

    Only the buckets up to the highest one observed are kept (``counts`` gives them all): a
    steady probe's attempts fall into the first one or two, and a whole list per series was
    1.5 MiB at 5,000 containers (issue 36, tracemalloc)."""

    __slots__ = ("_counts", "total")

    def __init__(self) -> None:
        self._counts: list[int] = []
        self.total = 0.0

    @property
    def counts(self) -> list[int]:
        """The count of every bucket, ``LE_VALUES``' order (a new list)."""
        counts = self._counts
        return counts + [0] * (len(LE_VALUES) - len(counts))

    def observe(self, value: float) -> None:
        # As prometheus_client's: the first bucket whose bound is >= value.
        bucket = bisect_left(GO_DEFAULT_BUCKETS, value)
        counts = self._counts
        if bucket >= len(counts):
            counts.extend([0] * (bucket + 1 - len(counts)))
        counts[bucket] += 1
        self.total += value


class WorkerSeries:
    """The series of one probe worker, as numbers; a series exists once it has counted."""

    __slots__ = (
        "attempts",
        "durations",
        "escaped",
        "failing",
        "failing_of",
        "first_success_of",
        "held",
        "labels",
        "timeouts",
        "totals",
        "transitions",
    )

    def __init__(self, labels: tuple[str, str, str, str]) -> None:
        self.labels = labels  # WORKER_LABELS' values
        self.escaped = _escaped(labels)
        # cri_prober_probe_consecutive_failures: failed attempts in a row of the container
        # ``failing_of`` (its ID). Counted here from the attempts, not read from the worker,
        # whose run restarts at 0 when it goes on hold: a held probe keeps its count.
        self.failing = 0
        self.failing_of = ""
        # cri_prober_probe_on_hold: its published failure put it on hold until the container
        # restarts (the container's next published result, a restart's initial value, ends it).
        self.held = False
        # The container whose first published success was timed (time to first success).
        self.first_success_of = ""
        # prober_probe_total by pod UID (a pod recreated under its name has a new one), then
        # [successful, failed].
        self.totals: dict[str, list[int]] = {}
        self.durations: HistogramSeries | None = None  # prober_probe_duration_seconds
        self.timeouts = 0
        self.transitions: dict[str, int] = {}  # by published result
        # By attempt result, when enabled: until then the one shared empty map (read only).
        self.attempts: dict[str, HistogramSeries] = NO_ATTEMPTS

    def reset(self) -> None:
        self.durations = None
        self.timeouts = 0
        self.transitions = {}
        self.attempts = NO_ATTEMPTS


# Every worker's ``attempts`` without --metrics-attempt-durations: never written (a worker gets
# a map of its own at its first timed attempt), 64 bytes a worker saved.
NO_ATTEMPTS: dict[str, HistogramSeries] = {}


def _escaped(labels: tuple[str, ...]) -> tuple[str, ...]:
    """``labels`` escaped for the encoders; the same tuple when nothing needed escaping (nearly
    always: one tuple a series instead of two)."""
    escaped = tuple(escape_label_value(value) for value in labels)
    return labels if escaped == labels else escaped


@dataclass(frozen=True, slots=True, eq=False)  # hashed by identity (cheap): each exists once
class Shape:
    """One kind of sample line: its name and its labels, in the order values are given."""

    name: str
    labels: tuple[str, ...]


@dataclass(frozen=True, slots=True, eq=False)
class Family:
    """One per-worker metric family and its sample shapes (a histogram's bucket, count, sum)."""

    name: str
    documentation: str
    type: str
    shapes: tuple[Shape, ...]


def _histogram_family(name: str, documentation: str, labels: tuple[str, ...]) -> Family:
    return Family(
        name,
        documentation,
        "histogram",
        (
            Shape(f"{name}_bucket", (*labels, "le")),
            Shape(f"{name}_count", labels),
            Shape(f"{name}_sum", labels),
        ),
    )


TOTAL = Family(
    "prober_probe",
    # The kubelet's help text, word for word.
    "Cumulative number of a liveness, readiness or startup probe for a container by result.",
    "counter",
    (Shape("prober_probe_total", (*WORKER_LABELS, "pod_uid", "result")),),
)
DURATION = _histogram_family(
    "prober_probe_duration_seconds", "Duration in seconds for a probe response.", WORKER_LABELS
)
ATTEMPT_DURATION = _histogram_family(
    "cri_prober_probe_duration_seconds",
    "Duration in seconds of every probe attempt, by attempt result "
    "(success, warning, failure, unknown, or error: could not run).",
    (*WORKER_LABELS, "result"),
)
TRANSITIONS = Family(
    "cri_prober_probe_transitions",
    "Changes of a published probe result, by the new result.",
    "counter",
    (Shape("cri_prober_probe_transitions_total", (*WORKER_LABELS, "result")),),
)
TIMEOUTS = Family(
    "cri_prober_probe_timeouts",
    "Probe attempts that failed because their timeoutSeconds expired.",
    "counter",
    (Shape("cri_prober_probe_timeouts_total", WORKER_LABELS),),
)
CONSECUTIVE_FAILURES = Family(
    "cri_prober_probe_consecutive_failures",
    "Failed attempts in a row of the probe's current container (0 after a success or a "
    "restart); a probe on hold keeps the count that put it there.",
    "gauge",
    (Shape("cri_prober_probe_consecutive_failures", WORKER_LABELS),),
)
ON_HOLD = Family(
    "cri_prober_probe_on_hold",
    "1 while the probe is on hold until its container restarts (after a published liveness or "
    "startup failure, where something acts on it: serve --failure-hold); absent otherwise.",
    "gauge",
    (Shape("cri_prober_probe_on_hold", WORKER_LABELS),),
)
CONTAINER_READY = Family(
    "cri_prober_container_ready",
    "1 while the probed container is ready (as the kubelet derives it), 0 otherwise.",
    "gauge",
    (Shape("cri_prober_container_ready", CONTAINER_LABELS),),
)
CONTAINER_STARTED = Family(
    "cri_prober_container_started",
    "1 while the probed container runs and has passed its startup probe (if any), 0 otherwise.",
    "gauge",
    (Shape("cri_prober_container_started", CONTAINER_LABELS),),
)
CONTAINER_FAMILIES = (CONTAINER_READY, CONTAINER_STARTED)


class ContainerSeries:
    """One probed container's gauges, as of its newest published result."""

    __slots__ = ("escaped", "labels", "ready", "started")

    def __init__(self, labels: tuple[str, str, str, str]) -> None:
        self.labels = labels  # CONTAINER_LABELS' values
        self.escaped = _escaped(labels)
        self.ready = False
        self.started = False


# One sample as ``WorkerSeriesCollector.walk`` yields it for ``collect``: (shape, label values,
# value).
_Line = tuple[Shape, tuple[str, ...], float]


class WorkerSeriesCollector(Collector):
    """Every worker's series: updated on the event loop, read at scrape time in a thread.

    Readers copy what they iterate (``list(d.values())`` is one C call under the GIL), so the
    loop may add and drop workers while a scrape runs; a scrape may see an attempt counted in a
    bucket and not yet in the sum, as prometheus_client's own histograms may.
    """

    def __init__(self, *, attempt_durations: bool) -> None:
        self.attempt_durations = attempt_durations
        # By each series' labels (probe type, container, pod, namespace): the key is the
        # series' own tuple, not a second one.
        self._by_key: dict[tuple[str, str, str, str], WorkerSeries] = {}
        # By the manager's slot key (pod UID, or sandbox ID without one; container name).
        self._containers: dict[tuple[str, str], ContainerSeries] = {}
        # Called before a read (``Metrics.follow``): the manager tells the repeated attempts its
        # workers hold back, so the counts read include every attempt so far; in steps, for a
        # reader that gives the loop a turn between them (the metrics server).
        self.before_read: Callable[[], Iterator[None]] | None = None

    def catch_up(self) -> None:
        """Count the attempts told in runs so far (``before_read``)."""
        for _ in self.catch_up_in_steps():
            pass

    def catch_up_in_steps(self) -> Iterator[None]:
        """``catch_up`` in steps of a few hundred workers."""
        if self.before_read is not None:
            yield from self.before_read()

    def families(self) -> tuple[Family, ...]:
        optional = (ATTEMPT_DURATION,) if self.attempt_durations else ()
        return (
            TOTAL,
            DURATION,
            *optional,
            TRANSITIONS,
            TIMEOUTS,
            CONSECUTIVE_FAILURES,
            ON_HOLD,
            *CONTAINER_FAMILIES,
        )

    def worker(self, container: ContainerInfo, kind: ProbeKind) -> WorkerSeries:
        pod = container.pod
        key = (PROBE_TYPES[kind], container.name, pod.name, pod.namespace)
        worker = self._by_key.get(key)
        if worker is None:
            worker = WorkerSeries(key)
            self._by_key[key] = worker
        return worker

    def attempt(self, container: ContainerInfo, kind: ProbeKind, record: ProbeRecord) -> None:
        """Count one attempt: the kubelet's metrics skip attempts that could not run."""
        self.attempts(container, kind, record, (record.duration,))

    def attempts(
        self,
        container: ContainerInfo,
        kind: ProbeKind,
        record: ProbeRecord,
        durations: Sequence[float],
    ) -> None:
        """Count one attempt like ``record`` per duration (a steady probe's repeats come so)."""
        count = len(durations)
        worker = self.worker(container, kind)
        # serve --mirror: an attempt the kubelet's histogram could not time has no duration.
        timed = [d for d in durations if d] if record.source else durations
        if self.attempt_durations and timed:
            histogram = worker.attempts.get(record.result)
            if histogram is None:
                if worker.attempts is NO_ATTEMPTS:
                    worker.attempts = {}
                histogram = worker.attempts[record.result] = HistogramSeries()
            for duration in timed:
                histogram.observe(duration)
        if record.timed_out:
            worker.timeouts += count
        if record.result in FAILED_RESULTS:
            if worker.failing_of == record.container_id:
                worker.failing += count
            else:
                worker.failing_of, worker.failing = record.container_id, count
        elif record.result != "error":  # an attempt that could not run counts for nothing
            worker.failing_of, worker.failing = record.container_id, 0
        result = KUBELET_RESULTS.get(record.result)
        if result is None:
            return
        totals = worker.totals.get(container.pod.uid)
        if totals is None:
            totals = worker.totals[container.pod.uid] = [0, 0]
        if result == "successful":
            totals[0] += count
            # As the kubelet: only successful attempts are timed.
            if not timed:
                return
            if worker.durations is None:
                worker.durations = HistogramSeries()
            for duration in timed:
                worker.durations.observe(duration)
        else:
            totals[1] += count

    def new_container(self, container: ContainerInfo, kind: ProbeKind) -> WorkerSeries:
        """A published result of ``container``: a container the worker had not probed yet (a
        restart) starts with no failures."""
        worker = self.worker(container, kind)
        if worker.failing_of != container.id:
            worker.failing_of, worker.failing = container.id, 0
        return worker

    def container_health(self, container: ContainerInfo, *, ready: bool, started: bool) -> None:
        """The container's health after a published result."""
        pod = container.pod
        key = (pod.uid or pod.sandbox_id, container.name)
        series = self._containers.get(key)
        if series is None:
            series = ContainerSeries((container.name, pod.name, pod.namespace, pod.uid))
            self._containers[key] = series
        series.ready, series.started = ready, started

    def container_gone(self, container: ContainerInfo) -> None:
        """The manager dropped the container's slot: its gauges go."""
        pod = container.pod
        self._containers.pop((pod.uid or pod.sandbox_id, container.name), None)

    def forget(self, container: ContainerInfo, kind: ProbeKind) -> None:
        """Delete a stopped worker's series: prober_probe_total of its pod UID, and the rest
        (which name no UID: a pod recreated under the same name shares them)."""
        pod = container.pod
        key = (PROBE_TYPES[kind], container.name, pod.name, pod.namespace)
        worker = self._by_key.get(key)
        if worker is None:
            return
        worker.totals.pop(pod.uid, None)
        if worker.totals:
            worker.reset()
        else:
            del self._by_key[key]

    # -- reading --------------------------------------------------------------------------------

    def snapshot(self) -> list[WorkerSeries]:
        return list(self._by_key.values())

    def containers(self) -> list[ContainerSeries]:
        return list(self._containers.values())

    def walk(self, family: Family) -> Iterator[_Line]:
        """``family``'s samples: what ``collect`` exports (``Renderer.render`` writes the same)."""
        workers = self.snapshot()
        if family is TOTAL:
            (shape,) = family.shapes
            for worker in workers:
                for uid, (successful, failed) in list(worker.totals.items()):
                    if successful:
                        yield shape, (*worker.labels, uid, "successful"), successful
                    if failed:
                        yield shape, (*worker.labels, uid, "failed"), failed
        elif family is DURATION:
            for worker in workers:
                if (histogram := worker.durations) is not None:
                    yield from _histogram_lines(family, worker.labels, histogram)
        elif family is ATTEMPT_DURATION:
            for worker in workers:
                for result, histogram in list(worker.attempts.items()):
                    yield from _histogram_lines(family, (*worker.labels, result), histogram)
        elif family is TRANSITIONS:
            (shape,) = family.shapes
            for worker in workers:
                for result, count in list(worker.transitions.items()):
                    yield shape, (*worker.labels, result), count
        elif family is TIMEOUTS:
            (shape,) = family.shapes
            for worker in workers:
                if worker.timeouts:
                    yield shape, worker.labels, worker.timeouts
        elif family is CONSECUTIVE_FAILURES:
            (shape,) = family.shapes
            for worker in workers:
                yield shape, worker.labels, worker.failing
        elif family is ON_HOLD:
            (shape,) = family.shapes
            for worker in workers:
                if worker.held:  # only the held ones: a handful of series, not one per probe
                    yield shape, worker.labels, 1
        elif family is CONTAINER_READY:
            (shape,) = family.shapes
            for series in self.containers():
                yield shape, series.labels, int(series.ready)
        elif family is CONTAINER_STARTED:
            (shape,) = family.shapes
            for series in self.containers():
                yield shape, series.labels, int(series.started)

    def describe(self) -> Iterable[Metric]:
        return [
            Metric(family.name, family.documentation, family.type) for family in self.families()
        ]

    def collect(self) -> Iterator[Metric]:
        self.catch_up()
        for family in self.families():
            metric = Metric(family.name, family.documentation, family.type)
            metric.samples = [
                Sample(shape.name, dict(zip(shape.labels, values, strict=True)), float(value))
                for shape, values, value in self.walk(family)
            ]
            yield metric


def _histogram_lines(
    family: Family, labels: tuple[str, ...], histogram: HistogramSeries
) -> Iterator[_Line]:
    bucket, count, total = family.shapes
    cumulative = 0
    for le, observed in zip(LE_VALUES, histogram.counts[:], strict=True):
        cumulative += observed
        yield bucket, (*labels, le), cumulative
    yield count, labels, cumulative
    yield total, labels, histogram.total


def escape_label_value(value: str) -> str:
    """How both encoders escape a label value (prometheus_client's openmetrics ``_escape`` with
    ALLOWUTF8, which label values always use)."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


__all__ = [
    "ATTEMPT_DURATION",
    "ATTEMPT_RESULTS",
    "CONSECUTIVE_FAILURES",
    "CONTAINER_FAMILIES",
    "CONTAINER_LABELS",
    "CONTAINER_READY",
    "CONTAINER_STARTED",
    "DURATION",
    "GO_DEFAULT_BUCKETS",
    "KUBELET_RESULTS",
    "LE_VALUES",
    "ON_HOLD",
    "PROBE_TYPES",
    "TIMEOUTS",
    "TOTAL",
    "TRANSITIONS",
    "WORKER_LABELS",
    "ContainerSeries",
    "Family",
    "HistogramSeries",
    "Shape",
    "WorkerSeries",
    "WorkerSeriesCollector",
    "escape_label_value",
    "go_float",
]
