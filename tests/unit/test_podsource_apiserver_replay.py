"""The apiserver pod source against a real kube-apiserver 1.28.7's recorded answers (replayed
by the fake, ``tests/fixtures/kube-apiserver-1.28.7``) and the fake's watch-cache rules: what it
asks the server (lists from the watch cache, a streaming list where offered), how it relists
(after a jittered back-off), that quiet streams are not cut, and how a 403 at start is logged."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import httpx2
import pytest
from lightkube import KubeConfig
from structlog.testing import capture_logs

from cri_prober.podspecs.apiserver import ApiServerSource
from tests.support.apiserver import GONE, FakeApiServer, RecordedRequest, Recording, running
from tests.support.clock import ManualClock

NODE = "node-a"  # the recordings' node
LISTED = Recording.load("list-node-a-rv0")  # 3 pods of node-a, resourceVersion 209


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
        fake.put(_pod("elsewhere", node="node-b"))
        yield fake
        assert fake.protocol_errors == []


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def _pod(name: str, *, node: str = NODE) -> dict[str, Any]:
    pod: dict[str, Any] = copy.deepcopy(LISTED.json()["items"][0])
    pod["metadata"].update(name=name, uid=f"uid-{name}")
    pod["spec"]["nodeName"] = node
    return pod


def _source(server: FakeApiServer, clock: ManualClock, **kwargs: Any) -> ApiServerSource:
    return ApiServerSource(
        node_name=NODE,
        config=KubeConfig.from_server(server.url),
        clock=clock,
        retry_initial=0.01,
        retry_max=0.05,
        **kwargs,
    )


def _events(logs: Sequence[Mapping[str, Any]], name: str) -> list[Mapping[str, Any]]:
    return [entry for entry in logs if entry["event"] == name]


def _lists(server: FakeApiServer) -> list[RecordedRequest]:
    return [request for request in server.requests if request.verb == "list"]


def _names(source: ApiServerSource) -> set[str]:
    return {spec.label.split("/")[1] for spec in source.pods.values()}


async def _until(predicate: Any, timeout: float = 10.0) -> None:
    """Poll a condition set by the source's task (it signals nothing a test could await)."""
    async with asyncio.timeout(timeout):  # a hang guard; the condition comes in milliseconds
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


# -- what it asks -------------------------------------------------------------------------------


async def test_the_first_list_reads_the_watch_cache_not_etcd(
    server: FakeApiServer, clock: ManualClock
) -> None:
    """resourceVersion=0: the watch cache answers; a list without one is a quorum read of etcd,
    which reads every pod of the cluster to filter one node's (a 1.28 server, WatchList off)."""
    source = _source(server, clock)
    async with running(source):
        await server.wait_streams(1)
        assert _names(source) == {"web-probes", "with-init", "with-sidecar"}
    lists = _lists(server)
    assert lists, "no list"
    assert [request.resource_version for request in lists] == ["0"]
    assert lists[0].query["fieldSelector"] == f"spec.nodeName={NODE}"
    assert "fieldSelector=spec.nodeName%3Dnode-a" in lists[0].query_string
    assert lists[0].headers.get("Accept") is not None  # headers are recorded too


async def test_a_relist_after_410_reads_the_cache_at_the_last_version_after_a_jittered_wait(
    server: FakeApiServer, clock: ManualClock
) -> None:
    """What an API server restart does (recorded): the stream breaks without its final chunk,
    the resumed watch is answered 200 with an ERROR event holding a 410 Status. The relist
    waits the reflector's back-off (0.8 s × [1, 2), then doubling) and reads the watch cache at
    the last version seen (no limit: a limit would send it to etcd)."""
    sleeps = Sleeps()
    source = _source(server, clock, sleep=sleeps)
    async with running(source):
        await server.wait_streams(1)
        assert sleeps.delays == []  # the first list (after the 422) is at once
        watched_from = server.requests[-1].resource_version
        server.replay_next("watch", "watch-cut-by-apiserver-stop")
        server.replay_next("watch", "watch-after-restart-410")
        with capture_logs() as logs:
            server.end_watches()  # the fake's own stream ends; the replays answer the next two
            await server.wait_streams(4)
        (expired,) = _events(logs, "pod_watch_expired")
        assert expired["detail"] == "410 Expired: too old resource version: 228 (253)"
        delay = expired["delay"]
        assert 0.8 <= delay < 1.6
        assert delay in [round(d, 3) for d in sleeps.delays]
        assert _events(logs, "pod_source_failed") == []
        assert _events(logs, "pod_watch_interrupted")  # the cut: resumed, no relist

        # A second 410 soon after: the wait doubles.
        with capture_logs() as logs:
            server.send_error(GONE)
            await server.wait_streams(5)
        (expired,) = _events(logs, "pod_watch_expired")
        assert 1.6 <= expired["delay"] < 3.2
        # Two minutes without one: back to the first step.
        clock.now += 121
        with capture_logs() as logs:
            server.send_error(GONE)
            await server.wait_streams(6)
        (expired,) = _events(logs, "pod_watch_expired")
        assert 0.8 <= expired["delay"] < 1.6
    assert source.relists == 3
    lists = _lists(server)
    assert [request.resource_version for request in lists] == [
        "0",
        watched_from,  # the last version seen: nothing came on the replayed streams
        str(server.version),
        str(server.version),
    ]
    assert all("limit" not in request.query for request in lists[1:])
    assert sum(request.streaming_list for request in server.requests) == 1  # 422 once, for life


