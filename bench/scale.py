"""Scale: thousands of simulated containers on the fake CRI runtime, real tcp/http probes.

    python -m bench.scale [--quick] [--sizes 500,1000,2000,5000] [--seconds S] [--last-seconds S]
                          [--cpu-hog [--nice N]] [--pauses] [--history-size N]
                          [--profile DIR] [--tracemalloc N]

For each size N, starts the fake runtime (bench.fake_cri) with N host-network pods and the probe
targets (bench.listeners, 8 HTTP + 8 TCP ports) in two child processes, then runs the whole
cri-prober daemon in this process (relist discovery every 1 s) with a readiness httpGet and a
liveness tcpSocket probe per container at period 10 s, i.e. N/5 probes/s. After a warm-up it
samples, every 5 s: this process's CPU %, RSS, asyncio task count and event-loop lag; and records
every probe's lateness against its worker's tick grid (see docs/benchmarks.md). The process
holds the modules a plain install gives serve (``bench._plain_install``; its own scraper is plain
asyncio), so its RSS is the daemon's plus a few small benchmark modules. ``--history-size`` is
serve's flag of that name: the memory an operator can trade for a shorter history.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import os
import resource
import subprocess
import tempfile
import threading
import time
import tracemalloc
from array import array
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import bench._plain_install  # first, before structlog: the modules a plain install has
from bench._common import (
    Child,
    describe_memory,
    fmt,
    free_port,
    listeners,
    machine,
    median,
    memory_breakdown,
    pct,
    ports,
    proc_cpu_seconds,
    py_spy,
    quiet_logs,
    rss_mib,
    rules_file,
    say,
    spy_rows,
    start_py_spy,
    table,
    tables_first,
)
from bench._pauses import PauseSampler
from cri_prober.cli.common import loop_factory
from cri_prober.discovery.pleg import Discovery
from cri_prober.discovery.source import DiscoveryUpdate, Relisted
from cri_prober.manager.events import AttemptFinished, AttemptsRepeated, ManagerEvent, catch_up
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.worker import DEFAULT_HISTORY_SIZE
from cri_prober.runtime.client import CriClient
from tests.support.daemon import InRuns, running_daemon
from tests.support.waiting import until

PERIOD = 10.0
SPY = py_spy()
RULES = """
probes:
  - match: {namespace: bench, container: app}
    readinessProbe:
      httpGet: {path: /, port: http}
      periodSeconds: 10
    livenessProbe:
      tcpSocket: {port: tcp}
      periodSeconds: 10
