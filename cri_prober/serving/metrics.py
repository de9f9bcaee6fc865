"""Prometheus metrics, served at ``/metrics`` by a small asyncio HTTP server.

``prober_probe_total`` and ``prober_probe_duration_seconds`` are the kubelet's prober metrics with
its names, labels, values and buckets (docs/kubelet-semantics.md §6), so existing dashboards and
alerts work unchanged; the ``cri_prober_*`` metrics cover what the kubelet does not export
(transitions, timeouts, CRI calls, discovery freshness, and on request every attempt's duration).
A worker's series are deleted when it stops, as the kubelet's are.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import socket
import struct
import time
import zlib
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import prometheus_client
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from cri_prober import fdlimit
from cri_prober.discovery.model import ContainerInfo
from cri_prober.discovery.source import DiscoveryUpdate, NodeSource, Relisted
from cri_prober.errors import ConfigError
from cri_prober.manager.api import ProbeService
from cri_prober.manager.events import AttemptFinished, ManagerEvent, ResultChanged, WorkerStopped
from cri_prober.podspecs.registry import PodSpecs
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.results import ProbeRecord
from cri_prober.runtime.client import CriCall, CriClient

log = structlog.get_logger(__name__)

# The text exposition format generate_latest() writes, the answer to a request with no Accept.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# gzip level of compressed answers. On a 5,000-container exposition (24 MB) level 1 takes 0.05 s
# for 1.3 MB, 6 0.17 s for 1.1 MB, 9 (gzip.compress's default) 0.5 s for 1.0 MB: CPU is what a
# node is short of, bytes are not.
GZIP_LEVEL = 1
_GZIP_WBITS = 16 + zlib.MAX_WBITS  # zlib's way of asking for the gzip container


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What metrics clients may hold, each and together (see ``MetricsServer``).

    64 connections are far more than any number of Prometheus servers scraping one node, and
    with the reserve they stay clear of probes even at a 1,024 limit: 64 + serve's ~20 own
    descriptors leave 940 for probes, and the reserve keeps 256 free whatever else is open.
    """

    max_connections: int = 64
    request_timeout: float = 5.0  # from accept to the last byte of the answer
    max_head_bytes: int = 8192
    fd_reserve: int = 256
    log_interval: float = 10.0
    accept_retry: float = 1.0  # after a failed accept (EMFILE): what asyncio waits too


# Connections taken from the backlog per readiness callback, and the backlog itself (asyncio's).
ACCEPT_BATCH = 100
BACKLOG = 100
# Input read and thrown away after an answer, waiting for the client to close (see _serve).
MAX_DISCARD_BYTES = 65536
# SO_LINGER on, 0 s: close() resets the connection and frees it at once.
_LINGER_RESET = struct.pack("ii", 1, 0)

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


def _go_float(value: float) -> str:
    """How the encoders write a sample value (prometheus_client's floatToGoString, typed)."""
    text: str = floatToGoString(value)  # type: ignore[no-untyped-call]  # untyped there
    return text


# Prometheus' Go client's DefBuckets, which the kubelet's histograms use; prometheus_client's own
# defaults differ (they add .075, .75 and 7.5), so they are spelled out.
GO_DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LE = (*(_go_float(bound) for bound in GO_DEFAULT_BUCKETS), "+Inf")

# The per-worker series' labels: the kubelet's, in its order.
WORKER_LABELS = ("probe_type", "container", "pod", "namespace")


