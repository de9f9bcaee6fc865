"""Detection latency: a container exits → cri-prober publishes its readiness failure.

    python -m bench.detection [--quick] [--rounds R] [--batch B]

Starts private containerd 1.6 (discovery relists every 1 s) and 2.1 (discovery follows
GetContainerEvents), and alternates between them (one batch of B exits on 1.6, then one on 2.1,
R rounds). Each batch runs the daemon in-process against that runtime, with an exec readiness
probe (``true``, every 1 s) on B fresh pods; once every pod is ready, their containers are made
to exit one at a time (``kill 1`` through ExecSync; PID 1 traps TERM and exits 3), at random
moments so exits do not line up with the relist grid. For each exit, against the runtime's own
``finished_at``, it records when:

- discovery reported the container ``died`` (the manager's derived ready/serving state, and so
  the Health service, flips here);
- the manager published readiness FAILURE (in-process observer; this waits for the worker's
  next tick, so it adds up to one probe period);
- the same transition arrived on a ``WatchTransitions`` stream of the local API, when
  ``cri_prober.serving.server`` can be started (otherwise the report says so).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import operator
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial

import grpc

from bench._common import (
    Collector,
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
from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.daemon import Daemon
from cri_prober.discovery.model import EventKind
from cri_prober.discovery.source import DiscoveryUpdate, ViewChanged
from cri_prober.manager.events import ResultChanged
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.results import Published
from tests.support.daemon import running_daemon
from tests.support.testbed import ContainerSpec, PodFactory, Testbed
from tests.support.waiting import until

RULES = """
probes:
  - match: {namespace: bench, pod: "det-*", container: app}
    readinessProbe:
      exec: {command: ["true"]}
      periodSeconds: 1
"""
APP = ContainerSpec(
    "app", command=["sh", "-c", 'trap "exit 3" TERM; while :; do sleep 3600 & wait $!; done']
)


@dataclass
class Exit:
    version: str
    mode: str
    finished_at: float  # the runtime's finished_at, wall seconds
    died: float  # discovery's died event
    published: float  # readiness FAILURE published (observer)
    streamed: float | None  # the same transition on WatchTransitions


@contextlib.asynccontextmanager
async def transition_stream(daemon: Daemon, arrivals: dict[str, float]) -> AsyncIterator[str]:
    """Follow WatchTransitions on the daemon's own API; yields "" or why it could not be used."""
    try:
        from cri_prober._gen.criprober.v1 import query_pb2, query_pb2_grpc  # optional: the API
    except ImportError as exc:
        yield f"{type(exc).__name__}: {exc}"
        return
    channel = grpc.aio.insecure_channel(daemon.config.listen)
    stub = query_pb2_grpc.CriProberStub(channel)
    call = stub.WatchTransitions(query_pb2.WatchTransitionsRequest())

    async def follow() -> None:
        async for transition in call:
            if (
                transition.kind == "readiness"
                and transition.result == "failure"
                and transition.previous == "success"  # not the initial value of a new container
            ):
                arrivals.setdefault(transition.container_id, time.time())

    task = asyncio.create_task(follow())
    try:
        # The stream sends nothing until a transition happens: check that it is open at all.
        await asyncio.wait_for(channel.channel_ready(), 10)
        await asyncio.sleep(0.2)
        if task.done() and task.exception() is not None:
            yield f"WatchTransitions failed: {task.exception()}"
        else:
            yield ""
    except TimeoutError:
        yield f"the daemon's API at {daemon.config.listen} did not answer"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await task
        await channel.close()


