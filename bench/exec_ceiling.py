"""Exec ceiling: exec probes/s cri-prober sustains vs the best raw ExecSync loop, same run.

    python -m bench.exec_ceiling [--quick]

Starts a private containerd 1.6, creates N host-network pods running ``sleep``, then alternates
rounds of (A) a raw ExecSync ``true`` loop at concurrency 1, 2, 4, 8, 16 (the best of which is the
round's ceiling) and (B) the whole cri-prober daemon in-process (relist discovery, the probe
manager, one liveness worker per container, exec ``true`` every 1 s) at each
--max-concurrent-execs value. Reports per-round ratios, their medians, lateness, fairness and
throughput over time.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc

from bench._common import (
    Collector,
    Lateness,
    containerd,
    due_times,
    fmt,
    machine,
    median,
    node_jiffies,
    pct,
    proc_cpu_seconds,
    quiet_logs,
    rules_file,
    say,
    table,
    tables_first,
)
from cri_prober._gen.runtime.v1 import api_pb2, api_pb2_grpc
from cri_prober.discovery.model import ContainerInfo
from cri_prober.probing.spec import RulesFile, load_rules
from tests.support.daemon import running_daemon
from tests.support.testbed import ContainerSpec

PERIOD = 1.0
RULES = """
probes:
  - match: {{namespace: bench, pod: "{pattern}", container: app}}
    livenessProbe:
      exec: {{command: ["true"]}}
      periodSeconds: 1
      timeoutSeconds: 5
