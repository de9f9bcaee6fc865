"""Issue 34, item 8: an API server (or a proxy) that ends every watch right after one event.
The reflector reopens a watch that ended normally at once, so the apiserver source reopened
about 120 a second with nothing said at info. Watches are counted in a metric; from the third
short one in a row, the next waits until a second after the last opened; one warning says so."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import pytest
from lightkube import KubeConfig
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from cri_prober.podspecs.apiserver import ApiServerSource
from cri_prober.podspecs.registry import PodSpecs
from cri_prober.podspecs.watch_churn import CHURN_AFTER, CHURN_PACE
from cri_prober.serving.metrics import Metrics
from tests.support.apiserver import FakeApiServer, Recording, running
from tests.support.clock import ManualClock

NODE = "node-a"  # the recordings' node
LISTED = Recording.load("list-node-a-rv0")


class Sleeps:
    """The source's ``sleep``: records each wait and returns at once (no real waiting)."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        await asyncio.sleep(0)


@pytest.fixture
async def server() -> AsyncIterator[FakeApiServer]:
    async with FakeApiServer(node_name=NODE) as fake:
        for pod in LISTED.json()["items"]:
            fake.put(pod)
        yield fake
        assert fake.protocol_errors == []


def _source(server: FakeApiServer, clock: ManualClock, sleeps: Sleeps) -> ApiServerSource:
    return ApiServerSource(
        node_name=NODE,
        config=KubeConfig.from_server(server.url),
        clock=clock,
        sleep=sleeps,
        streaming_list=False,
    )


def _events(logs: Sequence[Mapping[str, Any]], name: str) -> list[Mapping[str, Any]]:
    return [entry for entry in logs if entry["event"] == name]


def _pod(server: FakeApiServer, name: str) -> dict[str, Any]:
    pod: dict[str, Any] = copy.deepcopy(LISTED.json()["items"][0])
    pod["metadata"].update(name=name, uid=f"uid-{name}")
    return pod


async def _one_event_then_end(server: FakeApiServer, name: str, streams: int) -> None:
    """The open watch gets one event and is ended by the server; wait for the next one."""
    server.put(_pod(server, name))
    server.end_watches()
    await server.wait_streams(streams)


async def test_watches_the_server_ends_at_once_are_paced_and_reported_once(
    server: FakeApiServer,
) -> None:
    clock = ManualClock()  # never moves here: every watch ends "at once"
    sleeps = Sleeps()
    source = _source(server, clock, sleeps)
    async with running(source) as changes:
        await server.wait_streams(1)
        with capture_logs() as logs:
            for index in range(1, 7):
                await _one_event_then_end(server, f"churn-{index}", index + 1)
        await changes.wait(7)  # every event still reached the view
        assert len(source.pods) == 3 + 6
        # The first CHURN_AFTER - 1 reopen at once, as the reflector does; then paced.
        assert sleeps.delays == [CHURN_PACE] * (6 - CHURN_AFTER + 1)
        (churn,) = _events(logs, "pod_watch_churn")  # once: rate-limited
        assert churn["log_level"] == "warning"
        assert (churn["watches"], churn["paced"], churn["pace"]) == (CHURN_AFTER, 1, CHURN_PACE)
        assert "ended 3 watches in a row within 1s of opening them" in churn["detail"]

        # A watch that lasts (on the source's clock) ends the churn: the next opens at once.
        sleeps.delays.clear()
        clock.now += 2 * CHURN_PACE
        await _one_event_then_end(server, "calm-1", 8)
        await _one_event_then_end(server, "calm-2", 9)
        assert sleeps.delays == []
    assert source.watches == server.count("watch") >= 9


async def test_a_watch_is_paced_only_by_what_is_left_of_the_pace(server: FakeApiServer) -> None:
    """While churning, a short watch that lasted 0.4 s waits 0.6 s more: one opens per pace."""
    clock = ManualClock()
    sleeps = Sleeps()
    source = _source(server, clock, sleeps)
    async with running(source):
        await server.wait_streams(1)
        for index in range(1, CHURN_AFTER):
            await _one_event_then_end(server, f"churn-{index}", index + 1)
        assert sleeps.delays == []
        clock.now += 0.4  # the next watch lasts 0.4 s on the source's clock
        await _one_event_then_end(server, "churn-last", CHURN_AFTER + 1)
        assert sleeps.delays == [pytest.approx(CHURN_PACE - 0.4)]


async def test_the_watches_are_counted_in_a_metric(server: FakeApiServer) -> None:
    clock = ManualClock()
    source = _source(server, clock, Sleeps())
    metrics = Metrics()
    metrics.follow_pod_sources(PodSpecs([source], clock=clock))
    async with running(source):
        await server.wait_streams(1)
        await _one_event_then_end(server, "next", 2)
        samples = {
            sample.name: sample.value
            for family in text_string_to_metric_families(metrics.exposition().decode())
            for sample in family.samples
            if sample.labels.get("source") == "apiserver"
        }
        assert samples["cri_prober_pod_source_watches_total"] == server.count("watch") == 2
