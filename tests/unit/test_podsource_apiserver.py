"""The apiserver pod source against a local fake of the API server's list/watch protocol:
list then watch, resuming from the last resourceVersion, relisting on 410 Gone, and failing
(logged once, view kept, stale in time) on 403 and friends."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from lightkube import KubeConfig
from lightkube.config.kubeconfig import SERVICE_ACCOUNT
from structlog.testing import capture_logs

from cri_prober.errors import ConfigError
from cri_prober.podspecs.apiserver import ApiServerSource
from cri_prober.probing.kinds import ProbeKind
from tests.support.apiserver import FORBIDDEN, GONE, FakeApiServer, running, status
from tests.support.clock import ManualClock
from tests.support.waiting import HANG_GUARD

NODE = "kd-node"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kubelet-1.28.7"
STALE_AFTER = 60.0
WEB_UID = "f177263d9de7365e9da06d5ff3b3399b"
BATCH_UID = "2a55a2aecce1cdf9b9a4c4197da463d8"


def _recorded_pods() -> dict[str, dict[str, Any]]:
    document = json.loads((FIXTURES / "pods-running.json").read_text())
    return {item["metadata"]["uid"]: item for item in document["items"]}


def _copy_of(pod: dict[str, Any], *, uid: str, name: str, node: str = NODE) -> dict[str, Any]:
    pod = copy.deepcopy(pod)
    pod["metadata"].update(uid=uid, name=name)
    pod["spec"]["nodeName"] = node
    return pod


@pytest.fixture
async def server() -> AsyncIterator[FakeApiServer]:
    async with FakeApiServer(node_name=NODE) as fake:
        for pod in _recorded_pods().values():
            fake.put(pod)
        web = _recorded_pods()[WEB_UID]
        fake.put(_copy_of(web, uid="other-node-pod", name="elsewhere", node="node-2"))
        yield fake
        assert fake.protocol_errors == []


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def _source(server: FakeApiServer, clock: ManualClock, **kwargs: Any) -> ApiServerSource:
    """A source with short back-offs; LIST/WATCH only (the streaming list has its own tests,
    in test_podsource_apiserver_replay.py)."""
    options: dict[str, Any] = {
        "retry_initial": 0.01,
        "retry_max": 0.05,
        "relist_initial": 0.01,
        "relist_max": 0.05,
        "streaming_list": False,
    }
    return ApiServerSource(
        node_name=NODE,
        config=KubeConfig.from_server(server.url),
        stale_after=STALE_AFTER,
        clock=clock,
        **options | kwargs,
    )


def _labels(source: ApiServerSource) -> set[str]:
    return {spec.label for spec in source.pods.values()}


def _events(logs: Sequence[Mapping[str, Any]], name: str) -> list[Mapping[str, Any]]:
    return [entry for entry in logs if entry["event"] == name]


# -- list, then watch ---------------------------------------------------------------------------


async def test_the_first_list_fills_the_view_then_a_watch_follows_from_its_version(
    server: FakeApiServer, clock: ManualClock
) -> None:
    source = _source(server, clock)
    assert source.stale()  # no good read yet
    async with running(source) as changes:
        await server.wait_streams(1)
        assert _labels(source) == {"shop/web-kd-node", "jobs/batch-kd-node"}
        assert changes.calls == 1
        assert not source.stale()
        web = source.pods[WEB_UID]
        assert web.containers["app"].probe(ProbeKind.LIVENESS) is not None

    listing, watch = server.requests
    assert (listing.verb, watch.verb) == ("list", "watch")
    assert listing.query["fieldSelector"] == f"spec.nodeName={NODE}"
    assert listing.resource_version == "0"  # the watch cache, not etcd
    assert watch.query["fieldSelector"] == f"spec.nodeName={NODE}"
    assert watch.resource_version == str(server.version)  # the list's
    assert watch.query["allowWatchBookmarks"] == "true"
    assert 300 <= int(watch.query["timeoutSeconds"]) < 600


async def test_added_modified_and_deleted_events_change_the_view(
    server: FakeApiServer, clock: ManualClock
) -> None:
    source = _source(server, clock)
    web = _recorded_pods()[WEB_UID]
    async with running(source) as changes:
        await server.wait_streams(1)
        assert changes.calls == 1

        server.put(_copy_of(web, uid="new-uid", name="web-2"))
        await changes.wait(2)
        assert "shop/web-2" in _labels(source)

        modified = copy.deepcopy(server.pods["new-uid"])
        modified["spec"]["containers"][0]["livenessProbe"]["periodSeconds"] = 17
        server.put(modified)
        await changes.wait(3)
        liveness = source.pods["new-uid"].containers["app"].probe(ProbeKind.LIVENESS)
        assert liveness is not None
        assert liveness.period_seconds == 17

        server.delete("new-uid")
        await changes.wait(4)
        assert _labels(source) == {"shop/web-kd-node", "jobs/batch-kd-node"}
        assert server.count("list") == 1


async def test_changed_is_called_only_when_the_view_changes(
    server: FakeApiServer, clock: ManualClock
) -> None:
    source = _source(server, clock)
    async with running(source) as changes:
        await server.wait_streams(1)
        # A status-only update (what the kubelet writes all day) changes no spec.
        status_only = copy.deepcopy(server.pods[WEB_UID])
        status_only["status"]["conditions"][0]["lastTransitionTime"] = "2026-11-23T12:00:00Z"
        server.put(status_only)
        server.bookmark()
        server.delete(BATCH_UID)  # a real change, after them in the stream
        await changes.wait(2)
        assert changes.calls == 2
        assert _labels(source) == {"shop/web-kd-node"}


# -- resuming -----------------------------------------------------------------------------------


async def test_a_watch_that_ends_resumes_from_the_last_bookmark_without_a_relist(
    server: FakeApiServer, clock: ManualClock
) -> None:
    source = _source(server, clock)
    async with running(source):
        await server.wait_streams(1)
        server.advance(5)  # other nodes' pods changed
        version = server.bookmark()
        server.end_watches()  # the server's timeoutSeconds
        await server.wait_streams(2)
    assert server.requests[-1].resource_version == version
    assert server.count("list") == 1
    assert source.relists == 0


async def test_a_dropped_watch_resumes_from_the_last_event_and_gets_what_it_missed(
    server: FakeApiServer, clock: ManualClock
) -> None:
    source = _source(server, clock)
    web = _recorded_pods()[WEB_UID]
    async with running(source) as changes:
        await server.wait_streams(1)
        server.put(_copy_of(web, uid="seen", name="seen"))
        await changes.wait(2)
        seen_version = server.pods["seen"]["metadata"]["resourceVersion"]
        with capture_logs() as logs:
            server.drop_watches()
            server.put(_copy_of(web, uid="missed", name="missed"))  # while disconnected
            await changes.wait(3)
        assert "shop/missed" in _labels(source)
        assert server.count("list") == 1
        (interrupted,) = _events(logs, "pod_watch_interrupted")
        assert "incomplete chunked read" in interrupted["error"]
        assert _events(logs, "pod_source_failed") == []
    assert server.requests[2].verb == "watch"
    assert server.requests[2].resource_version == seen_version


async def test_an_error_event_other_than_gone_fails_then_relists_from_the_watch_cache(
    server: FakeApiServer, clock: ManualClock
) -> None:
    # client-go's reflector: a watch that ended with an error is followed by a relist at the
    # last resourceVersion (served by the watch cache), not by a watch resumed from it.
    source = _source(server, clock)
    async with running(source):
        await server.wait_streams(1)
        version = server.bookmark()
        with capture_logs() as logs:
            server.send_error(status(500, "InternalError", "etcd is sad"))
            await server.wait_streams(2)
    (failed,) = _events(logs, "pod_source_failed")
    assert failed["error"] == (
        "watch pods: the API server sent an error: 500 InternalError: etcd is sad"
    )
    relist, watch = server.requests[-2:]
    assert relist.verb == "list"
    assert relist.resource_version == version  # the cache, at least as new as what was seen
    assert "limit" not in relist.query  # a limit would send it to etcd
    assert watch.verb == "watch"
    assert server.count("list") == 2


async def test_a_broken_event_line_fails_then_relists(
    server: FakeApiServer, clock: ManualClock
) -> None:
    source = _source(server, clock)
    async with running(source):
        await server.wait_streams(1)
        version = server.bookmark()
        with capture_logs() as logs:
            server.send_raw('{"type": "ADDED", "object": {"metadata": ')
            await server.wait_streams(2)
    (failed,) = _events(logs, "pod_source_failed")
    assert failed["error"].startswith("watch pods: a line is not JSON")
    assert [(r.verb, r.resource_version) for r in server.requests[-2:]] == [
        ("list", version),
        ("watch", str(server.version)),
    ]


@pytest.mark.parametrize(("code", "relists"), [(500, True), (403, True), (429, False)])
async def test_a_refused_watch_relists_but_429_only_backs_off(
    server: FakeApiServer, clock: ManualClock, code: int, relists: bool
) -> None:
    # The reflector re-watches after 429 (and an unreachable server), relists after the rest.
    source = _source(server, clock)
    async with running(source):
        await server.wait_streams(1)
        version = server.bookmark()
        server.fail_next("watch", code, status(code, "Refused", "not now"))
        server.end_watches()
        await server.wait_streams(2)
    verbs = [r.verb for r in server.requests]
    assert verbs[:3] == ["list", "watch", "watch"]  # the refused one
    assert server.requests[2].resource_version == version
    assert verbs[3:] == (["list", "watch"] if relists else ["watch"])


async def test_a_stream_silent_past_the_servers_timeout_is_taken_for_dead_and_resumed(
    server: FakeApiServer, clock: ManualClock
) -> None:
    # The read timeout is timeoutSeconds + 30 s; here 0.2 s, and the fake never ends the stream
    # (a proxy that lost the server, a half-open connection).
    source = _source(server, clock, read_timeout=0.2)
    async with running(source):
        await server.wait_streams(1)
        version = server.bookmark()
        with capture_logs() as logs:
            await server.wait_streams(2)  # no line for 0.2 s: taken for a dead connection
    assert [entry["resume_from"] for entry in _events(logs, "pod_watch_idle")][:1] == [version]
    assert server.requests[2].resource_version == version
    assert _events(logs, "pod_source_failed") == []
    assert server.count("list") == 1


# -- 410 Gone -----------------------------------------------------------------------------------


@pytest.mark.parametrize("gone", ["http", "event-on-open", "event-mid-stream"])
async def test_gone_relists_and_drops_the_pods_deleted_in_the_gap(
    server: FakeApiServer, clock: ManualClock, gone: str
) -> None:
    server.gone_as = "http" if gone == "http" else "event"
    source = _source(server, clock)
    async with running(source) as changes:
        await server.wait_streams(1)
        with capture_logs() as logs:
            if gone == "event-mid-stream":
                server.forget(BATCH_UID)  # its DELETED event never reaches the watch
                server.send_error(GONE)
            else:
                server.end_watches()
                server.forget(BATCH_UID)
                server.compact()  # the watch's version is gone by the time it resumes
            await changes.wait(2)
            await server.wait_streams(2)
        assert _labels(source) == {"shop/web-kd-node"}
        assert source.relists == 1
        (expired,) = _events(logs, "pod_watch_expired")
        assert expired["detail"].startswith("410 Expired: too old resource version")
        assert _events(logs, "pod_source_failed") == []
    expected = ["list", "watch", "list", "watch"]
    if gone != "event-mid-stream":
        expected.insert(2, "watch")  # the resumed watch that got 410
    assert [request.verb for request in server.requests] == expected
    assert server.requests[-1].resource_version == str(server.version)


# -- failures -----------------------------------------------------------------------------------


async def test_forbidden_is_logged_once_keeps_the_view_and_goes_stale_in_time(
    server: FakeApiServer, clock: ManualClock
) -> None:
    source = _source(server, clock)
    async with running(source) as changes:
        await server.wait_streams(1)
        server.delete(BATCH_UID)
        await changes.wait(2)  # so the client has the stream open
        clock.now += 10 * STALE_AFTER
        assert not source.stale()  # an open, silent watch is healthy
        with capture_logs() as logs:
            server.fail_always("watch", 403, FORBIDDEN)  # RBAC revoked
            server.fail_always("list", 403, FORBIDDEN)
            server.end_watches()
            await server.wait_requests("list", 6)  # each failure relists, as the reflector
            # Within the grace a restarting API server gets (30 s on the fake clock): warnings.
            assert _events(logs, "pod_source_failed") == []
            assert source.pods.keys() == {WEB_UID}
            assert not source.stale()  # down for less than stale_after (on the fake clock)
            clock.now += STALE_AFTER + 1  # past the grace too
            assert source.stale()
            assert "403 Forbidden" in source.staleness()
            await server.wait_requests("list", server.count("list") + 2)

            server.stop_failing()
            server.delete(WEB_UID)
            await changes.wait(3)  # the relist that passed
            await server.wait_streams(2)  # then a watch from it
            assert not source.stale()
    # The refused watch, then the relists it led to: warnings for the grace's 3 attempts, then
    # one error past it, not one line per attempt.
    warned = _events(logs, "pod_source_forbidden")
    assert [entry["attempt"] for entry in warned] == [1, 2, 3]
    assert warned[0]["error"].startswith("watch pods: 403 Forbidden: pods is forbidden")
    (failed_list,) = _events(logs, "pod_source_failed")
    assert failed_list["error"].startswith(
        "list pods: 403 Forbidden: the service account needs get/list/watch on pods"
    )
    assert 'cannot list resource "pods"' in failed_list["error"]
    assert failed_list["kept_pods"] == 1
    assert len(_events(logs, "pod_source_recovered")) == 1
    assert changes.calls == 3
    verbs = [request.verb for request in server.requests]
    # The refused watch was followed by relists only (each refused too, then one that passed),
    # all from the watch cache at the version last seen, never from etcd.
    assert verbs == ["list", "watch", "watch"] + ["list"] * (len(verbs) - 4) + ["watch"]
    relists = server.requests[3:-1]
    assert {request.resource_version for request in relists} == {
        server.requests[2].resource_version
    }
    assert all("limit" not in request.query for request in relists)


async def test_an_api_server_restart_is_warnings_and_a_quick_relist_not_the_rbac_error(
    server: FakeApiServer, clock: ManualClock
) -> None:
    """Issue 34: a running API server restarts. The stream breaks, the server cannot be reached,
    then answers 503, then 403 while its RBAC cache loads. All within the grace a (re)starting
    server gets: warnings without the RBAC advice, and retries at the back-off's first steps,
    so the relist follows at once when it answers (the retries used to escalate to 15-30 s)."""
    delays: list[float] = []

    async def sleep(delay: float) -> None:
        delays.append(delay)
        await asyncio.sleep(0)

    # The real back-off (0.5 s doubling to 30 s), its sleeps recorded instead of waited.
    source = _source(server, clock, retry_initial=0.5, retry_max=30.0, sleep=sleep)
    async with running(source):
        await server.wait_streams(1)
        with capture_logs() as logs:
            server.refuse_next("watch", times=2)
            server.fail_next("watch", 503, status(503, "ServiceUnavailable", "starting"))
            server.fail_next("list", 403, FORBIDDEN, times=4)
            server.drop_watches()
            await server.wait_streams(2)
    assert _events(logs, "pod_source_failed") == []
    retrying = _events(logs, "pod_source_retrying")
    unreachable = f"watch pods: cannot reach the API server at {server.url}"
    assert [entry["attempt"] for entry in retrying] == [1, 2, 1]
    assert [entry["error"].startswith(unreachable) for entry in retrying] == [True, True, False]
    assert retrying[2]["error"].startswith("watch pods: HTTP 503 ServiceUnavailable")
    forbidden = _events(logs, "pod_source_forbidden")
    assert [entry["attempt"] for entry in forbidden] == [1, 2, 3]  # the 4th: rate-limited
    assert "needs get/list/watch" not in forbidden[0]["error"]
    assert {entry["log_level"] for entry in retrying + forbidden} == {"warning"}
    assert len(delays) >= 7  # one after each failure
    assert max(delays) <= 1.0  # the first two steps: 0.25-0.5 s, then 0.5-1 s
    verbs = [request.verb for request in server.requests]
    assert verbs == ["list", "watch", "watch", "watch", "watch"] + ["list"] * 5 + ["watch"]
    assert _events(logs, "pod_source_recovered") == []  # no error was logged to recover from


async def test_past_its_grace_a_restarts_failure_is_the_error_and_backs_off(
    server: FakeApiServer, clock: ManualClock
) -> None:
    """A 503 that lasts past the grace (30 s and 3 attempts) is the error, and the back-off
    grows again from the grace's pace."""
    delays: list[float] = []

    async def sleep(delay: float) -> None:
        delays.append(delay)
        await asyncio.sleep(0)

    source = _source(server, clock, retry_initial=0.5, retry_max=30.0, sleep=sleep)
    async with running(source):
        await server.wait_streams(1)
        with capture_logs() as logs:
            server.fail_always("watch", 503, status(503, "ServiceUnavailable", "starting"))
            server.fail_always("list", 503, status(503, "ServiceUnavailable", "starting"))
            server.end_watches()
            await server.wait_requests("list", 4)  # the watch's 503, then 3 relists
            clock.now += 31
            graced = len(delays)
            await server.wait_requests("list", server.count("list") + 3)
    (failed,) = _events(logs, "pod_source_failed")
    assert failed["error"].startswith("list pods: HTTP 503 ServiceUnavailable")
    assert len(_events(logs, "pod_source_retrying")) == 3
    assert max(delays[:graced]) <= 1.0
    assert max(delays[graced + 1 :]) > 1.0  # escalating again


