"""``/metrics`` of a real ``serve`` on containerd, scraped and parsed like Prometheus would.

The kubelet's prober metrics must keep its names, labels and buckets and count real attempts; a
pod's series must vanish with its workers; gzip and OpenMetrics are negotiated.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2_grpc
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_text_to_families,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from cri_prober._gen.criprober.v1 import query_pb2_grpc
from tests.support.serve import Serve, settled, start_serve, touch_ready, unique, wait_status
from tests.support.testbed import ContainerSpec, PodFactory, Testbed
from tests.support.waiting import HANG_GUARD

RULES = """
probes:
  - match: {namespace: default, pod: "m-*", container: app}
    readinessProbe: {exec: {command: [cat, /tmp/ready]}, periodSeconds: 1, timeoutSeconds: 10}
    livenessProbe: {exec: {command: ["true"]}, periodSeconds: 1, timeoutSeconds: 10}
  - match: {namespace: default, pod: "slow-*", container: app}
    # Times out on every attempt; the high threshold keeps the worker probing.
    livenessProbe:
      exec: {command: [sleep, "5"]}
      periodSeconds: 1
      timeoutSeconds: 1
      failureThreshold: 1000
  - match: {namespace: default, pod: "lag-*", container: app}
    # Each attempt takes its 2 s timeout on a 1 s period: the one pending tick runs at once and
    # the next is dropped, every time (issue 25: a dropped tick is counted, logged and explained).
    livenessProbe:
      exec: {command: [sleep, "5"]}
      periodSeconds: 1
      timeoutSeconds: 2
      failureThreshold: 1000
"""
# The kubelet's buckets (Go's prometheus.DefBuckets).
DEFAULT_BUCKETS = [
    "0.005",
    "0.01",
    "0.025",
    "0.05",
    "0.1",
    "0.25",
    "0.5",
    "1.0",
    "2.5",
    "5.0",
    "10.0",
]
SERVING = 1


@pytest.fixture(scope="module", name="serve")
def _serve(testbed_16: Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    with start_serve(testbed_16, tmp_path_factory.mktemp("metrics"), RULES) as serve:
        yield serve


@pytest.fixture(name="channel")
async def _channel(serve: Serve) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(serve.target) as channel:
        yield channel


@pytest.fixture(name="scrape")
async def _scrape(serve: Serve) -> AsyncIterator[Any]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{serve.metrics_port}") as client:

        async def scrape() -> list[Sample]:
            response = await client.get("/metrics")
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
            # httpx accepts gzip (and decodes it), as Prometheus does.
            assert response.headers["content-encoding"] == "gzip"
            return [
                sample
                for family in text_string_to_metric_families(response.text)
                for sample in family.samples
            ]

        yield scrape


def value(samples: list[Sample], name: str, **labels: str) -> float:
    """The sum of ``name`` over the samples whose labels include ``labels``."""
    return sum(
        sample.value
        for sample in samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


class TestKubeletMetrics:
    async def test_names_labels_and_counts(
        self, pods_16: PodFactory, channel: grpc.aio.Channel, testbed_16: Testbed, scrape: Any
    ) -> None:
        """prober_probe_total and prober_probe_duration_seconds count like the kubelet's."""
        api = query_pb2_grpc.CriProberStub(channel)
        pod = await pods_16.create_pod(unique("m"), containers=[ContainerSpec("app")])
        target = f"default/{pod.name}/app"
        await settled(
            api,
            target,
            lambda c: c.probes.readiness.attempts >= 2 and c.probes.liveness.attempts >= 1,
        )
        await touch_ready(testbed_16, pod.containers["app"].id)
        await wait_status(health_pb2_grpc.HealthStub(channel), target, SERVING)

        samples = await scrape()
        mine = {"pod": pod.name, "namespace": "default", "container": "app"}
        totals = [
            s for s in samples if s.name == "prober_probe_total" and s.labels["pod"] == pod.name
        ]
        assert {frozenset(s.labels) for s in totals} == {
            frozenset({"probe_type", "result", "container", "pod", "namespace", "pod_uid"})
        }
        assert {s.labels["pod_uid"] for s in totals} == {pod.uid}
        readiness = {**mine, "probe_type": "Readiness"}
        failed = value(samples, "prober_probe_total", **readiness, result="failed")
        successful = value(samples, "prober_probe_total", **readiness, result="successful")
        assert failed >= 2
        assert successful >= 1
        assert (
            value(samples, "prober_probe_total", **mine, probe_type="Liveness", result="successful")
            >= 1
        )

        # Only successful attempts are timed, in the default buckets.
        assert value(samples, "prober_probe_duration_seconds_count", **readiness) == successful
        buckets = [
            s.labels["le"]
            for s in samples
            if s.name == "prober_probe_duration_seconds_bucket"
            and readiness.items() <= s.labels.items()
        ]
        assert buckets == [*DEFAULT_BUCKETS, "+Inf"]
        assert {
            frozenset(s.labels) - {"le"}
            for s in samples
            if s.name == "prober_probe_duration_seconds_bucket"
        } == {frozenset({"probe_type", "container", "pod", "namespace"})}

        # cri-prober's own per-worker series; every attempt's duration only when asked for.
        assert not [s for s in samples if s.name.startswith("cri_prober_probe_duration_seconds")]
        transitions = "cri_prober_probe_transitions_total"
        assert value(samples, transitions, **readiness, result="success") == 1
        assert not [s for s in samples if s.name.endswith("_created")]

    async def test_series_go_with_the_pod(
        self, pods_16: PodFactory, channel: grpc.aio.Channel, scrape: Any
    ) -> None:
        """Removing a pod stops its workers, which deletes every series labelled with it."""
        api = query_pb2_grpc.CriProberStub(channel)
        pod = await pods_16.create_pod(unique("m"), containers=[ContainerSpec("app")])
        await settled(api, f"default/{pod.name}/app", lambda c: c.probes.readiness.attempts >= 1)
        assert [s for s in await scrape() if s.labels.get("pod") == pod.name]
        await pods_16.remove_pod(pod)
        async with asyncio.timeout(HANG_GUARD):
            while True:  # a scrape is the only way to see it
                if not [s for s in await scrape() if s.labels.get("pod") == pod.name]:
                    break
                await asyncio.sleep(0.2)

    async def test_timeouts_are_counted(
        self, pods_16: PodFactory, channel: grpc.aio.Channel, scrape: Any
    ) -> None:
        """An exec probe that outlives timeoutSeconds counts in cri_prober_probe_timeouts_total."""
        api = query_pb2_grpc.CriProberStub(channel)
        pod = await pods_16.create_pod(unique("slow"), containers=[ContainerSpec("app")])
        container = await settled(
            api, f"default/{pod.name}/app", lambda c: c.probes.liveness.attempts >= 1
        )
        assert container.probes.liveness.last_attempt.timed_out
        timeouts = value(
            await scrape(), "cri_prober_probe_timeouts_total", pod=pod.name, probe_type="Liveness"
        )
        assert timeouts >= 1

    async def test_dropped_ticks_are_counted_logged_and_explained(
        self, pods_16: PodFactory, channel: grpc.aio.Channel, scrape: Any, serve: Serve
    ) -> None:
        """Attempts longer than their period drop ticks, as the kubelet's ticker does; here each
        attempt after one says so (``late``, ``ticksDropped``), the node's counter counts them and
        one warning line says why."""
        api = query_pb2_grpc.CriProberStub(channel)
        pod = await pods_16.create_pod(unique("lag"), containers=[ContainerSpec("app")])
        container = await settled(
            api,
            f"default/{pod.name}/app",
            lambda c: c.probes.liveness.last_attempt.ticks_dropped >= 1,
        )
        last = container.probes.liveness.last_attempt
        assert last.timed_out
        assert last.HasField("late")
        dropped = value(
            await scrape(), "cri_prober_probe_ticks_dropped_total", probe_type="Liveness"
        )
        assert dropped >= 1
        await serve.until(lambda: serve.logged("probe_ticks_dropped"), timeout=HANG_GUARD)
        line = serve.logged("probe_ticks_dropped")[0]
        assert line["level"] == "warning"
        assert line["dropped"]["liveness"] >= 1
        # The m-* pods' two exec probes take turns at their container's one slot: milliseconds,
        # which the line reports but does not blame on the cap.
        if line["exec_slot_wait_seconds"] < 1.0:
            assert "past their period" in line["why"]
        else:
            assert "--max-concurrent-execs 16" in line["why"]
        assert line["max_concurrent_execs"] == 16


