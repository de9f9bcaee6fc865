"""Exec fairness: how late a period-1 exec probe gets beside containers whose exec probes hang.

    python -m bench.exec_fairness [--before REV] [--hogs 16 64] [--window 30] [--rounds 1]

Starts a private containerd (1.7 by default), creates tenant pods of 4 containers whose two exec
probes each run ``sleep 3600`` (timeoutSeconds 3600, period 1) and a canary pod with an exec
readiness probe ``true`` (period 1), then runs the cri-prober daemon in a child process for
``--window`` seconds from its start, once per hog count and code version: this tree, and with
``--before`` the ``cri_prober`` package of that git revision (``git archive``), in the same run,
rounds interleaved. Reports the canary's attempts, when its first verdict came (from the
daemon's start: the canary is as new as the hogs then), its largest gap between attempt starts
(window edges included, and from its first attempt on), and how late its later verdicts came
(p50/p99/max), side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from io import BytesIO
from pathlib import Path
from typing import Any

from bench._common import (
    containerd,
    fmt,
    machine,
    pct,
    quiet_logs,
    rules_file,
    say,
    table,
    tables_first,
)
from tests.support.testbed import ContainerSpec

ROOT = Path(__file__).resolve().parent.parent
HOG = {"exec": {"command": ["sleep", "3600"]}, "timeoutSeconds": 3600, "periodSeconds": 1}
TENANT_CONTAINERS = 4
RULES = """
probes:
  - match: {{namespace: bench, pod: "tenant-*", container: "app-*", labels: {{{label}: "yes"}}}}
    livenessProbe: {hog}
    readinessProbe: {hog}
  - match: {{namespace: bench, pod: canary, container: app}}
    readinessProbe:
      exec: {{command: ["true"]}}
      periodSeconds: 1
"""


def in_first(hogs: int) -> str:
    """The label of the tenant pods that make up the first ``hogs`` hanging containers."""
    return f"first-{hogs}"


# -- the child: one daemon run ------------------------------------------------------------------


async def child(endpoint: str, hogs: int, window: float) -> dict[str, object]:
    """Run the daemon (whichever ``cri_prober`` is on the path) and time the canary."""
    from cri_prober.probing.kinds import ProbeKind
    from tests.support.daemon import running_daemon

    quiet_logs()
    rules = RULES.format(label=in_first(hogs), hog=json.dumps(HOG))
    async with (
        rules_file(rules) as path,
        running_daemon(endpoint, path, relist_period=0.5) as (daemon, _watcher),
    ):
        ready = time.time()
        most_held = 0
        end = ready + window
        while time.time() < end:
            most_held = max(most_held, daemon.cri.execs_in_flight)
            await asyncio.sleep(0.05)
        manager: Any = daemon.manager
        if hasattr(manager, "probed"):
            canary = next(p for p in manager.probed() if p.container.pod.name == "canary")
            records = list(canary.probe(ProbeKind.READINESS).history)
        else:  # a tree from before the manager's split (bench/README: side by side)
            slot = next(s for s in manager.slots() if s.pod.name == "canary")
            records = list(slot.workers[ProbeKind.READINESS].history)
        records = [r for r in records if ready <= r.started_at < end]
        stats = {
            name: getattr(daemon.cri, name, None)
            for name in ("execs_outstanding", "exec_slot_preemptions", "exec_overruns")
        }
    starts = [r.started_at for r in records]
    edges = [ready, *starts, end]
    lates: list[float] = []
    if records:
        first = starts[0]
        for record in records:
            tick = round(record.started_at - first)
            lates.append(max(0.0, record.started_at - (first + tick)) + record.duration)
    return {
        "attempts": len(records),
        "max_gap": max(b - a for a, b in itertools.pairwise(edges)),
        # From the canary's first attempt on: it has run once, so its standing is known.
        "max_gap_after_first": max(b - a for a, b in itertools.pairwise(edges[1:])),
        "first": (starts[0] - ready + records[0].duration) if records else window,
        "late": lates[1:],
        "most_held": most_held,
        **stats,
    }


# -- the parent ---------------------------------------------------------------------------------


@contextlib.contextmanager
def package_of(revision: str) -> Iterator[Path]:
    """A directory holding ``cri_prober`` as it was at ``revision``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", revision, "cri_prober"],
        check=True,
        capture_output=True,
    ).stdout
    with tempfile.TemporaryDirectory(prefix="cprb-bench-before-") as directory:
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(directory, filter="data")
        yield Path(directory)


