"""Shared benchmark plumbing: testbeds, child processes, CPU/RSS readings, statistics, tables."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from cri_prober import malloc
from cri_prober.manager.events import AttemptFinished, ManagerEvent, ResultChanged
from cri_prober.probing.kinds import ProbeKind
from cri_prober.runtime.model import CriCall
from tests.support.testbed import Testbed

CLK_TCK = os.sysconf("SC_CLK_TCK")


def quiet_logs() -> None:
    """Keep cri-prober's info logs (one line per transition) out of the benchmark's output."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def say(message: str) -> None:
    """Progress on stderr (the table goes to stdout)."""
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {message}\n")
    sys.stderr.flush()


@contextlib.contextmanager
def tables_first(report: Callable[[], None]) -> Iterator[None]:
    """Print the tables of what was measured however the block ends (issue 35).

    A run that fails after some windows (a daemon's stop timing out after the last one, a
    testbed's teardown, a later window) still prints the figures it has, then says on stderr
    that it failed and re-raises, so the exit is non-zero and the traceback follows the tables.
    ``report`` prints from what the block has recorded so far and must cope with a partial run.
    """
    try:
        yield
    except BaseException as failure:
        try:
            report()
        except Exception as unreported:  # the failure that ended the run is the one to raise
            print(f"\n(the tables could not be printed: {unreported!r})", file=sys.stderr)
        sys.stdout.flush()
        print(
            f"\nthe run failed after what it measured: {type(failure).__name__}: {failure}",
            file=sys.stderr,
        )
        raise
    report()


# -- statistics -----------------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def fmt(value: float, digits: int = 2) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return f"{value:.{digits}f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown pipe table."""
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in cells
    ]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)


def machine() -> str:
    """One line describing this machine, for the report."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return (
        f"{os.cpu_count()} CPUs ({model}), {platform.system()} {platform.release()},"
        f" Python {platform.python_version()}"
    )


# -- schedule lateness ----------------------------------------------------------------------------


@dataclass
class Lateness:
    """Lateness of a worker's probe starts against its own tick grid (see docs/benchmarks.md)."""

    late: list[float] = field(default_factory=list)  # seconds, each in [0, period)
    ticks: int = 0  # grid ticks covered after each worker's first probe
    dropped: int = 0  # ticks that got no probe (the worker was still busy with an earlier one)

    def add(
        self,
        starts: Sequence[float],
        period: float,
        window: tuple[float, float] = (-math.inf, math.inf),
    ) -> None:
        """Add one worker's consecutive probe start times; count those within ``window``.

        The worker's first start anchors its grid (the worker starts its ticker right before its
        first probe), so every later start is measured against ``first + k * period``.
        """
        if len(starts) < 2:
            return
        anchor = starts[0]
        previous = 0
        for start in starts[1:]:
            k = math.floor((start - anchor) / period + 1e-9)
            if window[0] <= start < window[1]:
                self.late.append(start - (anchor + k * period))
                self.dropped += max(0, k - previous - 1)
                self.ticks += k - previous
            previous = k

    @property
    def dropped_fraction(self) -> float:
        return self.dropped / self.ticks if self.ticks else math.nan


def due_times(starts: Sequence[float], period: float) -> list[float]:
    """The grid tick each start served (the latest tick at or before it)."""
    if not starts:
        return []
    anchor = starts[0]
    return [anchor + math.floor((s - anchor) / period + 1e-9) * period for s in starts]


# -- observing the manager ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Attempt:
    """One finished probe attempt as the benchmark saw it."""

    worker: str
    kind: ProbeKind
    container_id: str
    started_at: float  # wall clock (the worker's record)
    duration: float
    result: str
    dispatched_at: float | None  # wall clock when the ExecSync call left (exec only)
    finished_at: float  # wall clock when the collector heard of it