class Metrics:
    """Every metric cri-prober exports, fed by the manager's, discovery's and CRI's streams.

    The per-worker metrics (the kubelet's two, and transitions, timeouts and optionally every
    attempt's duration) are plain numbers per worker (``_Worker``), exported by ``_Workers``:
    about 1 µs per attempt, and 0.2 s per scrape of 10,000 workers, where labelled
    prometheus_client children took 15 µs and 3.5 s (bench/metrics_scrape.py). The rest, a few
    dozen series, are ordinary prometheus_client metrics on ``_base``.
    """

    def __init__(self, *, attempt_durations: bool = False) -> None:
        self.attempt_durations = attempt_durations
        self._base = CollectorRegistry(auto_describe=True)
        self._workers = _Workers(attempt_durations=attempt_durations)
        self._cri: CriClient | None = None  # set by follow()
        # Everything: the worker series first, then the rest; what tests and generate_latest()
        # read, and what ``exposition`` must equal byte for byte.
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self._workers)
        self.registry.register(self._base)
        self._renderers: dict[str, _Renderer | None] = {}
        self.cri_requests = Counter(
            "cri_prober_cri_requests_total",
            "CRI calls made to the runtime, by method and gRPC status code.",
            ["method", "code"],
            registry=self._base,
        )
        self.cri_duration = Histogram(
            "cri_prober_cri_request_duration_seconds",
            "Duration in seconds of CRI calls, by method and gRPC status code.",
            ["method", "code"],
            buckets=GO_DEFAULT_BUCKETS,
            registry=self._base,
        )
        self.relist_duration = Histogram(
            "cri_prober_relist_duration_seconds",
            "Duration in seconds of relisting pods and containers from the runtime.",
            buckets=GO_DEFAULT_BUCKETS,
            registry=self._base,
        )
        self.relist_staleness = Gauge(
            "cri_prober_relist_staleness_seconds",
            "Seconds since the last successful relist (+Inf before the first).",
            registry=self._base,
        )
        self.execs_in_flight = Gauge(
            "cri_prober_execs_in_flight",
            "ExecSync calls holding an exec slot right now.",
            registry=self._base,
        )
        self.execs_overdue = Gauge(
            "cri_prober_execs_overdue",
            "ExecSync calls past their probe's timeout, waiting for the runtime's answer without "
            "a slot (the exec's output is still open).",
            registry=self._base,
        )
        self.execs_waiting = Gauge(
            "cri_prober_execs_waiting",
            "ExecSync calls waiting for an exec slot right now (--max-concurrent-execs is "
            "delaying them).",
            registry=self._base,
        )
        self.execs_outstanding = Gauge(
            "cri_prober_execs_outstanding",
            "ExecSync calls the runtime is working on right now, holding a slot or not.",
            registry=self._base,
        )
        self._base.register(_ExecSlotCollector(self))
        self.containers_tracked = Gauge(
            "cri_prober_containers_tracked",
            "Containers with at least one probe configured.",
            registry=self._base,
        )

    def follow_pod_sources(self, pod_specs: PodSpecs) -> None:
        """Export the ``--probes-from`` sources' freshness, pods and reads."""
        self._base.register(_PodSourceCollector(pod_specs))

    def follow(
        self, *, manager: ProbeService, node: NodeSource, cri: CriClient
    ) -> Callable[[], None]:
        """Follow the manager, discovery and CRI calls; returns a function that stops it."""
        self.execs_in_flight.set_function(lambda: cri.execs_in_flight)
        self.execs_overdue.set_function(lambda: cri.execs_overdue)
        self.execs_waiting.set_function(lambda: cri.execs_waiting)
        self.execs_outstanding.set_function(lambda: cri.execs_outstanding)
        self._cri = cri
        self.containers_tracked.set_function(lambda: manager.tracked())

        def staleness() -> float:
            # Discovery stamps relists with its default clock, time.monotonic.
            last = node.last_relist_ok
            return float("inf") if last is None else time.monotonic() - last

        self.relist_staleness.set_function(staleness)
        stops = [
            manager.events.subscribe(self.manager_event),
            node.updates.subscribe(self.discovery_update),
            cri.calls.subscribe(self.cri_call),
        ]

        def stop() -> None:
            for unsubscribe in stops:
                unsubscribe()

        return stop

    # -- the streams ----------------------------------------------------------------------------

    def manager_event(self, event: ManagerEvent) -> None:
        """Count attempts and transitions; forget a stopped worker's series."""
        if isinstance(event, AttemptFinished):
            self._workers.attempt(event.container, event.kind, event.record)
        elif isinstance(event, ResultChanged):
            worker = self._workers.worker(event.container, event.kind)
            result = event.result.value
            worker.transitions[result] = worker.transitions.get(result, 0) + 1
        elif isinstance(event, WorkerStopped) and not event.replaced:
            # A replaced worker (a changed spec) ends after its replacement started; its series
            # are the replacement's now (the labels name no worker), so deleting would reset them.
            self._workers.forget(event.container, event.kind)

    def cri_call(self, call: CriCall) -> None:
        """Count one CRI call."""
        self.cri_requests.labels(call.method, call.code).inc()
        self.cri_duration.labels(call.method, call.code).observe(call.seconds)

    def discovery_update(self, update: DiscoveryUpdate) -> None:
        """Time relists; their failures show in the CRI call codes."""
        if isinstance(update, Relisted):
            self.relist_duration.observe(update.seconds)

    # -- the exposition -------------------------------------------------------------------------

    def exposition(self, accept: str | None = None) -> bytes:
        """Every metric in the format ``negotiate(accept)`` picks (the text format by default).

        Equal, byte for byte, to prometheus_client's encoder over ``registry``, only faster: the
        per-worker lines are written from line templates that the same encoder wrote (see
        ``_Renderer``), the rest by the encoder itself. Safe to call from another thread.
        """
        return b"".join(self.exposition_chunks(accept))

    def exposition_chunks(self, accept: str | None = None) -> list[bytes]:
        """``exposition(accept)`` in pieces of a few MB at most, to compress or join: in a
        thread, every C call on a large buffer holds the GIL all along (tens of ms at 50 MB)."""
        encoder, content_type = negotiate(accept)
        if content_type not in self._renderers:
            # Content types are few (a format, a version and an escaping); the bound only
            # guards against clients inventing versions.
            if len(self._renderers) >= 16:
                self._renderers.clear()
            self._renderers[content_type] = _Renderer.make(encoder, self._workers.families())
        renderer = self._renderers[content_type]
        if renderer is None:
            return [encoder(self.registry)]
        return [*renderer.render(self._workers), encoder(self._base)]


def negotiate(accept: str | None) -> tuple[Callable[[Collector], bytes], str]:
    """prometheus_client's choice of encoder and content type for an ``Accept`` header.

    OpenMetrics when the header asks for it, the text format otherwise, and the text format too
    for a header prometheus_client cannot parse (a version that is not a number) or one that
    would put control characters into the answer's Content-Type.
    """
    try:
        encoder, content_type = choose_encoder(accept or "")
    except (TypeError, ValueError):
        return choose_encoder("")
    if not (content_type.isascii() and content_type.isprintable()):
        return choose_encoder("")
    return encoder, content_type