"""


class LeanObserver:
    """Lateness from every start's phase on its worker's grid (only numbers kept, no records).

    A listener on the manager's events that takes a steady probe's repeated attempts in runs
    (``running_daemon(..., listeners=[InRuns(observer)])``), as serve's own listeners do: a plain
    listener needs every attempt and so turns the manager's steady fast path off (issue 36).
    Each ``AttemptsRepeated`` brings its attempts' start stamps; a run is told late (once per
    history, or when counts are read: ``catch_up`` before ``lateness``), so what is counted is
    chosen by the start stamp, ``count_from`` to ``count_until``, not by when it was told.
    A worker's grid is known only through its starts, and any start, the first one too, may be
    late. Each start's phase is taken modulo the period against the worker's second start (its
    first on the ticker, see ``first_probe``), on a circle: the worker's on-time phase is the
    one just after the widest gap between its phases (its lateness spread is far below a
    period), and a start's lateness is how far its phase lies past that one. The grid index of
    each start follows, and with it the ticks no start served (``dropped``).

    Until issue 25 a phase was a plain difference with the anchor (floored to a grid point with
    1 s of slack): a worker whose anchor was late by more than the slack then read every on-time
    start as nearly a period late, which made the p99 of 10.0 s that run reported.
    """

    def __init__(self) -> None:
        # Each worker's number, by its key; what is kept is numbers in flat arrays by that
        # number, not a container per worker: the observer runs in the measured process, and
        # its keys (three copies each) and a growing array per worker took 6 MiB of the RSS the
        # benchmark reports at 5,000 containers (issue 36).
        self.workers: dict[tuple[str, str, ProbeKind], int] = {}
        self.anchors = array("d")  # a worker's anchor (its second start); NaN until then
        self.start_worker = array("l")  # each counted start's worker, and the start
        self.start_at = array("d")
        # The window, on the starts' wall-clock stamps: nothing is counted until count_from.
        self.since = math.inf
        self.until = math.inf
        self.probes = 0
        self.unsuccessful = 0
        self.timed_out = 0
        self.first_probe = 0.0  # wall time of the latest first probe of any worker
        self._summary: tuple[list[float], int, int] | None = None

    def count_from(self, wall: float) -> None:
        """Count the starts stamped at ``wall`` or later (until ``count_until``)."""
        self.since = wall

    def count_until(self, wall: float) -> None:
        """Count no start stamped at ``wall`` or later; the repeats of the window told later
        (``catch_up``) are still counted."""
        self.until = wall

    @property
    def first_probes(self) -> int:
        """Workers whose first step has been seen."""
        return len(self.workers)

    def __call__(self, event: ManagerEvent) -> None:
        if isinstance(event, AttemptFinished):
            starts: tuple[float, ...] = (event.record.started_at,)
        elif isinstance(event, AttemptsRepeated):
            starts = event.starts
        else:
            return
        container, kind, record = event.container, event.kind, event.record
        # The manager's slot key: a worker's grid survives its container's restarts.
        key = (container.pod.uid or container.pod_sandbox_id, container.name, kind)
        # Repeats share their newest record's result and timeout (only times differ).
        unsuccessful, timed_out = record.result != "success", record.timed_out
        for start in starts:
            worker = self.workers.get(key)
            if worker is None:
                # A worker's first step after start comes within what was left of the first
                # period; its ticker's phase is drawn apart from it, so the grid starts at
                # step 2.
                self.workers[key] = len(self.anchors)
                self.anchors.append(math.nan)
                self.first_probe = max(self.first_probe, start)
                continue
            if math.isnan(self.anchors[worker]):
                self.anchors[worker] = start
                continue
            if self.since <= start < self.until:
                self.start_worker.append(worker)
                self.start_at.append(start)
                self._summary = None
                self.probes += 1
                self.unsuccessful += unsuccessful
                self.timed_out += timed_out

    def lateness(self) -> list[float]:
        """Every counted start's lateness past its worker's on-time phase."""
        return self._summarize()[0]

    @property
    def ticks(self) -> int:
        """Grid points from each worker's first counted start to its last."""
        return self._summarize()[1]

    @property
    def dropped(self) -> int:
        """Grid points between those that no start served."""
        return self._summarize()[2]

    def _summarize(self) -> tuple[list[float], int, int]:
        if self._summary is None:
            starts: dict[int, list[float]] = {}
            for worker, start in zip(self.start_worker, self.start_at, strict=True):
                starts.setdefault(worker, []).append(start)
            late: list[float] = []
            ticks = dropped = 0
            for worker, worker_starts in starts.items():
                worker_late, worker_ticks, worker_dropped = worker_lateness(
                    self.anchors[worker], worker_starts
                )
                late.extend(worker_late)
                ticks += worker_ticks
                dropped += worker_dropped
            self._summary = (late, ticks, dropped)
        return self._summary


def worker_lateness(
    anchor: float, starts: array[float] | list[float], period: float = PERIOD
) -> tuple[list[float], int, int]:
    """One worker's starts: each one's lateness, the grid points they span, and how many of
    those no start served (see ``LeanObserver``)."""
    offsets = [start - anchor for start in starts]
    phases = sorted(offset % period for offset in offsets)
    count = len(phases)
    # The widest gap between neighbouring phases on the circle ends at the on-time phase.
    widest = max(
        range(count),
        key=lambda i: phases[(i + 1) % count] - phases[i] + (period if i == count - 1 else 0),
    )
    on_time = phases[(widest + 1) % count]
    late = [(offset - on_time) % period for offset in offsets]
    points = {
        round((offset - on_time - lag) / period) for offset, lag in zip(offsets, late, strict=True)
    }
    span = max(points) - min(points) + 1
    return late, span, span - len(points)


@dataclass
class Sample:
    cpu_pct: float
    rss: float
    tasks: int
    loop_lag_max: float
    loop_cpu_pct: float  # the event-loop thread's CPU, % of one CPU
    runqueue_pct: float  # share of the time the loop thread was runnable but not running
    loadavg: float  # the node's 1-minute load average (other work on the machine)


