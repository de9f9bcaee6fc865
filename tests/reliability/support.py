"""Shared helpers for the reliability tests: an API client, probed containers and their workers,
resource samples, processes.

The in-process daemon itself is ``tests.support.daemon.running_daemon``, shared with the rest of
the suite and the benchmarks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import statistics
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from cri_prober._gen.criprober.v1 import query_pb2_grpc
from cri_prober.daemon import Daemon
from cri_prober.discovery.model import ContainerInfo
from cri_prober.manager.state import ProbedContainer
from cri_prober.probing.kinds import ProbeKind
from cri_prober.serving.address import parse_listen
from cri_prober.serving.transitions import TransitionLog
from tests.support.watchers import ManagerWatcher

# The manager watcher the reliability tests await (shared with the rest of the suite).
Watcher = ManagerWatcher


@dataclass
class Api:
    """A client of a running daemon's own API (``serve --listen``)."""

    channel: grpc.aio.Channel
    transitions: TransitionLog  # the API server's transition log

    @property
    def query(self) -> query_pb2_grpc.CriProberAsyncStub:
        return query_pb2_grpc.CriProberStub(self.channel)

    @property
    def health(self) -> Any:  # grpc_health ships no type information
        return health_pb2_grpc.HealthStub(self.channel)


@contextlib.asynccontextmanager
async def api_client(daemon: Daemon) -> AsyncIterator[Api]:
    """Open a channel to the API ``daemon`` serves at its ``--listen`` address."""
    assert daemon.api is not None, "the daemon serves no API"
    channel = grpc.aio.insecure_channel(parse_listen(daemon.config.listen).grpc_address)
    try:
        yield Api(channel, daemon.api.transitions)
    finally:
        await channel.close()


def probed_with_prefix(daemon: Daemon, prefix: str) -> list[ProbedContainer]:
    """The manager's probed containers whose pod name starts with ``prefix`` (a snapshot)."""
    return [p for p in daemon.manager.probed() if p.container.pod.name.startswith(prefix)]


def probed_by_pod(daemon: Daemon, prefix: str) -> dict[str, ProbedContainer]:
    """The probed containers whose pod name starts with ``prefix``, by pod name (one container
    per pod; a snapshot, so call again for fresh values)."""
    return {p.container.pod.name: p for p in probed_with_prefix(daemon, prefix)}


WorkerKey = tuple[str, ProbeKind]  # (namespace/pod/container, probe kind)


def label_of(container: ContainerInfo) -> str:
    """``namespace/pod/container``, as ``ProbedContainer.label`` names it."""
    return f"{container.pod.namespace}/{container.pod.name}/{container.name}"


@dataclass(frozen=True)
class Workers:
    """The running workers of some containers, as the manager's public surface shows them.

    The manager hands out no worker objects, so "the very same workers go on" is told from what
    it does show: the same probes have a running worker, no count of attempts went back (a new
    worker starts at 0, a kept one keeps counting), and none of those workers stopped since (a
    replaced or ended worker reports ``WorkerStopped``).
    """

    containers: frozenset[str]  # the labels of the probed containers
    attempts: dict[WorkerKey, int]  # attempts of each running worker
    stopped: int  # how many WorkerStopped events the watcher had seen

    @classmethod
    def of(cls, probed: Iterable[ProbedContainer], watcher: ManagerWatcher) -> Workers:
        probed = list(probed)
        return cls(
            frozenset(p.label for p in probed),
            {(p.label, s.kind): s.attempts for p in probed for s in p.probes if s.active},
            len(watcher.stopped),
        )

    def assert_kept(self, probed: Iterable[ProbedContainer], watcher: ManagerWatcher) -> None:
        """No worker of these was replaced, added or dropped since this snapshot."""
        now = Workers.of(probed, watcher)
        assert now.containers == self.containers
        assert now.attempts.keys() == self.attempts.keys()
        went_back = {
            k: (n, now.attempts[k]) for k, n in self.attempts.items() if now.attempts[k] < n
        }
        assert not went_back, went_back
        stopped = [
            e
            for e in watcher.stopped[self.stopped :]
            if (label_of(e.container), e.kind) in self.attempts
        ]
        assert not stopped, stopped


# -- resources ------------------------------------------------------------------------------------


def open_fds() -> int:
    """File descriptors this process has open right now."""
    return len(os.listdir("/proc/self/fd"))