async def test_the_caches_whole_answer_to_a_limited_list_is_taken_as_one(
    server: FakeApiServer, clock: ManualClock
) -> None:
    """resourceVersion=0&limit=2 (recorded): the cache ignores limit, 3 pods and no continue."""
    server.replay_next("list", "list-node-a-limit2-page1-rv0")
    source = _source(server, clock, streaming_list=False, page_size=2)
    async with running(source):
        await server.wait_streams(1)
        assert _names(source) == {"web-probes", "with-init", "with-sidecar"}
    (listing,) = _lists(server)
    assert (listing.resource_version, listing.query["limit"]) == ("0", "2")
    assert server.requests[-1].resource_version == "287"  # the cache's own version


async def test_a_list_the_cache_cannot_serve_falls_back_to_paged_reads_of_etcd(
    server: FakeApiServer, clock: ManualClock
) -> None:
    """The relist at the last version is answered 410 (recorded): at once, a quorum list in
    pages, the second page asking with the first page's continue token (recorded pages)."""
    source = _source(server, clock, sleep=Sleeps(), streaming_list=False, page_size=2)
    async with running(source):
        await server.wait_streams(1)
        server.replay_next("list", "list-exact-rv-after-compact-410")
        first = server.replay_next("list", "list-node-a-limit2-page1")
        server.replay_next("list", "list-node-a-limit2-page2")
        with capture_logs() as logs:
            server.send_error(GONE)
            await server.wait_streams(2)
        (fallback,) = _events(logs, "pod_list_fallback")
        assert fallback["action"] == "listing from etcd"
        assert "410 Expired" in fallback["detail"]
        assert _names(source) == {"web-probes", "with-init", "with-sidecar"}
    _, at_version, page1, page2 = _lists(server)
    assert "limit" not in at_version.query
    assert page1.resource_version is None
    assert page1.query["limit"] == "2"
    assert page2.query["continue"] == first.json()["metadata"]["continue"]
    assert page2.resource_version is None  # a continued list may not name a version
    assert server.requests[-1].resource_version == "297"  # the pages' snapshot
    assert source.relists == 1


async def test_one_unpaged_answer_over_the_byte_cap_makes_lists_paged(
    server: FakeApiServer, clock: ManualClock
) -> None:
    """The cache ignores limit: one answer holds every pod of the node. Past max_page_bytes
    the read fails and lists go to etcd in pages from then on, each page under the cap."""
    cap = 6 * 1024  # one pod's answer (~4-5 KiB) fits, all 3 (~12 KiB) do not
    source = _source(server, clock, streaming_list=False, page_size=1, max_page_bytes=cap)
    with capture_logs() as logs:
        async with running(source):
            await server.wait_streams(1)
            assert len(source.pods) == 3
    (failed,) = _events(logs, "pod_source_failed")
    assert failed["error"].endswith("stopped reading; lists read pages from now on")
    first, *pages = _lists(server)
    assert first.resource_version == "0"
    assert [(page.resource_version, page.query.get("continue")) for page in pages] == [
        (None, None),
        (None, "1"),
        (None, "2"),
    ]


# -- the streaming list -------------------------------------------------------------------------


async def test_a_refused_streaming_list_falls_back_to_the_cache_list_once(
    server: FakeApiServer, clock: ManualClock
) -> None:
    """1.28 with WatchList off answers sendInitialEvents with 422 (recorded): one info line,
    the resourceVersion=0 list, and no streaming list again."""
    source = _source(server, clock)
    with capture_logs() as logs:
        async with running(source):
            await server.wait_streams(1)
            server.end_watches()
            await server.wait_streams(2)
    streaming, listing, *watches = server.requests
    assert streaming.streaming_list
    assert streaming.query["resourceVersionMatch"] == "NotOlderThan"
    assert streaming.query["allowWatchBookmarks"] == "true"
    assert listing.verb == "list"
    assert listing.resource_version == "0"
    assert [watch.streaming_list for watch in watches] == [False, False]
    (fallback,) = _events(logs, "pod_list_fallback")
    assert "422 Invalid" in fallback["detail"]
    assert _events(logs, "pod_source_failed") == []