@dataclass
class SizeResult:
    containers: int
    seconds: float
    probes_per_s: float
    late_p50: float
    late_p99: float
    late_max: float
    dropped_pct: float
    unsuccessful: int
    cpu_pct: float
    rss_start: float
    rss_end: float
    rss_baseline: float
    tasks: int
    loop_lag_p99: float
    relist_p50: float
    relist_p99: float
    fake_cpu_pct: float
    listeners_cpu_pct: float
    startup_s: float
    first_probes_s: float  # from daemon start until every worker had its first probe
    scrape_p50: float  # s, a gzip /metrics scrape during the window
    scrape_max: float
    scrape_bytes: float  # gzipped
    scrapes_failed: int
    relist_alone_wall: float  # ms, one steady-state relist with nothing else running
    relist_alone_cpu: float
    timed_out: int
    samples: list[Sample] = field(default_factory=list)
    # Garbage collections during the window, by generation: (count, total s, longest s).
    collections: dict[int, tuple[int, float, float]] = field(default_factory=dict)
    hog: bool = False  # run beside a CPU hog (--cpu-hog)
    memory: str = ""  # where the RSS is at the end of the window (describe_memory)
    # ... once every worker is there, and at the start of the window: when the allocators'
    # free memory (pymalloc's unused pools) appeared.
    memory_workers: str = ""
    memory_start: str = ""
    # ... and after a full collection at the end (after the window: garbage cycles the
    # collector had not reached yet, which the RSS above still holds).
    memory_collected: str = ""
    pauses: PauseSampler | None = None  # with --pauses
    # With --tracemalloc: the live allocations made since the daemon's start, at the end of the
    # window, by line and by file (rows of place, MiB, blocks).
    traced: list[tuple[str, list[list[str]]]] = field(default_factory=list)


TRACE_FRAMES = 1  # a line per allocation: what made each kept block


def traced_rows(top: int) -> list[tuple[str, list[list[str]]]]:
    """The largest places still holding memory traced since ``tracemalloc.start``, by line and
    by file (then tracing stops): rows of (place, MiB, blocks), the total last."""
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)]
    )
    tracemalloc.stop()
    out = []
    for key in ("lineno", "filename"):
        stats = snapshot.statistics(key)
        rows = [
            [str(stat.traceback[0]), fmt(stat.size / 2**20, 2), str(stat.count)]
            for stat in stats[:top]
        ]
        total = sum(stat.size for stat in stats)
        rows.append(["all", fmt(total / 2**20, 2), str(sum(stat.count for stat in stats))])
        out.append((key, rows))
    return out


def freed_rows(before: tracemalloc.Snapshot, top: int) -> list[tuple[str, list[list[str]]]]:
    """What was live at ``before`` (every worker there) and is no longer (the start-up burst's
    transient memory, which leaves pymalloc's pools unused), by line."""
    skip = [tracemalloc.Filter(False, tracemalloc.__file__)]
    after = tracemalloc.take_snapshot().filter_traces(skip)
    stats = sorted(
        after.compare_to(before.filter_traces(skip), "lineno"), key=lambda s: s.size_diff
    )
    rows = [
        [str(stat.traceback[0]), fmt(stat.size_diff / 2**20, 2), str(stat.count_diff)]
        for stat in stats[:top]
    ]
    total = sum(stat.size_diff for stat in stats)
    rows.append(["all", fmt(total / 2**20, 2), str(sum(stat.count_diff for stat in stats))])
    return [("lineno, the change from every worker there to the window's start", rows)]


class CollectionTimer:
    """Times every garbage collection (``gc.callbacks``) while ``counting``: each one stops
    the event loop for as long as it takes."""

    def __init__(self) -> None:
        self.counting = False
        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self.counting:
            self.pauses[info["generation"]].append(time.perf_counter() - self._started)

    def summary(self) -> dict[int, tuple[int, float, float]]:
        return {
            generation: (len(pauses), sum(pauses), max(pauses, default=0.0))
            for generation, pauses in self.pauses.items()
        }


def main_thread_sched() -> tuple[float, float]:
    """(CPU seconds, seconds waiting on a run queue) of this process's main thread (the loop)."""
    fields = Path(f"/proc/self/task/{os.getpid()}/schedstat").read_text().split()
    return int(fields[0]) / 1e9, int(fields[1]) / 1e9


async def relist_cost(target: str, repeats: int = 5) -> tuple[float, float]:
    """Wall and CPU ms of one steady-state relist (nothing changed), discovery alone."""
    async with CriClient.connect(target) as cri:
        discovery = Discovery(cri)
        await discovery.relist()  # the first one fetches every status
        walls, cpus = [], []
        for _ in range(repeats):
            w, c = time.monotonic(), time.process_time()
            await discovery.relist()
            walls.append(time.monotonic() - w)
            cpus.append(time.process_time() - c)
    return 1000 * min(walls), 1000 * min(cpus)


