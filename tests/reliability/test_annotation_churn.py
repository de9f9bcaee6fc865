"""Pods churned with a bad 200 KB override annotation and no matching rule leave nothing behind.

The finding (issue 15): RSS grew by 22.6 MB per 100 such pods and never came back, because the
manager's override cache kept every annotation's text and was pruned only when a container's
slot went away, which a pod without a probe never has. Here pods come and go in batches on the
fake runtime through discovery and the manager, as in ``serve``. Python's own allocations
(tracemalloc) are measured after each batch has left, once a warm-up has sized every cache; and
RSS, like the finding, in a fresh process without tracemalloc.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import statistics
import sys
import tempfile
import tracemalloc
from collections.abc import AsyncIterator, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import structlog

from cri_prober.discovery.pleg import Discovery
from cri_prober.manager.probe_manager import OVERRIDE_ANNOTATION_PREFIX, ProbeManager
from cri_prober.probing.prober import Prober
from cri_prober.probing.spec import load_rules
from cri_prober.runtime.client import CriClient
from tests.reliability.support import rss_bytes
from tests.support.fake_runtime import FakeRuntime, FakeRuntimeServer
from tests.support.waiting import HANG_GUARD

# A rule that matches none of the churned pods: they get no slot, no worker, no probe.
RULES = """
probes:
  - match: {namespace: probed}
    livenessProbe: {exec: {command: ["true"]}}
"""
ANNOTATION_BYTES = 200 * 1024
BATCH = 50
WARM_UP_ROUNDS = 2
ROUNDS = 6  # 300 pods measured: 60 MB of annotation text, had it been kept
# What 300 pods may leave behind in all: far below one annotation per pod (200 KB each), and
# enough for allocator and dict noise.
MAX_TRACED_GROWTH = 1024 * 1024
# A log line is the one place a bad annotation's text still goes; it must stay short.
MAX_LOG_EVENT_CHARS = 4096


def bad_annotation(index: int) -> str:
    """200 KB that parse as JSON but break a rule whose message quotes the value (a port name),
    and differ per pod, as real pods' annotations would."""
    filler = f"p{index}-" + "x" * ANNOTATION_BYTES
    return json.dumps({"readinessProbe": {"tcpSocket": {"port": filler}}})


class LogSizes:
    """A structlog processor that keeps only the count and largest size of the events it drops."""

    def __init__(self) -> None:
        self.events = 0
        self.largest = 0

    def __call__(self, _logger: Any, _method: str, event: MutableMapping[str, Any]) -> Any:
        self.events += 1
        self.largest = max(self.largest, len(repr(event)))
        raise structlog.DropEvent


@contextlib.contextmanager
def measured_logs() -> Iterator[LogSizes]:
    # Logs are measured and dropped, never kept: kept log text would be growth of the test's own.
    sizes = LogSizes()
    previous = structlog.get_config()["processors"]
    structlog.configure(processors=[sizes])
    try:
        yield sizes
    finally:
        structlog.configure(processors=previous)


@contextlib.asynccontextmanager
async def node(tmp_path: Path) -> AsyncIterator[tuple[FakeRuntime, Discovery, ProbeManager]]:
    runtime = FakeRuntime()
    async with (
        FakeRuntimeServer(str(tmp_path / "cri.sock"), runtime),
        CriClient.connect(f"unix://{tmp_path / 'cri.sock'}") as cri,
    ):
        manager = ProbeManager(prober=Prober(cri), rules=load_rules(RULES, source="rules.yaml"))
        try:
            yield runtime, Discovery(cri), manager
        finally:
            await manager.shutdown(grace=2)


class Churn:
    """Pods that come and go in batches on one fake node, each with its own bad annotation."""

    def __init__(self, runtime: FakeRuntime, discovery: Discovery, manager: ProbeManager) -> None:
        self.runtime = runtime
        self.discovery = discovery
        self.manager = manager
        self.rounds = 0

    async def relist(self) -> None:
        events = await self.discovery.relist()
        self.manager.on_lifecycle(events, self.discovery.containers().values())

    async def batch(self) -> None:
        """Add BATCH pods, reconcile them twice, remove them, reconcile again."""
        sandboxes = []
        for i in range(BATCH):
            index = self.rounds * BATCH + i
            annotations = {OVERRIDE_ANNOTATION_PREFIX + "app": bad_annotation(index)}
            sandbox = self.runtime.add_sandbox(f"churn-{index}", annotations=annotations)
            self.runtime.add_container(sandbox, "app")
            sandboxes.append(sandbox)
        self.rounds += 1
        await self.relist()
        assert self.manager.probed() == []  # no rule matched, the annotation was refused
        await self.relist()  # a second look at the same pods parses nothing again
        for sandbox in sandboxes:
            self.runtime.remove_sandbox(sandbox.id)
        del sandboxes
        await self.relist()
        assert not self.discovery.pods()


