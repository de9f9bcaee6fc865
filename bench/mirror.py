"""Mirror vs re-run: what a node's probes cost the runtime with ``serve --mirror`` and without.

    bench/run mirror [--quick] [--version 1.6] [--containers 20] [--period 1] [--rounds 2]
                     [--seconds 15] [--lag-samples 30]

A private containerd (in a cgroup of its own, as in bench/exec_cost.py, so its shims and every
``runc`` it forks count there) runs N host-network pods of ``sleep``. A local kubelet stand-in
(tests/support/kubelet_server.py) lists them on ``/pods`` with an exec liveness probe (``true``,
every --period) each, plus an exec readiness probe on the first, and their status; and it keeps
``/metrics/probes`` as the kubelet running those probes would: each probe's
``prober_probe_total{result="successful"}`` grows by one every period. The kubelet's own execs
are not run: they are the same with either contender, and what is measured is what cri-prober
adds.

Contenders, each a real ``cri-prober serve`` started for its window and stopped after it:

- **re-run**: ``--probes-from kubelet:URL``, running the pods' probes itself (today's way);
- **mirror**: the same plus ``--mirror kubelet:URL``, reading the stand-in's counters.

Each round is idle, re-run, mirror, mirror, re-run (ABBA, so a drift in the machine's load
weighs on both alike); a window starts once serve answers and has run for a warm-up. Per window:
the runtime's CPU (containerd's cgroup: containerd, shims, runc; and the app containers'
cgroups, where the exec'd processes run), serve's own CPU (/proc), the ExecSync calls serve made
(its ``cri_prober_cri_requests_total``) and the attempts it mirrored, all as % of one core.

Then the lag: with the mirror on, the stand-in flips the first pod's readiness counter
(``failed`` and ``successful`` in turn, failure threshold 1) at a random phase of the 1 s read,
and the bench times how long the change takes to reach cri-prober's API (a
``WatchTransitions`` stream): the kubelet verdict -> cri-prober's view.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench._common import containerd, fmt, load_average, machine, median, quiet_logs, say, table
from bench.exec_cost import Hierarchy, Meter, Reading, container_pid, own_cgroup
from cri_prober._gen.criprober.v1 import query_pb2, query_pb2_grpc
from tests.support.kubelet_server import KubeletServer
from tests.support.serve import Serve, _wait_serving, launch, stale_socket
from tests.support.testbed import ContainerSpec, Testbed

NAMESPACE = "bench-mirror"
KUBELET_START = 1.7e9
RULES = "probes: []\n"
WARM_UP = 3.0
MODES = ("re-run", "mirror")


# -- the kubelet stand-in -------------------------------------------------------------------------


@dataclass
class Probe:
    """One probe the stand-in's kubelet "runs": its counts by result."""

    pod: str
    uid: str
    container_id: str
    kind: str  # Liveness / Readiness
    successes: int = 0
    failures: int = 0
    paused: bool = False  # the lag phase sets this one's counts itself


