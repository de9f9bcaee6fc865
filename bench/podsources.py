"""What one poll of a --probes-from source costs, with and without skipping unchanged pods.

A kubelet's /pods lists every pod on the node with full specs and statuses, and the kubelet and
manifests sources read it every 2 s. Each poll decodes the JSON (off the loop), then hands the
items, keyed and digested in the same thread, to ``replace_all``, which parses on the loop only
pods whose object changed since the last poll. This benchmark measures the loop's share, side by
side in interleaved rounds, of a poll where one pod's status changed (the usual case) against the
same poll parsing every pod again (no diffing), on the recorded
kubelet v1.28.7 pods multiplied to a node's worth; it reports medians and their ratio.

    python -m bench.podsources [--quick] [--pods N ...]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import time
from pathlib import Path
from typing import Any

from bench._common import fmt, machine, median, quiet_logs, say, table
from cri_prober.podspecs.source import Changed, PodSource, prepare

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "kubelet-1.28.7"


class _Source(PodSource):
    async def run(self, changed: Changed) -> None:  # pragma: no cover - never run here
        await asyncio.Event().wait()


def node_pods(count: int) -> list[dict[str, Any]]:
    """``count`` pods made from the recorded ones, each with its own name and UID."""
    recorded = json.loads((FIXTURE / "pods-running.json").read_text())["items"]
    pods = []
    for index in range(count):
        pod = copy.deepcopy(recorded[index % len(recorded)])
        pod["metadata"]["name"] = f"{pod['metadata']['name']}-{index}"
        pod["metadata"]["uid"] = f"uid-{index:06d}"
        pods.append(pod)
    return pods


def one_round(pods: list[dict[str, Any]], diffing: _Source) -> tuple[float, float, float]:
    """Seconds of loop time for a diffing poll and for a full-reparse poll of the same body."""
    # One pod's status changes between polls, as a probe result or restart would change it.
    pods[0]["status"]["phase"] = "Pending" if pods[0]["status"]["phase"] == "Running" else "Running"
    body = json.dumps({"kind": "PodList", "items": pods}).encode()
    # Decoding runs in a worker thread in the sources; what runs on the loop is replace_all.
    items, fresh_items = json.loads(body)["items"], json.loads(body)["items"]
    start = time.perf_counter()
    prepared = prepare(items)  # in the worker thread, with the decoding
    in_thread = time.perf_counter() - start
    start = time.perf_counter()
    diffing.replace_all(prepared)
    with_diff = time.perf_counter() - start
    start = time.perf_counter()
    _Source("full", stale_after=10).replace_all(fresh_items)
    without = time.perf_counter() - start
    return with_diff, without, in_thread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--pods", type=int, nargs="*", default=[110, 250])
    args = parser.parse_args()
    quiet_logs()
    rounds = 10 if args.quick else 40
    say(f"machine: {machine()}; {rounds} interleaved rounds per size")
    rows = []
    for count in args.pods:
        pods = node_pods(count)
        body = json.dumps({"kind": "PodList", "items": pods}).encode()
        diffing = _Source("diffing", stale_after=10)
        diffing.replace_all(json.loads(body)["items"])
        results = [one_round(pods, diffing) for _ in range(rounds)]
        with_diff = median([r[0] for r in results])
        without = median([r[1] for r in results])
        in_thread = median([r[2] for r in results])
        start = time.perf_counter()
        for _ in range(rounds):
            json.loads(body)
        decode = (time.perf_counter() - start) / rounds
        rows.append(
            (
                count,
                f"{len(body) / 1024:.0f} KiB",
                fmt(decode * 1000) + " ms",
                fmt(in_thread * 1000) + " ms",
                fmt(with_diff * 1000) + " ms",
                fmt(without * 1000) + " ms",
                fmt(without / with_diff, 1) + "x",
                fmt(with_diff / 2 * 1000, 1) + " ms/s",
            )
        )
    print(
        table(
            (
                "pods",
                "/pods body",
                "JSON decode (thread)",
                "keys, digests (thread)",
                "poll, diffing",
                "poll, full reparse",
                "ratio",
                "loop time per s at 2 s polls",
            ),
            rows,
        )
    )


if __name__ == "__main__":
    main()
