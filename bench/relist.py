"""Relist cost: discovery's steady-state relists on the fake CRI runtime, with nothing changing.

    python -m bench.relist [--quick] [--sizes 500,1000,...] [--repeats R] [--window S]

For each size N, with the fake runtime (bench.fake_cri) serving N host-network pods of one
container each from a child process, it times R steady relists (CPU of this process and wall),
then R more split into the List RPCs (gRPC + parse), the client's conversion and discovery's diff.
Then it runs discovery S seconds relisting every 1 s and S seconds in events mode, reporting CPU
ms per second (less the stall sampler's own cost) and the longest event-loop stall.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._common import Child, fmt, machine, median, quiet_logs, say, table, tables_first
from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.discovery.pleg import DEFAULT_SAFETY_RELIST_PERIOD, Discovery
from cri_prober.discovery.source import DiscoveryUpdate, ViewChanged
from cri_prober.runtime import convert
from cri_prober.runtime.client import CriClient

# How often the stall sampler wakes up; its own cost is measured and taken off the modes' CPU.
STALL_TICK = 0.02


@dataclass
class Meter:
    """CPU and wall seconds summed over the timed calls of one relist."""

    cpu: float = 0.0
    wall: float = 0.0

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        cpu, wall = time.process_time(), time.monotonic()
        try:
            yield
        finally:
            self.cpu += time.process_time() - cpu
            self.wall += time.monotonic() - wall


@dataclass
class SizeResult:
    containers: int
    cpu: list[float] = field(default_factory=list)  # ms per steady relist
    wall: list[float] = field(default_factory=list)
    rpc_cpu: list[float] = field(default_factory=list)  # the two List calls: gRPC + parse
    rpc_wall: list[float] = field(default_factory=list)
    convert_cpu: list[float] = field(default_factory=list)  # the rest of list_*
    diff_cpu: list[float] = field(default_factory=list)  # the rest of the relist
    parse_cpu: float = math.nan  # ms, FromString of both responses alone
    lean_parse_cpu: float = math.nan  # ms, the same parsing only each item's ID and state
    first_relist_s: float = math.nan
    view_changed: int = 0  # ViewChanged published by steady relists (should be 0)
    idle_cpu: float = math.nan  # ms of CPU per second with discovery not running (the sampler)
    relist_mode_cpu: float = math.nan  # ms of CPU per second, relisting every 1 s
    relist_mode_stall: float = math.nan  # ms, the longest event-loop stall in that window
    events_mode_cpu: float = math.nan  # ms of CPU per second, events mode, no events
    events_mode_stall: float = math.nan


def _timed_rpcs(call: Callable[..., Awaitable[Any]], meter: Meter) -> Callable[..., Awaitable[Any]]:
    """The client's one-RPC runner, timing the two List calls (send, wait, receive, parse)."""

    async def timed(method: str, rpc: Callable[[], Awaitable[Any]]) -> Any:
        if method not in ("ListPodSandbox", "ListContainers"):
            return await call(method, rpc)
        with meter.timing():
            return await call(method, rpc)

    return timed


def _timed_list(method: Callable[[], Awaitable[Any]], meter: Meter) -> Callable[[], Awaitable[Any]]:
    async def timed() -> Any:
        with meter.timing():
            return await method()

    return timed


async def _parse_cost(cri: CriClient, repeats: int) -> tuple[float, float]:
    """CPU ms to parse the two list responses from their bytes (no network, no conversion):
    as full messages, and as the client's ID-and-state listings (NaN where it has none)."""
    stub: Any = cri._stub  # the benchmark looks under the client on purpose
    sandboxes = (await stub.ListPodSandbox(api_pb2.ListPodSandboxRequest())).SerializeToString()
    containers = (await stub.ListContainers(api_pb2.ListContainersRequest())).SerializeToString()
    lean = (
        getattr(convert, "LeanSandboxList", None),
        getattr(convert, "LeanContainerList", None),
    )
    costs = []
    for sandbox_list, container_list in (
        (api_pb2.ListPodSandboxResponse, api_pb2.ListContainersResponse),
        lean,
    ):
        if sandbox_list is None or container_list is None:
            costs.append(math.nan)
            continue
        cpus = []
        for _ in range(repeats):
            cpu = time.process_time()
            sandbox_list.FromString(sandboxes)
            container_list.FromString(containers)
            cpus.append(time.process_time() - cpu)
        costs.append(1000 * median(cpus))
    return costs[0], costs[1]


async def _steady(
    discovery: Discovery, mode: str | None, seconds: float, settle: float = 2.0
) -> tuple[float, float]:
    """(CPU ms per second, longest loop stall ms) of discovery running alone in ``mode``.

    With ``mode`` None discovery does not run: that is the stall sampler's own cost.
    """
    stop = asyncio.Event()
    stalls: list[float] = []
    task = asyncio.create_task(
        discovery.run(mode, stop=stop) if mode else stop.wait()  # type: ignore[arg-type]
    )
    loop = asyncio.get_running_loop()
    await asyncio.sleep(settle)  # events mode's relist on connect, relist mode's first relist
    cpu, wall = time.process_time(), time.monotonic()
    end = wall + seconds
    while loop.time() < end:
        before = loop.time()
        await asyncio.sleep(STALL_TICK)
        stalls.append(loop.time() - before - STALL_TICK)
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    stop.set()
    await task
    return 1000 * cpu / wall, 1000 * max(stalls, default=math.nan)


