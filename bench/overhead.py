"""Overhead per probe: CPU seconds per 1,000 probes, cri-prober vs a minimal asyncio loop.

    python -m bench.overhead [--quick] [--kinds http,tcp,grpc,exec]

For each probe kind, alternates (ABBA within each round) two contenders in this one process,
each driving the same number of probe loops at the same period against the same targets:

- cri-prober: the probe manager with one worker per (synthetic, host-network) container, i.e.
  worker scheduling + threshold bookkeeping + history + the prober's dispatch + the handler;
- raw: N asyncio tasks each doing the bare request once per period (asyncio open_connection
  and a minimal HTTP/1.1 GET; connect+close; grpc.aio Health/Check on a fresh channel;
  ExecSync through the generated stub).

HTTP/TCP/gRPC targets run in a separate process (bench.listeners), so only client CPU is counted
(time.process_time of this process, all threads). Exec targets are containers of a private
containerd 1.6; only this process's (client) CPU is counted for exec too.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from types import MappingProxyType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench._common import (
    Child,
    Collector,
    containerd,
    fmt,
    listeners,
    machine,
    median,
    ports,
    quiet_logs,
    say,
    table,
    tables_first,
)
from cri_prober._gen.runtime.v1 import api_pb2, api_pb2_grpc
from cri_prober.discovery.model import ContainerInfo, PodInfo
from cri_prober.manager.probe_manager import ProbeManager
from cri_prober.probing.prober import Prober
from cri_prober.probing.spec import load_rules
from cri_prober.runtime.client import CriClient
from cri_prober.runtime.model import ContainerState
from tests.support.testbed import ContainerSpec

PERIOD = 1.0
HANDLERS = {
    "http": "httpGet: {{path: /, port: {port}}}",
    "tcp": "tcpSocket: {{port: {port}}}",
    "grpc": "grpc: {{port: {port}}}",
    "exec": 'exec: {{command: ["true"]}}',
}
RULES = """
probes:
  - match: {{namespace: bench, container: app}}
    livenessProbe:
      {handler}
      periodSeconds: 1
      timeoutSeconds: {timeout}
