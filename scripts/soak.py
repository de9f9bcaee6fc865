#!/usr/bin/env python3
"""Churn soak: pods created and removed continuously under an in-process ``serve`` daemon.

A private containerd testbed is started (root only), a few steady pods stay up the whole time, and
churn pods are created and removed one per ``--interval`` seconds (every fifth cycle also
restarts a container the way the kubelet does, giving its slot a new container ID). Every
``--sample-every`` seconds a row is printed: open fds, asyncio tasks, RSS, probe workers, slots,
published results, metric series, exec calls in flight, probes run and event-loop lag.

At the end every churn pod is removed, the daemon is given time to notice, and the final sample
must be back at the baseline taken before the churn started (exact for workers, slots, results
and the probe workers' metric series, scraped from serve's own ``/metrics``; within a small slack
for fds and tasks; within ``--rss-slack-mib`` for RSS).
The exit status is 0 when it is, 1 when not.

    sudo .venv/bin/python scripts/soak.py --minutes 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cri_prober import logs
from cri_prober.daemon import Daemon, ServeConfig, read_rules
from cri_prober.probing.worker import ProbeRecord
from cri_prober.runtime.endpoints import Endpoint
from tests.support.testbed import ContainerSpec, Pod, PodFactory, Testbed

RULES = """
probes:
  - match: {namespace: soak, container: app}
    readinessProbe:
      exec: {command: ["true"]}
      periodSeconds: 1
    livenessProbe:
      httpGet: {path: /index.html, port: 8080}
      periodSeconds: 2
  - match: {namespace: soak, container: side}
    livenessProbe:
      tcpSocket: {port: 8080}
      periodSeconds: 1
    startupProbe:
      exec: {command: [test, -f, /tmp/index.html]}
      periodSeconds: 1
      failureThreshold: 30
"""
WEB = ContainerSpec(
    "app", command=["sh", "-c", "echo ok > /tmp/index.html && exec httpd -f -p 8080 -h /tmp"]
)
SIDE = ContainerSpec("side", command=["sh", "-c", "echo ok > /tmp/index.html && exec sleep 3600"])

FD_SLACK = 8
TASK_SLACK = 8


@dataclass(frozen=True)
class Row:
    """One sample of the daemon's footprint."""

    elapsed: float
    pods: int
    fds: int
    tasks: int
    rss_mib: float
    workers: int
    slots: int
    results: int
    series: int
    worker_series: int
    in_flight: int
    probes: int
    errored: int
    lag_p99_ms: float


class Counter:
    """A manager observer: counts probe attempts (and those that could not run), signals change."""

    def __init__(self) -> None:
        self.probes = 0
        self.errored = 0
        self.changed = asyncio.Event()

    def probe_finished(self, _slot: object, _kind: object, record: ProbeRecord) -> None:
        self.probes += 1
        if record.result == "error":
            self.errored += 1
        self.changed.set()

    def transition(self, *_args: object) -> None:
        self.changed.set()

    def worker_stopped(self, *_args: object) -> None:
        self.changed.set()