# -- the per-worker series ------------------------------------------------------------------------


class _Histogram:
    """One histogram series: counts per bucket (not cumulative; the last is +Inf), and the sum."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * len(_LE)
        self.total = 0.0

    def observe(self, value: float) -> None:
        # As prometheus_client's: the first bucket whose bound is >= value.
        self.counts[bisect_left(GO_DEFAULT_BUCKETS, value)] += 1
        self.total += value


class _Worker:
    """The series of one probe worker, as numbers; a series exists once it has counted."""

    __slots__ = ("attempts", "durations", "escaped", "labels", "timeouts", "totals", "transitions")

    def __init__(self, labels: tuple[str, str, str, str]) -> None:
        self.labels = labels  # WORKER_LABELS' values
        self.escaped = tuple(_escape(value) for value in labels)
        # prober_probe_total by pod UID (a pod recreated under its name has a new one), then
        # [successful, failed].
        self.totals: dict[str, list[int]] = {}
        self.durations: _Histogram | None = None  # prober_probe_duration_seconds
        self.timeouts = 0
        self.transitions: dict[str, int] = {}  # by published result
        self.attempts: dict[str, _Histogram] = {}  # by attempt result, when enabled

    def reset(self) -> None:
        self.durations = None
        self.timeouts = 0
        self.transitions = {}
        self.attempts = {}


@dataclass(frozen=True, slots=True, eq=False)  # hashed by identity (cheap): each exists once
class _Shape:
    """One kind of sample line: its name and its labels, in the order values are given."""

    name: str
    labels: tuple[str, ...]


@dataclass(frozen=True, slots=True, eq=False)
class _Family:
    """One per-worker metric family and its sample shapes (a histogram's bucket, count, sum)."""

    name: str
    documentation: str
    type: str
    shapes: tuple[_Shape, ...]


def _histogram_family(name: str, documentation: str, labels: tuple[str, ...]) -> _Family:
    return _Family(
        name,
        documentation,
        "histogram",
        (
            _Shape(f"{name}_bucket", (*labels, "le")),
            _Shape(f"{name}_count", labels),
            _Shape(f"{name}_sum", labels),
        ),
    )


TOTAL = _Family(
    "prober_probe",
    # The kubelet's help text, word for word.
    "Cumulative number of a liveness, readiness or startup probe for a container by result.",
    "counter",
    (_Shape("prober_probe_total", (*WORKER_LABELS, "pod_uid", "result")),),
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
TRANSITIONS = _Family(
    "cri_prober_probe_transitions",
    "Changes of a published probe result, by the new result.",
    "counter",
    (_Shape("cri_prober_probe_transitions_total", (*WORKER_LABELS, "result")),),
)
TIMEOUTS = _Family(
    "cri_prober_probe_timeouts",
    "Probe attempts that failed because their timeoutSeconds expired.",
    "counter",
    (_Shape("cri_prober_probe_timeouts_total", WORKER_LABELS),),
)

# One sample as ``_Workers.walk`` yields it for ``collect``: (shape, label values, value).
_Line = tuple[_Shape, tuple[str, ...], float]


class _Workers(Collector):
    """Every worker's series: updated on the event loop, read at scrape time in a thread.

    Readers copy what they iterate (``list(d.values())`` is one C call under the GIL), so the
    loop may add and drop workers while a scrape runs; a scrape may see an attempt counted in a
    bucket and not yet in the sum, as prometheus_client's own histograms may.
    """

    def __init__(self, *, attempt_durations: bool) -> None:
        self.attempt_durations = attempt_durations
        self._by_key: dict[tuple[ProbeKind, str, str, str], _Worker] = {}

    def families(self) -> tuple[_Family, ...]:
        optional = (ATTEMPT_DURATION,) if self.attempt_durations else ()
        return (TOTAL, DURATION, *optional, TRANSITIONS, TIMEOUTS)

    def worker(self, container: ContainerInfo, kind: ProbeKind) -> _Worker:
        pod = container.pod
        key = (kind, container.name, pod.name, pod.namespace)
        worker = self._by_key.get(key)
        if worker is None:
            worker = _Worker((PROBE_TYPES[kind], container.name, pod.name, pod.namespace))
            self._by_key[key] = worker
        return worker

    def attempt(self, container: ContainerInfo, kind: ProbeKind, record: ProbeRecord) -> None:
        """Count one attempt: the kubelet's metrics skip attempts that could not run."""
        worker = self.worker(container, kind)
        if self.attempt_durations:
            histogram = worker.attempts.get(record.result)
            if histogram is None:
                histogram = worker.attempts[record.result] = _Histogram()
            histogram.observe(record.duration)
        if record.timed_out:
            worker.timeouts += 1
        result = KUBELET_RESULTS.get(record.result)
        if result is None:
            return
        totals = worker.totals.get(container.pod.uid)
        if totals is None:
            totals = worker.totals[container.pod.uid] = [0, 0]
        if result == "successful":
            totals[0] += 1
            # As the kubelet: only successful attempts are timed.
            if worker.durations is None:
                worker.durations = _Histogram()
            worker.durations.observe(record.duration)
        else:
            totals[1] += 1

    def forget(self, container: ContainerInfo, kind: ProbeKind) -> None:
        """Delete a stopped worker's series: prober_probe_total of its pod UID, and the rest
        (which name no UID: a pod recreated under the same name shares them)."""
        pod = container.pod
        key = (kind, container.name, pod.name, pod.namespace)
        worker = self._by_key.get(key)
        if worker is None:
            return
        worker.totals.pop(pod.uid, None)
        if worker.totals:
            worker.reset()
        else:
            del self._by_key[key]

    # -- reading --------------------------------------------------------------------------------

    def snapshot(self) -> list[_Worker]:
        return list(self._by_key.values())

    def walk(self, family: _Family) -> Iterator[_Line]:
        """``family``'s samples: what ``collect`` exports (``_Renderer.render`` writes the same)."""
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

    def describe(self) -> Iterable[Metric]:
        return [
            Metric(family.name, family.documentation, family.type) for family in self.families()
        ]

    def collect(self) -> Iterator[Metric]:
        for family in self.families():
            metric = Metric(family.name, family.documentation, family.type)
            metric.samples = [
                Sample(shape.name, dict(zip(shape.labels, values, strict=True)), float(value))
                for shape, values, value in self.walk(family)
            ]
            yield metric


def _histogram_lines(
    family: _Family, labels: tuple[str, ...], histogram: _Histogram
) -> Iterator[_Line]:
    bucket, count, total = family.shapes
    cumulative = 0
    for le, observed in zip(_LE, histogram.counts[:], strict=True):
        cumulative += observed
        yield bucket, (*labels, le), cumulative
    yield count, labels, cumulative
    yield total, labels, histogram.total


def _escape(value: str) -> str:
    # How both encoders escape a label value (prometheus_client's openmetrics _escape with
    # ALLOWUTF8, which label values always use).
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: float) -> str:
    # floatToGoString's answer, without its work for the common case: below 10^6 an integer n
    # is written "n.0" (from there on, Go and so floatToGoString switch to exponents).
    if type(value) is int and 0 <= value < 1_000_000:
        return f"{value}.0"
    return _go_float(value)


class _Families:
    """A fixed list of families, in the shape an encoder reads (``collect()``)."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> list[Metric]:
        return self._metrics


@dataclass(frozen=True, slots=True)
class _Template:
    """How an encoder writes one sample shape, as format strings over escaped label values.

    ``line`` takes every label value, then the value, and ends the line. ``head`` and ``tail``
    take the values but the last; between them goes the last label's value (a histogram's
    ``le``, a counter's ``result``), after ``tail`` the value: a worker formats those two once
    and writes each of its lines with one concatenation.
    """

    line: str
    head: str
    tail: str


class _Renderer:
    """The per-worker families in one exposition format, written as that format's encoder would.

    Each family's header and each sample shape's line are made once by the encoder itself, with
    placeholder label values (``_template``), then filled in for every sample. tests/unit/
    test_metrics.py checks ``Metrics.exposition`` against the encoder byte for byte, for every
    format and escaping.
    """

    def __init__(
        self, families: tuple[_Family, ...], headers: list[str], templates: list[_Template]
    ):
        self._families = families
        self._headers = headers
        shapes = [shape for family in families for shape in family.shapes]
        self._templates = dict(zip(shapes, templates, strict=True))

    @classmethod
    def make(
        cls, encoder: Callable[[Collector], bytes], families: tuple[_Family, ...]
    ) -> _Renderer | None:
        """A renderer for ``encoder``'s format, or None when its output is not made of the
        pieces expected (then the encoder writes everything)."""
        headers = []
        templates = []
        for family in families:
            metric = Metric(family.name, family.documentation, family.type)
            header = encoder(_Families([metric])).decode()
            # OpenMetrics ends every exposition with "# EOF"; the rest of it follows this part.
            header = header.removesuffix("# EOF\n")
            if header.count("\n") != 2 or not header.startswith("# HELP "):
                return None
            headers.append(header)
            for shape in family.shapes:
                template = _template(encoder, family, shape)
                if template is None:
                    return None
                templates.append(template)
        return cls(families, headers, templates)

    def render(self, workers: _Workers) -> list[bytes]:
        snapshot = workers.snapshot()
        chunks: list[bytes] = []
        for family, header in zip(self._families, self._headers, strict=True):
            chunks.append(header.encode())
            # In batches: joining and encoding are single C calls that hold the GIL, which the
            # event loop waits for; a batch's take a millisecond or two.
            for start in range(0, len(snapshot), _RENDER_BATCH):
                out: list[str] = []
                self._family(out, family, snapshot[start : start + _RENDER_BATCH])
                chunks.append("".join(out).encode())
        return chunks

    def _family(self, out: list[str], family: _Family, workers: list[_Worker]) -> None:
        if family is TOTAL:
            self._totals(out, workers)
        elif family is DURATION:
            for worker in workers:
                if (histogram := worker.durations) is not None:
                    self._histogram(out, family, worker.escaped, histogram)
        elif family is ATTEMPT_DURATION:
            for worker in workers:
                for result, histogram in list(worker.attempts.items()):
                    labels = (*worker.escaped, _escape(result))
                    self._histogram(out, family, labels, histogram)
        elif family is TRANSITIONS:
            line = self._templates[family.shapes[0]].line
            for worker in workers:
                for result, count in list(worker.transitions.items()):
                    out.append(line.format(*worker.escaped, result, _number(count)))
        elif family is TIMEOUTS:
            line = self._templates[family.shapes[0]].line
            for worker in workers:
                if worker.timeouts:
                    out.append(line.format(*worker.escaped, _number(worker.timeouts)))

    def _totals(self, out: list[str], snapshot: list[_Worker]) -> None:
        template = self._templates[TOTAL.shapes[0]]
        for worker in snapshot:
            for uid, (successful, failed) in list(worker.totals.items()):
                labels = (*worker.escaped, _escape(uid))
                head, tail = template.head.format(*labels), template.tail.format(*labels)
                if successful:
                    out.append(f"{head}successful{tail}{_number(successful)}\n")
                if failed:
                    out.append(f"{head}failed{tail}{_number(failed)}\n")

    def _histogram(
        self, out: list[str], family: _Family, labels: tuple[str, ...], histogram: _Histogram
    ) -> None:
        bucket, count, total = (self._templates[shape] for shape in family.shapes)
        head, tail = bucket.head.format(*labels), bucket.tail.format(*labels)
        cumulative = 0
        for le, observed in zip(_LE, histogram.counts[:], strict=True):
            cumulative += observed
            # _number inlined: this is most of an exposition's lines.
            text = f"{cumulative}.0" if cumulative < 1_000_000 else _go_float(cumulative)
            out.append(f"{head}{le}{tail}{text}\n")
        out.append(count.line.format(*labels, _number(cumulative)))
        out.append(total.line.format(*labels, _go_float(histogram.total)))


# Workers rendered per joined and encoded chunk (up to about 2 MB of text).
_RENDER_BATCH = 1000
_MARK = re.compile("\ue000([0-9]+)\ue001")


def _template(
    encoder: Callable[[Collector], bytes], family: _Family, shape: _Shape
) -> _Template | None:
    """How ``encoder`` writes a ``shape`` sample; None when its line is not made of the pieces
    expected: the labels in some order, each value once, then the value."""
    last = len(shape.labels) - 1
    marks = [f"\ue000{index}\ue001" for index in range(len(shape.labels))]
    metric = Metric(family.name, family.documentation, family.type)
    metric.samples.append(Sample(shape.name, dict(zip(shape.labels, marks, strict=True)), 0.0))
    text = encoder(_Families([metric])).decode()
    found = [line for line in text.split("\n") if "\ue000" in line]
    if len(found) != 1 or not found[0].endswith(" 0.0"):
        return None
    prefix = found[0].removesuffix("0.0")
    if sorted(int(index) for index in _MARK.findall(prefix)) != list(range(len(marks))):
        return None
    # Literal braces doubled, placeholders made format fields.
    braced = _MARK.sub(r"{\1}", prefix.replace("{", "{{").replace("}", "}}"))
    head, _, tail = braced.partition(f"{{{last}}}")
    return _Template(line=f"{braced}{{{last + 1}}}\n", head=head, tail=tail)


# -- the HTTP endpoint ----------------------------------------------------------------------------


def parse_address(address: str) -> tuple[str | None, int]:
    """Parse ``HOST:PORT`` (``[v6]:PORT``; an empty host means every interface)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"--metrics-address {address!r}: expected HOST:PORT")
    host = host.removeprefix("[").removesuffix("]")
    return host or None, int(port)