async def batch(
    testbed: Testbed, pods: PodFactory, size: int, tag: str
) -> tuple[list[Exit], str, str]:
    """One daemon run with ``size`` exits; returns the exits, discovery mode and API note."""
    collector = Collector()
    died: dict[str, float] = {}
    arrivals: dict[str, float] = {}
    published: dict[str, float] = {}

    def on_transition(now: float, change: ResultChanged) -> None:
        if (
            change.kind is ProbeKind.READINESS
            and change.result is Published.FAILURE
            and change.previous is Published.SUCCESS
        ):
            published.setdefault(change.container.id, now)

    collector.on_transition = on_transition

    def on_update(update: DiscoveryUpdate) -> None:
        if isinstance(update, ViewChanged):
            for event in update.events:
                if event.kind is EventKind.DIED and event.container is not None:
                    died.setdefault(event.container.id, time.time())

    exits: list[Exit] = []
    async with (
        rules_file(RULES) as rules,
        running_daemon(
            testbed.endpoint, rules, ready_timeout=60, stop_timeout=60, listeners=[collector],
            relist_period=1.0,
        ) as (daemon, watcher),
    ):  # fmt: skip
        mode = str(daemon.discovery.effective_mode)
        unsubscribe = daemon.discovery.updates.subscribe(on_update)
        async with transition_stream(daemon, arrivals) as api_note:
            created = [
                await pods.create_pod(f"det-{tag}-{i}", namespace="bench", containers=[APP])
                for i in range(size)
            ]
            ids = [pod.container_ids["app"] for pod in created]
            results = daemon.manager.results
            await watcher.until(
                lambda: all(results.get(c, ProbeKind.READINESS) is Published.SUCCESS for c in ids),
                60,
            )
            for cid in ids:
                await asyncio.sleep(random.uniform(0.3, 1.3))
                # PID 1 traps TERM and exits 3: a crash of the container's own process.
                await pods.runtime.ExecSync(
                    api_pb2.ExecSyncRequest(container_id=cid, cmd=["kill", "1"], timeout=5),
                    timeout=10,
                )
                await watcher.until(partial(operator.contains, published, cid), 30)
                if not api_note:
                    # The stream's task sets it: poll.
                    with contextlib.suppress(TimeoutError):
                        await until(partial(operator.contains, arrivals, cid), timeout=5, poll=0.01)
                status = await pods.container_status(cid)
                exits.append(
                    Exit(
                        version=testbed.version,
                        mode=mode,
                        finished_at=status.finished_at / 1e9,
                        died=died.get(cid, float("nan")),
                        published=published[cid],
                        streamed=arrivals.get(cid),
                    )
                )
            unsubscribe()
        for pod in created:
            await pods.remove_pod(pod)
    return exits, mode, api_note


async def run(args: argparse.Namespace) -> None:
    quiet_logs()
    exits: list[Exit] = []
    modes: dict[str, str] = {}
    notes: set[str] = set()
    # The tables of what was measured come first, even when a stop or a later window
    # fails: that failure follows them (issue 35).
    with tables_first(lambda: report(args, exits, modes, notes)):
        async with (
            containerd("1.6") as tb16,
            containerd("2.1") as tb21,
            tb16.pods() as pods16,
            tb21.pods() as pods21,
        ):
            for round_no in range(args.rounds):
                for testbed, pods in ((tb16, pods16), (tb21, pods21)):
                    say(f"round {round_no + 1}: {args.batch} exits on containerd {testbed.version}")
                    got, mode, note = await batch(
                        testbed,
                        pods,
                        args.batch,
                        f"{round_no}-{testbed.version.replace('.', '')}",
                    )
                    modes[testbed.version] = mode
                    notes.add(note)
                    exits.extend(got)
                    say(
                        "  published after exit (ms): "
                        + " ".join(f"{1000 * (e.published - e.finished_at):.0f}" for e in got)
                    )


def report(
    args: argparse.Namespace, exits: list[Exit], modes: dict[str, str], notes: set[str]
) -> None:
    print(f"\n## Detection latency ({machine()})\n")
    note = " ".join(n for n in notes if n)
    print(
        f"{args.rounds} rounds x {args.batch} exits per runtime, alternating; readiness exec"
        f" probe every 1 s; latencies in ms after the runtime's finished_at."
        + (f" WatchTransitions unavailable: {note}" if note else "")
        + "\n"
    )
    rows = []
    for version in ("1.6", "2.1"):
        mine = [e for e in exits if e.version == version]
        died = [1000 * (e.died - e.finished_at) for e in mine]
        pub = [1000 * (e.published - e.finished_at) for e in mine]
        streamed = [1000 * (e.streamed - e.finished_at) for e in mine if e.streamed is not None]
        tick = [1000 * (e.published - e.died) for e in mine]
        rows.append(
            [
                version, modes.get(version, "?"), len(mine),
                fmt(pct(died, 50), 0), fmt(pct(died, 99), 0), fmt(max(died, default=0), 0),
                fmt(pct(pub, 50), 0), fmt(pct(pub, 99), 0), fmt(max(pub, default=0), 0),
                fmt(pct(streamed, 50), 0), fmt(pct(streamed, 99), 0), len(streamed),
                fmt(pct(tick, 50), 0),
            ]
        )  # fmt: skip
    print(
        table(
            [
                "containerd", "discovery", "exits", "died p50", "died p99", "died max",
                "published p50", "published p99", "published max", "WatchTransitions p50",
                "WatchTransitions p99", "streamed", "died→published p50",
            ],
            rows,
        )
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2 rounds x 3 exits per runtime")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--batch", type=int)
    args = parser.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 6)
    args.batch = args.batch or (3 if args.quick else 5)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