async def loop_lag(out: list[float], stop: asyncio.Event) -> None:
    """How late a 100 ms sleep wakes up: the event loop's responsiveness."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        before = loop.time()
        await asyncio.sleep(0.1)
        out.append(loop.time() - before - 0.1)


class ScrapeFailed(Exception):
    """A scrape that did not end in a whole 200 answer."""


SCRAPE_TIMEOUT = 30.0


async def scrape_once(port: int) -> int:
    """One gzip scrape of /metrics on a new connection, as Prometheus makes it: the body's
    bytes (read raw and dropped). Plain asyncio streams: an HTTP client library in this process
    (the daemon's) would add its modules to the RSS measured (httpx: about 3 MiB)."""
    try:
        async with asyncio.timeout(SCRAPE_TIMEOUT):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(
                    b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Accept-Encoding: gzip\r\nConnection: close\r\n\r\n"
                )
                head = await reader.readuntil(b"\r\n\r\n")
                status, *lines = head.decode("latin-1").split("\r\n")
                if status.split(" ")[1:2] != ["200"]:
                    raise ScrapeFailed(status)
                fields = {
                    name.strip().lower(): value.strip()
                    for name, _, value in (line.partition(":") for line in lines)
                }
                length = int(fields.get("content-length", "-1"))
                if length < 0:
                    raise ScrapeFailed(f"no Content-Length in {status!r}")
                size = 0
                while size < length:
                    chunk = await reader.read(min(1 << 16, length - size))
                    if not chunk:
                        raise ScrapeFailed(f"closed after {size} of {length} bytes")
                    size += len(chunk)
                return size
            finally:
                writer.close()
    except (
        OSError,
        TimeoutError,
        ValueError,
        asyncio.IncompleteReadError,
        asyncio.LimitOverrunError,
    ) as error:
        raise ScrapeFailed(repr(error)) from error


async def scrape_metrics(
    port: int,
    every: float,
    out: list[tuple[float, int]],
    stop: asyncio.Event,
) -> None:
    """Scrape /metrics (gzip) every ``every`` s as Prometheus would: (seconds, bytes) each.

    The body is read raw and dropped: decompressing it (as HTTP clients do by default) made
    24 MB of text on the daemon's own loop, about 0.1 s of its time and 20 MB of its memory per
    scrape, which a real scraper, in its own process, never costs cri-prober.
    """
    while not stop.is_set():
        started = time.monotonic()
        try:
            size = await scrape_once(port)
        except ScrapeFailed as error:
            # A failed scrape is a finding (the server gave up on a loop too busy to serve
            # it in time), not the end of the run: counted with size -1.
            say(f"  scrape failed after {time.monotonic() - started:.1f} s: {error!r}")
            size = -1
        out.append((time.monotonic() - started, size))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)