"""
HTTP_REQUEST = (
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: kube-probe/1.34\r\nAccept: */*\r\n"
    b"Connection: close\r\n\r\n"
)


def synthetic_containers(ids: list[str]) -> list[ContainerInfo]:
    """Host-network, running containers as discovery would report them (no runtime needed)."""
    now = time.time_ns()
    out = []
    for i, cid in enumerate(ids):
        pod = PodInfo(
            sandbox_id=f"sandbox-{i}",
            name=f"pod-{i}",
            namespace="bench",
            uid=f"uid-{i}",
            attempt=0,
            ready=True,
            ip="",
            host_network=True,
            labels=MappingProxyType({}),
            annotations=MappingProxyType({}),
            created_at=now,
        )
        out.append(
            ContainerInfo(
                id=cid,
                pod_sandbox_id=pod.sandbox_id,
                name="app",
                attempt=0,
                state=ContainerState.CONTAINER_RUNNING,
                created_at=now,
                started_at=now,
                finished_at=0,
                exit_code=0,
                labels=MappingProxyType({}),
                annotations=MappingProxyType({}),
                env=None,
                pod=pod,
            )
        )
    return out


async def measure_prober(
    kind: str, port: int, cri: CriClient, ids: list[str], warmup: float, seconds: float
) -> tuple[float, int]:
    """CPU seconds and probes finished in the window, through the manager/worker/handler path."""
    timeout = 5 if kind == "exec" else 1
    rules = load_rules(
        RULES.format(handler=HANDLERS[kind].format(port=port), timeout=timeout), source="bench"
    )
    collector = Collector()
    manager = ProbeManager(prober=Prober(cri), rules=rules)
    manager.events.subscribe(collector)
    manager.reconcile(synthetic_containers(ids))
    try:
        await asyncio.sleep(warmup)
        before = len(collector.attempts)
        cpu0 = time.process_time()
        await asyncio.sleep(seconds)
        cpu = time.process_time() - cpu0
        attempts = collector.attempts[before:]
    finally:
        await manager.shutdown(5)
    bad = [a for a in attempts if a.result != "success"]
    if bad:
        say(f"  {len(bad)} of {len(attempts)} {kind} probes not successful: {bad[0].result}")
    return cpu, len(attempts)


def raw_probe(
    kind: str, port: int, stub: api_pb2_grpc.RuntimeServiceAsyncStub | None
) -> Callable[[str], Awaitable[bool]]:
    """The minimal hand-written request for ``kind``; returns whether it succeeded."""
    loop = asyncio.get_running_loop()
    health_request = health_pb2.HealthCheckRequest(service="")

    async def http(_cid: str) -> bool:
        async with asyncio.timeout(1):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(HTTP_REQUEST)
                data = await reader.read()
            finally:
                writer.close()
        return data.startswith(b"HTTP/1.1 2")

    async def tcp(_cid: str) -> bool:
        async with asyncio.timeout(1):
            transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
        transport.close()
        return True

    async def grpc_check(_cid: str) -> bool:
        async with grpc.aio.insecure_channel(f"ipv4:127.0.0.1:{port}") as channel:
            response = await health_pb2_grpc.HealthStub(channel).Check(health_request, timeout=1)
        return bool(response.status == health_pb2.HealthCheckResponse.SERVING)

    async def exec_sync(cid: str) -> bool:
        assert stub is not None
        response = await stub.ExecSync(
            api_pb2.ExecSyncRequest(container_id=cid, cmd=["true"], timeout=5), timeout=7
        )
        return response.exit_code == 0

    return {"http": http, "tcp": tcp, "grpc": grpc_check, "exec": exec_sync}[kind]


async def measure_raw(
    kind: str,
    port: int,
    stub: api_pb2_grpc.RuntimeServiceAsyncStub | None,
    ids: list[str],
    warmup: float,
    seconds: float,
) -> tuple[float, int]:
    """CPU seconds and requests finished in the window, N bare loops on the same period."""
    probe = raw_probe(kind, port, stub)
    loop = asyncio.get_running_loop()
    counting = False
    done = 0
    failed = 0

    async def one(cid: str) -> None:
        nonlocal done, failed
        next_tick = loop.time() + random.uniform(0, PERIOD)
        while True:
            await asyncio.sleep(max(0.0, next_tick - loop.time()))
            next_tick += PERIOD
            try:
                ok = await probe(cid)
            except (OSError, TimeoutError, grpc.aio.AioRpcError):
                ok = False
            if counting:
                done += 1
                failed += not ok

    tasks = [asyncio.create_task(one(cid)) for cid in ids]
    try:
        await asyncio.sleep(warmup)
        counting = True
        cpu0 = time.process_time()
        await asyncio.sleep(seconds)
        cpu = time.process_time() - cpu0
        counting = False
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if failed:
        say(f"  {failed} of {done} raw {kind} requests failed")
    return cpu, done


async def run(args: argparse.Namespace) -> None:
    quiet_logs()
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in args.kinds}
    # The tables of what was measured come first, even when a stop or a later window
    # fails: that failure follows them (issue 35).
    with tables_first(lambda: report(args, results)), listeners(http=1, tcp=1, grpc=1) as child:
        if "exec" in args.kinds:
            async with containerd("1.6") as testbed, testbed.pods() as pods:
                say(f"creating {args.exec_containers} pods")
                exec_ids = []
                for i in range(args.exec_containers):
                    pod = await pods.create_pod(
                        f"overhead-{i:02d}", namespace="bench", containers=[ContainerSpec("app")]
                    )
                    exec_ids.append(pod.container_ids["app"])
                await rounds(args, child, testbed.endpoint, exec_ids, results)
        else:
            await rounds(args, child, None, [], results)


async def rounds(
    args: argparse.Namespace,
    child: Child,
    endpoint: str | None,
    exec_ids: list[str],
    results: dict[str, list[tuple[float, float]]],
) -> None:
    cri = CriClient.connect(endpoint or "unix:///nonexistent")
    channel = grpc.aio.insecure_channel(endpoint) if endpoint else None
    stub = api_pb2_grpc.RuntimeServiceStub(channel) if channel is not None else None
    try:
        for round_no in range(args.rounds):
            for kind in args.kinds:
                port = ports(child, kind)[0] if kind != "exec" else 0
                ids = exec_ids if kind == "exec" else [f"c{i:04d}" for i in range(args.workers)]
                seconds = args.exec_seconds if kind == "exec" else args.seconds
                order = ["prober", "raw"] if round_no % 2 == 0 else ["raw", "prober"]
                per: dict[str, float] = {}
                for contender in order:
                    if contender == "prober":
                        cpu, n = await measure_prober(kind, port, cri, ids, 2.0, seconds)
                    else:
                        cpu, n = await measure_raw(kind, port, stub, ids, 2.0, seconds)
                    per[contender] = 1000 * cpu / max(n, 1)
                    say(
                        f"round {round_no + 1} {kind} {contender}: {n} probes,"
                        f" {per[contender]:.3f} CPU s per 1000"
                    )
                results[kind].append((per["prober"], per["raw"]))
    finally:
        await cri.close()
        if channel is not None:
            await channel.close()


def report(args: argparse.Namespace, results: dict[str, list[tuple[float, float]]]) -> None:
    print(f"\n## Overhead per probe ({machine()})\n")
    print(
        f"rounds: {args.rounds} (ABBA order); {args.workers} loops at 1 s for http/tcp/grpc"
        f" ({args.seconds:g} s windows), {args.exec_containers} containers for exec"
        f" ({args.exec_seconds:g} s windows)\n"
    )
    rows = []
    for kind, runs in results.items():
        ratios = [p / r for p, r in runs]
        rows.append(
            [
                kind,
                " / ".join(fmt(p, 3) for p, _ in runs),
                " / ".join(fmt(r, 3) for _, r in runs),
                fmt(median([p for p, _ in runs]), 3),
                fmt(median([r for _, r in runs]), 3),
                " / ".join(fmt(x, 2) for x in ratios),
                fmt(median(ratios), 2),
            ]
        )
    print(
        table(
            [
                "probe",
                "cri-prober CPU s/1000 per round",
                "raw CPU s/1000 per round",
                "cri-prober median",
                "raw median",
                "ratio per round",
                "median ratio",
            ],
            rows,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one short round (smoke test)")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--kinds", default="http,tcp,grpc,exec")
    args = parser.parse_args()
    args.kinds = args.kinds.split(",")
    if args.quick:
        args.rounds = args.rounds or 1
        args.workers = 100
        args.seconds = 5.0
        args.exec_containers = 10
        args.exec_seconds = 6.0
    else:
        args.rounds = args.rounds or 4
        args.workers = 200
        args.seconds = 10.0
        args.exec_containers = 20
        args.exec_seconds = 15.0
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