@pytest.mark.parametrize("read_first", [False, True])
async def test_a_429_is_a_warning_never_the_error(
    server: FakeApiServer, clock: ManualClock, read_first: bool
) -> None:
    throttled = status(429, "TooManyRequests", "Too many requests, please try again later.")
    source = _source(server, clock)
    with capture_logs() as logs:
        async with running(source):
            if read_first:
                await server.wait_streams(1)
                server.fail_next("watch", 429, throttled, times=5)
                server.end_watches()
                await server.wait_streams(2)
            else:
                server.fail_next("list", 429, throttled, times=5)
                await server.wait_streams(1)
    assert _events(logs, "pod_source_failed") == []
    retrying = _events(logs, "pod_source_retrying")
    assert [entry["attempt"] for entry in retrying] == [1, 2, 3]  # then rate-limited
    assert retrying[0]["error"].startswith(
        ("watch" if read_first else "list") + " pods: HTTP 429 TooManyRequests"
    )
    assert retrying[0]["log_level"] == "warning"


async def test_a_failing_first_list_is_retried_and_logged_once(
    server: FakeApiServer, clock: ManualClock
) -> None:
    source = _source(server, clock)
    server.fail_next("list", 401, status(401, "Unauthorized", "Unauthorized"), times=3)
    with capture_logs() as logs:
        async with running(source) as changes:
            await changes.wait(1)
            assert not source.stale()
    (failed,) = _events(logs, "pod_source_failed")
    assert failed["error"].startswith(
        "list pods: 401 Unauthorized: the API server rejected the credentials"
    )
    assert failed["kept_pods"] == 0
    assert server.count("list") == 4