@contextlib.asynccontextmanager
async def churn(tmp_path: Path) -> AsyncIterator[Churn]:
    async with node(tmp_path) as (runtime, discovery, manager):
        yield Churn(runtime, discovery, manager)


async def test_churned_pods_with_bad_annotations_leave_nothing(tmp_path: Path) -> None:
    """Batches of 50 pods, each with its own bad 200 KB annotation, come and go; after each
    batch has left, traced memory is where it was."""
    async with churn(tmp_path) as pods:
        with measured_logs() as logs:
            for _ in range(WARM_UP_ROUNDS):
                await pods.batch()
            tracemalloc.start()
            try:
                gc.collect()
                baseline = tracemalloc.get_traced_memory()[0]
                growth: list[int] = []
                for _ in range(ROUNDS):
                    await pods.batch()
                    gc.collect()
                    growth.append(tracemalloc.get_traced_memory()[0] - baseline)
            finally:
                tracemalloc.stop()
    print(
        f"{BATCH * ROUNDS} pods with a {ANNOTATION_BYTES // 1024} KB bad annotation: traced "
        f"growth after each batch of {BATCH} (KiB): {[round(g / 1024) for g in growth]}; "
        f"{logs.events} log events, the largest {logs.largest} characters"
    )
    # What is left is the fake runtime's own call log and protobuf caches (tracemalloc's
    # tracebacks say so), a few KiB per batch; one annotation kept per pod would be 10 MB.
    assert max(growth) < MAX_TRACED_GROWTH, growth
    # One refusal per pod, logged once although each pod was reconciled twice, and short.
    assert logs.events == (WARM_UP_ROUNDS + ROUNDS) * BATCH
    assert logs.largest < MAX_LOG_EVENT_CHARS


RSS_ROUNDS = 16
# RSS of a process without tracemalloc, first rounds against last: the allocator and gRPC's
# threads drift by about 10 MiB over 800 pods here; one kept annotation per pod is 160 MiB.
MAX_RSS_GROWTH = 32 * 2**20


async def test_churn_rss_is_flat_in_a_subprocess() -> None:
    """The finding measured RSS; so does this, in a fresh process without tracemalloc (whose
    own bookkeeping would show up in RSS): 800 pods in 16 batches."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.reliability.test_annotation_churn",
        str(RSS_ROUNDS),
        cwd=Path(__file__).parents[2],
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), HANG_GUARD)
    assert proc.returncode == 0, err.decode()[-2000:]
    rss: list[int] = json.loads(out.decode().splitlines()[-1])
    # The allocator's arenas swing by ~40 MiB from batch to batch and settle after about eight
    # (measured: 100-150 MiB early, ~145-153 MiB late): the highest of the six batches after two
    # warm-ups against the median of the last four. A leak of one annotation per pod would add
    # ~10 MiB a batch, 80 MiB over the last eight; the swing alone made the median of four
    # early batches miss the 32 MiB bound under a CPU hog.
    early, late = max(rss[2:8]), statistics.median(rss[-4:])
    print(f"RSS after each batch of {BATCH} (MiB): {[round(r / 2**20) for r in rss]}")
    assert late - early < MAX_RSS_GROWTH, (early, late)


async def _rss_per_round(rounds: int) -> list[int]:
    with tempfile.TemporaryDirectory() as directory, measured_logs():
        async with churn(Path(directory)) as pods:
            rss: list[int] = []
            for _ in range(rounds):
                await pods.batch()
                gc.collect()
                rss.append(rss_bytes())
            return rss


if __name__ == "__main__":
    # The subprocess of test_churn_rss_is_flat_in_a_subprocess: RSS after each batch, as JSON.
    print(json.dumps(asyncio.run(_rss_per_round(int(sys.argv[1])))))