async def test_a_streaming_list_fills_the_view_and_the_stream_goes_on(
    server: FakeApiServer, clock: ManualClock
) -> None:
    server.watch_list = True
    source = _source(server, clock)
    async with running(source) as changes:
        await server.wait_streams(1)
        await _until(lambda: changes.calls == 1)
        assert _names(source) == {"web-probes", "with-init", "with-sidecar"}
        assert not source.stale()
        server.put(_pod("later"))
        await _until(lambda: changes.calls == 2)
        assert "later" in _names(source)
    assert [request.streaming_list for request in server.requests] == [True]
    assert _lists(server) == []


async def test_a_recorded_streaming_list_ends_at_its_bookmark_and_watches_on(
    server: FakeApiServer, clock: ManualClock
) -> None:
    """1.28 with WatchList on (recorded): ADDED ×3 out of key order, the initial-events-end
    bookmark at 319 once a pod was written elsewhere, a plain bookmark, then the server's end;
    the watch resumes at 319 with no list."""
    server.replay_next("watch", "watchlist-gate-on-bookmark-after-pod-write", time_scale=0.01)
    source = _source(server, clock)
    with capture_logs() as logs:
        async with running(source) as changes:
            await server.wait_streams(2)
            assert changes.calls == 1
            assert _names(source) == {"web-probes", "with-init", "with-sidecar"}
    (listed,) = _events(logs, "pod_source_listed")
    assert (listed["pods"], listed["resource_version"]) == (3, "319")
    assert [entry["resource_version"] for entry in _events(logs, "pod_watch_bookmark")] == ["319"]
    streaming, watch = server.requests
    assert streaming.streaming_list
    assert "resourceVersion" not in streaming.query  # the first: at least etcd's latest
    assert (watch.streaming_list, watch.resource_version) == (False, "319")
    assert _lists(server) == []


async def test_a_streaming_list_without_its_end_bookmark_falls_back_to_lists(
    server: FakeApiServer, clock: ManualClock
) -> None:
    """A 1.28 cache with WatchList on, right after a restart, sends the initial events but no
    initial-events-end bookmark until a pod is written (recorded: none in 10 s): the stream
    ends unfinished, and the source lists instead, for good."""
    server.replay_next("watch", "watchlist-gate-on-after-restart-no-pod-writes", time_scale=0.01)
    source = _source(server, clock)
    with capture_logs() as logs:
        async with running(source) as changes:
            await server.wait_streams(2)
            await _until(lambda: changes.calls == 1)
    (fallback,) = _events(logs, "pod_list_fallback")
    assert fallback["detail"] == "no k8s.io/initial-events-end bookmark after 3 initial events"
    assert [request.verb for request in server.requests] == ["watch", "list", "watch"]


async def test_a_streaming_list_that_never_finishes_is_given_up_after_its_timeout(
    server: FakeApiServer, clock: ManualClock
) -> None:
    server.watch_list = True
    server.initial_events_end = False  # the stream stays open, initial events never end
    source = _source(server, clock, initial_events_timeout=0.1)
    async with running(source) as changes:
        await server.wait_streams(2)
        await _until(lambda: changes.calls == 1)
        assert len(source.pods) == 3
    assert [request.verb for request in server.requests] == ["watch", "list", "watch"]


# -- quiet streams ------------------------------------------------------------------------------