async def run_size(
    count: int,
    seconds: float,
    warmup: float,
    tmp: Path,
    scrape_every: float,
    profile: Path | None = None,
    sample_pauses: bool = False,
    history_size: int = DEFAULT_HISTORY_SIZE,
    nice: int = 0,
    hog: bool = False,
    measured: Callable[[SizeResult], None] = lambda result: None,
    trace: int = 0,
    every_attempt: bool = False,
) -> SizeResult:
    """One size's window; its result goes to ``measured`` before anything stops."""
    rss_baseline = rss_mib()
    with listeners(http=8, tcp=8, grpc=0) as targets:
        socket = tmp / f"fake-{count}.sock"
        with Child(
            [
                "-m", "bench.fake_cri", "--socket", str(socket), "--containers", str(count),
                "--http-ports", ",".join(map(str, ports(targets, "http"))),
                "--tcp-ports", ",".join(map(str, ports(targets, "tcp"))),
            ],
            ready_timeout=120,
        ) as fake:  # fmt: skip
            relist_wall, relist_cpu = await relist_cost(str(fake.info["target"]))
            observer = LeanObserver()
            collections = CollectionTimer()
            gc.callbacks.append(collections)
            relists: list[float] = []
            started = time.monotonic()
            started_wall = time.time()
            metrics_port = free_port()
            scrapes: list[tuple[float, int]] = []
            if trace:
                # From the daemon's start: what it keeps, not the benchmark's fake runtime client.
                tracemalloc.start(TRACE_FRAMES)
            async with (
                # Entered once the helpers run, so that they keep the default niceness.
                loop_thread_niceness(nice),
                rules_file(RULES) as rules,
                running_daemon(
                    str(fake.info["target"]), rules, ready_timeout=180, stop_timeout=60,
                    listeners=[observer if every_attempt else InRuns(observer)], pleg="relist",
                    metrics_address=f"127.0.0.1:{metrics_port}" if scrape_every else None,
                    freeze_gc=True,  # as serve does
                    tune_malloc=True,  # as serve does
                    history_size=history_size,
                ) as (daemon, watcher),
            ):  # fmt: skip
                # Only the lean observer follows the manager: the watcher would keep every event,
                # and it takes every attempt, which turns the steady fast path off (issue 36).
                watcher.unsubscribe()
                if daemon.manager.events.takes_runs == every_attempt:
                    raise RuntimeError(
                        f"the steady fast path is {'on' if every_attempt else 'off'}"
                    )

                def relisted(update: DiscoveryUpdate) -> None:
                    if isinstance(update, Relisted):
                        relists.append(update.seconds)

                daemon.discovery.updates.subscribe(relisted)
                # Poll (5 times a second, before measuring) rather than re-count the workers on
                # every one of the thousands of manager events a second.
                await until(
                    lambda: daemon.manager.worker_count() >= 2 * count, timeout=300, poll=0.2
                )
                startup = time.monotonic() - started
                memory_workers = describe_memory(memory_breakdown())
                at_workers = tracemalloc.take_snapshot() if trace else None
                say(f"  {count}: {2 * count} workers after {startup:.1f} s; warming up")
                if scrape_every:
                    # The client's first use; it may fail in the start-up burst (not counted).
                    with contextlib.suppress(ScrapeFailed):
                        await scrape_once(metrics_port)
                await asyncio.sleep(max(warmup, PERIOD + 1))
                # Every worker's first probe has been seen: the jitter ends within one period.
                first_probes = observer.first_probe - started_wall
                if observer.first_probes < 2 * count:
                    first_probes = math.inf
                relists.clear()
                collections.counting = True
                lags: list[float] = []
                stop_lag = asyncio.Event()
                lag_task = asyncio.create_task(loop_lag(lags, stop_lag))
                scrape_task = (
                    asyncio.create_task(
                        scrape_metrics(metrics_port, scrape_every, scrapes, stop_lag)
                    )
                    if scrape_every
                    else None
                )
                samples: list[Sample] = []
                # py-spy on this very process (the daemon runs in it) through the window.
                spy = (
                    await start_py_spy(SPY, os.getpid(), seconds, profile)
                    if profile is not None and SPY is not None
                    else None
                )
                pauses = PauseSampler() if sample_pauses else None
                if pauses is not None:
                    pauses.start()
                rss_start = rss_mib()
                memory_start = describe_memory(memory_breakdown())
                freed = freed_rows(at_workers, trace) if at_workers is not None else []
                fake_cpu0 = proc_cpu_seconds(fake.pid)
                lis_cpu0 = proc_cpu_seconds(targets.pid)
                cpu0, wall0 = time.process_time(), time.monotonic()
                observer.count_from(time.time())  # the starts stamped in the window
                end = wall0 + seconds
                while (now := time.monotonic()) < end:
                    c, w = time.process_time(), now
                    sched_cpu, sched_wait = main_thread_sched()
                    lag_mark = len(lags)
                    await asyncio.sleep(min(5.0, end - now))
                    sched_cpu1, sched_wait1 = main_thread_sched()
                    elapsed = time.monotonic() - w
                    samples.append(
                        Sample(
                            cpu_pct=100 * (time.process_time() - c) / elapsed,
                            rss=rss_mib(),
                            tasks=len(asyncio.all_tasks()),
                            loop_lag_max=max(lags[lag_mark:], default=0.0),
                            loop_cpu_pct=100 * (sched_cpu1 - sched_cpu) / elapsed,
                            runqueue_pct=100 * (sched_wait1 - sched_wait) / elapsed,
                            loadavg=os.getloadavg()[0],
                        )
                    )
                wall = time.monotonic() - wall0
                observer.count_until(time.time())
                cpu = time.process_time() - cpu0
                memory = describe_memory(memory_breakdown())
                traced = freed + (traced_rows(trace) if trace else [])
                if pauses is not None:
                    pauses.stop()
                fake_cpu = proc_cpu_seconds(fake.pid) - fake_cpu0
                lis_cpu = proc_cpu_seconds(targets.pid) - lis_cpu0
                collections.counting = False
                # The window's repeats the workers still hold back (at most a history's worth
                # each): told now, counted by their stamps.
                catch_up(daemon.manager.events)
                stop_lag.set()
                if spy is not None:
                    await spy.wait()
                await lag_task
                if scrape_task is not None:
                    await scrape_task
                # Once nothing is counted any more: the collection stops the loop.
                gc.collect()
                memory_collected = describe_memory(memory_breakdown())
                # Kept before anything stops: a stop that fails (the daemon's, the fake
                # runtime's, the listeners') must not lose the figures (issue 35).
                late = observer.lateness()
                result = SizeResult(
                    containers=count,
                    seconds=wall,
                    probes_per_s=observer.probes / wall,
                    late_p50=pct(late, 50),
                    late_p99=pct(late, 99),
                    late_max=max(late, default=math.nan),
                    dropped_pct=100 * observer.dropped / observer.ticks
                    if observer.ticks
                    else math.nan,
                    unsuccessful=observer.unsuccessful,
                    cpu_pct=100 * cpu / wall,
                    rss_start=rss_start,
                    rss_end=samples[-1].rss,
                    rss_baseline=rss_baseline,
                    tasks=max(s.tasks for s in samples),
                    loop_lag_p99=pct(lags, 99),
                    relist_p50=pct(relists, 50),
                    relist_p99=pct(relists, 99),
                    fake_cpu_pct=100 * fake_cpu / wall,
                    listeners_cpu_pct=100 * lis_cpu / wall,
                    startup_s=startup,
                    first_probes_s=first_probes,
                    scrape_p50=pct([t for t, b in scrapes if b >= 0], 50),
                    scrape_max=max((t for t, b in scrapes if b >= 0), default=math.nan),
                    scrape_bytes=median([float(b) for _, b in scrapes if b >= 0])
                    if any(b >= 0 for _, b in scrapes)
                    else math.nan,
                    scrapes_failed=sum(1 for _, b in scrapes if b < 0),
                    relist_alone_wall=relist_wall,
                    relist_alone_cpu=relist_cpu,
                    timed_out=observer.timed_out,
                    collections=collections.summary(),
                    memory=memory,
                    memory_workers=memory_workers,
                    memory_start=memory_start,
                    memory_collected=memory_collected,
                    pauses=pauses,
                    samples=samples,
                    traced=traced,
                )
                result.hog = hog
                measured(result)
    gc.callbacks.remove(collections)
    return result


