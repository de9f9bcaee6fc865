"""How the --probes-from sources' freshness reaches users: health "" (Check and Watch, woken by
the registry's freshness topic) and the pod source metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from cri_prober.podspecs.registry import PodSpecs
from cri_prober.podspecs.source import Changed, PodSource
from cri_prober.serving.metrics import Metrics
from tests.support.clock import ManualClock
from tests.support.health import health_stub
from tests.support.waiting import HANG_GUARD

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kubelet-1.28.7"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
REASON_METADATA_KEY = "criprober-not-serving-reason"  # docs/interface.md


class ListedSource(PodSource):
    """A source whose reads the test plays by hand."""

    async def run(self, changed: Changed) -> None:
        await asyncio.Event().wait()


@pytest.fixture(name="clock")
def _clock() -> ManualClock:
    return ManualClock(100.0)


@pytest.fixture(name="source")
def _source(clock: ManualClock) -> ListedSource:
    return ListedSource("kubelet:http://127.0.0.1:10255/pods", stale_after=10, clock=clock)


@pytest.fixture(name="health")
async def _health(
    tmp_path: Path, source: ListedSource, clock: ManualClock
) -> AsyncIterator[tuple[Any, PodSpecs]]:
    registry = PodSpecs([source], clock=clock)
    async with health_stub(
        tmp_path, containers=["shop/web-kd-node/app"], pod_specs=registry
    ) as stub:
        yield stub, registry


async def test_health_is_not_serving_while_a_pod_source_is_stale(
    health: tuple[Any, PodSpecs], source: ListedSource, clock: ManualClock
) -> None:
    """ "" is NOT_SERVING until the source's first good read, SERVING while it is fresh, and
    NOT_SERVING again once it has had no good read for stale_after; pods' services are
    unaffected. Watch is woken by the registry's freshness change."""
    stub, registry = health
    watch = stub.Watch(health_pb2.HealthCheckRequest(service=""))
    assert (await watch.read()).status == NOT_SERVING  # no good read yet
    source.succeeded()
    registry.check_staleness()
    async with asyncio.timeout(HANG_GUARD):
        assert (await watch.read()).status == SERVING
    source.failed("connection refused")
    clock.now += 11
    registry.check_staleness()
    async with asyncio.timeout(HANG_GUARD):
        assert (await watch.read()).status == NOT_SERVING
    check = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=HANG_GUARD)
    assert check.status == NOT_SERVING
    pod = await stub.Check(health_pb2.HealthCheckRequest(service="shop/web-kd-node/app"))
    assert pod.status == SERVING
    watch.cancel()


def test_metrics_export_each_sources_freshness_pods_and_reads(
    source: ListedSource, clock: ManualClock
) -> None:
    pods = json.loads((FIXTURES / "pods-running.json").read_text())["items"]
    bad = json.loads(json.dumps(pods[0]))
    bad["metadata"]["uid"] = "bad-uid"
    bad["spec"]["containers"][0]["readinessProbe"]["periodSeconds"] = -1
    source.replace_all([*pods, bad])
    source.succeeded()
    source.failed("timeout")
    metrics = Metrics()
    metrics.follow_pod_sources(PodSpecs([source], clock=clock))
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for sample in family.samples
        if sample.name.startswith("cri_prober_pod_source")
    }
    name = (("source", source.name),)
    assert samples[("cri_prober_pod_source_up", name)] == 1.0  # failed once, still fresh
    assert samples[("cri_prober_pod_source_pods", name)] == 2.0
    assert samples[("cri_prober_pod_source_invalid_pods", name)] == 1.0
    reads = "cri_prober_pod_source_reads_total"
    assert samples[(reads, (("result", "ok"), *name))] == 1.0
    assert samples[(reads, (("result", "error"), *name))] == 1.0
    clock.now += 11
    text = metrics.exposition().decode()
    assert f'cri_prober_pod_source_up{{source="{source.name}"}} 0.0' in text


async def test_health_says_which_pod_source_is_stale_and_why(
    health: tuple[Any, PodSpecs], source: ListedSource, clock: ManualClock
) -> None:
    """Check("") names the stale source, since when and its last error in its trailing
    metadata (issue 35: grpc.health.v1 has no field for why); nothing while it is fresh."""
    stub, registry = health
    source.succeeded()
    registry.check_staleness()
    call = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=HANG_GUARD)
    assert (await call).status == SERVING
    assert not [k for k, _ in await call.trailing_metadata() if k == REASON_METADATA_KEY]
    source.failed("connection refused\nby 127.0.0.1")
    clock.now += 11
    registry.check_staleness()
    call = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=HANG_GUARD)
    assert (await call).status == NOT_SERVING
    reasons = [v for k, v in await call.trailing_metadata() if k == REASON_METADATA_KEY]
    assert reasons == [
        "pod source kubelet:http://127.0.0.1:10255/pods: no good read for 11s: connection "
        "refused\\nby 127.0.0.1 (its last good view is still probed)"
    ]