@dataclass
class Kubelet:
    """The stand-in: pods with exec probes on /pods, and their counters on /metrics/probes."""

    server: KubeletServer
    period: float
    probes: list[Probe] = field(default_factory=list)

    def pods_document(self) -> dict[str, Any]:
        timing = {"timeoutSeconds": 1, "periodSeconds": max(1, round(self.period))}
        items = []
        for probe in self.probes:
            if probe.kind != "Liveness":
                continue
            container: dict[str, Any] = {
                "name": "app",
                "image": "busybox",
                "livenessProbe": {"exec": {"command": ["true"]}, **timing, "failureThreshold": 3},
            }
            if any(p.uid == probe.uid and p.kind == "Readiness" for p in self.probes):
                container["readinessProbe"] = {
                    "exec": {"command": ["true"]},
                    **timing,
                    "failureThreshold": 1,
                }
            items.append({
                "metadata": {"name": probe.pod, "namespace": NAMESPACE, "uid": probe.uid},
                "spec": {"containers": [container]},
                "status": {
                    "phase": "Running",
                    "containerStatuses": [{
                        "name": "app", "containerID": f"containerd://{probe.container_id}",
                        "ready": True, "started": True,
                    }],
                },
            })  # fmt: skip
        return {"kind": "PodList", "apiVersion": "v1", "items": items}

    def publish(self) -> None:
        """Write the counters to /metrics/probes, as the kubelet exposes them."""
        lines = ["# TYPE prober_probe_total counter"]
        for p in self.probes:
            for result, count in (("successful", p.successes), ("failed", p.failures)):
                if count:
                    lines.append(
                        f'prober_probe_total{{container="app",namespace="{NAMESPACE}",'
                        f'pod="{p.pod}",pod_uid="{p.uid}",probe_type="{p.kind}",'
                        f'result="{result}"}} {count}'
                    )
        lines.append("# TYPE process_start_time_seconds gauge")
        lines.append(f"process_start_time_seconds {KUBELET_START}")
        self.server.metrics = ("\n".join(lines) + "\n").encode()

    async def run(self) -> None:
        """Every period, each probe not paused passes once (the kubelet's ticker)."""
        loop = asyncio.get_running_loop()
        tick = loop.time()
        while True:
            for probe in self.probes:
                if not probe.paused:
                    probe.successes += 1
            self.publish()
            tick += self.period
            await asyncio.sleep(max(0.0, tick - loop.time()))


# -- serve --------------------------------------------------------------------------------------