async def test_a_server_error_without_a_status_is_quoted(
    server: FakeApiServer, clock: ManualClock
) -> None:
    source = _source(server, clock)
    server.fail_next("list", 503, "upstream connect error")
    with capture_logs() as logs:
        async with running(source) as changes:
            await changes.wait(1)
    (failed,) = _events(logs, "pod_source_failed")
    assert failed["error"] == "list pods: HTTP 503: upstream connect error"


async def test_an_unreachable_server_fails_and_run_keeps_trying(clock: ManualClock) -> None:
    async with FakeApiServer(node_name=NODE) as gone_server:
        url = gone_server.url  # a port nothing listens on once it is closed
    source = ApiServerSource(
        node_name=NODE,
        config=KubeConfig.from_server(url),
        clock=clock,
        retry_initial=0.01,
        retry_max=0.02,
    )
    third_failure = asyncio.Event()
    failed = source.failed

    def counting_failed(message: str) -> None:
        failed(message)
        if source.read_errors == 3:
            third_failure.set()

    source.failed = counting_failed  # type: ignore[method-assign]
    with capture_logs() as logs:
        async with running(source):
            await asyncio.wait_for(third_failure.wait(), HANG_GUARD)
    (logged,) = _events(logs, "pod_source_failed")
    assert logged["error"].startswith(f"list pods: cannot reach the API server at {url}")
    assert source.stale()


