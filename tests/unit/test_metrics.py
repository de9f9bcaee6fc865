"""Metric semantics (the kubelet's rules for what counts) and the /metrics HTTP endpoint."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from cri_prober.discovery.model import ContainerInfo
from cri_prober.errors import ConfigError
from cri_prober.manager.events import AttemptFinished, ResultChanged, WorkerStopped
from cri_prober.manager.state import Health
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.results import ProbeRecord, Published
from cri_prober.runtime.client import CriCall
from cri_prober.serving.metrics import Metrics, MetricsServer, parse_address
from tests.unit.slots import make_slot

LABELS = {"probe_type": "Readiness", "container": "app", "pod": "web-0", "namespace": "shop"}


def record(result: str, *, duration: float = 0.2, timed_out: bool = False) -> ProbeRecord:
    return ProbeRecord("id-app", 0.0, duration, result, "", timed_out=timed_out)


def attempt(
    metrics: Metrics, container: ContainerInfo, kind: ProbeKind, probe_record: ProbeRecord
) -> None:
    metrics.manager_event(AttemptFinished(container, kind, probe_record))


def changed(
    metrics: Metrics, container: ContainerInfo, previous: Published | None, result: Published
) -> None:
    health = Health(running=True, started=True, ready=result is Published.SUCCESS, live=True)
    metrics.manager_event(
        ResultChanged(container, ProbeKind.READINESS, previous, result, 1, "", health)
    )


def total(metrics: Metrics, result: str) -> float | None:
    return metrics.registry.get_sample_value(
        "prober_probe_total", {**LABELS, "result": result, "pod_uid": "uid-1"}
    )


@pytest.fixture(name="metrics")
def _metrics() -> Metrics:
    return Metrics()


@pytest.fixture(name="container")
def _container() -> ContainerInfo:
    return make_slot().container


class TestKubeletSemantics:
    def test_results_map_like_the_kubelet(self, metrics: Metrics, container: ContainerInfo) -> None:
        """Warnings count as successful, unknown verdicts as failed, errors not at all."""
        for result in ("success", "warning", "failure", "unknown", "error"):
            attempt(metrics, container, ProbeKind.READINESS, record(result))
        assert (total(metrics, "successful"), total(metrics, "failed")) == (2.0, 2.0)
        assert total(metrics, "unknown") is None

    def test_only_successful_attempts_are_timed(
        self, metrics: Metrics, container: ContainerInfo
    ) -> None:
        """prober_probe_duration_seconds observes successes; cri-prober's own observes all."""
        attempt(metrics, container, ProbeKind.READINESS, record("success", duration=0.3))
        attempt(metrics, container, ProbeKind.READINESS, record("failure", duration=7.0))
        attempt(metrics, container, ProbeKind.READINESS, record("error", duration=1.0))
        sample = metrics.registry.get_sample_value
        assert sample("prober_probe_duration_seconds_count", LABELS) == 1.0
        assert sample("prober_probe_duration_seconds_sum", LABELS) == pytest.approx(0.3)
        own = "cri_prober_probe_duration_seconds_count"
        assert [sample(own, {**LABELS, "result": r}) for r in ("success", "failure", "error")] == [
            1.0,
            1.0,
            1.0,
        ]

    def test_timeouts_and_transitions(self, metrics: Metrics, container: ContainerInfo) -> None:
        """Timed-out attempts and published changes have their own counters."""
        attempt(metrics, container, ProbeKind.READINESS, record("failure", timed_out=True))
        changed(metrics, container, Published.FAILURE, Published.SUCCESS)
        sample = metrics.registry.get_sample_value
        assert sample("cri_prober_probe_timeouts_total", LABELS) == 1.0
        transitions = {**LABELS, "result": "success"}
        assert sample("cri_prober_probe_transitions_total", transitions) == 1.0