async def test_a_quiet_watch_without_bookmarks_is_ended_by_the_server_not_cut(
    server: FakeApiServer, clock: ManualClock
) -> None:
    """No bookmark for minutes is healthy (watch cache off, or after a restart until a pod is
    written: recorded). The client's read timeout is above the server's timeoutSeconds, so the
    server ends the stream, and the watch resumes from the same version without a relist."""
    server.watch_time_scale = 0.0005  # timeoutSeconds 300-600 pass in 0.15-0.3 s
    server.replay_next("watch", "watchlist-sendinitialevents")  # 422: no streaming list
    server.replay_next("watch", "watch-after-restart-no-pod-writes-no-bookmarks", time_scale=0.002)
    source = _source(server, clock)
    timeouts: list[Mapping[str, float]] = []

    async def record(request: httpx2.Request) -> None:
        if request.url.params.get("watch") == "true":
            timeouts.append(request.extensions["timeout"])

    source._http.event_hooks["request"].append(record)
    with capture_logs() as logs:
        async with running(source):
            await server.wait_streams(4)  # the replayed quiet stream, then two the fake ends
    watches = [request for request in server.requests if request.verb == "watch"]
    for request, timeout in zip(watches, timeouts, strict=True):
        assert int(request.query["timeoutSeconds"]) >= 300
        assert timeout["read"] > int(request.query["timeoutSeconds"]), "cut before the server"
    assert _events(logs, "pod_watch_idle") == []
    assert _events(logs, "pod_watch_expired") == []
    versions = {request.resource_version for request in watches if not request.streaming_list}
    assert versions == {str(server.version)}
    assert len(_lists(server)) == 1
    assert source.relists == 0


async def test_a_replayed_watch_applies_a_force_delete_and_logs_bookmarks(
    server: FakeApiServer, clock: ManualClock
) -> None:
    """The recorded stream: tmp-a ADDED, MODIFIED (label), MODIFIED (graceful delete),
    MODIFIED then DELETED (force delete), two BOOKMARKs at 228; the next watch resumes at 228."""
    server.replay_next("list", LISTED)
    server.replay_next("watch", "watch-node-a-bookmarks")
    source = _source(server, clock, streaming_list=False)
    with capture_logs(processors=[]) as logs:
        async with running(source) as changes:
            await server.wait_streams(2)
            await _until(lambda: len(_events(logs, "pod_watch_opened")) == 2)
            assert _names(source) == {"web-probes", "with-init", "with-sidecar"}
            # The list; tmp-a added; its graceful delete (deletionTimestamp); the force delete's
            # MODIFIED (grace 0) and DELETED. The label alone changes no spec.
            assert changes.calls == 5
    bookmarks = _events(logs, "pod_watch_bookmark")
    assert [entry["resource_version"] for entry in bookmarks] == ["228", "228"]
    opened = _events(logs, "pod_watch_opened")
    assert [entry["resume_from"] for entry in opened[:2]] == ["209", "228"]
    assert _lists(server)[0].resource_version == "0"
    assert len(_lists(server)) == 1


# -- a 403 at start -----------------------------------------------------------------------------


async def test_a_403_while_the_api_server_starts_is_a_warning_then_it_succeeds(
    server: FakeApiServer, clock: ManualClock
) -> None:
    server.replay_next("list", "error-403-no-rbac-list-pods", times=2)
    source = _source(server, clock)
    with capture_logs() as logs:
        async with running(source):
            await server.wait_streams(1)
            assert len(source.pods) == 3
    warnings = _events(logs, "pod_source_forbidden")
    assert [entry["log_level"] for entry in warnings] == ["warning", "warning"]
    assert warnings[0]["error"].startswith("list pods: 403 Forbidden: pods is forbidden: User ")
    assert "needs get/list/watch" not in warnings[0]["error"]
    assert _events(logs, "pod_source_failed") == []
    assert _events(logs, "pod_source_recovered") == []


async def test_an_anonymous_403_says_no_credentials_reached_the_server(
    server: FakeApiServer, clock: ManualClock
) -> None:
    """Anonymous auth is on by default: no credentials is a 403 (recorded), not a 401."""
    server.replay_next("list", "error-403-anonymous", times=10**6)
    source = _source(server, clock, forbidden_grace=0)
    with capture_logs() as logs:
        async with running(source):
            await server.wait_requests("list", 6)
    (failed,) = _events(logs, "pod_source_failed")
    assert failed["error"].startswith(
        "list pods: 403 Forbidden: the API server took the request as anonymous"
    )
    assert 'User "system:anonymous" cannot list resource "pods"' in failed["error"]


async def test_a_403_that_persists_at_start_is_the_rbac_error_once(
    server: FakeApiServer, clock: ManualClock
) -> None:
    server.replay_next("list", "error-403-no-rbac-list-pods", times=10**6)
    source = _source(server, clock)
    with capture_logs() as logs:
        async with running(source):
            await server.wait_requests("list", 2)
            clock.now += 31  # past the grace, and soon past 3 attempts
            await server.wait_requests("list", 8)
    failed = _events(logs, "pod_source_failed")
    assert len(failed) == 1
    assert failed[0]["error"].startswith(
        "list pods: 403 Forbidden: the service account needs get/list/watch on pods"
    )
    assert 2 <= len(_events(logs, "pod_source_forbidden")) <= 3
    assert source.stale()