async def test_an_invalid_pod_is_logged_with_its_field_and_the_others_are_used(
    server: FakeApiServer, clock: ManualClock
) -> None:
    web = _recorded_pods()[WEB_UID]
    bad = _copy_of(web, uid="bad-uid", name="bad")
    bad["spec"]["containers"][0]["livenessProbe"]["httpGet"]["port"] = 70000
    server.put(bad)
    source = _source(server, clock)
    with capture_logs() as logs:
        async with running(source) as changes:
            await server.wait_streams(1)
            worse = _copy_of(web, uid="worse-uid", name="worse")
            worse["spec"]["containers"][1]["livenessProbe"]["periodSeconds"] = -3
            server.put(worse)
            server.delete(BATCH_UID)  # after it in the stream
            await changes.wait(2)
            assert _labels(source) == {"shop/web-kd-node"}
            assert source.invalid_pods == 2
    invalid = _events(logs, "pod_spec_invalid")
    assert [(entry["pod"], entry["error"]) for entry in invalid] == [
        (
            "shop/bad",
            "pod shop/bad: spec.containers[0].livenessProbe.httpGet.port: "
            "must be a valid port name or number 1-65535 (got 70000)",
        ),
        (
            "shop/worse",
            "pod shop/worse: spec.containers[1].livenessProbe.periodSeconds: must be >= 0",
        ),
    ]
    assert changes.calls == 2