class Collector:
    """A listener on a manager's events recording every attempt and transition.

    Subscribe it to ``manager.events`` (``running_daemon(..., listeners=[collector])`` does so
    before the daemon starts), and to ``daemon.cri.calls`` for ``Attempt.dispatched_at``.
    """

    def __init__(self) -> None:
        self.attempts: list[Attempt] = []
        self.transitions: list[tuple[float, ResultChanged]] = []
        # Task name -> wall time its last ExecSync was dispatched (see ``cri_call``).
        self.dispatch: dict[str, float] = {}
        self.on_transition: Callable[[float, ResultChanged], None] | None = None

    def __call__(self, event: ManagerEvent) -> None:
        if isinstance(event, AttemptFinished):
            self._attempt(event)
        elif isinstance(event, ResultChanged):
            now = time.time()
            self.transitions.append((now, event))
            if self.on_transition is not None:
                self.on_transition(now, event)

    def _attempt(self, event: AttemptFinished) -> None:
        task = asyncio.current_task()
        dispatched = self.dispatch.pop(task.get_name(), None) if task is not None else None
        c, record = event.container, event.record
        self.attempts.append(
            Attempt(
                worker=f"{c.pod.namespace}/{c.pod.name}/{c.name}:{event.kind.value}",
                kind=event.kind,
                container_id=record.container_id,
                started_at=record.started_at,
                duration=record.duration,
                result=record.result,
                dispatched_at=dispatched,
                finished_at=time.time(),
            )
        )

    def cri_call(self, call: CriCall) -> None:
        """Record when each worker's ExecSync actually left for the runtime.

        The worker stamps ``started_at`` before the exec waits for one of the client's exec
        slots, so the record alone hides queueing. The client times each call from the moment
        it holds the slot and publishes it on ``cri.calls`` in the calling (worker's) task, so
        its start, keyed by that task, is the dispatch time the attempt (finished later in the
        same task) picks up.
        """
        if call.method == "ExecSync":
            task = asyncio.current_task()
            if task is not None:
                self.dispatch[task.get_name()] = time.time() - call.seconds

    def clear(self) -> None:
        self.attempts.clear()
        self.transitions.clear()
        self.dispatch.clear()

    def by_worker(self, start: float, end: float) -> dict[str, list[Attempt]]:
        """Attempts that started within [start, end), per worker, in start order."""
        out: dict[str, list[Attempt]] = defaultdict(list)
        for attempt in sorted(self.attempts, key=lambda a: a.started_at):
            if start <= attempt.started_at < end:
                out[attempt.worker].append(attempt)
        return out


# -- the daemon in-process ----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def rules_file(rules_yaml: str) -> AsyncIterator[Path]:
    """The rules in a file of a private temp dir, removed afterwards; for the shared
    ``tests.support.daemon.running_daemon``, which puts the daemon's local API socket beside it.

    Async only so that one ``async with`` can hold both:
    ``async with rules_file(RULES) as rules, running_daemon(target, rules, ...) as (d, w):``.
    """
    with tempfile.TemporaryDirectory(prefix="cprb-bench-api-") as directory:
        path = Path(directory) / "rules.yaml"
        await asyncio.to_thread(path.write_text, rules_yaml, encoding="utf-8")
        yield path


# -- containerd testbeds --------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def containerd(version: str = "1.6") -> AsyncIterator[Testbed]:
    """A private containerd in a temp dir, always torn down (pods, shims, mounts, bridge, dir)."""
    base = Path(tempfile.mkdtemp(prefix=f"cprb-bench-{version}-"))
    directory = base / "tb"
    say(f"starting containerd {version} in {directory}")
    try:
        testbed = await asyncio.to_thread(Testbed.start, directory, version=version)
    except BaseException:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(Testbed.stop_dir, directory)
        shutil.rmtree(base, ignore_errors=True)
        raise
    try:
        yield testbed
    finally:
        say(f"stopping containerd {version}")
        try:
            await asyncio.to_thread(testbed.stop)
        finally:
            shutil.rmtree(base, ignore_errors=True)


# -- child processes ------------------------------------------------------------------------------