class TestOwnMetrics:
    async def test_runtime_and_discovery(self, scrape: Any) -> None:
        """CRI calls, execs in flight, tracked containers and relist freshness are exported."""
        samples = await scrape()
        assert (
            value(samples, "cri_prober_cri_requests_total", method="ListContainers", code="OK") > 0
        )
        assert value(samples, "cri_prober_cri_request_duration_seconds_count", method="Version") > 0
        assert [s for s in samples if s.name == "cri_prober_execs_in_flight"]
        assert [s for s in samples if s.name == "cri_prober_execs_overdue"]
        assert [s for s in samples if s.name == "cri_prober_containers_tracked"]
        assert value(samples, "cri_prober_relist_duration_seconds_count") > 0
        assert 0 <= value(samples, "cri_prober_relist_staleness_seconds") < 30

    async def test_openmetrics(self, serve: Serve) -> None:
        """Asked for OpenMetrics, serve answers it, and OpenMetrics' strict parser reads it."""
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{serve.metrics_port}") as client:
            response = await client.get(
                "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
            )
        assert response.headers["content-type"].startswith("application/openmetrics-text")
        assert response.text.endswith("# EOF\n")
        families = openmetrics_text_to_families(response.text)  # type: ignore[no-untyped-call]
        assert {"prober_probe", "prober_probe_duration_seconds"} <= {f.name for f in families}

    async def test_only_metrics_path_is_served(self, serve: Serve) -> None:
        """Any path but /metrics is 404; anything but GET or HEAD is 405."""
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{serve.metrics_port}") as client:
            assert (await client.get("/")).status_code == 404
            assert (await client.post("/metrics")).status_code == 405
            head = await client.head("/metrics")
            assert (head.status_code, head.content) == (200, b"")
