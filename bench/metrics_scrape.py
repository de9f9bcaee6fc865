"""What a /metrics scrape costs on a big node: wall time, bytes, and the event loop's delay.

It feeds a ``Metrics`` synthetic attempts of N containers with a readiness and a liveness probe
each, serves it with ``MetricsServer`` on 127.0.0.1 and scrapes it as text, text+gzip and
OpenMetrics+gzip, with and without ``--metrics-attempt-durations`` (docs/benchmarks.md, "Metrics
scrape", says what each column is).

    python -m bench.metrics_scrape [--quick] [--containers N ...] [--scrapes N]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import gzip
import random
import socket
import time
import uuid
from dataclasses import dataclass, field

import prometheus_client

from bench._common import fmt, machine, median, quiet_logs, say, table, tables_first
from cri_prober.discovery.model import ContainerInfo, PodInfo
from cri_prober.manager.events import AttemptFinished, ResultChanged
from cri_prober.manager.state import Health
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.results import ProbeRecord, Published
from cri_prober.runtime.model import ContainerState
from cri_prober.serving.metrics import Metrics
from cri_prober.serving.metrics_http import MetricsServer

KINDS = (ProbeKind.READINESS, ProbeKind.LIVENESS)
ATTEMPTS_PER_WORKER = 10
VARIANTS = {
    "text": b"",
    "text+gzip": b"Accept-Encoding: gzip\r\n",
    "OpenMetrics+gzip": (
        b"Accept: application/openmetrics-text; version=1.0.0\r\nAccept-Encoding: gzip\r\n"
    ),
}
TICK = 0.01
IDLE_SECONDS = 2.0
# A flaky worker's transitions: to failure and back.
FLAP = ((Published.SUCCESS, Published.FAILURE), (Published.FAILURE, Published.SUCCESS))


def node(containers: int, rng: random.Random) -> list[ContainerInfo]:
    """Containers as discovery reports them: deployment-style pod names in 40 namespaces."""
    out = []
    for index in range(containers):
        pod = PodInfo(
            sandbox_id=f"{rng.getrandbits(256):064x}",
            name=f"svc-{index // 20:04d}-{rng.getrandbits(40):010x}-{rng.getrandbits(20):05x}",
            namespace=f"team-{index % 40:02d}",
            uid=str(uuid.UUID(int=rng.getrandbits(128))),
            attempt=0,
            ready=True,
            ip=f"10.{index // 65536}.{index // 256 % 256}.{index % 256}",
            host_network=False,
            labels={"app": f"svc-{index // 20:04d}"},
            annotations={},
            created_at=0,
        )
        out.append(
            ContainerInfo(
                id=f"{rng.getrandbits(256):064x}",
                pod_sandbox_id=pod.sandbox_id,
                name="app",
                attempt=0,
                state=ContainerState.CONTAINER_RUNNING,
                created_at=0,
                started_at=1,
                finished_at=0,
                exit_code=0,
                labels={},
                annotations={},
                env=None,
                pod=pod,
            )
        )
    return out


def history(
    containers: list[ContainerInfo], rng: random.Random
) -> tuple[list[ResultChanged], list[AttemptFinished]]:
    """Every worker's transitions and attempts, as the manager publishes them: ten attempts a
    worker (durations log-normal around 7 ms); one worker in ten fails three in a row, some of
    those by timeout, and flaps to failure and back."""
    health = Health(running=True, started=True, ready=True, live=True)
    changes: list[ResultChanged] = []
    attempts: list[AttemptFinished] = []
    for container in containers:
        for kind in KINDS:
            flaky = rng.random() < 0.1
            changes.append(ResultChanged(container, kind, None, Published.SUCCESS, 1, "", health))
            for index in range(ATTEMPTS_PER_WORKER):
                failed = flaky and index in (3, 4, 5)
                timed_out = failed and index == 4 and rng.random() < 0.3
                duration = 1.0 if timed_out else rng.lognormvariate(-5, 1)
                record = ProbeRecord(
                    container.id,
                    0.0,
                    duration,
                    "failure" if failed else "success",
                    "",
                    timed_out=timed_out,
                )
                attempts.append(AttemptFinished(container, kind, record))
            if flaky:
                for previous, result in FLAP:
                    changes.append(ResultChanged(container, kind, previous, result, 3, "", health))
    return changes, attempts


def scrape(port: int, fields: bytes) -> tuple[float, bytes]:
    """One GET /metrics: its wall time from connect to the last byte, and its body.

    Blocking, and run in a thread: the loop is the server's alone (a blocked recv lets go of
    the GIL), so its timer's lateness is what serving costs it, not what reading costs us.
    """
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: bench\r\n" + fields + b"\r\n")
        chunks = []
        while chunk := sock.recv(1 << 20):
            chunks.append(chunk)
    seconds = time.perf_counter() - started
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200 "):
        raise RuntimeError(f"scrape failed: {head[:200]!r}")
    return seconds, body


@dataclass
class Run:
    """One size with or without the optional histogram."""

    containers: int
    attempt_durations: bool
    series: int = 0
    us_per_attempt: float = 0.0
    reference_seconds: float = 0.0  # prometheus_client.generate_latest over the registry
    times: dict[str, list[float]] = field(default_factory=dict)  # scrape wall times by variant
    sizes: dict[str, int] = field(default_factory=dict)  # body bytes by variant
    lateness: dict[str, float] = field(default_factory=dict)  # a 10 ms timer's worst delay
    idle_lateness: float = 0.0  # the same timer's worst delay before the scrapes


async def measure(containers: int, attempt_durations: bool, scrapes: int) -> Run:
    """Feed, serve and scrape one size; a 10 ms timer on the loop measures its delays, first
    idle, then during each variant's scrapes (made on the loop, in slices of 10 ms)."""
    run = Run(containers, attempt_durations)
    rng = random.Random(containers)
    changes, attempts = history(node(containers, rng), rng)
    metrics = Metrics(attempt_durations=attempt_durations)
    for change in changes:
        metrics.manager_event(change)
    started = time.perf_counter()
    for attempt in attempts:
        metrics.manager_event(attempt)
    run.us_per_attempt = (time.perf_counter() - started) / len(attempts) * 1e6
    # The feed made a million objects at once; a long-running serve's heap has long been
    # through the collector's generations. Collect now, or its first full pass (100+ ms, GIL
    # held) lands in the middle of the scrapes.
    gc.collect()

    server = MetricsServer(metrics)
    await server.start("127.0.0.1:0")
    loop = asyncio.get_running_loop()
    late: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            due = loop.time() + TICK
            await asyncio.sleep(TICK)
            late.append(loop.time() - due)

    bodies: dict[str, bytes] = {}
    ticking = asyncio.create_task(ticker())
    try:
        # The timer's lateness with nothing to serve: what the machine alone costs it.
        await asyncio.sleep(IDLE_SECONDS)
        run.idle_lateness = max(late, default=0.0)
        for name, fields in VARIANTS.items():
            late.clear()
            for _ in range(scrapes):
                seconds, body = await asyncio.to_thread(scrape, server.port, fields)
                run.times.setdefault(name, []).append(seconds)
                run.sizes[name] = len(body)
                bodies[name] = body  # looked at after the timer stops: not on the loop now
                # The server leaves as long as an exposition took between two (its flood
                # guard): wait that out, so each scrape measures one exposition.
                await asyncio.sleep(seconds)
            run.lateness[name] = max(late, default=0.0)
    finally:
        done.set()
        await ticking
        await server.stop()
    text = bodies["text"]
    run.series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
    if gzip.decompress(bodies["text+gzip"]) != text:
        raise RuntimeError("the gzipped scrape is not the text scrape")
    started = time.perf_counter()
    prometheus_client.generate_latest(metrics.registry)
    run.reference_seconds = time.perf_counter() - started
    return run