async def run_size(count: int, repeats: int, window: float, tmp: Path) -> SizeResult:
    result = SizeResult(count)
    socket = tmp / f"fake-{count}.sock"
    with Child(
        [
            "-m", "bench.fake_cri", "--socket", str(socket), "--containers", str(count),
            "--http-ports", "1", "--tcp-ports", "2",
        ],
        ready_timeout=300,
    ) as fake:  # fmt: skip
        async with CriClient.connect(str(fake.info["target"])) as cri:
            discovery = Discovery(cri)
            started = time.monotonic()
            await discovery.relist()  # the first one fetches every status
            result.first_relist_s = time.monotonic() - started
            assert len(discovery.containers()) == count, len(discovery.containers())

            def changed(update: DiscoveryUpdate) -> None:
                if isinstance(update, ViewChanged):
                    result.view_changed += 1

            discovery.updates.subscribe(changed)
            for _ in range(3):  # warm-up
                await discovery.relist()
            for _ in range(repeats):
                cpu, wall = time.process_time(), time.monotonic()
                await discovery.relist()
                result.cpu.append(1000 * (time.process_time() - cpu))
                result.wall.append(1000 * (time.monotonic() - wall))

            # The split, in separate relists so its wrappers cost the plain figures nothing.
            rpc, lists = Meter(), Meter()
            cri_any: Any = cri  # the benchmark looks under the client on purpose
            cri_any._call = _timed_rpcs(cri._call, rpc)
            cri_any.list_pod_sandboxes = _timed_list(cri.list_pod_sandboxes, lists)
            cri_any.list_containers = _timed_list(cri.list_containers, lists)
            for _ in range(repeats):
                rpc.cpu = rpc.wall = lists.cpu = lists.wall = 0.0
                cpu = time.process_time()
                await discovery.relist()
                cpu = time.process_time() - cpu
                result.rpc_cpu.append(1000 * rpc.cpu)
                result.rpc_wall.append(1000 * rpc.wall)
                result.convert_cpu.append(1000 * (lists.cpu - rpc.cpu))
                result.diff_cpu.append(1000 * (cpu - lists.cpu))
        # A fresh client for the rest: this one's methods are wrapped.
        async with CriClient.connect(str(fake.info["target"])) as cri:
            result.parse_cpu, result.lean_parse_cpu = await _parse_cost(cri, repeats)
            discovery = Discovery(cri)
            await discovery.relist()
            discovery.updates.subscribe(changed)
            result.idle_cpu, _ = await _steady(discovery, None, window)
            result.relist_mode_cpu, result.relist_mode_stall = await _steady(
                discovery, "relist", window
            )
            result.events_mode_cpu, result.events_mode_stall = await _steady(
                discovery, "events", window
            )
    return result


async def run(args: argparse.Namespace) -> None:
    quiet_logs()
    results: list[SizeResult] = []
    # The tables of what was measured come first, even when a stop or a later size fails:
    # that failure follows them (issue 35).
    with (
        tables_first(lambda: report(args, results)),
        tempfile.TemporaryDirectory(prefix="cprb-relist-") as tmp,
    ):
        for count in args.sizes:
            say(
                f"{count} containers: {args.repeats} steady relists,"
                f" then {args.window:g} s per mode"
            )
            results.append(await run_size(count, args.repeats, args.window, Path(tmp)))
            r = results[-1]
            say(
                f"  steady relist CPU {median(r.cpu):.1f} ms, wall {median(r.wall):.1f} ms;"
                f" relist mode {r.relist_mode_cpu:.1f} ms/s, events mode {r.events_mode_cpu:.1f}"
                " ms/s"
            )


def report(args: argparse.Namespace, results: list[SizeResult]) -> None:
    print(f"\n## Relist cost on the fake CRI runtime ({machine()})\n")
    print(
        f"Steady-state relists (nothing changed), medians of {args.repeats}; discovery alone in"
        f" this process, the fake runtime in another. Modes run {args.window:g} s each.\n"
    )
    rows = [
        [
            r.containers, fmt(median(r.cpu), 1), fmt(median(r.wall), 1),
            fmt(median(r.rpc_cpu), 1), fmt(median(r.rpc_wall), 1), fmt(r.parse_cpu, 1),
            fmt(r.lean_parse_cpu, 1),
            fmt(median(r.convert_cpu), 1), fmt(median(r.diff_cpu), 1), r.view_changed,
            fmt(r.relist_mode_cpu - r.idle_cpu, 1), fmt(r.relist_mode_stall, 0),
            fmt(r.events_mode_cpu - r.idle_cpu, 2), fmt(r.events_mode_stall, 0),
            fmt(
                r.events_mode_cpu - r.idle_cpu + median(r.cpu) / DEFAULT_SAFETY_RELIST_PERIOD, 2
            ),
            fmt(r.idle_cpu, 1),
            fmt(r.first_relist_s, 1),
        ]
        for r in results
    ]  # fmt: skip
    print(
        table(
            [
                "containers", "relist CPU ms", "relist wall ms", "List RPCs CPU ms",
                "List RPCs wall ms", "full parse alone CPU ms", "ID+state parse alone CPU ms",
                "convert CPU ms", "diff CPU ms",
                "ViewChanged", "relist mode CPU ms/s", "relist mode max stall ms",
                "events mode CPU ms/s", "events mode max stall ms",
                "events mode + safety relist CPU ms/s", "sampler CPU ms/s (taken off)",
                "first relist s",
            ],
            rows,
        )
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="500 and 5,000 containers")
    parser.add_argument("--sizes")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--window", type=float, help="seconds per discovery mode")
    args = parser.parse_args()
    default_sizes = "500,5000" if args.quick else "500,1000,2000,5000,10000"
    args.sizes = [int(x) for x in (args.sizes or default_sizes).split(",")]
    args.repeats = args.repeats or (10 if args.quick else 20)
    args.window = args.window or (10.0 if args.quick else 20.0)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
