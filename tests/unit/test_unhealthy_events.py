"""serve --mirror with --probes-from apiserver: the kubelet's Unhealthy events explain mirrored
failures (issue 38 item 2). The parser of an Event, the bounded store of the newest text per
probe, the list+watch against the fake API server, and a mirrored failure shown with the text
(and the note when the event predates the failure's window)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from lightkube import KubeConfig
from structlog.testing import capture_logs

from cri_prober.manager.slots import SlotKey
from cri_prober.podspecs.apiserver import ApiServerSource
from cri_prober.podspecs.options import PodSourceOptions, parse_source
from cri_prober.podspecs.unhealthy_events import (
    MAX_TEXT_CHARS,
    UnhealthyEvent,
    UnhealthyEvents,
    UnhealthyTexts,
    parse_event,
)
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.mirror import FailureText, MirroredAttempts, MirrorWorker
from cri_prober.probing.results import MIRROR_SOURCE
from tests.support.apiserver import FakeApiServer
from tests.support.daemon import daemon_on_fake_runtime
from tests.support.fake_runtime import FakeRuntime
from tests.support.waiting import until
from tests.unit.test_kubelet_mirror import (
    APISERVER_NODE,
    WEB_UID,
    _recorded_node_pods,
    mirror_node,
    start_recorded,
)
from tests.unit.test_kubelet_node_version import _kubeconfig

NODE = "node-a"
UID = "0b8c3f7e-1111-4222-8333-944455556666"


def kubelet_event(
    message: str = "Readiness probe failed: cat: /tmp/ready: No such file or directory",
    *,
    uid: str = UID,
    container: str = "c",
    host: str = NODE,
    last: str = "2026-11-28T10:00:05Z",
    reason: str = "Unhealthy",
    count: int = 3,
) -> dict[str, Any]:
    """A core/v1 Event as the kubelet's recorder writes one for a failed probe."""
    return {
        "kind": "Event",
        "apiVersion": "v1",
        "metadata": {"name": f"web.{uid[:6]}", "namespace": "ns"},
        "involvedObject": {
            "kind": "Pod",
            "namespace": "ns",
            "name": "web",
            "uid": uid,
            "apiVersion": "v1",
            "fieldPath": f"spec.containers{{{container}}}",
        },
        "reason": reason,
        "message": message,
        "source": {"component": "kubelet", "host": host},
        "firstTimestamp": "2026-11-28T09:59:00Z",
        "lastTimestamp": last,
        "count": count,
        "type": "Warning",
        "eventTime": None,
        "reportingComponent": "kubelet",
        "reportingInstance": host,
    }


# -- the parser -------------------------------------------------------------------------------


def test_a_failed_probes_event_parses_into_its_probe_text_and_time() -> None:
    event = parse_event(kubelet_event(), NODE)
    assert event == UnhealthyEvent(
        UID,
        "c",
        ProbeKind.READINESS,
        "cat: /tmp/ready: No such file or directory",
        1795860005.0,  # 2026-11-28T10:00:05Z
        3,
    )


def test_an_errored_probe_keeps_the_whole_message_and_each_kind_is_read() -> None:
    errored = parse_event(kubelet_event("Liveness probe errored: rpc error: code = Unknown"), NODE)
    assert errored is not None
    assert (errored.kind, errored.text) == (
        ProbeKind.LIVENESS,
        "Liveness probe errored: rpc error: code = Unknown",
    )
    startup = parse_event(kubelet_event("Startup probe failed: HTTP probe failed with 503"), NODE)
    assert startup is not None
    assert (startup.kind, startup.text) == (ProbeKind.STARTUP, "HTTP probe failed with 503")


def test_events_of_other_nodes_reasons_or_shapes_are_not_the_kubelets_probe_failures() -> None:
    assert parse_event(kubelet_event(host="node-b"), NODE) is None
    assert parse_event(kubelet_event(reason="Killing"), NODE) is None
    assert parse_event(kubelet_event("Readiness probe warning: redirect"), NODE) is None
    no_path = kubelet_event()
    no_path["involvedObject"]["fieldPath"] = ""
    assert parse_event(no_path, NODE) is None
    no_time = kubelet_event()
    no_time["lastTimestamp"] = no_time["firstTimestamp"] = None
    assert parse_event(no_time, NODE) is None
    junk: list[object] = [None, [], "x", {"reason": "Unhealthy", "involvedObject": "Pod"}]
    for obj in junk:
        assert parse_event(obj, NODE) is None


