"""Exec cost: the CPU the container runtime spends on one exec probe (what shadowing doubles).

    bench/run exec_cost [--quick] [--versions 1.6,2.1] [--containers 20] [--period 1]
                        [--rounds 3] [--seconds 10]

Starts a private containerd (per --versions), moves it into a cgroup of its own before any pod
exists, so every shim it starts and every short-lived ``runc`` it forks are accounted there
too, then creates N host-network pods running ``sleep``. Each round is an idle window (A)
followed by a load window (B) of the same length: B is a raw paced ExecSync loop through the
generated CRI stub, one ``true`` per container per period on a fixed grid (a tick that comes
while the container's previous exec still runs is skipped, as the kubelet's ticker does).

The runtime's CPU comes from cgroup counters (v1 ``cpuacct.usage`` or v2 ``cpu.stat``
``usage_usec``): the containerd cgroup (containerd + shims + runc and its children), split into
containerd's own process (/proc/PID/stat) and the rest; plus the app containers' cgroups, where
the exec'd process runs (``runc exec`` joins its ``runc init`` to the container's cgroups before
it execs the command, so that column is runc init's last part plus the command). Each B window's
CPU minus the A window's rate over B's length, divided by the execs B ran, is the cost per exec.
Without cgroup counters only the node-wide figure (/proc/stat busy time minus this process's own
CPU, B minus A) is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench._common import (
    CLK_TCK,
    containerd,
    fmt,
    load_average,
    machine,
    median,
    node_jiffies,
    proc_cpu_seconds,
    quiet_logs,
    say,
    table,
    tables_first,
)
from cri_prober._gen.runtime.v1 import api_pb2, api_pb2_grpc
from tests.support.testbed import ContainerSpec, Testbed

NAMESPACE = "bench"
# (exec probes, period in seconds) whose cost the report spells out: the 30 pods at 1 s,
# and the same pods at a more typical 10 s.
SCENARIOS: tuple[tuple[int, float], ...] = ((30, 1.0), (30, 10.0), (100, 10.0))


# -- cgroup CPU counters --------------------------------------------------------------------------


@dataclass(frozen=True)
class Hierarchy:
    """One cgroup hierarchy that counts CPU time: v2, or v1 with the cpuacct controller."""

    root: Path
    v2: bool

    @classmethod
    def detect(cls) -> Hierarchy | None:
        """The hierarchy to read: pure v2, else v1 cpuacct, else a hybrid's unified v2 mount."""
        unified: Path | None = None
        cpuacct: Path | None = None
        for line in Path("/proc/self/mounts").read_text().splitlines():
            _, mountpoint, fstype, options, *_ = line.split()
            if fstype == "cgroup2" and unified is None:
                unified = Path(mountpoint)
            elif fstype == "cgroup" and "cpuacct" in options.split(","):
                cpuacct = Path(mountpoint)
        if unified is not None and (unified / "cgroup.controllers").exists() and cpuacct is None:
            return cls(unified, v2=True)
        if cpuacct is not None:
            return cls(cpuacct, v2=False)
        if unified is not None and (unified / "cpu.stat").exists():
            return cls(unified, v2=True)
        return None

    @property
    def name(self) -> str:
        return (
            f"cgroup v2 cpu.stat at {self.root}" if self.v2 else f"cgroup v1 cpuacct at {self.root}"
        )

    def of_pid(self, pid: int) -> Path:
        """The cgroup directory ``pid`` is in, in this hierarchy."""
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            number, controllers, path = line.split(":", 2)
            if (self.v2 and number == "0") or (not self.v2 and "cpuacct" in controllers.split(",")):
                return self.root / path.lstrip("/")
        raise RuntimeError(f"process {pid} is in no cgroup of {self.name}")

    def usage(self, cgroup: Path) -> float:
        """CPU seconds of every process that ran in ``cgroup`` and below, ever."""
        if self.v2:
            for line in (cgroup / "cpu.stat").read_text().splitlines():
                key, value = line.split()
                if key == "usage_usec":
                    return int(value) / 1e6
            raise RuntimeError(f"{cgroup}/cpu.stat has no usage_usec")
        return int((cgroup / "cpuacct.usage").read_text()) / 1e9

    def processes(self, cgroup: Path) -> Counter[str]:
        """Command names of the processes in ``cgroup`` (not below it), counted."""
        names: Counter[str] = Counter()
        for pid in (cgroup / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                names[Path(f"/proc/{pid}/comm").read_text().strip()] += 1
        return names


@contextlib.contextmanager
def own_cgroup(hierarchy: Hierarchy, pid: int) -> Iterator[Path]:
    """Move process ``pid`` into a new child of its cgroup; removed afterwards.

    Processes it forks from then on (shims, runc) start there too. The cgroup is only removed
    once empty: after the testbed's teardown; anything left is moved back to the parent first.
    """
    parent = hierarchy.of_pid(pid)
    cgroup = parent / f"cprb-exec-cost-{os.getpid()}"
    cgroup.mkdir()
    try:
        (cgroup / "cgroup.procs").write_text(str(pid))
        yield cgroup
    finally:
        for _ in range(50):
            left = (cgroup / "cgroup.procs").read_text().split()
            for other in left:
                with contextlib.suppress(OSError):
                    (parent / "cgroup.procs").write_text(other)
            try:
                cgroup.rmdir()
                break
            except OSError:
                time.sleep(0.1)


# -- one window -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reading:
    """Cumulative counters at one moment."""

    wall: float
    containerd: float  # containerd's own process, CPU seconds
    runtime: float  # containerd's cgroup: containerd, shims, runc and its children
    containers: float  # the app containers' cgroups: the exec'd processes
    client: float  # this process (the ExecSync loop)
    node_busy: float  # all CPUs, busy seconds

    def __sub__(self, other: Reading) -> Reading:
        return Reading(
            self.wall - other.wall,
            self.containerd - other.containerd,
            self.runtime - other.runtime,
            self.containers - other.containers,
            self.client - other.client,
            self.node_busy - other.node_busy,
        )


@dataclass
class Meter:
    """Takes Readings of one testbed."""

    hierarchy: Hierarchy | None
    containerd_pid: int
    runtime_cgroup: Path | None
    container_cgroups: Sequence[Path]

    def read(self) -> Reading:
        busy, _ = node_jiffies()
        cgroups = self.hierarchy
        return Reading(
            wall=time.monotonic(),
            containerd=proc_cpu_seconds(self.containerd_pid),
            runtime=(
                cgroups.usage(self.runtime_cgroup)
                if cgroups is not None and self.runtime_cgroup is not None
                else math.nan
            ),
            containers=(
                sum(cgroups.usage(c) for c in self.container_cgroups)
                if cgroups is not None
                else math.nan
            ),
            client=time.process_time(),
            node_busy=busy / CLK_TCK,
        )


@dataclass(frozen=True)
class Round:
    """One idle window and one load window, and the cost per exec they give."""

    execs: int
    errors: int
    skipped: int  # ticks skipped because the container's previous exec was still running
    idle: Reading
    load: Reading

    def extra(self, field: str) -> float:
        """Seconds of ``field`` the load window spent above the idle window's rate."""
        load: float = getattr(self.load, field)
        idle: float = getattr(self.idle, field)
        return load - idle * (self.load.wall / self.idle.wall)

    def per_exec_ms(self, field: str) -> float:
        return 1000 * self.extra(field) / self.execs if self.execs else math.nan

    @property
    def rate(self) -> float:
        return self.execs / self.load.wall

    @property
    def containerd_ms(self) -> float:
        return self.per_exec_ms("containerd")

    @property
    def shims_ms(self) -> float:
        return self.per_exec_ms("runtime") - self.containerd_ms

    @property
    def exec_ms(self) -> float:
        return self.per_exec_ms("containers")

    @property
    def total_ms(self) -> float:
        return self.per_exec_ms("runtime") + self.exec_ms

    @property
    def client_ms(self) -> float:
        return self.per_exec_ms("client")

    @property
    def node_ms(self) -> float:
        """Node-wide busy time above idle, less this process's own, per exec (cross-check)."""
        return self.per_exec_ms("node_busy") - self.client_ms


async def paced_execs(
    stub: api_pb2_grpc.RuntimeServiceAsyncStub, ids: Sequence[str], period: float, seconds: float
) -> tuple[int, int, int]:
    """ExecSync ``true`` once per period in each container, ticks spread over the period.

    Returns (execs that succeeded, errors, ticks skipped); returns when the last call ends.
    """
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05
    end = start + seconds
    done = errors = skipped = 0

    async def one(index: int, container_id: str) -> None:
        nonlocal done, errors, skipped
        request = api_pb2.ExecSyncRequest(container_id=container_id, cmd=["true"], timeout=5)
        tick = start + period * index / len(ids)
        while tick < end:
            await asyncio.sleep(max(0.0, tick - loop.time()))
            try:
                await stub.ExecSync(request, timeout=10)
                done += 1
            except grpc.aio.AioRpcError:
                errors += 1
            tick += period
            while tick < loop.time():  # the call outlasted a period: that tick is gone
                tick += period
                skipped += 1

    await asyncio.gather(*(one(i, c) for i, c in enumerate(ids)))
    return done, errors, skipped


# -- one containerd -------------------------------------------------------------------------------


async def container_pid(stub: api_pb2_grpc.RuntimeServiceAsyncStub, container_id: str) -> int:
    """The container's init process, from ContainerStatus's verbose info."""
    response = await stub.ContainerStatus(
        api_pb2.ContainerStatusRequest(container_id=container_id, verbose=True), timeout=10
    )
    return int(json.loads(response.info["info"])["pid"])


@dataclass
class VersionResult:
    version: str
    containerd_version: str
    rounds: list[Round]
    in_cgroup: Counter[str]  # processes in containerd's cgroup during the last load window
    hierarchy: str


async def measure(version: str, args: argparse.Namespace) -> VersionResult:
    hierarchy = Hierarchy.detect()
    async with containerd(version) as testbed:
        with (
            own_cgroup(hierarchy, testbed.pid)
            if hierarchy is not None
            else contextlib.nullcontext()
        ) as runtime_cgroup:
            return await _measure(testbed, hierarchy, runtime_cgroup, version, args)


async def _measure(
    testbed: Testbed,
    hierarchy: Hierarchy | None,
    runtime_cgroup: Path | None,
    version: str,
    args: argparse.Namespace,
) -> VersionResult:
    async with testbed.pods() as pods:
        say(f"creating {args.containers} pods")
        ids: list[str] = []
        for i in range(args.containers):
            pod = await pods.create_pod(
                f"exec-cost-{i:02d}",
                namespace=NAMESPACE,
                containers=[ContainerSpec("app", command=["sleep", "3600"])],
            )
            ids.append(pod.container_ids["app"])
        stub = pods.runtime
        container_cgroups: list[Path] = []
        if hierarchy is not None and runtime_cgroup is not None:
            for container_id in ids:
                cgroup = hierarchy.of_pid(await container_pid(stub, container_id))
                if cgroup.is_relative_to(runtime_cgroup):
                    raise RuntimeError(f"{cgroup} is inside {runtime_cgroup}: counted twice")
                container_cgroups.append(cgroup)
        meter = Meter(hierarchy, testbed.pid, runtime_cgroup, container_cgroups)
        say("warm-up")
        await paced_execs(stub, ids, args.period, 2.0)
        rounds: list[Round] = []
        in_cgroup: Counter[str] = Counter()
        for number in range(args.rounds):
            say(f"containerd {version} round {number + 1}: idle {args.seconds:g} s")
            before = meter.read()
            await asyncio.sleep(args.seconds)
            idle = meter.read() - before
            say(f"containerd {version} round {number + 1}: load {args.seconds:g} s")
            before = meter.read()
            load_task = asyncio.create_task(paced_execs(stub, ids, args.period, args.seconds))
            await asyncio.sleep(args.seconds / 2)
            if runtime_cgroup is not None and hierarchy is not None:
                in_cgroup = hierarchy.processes(runtime_cgroup)
            execs, errors, skipped = await load_task
            load = meter.read() - before
            rounds.append(Round(execs, errors, skipped, idle, load))
            r = rounds[-1]
            say(
                f"  {r.rate:.1f} exec/s, runtime {fmt(r.total_ms)} ms/exec"
                f" (containerd {fmt(r.containerd_ms)}, shims+runc {fmt(r.shims_ms)},"
                f" exec'd {fmt(r.exec_ms)}), node-wide {fmt(r.node_ms)}"
            )
        return VersionResult(
            version,
            testbed.containerd_version,
            rounds,
            in_cgroup,
            hierarchy.name if hierarchy is not None else "none (node-wide only)",
        )


# -- report ---------------------------------------------------------------------------------------


def spread(values: Sequence[float]) -> str:
    """min-max of the finite values."""
    finite = [v for v in values if not math.isnan(v)]
    return f"{fmt(min(finite))}-{fmt(max(finite))}" if finite else "-"


def report(
    results: Sequence[VersionResult], args: argparse.Namespace, loads: Sequence[str]
) -> None:
    print(f"\n## Exec cost ({machine()})\n")
    print(
        f"{args.containers} containers, exec `true` in each every {args.period:g} s"
        f" (raw paced ExecSync loop); {args.rounds} rounds of idle {args.seconds:g} s +"
        f" load {args.seconds:g} s per containerd; load average before / after:"
        f" {loads[0]} | {loads[1]}\n"
    )
    for result in results:
        print(
            f"### containerd {result.version} ({result.containerd_version});"
            f" counters: {result.hierarchy}\n"
        )
        if result.in_cgroup:
            members = ", ".join(f"{name} x{n}" for name, n in sorted(result.in_cgroup.items()))
            print(f"containerd's cgroup mid-load: {members}\n")
        rows = []
        for number, r in enumerate(result.rounds, 1):
            rows.append([
                number, r.execs, r.errors, r.skipped, fmt(r.rate, 1), fmt(r.containerd_ms),
                fmt(r.shims_ms), fmt(r.exec_ms), fmt(r.total_ms), fmt(r.node_ms),
                fmt(r.client_ms),
            ])  # fmt: skip
        rs = result.rounds
        rows.append([
            "median", "", sum(r.errors for r in rs), sum(r.skipped for r in rs),
            fmt(median([r.rate for r in rs]), 1), fmt(median([r.containerd_ms for r in rs])),
            fmt(median([r.shims_ms for r in rs])), fmt(median([r.exec_ms for r in rs])),
            fmt(median([r.total_ms for r in rs])), fmt(median([r.node_ms for r in rs])),
            fmt(median([r.client_ms for r in rs])),
        ])  # fmt: skip
        print(table(
            ["round", "execs", "errors", "ticks skipped", "exec/s", "containerd ms/exec",
             "shims+runc ms/exec", "in the container ms/exec", "runtime total ms/exec",
             "node-wide ms/exec (noisy cross-check)", "client ms/exec"],
            rows,
        ))  # fmt: skip
        totals = [r.total_ms for r in rs]
        if all(math.isnan(t) for t in totals):
            totals = [r.node_ms for r in rs]
        cost = median(totals)
        print(
            f"\nruntime CPU per exec: median {fmt(cost)} ms (rounds {spread(totals)});"
            f" stdev {fmt(statistics.stdev(totals)) if len(totals) > 1 else '-'} ms\n"
        )
        rows = [
            [
                n, f"{period:g} s", fmt(n / period, 1), fmt(cost * n / period / 10, 1),
                fmt(2 * cost * n / period / 10, 1),
            ]
            for n, period in SCENARIOS
        ]  # fmt: skip
        print(table(
            ["exec probes", "period", "exec/s (one prober)", "% of one core: the kubelet alone",
             "kubelet + cri-prober shadowing them"],
            rows,
        ))  # fmt: skip
        print()


async def run(args: argparse.Namespace) -> None:
    quiet_logs()
    before = load_average()
    results: list[VersionResult] = []
    # The tables of what was measured come first, even when a stop (a containerd's) or a later
    # version fails: that failure follows them (issue 35).
    with tables_first(lambda: report(results, args, [before, load_average()])):
        for version in args.versions:
            results.append(await measure(version, args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="containerd 1.6, one short round")
    parser.add_argument("--versions", default=None, help="comma-separated (default 1.6,2.1)")
    parser.add_argument("--containers", type=int, default=20)
    parser.add_argument("--period", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=None, help="each window's length")
    args = parser.parse_args()
    if args.quick:
        args.versions = args.versions or "1.6"
        args.rounds = args.rounds or 1
        args.seconds = args.seconds or 5.0
    args.versions = (args.versions or "1.6,2.1").split(",")
    args.rounds = args.rounds or 3
    args.seconds = args.seconds or 10.0
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