"""


@dataclass
class RawResult:
    concurrency: int
    rate: float
    errors: int
    node_busy: float  # fraction of all CPUs
    client_cpu: float  # this process's CPU, % of one CPU
    containerd_cpu: float  # containerd's main process, % of one CPU


@dataclass
class ProberResult:
    containers: int
    cap: int
    rate: float  # successful probes finished per second in the window
    requested: float
    late_p50: float
    late_p99: float
    dispatch_p50: float
    dispatch_p99: float
    dropped: float
    fair_min: int
    fair_max: int
    errors: int
    failures: int
    node_busy: float
    client_cpu: float  # the daemon's process, % of one CPU
    containerd_cpu: float
    in_flight: float  # mean ExecSync calls in flight (sampled every 50 ms)
    buckets: list[float] = field(default_factory=list)  # completions/s per 5 s, whole run


async def raw_rate(
    target: str, ids: list[str], concurrency: int, seconds: float, containerd_pid: int
) -> RawResult:
    """ExecSync ``true`` round-robin over the containers from ``concurrency`` coroutines."""
    channel = grpc.aio.insecure_channel(target)
    stub = api_pb2_grpc.RuntimeServiceStub(channel)
    done = 0
    errors = 0
    loop = asyncio.get_running_loop()
    warm = loop.time() + 1.0
    end = warm + seconds

    async def worker(first: int) -> None:
        nonlocal done, errors
        index = first
        while loop.time() < end:
            request = api_pb2.ExecSyncRequest(
                container_id=ids[index % len(ids)], cmd=["true"], timeout=5
            )
            index += concurrency
            try:
                await stub.ExecSync(request, timeout=10)
            except grpc.aio.AioRpcError:
                errors += 1
                continue
            now = loop.time()
            if warm <= now < end:
                done += 1

    busy0, total0 = node_jiffies()
    cpu0, ctrd0, wall0 = time.process_time(), proc_cpu_seconds(containerd_pid), time.monotonic()
    try:
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    finally:
        await channel.close()
    busy1, total1 = node_jiffies()
    wall = time.monotonic() - wall0
    return RawResult(
        concurrency,
        done / seconds,
        errors,
        (busy1 - busy0) / (total1 - total0),
        100 * (time.process_time() - cpu0) / wall,
        100 * (proc_cpu_seconds(containerd_pid) - ctrd0) / wall,
    )


async def prober_run(
    target: str,
    count: int,
    cap: int,
    seconds: float,
    containerd_pid: int,
    *,
    warmup: float = 4.0,
) -> ProberResult:
    """The daemon with exec liveness probes on ``count`` containers and ``cap`` exec slots."""
    pattern = "exec-a-*" if count <= 20 else "exec-*"
    collector = Collector()
    async with (
        rules_file(RULES.format(pattern=pattern)) as rules,
        running_daemon(
            target,
            rules,
            ready_timeout=60,
            stop_timeout=60,
            listeners=[collector],
            pleg="relist",
            max_concurrent_execs=cap,
        ) as (daemon, watcher),
    ):
        unsubscribe = daemon.cri.calls.subscribe(collector.cri_call)  # ExecSync dispatch times
        run_start = time.time()
        await watcher.until(lambda: daemon.manager.worker_count() >= count, 30)
        # From here only the benchmark's own listener follows the manager (the watcher
        # would keep every event and spend this process's CPU on it).
        watcher.unsubscribe()
        await asyncio.sleep(warmup)
        window_start = time.time()
        busy0, total0 = node_jiffies()
        cpu0, ctrd0, wall0 = time.process_time(), proc_cpu_seconds(containerd_pid), time.monotonic()
        in_flight: list[int] = []
        while time.time() < window_start + seconds:
            in_flight.append(daemon.cri.execs_in_flight)
            await asyncio.sleep(0.05)
        window_end = time.time()
        busy1, total1 = node_jiffies()
        wall = time.monotonic() - wall0
        client_cpu = 100 * (time.process_time() - cpu0) / wall
        containerd_cpu = 100 * (proc_cpu_seconds(containerd_pid) - ctrd0) / wall
        unsubscribe()
    node_busy = (busy1 - busy0) / (total1 - total0)

    per_worker = collector.by_worker(0, math.inf)
    lateness = Lateness()
    dispatch_late: list[float] = []
    per_container: dict[str, int] = {}
    errors = failures = 0
    for worker, attempts in per_worker.items():
        starts = [a.started_at for a in attempts]
        lateness.add(starts, PERIOD, (window_start, window_end))
        for a, due in zip(attempts, due_times(starts, PERIOD), strict=True):
            if window_start <= a.started_at < window_end and a.dispatched_at is not None:
                dispatch_late.append(a.dispatched_at - due)
        ok = [a for a in attempts if window_start <= a.finished_at < window_end]
        per_container[worker] = sum(1 for a in ok if a.result == "success")
        errors += sum(1 for a in ok if a.result == "error")
        failures += sum(1 for a in ok if a.result == "failure")
    done = sum(per_container.values())
    buckets: collections.Counter[int] = collections.Counter()
    for a in collector.attempts:
        if a.result == "success":
            buckets[int((a.finished_at - run_start) // 5)] += 1
    last = int((window_end - run_start) // 5)
    return ProberResult(
        containers=count,
        cap=cap,
        rate=done / (window_end - window_start),
        requested=count / PERIOD,
        late_p50=pct(lateness.late, 50),
        late_p99=pct(lateness.late, 99),
        dispatch_p50=pct(dispatch_late, 50),
        dispatch_p99=pct(dispatch_late, 99),
        dropped=lateness.dropped_fraction,
        fair_min=min(per_container.values(), default=0),
        fair_max=max(per_container.values(), default=0),
        errors=errors,
        failures=failures,
        node_busy=node_busy,
        client_cpu=client_cpu,
        containerd_cpu=containerd_cpu,
        in_flight=sum(in_flight) / max(len(in_flight), 1),
        buckets=[buckets[i] / 5 for i in range(last)],
    )


async def run(args: argparse.Namespace) -> None:
    quiet_logs()
    total = max(args.containers)
    raw_rounds: list[list[RawResult]] = []
    prober_rounds: list[list[ProberResult]] = []

    def tables() -> None:
        if not args.paired_only:  # paired() prints its own table when it is done
            report(args, raw_rounds, prober_rounds)

    # The tables of what was measured come first, even when a stop or a later window
    # fails: that failure follows them (issue 35).
    with tables_first(tables):
        async with containerd("1.6") as testbed, testbed.pods() as pods:
            say(f"creating {total} pods")
            ids: list[str] = []
            for i in range(total):
                group = "a" if i < 20 else "b"
                pod = await pods.create_pod(
                    f"exec-{group}-{i:02d}",
                    namespace="bench",
                    containers=[ContainerSpec("app", command=["sleep", "3600"])],
                )
                ids.append(pod.container_ids["app"])
            if args.paired_only:
                print(f"\n## Exec ceiling, paired ({machine()}, containerd 1.6)")
                await paired(args, testbed.endpoint, ids, testbed.pid)
                return
            for round_no in range(args.rounds):
                # ABBA: the prober goes first in odd rounds so slow drift does not favour one side.
                probers: list[ProberResult] = []
                if round_no % 2:
                    await prober_round(
                        args, testbed.endpoint, testbed.pid, total, round_no, probers
                    )
                raws = []
                for concurrency in args.concurrency:
                    say(f"round {round_no + 1}: raw ExecSync loop, concurrency {concurrency}")
                    raws.append(
                        await raw_rate(
                            testbed.endpoint, ids, concurrency, args.raw_seconds, testbed.pid
                        )
                    )
                    say(f"  {raws[-1].rate:.1f}/s")
                raw_rounds.append(raws)
                if round_no % 2 == 0:
                    await prober_round(
                        args, testbed.endpoint, testbed.pid, total, round_no, probers
                    )
                prober_rounds.append(probers)


async def prober_round(
    args: argparse.Namespace,
    endpoint: str,
    containerd_pid: int,
    total: int,
    round_no: int,
    out: list[ProberResult],
) -> None:
    for count in args.containers:
        for cap in args.caps if count == total else [8]:
            say(f"round {round_no + 1}: cri-prober, {count} containers, cap {cap}")
            out.append(await prober_run(endpoint, count, cap, args.prober_seconds, containerd_pid))
            say(f"  {out[-1].rate:.1f}/s")


async def paired(args: argparse.Namespace, endpoint: str, ids: list[str], pid: int) -> None:
    """Tightly interleaved pairs: raw loop at concurrency = cap vs the daemon with that cap.

    The daemon keeps running between its windows; its workers are switched off (rules emptied,
    as a SIGHUP reload would) while the raw loop runs, so each pair is measured seconds apart.
    """
    rows = []
    for cap in args.caps:
        collector = Collector()
        rules = load_rules(RULES.format(pattern="exec-*"), source="bench")
        pairs: list[tuple[float, float]] = []
        async with (
            rules_file(RULES.format(pattern="exec-*")) as path,
            running_daemon(
                endpoint, path, ready_timeout=60, stop_timeout=60, listeners=[collector],
                pleg="relist", max_concurrent_execs=cap,
            ) as (daemon, watcher),
        ):  # fmt: skip
            # Read the view at each switch: discovery replaces (never mutates) its mapping.
            await watcher.until(lambda: daemon.manager.worker_count() >= len(ids), 30)
            # From here only the benchmark's own listener follows the manager (the watcher
            # would keep every event and spend this process's CPU on it).
            watcher.unsubscribe()

            def containers() -> Iterable[ContainerInfo]:
                return daemon.discovery.containers().values()

            for pair in range(args.pairs):
                result: dict[str, float] = {}
                for contender in ("raw", "prober") if pair % 2 == 0 else ("prober", "raw"):
                    if contender == "raw":
                        daemon.manager.set_rules(RulesFile(probes=()), containers())
                        await asyncio.sleep(1.0)  # let in-flight probes drain
                        raw = await raw_rate(endpoint, ids, cap, args.pair_seconds, pid)
                        result["raw"] = raw.rate
                    else:
                        daemon.manager.set_rules(rules, containers())
                        await asyncio.sleep(3.0)
                        start = time.time()
                        await asyncio.sleep(args.pair_seconds)
                        end = time.time()
                        ok = [
                            a for a in collector.attempts
                            if start <= a.finished_at < end and a.result == "success"
                        ]  # fmt: skip
                        result["prober"] = len(ok) / (end - start)
                pairs.append((result["prober"], result["raw"]))
                say(f"cap {cap} pair {pair + 1}: prober {result['prober']:.1f}/s,"
                    f" raw {result['raw']:.1f}/s")  # fmt: skip
        ratios = [p / r for p, r in pairs]
        rows.append([
            cap, " / ".join(fmt(p, 1) for p, _ in pairs), fmt(median([p for p, _ in pairs]), 1),
            " / ".join(fmt(r, 1) for _, r in pairs), fmt(median([r for _, r in pairs]), 1),
            fmt(median(ratios), 2), fmt(min(ratios), 2), fmt(max(ratios), 2),
        ])  # fmt: skip
    print(f"\n### Paired windows ({len(ids)} containers, {args.pair_seconds:g} s windows)\n")
    print(table(
        ["cap = raw concurrency", "cri-prober probes/s per pair", "median", "raw exec/s per pair",
         "median", "median ratio", "min ratio", "max ratio"],
        rows,
    ))  # fmt: skip


def report(
    args: argparse.Namespace,
    raw_rounds: list[list[RawResult]],
    prober_rounds: list[list[ProberResult]],
) -> None:
    print(f"\n## Exec ceiling ({machine()}, containerd 1.6)\n")
    print(
        f"rounds: {args.rounds}; raw window {args.raw_seconds} s, prober window"
        f" {args.prober_seconds} s; exec probe period {PERIOD:g} s\n"
    )
    rows = []
    for i, concurrency in enumerate(args.concurrency):
        rates = [r[i].rate for r in raw_rounds]
        rows.append([
            concurrency, " / ".join(fmt(x, 1) for x in rates), fmt(median(rates), 1),
            sum(r[i].errors for r in raw_rounds),
            fmt(100 * median([r[i].node_busy for r in raw_rounds]), 0),
            fmt(median([r[i].client_cpu for r in raw_rounds]), 0),
            fmt(median([r[i].containerd_cpu for r in raw_rounds]), 0),
        ])  # fmt: skip
    print(table(
        ["raw concurrency", "exec/s per round", "median", "errors", "node CPU % (of 2)",
         "client CPU %", "containerd CPU %"],
        rows,
    ))  # fmt: skip
    ceilings = [max(r.rate for r in raws) for raws in raw_rounds]
    print(f"\nceiling per round (best raw): {' / '.join(fmt(c, 1) for c in ceilings)}")
    print("ratio = cri-prober probes/s / min(ceiling, requested probes/s), same round\n")
    rows = []
    for j, first in enumerate(prober_rounds[0]):
        runs = [p[j] for p in prober_rounds]
        # Below the ceiling the most anyone can do is what was asked for.
        ratios = [p.rate / min(c, p.requested) for p, c in zip(runs, ceilings, strict=True)]
        rows.append([
            first.containers, fmt(first.requested, 0), first.cap,
            " / ".join(fmt(p.rate, 1) for p in runs), fmt(median([p.rate for p in runs]), 1),
            " / ".join(fmt(r, 2) for r in ratios), fmt(median(ratios), 2),
            fmt(1000 * median([p.late_p50 for p in runs]), 1),
            fmt(1000 * median([p.late_p99 for p in runs]), 1),
            fmt(1000 * median([p.dispatch_p50 for p in runs]), 0),
            fmt(1000 * median([p.dispatch_p99 for p in runs]), 0),
            fmt(100 * median([p.dropped for p in runs]), 1),
            f"{min(p.fair_min for p in runs)}/{max(p.fair_max for p in runs)}",
            sum(p.errors + p.failures for p in runs),
            fmt(100 * median([p.node_busy for p in runs]), 0),
            fmt(median([p.client_cpu for p in runs]), 0),
            fmt(median([p.containerd_cpu for p in runs]), 0),
            fmt(median([p.in_flight for p in runs]), 1),
        ])  # fmt: skip
    print(table(
        ["containers", "requested/s", "cap", "probes/s per round", "median", "ratio per round",
         "median ratio", "late p50 ms", "late p99 ms", "dispatch p50 ms", "dispatch p99 ms",
         "ticks dropped %", "min/max per container", "errors+failures", "node CPU % (of 2)",
         "prober CPU %", "containerd CPU %", "execs in flight"],
        rows,
    ))  # fmt: skip
    print("\nthroughput over time (successful probes/s per 5 s bucket, last round):\n")
    for p in prober_rounds[-1]:
        print(
            f"- {p.containers} containers, cap {p.cap}: " + " ".join(fmt(b, 0) for b in p.buckets)
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one short round (smoke test)")
    parser.add_argument("--rounds", type=int)
    parser.add_argument(
        "--paired-only",
        action="store_true",
        help="only the tightly interleaved raw-vs-daemon pairs at each cap (96 containers)",
    )
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--pair-seconds", type=float, default=10.0)
    args = parser.parse_args()
    if args.quick:
        args.rounds = args.rounds or 1
        args.concurrency = [1, 4, 8, 16]
        args.containers = [80]
        args.caps = [8]
        args.raw_seconds = 6.0
        args.prober_seconds = 10.0
    elif args.paired_only:
        args.containers = [96]
        args.caps = [4, 8, 16]
    else:
        args.rounds = args.rounds or 3
        args.concurrency = [1, 2, 4, 8, 16]
        args.containers = [20, 96]
        args.caps = [4, 8, 16]
        args.raw_seconds = 10.0
        args.prober_seconds = 30.0
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
