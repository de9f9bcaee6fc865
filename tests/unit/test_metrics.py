"""Metric semantics (the kubelet's rules for what counts) and the /metrics HTTP endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gzip
import resource
import socket
import time
from collections.abc import AsyncIterator, Iterator, MutableMapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics import parser as openmetrics_parser
from prometheus_client.parser import text_string_to_metric_families

from cri_prober import fdlimit
from cri_prober.discovery.model import ContainerInfo
from cri_prober.errors import ConfigError
from cri_prober.manager.events import AttemptFinished, ResultChanged, WorkerStopped
from cri_prober.manager.state import Health
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.results import ProbeRecord, Published
from cri_prober.runtime.client import CriClient
from cri_prober.runtime.model import CriCall
from cri_prober.serving.metrics import Metrics
from cri_prober.serving.metrics_http import MetricsServer, ServerLimits, parse_address
from cri_prober.serving.metrics_render import negotiate
from cri_prober.serving.metrics_series import GO_DEFAULT_BUCKETS
from cri_prober.topic import Topic
from tests.support.waiting import until
from tests.unit.slots import make_slot

LABELS = {"probe_type": "Readiness", "container": "app", "pod": "web-0", "namespace": "shop"}

# How long a wait may last before the test fails as hung: a guard, never a timing claim (a busy
# machine can take seconds to accept a connection).
HANG_GUARD = 60.0


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
        """prober_probe_duration_seconds observes successes only."""
        attempt(metrics, container, ProbeKind.READINESS, record("success", duration=0.3))
        attempt(metrics, container, ProbeKind.READINESS, record("failure", duration=7.0))
        attempt(metrics, container, ProbeKind.READINESS, record("error", duration=1.0))
        sample = metrics.registry.get_sample_value
        assert sample("prober_probe_duration_seconds_count", LABELS) == 1.0
        assert sample("prober_probe_duration_seconds_sum", LABELS) == pytest.approx(0.3)

    def test_names_labels_help_and_buckets(
        self, metrics: Metrics, container: ContainerInfo
    ) -> None:
        """The kubelet's two metrics as its dashboards know them, down to the line."""
        attempt(metrics, container, ProbeKind.READINESS, record("success", duration=0.3))
        attempt(metrics, container, ProbeKind.READINESS, record("failure"))
        text = metrics.exposition().decode()
        lines = text.splitlines()
        for line in (
            "# HELP prober_probe_total Cumulative number of a liveness, readiness or startup "
            "probe for a container by result.",
            "# TYPE prober_probe_total counter",
            'prober_probe_total{container="app",namespace="shop",pod="web-0",pod_uid="uid-1",'
            'probe_type="Readiness",result="successful"} 1.0',
            'prober_probe_total{container="app",namespace="shop",pod="web-0",pod_uid="uid-1",'
            'probe_type="Readiness",result="failed"} 1.0',
            "# HELP prober_probe_duration_seconds Duration in seconds for a probe response.",
            "# TYPE prober_probe_duration_seconds histogram",
            'prober_probe_duration_seconds_bucket{container="app",le="0.25",namespace="shop",'
            'pod="web-0",probe_type="Readiness"} 0.0',
            'prober_probe_duration_seconds_bucket{container="app",le="0.5",namespace="shop",'
            'pod="web-0",probe_type="Readiness"} 1.0',
            'prober_probe_duration_seconds_count{container="app",namespace="shop",pod="web-0",'
            'probe_type="Readiness"} 1.0',
        ):
            assert line in lines
        families = {f.name: f for f in text_string_to_metric_families(text)}
        buckets = [
            s.labels["le"]
            for s in families["prober_probe_duration_seconds"].samples
            if s.name.endswith("_bucket")
        ]
        expected = ["0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "5.0"]
        assert buckets == [*expected, "10.0", "+Inf"]
        assert {frozenset(s.labels) for s in families["prober_probe"].samples} == {
            frozenset({"probe_type", "result", "container", "pod", "namespace", "pod_uid"})
        }

    def test_buckets_as_prometheus_client_fills_them(
        self, metrics: Metrics, container: ContainerInfo
    ) -> None:
        """Edge values land where a prometheus_client Histogram puts them (a bound is in its
        own bucket: le means less than or equal)."""
        durations = [0.0, 0.005, 0.0050001, 0.1, 1.0, 9.99, 10.0, 10.5, 1e9]
        reference = Histogram(
            "prober_probe_duration_seconds",
            "-",
            buckets=GO_DEFAULT_BUCKETS,
            registry=(registry := CollectorRegistry()),
        )
        for duration in durations:
            reference.observe(duration)
            attempt(metrics, container, ProbeKind.READINESS, record("success", duration=duration))
        for le in [*(str(b) for b in GO_DEFAULT_BUCKETS), "+Inf"]:
            name = "prober_probe_duration_seconds_bucket"
            expected = registry.get_sample_value(name, {"le": le})
            assert metrics.registry.get_sample_value(name, {**LABELS, "le": le}) == expected

    def test_timeouts_and_transitions(self, metrics: Metrics, container: ContainerInfo) -> None:
        """Timed-out attempts and published changes have their own counters."""
        attempt(metrics, container, ProbeKind.READINESS, record("failure", timed_out=True))
        changed(metrics, container, Published.FAILURE, Published.SUCCESS)
        sample = metrics.registry.get_sample_value
        assert sample("cri_prober_probe_timeouts_total", LABELS) == 1.0
        transitions = {**LABELS, "result": "success"}
        assert sample("cri_prober_probe_transitions_total", transitions) == 1.0


class TestRestartLoop:
    """What deploy/monitoring's CriProberLivenessRestartLoop counts on: a liveness probe's failure
    transitions keep counting across its container's restarts (new container IDs), while the
    failures-in-a-row gauge starts over with each new container."""

    def test_failure_transitions_survive_new_containers(
        self, metrics: Metrics, container: ContainerInfo
    ) -> None:
        labels = {**LABELS, "probe_type": "Liveness"}
        sample = metrics.registry.get_sample_value
        for restart in range(3):
            current = dataclasses.replace(container, id=f"id-app-{restart}", attempt=restart)
            up = Health(running=True, started=True, ready=True, live=True)
            metrics.manager_event(
                ResultChanged(current, ProbeKind.LIVENESS, None, Published.SUCCESS, 0, "", up)
            )
            assert sample("cri_prober_probe_consecutive_failures", labels) == 0.0
            for _ in range(3):
                failed = ProbeRecord(current.id, 0.0, 0.1, "failure", "")
                attempt(metrics, current, ProbeKind.LIVENESS, failed)
            down = dataclasses.replace(up, live=False)
            metrics.manager_event(
                ResultChanged(
                    current, ProbeKind.LIVENESS, Published.SUCCESS, Published.FAILURE, 3, "", down
                )
            )
            assert sample("cri_prober_probe_consecutive_failures", labels) == 3.0
            transitions = {**labels, "result": "failure"}
            assert sample("cri_prober_probe_transitions_total", transitions) == restart + 1


class TestAttemptDurations:
    """cri_prober_probe_duration_seconds, every attempt by result: only when asked for."""

    def test_absent_by_default(self, metrics: Metrics, container: ContainerInfo) -> None:
        attempt(metrics, container, ProbeKind.READINESS, record("failure"))
        assert b"cri_prober_probe_duration_seconds" not in metrics.exposition()

    def test_every_result_when_enabled(self, container: ContainerInfo) -> None:
        metrics = Metrics(attempt_durations=True)
        for result in ("success", "failure", "error"):
            attempt(metrics, container, ProbeKind.READINESS, record(result, duration=0.3))
        sample = metrics.registry.get_sample_value
        own = "cri_prober_probe_duration_seconds"
        assert [sample(f"{own}_count", {**LABELS, "result": r}) for r in ("success", "error")] == [
            1.0,
            1.0,
        ]
        labels = {**LABELS, "result": "failure", "le": "0.5"}
        assert sample(f"{own}_bucket", labels) == 1.0
        assert sample(f"{own}_sum", {**LABELS, "result": "failure"}) == pytest.approx(0.3)


class TestWorkerStopped:
    def test_deletes_the_workers_series(self, container: ContainerInfo) -> None:
        """When a worker stops for good, every series labelled with it goes."""
        metrics = Metrics(attempt_durations=True)
        attempt(metrics, container, ProbeKind.READINESS, record("success", timed_out=False))
        attempt(metrics, container, ProbeKind.READINESS, record("failure", timed_out=True))
        changed(metrics, container, None, Published.FAILURE)
        attempt(metrics, container, ProbeKind.LIVENESS, record("success"))
        metrics.manager_event(WorkerStopped(container, ProbeKind.READINESS, replaced=False))
        # The node-wide count by reason names no worker: it stays.
        text = "\n".join(
            line
            for line in metrics.exposition().decode().splitlines()
            if "cri_prober_probe_attempts_by_reason" not in line
        )
        assert 'probe_type="Readiness"' not in text
        assert 'probe_type="Liveness"' in text

    def test_keeps_a_replacements_series(self, metrics: Metrics, container: ContainerInfo) -> None:
        """A worker replaced after a spec change leaves the series to its successor."""
        attempt(metrics, container, ProbeKind.READINESS, record("success"))
        # The manager says so: the stopped worker's replacement already runs.
        metrics.manager_event(WorkerStopped(container, ProbeKind.READINESS, replaced=True))
        assert total(metrics, "successful") == 1.0

    def test_a_pod_recreated_under_its_name_keeps_its_count(
        self, metrics: Metrics, container: ContainerInfo
    ) -> None:
        """prober_probe_total names the pod UID: the old pod's worker stopping deletes its
        count, not the new pod's (the series without a UID go, as they always did)."""
        recreated = dataclasses.replace(
            container, pod=dataclasses.replace(container.pod, uid="uid-2")
        )
        attempt(metrics, container, ProbeKind.READINESS, record("success"))
        attempt(metrics, recreated, ProbeKind.READINESS, record("failure"))
        metrics.manager_event(WorkerStopped(container, ProbeKind.READINESS, replaced=False))
        assert total(metrics, "successful") is None
        new = {**LABELS, "result": "failed", "pod_uid": "uid-2"}
        assert metrics.registry.get_sample_value("prober_probe_total", new) == 1.0


def populated(metrics: Metrics) -> Metrics:
    """Every per-worker series, label values that need escaping, and counts past 10^6 (which
    Go, and so the encoders, write with an exponent)."""
    for index, pod in enumerate(["web-0", 'we"b\\1', "web\n2"]):
        slot = make_slot()
        # A pod UID each: the per-container gauges are one per pod (their labels escaped too).
        pod_info = dataclasses.replace(slot.container.pod, name=pod, uid=f"uid-{index + 1}")
        container = dataclasses.replace(slot.container, pod=pod_info)
        for kind in ProbeKind:
            for result in ("success", "warning", "failure", "unknown", "error"):
                attempt(metrics, container, kind, record(result, duration=0.01 * index))
            attempt(metrics, container, kind, record("failure", duration=3.0, timed_out=True))
            changed(metrics, container, None, Published.FAILURE)
            changed(metrics, container, Published.FAILURE, Published.SUCCESS)
    metrics.cri_call(CriCall("ExecSync", "OK", 0.01))
    # Counting to 10^6 one attempt at a time takes long; the count is set where it is kept.
    worker = next(iter(metrics._workers._by_key.values()))
    worker.totals["uid-1"][0] = 1_234_567
    worker.held = True  # cri_prober_probe_on_hold, which only held probes have
    return metrics


ACCEPT = [
    "",
    "text/plain",
    "text/plain;version=1.0.0;escaping=allow-utf-8",
    "text/plain;version=1.0.0;escaping=dots",
    "text/plain;version=1.0.0;escaping=values",
    "application/openmetrics-text",
    "application/openmetrics-text;version=1.0.0;escaping=underscores",
    "application/openmetrics-text;version=1.0.0;escaping=dots",
    "application/openmetrics-text;version=1.0.0;escaping=values",
    "application/openmetrics-text;version=2.0.0;escaping=allow-utf-8",
    # Prometheus 3's default.
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
]


class TestExposition:
    @pytest.mark.parametrize("attempt_durations", [False, True])
    @pytest.mark.parametrize("accept", ACCEPT)
    def test_equals_prometheus_clients_encoder(self, accept: str, attempt_durations: bool) -> None:
        """The fast exposition is what prometheus_client's negotiated encoder writes for the
        same registry, byte for byte, in every format and escaping."""
        metrics = populated(Metrics(attempt_durations=attempt_durations))
        encoder, _content_type = choose_encoder(accept)
        assert metrics.exposition(accept) == encoder(metrics.registry)

    def test_openmetrics_parses(self) -> None:
        """OpenMetrics' strict parser reads the OpenMetrics exposition, ending in # EOF."""
        metrics = populated(Metrics(attempt_durations=True))
        text = metrics.exposition("application/openmetrics-text").decode()
        assert text.endswith("\n# EOF\n")
        families = openmetrics_parser.text_string_to_metric_families(text)  # type: ignore[no-untyped-call]
        names = {family.name for family in families}
        assert {"prober_probe", "prober_probe_duration_seconds"} <= names

    @pytest.mark.parametrize(
        "accept",
        [
            "application/openmetrics-text; version=abc",  # prometheus_client raises on it
            # Would end up in the Content-Type (a version 2.x passes prometheus_client's check).
            "application/openmetrics-text; version=2.x\ry",
        ],
    )
    def test_unusable_accept_gets_the_text_format(self, accept: str) -> None:
        assert negotiate(accept)[1] == "text/plain; version=0.0.4; charset=utf-8"


def test_cri_calls(metrics: Metrics) -> None:
    """Every CRI call is counted and timed by method and status code."""
    metrics.cri_call(CriCall("ExecSync", "OK", 0.01))
    metrics.cri_call(CriCall("ExecSync", "DEADLINE_EXCEEDED", 3.0))
    sample = metrics.registry.get_sample_value
    assert sample("cri_prober_cri_requests_total", {"method": "ExecSync", "code": "OK"}) == 1.0
    labels = {"method": "ExecSync", "code": "DEADLINE_EXCEEDED"}
    assert sample("cri_prober_cri_request_duration_seconds_sum", labels) == 3.0


async def test_exec_slots(metrics: Metrics, tmp_path: Path) -> None:
    """The exec slots' gauges and counters follow the CRI client: calls waiting for a slot or
    out at the runtime, seconds waited, slots preempted, execs that overran their start hold."""
    cri = CriClient.connect(f"unix://{tmp_path}/none.sock")  # lazy: never connects here
    manager: Any = SimpleNamespace(events=Topic[object]("events"), tracked=lambda: 0)
    node: Any = SimpleNamespace(updates=Topic[object]("updates"), last_relist_ok=None)
    stop = metrics.follow(manager=manager, node=node, cri=cri)
    try:
        slots = cri._exec_slots  # the client's own, driven by hand: no runtime needed
        held = [await slots.acquire(f"c{i}") for i in range(cri.max_concurrent_execs)]
        waiting = asyncio.create_task(slots.acquire("other"))
        await asyncio.sleep(0)
        sample = metrics.registry.get_sample_value
        assert sample("cri_prober_execs_waiting", {}) == 1.0
        assert sample("cri_prober_execs_outstanding", {}) == 0.0
        assert sample("cri_prober_exec_slot_preemptions_total", {}) == 0.0
        held[0].soften()
        await waiting
        assert sample("cri_prober_execs_waiting", {}) == 0.0
        assert sample("cri_prober_exec_slot_preemptions_total", {}) == 1.0
        assert sample("cri_prober_exec_overruns_total", {}) == 1.0
        assert sample("cri_prober_exec_slot_wait_seconds_total", {}) == 0.0
        # The runtime's pace: absent until enough execs were answered, then their median.
        assert sample("cri_prober_exec_pace_seconds", {}) is None
        for slot in (*held, waiting.result()):
            slot.finish()
        assert cri.exec_pace is not None
        assert sample("cri_prober_exec_pace_seconds", {}) == cri.exec_pace
    finally:
        stop()
        await cri.close()


def test_ticks_dropped_are_counted_node_wide_by_probe_type(
    metrics: Metrics, container: ContainerInfo
) -> None:
    """An attempt that came after dropped ticks adds them to the node's counter; none is
    exported for a probe type that never dropped one."""
    late = dataclasses.replace(record("success"), late=0.4, dropped=2)
    attempt(metrics, container, ProbeKind.LIVENESS, late)
    attempt(metrics, container, ProbeKind.LIVENESS, late)
    attempt(metrics, container, ProbeKind.READINESS, record("success"))
    sample = metrics.registry.get_sample_value
    assert sample("cri_prober_probe_ticks_dropped_total", {"probe_type": "Liveness"}) == 4.0
    assert sample("cri_prober_probe_ticks_dropped_total", {"probe_type": "Readiness"}) is None


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
        async with asyncio.timeout(HANG_GUARD):
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
        assert b"Vary: Accept, Accept-Encoding" in head
        assert b"Content-Encoding" not in head
        assert b'cri_prober_cri_requests_total{code="OK",method="Version"} 1.0' in body

    @pytest.mark.parametrize("method", ["GET", "HEAD"])
    async def test_gzip(self, server: MetricsServer, metrics: Metrics, method: str) -> None:
        """With gzip accepted, the answer is the same exposition gzipped, and says so."""
        populated(metrics)
        plain = await self.request(server, b"GET /metrics HTTP/1.1\r\n\r\n")
        response = await self.request(
            server,
            f"{method} /metrics HTTP/1.1\r\naccept-encoding: br;q=1.0, GZIP;q=0.5\r\n\r\n".encode(),
        )
        head, _, body = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"Content-Encoding: gzip" in head.split(b"\r\n")
        assert b"Vary: Accept, Accept-Encoding" in head.split(b"\r\n")
        assert b"Content-Type: text/plain; version=0.0.4; charset=utf-8" in head
        if method == "GET":
            assert f"Content-Length: {len(body)}".encode() in head
            assert gzip.decompress(body) == plain.partition(b"\r\n\r\n")[2]
        else:
            assert body == b""

    async def test_openmetrics(self, server: MetricsServer, metrics: Metrics) -> None:
        """Asked for OpenMetrics (here as Prometheus asks, gzipped), the answer is OpenMetrics."""
        populated(metrics)
        accept = ACCEPT[-1]
        response = await self.request(
            server,
            f"GET /metrics HTTP/1.1\r\nAccept: {accept}\r\nAccept-Encoding: gzip\r\n\r\n".encode(),
        )
        head, _, body = response.partition(b"\r\n\r\n")
        fields = head.split(b"\r\n")
        assert (
            b"Content-Type: application/openmetrics-text; version=1.0.0; charset=utf-8; "
            b"escaping=allow-utf-8"
        ) in fields
        assert b"Content-Encoding: gzip" in fields
        text = gzip.decompress(body)
        assert text.endswith(b"\n# EOF\n")
        assert text == metrics.exposition(accept)

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


# -- limits: what clients of the metrics port may hold (issue 15) ----------------------------------


class BigMetrics(Metrics):
    """An exposition far larger than socket buffers, so an unread answer cannot be sent."""

    def exposition_pieces(self, accept: str | None = None) -> Iterator[bytes]:
        yield b"x" * 16_000_000


class GatedMetrics(Metrics):
    """An exposition whose pieces do not end until the test releases it."""

    def __init__(self) -> None:
        super().__init__()
        self.made = 0
        self.pieces = 0
        self.release = False

    def exposition_pieces(self, accept: str | None = None) -> Iterator[bytes]:
        self.made += 1
        while not self.release:  # the many pieces of a node with 20,000 workers
            self.pieces += 1
            # A real piece is 1-2 ms of work: without it, a loaded machine's slow accepts let
            # millions of empty pieces pile up (gigabytes) before the test releases the gate.
            time.sleep(0.001)
            yield b""
        yield from super().exposition_pieces(accept)


@contextlib.contextmanager
def released_at_exit(metrics: GatedMetrics) -> Iterator[None]:
    """Ends the held exposition however the test ends, so a failed wait cannot hang the stop."""
    try:
        yield
    finally:
        metrics.release = True


async def half_sent(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection whose request head never ends."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: a\r\n")
    await writer.drain()
    return reader, writer


async def closed_by_server(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """What the server sent before closing (a reset counts as closing), within ``timeout``."""
    async with asyncio.timeout(timeout):
        try:
            return await reader.read()
        except ConnectionResetError:
            return b""


async def get(port: int, fields: bytes = b"") -> bytes:
    """GET /metrics with these header ``fields`` (each ending in CRLF); the whole answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: a\r\n" + fields + b"\r\n")
    try:
        return await closed_by_server(reader, HANG_GUARD)
    finally:
        writer.close()


def refusal_lines(logs: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [entry for entry in logs if entry["event"] == "metrics_connections_refused"]


@contextlib.asynccontextmanager
async def serving(metrics: Metrics, **limits: Any) -> AsyncIterator[MetricsServer]:
    server = MetricsServer(metrics, ServerLimits(**limits))
    await server.start("127.0.0.1:0")
    try:
        yield server
    finally:
        await server.stop()


class TestLimits:
    async def test_connections_over_the_cap_are_closed_at_once(self, metrics: Metrics) -> None:
        """With the cap's worth of half-sent requests held, the next connection is closed at
        once (not held for the time limit), and a scrape works again when they go.

        At once is shown as the refusal's reason rather than timed: "busy" is counted when a
        connection is closed as it is accepted, never served."""
        cap = ServerLimits().max_connections
        with structlog.testing.capture_logs() as logs:
            async with serving(metrics) as server:
                held = [await half_sent(server.port) for _ in range(cap)]
                await until(lambda: server.connections == cap, timeout=HANG_GUARD)
                reader, writer = await half_sent(server.port)
                # A guard against a connection held for ever, not a bound.
                assert await closed_by_server(reader, timeout=HANG_GUARD) == b""
                writer.close()
                assert server.connections == cap
                for _, held_writer in held:
                    held_writer.close()
                await until(lambda: server.connections == 0, timeout=HANG_GUARD)
                assert (await get(server.port)).startswith(b"HTTP/1.1 200 OK")
        assert refusal_lines(logs)[0]["busy"] == 1

    async def test_a_half_sent_request_is_dropped_at_the_time_limit(self, metrics: Metrics) -> None:
        """A request head that never ends holds its connection for the time limit, no longer.

        Shown by the drop itself rather than its timing: the server closes the connection with
        nothing sent, counting it as timed out, which only its time limit firing does."""
        with structlog.testing.capture_logs() as logs:
            async with serving(metrics, request_timeout=0.3) as server:
                reader, writer = await half_sent(server.port)
                # The timeout is a guard against a connection held for ever, not a bound.
                assert await closed_by_server(reader, timeout=HANG_GUARD) == b""
                writer.close()
        # The refusals are logged in one summary line, at the latest when the server stops.
        (line,) = refusal_lines(logs)
        assert (line["count"], line["timed_out"]) == (1, 1)

    async def test_an_answer_never_read_does_not_hold_the_connection(self) -> None:
        """A client that asks and never reads cannot keep its connection (and the answer in
        the kernel) past the time limit: the server resets it."""
        async with serving(BigMetrics(), request_timeout=0.5) as server:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
            sock.send(b"GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n")
            await until(lambda: server.connections == 1, timeout=HANG_GUARD)
            await until(lambda: server.connections == 0, timeout=HANG_GUARD)
            # The rest never arrives: the connection was reset, not closed after the answer.
            sock.setblocking(True)
            sock.settimeout(2)
            received = 0
            with contextlib.suppress(ConnectionResetError):
                while chunk := sock.recv(1 << 20):
                    received += len(chunk)
            sock.close()
            assert received < 16_000_000

    async def test_a_request_head_over_the_limit_is_refused(self, metrics: Metrics) -> None:
        """Past 8 KiB without the blank line that ends a head, the answer is 431 at once."""
        async with serving(metrics) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /metrics HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 9000 + b"\r\n")
            await writer.drain()
            assert (await closed_by_server(reader, timeout=HANG_GUARD)).startswith(b"HTTP/1.1 431 ")
            writer.close()

    async def test_no_connection_within_the_descriptor_reserve(self, metrics: Metrics) -> None:
        """While the process is within the reserve of its descriptor limit (here: always), a
        connection is closed as soon as it is accepted, and counted."""
        limit = fdlimit.soft_limit()
        assert limit is not None
        with structlog.testing.capture_logs() as logs:
            async with serving(metrics, fd_reserve=limit, log_interval=0.1) as server:
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
                assert await closed_by_server(reader, timeout=HANG_GUARD) == b""
                writer.close()
                await until(lambda: bool(refusal_lines(logs)), timeout=HANG_GUARD)
        assert refusal_lines(logs)[0]["fd_reserve"] == 1

    async def test_a_flood_is_logged_once_per_interval(self, metrics: Metrics) -> None:
        """200 refused connections in one interval make one summary line, no traceback.

        The interval is an hour, so however slow a busy machine makes the 200 connections they
        all fall in it; the line comes when the server stops (what is counted is never lost)."""
        with structlog.testing.capture_logs() as logs:
            async with serving(metrics, max_connections=1, log_interval=3600) as server:
                held = await half_sent(server.port)
                await until(lambda: server.connections == 1, timeout=HANG_GUARD)
                for _ in range(200):
                    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
                    await closed_by_server(reader, timeout=HANG_GUARD)
                    writer.close()
                assert refusal_lines(logs) == []  # within the interval: nothing logged yet
                held[1].close()
        lines = refusal_lines(logs)
        assert [(line["count"], line["busy"]) for line in lines] == [(200, 200)]
        assert lines[0]["log_level"] == "warning"
        assert lines[0]["seconds"] == 3600

    async def test_the_interval_timer_logs_what_it_counted(self, metrics: Metrics) -> None:
        """Without a stop, the line comes when the interval ends."""
        with structlog.testing.capture_logs() as logs:
            async with serving(metrics, max_connections=1, log_interval=0.05) as server:
                held = await half_sent(server.port)
                await until(lambda: server.connections == 1, timeout=HANG_GUARD)
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
                await closed_by_server(reader, timeout=HANG_GUARD)
                writer.close()
                await until(lambda: bool(refusal_lines(logs)), timeout=HANG_GUARD)
                held[1].close()
        assert [(line["count"], line["busy"]) for line in refusal_lines(logs)] == [(1, 1)]

    async def test_accepting_without_descriptors_pauses_quietly(self, metrics: Metrics) -> None:
        """accept() failing with EMFILE (the limit lowered to what is open, in-process, then
        restored) is counted and retried a moment later; the waiting client is then served."""
        async with serving(metrics, fd_reserve=0, accept_retry=0.1, log_interval=0.1) as server:
            client = socket.socket()
            client.setblocking(False)
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            open_now = fdlimit.open_fds()
            assert open_now is not None
            with structlog.testing.capture_logs() as logs:
                # No descriptor is left for the server's accept(); the client needs none more.
                resource.setrlimit(resource.RLIMIT_NOFILE, (open_now - 1, hard))
                try:
                    with contextlib.suppress(BlockingIOError):
                        client.connect(("127.0.0.1", server.port))
                    await until(lambda: bool(refusal_lines(logs)), timeout=HANG_GUARD)
                finally:
                    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            (line,) = refusal_lines(logs)
            assert line["accept_failed"] >= 1
            assert line["error"] == "Too many open files"
            loop = asyncio.get_running_loop()
            await loop.sock_sendall(client, b"GET /metrics HTTP/1.1\r\n\r\n")
            assert (await loop.sock_recv(client, 100)).startswith(b"HTTP/1.1 200 OK")
            client.close()

    async def test_concurrent_scrapes_share_one_exposition_and_the_loop_goes_on(self) -> None:
        """20 scrapes at once while an exposition is being made: it is made a piece at a time,
        giving the event loop a turn after each, so the loop goes on (it accepts and reads all
        20 requests while the exposition is held), and at most three expositions answer all of
        them (the one the first scrape started, and then one for everyone who came while it was
        made). Were the pieces read without giving way, nothing here would ever be accepted."""
        metrics = GatedMetrics()
        async with serving(metrics) as server, contextlib.AsyncExitStack() as stack:
            stack.enter_context(released_at_exit(metrics))
            scrapes = [asyncio.create_task(get(server.port)) for _ in range(20)]
            # The first exposition is being made (held), and all 20 are accepted meanwhile.
            await until(lambda: metrics.pieces > 0, timeout=HANG_GUARD)
            await until(lambda: server.requests_waiting == 20, timeout=HANG_GUARD)
            assert metrics.made == 1  # still the first, held
            metrics.release = True
            answers = await asyncio.gather(*scrapes)
            assert all(answer.startswith(b"HTTP/1.1 200 OK") for answer in answers)
            assert metrics.made == 2  # shared: 20 scrapes, two expositions

    async def test_variants_share_generations(self) -> None:
        """Plain, gzipped and OpenMetrics scrapes at once: each gets its own format, and each
        format is made once per generation however many ask for it (two generations: the one
        the first request started, and the next for everyone who came while it was made)."""
        metrics = GatedMetrics()
        variants = {
            b"": b"text/plain; version=0.0.4",
            b"Accept-Encoding: gzip\r\n": b"text/plain; version=0.0.4",
            b"Accept: application/openmetrics-text\r\n": b"application/openmetrics-text",
        }
        async with serving(metrics) as server, contextlib.AsyncExitStack() as stack:
            stack.enter_context(released_at_exit(metrics))
            scrapes = [
                asyncio.create_task(get(server.port, fields))
                for fields in variants
                for _ in range(10)
            ]
            await until(lambda: server.requests_waiting == 30, timeout=HANG_GUARD)
            metrics.release = True
            answers = await asyncio.gather(*scrapes)
        for index, answer in enumerate(answers):
            fields, content_type = list(variants.items())[index // 10]
            head, _, body = answer.partition(b"\r\n\r\n")
            assert b"Content-Type: " + content_type in head
            assert (b"Content-Encoding: gzip" in head) == (b"gzip" in fields)
            if b"gzip" in fields:
                body = gzip.decompress(body)
            assert body.endswith(b"# EOF\n") == (b"openmetrics" in fields)
        assert metrics.made == 3  # the first request's format, then both formats once

    @pytest.mark.parametrize("fields", [b"", b"Accept-Encoding: gzip\r\n"])
    async def test_an_answer_is_never_older_than_its_request(
        self, metrics: Metrics, fields: bytes
    ) -> None:
        """Sharing expositions never serves one made before the request arrived."""
        async with serving(metrics) as server:
            for calls in range(1, 4):
                metrics.cri_call(CriCall("Version", "OK", 0.001))
                sample = f'cri_prober_cri_requests_total{{code="OK",method="Version"}} {calls}.0'
                _head, _, body = (await get(server.port, fields)).partition(b"\r\n\r\n")
                if fields:
                    body = gzip.decompress(body)
                assert sample.encode() in body