async def run_child(code: Path, endpoint: str, hogs: int, window: float) -> dict[str, object]:
    """One daemon run in a child process whose ``cri_prober`` comes from ``code``."""
    env = {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{ROOT}"}
    with tempfile.TemporaryDirectory(prefix="cprb-bench-cwd-") as cwd:  # nothing shadows them
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.exec_fairness",
            "--child",
            endpoint,
            "--hogs",
            str(hogs),
            "--window",
            str(window),
            cwd=cwd,
            env=env,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"child for {hogs} hogs from {code} exited {process.returncode}")
    result: dict[str, object] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def run(args: argparse.Namespace) -> None:
    quiet_logs()
    hogs_max = max(args.hogs)
    if any(h % TENANT_CONTAINERS or h > 400 for h in args.hogs):
        raise SystemExit("--hogs: multiples of 4, at most 400")
    results: dict[tuple[str, int], list[dict[str, object]]] = {}
    variants: list[tuple[str, Path]] = [("after", ROOT)]
    # The tables of what was measured come first, even when a stop or a later window
    # fails: that failure follows them (issue 35).
    with tables_first(lambda: report(args, variants, results)), contextlib.ExitStack() as stack:
        if args.before:
            old = stack.enter_context(package_of(args.before))
            variants.insert(0, (f"before ({args.before})", old))
        async with containerd(args.containerd) as testbed, testbed.pods() as pods:
            say(f"creating {hogs_max // TENANT_CONTAINERS} tenant pods and the canary")
            tenant = [ContainerSpec(f"app-{i}") for i in range(TENANT_CONTAINERS)]
            await asyncio.gather(
                *(
                    pods.create_pod(
                        f"tenant-{i:02d}",
                        namespace="bench",
                        labels={
                            in_first(h): "yes" for h in args.hogs if i < h // TENANT_CONTAINERS
                        },
                        containers=tenant,
                    )
                    for i in range(hogs_max // TENANT_CONTAINERS)
                ),
                pods.create_pod("canary", namespace="bench", containers=[ContainerSpec("app")]),
            )
            for round_ in range(args.rounds):
                for hogs in args.hogs:
                    for name, code in variants:
                        say(f"round {round_ + 1}: {name}, {hogs} hanging containers")
                        result = await run_child(code, testbed.endpoint, hogs, args.window)
                        results.setdefault((name, hogs), []).append(result)


def report(
    args: argparse.Namespace,
    variants: Sequence[tuple[str, Path]],
    results: dict[tuple[str, int], list[dict[str, object]]],
) -> None:
    """The table of every window measured (a run that failed part-way has fewer)."""
    print(f"\n{machine()}; containerd {args.containerd}; window {args.window:g} s\n")
    rows = []
    for hogs in args.hogs:
        for name, _code in variants:
            runs = results.get((name, hogs), [])
            lates = [x for r in runs for x in r["late"]]  # type: ignore[attr-defined]
            rows.append(
                [
                    hogs,
                    name,
                    "/".join(str(r["attempts"]) for r in runs),
                    "/".join(fmt(float(r["first"])) for r in runs),  # type: ignore[arg-type]
                    "/".join(fmt(float(r["max_gap"])) for r in runs),  # type: ignore[arg-type]
                    "/".join(
                        fmt(float(r["max_gap_after_first"]))  # type: ignore[arg-type]
                        for r in runs
                    ),
                    fmt(pct(lates, 50), 3),
                    fmt(pct(lates, 99), 3),
                    fmt(max(lates) if lates else math.nan, 3),
                    "/".join(str(r["most_held"]) for r in runs),
                    "/".join(str(r.get("exec_slot_preemptions")) for r in runs),
                ]
            )
    headers = [
        "hogs",
        "code",
        "canary attempts",
        "first verdict s",
        "max gap s",
        "max gap after first s",
        "late p50 s",
        "late p99 s",
        "late max s",
        "most slots held",
        "preemptions",
    ]
    print(table(headers, rows))
    if args.before:
        print()
        ratio_rows = []
        for hogs in args.hogs:
            before, after = (results.get((name, hogs), []) for name, _ in variants)
            gap_b = max(float(r["max_gap"]) for r in before)  # type: ignore[arg-type]
            gap_a = max(float(r["max_gap"]) for r in after)  # type: ignore[arg-type]
            ratio_rows.append([hogs, fmt(gap_b), fmt(gap_a), fmt(gap_b / gap_a, 1)])
        print(table(["hogs", "max gap before s", "max gap after s", "before / after"], ratio_rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="git revision to compare with (its cri_prober)")
    parser.add_argument("--hogs", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--containerd", default="1.7")
    parser.add_argument("--child", metavar="ENDPOINT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(child(args.child, args.hogs[0], args.window))))
        return
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