class MetricsServer:
    """A minimal HTTP/1.1 server for ``GET /metrics``: one request per connection, bounded.

    The port is often reachable by anyone who reaches the node (the DaemonSet binds it on the
    host network), and every connection costs a file descriptor, the resource tcp, http and gRPC
    probes need too. So what a client can hold is bounded: at most ``max_connections`` at a
    time (more are closed as soon as they are accepted), ``request_timeout`` from accept to the
    last byte of the answer (so a half-sent request, or an answer never read, cannot hold one
    longer), a request head of at most ``max_head_bytes``, no keep-alive (one request per
    connection), and no connection at all while the process is within ``fd_reserve``
    descriptors of its limit. Connections turned away are counted and logged as one summary
    line per ``log_interval``, never a line (or a traceback) each.

    The accept loop is our own rather than ``asyncio.start_server``'s: asyncio accepts without
    any cap and logs a traceback for every failed accept (EMFILE), once a second per socket.
    """

    def __init__(self, metrics: Metrics, limits: ServerLimits | None = None) -> None:
        self.metrics = metrics
        self.limits = limits or ServerLimits()
        self.port = 0
        # What stops the metrics following the daemon's streams; called by ``stop()``.
        self.unfollow: Callable[[], None] | None = None
        self._sockets: list[socket.socket] = []
        self._paused: dict[int, asyncio.TimerHandle] = {}  # fd -> resume timer after EMFILE
        self._connections: set[asyncio.Task[None]] = set()
        self._refusals = _RefusalLog(self.limits)
        # Expositions: the one being made, how many were started, the variants the next one must
        # make, and the latest made (its number, and its body by variant).
        self._generation: asyncio.Task[None] | None = None
        self._generations_started = 0
        self._wanted: set[_Variant] = set()
        self._latest: tuple[int, dict[_Variant, bytes]] = (0, {})
        self._last_generation = (0.0, 0.0)  # (when it ended, how long it took), loop time

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return len(self._connections)

    async def start(self, address: str) -> None:
        """Bind ``address`` and serve; raises ``ConfigError`` when it cannot be bound."""
        host, port = parse_address(address)
        try:
            self._sockets = await _bind(host, port)
        except OSError as exc:
            raise ConfigError(f"--metrics-address {address}: cannot bind: {exc.strerror}") from exc
        self.port = self._sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        for sock in self._sockets:
            loop.add_reader(sock.fileno(), self._accept, sock)
        log.info(
            "metrics_listening",
            address=address,
            port=self.port,
            max_connections=self.limits.max_connections,
            fd_reserve=self.limits.fd_reserve,
        )

    async def stop(self) -> None:
        """Stop following and accepting, and end the connections being served (a scrape has
        nothing to lose). Calling it twice is harmless."""
        if self.unfollow is not None:
            self.unfollow()
            self.unfollow = None
        loop = asyncio.get_running_loop()
        for timer in self._paused.values():
            timer.cancel()
        self._paused.clear()
        for sock in self._sockets:
            loop.remove_reader(sock.fileno())
            sock.close()
        self._sockets = []
        for task in self._connections:
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._generation is not None:
            # Its thread cannot be interrupted; let it end rather than leave it to the loop's
            # shutdown (bounded by one exposition's time).
            await asyncio.wait([self._generation])
        self._refusals.flush()

    # -- accepting ------------------------------------------------------------------------------

    def _accept(self, sock: socket.socket) -> None:
        # Called when the listening socket is readable; takes what the backlog holds, up to a
        # batch, so one callback cannot hold the loop for long under a flood.
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _peer = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the client gave up while in the backlog
            except OSError as exc:
                # EMFILE, ENFILE, ENOBUFS, ENOMEM: nothing to accept with. The socket stays
                # readable, so stop watching it for a while instead of spinning; the kernel's
                # backlog holds (or drops) what arrives meanwhile.
                self._refusals.count("accept_failed", error=exc.strerror)
                self._pause(sock)
                return
            reason = self._refusal(conn)
            if reason is not None:
                conn.close()
                self._refusals.count(reason)
                continue
            conn.setblocking(False)
            task = asyncio.get_running_loop().create_task(self._serve(conn), name="metrics:conn")
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    def _refusal(self, conn: socket.socket) -> str | None:
        """Why ``conn`` (just accepted) must be closed at once, or None to serve it."""
        if len(self._connections) >= self.limits.max_connections:
            return "busy"
        limit = fdlimit.soft_limit()
        if limit is None:
            return None
        # Without /proc, the new descriptor's number is a lower bound: the kernel hands out the
        # lowest free one, so every number below it is taken.
        in_use = fdlimit.open_fds()
        if in_use is None:
            in_use = conn.fileno() + 1
        if limit - in_use < self.limits.fd_reserve:
            return "fd_reserve"
        return None

    def _pause(self, sock: socket.socket) -> None:
        fd = sock.fileno()
        if fd in self._paused:
            return
        loop = asyncio.get_running_loop()
        loop.remove_reader(fd)

        def resume() -> None:
            del self._paused[fd]
            loop.add_reader(fd, self._accept, sock)

        self._paused[fd] = loop.call_later(self.limits.accept_retry, resume)

    # -- one connection -------------------------------------------------------------------------

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        abort = answered = False
        try:
            async with asyncio.timeout(self.limits.request_timeout):
                try:
                    head = await self._read_head(conn)
                except _HeadTooLarge:
                    self._refusals.count("too_large")
                    response = _response(
                        431, "Request Header Fields Too Large", b"request head too large\n"
                    )
                else:
                    if head is None:
                        return  # the client closed before sending a whole request head
                    response = await self._respond(head)
                await loop.sock_sendall(conn, response)
                answered = True
                # Closing with unread input (a body, the rest of a head too large) would reset
                # the connection, and a reset can destroy the answer before the client reads
                # it: end our side, then read until the client closes, within the same limit.
                conn.shutdown(socket.SHUT_WR)
                await self._discard_until_eof(conn)
        except TimeoutError:
            # A half-sent request, an answer the client does not read, or a client that does
            # not close: reset rather than leave the kernel holding the unsent rest.
            if not answered:
                self._refusals.count("timed_out")
            abort = True
        except OSError:
            pass  # the client went away
        except Exception as exc:
            # A bug making the answer: counted in the summary line like the rest, rather than
            # a traceback per request, which a flood of requests would make a flood of lines.
            self._refusals.count("failed", error=f"{type(exc).__name__}: {exc}")
        finally:
            if abort:
                with contextlib.suppress(OSError):
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            conn.close()

    async def _read_head(self, conn: socket.socket) -> bytes | None:
        """The request head up to its blank line; None at EOF; ``_HeadTooLarge`` past the limit."""
        loop = asyncio.get_running_loop()
        limit = self.limits.max_head_bytes
        head = bytearray()
        while True:
            chunk = await loop.sock_recv(conn, 4096)
            if not chunk:
                return None
            head += chunk
            end = head.find(b"\r\n\r\n")
            if end >= 0 and end + 4 <= limit:
                return bytes(head[: end + 4])
            if len(head) >= limit:
                raise _HeadTooLarge

    async def _discard_until_eof(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        discarded = 0
        while discarded < MAX_DISCARD_BYTES and (chunk := await loop.sock_recv(conn, 4096)):
            discarded += len(chunk)

    async def _respond(self, head: bytes) -> bytes:
        lines = head.split(b"\r\n")
        parts = lines[0].decode("latin-1").split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _response(400, "Bad Request", b"bad request\n")
        method, target, _version = parts
        if target.split("?", 1)[0] != "/metrics":
            return _response(404, "Not Found", b"not found: metrics are at /metrics\n")
        if method not in ("GET", "HEAD"):
            return _response(405, "Method Not Allowed", b"use GET\n", ("Allow", "GET, HEAD"))
        fields = _header_fields(lines[1:], ("accept", "accept-encoding"))
        # As prometheus_client's own servers: its content negotiation, and gzip when accepted.
        _encoder, content_type = negotiate(fields.get("accept"))
        gzipped = gzip_accepted(fields.get("accept-encoding", ""))
        body = await self._exposition((content_type, gzipped))
        # The answer depends on both headers (caches must not mix them up), so Vary names both,
        # whether or not this one is compressed.
        extra = [("Vary", "Accept, Accept-Encoding")]
        if gzipped:
            extra.append(("Content-Encoding", "gzip"))
        return _response(
            200, "OK", body, *extra, content_type=content_type, head_only=method == "HEAD"
        )

    # -- the exposition -------------------------------------------------------------------------

    async def _exposition(self, variant: _Variant) -> bytes:
        """The metrics in ``variant``, made after this call began; concurrent requests share.

        Making an exposition is mostly pure Python (0.2 s for 5,000 containers' 10,000 workers,
        bench/metrics_scrape.py), and compressing it takes a little more. On the loop, 64
        concurrent scrapes would each stop every probe for that long, one after the other; so
        they are made in a thread (the per-worker state is read from copies, prometheus_client
        is thread-safe, and the gauges' callbacks only read numbers), one generation at a time,
        each making every variant (format, gzip) its requests asked for: a request that arrives
        while one is being made waits for the next, which then answers every request that
        waited. An answer is never older than its request, and however many requests arrive,
        at most one generation is being made.
        """
        wanted = self._generations_started + 1  # the first one that starts after now
        while True:
            number, bodies = self._latest
            if number >= wanted and variant in bodies:
                return bodies[variant]
            self._wanted.add(variant)
            if self._generation is None:
                self._generations_started += 1
                variants, self._wanted = self._wanted, set()
                self._generation = asyncio.get_running_loop().create_task(
                    self._generate(self._generations_started, variants),
                    name="metrics:exposition",
                )
            # Shielded: a request that times out must not cancel the one others wait for.
            await asyncio.shield(self._generation)

    async def _generate(self, number: int, variants: set[_Variant]) -> None:
        loop = asyncio.get_running_loop()
        try:
            # Back to back (a flood of scrapes), expositions would keep a core busy: leave at
            # least as long as the last one took between two, so they use at most half of one.
            ended, took = self._last_generation
            if (delay := ended + took - loop.time()) > 0:
                await asyncio.sleep(delay)
            started = loop.time()
            bodies = await asyncio.to_thread(self._make, variants)
            self._last_generation = (loop.time(), loop.time() - started)
            # Only the latest generation's bodies are kept: a body is large (a 5,000-container
            # text exposition is 24 MB), and a request whose variant it lacks asks for the next.
            self._latest = (number, bodies)
        finally:
            self._generation = None

    def _make(self, variants: set[_Variant]) -> dict[_Variant, bytes]:
        """Every variant asked for, each format made once. A gzipped one is compressed piece by
        piece (zlib lets go of the GIL while it works), never joined uncompressed."""
        bodies: dict[_Variant, bytes] = {}
        for content_type in {content_type for content_type, _gzipped in variants}:
            chunks = self.metrics.exposition_chunks(content_type)
            if (content_type, False) in variants:
                bodies[content_type, False] = b"".join(chunks)
            if (content_type, True) in variants:
                compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, _GZIP_WBITS)
                compressed = [compressor.compress(chunk) for chunk in chunks]
                bodies[content_type, True] = b"".join([*compressed, compressor.flush()])
        return bodies