class TestWorkerStopped:
    def test_deletes_the_workers_series(self, metrics: Metrics, container: ContainerInfo) -> None:
        """When a worker stops for good, every series labelled with it goes."""
        attempt(metrics, container, ProbeKind.READINESS, record("success", timed_out=False))
        attempt(metrics, container, ProbeKind.READINESS, record("failure", timed_out=True))
        changed(metrics, container, None, Published.FAILURE)
        attempt(metrics, container, ProbeKind.LIVENESS, record("success"))
        metrics.manager_event(WorkerStopped(container, ProbeKind.READINESS, replaced=False))
        text = metrics.exposition().decode()
        assert 'probe_type="Readiness"' not in text
        assert 'probe_type="Liveness"' in text

    def test_keeps_a_replacements_series(self, metrics: Metrics, container: ContainerInfo) -> None:
        """A worker replaced after a spec change leaves the series to its successor."""
        attempt(metrics, container, ProbeKind.READINESS, record("success"))
        # The manager says so: the stopped worker's replacement already runs.
        metrics.manager_event(WorkerStopped(container, ProbeKind.READINESS, replaced=True))
        assert total(metrics, "successful") == 1.0


def test_cri_calls(metrics: Metrics) -> None:
    """Every CRI call is counted and timed by method and status code."""
    metrics.cri_call(CriCall("ExecSync", "OK", 0.01))
    metrics.cri_call(CriCall("ExecSync", "DEADLINE_EXCEEDED", 3.0))
    sample = metrics.registry.get_sample_value
    assert sample("cri_prober_cri_requests_total", {"method": "ExecSync", "code": "OK"}) == 1.0
    labels = {"method": "ExecSync", "code": "DEADLINE_EXCEEDED"}
    assert sample("cri_prober_cri_request_duration_seconds_sum", labels) == 3.0


@pytest.mark.parametrize(
    ("address", "expected"),
    [("127.0.0.1:9100", ("127.0.0.1", 9100)), (":9100", (None, 9100)), ("[::1]:1", ("::1", 1))],
)
def test_parse_address(address: str, expected: tuple[str | None, int]) -> None:
    """HOST:PORT, with an empty host meaning every interface and IPv6 in brackets."""
    assert parse_address(address) == expected


@pytest.mark.parametrize("address", ["9100", "host:", "host:99999", "host:http"])
def test_parse_address_rejects(address: str) -> None:
    """Anything but HOST:PORT is a configuration error."""
    with pytest.raises(ConfigError, match="--metrics-address"):
        parse_address(address)


class TestHttp:
    @pytest.fixture(name="server")
    async def _server(self, metrics: Metrics) -> AsyncIterator[MetricsServer]:
        server = MetricsServer(metrics)
        await server.start("127.0.0.1:0")
        yield server
        await server.stop()

    async def request(self, server: MetricsServer, raw: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(raw)
        await writer.drain()
        async with asyncio.timeout(5):
            response = await reader.read()
        writer.close()
        await writer.wait_closed()
        return response

    async def test_metrics(self, server: MetricsServer, metrics: Metrics) -> None:
        """GET /metrics answers the text format with a length and closes the connection."""
        metrics.cri_call(CriCall("Version", "OK", 0.001))
        response = await self.request(server, b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n")
        head, _, body = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"Content-Type: text/plain; version=0.0.4; charset=utf-8" in head
        assert f"Content-Length: {len(body)}".encode() in head
        assert b'cri_prober_cri_requests_total{code="OK",method="Version"} 1.0' in body

    @pytest.mark.parametrize(
        ("raw", "status"),
        [
            (b"GET / HTTP/1.1\r\n\r\n", b"404"),
            (b"DELETE /metrics HTTP/1.1\r\n\r\n", b"405"),
            (b"nonsense\r\n\r\n", b"400"),
        ],
    )
    async def test_errors(self, server: MetricsServer, raw: bytes, status: bytes) -> None:
        """Other paths, methods and malformed requests get the matching status."""
        assert (await self.request(server, raw)).startswith(b"HTTP/1.1 " + status)

    async def test_address_in_use(self, server: MetricsServer, metrics: Metrics) -> None:
        """Binding a taken address is a clear configuration error."""
        with pytest.raises(ConfigError, match="cannot bind"):
            await MetricsServer(metrics).start(f"127.0.0.1:{server.port}")