def test_an_event_recorded_by_the_new_api_has_its_instance_and_event_time() -> None:
    event = kubelet_event(host="")
    event["source"] = {}
    event["reportingInstance"] = NODE
    event["lastTimestamp"] = None
    event["eventTime"] = "2026-11-28T10:00:05.250000Z"
    parsed = parse_event(event, NODE)
    assert parsed is not None
    assert parsed.at == 1795860005.25


def test_a_long_output_is_cut() -> None:
    parsed = parse_event(kubelet_event("Readiness probe failed: " + "x" * 20_000), NODE)
    assert parsed is not None
    assert len(parsed.text) == MAX_TEXT_CHARS


# -- the store ------------------------------------------------------------------------------


def _event(uid: str, at: float, text: str = "t", container: str = "c") -> UnhealthyEvent:
    return UnhealthyEvent(uid, container, ProbeKind.LIVENESS, text, at)


def test_the_store_keeps_the_newest_text_per_probe_of_live_pods_only() -> None:
    live = {"a": object(), "b": object()}
    texts = UnhealthyTexts(lambda: live)
    assert texts.put(_event("a", 10.0, "new"))
    assert not texts.put(_event("a", 5.0, "older"))
    assert texts.get("a", "c", ProbeKind.LIVENESS) == FailureText("new", 10.0)
    assert texts.get("a", "c", ProbeKind.READINESS) is None
    assert not texts.put(_event("elsewhere", 10.0))  # a pod not on this node
    assert texts.put(_event("b", 1.0))
    del live["b"]  # the pod went: its texts go with it
    texts.prune()
    assert texts.get("b", "c", ProbeKind.LIVENESS) is None
    assert len(texts) == 1


def test_the_store_is_bounded() -> None:
    live = {str(i): object() for i in range(100)}
    texts = UnhealthyTexts(lambda: live, max_entries=10)
    for i in range(100):
        texts.put(_event(str(i), float(i)))
    assert len(texts) == 10
    # The oldest went first; the newest are kept.
    assert texts.get("99", "c", ProbeKind.LIVENESS) is not None
    assert texts.get("0", "c", ProbeKind.LIVENESS) is None


# -- list and watch against the fake API server ---------------------------------------------


@contextlib.asynccontextmanager
async def watching(fake: FakeApiServer, **options: Any) -> AsyncIterator[UnhealthyEvents]:
    source = ApiServerSource(
        node_name=APISERVER_NODE, config=KubeConfig.from_server(fake.url), streaming_list=False
    )
    source.replace_all(_recorded_node_pods())
    events = UnhealthyEvents(source, **options)
    task = asyncio.create_task(events.run())
    try:
        yield events
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await source.close()


async def test_the_watch_keeps_this_nodes_kubelet_texts_listed_and_watched() -> None:
    async with FakeApiServer(node_name=APISERVER_NODE) as fake:
        fake.add_event(
            kubelet_event(
                "Liveness probe failed: listed", uid=WEB_UID, container="app", host=APISERVER_NODE
            )
        )
        fake.add_event(kubelet_event("Liveness probe failed: elsewhere", uid=WEB_UID))
        async with watching(fake) as events:
            await fake.wait_event_watches(1)
            listed = events.texts.get(WEB_UID, "app", ProbeKind.LIVENESS)
            assert listed is not None
            assert listed.text == "listed"
            fake.add_event(
                kubelet_event(
                    "Liveness probe failed: watched",
                    uid=WEB_UID,
                    container="app",
                    host=APISERVER_NODE,
                    last="2026-11-28T10:01:00Z",
                )
            )
            await until(
                lambda: (
                    (t := events.texts.get(WEB_UID, "app", ProbeKind.LIVENESS)) is not None
                    and t.text == "watched"
                ),
                timeout=60,
            )
            assert len(events.texts) == 1
        assert fake.protocol_errors == []
        assert fake.event_requests[0]["fieldSelector"] == "involvedObject.kind=Pod,reason=Unhealthy"


async def test_a_list_too_large_to_hold_is_read_as_a_watch_from_any_version() -> None:
    """A cluster's Unhealthy events past the list's cap: one line, then a watch from
    resourceVersion 0, which sends them one bounded event at a time."""
    async with FakeApiServer(node_name=APISERVER_NODE) as fake:
        fake.add_event(
            kubelet_event(
                "Liveness probe failed: many", uid=WEB_UID, container="app", host=APISERVER_NODE
            )
        )
        with capture_logs() as logs:
            async with watching(fake, max_list_bytes=100) as events:
                await until(
                    lambda: events.texts.get(WEB_UID, "app", ProbeKind.LIVENESS) is not None,
                    timeout=60,
                )
        [list_request, watch_request] = fake.event_requests[:2]
        assert "watch" not in list_request
        assert (watch_request["watch"], watch_request["resourceVersion"]) == ("true", "0")
        [failed] = [e for e in logs if e["event"] == "kubelet_events_failed"]
        assert "watching from resourceVersion 0 instead" in failed["error"]