class LoopLag:
    """Measures how late the event loop runs a 50 ms timer (a stalled loop delays every probe)."""

    def __init__(self) -> None:
        self.lags: deque[float] = deque(maxlen=2000)
        self.worst = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(0.05)
            lag = loop.time() - before - 0.05
            self.lags.append(lag)
            self.worst = max(self.worst, lag)

    def p99(self) -> float:
        if not self.lags:
            return 0.0
        ordered = sorted(self.lags)
        return ordered[int(0.99 * (len(ordered) - 1))]


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Soak:
    def __init__(self, args: argparse.Namespace, testbed: Testbed, directory: Path) -> None:
        self.args = args
        self.testbed = testbed
        self.directory = directory
        self.counter = Counter()
        self.lag = LoopLag()
        self.metrics_port: int | None = None
        self.churn: deque[Pod] = deque()
        self.created = 0
        self.removed = 0
        self.restarted = 0
        self.errors: list[str] = []

    # -- measuring ------------------------------------------------------------------------------

    async def series(self) -> tuple[int, int]:
        """Scrape serve's /metrics: (all series, series of probe workers); -1 without metrics."""
        if self.metrics_port is None:
            return -1, -1
        reader, writer = await asyncio.open_connection("127.0.0.1", self.metrics_port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n")
        data = await reader.read()  # the server answers one request and closes
        writer.close()
        body = data.partition(b"\r\n\r\n")[2].decode()
        series = [line for line in body.splitlines() if line and not line.startswith("#")]
        return len(series), sum('container="' in line for line in series)

    async def sample(self, daemon: Daemon, started: float) -> Row:
        series, worker_series = await self.series()
        return Row(
            elapsed=time.monotonic() - started,
            pods=len(self.churn),
            fds=len(os.listdir("/proc/self/fd")),
            tasks=len(asyncio.all_tasks()),
            rss_mib=rss_mib(),
            workers=daemon.manager.worker_count(),
            slots=len(daemon.manager.slots()),
            results=len(daemon.manager.results),
            series=series,
            worker_series=worker_series,
            in_flight=daemon.cri.execs_in_flight,
            probes=self.counter.probes,
            errored=self.counter.errored,
            lag_p99_ms=self.lag.p99() * 1000,
        )

    async def steady_sample(self, daemon: Daemon, started: float) -> Row:
        """Median of 20 samples over a second: probes come and go, a leak does not."""
        rows = []
        for _ in range(20):
            rows.append(await self.sample(daemon, started))
            await asyncio.sleep(0.05)
        last = rows[-1]
        return Row(
            elapsed=last.elapsed,
            pods=last.pods,
            fds=int(statistics.median(r.fds for r in rows)),
            tasks=int(statistics.median(r.tasks for r in rows)),
            rss_mib=last.rss_mib,
            workers=last.workers,
            slots=last.slots,
            results=last.results,
            series=last.series,
            worker_series=last.worker_series,
            in_flight=last.in_flight,
            probes=last.probes,
            errored=last.errored,
            lag_p99_ms=last.lag_p99_ms,
        )

    @staticmethod
    def header() -> str:
        return (
            f"{'t(s)':>6} {'pods':>4} {'fds':>4} {'tasks':>5} {'rss MiB':>7} {'workers':>7} "
            f"{'slots':>5} {'results':>7} {'series':>6} {'wseries':>7} {'inflt':>5} {'probes':>7} "
            f"{'errored':>7} "
            f"{'lag p99':>7}"
        )

    @staticmethod
    def line(row: Row, label: str = "") -> str:
        return (
            f"{row.elapsed:6.0f} {row.pods:4d} {row.fds:4d} {row.tasks:5d} {row.rss_mib:7.1f} "
            f"{row.workers:7d} {row.slots:5d} {row.results:7d} {row.series:6d} "
            f"{row.worker_series:7d} "
            f"{row.in_flight:5d} {row.probes:7d} {row.errored:7d} {row.lag_p99_ms:5.0f}ms {label}"
        )

    # -- churning -------------------------------------------------------------------------------

    async def create(self, pods: PodFactory, name: str) -> Pod:
        pod = await pods.create_pod(
            name, namespace="soak", host_network=False, containers=[WEB, SIDE]
        )
        self.created += 1
        return pod

    async def cycle(self, pods: PodFactory, index: int) -> None:
        try:
            self.churn.append(await self.create(pods, f"churn-{index}"))
            if len(self.churn) > self.args.pods:
                await pods.remove_pod(self.churn.popleft())
                self.removed += 1
            if index % 5 == 0 and self.churn:
                # Restart like the kubelet: stop, then attempt+1 (the old one stays until removal).
                pod = self.churn.pop()
                self.churn.append(await pods.restart_container(pod, "app"))
                self.restarted += 1
        except Exception as exc:  # keep soaking; report at the end
            self.errors.append(f"cycle {index}: {type(exc).__name__}: {exc}")

    async def run(self) -> bool:
        rules_file = self.directory / "rules.yaml"
        rules_file.write_text(RULES)
        endpoint = self.testbed.endpoint
        metrics_address = None
        if importlib.util.find_spec("cri_prober.serving.metrics") is not None:
            self.metrics_port = free_port()
            metrics_address = f"127.0.0.1:{self.metrics_port}"
        config = ServeConfig(
            endpoint=Endpoint(endpoint, "flag", endpoint),
            config_file=rules_file,
            listen=f"unix://{self.directory}/api.sock",
            metrics_address=metrics_address,
            relist_period=0.5,
        )
        daemon = Daemon(config, read_rules(rules_file))
        daemon.observer.observers.append(self.counter)
        daemon_task = asyncio.create_task(daemon.run(), name="daemon")
        lag_task = asyncio.create_task(self.lag.run(), name="loop-lag")
        started = time.monotonic()
        ok = False
        try:
            await asyncio.wait_for(daemon.ready.wait(), 60)
            async with self.testbed.pods() as pods:
                for i in range(self.args.steady):
                    await self.create(pods, f"steady-{i}")
                await self.until(lambda: daemon.manager.worker_count() == 4 * self.args.steady)
                await asyncio.sleep(3)  # let the steady pods' probes settle into their periods
                gc.collect()
                baseline = await self.steady_sample(daemon, started)
                print(
                    f"metrics: scraped from serve's /metrics at {metrics_address}"
                    if metrics_address
                    else "metrics: cri_prober/metrics.py not present (series -1)"
                )
                print(self.header())
                print(self.line(baseline, "baseline"), flush=True)
                peak = baseline

                deadline = started + self.args.minutes * 60
                next_sample = time.monotonic() + self.args.sample_every
                index = 0
                while time.monotonic() < deadline:
                    cycle_started = time.monotonic()
                    await self.cycle(pods, index)
                    index += 1
                    if time.monotonic() >= next_sample:
                        row = await self.sample(daemon, started)
                        peak = Row(**{k: max(v, getattr(row, k)) for k, v in asdict(peak).items()})
                        print(self.line(row), flush=True)
                        next_sample += self.args.sample_every
                    await asyncio.sleep(
                        max(0.0, self.args.interval - (time.monotonic() - cycle_started))
                    )

                # Drain: remove every churn pod and wait for the daemon to forget them.
                while self.churn:
                    await pods.remove_pod(self.churn.popleft())
                    self.removed += 1
                await self.until(
                    lambda: (
                        daemon.manager.worker_count() == baseline.workers
                        and len(daemon.manager.slots()) == baseline.slots
                        and len(daemon.manager.results) == baseline.results
                    )
                )
                await asyncio.sleep(3)
                gc.collect()
                final = await self.steady_sample(daemon, started)
                print(self.line(peak, "peak"))
                print(self.line(final, "final"), flush=True)
                ok = self.verdict(baseline, final)
        finally:
            daemon.stop_event.set()
            await asyncio.wait_for(daemon_task, 60)
            lag_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lag_task
        return ok

    async def until(self, predicate: Any, timeout: float = 120.0) -> None:
        """Wait until ``predicate()`` holds, looking again after every probe and worker exit."""
        async with asyncio.timeout(timeout):
            while not predicate():
                self.counter.changed.clear()
                await self.counter.changed.wait()

    def verdict(self, baseline: Row, final: Row) -> bool:
        checks = {
            "workers back to baseline": final.workers == baseline.workers,
            "slots back to baseline": final.slots == baseline.slots,
            "results back to baseline": final.results == baseline.results,
            "probe workers' metric series back to baseline": final.worker_series
            == baseline.worker_series,
            f"fds within {FD_SLACK}": abs(final.fds - baseline.fds) <= FD_SLACK,
            f"tasks within {TASK_SLACK}": abs(final.tasks - baseline.tasks) <= TASK_SLACK,
            f"RSS growth under {self.args.rss_slack_mib} MiB": final.rss_mib - baseline.rss_mib
            < self.args.rss_slack_mib,
            "no churn errors": not self.errors,
        }
        print(
            f"\ncreated {self.created} pods ({2 * self.created} containers), removed "
            f"{self.removed}, restarted {self.restarted} containers, {final.probes} probes run "
            f"({final.errored} could not run: their container was going away), "
            f"event-loop lag worst {self.lag.worst * 1000:.0f} ms"
        )
        for error in self.errors[:20]:
            print(f"  error: {error}")
        for name, passed in checks.items():
            print(f"  {'PASS' if passed else 'FAIL'}  {name}")
        return all(checks.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="churn duration (default 10)")
    parser.add_argument("--pods", type=int, default=10, help="churn pods alive at once")
    parser.add_argument("--steady", type=int, default=3, help="pods that stay up throughout")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds per churn cycle")
    parser.add_argument("--sample-every", type=float, default=30.0, help="seconds between rows")
    parser.add_argument("--version", default="1.6", choices=["1.6", "1.7", "2.1"])
    parser.add_argument("--rss-slack-mib", type=float, default=32.0)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("soak.py needs root (it starts a private containerd)", file=sys.stderr)
        return 2
    # Transitions and the (expected) errored probes of containers removed mid-probe would drown
    # the table; the errored ones are counted in their own column instead.
    logs.configure(level="error")
    parent = Path(tempfile.mkdtemp(prefix="cprb-soak-"))
    directory = parent / "tb"
    try:
        testbed = Testbed.start(directory, version=args.version)
        print(f"testbed: containerd {testbed.containerd_version} in {directory}")
        ok = asyncio.run(Soak(args, testbed, parent).run())
    finally:
        Testbed.stop_dir(directory)
        shutil.rmtree(parent, ignore_errors=True)
    print("SOAK PASSED" if ok else "SOAK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