def task_count() -> int:
    """asyncio tasks alive on the running loop."""
    return len(asyncio.all_tasks())


def probe_task_names() -> list[str]:
    """Names of the running probe worker tasks (the manager names them ``probe:...``)."""
    return sorted(t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("probe:"))


def rss_bytes() -> int:
    """Resident set size of this process."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Sample:
    """Resource counts seen at several moments: their minimum and median."""

    fds_min: int
    fds_median: float
    tasks_min: int
    tasks_median: float


async def sample_resources(watcher: Watcher, events: int = 60) -> Sample:
    """Count fds and tasks at each of the next ``events`` observer events (probes finishing).

    Probes open sockets and gRPC calls run as tasks for a moment, so one reading is noisy; the
    minimum and median over many are what a leak would move.
    """
    fds: list[int] = []
    tasks: list[int] = []
    for _ in range(events):
        await watcher.events(1)
        fds.append(open_fds())
        tasks.append(task_count())
    return Sample(min(fds), statistics.median(fds), min(tasks), statistics.median(tasks))


# -- lateness on a busy machine --------------------------------------------------------------------

# A gap between a canary's probes longer than its bound is cri-prober's doing when cri-prober was
# on the CPU for at least this share of it (a loop kept busy uses all of it); below that, the
# machine kept it off the CPU (other processes, stress-ng beside the suite), which says nothing
# about cri-prober.
BUSY_SHARE = 0.75
# The longest stretch of CPU work a loop may do between two turns of a 50 ms timer: parsing a
# large file, building a huge string or backtracking a regex on the loop takes seconds of it, a
# turn of the daemon milliseconds.
STALL_BOUND = 0.5


@dataclass(frozen=True)
class CpuStamp:
    """A moment (``time.monotonic()``) and the CPU seconds a process had used by then."""

    at: float
    cpu: float


def cpu_stamp() -> CpuStamp:
    """Now, and the CPU seconds this process has used (all its threads)."""
    return CpuStamp(time.monotonic(), time.process_time())


def busy_overlong_gaps(
    stamps: Sequence[CpuStamp], bound: float, cpu_at: Callable[[float], float] | None = None
) -> list[tuple[float, float]]:
    """(gap, CPU used in it) for each gap between consecutive ``stamps`` longer than ``bound``
    during which the process was busy itself (`BUSY_SHARE`): what a test asserts is empty, where
    it once asserted that no gap is longer than ``bound``. ``cpu_at`` gives the CPU seconds at a
    moment when the stamps' own are not the process's (e.g. sampled from another process)."""
    found = []
    for a, b in itertools.pairwise(stamps):
        gap = b.at - a.at
        if gap <= bound:
            continue
        cpu = (cpu_at(b.at) - cpu_at(a.at)) if cpu_at is not None else b.cpu - a.cpu
        if cpu >= BUSY_SHARE * gap:
            found.append((round(gap, 2), round(cpu, 2)))
    return found


class LoopStalls:
    """``async with LoopStalls() as stalls``: ``stalls.longest`` is the most CPU the loop's
    thread used across one 50 ms sleep of the loop while it lasted: work that held the loop.
    Time the machine gave other processes is not in it, as it is in wall-clock lateness, nor
    work in other threads (a reload's parse, which the loop goes on beside)."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _measure(self) -> None:
        while True:
            before = time.thread_time()
            await asyncio.sleep(0.05)
            self.longest = max(self.longest, time.thread_time() - before)

    async def __aenter__(self) -> LoopStalls:
        self._task = asyncio.create_task(self._measure(), name="LoopStalls")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def percentile(values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile (``fraction`` 0.99 for p99) of ``values``."""
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


# -- processes ------------------------------------------------------------------------------------


async def wait_for_exit(pid: int, timeout: float) -> None:
    """Wait until process ``pid`` (not necessarily our child) has exited, through a pidfd."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(fd, readable)
    try:
        async with asyncio.timeout(timeout):
            await exited
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def processes_in_session(session_id: int) -> list[tuple[int, str]]:
    """(pid, command name) of every live process in session ``session_id``."""
    found: list[tuple[int, str]] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat_file:
                stat = stat_file.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        # fields[0] is the state, fields[3] the session ID (stat fields 3 and 6).
        if fields[0] != "Z" and int(fields[3]) == session_id:
            found.append((int(entry), name))
    return found