async def test_a_refused_list_is_one_clear_line_naming_the_rbac() -> None:
    async with FakeApiServer(node_name=APISERVER_NODE) as fake:
        fake.events_forbidden = True
        with capture_logs() as logs:
            async with watching(fake):
                await until(lambda: len(fake.event_requests) >= 3, timeout=60)
        failed = [e for e in logs if e["event"] == "kubelet_events_failed"]
        assert len(failed) == 1  # once per distinct error, not per retry
        assert "list and watch on events" in failed[0]["error"]


# -- a mirrored failure explained -------------------------------------------------------------


def _worker(node: Any, uid: str) -> MirrorWorker:
    slot = node.manager._slots.get(SlotKey(uid, "c"))
    assert slot is not None
    [worker] = [w for w in slot.workers.values() if isinstance(w, MirrorWorker)]
    return worker


def _failure(uid: str, since: float) -> MirroredAttempts:
    return MirroredAttempts(uid, "c", ProbeKind.READINESS, 0, 1, 0, since, since + 1)


async def test_a_mirrored_failure_shows_the_kubelets_event_text() -> None:
    async with mirror_node() as node:
        texts = UnhealthyTexts()
        node.manager.mirror_texts = texts
        pod, _ = await start_recorded(node, "flap", "c")
        uid = pod["metadata"]["uid"]
        texts.put(UnhealthyEvent(uid, "c", ProbeKind.READINESS, "db down", 1000.0))
        node.manager.on_mirrored([_failure(uid, 1000.5)])
        record = _worker(node, uid).history[-1]
        assert record.source == MIRROR_SOURCE
        assert record.result == "failure"
        assert record.output == "db down"
        assert "text from the kubelet's Unhealthy event" in record.note
        assert "before this failure" not in record.note


async def test_an_event_older_than_the_failure_says_so() -> None:
    async with mirror_node() as node:
        texts = UnhealthyTexts()
        node.manager.mirror_texts = texts
        pod, _ = await start_recorded(node, "flap", "c")
        uid = pod["metadata"]["uid"]
        texts.put(UnhealthyEvent(uid, "c", ProbeKind.READINESS, "db down", 1795860005.0))
        node.manager.on_mirrored([_failure(uid, 1795860005.0 + 300)])
        record = _worker(node, uid).history[-1]
        assert record.output == "db down"
        assert (
            "text from the kubelet's event at 2026-11-28T10:00:05Z, before this failure: the "
            "kubelet rate-limits its events"
        ) in record.note


async def test_without_an_event_a_mirrored_failure_is_as_before() -> None:
    async with mirror_node() as node:
        node.manager.mirror_texts = UnhealthyTexts()
        pod, _ = await start_recorded(node, "flap", "c")
        uid = pod["metadata"]["uid"]
        node.manager.on_mirrored([_failure(uid, 100.0)])
        record = _worker(node, uid).history[-1]
        assert record.output == ""
        assert record.reason == "kubelet"
        assert "the kubelet's Unhealthy event says why" in record.note


# -- serve wires it ---------------------------------------------------------------------------


@pytest.mark.parametrize("mirror", [True, False], ids=["mirror", "no-mirror"])
async def test_serve_watches_the_events_only_when_mirroring_from_the_apiserver(
    tmp_path: Path, mirror: bool
) -> None:
    async with FakeApiServer(node_name=APISERVER_NODE) as fake:
        kubeconfig = _kubeconfig(tmp_path / "kubeconfig", fake.url)
        options = PodSourceOptions(node_name=APISERVER_NODE, kubeconfig=kubeconfig)
        async with daemon_on_fake_runtime(
            tmp_path,
            FakeRuntime(),
            "probes: []\n",
            probes_from=(parse_source("apiserver"),),
            pod_sources=options,
            # Nothing listens there: the counters' reads fail, which this test does not need.
            mirror="http://127.0.0.1:9/metrics/probes" if mirror else "",
        ) as (daemon, _watcher):
            if mirror:
                await fake.wait_event_watches(1)
                assert daemon.unhealthy_events is not None
                assert daemon.manager.mirror_texts is daemon.unhealthy_events.texts
            else:
                await fake.wait_streams(1)  # the pods' watch: serve is up
                assert daemon.unhealthy_events is None
                assert daemon.manager.mirror_texts is None
        assert bool(fake.event_requests) is mirror