# -- config -------------------------------------------------------------------------------------


def _write_kubeconfig(path: Path, server: str, token: str) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "test",
                "contexts": [{"name": "test", "context": {"cluster": "c", "user": "u"}}],
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": token}}],
            }
        )
    )
    return path


async def test_a_kubeconfig_file_is_read_with_its_credentials(
    server: FakeApiServer, clock: ManualClock, tmp_path: Path
) -> None:
    path = _write_kubeconfig(tmp_path / "config", server.url, "file-token")
    source = ApiServerSource(node_name=NODE, kubeconfig=path, clock=clock)
    async with running(source):
        await server.wait_streams(1)
    assert {request.authorization for request in server.requests} == {"Bearer file-token"}


@pytest.mark.skipif(
    Path(SERVICE_ACCOUNT, "token").exists(), reason="in a pod, the service account comes first"
)
async def test_kubeconfig_env_is_used_without_an_explicit_config(
    server: FakeApiServer, clock: ManualClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write_kubeconfig(tmp_path / "config", server.url, "env-token")
    monkeypatch.setenv("KUBECONFIG", str(path))
    source = ApiServerSource(node_name=NODE, clock=clock)
    async with running(source):
        await server.wait_streams(1)
    assert {request.authorization for request in server.requests} == {"Bearer env-token"}


def test_a_missing_kubeconfig_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no usable Kubernetes client config from kubeconfig"):
        ApiServerSource(node_name=NODE, kubeconfig=tmp_path / "absent")


def test_the_node_name_is_required() -> None:
    with pytest.raises(ConfigError, match="needs the node's name"):
        ApiServerSource(node_name="", config=KubeConfig.from_server("http://127.0.0.1:1"))


async def test_close_twice_is_fine(clock: ManualClock) -> None:
    source = ApiServerSource(
        node_name=NODE, config=KubeConfig.from_server("http://127.0.0.1:1"), clock=clock
    )
    await source.close()
    await source.close()