async def run(args: argparse.Namespace) -> None:
    quiet_logs()
    results: list[SizeResult] = []

    def tables() -> None:
        if results:
            report(args, results)
        else:
            print("\nnothing was measured")

    # The tables of what was measured come first, even when a stop (the daemon's timing out
    # after a window, on a loaded machine) or a later size fails: that failure follows them.
    with tables_first(tables), tempfile.TemporaryDirectory(prefix="cprb-scale-") as tmp:
        for i, count in enumerate(args.sizes):
            seconds = args.last_seconds if i == len(args.sizes) - 1 else args.seconds
            for hog in (False, True) if args.cpu_hog else (False,):
                beside = " beside a CPU hog (stress-ng --cpu 1)" if hog else ""
                say(f"{count} containers x 2 probes at {PERIOD:g} s for {seconds:g} s{beside}")
                with cpu_hog() if hog else contextlib.nullcontext():
                    spied = (
                        args.profile / f"scale-{count}{'-hog' if hog else ''}.txt"
                        if args.profile is not None
                        else None
                    )
                    result = await run_size(
                        count, seconds, args.warmup, Path(tmp), args.scrape_every, spied,
                        args.pauses, args.history_size, args.nice if hog else 0,
                        hog=hog, measured=results.append, trace=args.tracemalloc,
                        every_attempt=args.every_attempt,
                    )  # fmt: skip
                say(
                    f"  {result.probes_per_s:.0f} probes/s, late p99"
                    f" {1000 * result.late_p99:.0f} ms, CPU {result.cpu_pct:.0f}%,"
                    f" RSS {result.rss_end:.0f} MiB, tasks {result.tasks}"
                )


@contextlib.asynccontextmanager
async def loop_thread_niceness(nice: int) -> AsyncIterator[None]:
    """This thread, the daemon's event loop (and the threads it starts meanwhile), at ``nice``
    for the block, as a unit's ``Nice=`` would set it; processes already started keep theirs,
    as a node's runtime and pods would."""
    if not nice:
        yield
        return
    thread = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, thread)
    os.setpriority(os.PRIO_PROCESS, thread, nice)
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, thread, before)