async def scrape(port: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: bench\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    return answer.decode().split("\r\n\r\n", 1)[1]


def total(text: str, name: str, contains: str = "") -> float:
    """The sum of the series ``name`` whose line contains ``contains``."""
    value = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and contains in line:
            value += float(line.rpartition(" ")[2])
    return value


@dataclass(frozen=True)
class Counts:
    execs: float  # ExecSync calls serve made
    mirrored: float  # kubelet attempts serve mirrored
    serve_cpu: float


async def counts(serve: Serve | None) -> Counts:
    if serve is None or serve.metrics_port is None:
        return Counts(0.0, 0.0, 0.0)
    text = await scrape(serve.metrics_port)
    return Counts(
        total(text, "cri_prober_cri_requests_total", 'method="ExecSync"'),
        total(text, "cri_prober_probe_mirrored_attempts_total"),
        serve.cpu_seconds(),
    )


@contextlib.asynccontextmanager
async def running_serve(
    testbed: Testbed, kubelet: KubeletServer, mode: str
) -> AsyncIterator[Serve]:
    """``serve`` re-running the stand-in's pods' probes, or mirroring them; ready, warmed up."""
    directory = Path(tempfile.mkdtemp(prefix="cprb-bench-mirror-"))
    stale_socket(directory / "api.sock")
    extra = ["--probes-from", f"kubelet:{kubelet.url}"]
    if mode == "mirror":
        extra += ["--mirror", f"kubelet:{kubelet.metrics_url}"]
    serve = launch(testbed.endpoint, directory, RULES, *extra, metrics_address="127.0.0.1:0")
    try:
        await asyncio.to_thread(_wait_serving, serve)
        await serve.until(lambda: bool(serve.logged("metrics_listening")), timeout=30)
        serve.metrics_port = int(serve.logged("metrics_listening")[0]["port"])
        await asyncio.sleep(WARM_UP)  # workers started, first reads and attempts made
        yield serve
    finally:
        await serve.close()
        shutil.rmtree(directory, ignore_errors=True)


# -- the CPU windows ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    mode: str  # "idle", "re-run" or "mirror"
    round: int
    cpu: Reading
    execs: float
    mirrored: float
    serve_cpu: float

    def pct(self, seconds: float) -> float:
        return 100 * seconds / self.cpu.wall

    @property
    def runtime_pct(self) -> float:
        """containerd, shims, runc and the exec'd processes, % of one core."""
        return self.pct(self.cpu.runtime + self.cpu.containers)


async def window(
    testbed: Testbed, kubelet: KubeletServer, meter: Meter, mode: str, number: int, seconds: float
) -> Window:
    say(f"round {number}: {mode} {seconds:g} s")
    async with contextlib.AsyncExitStack() as stack:
        serve = None
        if mode != "idle":
            serve = await stack.enter_async_context(running_serve(testbed, kubelet, mode))
        before, start = meter.read(), await counts(serve)
        await asyncio.sleep(seconds)
        after, end = meter.read(), await counts(serve)
    return Window(
        mode,
        number,
        after - before,
        end.execs - start.execs,
        end.mirrored - start.mirrored,
        end.serve_cpu - start.serve_cpu,
    )


# -- the lag ------------------------------------------------------------------------------------


async def lag(testbed: Testbed, kubelet: Kubelet, samples: int) -> list[float]:
    """Seconds from a counter change of the kubelet's to the transition in cri-prober's API."""
    probe = next(p for p in kubelet.probes if p.kind == "Readiness")
    lags: list[float] = []
    async with running_serve(testbed, kubelet.server, "mirror") as serve:
        probe.paused = True
        async with grpc.aio.insecure_channel(serve.target) as channel:
            stub = query_pb2_grpc.CriProberStub(channel)
            request = query_pb2.WatchTransitionsRequest(
                filter=query_pb2.ContainerFilter(id=probe.container_id)
            )
            stream = stub.WatchTransitions(request)
            try:
                for number in range(samples):
                    # A random phase of the 1 s read, so the mean is the mirror's, not luck's.
                    await asyncio.sleep(random.uniform(0.5, 1.5))
                    failing = number % 2 == 0
                    if failing:
                        probe.failures += 1
                    else:
                        probe.successes += 1
                    kubelet.publish()
                    changed = time.monotonic()
                    want = "failure" if failing else "success"
                    async with asyncio.timeout(30):
                        async for transition in stream:
                            if transition.kind == "readiness" and transition.result == want:
                                break
                    lags.append(time.monotonic() - changed)
            finally:
                stream.cancel()
                probe.paused = False
    return lags


# -- the run ------------------------------------------------------------------------------------


@dataclass
class Result:
    windows: list[Window]
    lags: list[float]
    hierarchy: str
    containerd_version: str


async def measure(args: argparse.Namespace) -> Result:
    hierarchy = Hierarchy.detect()
    async with containerd(args.version) as testbed:
        with (
            own_cgroup(hierarchy, testbed.pid)
            if hierarchy is not None
            else contextlib.nullcontext()
        ) as runtime_cgroup:
            async with testbed.pods() as pods, KubeletServer(tls=False) as server:
                kubelet = Kubelet(server, args.period)
                say(f"creating {args.containers} pods")
                container_cgroups: list[Path] = []
                for i in range(args.containers):
                    pod = await pods.create_pod(
                        f"mirror-{i:03d}",
                        namespace=NAMESPACE,
                        containers=[ContainerSpec("app", command=["sleep", "3600"])],
                    )
                    container_id = pod.container_ids["app"]
                    kubelet.probes.append(Probe(pod.name, pod.uid, container_id, "Liveness"))
                    if i == 0:
                        kubelet.probes.append(Probe(pod.name, pod.uid, container_id, "Readiness"))
                    if hierarchy is not None and runtime_cgroup is not None:
                        pid = await container_pid(pods.runtime, container_id)
                        container_cgroups.append(hierarchy.of_pid(pid))
                server.serve(kubelet.pods_document())
                kubelet.publish()
                ticker = asyncio.create_task(kubelet.run())
                try:
                    meter = Meter(hierarchy, testbed.pid, runtime_cgroup, container_cgroups)
                    windows: list[Window] = []
                    for number in range(1, args.rounds + 1):
                        for mode in ("idle", "re-run", "mirror", "mirror", "re-run"):
                            windows.append(
                                await window(testbed, server, meter, mode, number, args.seconds)
                            )
                    say(f"lag: {args.lag_samples} kubelet verdicts")
                    lags = await lag(testbed, kubelet, args.lag_samples)
                finally:
                    ticker.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await ticker
            return Result(
                windows,
                lags,
                hierarchy.name if hierarchy is not None else "none",
                testbed.containerd_version,
            )


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(result: Result, args: argparse.Namespace, loads: Sequence[str]) -> None:
    print(f"\n## Mirror vs re-run ({machine()})\n")
    exec_probes = args.containers + 1
    print(
        f"containerd {args.version} ({result.containerd_version}), counters: {result.hierarchy};"
        f" {args.containers} pods, {exec_probes} exec probes (`true`) every {args.period:g} s;"
        f" {args.rounds} rounds of idle, re-run, mirror, mirror, re-run, {args.seconds:g} s each"
        f" after a {WARM_UP:g} s warm-up; load average before / after: {loads[0]} | {loads[1]}\n"
    )
    idle = {w.round: w for w in result.windows if w.mode == "idle"}
    rows = []
    for w in result.windows:
        base = idle[w.round]
        rows.append([
            w.round, w.mode, fmt(w.cpu.wall, 1), int(w.execs), int(w.mirrored),
            fmt(w.pct(w.cpu.runtime)), fmt(w.pct(w.cpu.containers)), fmt(w.runtime_pct),
            fmt(w.runtime_pct - base.runtime_pct) if w.mode != "idle" else "",
            fmt(w.pct(w.serve_cpu)) if w.mode != "idle" else "",
        ])  # fmt: skip
    print(table(
        ["round", "contender", "s", "ExecSync by serve", "attempts mirrored",
         "containerd+shims+runc %", "exec'd processes %", "runtime %", "runtime % above idle",
         "serve %"],
        rows,
    ))  # fmt: skip
    print()
    summary = []
    for mode in MODES:
        ws = [w for w in result.windows if w.mode == mode]
        above = [w.runtime_pct - idle[w.round].runtime_pct for w in ws]
        summary.append([
            mode, fmt(median([w.execs / w.cpu.wall for w in ws]), 1),
            fmt(median([w.mirrored / w.cpu.wall for w in ws]), 1),
            fmt(median(above)), fmt(median([w.pct(w.serve_cpu) for w in ws])),
        ])  # fmt: skip
    print(table(
        ["contender", "ExecSync/s by serve", "mirrored/s",
         "runtime % of a core above idle (median)", "serve % of a core (median)"],
        summary,
    ))  # fmt: skip
    lags = result.lags
    print(
        f"\nLag, a kubelet verdict (counter change) -> cri-prober's API (WatchTransitions), "
        f"{len(lags)} samples: median {fmt(median(lags))} s, p90 {fmt(percentile(lags, 0.9))} s,"
        f" max {fmt(max(lags) if lags else math.nan)} s (reads every 1 s)\n"
    )


async def run(args: argparse.Namespace) -> None:
    quiet_logs()
    loads = [load_average()]
    result = await measure(args)
    loads.append(load_average())
    report(result, args, loads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="10 pods, one round of 8 s windows")
    parser.add_argument("--version", default="1.6", help="containerd version (default 1.6)")
    parser.add_argument("--containers", type=int, default=None)
    parser.add_argument("--period", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=None, help="each window's length")
    parser.add_argument("--lag-samples", type=int, default=None)
    args = parser.parse_args()
    quick = args.quick
    args.containers = args.containers or (10 if quick else 20)
    args.rounds = args.rounds or (1 if quick else 2)
    args.seconds = args.seconds or (8.0 if quick else 15.0)
    args.lag_samples = args.lag_samples or (10 if quick else 30)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
