"""Tick phases: are the workers' probe grids spread over the period, or bunched together?

    python -m bench.phases [--containers 1000]

Starts the fake CRI runtime with N running host-network containers (bench.fake_cri) and probe
targets (bench.listeners), runs the daemon in-process with a readiness httpGet and a liveness
tcpSocket probe at period 10 s (as bench.scale does), and after one period prints, per probe kind,
how the workers' grid anchors (first probe start, modulo the period) fall into 0.5 s bins. Evenly
spread workers put about 5 % into each bin; phase-locked ones put everything into one or two.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile

from bench._common import Child, fmt, listeners, ports, quiet_logs, rules_file, table
from bench.scale import PERIOD, RULES, LeanObserver
from cri_prober.probing.kinds import ProbeKind
from tests.support.daemon import running_daemon

BINS = 20


async def run(count: int) -> None:
    quiet_logs()
    with (
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
        observer = LeanObserver()
        async with (
            rules_file(RULES) as rules,
            running_daemon(
                str(fake.info["target"]), rules, ready_timeout=60, stop_timeout=60,
                listeners=[observer], pleg="relist",
            ) as (_, watcher),
        ):  # fmt: skip
            watcher.unsubscribe()  # only the observer follows the manager, as in bench.scale
            await asyncio.sleep(PERIOD + 4)
    rows = []
    for kind in (ProbeKind.READINESS, ProbeKind.LIVENESS):
        anchors = [a % PERIOD for (_, k), (a, _) in observer.grid.items() if k is kind]
        bins = [0] * BINS
        for anchor in anchors:
            bins[int(anchor / PERIOD * BINS) % BINS] += 1
        share = max(bins) / len(anchors) if anchors else 0.0
        rows.append([kind.value, len(anchors), fmt(100 * share, 1), " ".join(map(str, bins))])
    print(f"\n## Tick phases ({count} containers, period {PERIOD:g} s)\n")
    print(table(["probe", "workers", "busiest 0.5 s bin %", "workers per 0.5 s bin"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--containers", type=int, default=1000)
    args = parser.parse_args()
    asyncio.run(run(args.containers))


if __name__ == "__main__":
    main()
