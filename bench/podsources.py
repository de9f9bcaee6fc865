"""What one poll of a --probes-from source costs: whole-document JSON against typed decoding.

A kubelet's /pods lists every pod on the node with full specs and statuses, and the kubelet and
manifests sources read it every 2 s. Before issue 21 a poll decoded the whole body as Python
objects (``json.loads``) and digested each pod's whole object (``json.dumps``); now it decodes
only the fields cri-prober uses (``cri_prober.podspecs.decode``) and digests those, all in a
worker thread, and parses only pods whose digest changed. This benchmark times both pipelines
side by side in interleaved rounds on the recorded kubelet v1.28.7 pods multiplied to a node's
worth (one pod's status changes between polls), and reports medians and their ratio.

    python -m bench.podsources [--quick] [--pods N ...]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from bench._common import fmt, machine, median, quiet_logs, say, table
from cri_prober.podspecs.decode import decode_pod_list
from cri_prober.podspecs.source import Changed, PodSource

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


def _whole_document(body: bytes) -> list[tuple[bytes, object]]:
    """The pipeline before: every pod as Python objects, digested whole."""
    items = json.loads(body)["items"]
    return [
        (
            hashlib.blake2b(
                json.dumps(obj, sort_keys=True, separators=(",", ":")).encode(), digest_size=16
            ).digest(),
            obj,
        )
        for obj in items
    ]


def one_round(pods: list[dict[str, Any]], source: _Source) -> tuple[float, float]:
    """CPU seconds of one poll's decoding and diffing: before (whole document) and now."""
    # One pod's status changes between polls, as a probe result or restart would change it.
    pods[0]["status"]["phase"] = "Pending" if pods[0]["status"]["phase"] == "Running" else "Running"
    body = json.dumps({"kind": "PodList", "items": pods}).encode()
    start = time.process_time()
    _whole_document(body)
    before = time.process_time() - start
    start = time.process_time()
    source.replace_all(decode_pod_list(body).pods)
    now = time.process_time() - start
    return before, now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--pods", type=int, nargs="*", default=[110, 250, 5000])
    args = parser.parse_args()
    quiet_logs()
    rounds = 5 if args.quick else 20
    say(f"machine: {machine()}; {rounds} interleaved rounds per size")
    rows = []
    for count in args.pods:
        pods = node_pods(count)
        body = json.dumps({"kind": "PodList", "items": pods}).encode()
        source = _Source("kubelet", stale_after=10)
        source.replace_all(decode_pod_list(body).pods)
        results = [one_round(pods, source) for _ in range(rounds)]
        before = median([r[0] for r in results])
        now = median([r[1] for r in results])
        rows.append(
            (
                count,
                f"{len(body) / 1024:.0f} KiB",
                fmt(before * 1000) + " ms",
                fmt(now * 1000) + " ms",
                fmt(before / now, 1) + "x",
            )
        )
    print(
        table(
            (
                "pods",
                "/pods body",
                "poll before: json.loads + whole digests",
                "poll now: typed decode + used-field digests",
                "ratio",
            ),
            rows,
        )
    )
    print("\nBoth run in a worker thread in serve; the loop only swaps the new view in.")


if __name__ == "__main__":
    main()
