"""Prometheus metrics: every metric cri-prober exports, and the streams that feed them.

``prober_probe_total`` and ``prober_probe_duration_seconds`` are the kubelet's prober metrics with
its names, labels, values and buckets (docs/kubelet-semantics.md §6), so existing dashboards and
alerts work unchanged; the ``cri_prober_*`` metrics cover what the kubelet does not export
(transitions, timeouts, CRI calls, discovery freshness, and on request every attempt's duration)
and the current state alerts need (containers ready and started, failures in a row, the time to
a probe's first success). A worker's series are deleted when it stops, as the kubelet's are. The
per-worker series live in ``metrics_series.py``, their fast exposition in ``metrics_render.py``,
and the ``/metrics`` HTTP server in ``metrics_http.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cri_prober.discovery.source import DiscoveryUpdate, NodeSource, Relisted
from cri_prober.manager.events import (
    AttemptFinished,
    AttemptsRepeated,
    ContainerGone,
    ManagerEvent,
    ResultChanged,
    WorkerStopped,
    catch_up_in_steps,
    subscribe_runs,
)
from cri_prober.podspecs.kubelet_metrics import KubeletMetricsReader
from cri_prober.podspecs.registry import PodSpecs
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.results import Published
from cri_prober.runtime.client import CriClient
from cri_prober.runtime.model import CriCall
from cri_prober.serving.metrics_render import Renderer, negotiate
from cri_prober.serving.metrics_series import (
    GO_DEFAULT_BUCKETS,
    PROBE_TYPES,
    WorkerSeries,
    WorkerSeriesCollector,
)
from cri_prober.topic import Topic

# cri_prober_probe_time_to_first_success_seconds: from half a second (a process that answers at
# once, probed on its first tick) to ten minutes (a slow JVM or a migration behind a startup probe).
FIRST_SUCCESS_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class FollowedManager(Protocol):
    """What the metrics read of the manager (``ProbeManager`` provides it): its event stream,
    and how many containers it tracks."""

    @property
    def events(self) -> Topic[ManagerEvent]: ...

    def tracked(self) -> int: ...


class Metrics:
    """Every metric cri-prober exports, fed by the manager's, discovery's and CRI's streams.

    The per-worker metrics (the kubelet's two, and transitions, timeouts and optionally every
    attempt's duration) are plain numbers per worker (``WorkerSeries``), exported by
    ``WorkerSeriesCollector``: about 1 µs per attempt, and 0.2 s per scrape of 10,000 workers,
    where labelled prometheus_client children took 15 µs and 3.5 s (bench/metrics_scrape.py).
    The rest, a few dozen series, are ordinary prometheus_client metrics on ``_base``.
    """

    def __init__(
        self, *, attempt_durations: bool = False, wall: Callable[[], float] = time.time
    ) -> None:
        self.attempt_durations = attempt_durations
        self._wall = wall
        # Containers started before this are not timed to their first success: that success
        # may predate cri-prober (a restart adopts running containers without a new result).
        self._since = wall()
        self._base = CollectorRegistry(auto_describe=True)
        self._workers = WorkerSeriesCollector(attempt_durations=attempt_durations)
        self._cri: CriClient | None = None  # set by follow()
        # Everything: the worker series first, then the rest; what tests and generate_latest()
        # read, and what ``exposition`` must equal byte for byte.
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self._workers)
        self.registry.register(self._base)
        self._renderers: dict[str, Renderer | None] = {}
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
        self.first_success = Histogram(
            "cri_prober_probe_time_to_first_success_seconds",
            "Seconds from a container's start to its probe's first published success, by probe "
            "type (containers started after cri-prober).",
            ["probe_type"],
            buckets=FIRST_SUCCESS_BUCKETS,
            registry=self._base,
        )
        # By reason for the whole node (no container labels): a handful of series that say
        # why this node's probes fail ("half the timeouts are connection-refused"). Children are
        # kept per label tuple: ``labels()`` on every attempt would cost 15 µs each.
        self.attempt_reasons = Counter(
            "cri_prober_probe_attempts_by_reason_total",
            "Probe attempts on this node by probe type and reason (docs/interface.md, "
            "Reasons): ok, timeout, exit-code, connection-refused, runtime-error, ...",
            ["probe_type", "reason"],
            registry=self._base,
        )
        self._reason_children: dict[tuple[ProbeKind, str], Counter] = {}
        self._cri_children: dict[tuple[str, str], tuple[Counter, Histogram]] = {}
        # Node-wide too: ticks a worker dropped because its attempt before ran past them.
        self.ticks_dropped = Counter(
            "cri_prober_probe_ticks_dropped_total",
            "Probe ticks dropped because the attempt before ran past them (a worker keeps one "
            "pending tick, like the kubelet's), by probe type.",
            ["probe_type"],
            registry=self._base,
        )
        self._dropped_children: dict[ProbeKind, Counter] = {}  # made at the first drop
        # serve --mirror: the kubelet's attempts among those counted above and in the kubelet's
        # own two metrics (which keep the kubelet's labels exactly, so carry no source).
        self.mirrored = Counter(
            "cri_prober_probe_mirrored_attempts_total",
            "Probe attempts the kubelet ran and cri-prober mirrored from its counters (serve "
            "--mirror), by probe type and result; counted in prober_probe_total too.",
            ["probe_type", "result"],
            registry=self._base,
        )
        self._mirrored_children: dict[tuple[ProbeKind, str], Counter] = {}
        self.containers_tracked = Gauge(
            "cri_prober_containers_tracked",
            "Containers with at least one probe configured.",
            registry=self._base,
        )

    def follow_pod_sources(self, pod_specs: PodSpecs) -> None:
        """Export the ``--probes-from`` sources' freshness, pods and reads."""
        self._base.register(_PodSourceCollector(pod_specs))

    def follow_mirror(self, reader: KubeletMetricsReader) -> None:
        """Export serve --mirror's reads of the kubelet's counters and its counter resets."""
        self._base.register(_MirrorCollector(reader))

    def follow(
        self, *, manager: FollowedManager, node: NodeSource, cri: CriClient
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
        # A steady probe's repeated attempts come in runs (AttemptsRepeated): the manager is
        # asked for those held back before each read of the counts, on the loop's thread
        # (``exposition_pieces``; ``registry`` readers there too).
        loop_thread = threading.get_ident()

        def before_read() -> Iterator[None]:
            if threading.get_ident() == loop_thread:
                yield from catch_up_in_steps(manager.events)

        self._workers.before_read = before_read
        stops = [
            subscribe_runs(manager.events, self.manager_event),
            node.updates.subscribe(self.discovery_update),
            cri.calls.subscribe(self.cri_call),
        ]

        def stop() -> None:
            self._workers.before_read = None
            for unsubscribe in stops:
                unsubscribe()

        return stop

    # -- the streams ----------------------------------------------------------------------------

    def manager_event(self, event: ManagerEvent) -> None:
        """Count attempts and transitions, keep the containers' health; forget a stopped
        worker's series and a dropped container's."""
        if isinstance(event, AttemptFinished):
            self._attempts(event, (event.record.duration,))
        elif isinstance(event, AttemptsRepeated):
            if event.durations:
                self._attempts(event, event.durations)
        elif isinstance(event, ResultChanged):
            worker = self._workers.new_container(event.container, event.kind)
            result = event.result.value
            if event.previous is not event.result:
                # A restatement (an exit no worker publishes, issue 34) changes only the health:
                # no transition is counted, and a held probe stays held.
                worker.held = event.held
                worker.transitions[result] = worker.transitions.get(result, 0) + 1
            health = event.health
            self._workers.container_health(
                event.container, ready=health.ready, started=health.started
            )
            # consecutive is 0 for an initial value (no attempt published it).
            if event.result is Published.SUCCESS and event.consecutive > 0:
                self._first_success(worker, event)
        elif isinstance(event, WorkerStopped) and not event.replaced:
            # A replaced worker (a changed spec) ends after its replacement started; its series
            # are the replacement's now (the labels name no worker), so deleting would reset them.
            self._workers.forget(event.container, event.kind)
        elif isinstance(event, ContainerGone):
            self._workers.container_gone(event.container)

    def _attempts(
        self, event: AttemptFinished | AttemptsRepeated, durations: tuple[float, ...]
    ) -> None:
        """Count ``len(durations)`` attempts like ``event.record``, each with its duration."""
        record, count = event.record, len(durations)
        self._workers.attempts(event.container, event.kind, record, durations)
        kind, reason = event.kind, record.reason or "unknown"
        _child(
            self._reason_children,
            (kind, reason),
            lambda: self.attempt_reasons.labels(PROBE_TYPES[kind], reason),
        ).inc(count)
        if record.source:
            result = record.result
            _child(
                self._mirrored_children,
                (kind, result),
                lambda: self.mirrored.labels(PROBE_TYPES[kind], result),
            ).inc(count)
        if record.dropped:
            _child(
                self._dropped_children,
                kind,
                lambda: self.ticks_dropped.labels(PROBE_TYPES[kind]),
            ).inc(record.dropped * count)
        # A liveness probe starts out published as success (its initial value), so its
        # first success is its first successful attempt (its successThreshold is 1). Repeats
        # told after their container was replaced in the slot are not the new one's.
        if (
            kind is ProbeKind.LIVENESS
            and record.result in ("success", "warning")
            and (isinstance(event, AttemptFinished) or record.container_id == event.container.id)
        ):
            self._first_success(self._workers.worker(event.container, kind), event)

    def _first_success(
        self, worker: WorkerSeries, event: AttemptFinished | AttemptsRepeated | ResultChanged
    ) -> None:
        """Time the container's first published success of this probe, once."""
        container = event.container
        if worker.first_success_of == container.id:
            return
        worker.first_success_of = container.id
        started = container.started_at / 1e9  # nanoseconds, as the CRI says
        if started < self._since:
            return
        now = self._wall()
        self.first_success.labels(PROBE_TYPES[event.kind]).observe(max(0.0, now - started))

    def cri_call(self, call: CriCall) -> None:
        """Count one CRI call."""
        # Children kept per (method, code), a few dozen: ``labels()`` on every call was 2 % of
        # an exec probe's CPU (py-spy, bench/run process_cpu --profile).
        key = (call.method, call.code)
        requests, duration = _child(
            self._cri_children,
            key,
            lambda: (self.cri_requests.labels(*key), self.cri_duration.labels(*key)),
        )
        requests.inc()
        duration.observe(call.seconds)

    def discovery_update(self, update: DiscoveryUpdate) -> None:
        """Time relists; their failures show in the CRI call codes."""
        if isinstance(update, Relisted):
            self.relist_duration.observe(update.seconds)

    # -- the exposition -------------------------------------------------------------------------

    def exposition(self, accept: str | None = None) -> bytes:
        """Every metric in the format ``negotiate(accept)`` picks (the text format by default).

        Equal, byte for byte, to prometheus_client's encoder over ``registry``, only faster: the
        per-worker lines are written from line templates that the same encoder wrote (see
        ``Renderer``), the rest by the encoder itself.
        """
        return b"".join(self.exposition_pieces(accept))

    def exposition_pieces(self, accept: str | None = None) -> Iterator[bytes]:
        """``exposition(accept)`` in pieces of about a hundred workers' lines, each made when it
        is read: the metrics server reads them on the event loop and gives it a turn after
        each, so an exposition of thousands of workers never holds the loop for long."""
        encoder, content_type = negotiate(accept)
        for _ in self._workers.catch_up_in_steps():
            yield b""  # the reader may give the loop a turn between steps (an empty piece)
        if content_type not in self._renderers:
            # Content types are few (a format, a version and an escaping); the bound only
            # guards against clients inventing versions.
            if len(self._renderers) >= 16:
                self._renderers.clear()
            self._renderers[content_type] = Renderer.make(encoder, self._workers.families())
        renderer = self._renderers[content_type]
        if renderer is None:
            # No format prometheus_client writes today (tests/unit/test_metrics.py): all at once.
            yield encoder(self.registry)
            return
        yield from renderer.render(self._workers)
        yield encoder(self._base)


_Key = TypeVar("_Key")
_Child = TypeVar("_Child")


def _child(children: dict[_Key, _Child], key: _Key, make: Callable[[], _Child]) -> _Child:
    """``children[key]``, made by ``make()`` the first time: a metric's labelled children kept
    per label tuple, since prometheus_client's ``labels()`` costs about 15 µs a call."""
    child = children.get(key)
    if child is None:
        child = children[key] = make()
    return child


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
            "after the others until one of its execs finishes within it (unless the runtime "
            "is saturated: cri_prober_exec_pace_seconds).",
        )
        overruns.add_metric([], float(cri.exec_overruns))
        yield from (waited, preempted, overruns)
        if (pace := cri.exec_pace) is not None:
            gauge = GaugeMetricFamily(
                "cri_prober_exec_pace_seconds",
                "Median seconds from exec slot to answer of the last 32 execs answered within "
                "their timeout; past "
                "the start hold (0.5 s) the runtime counts as saturated and fewer execs start "
                "at a time.",
            )
            gauge.add_metric([], pace)
            yield gauge


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
        watches = CounterMetricFamily(
            "cri_prober_pod_source_watches",
            "Watch requests a --probes-from source sent (apiserver: each watch or streaming "
            "list opened); a fast-rising count is a server that ends its watches at once.",
            labels=["source"],
        )
        for source in self._pod_specs.sources:
            up.add_metric([source.name], 0.0 if source.stale() else 1.0)
            pods.add_metric([source.name], float(len(source.pods)))
            invalid.add_metric([source.name], float(source.invalid_pods))
            reads.add_metric([source.name, "ok"], float(source.reads - source.read_errors))
            reads.add_metric([source.name, "error"], float(source.read_errors))
            if source.watches is not None:
                watches.add_metric([source.name], float(source.watches))
        yield from (up, pods, invalid, reads, watches)


class _MirrorCollector(Collector):
    """serve --mirror's reader of the kubelet's counters, read at scrape time."""

    def __init__(self, reader: KubeletMetricsReader) -> None:
        self._reader = reader

    def collect(self) -> Iterator[Metric]:
        reader = self._reader
        reads = CounterMetricFamily(
            "cri_prober_kubelet_mirror_reads",
            "Reads of the kubelet's /metrics/probes (serve --mirror) by result.",
            labels=["result"],
        )
        reads.add_metric(["ok"], float(reader.reads - reader.read_errors))
        reads.add_metric(["error"], float(reader.read_errors))
        resets = CounterMetricFamily(
            "cri_prober_kubelet_counter_resets",
            "Reads of the kubelet's probe counters that could not be compared with the read "
            "before (a kubelet restart or a counter that went down): no attempt was mirrored "
            "from them.",
        )
        resets.add_metric([], float(reader.tracker.resets))
        yield from (reads, resets)


__all__ = ["FollowedManager", "Metrics"]
