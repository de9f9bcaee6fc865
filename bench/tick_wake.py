"""CPU per tick of waiting workers: the workers' tick timer vs one asyncio.sleep per target.

    bench/run tick_wake [--quick] [--ticks 100] [--rounds N] [--seconds S] [--before DIR]

Each contender is a child process on uvloop with ``--ticks`` waiters, each woken once a second
and doing nothing else, so what is measured is the wake alone (issue 36, docs/benchmarks.md "the
cost of a wake"): ``sleep`` waits with ``asyncio.sleep`` as bench.process_cpu's paced loop does;
``ticks`` waits as a probe worker does, on a future resolved by the loop's ``TickTimers``
(``LOOP_CLOCK.wake_at``). Each runs with the waiters' phases drawn at random over the second
(``jittered``: as serve's workers after start-up, one loop wake-up per tick) and all on one
phase (``aligned``: every tick served by one wake-up). ``--before DIR`` adds ``ticks-before``:
the same with the ``cri_prober`` package from DIR (e.g. ``git archive REV cri_prober``), in the
same rounds. CPU is the child's ``time.process_time`` over the window; each tick timer callback
is counted, and a tick resolved before its deadline is counted as early (there must be none).
Contenders alternate in ABBA order; no root needed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from bench._common import fmt, load_average, machine, median, say, table, tables_first

ROOT = Path(__file__).resolve().parent.parent
PERIOD = 1.0
PHASES = ("jittered", "aligned")


async def child(
    mode: str, phases: str, ticks: int, warmup: float, seconds: float
) -> dict[str, float]:
    """Run ``ticks`` waiters for the warm-up and the window; CPU and callbacks per tick."""
    from cri_prober.probing import ticks as tick_module

    loop = asyncio.get_running_loop()
    fired = [0]
    timers_fire = tick_module.TickTimers._fire

    def counted(self: tick_module.TickTimers) -> None:
        fired[0] += 1
        timers_fire(self)

    tick_module.TickTimers._fire = counted  # type: ignore[method-assign]
    done = [0]
    early = [0]
    start = loop.time() + 0.5

    async def waiter() -> None:
        deadline = start + (random.uniform(0, PERIOD) if phases == "jittered" else 0.0)
        while True:
            if mode == "sleep":
                await asyncio.sleep(max(0.0, deadline - loop.time()))
            else:
                wakeup: asyncio.Future[tick_module.Wake] = loop.create_future()
                tick_module.LOOP_CLOCK.wake_at(deadline, wakeup)
                await wakeup
            if loop.time() < deadline and mode != "sleep":
                early[0] += 1
            deadline += PERIOD
            done[0] += 1

    tasks = [asyncio.create_task(waiter()) for _ in range(ticks)]
    await asyncio.sleep(warmup)
    done0, cpu0, fired0, early0 = done[0], time.process_time(), fired[0], early[0]
    await asyncio.sleep(seconds)
    done1, cpu1, fired1, early1 = done[0], time.process_time(), fired[0], early[0]
    for task in tasks:
        task.cancel()
    count = max(1, done1 - done0)
    return {
        "ticks": done1 - done0,
        "ms_per_tick": 1000 * (cpu1 - cpu0) / count,
        "callbacks_per_tick": (fired1 - fired0) / count,
        "early": early1 - early0,
    }


def run_child(args: argparse.Namespace, contender: str, phases: str) -> dict[str, float]:
    mode = "sleep" if contender == "sleep" else "ticks"
    source = args.before if contender == "ticks-before" else ROOT
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.tick_wake",
            "--child",
            mode,
            "--phases",
            phases,
            "--ticks",
            str(args.ticks),
            "--warmup",
            str(args.warmup),
            "--seconds",
            str(args.seconds),
        ],
        cwd=source,  # ``-m`` puts the working directory first: its cri_prober is the one used
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, float] = json.loads(out.stdout.splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 short rounds")
    parser.add_argument("--ticks", type=int, default=100, help="waiters, each woken once a second")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--seconds", type=float, help="measurement window")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--before", type=Path, help="a directory holding an older cri_prober")
    parser.add_argument("--child", choices=("sleep", "ticks"), help=argparse.SUPPRESS)
    parser.add_argument("--phases", choices=PHASES, default="jittered", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        import uvloop

        result = uvloop.run(child(args.child, args.phases, args.ticks, args.warmup, args.seconds))
        print(json.dumps(result))
        return
    rounds = args.rounds or (2 if args.quick else 4)
    args.seconds = args.seconds or (5.0 if args.quick else 10.0)
    contenders = ["ticks", "sleep"] + (["ticks-before"] if args.before is not None else [])
    measured: dict[tuple[str, str], list[dict[str, float]]] = defaultdict(list)
    loads = [load_average()]

    def report() -> None:
        print(f"\n## CPU per tick of {args.ticks} waiters at 1/s ({machine()})\n")
        print(
            f"uvloop, {rounds} rounds (ABBA), {args.seconds:g} s windows after {args.warmup:g} s;"
            f" load average before: {loads[0]}, after: {load_average()}"
            + (f"; ticks-before from {args.before}" if args.before is not None else "")
            + ".\n"
        )
        rows = []
        for (contender, phases), results in measured.items():
            per = [r["ms_per_tick"] for r in results]
            rows.append(
                [
                    contender,
                    phases,
                    " / ".join(fmt(x, 3) for x in per),
                    f"**{fmt(median(per), 3)}**",
                    fmt(median([r["callbacks_per_tick"] for r in results]), 1),
                    int(sum(r["early"] for r in results)),
                ]
            )
        headers = ["contender", "phases", "CPU ms/tick per round", "median", "timer callbacks/tick"]
        print(table([*headers, "early ticks"], rows))
        sleep = measured.get(("sleep", "jittered"))
        if sleep:
            ratios = []
            for contender in contenders:
                got = measured.get((contender, "jittered"))
                if contender != "sleep" and got:
                    ratio = median([r["ms_per_tick"] for r in got]) / median(
                        [r["ms_per_tick"] for r in sleep]
                    )
                    ratios.append([f"{contender} / sleep (jittered)", f"**{fmt(ratio)}**"])
            if ratios:
                print()
                print(table(["ratio", "median"], ratios))

    with tables_first(report):
        for round_no in range(rounds):
            order = contenders if round_no % 2 == 0 else contenders[::-1]
            for contender in order:
                for phases in PHASES:
                    result = run_child(args, contender, phases)
                    measured[(contender, phases)].append(result)
                    say(
                        f"round {round_no + 1} {contender} {phases}: {result['ms_per_tick']:.3f} ms"
                        f" per tick, {result['callbacks_per_tick']:.1f} timer callbacks per tick;"
                        f" load {load_average()}"
                    )


if __name__ == "__main__":
    main()