class Child:
    """A benchmark helper process that prints one JSON line when ready; stopped by its PID."""

    def __init__(self, args: Sequence[str], *, ready_timeout: float = 60.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + ready_timeout
        line = ""
        while not line and time.monotonic() < deadline and self.proc.poll() is None:
            line = self.proc.stdout.readline()
        if not line:
            self.stop()
            raise RuntimeError(f"{' '.join(args)} did not start (exit {self.proc.poll()})")
        self.info: dict[str, object] = json.loads(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def listeners(*, http: int = 1, tcp: int = 1, grpc: int = 1) -> Child:
    """Start bench.listeners in its own process."""
    return Child(
        ["-m", "bench.listeners", "--http", str(http), "--tcp", str(tcp), "--grpc", str(grpc)]
    )


def ports(child: Child, kind: str) -> list[int]:
    value = child.info[kind]
    assert isinstance(value, list)
    return [int(p) for p in value]


# -- CPU and memory -------------------------------------------------------------------------------


def node_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat (busy excludes idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
    idle = fields[3] + fields[4]
    return total - idle, total


def proc_cpu_seconds(pid: int | str = "self") -> float:
    """utime + stime of a process (all its threads), in seconds."""
    text = Path(f"/proc/{pid}/stat").read_text()
    rest = text[text.rindex(")") + 2 :].split()
    return (int(rest[11]) + int(rest[12])) / CLK_TCK


def rss_mib(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def memory_breakdown() -> dict[str, float]:
    """Where this process's RSS is, in MiB: pymalloc's arenas (and how much of them is in live
    blocks, free blocks, unused pools), glibc's heaps (in use, free) and its mmapped blocks.

    pymalloc's figures come from ``sys._debugmallocstats`` (written to fd 2, read back from a
    temporary file), glibc's from ``mallinfo2`` (glibc 2.33 and later; NaN elsewhere)."""
    out = {"rss": rss_mib()}
    with tempfile.TemporaryFile() as capture:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(capture.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        capture.seek(0)
        text = capture.read().decode(errors="replace")

    def figure(pattern: str) -> float:
        found = re.search(pattern + r"\s*=\s*([0-9,]+)", text)
        return int(found.group(1).replace(",", "")) / 2**20 if found else math.nan

    out["pymalloc_arenas"] = figure(r"arenas \* \d+ bytes/arena")
    out["pymalloc_used"] = figure(r"# bytes in allocated blocks")
    out["pymalloc_free_blocks"] = figure(r"# bytes in available blocks")
    out["pymalloc_unused_pools"] = figure(r"unused pools \* \d+ bytes")
    heap = malloc.heap_stats()
    if heap is None:
        return out | {"malloc_used": math.nan, "malloc_free": math.nan, "mmapped": math.nan}
    out["malloc_used"] = heap.in_use / 2**20
    out["malloc_free"] = heap.free / 2**20
    out["mmapped"] = heap.mapped / 2**20
    return out


def describe_memory(memory: dict[str, float]) -> str:
    """``memory_breakdown()`` in one line. (pymalloc maps its arenas itself: they are not among
    malloc's mmapped blocks. The heaps' free part may be partly given back to the system.)"""
    rest = memory["rss"] - memory["pymalloc_arenas"] - memory["malloc_used"]
    rest -= memory["malloc_free"] + memory["mmapped"]
    return (
        f"RSS {memory['rss']:.0f} MiB: pymalloc arenas {memory['pymalloc_arenas']:.0f} "
        f"(live blocks {memory['pymalloc_used']:.0f}, free blocks "
        f"{memory['pymalloc_free_blocks']:.0f}, unused pools "
        f"{memory['pymalloc_unused_pools']:.0f}); malloc heaps in use "
        f"{memory['malloc_used']:.0f}, free {memory['malloc_free']:.0f}; malloc's mmapped blocks "
        f"{memory['mmapped']:.0f}; the rest (code, libraries, stacks) {rest:.0f}"
    )


@contextlib.contextmanager
def cpu_meter() -> Iterator[dict[str, float]]:
    """Measure this process's CPU seconds and wall seconds across a block."""
    out: dict[str, float] = {}
    cpu0, wall0 = time.process_time(), time.monotonic()
    try:
        yield out
    finally:
        out["cpu"] = time.process_time() - cpu0
        out["wall"] = time.monotonic() - wall0


def thread_cpu_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """utime + stime of each live thread of a process: thread ID -> (thread name, seconds).

    Threads that ended are missing (their CPU stays in the process total of proc_cpu_seconds).
    """
    out: dict[int, tuple[str, float]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            text = (task / "stat").read_text()
            name = text[text.index("(") + 1 : text.rindex(")")]
            rest = text[text.rindex(")") + 2 :].split()
            out[int(task.name)] = (name, (int(rest[11]) + int(rest[12])) / CLK_TCK)
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a child process to bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, for the report."""
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


# -- py-spy (not a dependency: the benchmarks that take --profile say how to get it) -----------


def py_spy() -> str | None:
    """The py-spy executable: on PATH, or beside this interpreter (a virtualenv's bin)."""
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return found if Path(found).exists() else None


async def start_py_spy(
    executable: str, pid: int, seconds: float, out: Path
) -> asyncio.subprocess.Process:
    """Sample ``pid`` (all its threads, idle ones left out) at 200 Hz for ``seconds`` into
    ``out``, in py-spy's raw format (collapsed stacks and counts); await ``wait()`` for it."""
    return await asyncio.create_subprocess_exec(
        executable, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))),
        "--rate", "200", "--format", "raw", "--nonblocking", "--output", str(out),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip


def spy_rows(paths: Sequence[Path], label: str, top: int = 14) -> list[list[str]]:
    """py-spy raw files as table rows: the functions most often at the top of the stack
    (``self``), with how often each was on it at all (``on the stack``), in % of samples."""
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for path in paths:
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = [re.sub(r":\d+\)$", ")", frame) for frame in stack.split(";")]
            total += int(count)
            for frame in set(frames):
                inclusive[frame] = inclusive.get(frame, 0) + int(count)
            own[frames[-1]] = own.get(frames[-1], 0) + int(count)
    return [
        [label, name, f"{100 * n / total:.1f} %", f"{100 * inclusive[name] / total:.1f} %"]
        for name, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]
    ]
