"""Tick phases: are the workers' probe grids spread over the period, or bunched together?

    python -m bench.phases [--containers 1000]

Starts the fake CRI runtime with N running host-network containers (bench.fake_cri) and probe
targets (bench.listeners), runs the daemon in-process with a readiness httpGet and a liveness
tcpSocket probe at period 10 s (as bench.scale does), and after three periods prints, per probe
kind, how the workers' phases (their latest start, modulo the period) fall into 0.5 s bins.
Evenly spread workers put about 5 % into each bin; phase-locked ones put everything into one or
two. (A worker's first starts say little: its first step and the readiness trigger its pod's
first sync sends come before it settles on its phase.)
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile

from bench._common import (
    Child,
    fmt,
    listeners,
    ports,
    quiet_logs,
    rules_file,
    table,
    tables_first,
)
from bench.scale import PERIOD, RULES
from cri_prober.manager.events import AttemptFinished, ManagerEvent
from cri_prober.probing.kinds import ProbeKind
from tests.support.daemon import running_daemon

BINS = 20


async def run(count: int) -> None:
    quiet_logs()
    latest: dict[tuple[str, ProbeKind], float] = {}
    with (
        # The table comes first, even when the daemon's stop fails: that failure follows it.
        tables_first(lambda: report(count, latest)),
        tempfile.TemporaryDirectory(prefix="cprb-phases-") as tmp,
        listeners(http=8, tcp=8, grpc=0) as targets,
        Child(
            [
                "-m", "bench.fake_cri", "--socket", f"{tmp}/fake.sock",
                "--containers", str(count),
                "--http-ports", ",".join(map(str, ports(targets, "http"))),
                "--tcp-ports", ",".join(map(str, ports(targets, "tcp"))),
            ]
        ) as fake,
    ):  # fmt: skip

        def observe(event: ManagerEvent) -> None:
            if isinstance(event, AttemptFinished):
                latest[event.container.id, event.kind] = event.record.started_at

        async with (
            rules_file(RULES) as rules,
            running_daemon(
                str(fake.info["target"]), rules, ready_timeout=60, stop_timeout=60,
                listeners=[observe], pleg="relist",
            ) as (_, watcher),
        ):  # fmt: skip
            watcher.unsubscribe()  # only the observer follows the manager, as in bench.scale
            await asyncio.sleep(3 * PERIOD + 4)


def report(count: int, latest: dict[tuple[str, ProbeKind], float]) -> None:
    """Where the workers' latest ticks fall in the period, in 0.5 s bins."""
    rows = []
    for kind in (ProbeKind.READINESS, ProbeKind.LIVENESS):
        phases = [start % PERIOD for (_, k), start in latest.items() if k is kind]
        bins = [0] * BINS
        for phase in phases:
            bins[int(phase / PERIOD * BINS) % BINS] += 1
        share = max(bins) / len(phases) if phases else 0.0
        rows.append([kind.value, len(phases), fmt(100 * share, 1), " ".join(map(str, bins))])
    print(f"\n## Tick phases ({count} containers, period {PERIOD:g} s)\n")
    print(table(["probe", "workers", "busiest 0.5 s bin %", "workers per 0.5 s bin"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--containers", type=int, default=1000)
    args = parser.parse_args()
    asyncio.run(run(args.containers))


if __name__ == "__main__":
    main()