# An exposition variant: its content type (the format negotiated) and whether it is gzipped.
_Variant = tuple[str, bool]


def _header_fields(lines: list[bytes], names: tuple[str, ...]) -> dict[str, str]:
    """The request header fields named (lower case), repeated ones joined with commas."""
    fields: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.decode("latin-1").partition(":")
        name = name.strip().lower()
        if sep and name in names:
            value = value.strip()
            fields[name] = f"{fields[name]}, {value}" if name in fields else value
    return fields


class _HeadTooLarge(Exception):
    """A request head longer than ``ServerLimits.max_head_bytes``."""


class _RefusalLog:
    """Counts connections the limits turned away; logs them as one line per interval.

    The first one arms a timer; when it fires, the interval's counts are logged as a single
    warning and reset, so a flood of any size costs one line per ``log_interval``.
    """

    REASONS = ("busy", "fd_reserve", "accept_failed", "timed_out", "too_large", "failed")

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.counts = dict.fromkeys(self.REASONS, 0)
        self.error: str | None = None
        self._timer: asyncio.TimerHandle | None = None

    def count(self, reason: str, *, error: str | None = None) -> None:
        self.counts[reason] += 1
        if error is not None:
            self.error = error
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.limits.log_interval, self.flush)

    def flush(self) -> None:
        """Log what was counted since the last line, if anything."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        total = sum(self.counts.values())
        if total == 0:
            return
        log.warning(
            "metrics_connections_refused",
            count=total,
            seconds=self.limits.log_interval,
            **self.counts,
            error=self.error,
            max_connections=self.limits.max_connections,
        )
        self.counts = dict.fromkeys(self.REASONS, 0)
        self.error = None


async def _bind(host: str | None, port: int) -> list[socket.socket]:
    """Listening sockets for ``host`` (None: every interface, IPv4 and IPv6), as asyncio's
    ``create_server`` makes them: SO_REUSEADDR, IPv6 sockets IPv6-only, non-blocking."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _name, sockaddr in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:
                continue  # a family this kernel lacks (IPv6 disabled): asyncio skips it too
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(sockaddr)
            sock.listen(BACKLOG)
            sock.setblocking(False)
        if not sockets:
            raise OSError(errno.EAFNOSUPPORT, os.strerror(errno.EAFNOSUPPORT))
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _response(
    status: int,
    reason: str,
    body: bytes,
    *extra: tuple[str, str],
    content_type: str = "text/plain; charset=utf-8",
    head_only: bool = False,
) -> bytes:
    headers = [
        f"HTTP/1.1 {status} {reason}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in extra),
    ]
    return ("\r\n".join(headers) + "\r\n\r\n").encode("latin-1") + (b"" if head_only else body)