@contextlib.contextmanager
def cpu_hog() -> Iterator[None]:
    """``stress-ng --cpu 1`` for the block: a busy node, as real nodes are (issue 25)."""
    hog = subprocess.Popen(
        ["stress-ng", "--cpu", "1", "--timeout", "3600"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield
    finally:
        hog.terminate()
        hog.wait(timeout=10)


def report(args: argparse.Namespace, results: list[SizeResult]) -> None:
    print(f"\n## Scale on the fake CRI runtime ({machine()}, {args.loop} event loop)\n")
    modules = "rich too (tests')" if bench._plain_install.rich_loaded() else "a plain install's"
    print(
        f"2 probes per container (httpGet + tcpSocket) at {PERIOD:g} s; relist every 1 s;"
        f" history size {args.history_size};"
        f" the steady fast path {'off (--every-attempt)' if args.every_attempt else 'on'};"
        f"{f' the daemon at nice {args.nice} beside the hog;' if args.nice else ''}"
        f" warm-up {args.warmup:g} s; max RSS of this process"
        f" {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB; modules:"
        f" {modules}\n"
    )
    rows = [
        [
            f"{r.containers} + CPU hog" if r.hog else r.containers,
            fmt(r.seconds, 0), fmt(r.probes_per_s, 0),
            fmt(1000 * r.late_p50, 1), fmt(1000 * r.late_p99, 1), fmt(1000 * r.late_max, 0),
            fmt(r.dropped_pct, 2), f"{r.unsuccessful} ({r.timed_out})", fmt(r.cpu_pct, 1),
            fmt(median([s.loop_cpu_pct for s in r.samples]), 0),
            fmt(median([s.runqueue_pct for s in r.samples]), 0),
            f"{r.rss_baseline:.0f} → {r.rss_start:.0f} → {r.rss_end:.0f}", r.tasks,
            fmt(1000 * r.loop_lag_p99, 1), fmt(r.relist_alone_cpu, 0), fmt(r.relist_alone_wall, 0),
            fmt(1000 * r.relist_p50, 0),
            fmt(1000 * r.relist_p99, 0), fmt(r.fake_cpu_pct, 0), fmt(r.listeners_cpu_pct, 0),
            fmt(r.startup_s, 1), fmt(r.first_probes_s, 1),
            f"{fmt(1000 * r.scrape_p50, 0)} / {fmt(1000 * r.scrape_max, 0)}"
            + (f" ({r.scrapes_failed} failed)" if r.scrapes_failed else ""),
            fmt(r.scrape_bytes / 1e6, 2),
            fmt(max(s.loadavg for s in r.samples), 1),
        ]
        for r in results
    ]  # fmt: skip
    print(
        table(
            [
                "containers", "window s", "probes/s", "late p50 ms", "late p99 ms",
                "late max ms", "ticks dropped %", "unsuccessful (timed out)", "prober CPU %",
                "loop thread CPU %", "loop thread run-queue wait %",
                "RSS MiB (before → start → end)", "asyncio tasks", "loop lag p99 ms",
                "relist alone CPU ms", "relist alone wall ms", "relist p50 ms", "relist p99 ms",
                "fake CRI CPU %", "listeners CPU %",
                "startup s", "every first probe s", "scrape p50 / max ms",
                "scrape MB (gzip)", "max loadavg",
            ],
            rows,
        )
    )  # fmt: skip
    for r in results:
        pauses = ", ".join(
            f"gen {generation}: {count} ({1000 * total / r.seconds:.1f} ms/s, longest "
            f"{1000 * longest:.0f} ms)"
            for generation, (count, total, longest) in sorted(r.collections.items())
        )
        beside = " beside a CPU hog" if r.hog else ""
        print(
            f"\ngarbage collections at {r.containers} containers{beside} during the window: "
            f"{pauses}"
        )
        for when, memory in (
            ("once every worker was there", r.memory_workers),
            ("at the start of the window", r.memory_start),
            ("at the end of the window", r.memory),
            ("after a full collection (gc.collect()) after the window", r.memory_collected),
        ):
            print(f"\nmemory {when} at {r.containers} containers{beside}: {memory}")
        if r.pauses is not None:
            lost = sum(pause.seconds for pause in r.pauses.pauses)
            print(
                f"\nloop pauses over {1000 * r.pauses.threshold:.0f} ms at {r.containers} "
                f"containers{beside}: {len(r.pauses.pauses)}, {lost:.1f} s in all; what ran in "
                "them (the loop thread sampled every 2 ms while late):\n"
            )
            print(table(["place", "ms", "% of pause time"], r.pauses.report()))
            print("\nthe longest:\n")
            print(table(["ms", "collections in it", "sampled most"], r.pauses.longest()))
        for key, traced in r.traced:
            print(
                f"\nlive memory traced from the daemon's start at {r.containers} containers"
                f"{beside}, by {key} (tracemalloc; its own cost is not in it, but is in the RSS):\n"
            )
            print(table(["place", "MiB", "blocks"], traced))
    if args.profile is not None:
        print(f"\nwhere the process's CPU goes in the window (py-spy, in {args.profile}):\n")
        spied = [
            row
            for path in sorted(args.profile.glob("scale-*.txt"))
            for row in spy_rows([path], path.stem.removeprefix("scale-"))
        ]
        print(table(["containers", "function (file)", "self", "on the stack"], spied))
    if len(results) > 1:
        base = results[0]
        print(f"\ngrowth relative to {base.containers} containers:\n")
        rows = [
            [
                f"{r.containers} + CPU hog" if r.hog else r.containers,
                fmt(r.containers / base.containers, 1),
                fmt(r.cpu_pct / base.cpu_pct, 1),
                fmt((r.rss_end - r.rss_baseline) / (base.rss_end - base.rss_baseline), 1),
                fmt(r.tasks / base.tasks, 1),
                fmt((r.rss_end - r.rss_baseline) * 1024 / r.containers, 1),
                fmt(r.cpu_pct / r.probes_per_s * 10 if r.probes_per_s else math.nan, 3),
            ]
            for r in results
        ]  # fmt: skip
        print(
            table(
                ["containers", "x containers", "x CPU", "x RSS (above baseline)", "x tasks",
                 "KiB RSS per container", "CPU ms per probe"],
                rows,
            )
        )  # fmt: skip
    last = results[-1]
    print(f"\nover time at {last.containers} containers (every 5 s):\n")
    print("- CPU %: " + " ".join(fmt(s.cpu_pct, 0) for s in last.samples))
    print("- RSS MiB: " + " ".join(fmt(s.rss, 0) for s in last.samples))
    print("- loop lag max ms: " + " ".join(fmt(1000 * s.loop_lag_max, 0) for s in last.samples))
    print("- loop thread CPU %: " + " ".join(fmt(s.loop_cpu_pct, 0) for s in last.samples))
    print(
        "- loop thread run-queue wait %: " + " ".join(fmt(s.runqueue_pct, 0) for s in last.samples)
    )
    print("- node load average: " + " ".join(fmt(s.loadavg, 1) for s in last.samples))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="500 containers for 30 s")
    parser.add_argument("--sizes")
    parser.add_argument("--seconds", type=float, help="window per size but the last")
    parser.add_argument("--last-seconds", type=float, help="window for the largest size")
    parser.add_argument("--warmup", type=float, default=15.0)
    parser.add_argument(
        "--cpu-hog", action="store_true",
        help="run each size twice, the second beside stress-ng --cpu 1, and print both (the "
        "second runs in the same process: its RSS starts where the first left it)",
    )  # fmt: skip
    parser.add_argument(
        "--scrape-every", type=float, default=15.0,
        help="scrape /metrics (gzip) every S s during the window; 0: no metrics server",
    )  # fmt: skip
    parser.add_argument(
        "--profile", type=Path,
        help="sample this process (the daemon runs in it) with py-spy through each window into "
        "this directory and print where its CPU goes (needs py-spy: pip install py-spy)",
    )  # fmt: skip
    parser.add_argument(
        "--pauses", action="store_true",
        help="sample the loop thread's stack whenever the loop is over 30 ms late, and print "
        "what ran in those pauses (garbage collections timed beside)",
    )  # fmt: skip
    parser.add_argument(
        "--tracemalloc", type=int, default=0, metavar="N",
        help="trace allocations from the daemon's start and print the N places holding the most "
        "at the end of each window, by line and by file (slows the daemon: its lateness and RSS "
        "are not comparable with a run without)",
    )  # fmt: skip
    parser.add_argument(
        "--history-size", type=int, default=DEFAULT_HISTORY_SIZE,
        help="serve's --history-size: attempts kept per probe (the memory an operator can trade)",
    )  # fmt: skip
    parser.add_argument(
        "--nice", type=int, default=0,
        help="with --cpu-hog, the daemon's loop thread at this niceness in the hog's row (e.g. "
        "-5, as a unit's Nice= would set; the hog and the helpers at 0)",
    )  # fmt: skip
    parser.add_argument(
        "--every-attempt", action="store_true",
        help="the lateness observer takes every attempt as it happens, which turns the manager's "
        "steady fast path off (what this benchmark measured before issue 36's run 10; and the "
        "only way to measure code older than AttemptsRepeated's start stamps)",
    )  # fmt: skip
    parser.add_argument(
        "--loop", choices=["uvloop", "asyncio"], default="uvloop",
        help="the event loop the daemon runs on (serve's default: uvloop)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.profile is not None:
        if SPY is None:
            parser.error("--profile needs py-spy (pip install py-spy)")
        args.profile.mkdir(parents=True, exist_ok=True)
    default_sizes = "500" if args.quick else "500,1000,2000,5000"
    args.sizes = [int(x) for x in (args.sizes or default_sizes).split(",")]
    args.seconds = args.seconds or (30.0 if args.quick else 60.0)
    args.last_seconds = args.last_seconds or (30.0 if args.quick else 180.0)
    if args.nice and not args.cpu_hog:
        parser.error("--nice applies to the CPU hog's row: it needs --cpu-hog")
    with asyncio.Runner(loop_factory=loop_factory(args.loop)) as runner:
        runner.run(run(args))


if __name__ == "__main__":
    main()