def report(runs: list[Run]) -> str:
    rows = []
    for run in runs:
        workers = run.containers * len(KINDS)
        for name, times in run.times.items():
            rows.append(
                [
                    f"{run.containers:,}",
                    "on" if run.attempt_durations else "off",
                    name,
                    f"{run.series:,}",
                    fmt(run.series / workers, 1),
                    fmt(median(times), 3),
                    fmt(max(times), 3),
                    fmt(run.sizes[name] / 1e6, 2),
                    fmt(run.us_per_attempt, 2),
                    fmt(run.lateness[name] * 1000, 0),
                    fmt(run.idle_lateness * 1000, 0),
                    fmt(run.reference_seconds, 2),
                ]
            )
    headers = [
        "containers",
        "attempt durations",
        "scrape",
        "series",
        "series/worker",
        "median s",
        "max s",
        "MB",
        "µs/attempt",
        "loop late ms",
        "idle late ms",
        "generate_latest s",
    ]
    return table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,000 and 5,000 containers")
    parser.add_argument("--containers", type=int, nargs="+", help="sizes (containers)")
    parser.add_argument("--scrapes", type=int, default=5, help="scrapes per variant (>= 5)")
    args = parser.parse_args()
    sizes = args.containers or ([1000, 5000] if args.quick else [1000, 5000, 10000])
    quiet_logs()
    # As serve: no *_created series (a process-wide switch).
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    runs: list[Run] = []

    def tables() -> None:
        print(f"machine: {machine()}")
        print(
            f"{len(KINDS)} probes per container, {ATTEMPTS_PER_WORKER} attempts per worker; "
            "scrapes one at a time, wall time from connect to the last byte\n"
        )
        print(report(runs))

    # The tables of what was measured come first, even when a stop or a later size fails: that
    # failure follows them (issue 35).
    with tables_first(tables):
        for containers in sizes:
            for attempt_durations in (False, True):
                say(f"{containers} containers, attempt durations {attempt_durations}")
                runs.append(asyncio.run(measure(containers, attempt_durations, args.scrapes)))


if __name__ == "__main__":
    main()