class _ExecSlotCollector(Collector):
    """The exec slots' counters, read from the CRI client at scrape time (none before it is
    followed)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        cri = self._metrics._cri
        if cri is None:
            return
        waited = CounterMetricFamily(
            "cri_prober_exec_slot_wait_seconds",
            "Seconds ExecSync calls spent waiting for an exec slot, in all.",
        )
        waited.add_metric([], cri.exec_slot_wait_seconds)
        preempted = CounterMetricFamily(
            "cri_prober_exec_slot_preemptions",
            "Exec slots taken from execs past their start hold for a waiting call (the exec "
            "runs on without one).",
        )
        preempted.add_metric([], float(cri.exec_slot_preemptions))
        overruns = CounterMetricFamily(
            "cri_prober_exec_overruns",
            "Execs still running at the end of their start hold; their container is served "
            "after the others until one of its execs finishes within it.",
        )
        overruns.add_metric([], float(cri.exec_overruns))
        yield from (waited, preempted, overruns)


class _PodSourceCollector(Collector):
    """The pod spec sources' state, read at scrape time (it is a handful of numbers each)."""

    def __init__(self, pod_specs: PodSpecs) -> None:
        self._pod_specs = pod_specs

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "cri_prober_pod_source_up",
            "1 while a --probes-from source's view is fresh, 0 while it is stale (its last good "
            "view is still used).",
            labels=["source"],
        )
        pods = GaugeMetricFamily(
            "cri_prober_pod_source_pods",
            "Pods in a --probes-from source's last good view.",
            labels=["source"],
        )
        invalid = GaugeMetricFamily(
            "cri_prober_pod_source_invalid_pods",
            "Pods a --probes-from source lists whose spec cri-prober cannot use (logged).",
            labels=["source"],
        )
        reads = CounterMetricFamily(
            "cri_prober_pod_source_reads",
            "Reads of a --probes-from source by result: polls, lists, and watch streams, "
            "events and bookmarks.",
            labels=["source", "result"],
        )
        for source in self._pod_specs.sources:
            up.add_metric([source.name], 0.0 if source.stale() else 1.0)
            pods.add_metric([source.name], float(len(source.pods)))
            invalid.add_metric([source.name], float(source.invalid_pods))
            reads.add_metric([source.name, "ok"], float(source.reads - source.read_errors))
            reads.add_metric([source.name, "error"], float(source.read_errors))
        yield from (up, pods, invalid, reads)


async def start_metrics(
    address: str,
    *,
    manager: ProbeService,
    node: NodeSource,
    cri: CriClient,
    pod_specs: PodSpecs | None = None,
    attempt_durations: bool = False,
) -> MetricsServer:
    """Export metrics at ``http://address/metrics`` until the returned server's ``stop()``;
    ``attempt_durations`` adds ``cri_prober_probe_duration_seconds`` (every attempt's duration).

    Raises:
        ConfigError: ``address`` is malformed or cannot be bound.
    """
    # The kubelet exports no *_created series; neither do we (a process-wide switch).
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped there
    metrics = Metrics(attempt_durations=attempt_durations)
    server = MetricsServer(metrics)
    await server.start(address)
    server.unfollow = metrics.follow(manager=manager, node=node, cri=cri)
    if pod_specs is not None:
        metrics.follow_pod_sources(pod_specs)
    return server


__all__ = [
    "KUBELET_RESULTS",
    "Metrics",
    "MetricsServer",
    "ServerLimits",
    "negotiate",
    "parse_address",
    "start_metrics",
]
