"""Pod sources against what a tenant (or a hostile source) can send: only the used fields are
decoded, bursts log one summary line, repeating problems keep their rate limit, a watch line
cannot grow without bound, and a pod missing from one read keeps its spec for a grace.

Memory and loop-time numbers are measured in bench/tenant_sources.py, not asserted here.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import threading
from collections.abc import AsyncIterator, MutableMapping
from pathlib import Path
from typing import Any

import httpx2
import pytest
from lightkube import KubeConfig
from structlog.testing import capture_logs

from cri_prober import files
from cri_prober import logs as logs_config
from cri_prober.logs import REPEAT_LOG_SECONDS
from cri_prober.podspecs import apiserver_client
from cri_prober.podspecs.apiserver import ApiServerSource
from cri_prober.podspecs.decode import PodListError, decode_pod_list
from cri_prober.podspecs.kubelet import KubeletSource
from cri_prober.podspecs.registry import PodSpecs
from cri_prober.podspecs.source import (
    MISSING_READS,
    SUMMARY_NAMES,
    Changed,
    PodSource,
)
from tests.support.apiserver import FakeApiServer
from tests.support.clock import ManualClock
from tests.support.kubelet_server import KubeletPki, KubeletServer, make_pki
from tests.support.waiting import HANG_GUARD, until

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kubelet-1.28.7"
RUNNING: dict[str, Any] = json.loads((FIXTURES / "pods-running.json").read_text())
WEB_UID = "f177263d9de7365e9da06d5ff3b3399b"
TOKEN = "token-1"


class ListedSource(PodSource):
    """A source whose reads the test plays by hand."""

    async def run(self, changed: Changed) -> None:
        await asyncio.Event().wait()


def _pod(index: int, *, env: int = 0, command: list[str] | None = None) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "app",
        "image": "busybox",
        "livenessProbe": {"exec": {"command": command or ["true"]}, "periodSeconds": 1},
    }
    if env:
        container["env"] = [{"name": f"V{i}", "value": "x" * 40} for i in range(env)]
    return {
        "metadata": {"name": f"pod-{index}", "namespace": "tenant", "uid": f"uid-{index}"},
        "spec": {"containers": [container]},
        "status": {"phase": "Running"},
    }


def _listing(pods: list[dict[str, Any]]) -> bytes:
    return json.dumps({"kind": "PodList", "apiVersion": "v1", "items": pods}).encode()


def _events(logs: list[MutableMapping[str, Any]], event: str) -> list[MutableMapping[str, Any]]:
    return [entry for entry in logs if entry["event"] == event]


# -- decoding only what is used ---------------------------------------------------------------


def test_only_the_env_entries_a_probe_refers_to_are_kept() -> None:
    """A 2,000-entry env list is read, but only $(V7) of it is kept, with its value."""
    pod = _pod(1, env=2000, command=["sh", "-c", "test $(V7) = $(MISSING)"])
    (decoded,) = decode_pod_list(_listing([pod])).pods
    (container,) = decoded.obj["spec"]["containers"]
    assert container["env"] == [{"name": "V7", "value": "x" * 40}]
    assert "image" not in container
    assert "status" not in json.dumps(decoded.obj["metadata"])


def test_annotations_are_kept_only_for_the_mirror_uid() -> None:
    pod = _pod(1)
    pod["metadata"]["annotations"] = {"big": "y" * 100_000, "kubernetes.io/config.mirror": "abc"}
    (decoded,) = decode_pod_list(_listing([pod])).pods
    assert decoded.obj["metadata"]["annotations"] == {"kubernetes.io/config.mirror": "abc"}
    del pod["metadata"]["annotations"]["kubernetes.io/config.mirror"]
    (plain,) = decode_pod_list(_listing([pod])).pods
    assert "annotations" not in plain.obj["metadata"]


def test_the_digest_follows_the_used_fields_only() -> None:
    """A status condition or an image changing is no change; a probe or phase changing is."""
    base = _pod(1)
    same = copy.deepcopy(base)
    same["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    same["spec"]["containers"][0]["image"] = "busybox:2"
    probe = copy.deepcopy(base)
    probe["spec"]["containers"][0]["livenessProbe"]["periodSeconds"] = 2
    phase = copy.deepcopy(base)
    phase["status"]["phase"] = "Succeeded"
    digests = [decode_pod_list(_listing([p])).pods[0].digest for p in (base, same, probe, phase)]
    assert digests[0] == digests[1]
    assert len({digests[0], digests[2], digests[3]}) == 3


@pytest.mark.parametrize(
    ("body", "message"),
    [
        pytest.param(
            b'{"kind":"PodList","items":[' + b",".join([b"{}"] * 100_000) + b"]}",
            "Object missing required field `metadata` - at `items[0]`",
            id="empty-items",
        ),
        pytest.param(
            b'{"kind":"PodList","items":[{"metadata":{"name":'
            + b"[" * 100_000
            + b"]" * 100_000
            + b"}}]}",
            "it is nested too deeply",
            id="deep",
        ),
    ],
)
def test_a_listing_no_kubelet_sends_is_refused_whole(body: bytes, message: str) -> None:
    with pytest.raises(PodListError) as caught:
        decode_pod_list(body)
    assert str(caught.value) == message


def test_more_pods_than_a_node_runs_are_refused() -> None:
    with pytest.raises(PodListError, match="it lists 11 pods, more than the 10 one node can run"):
        decode_pod_list(_listing([_pod(i) for i in range(11)]), max_pods=10)


# -- the kubelet source ------------------------------------------------------------------------


@pytest.fixture(name="pki")
def _pki(tmp_path: Path) -> KubeletPki:
    return make_pki(tmp_path)


@pytest.fixture(name="kubelet")
async def _kubelet(pki: KubeletPki) -> AsyncIterator[KubeletServer]:
    server = KubeletServer(pki, tokens=frozenset({TOKEN}))
    server.serve(RUNNING)
    await server.start()
    yield server
    await server.close()


@pytest.fixture(name="clock")
def _clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(name="source")
async def _source(
    kubelet: KubeletServer, pki: KubeletPki, tmp_path: Path, clock: ManualClock
) -> AsyncIterator[KubeletSource]:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    source = KubeletSource(
        kubelet.url, token_file=token, ca_file=pki.ca_file, timeout=5.0, max_pods=50, clock=clock
    )
    yield source
    await source.close()


async def test_a_flood_of_empty_items_fails_the_read_and_keeps_the_view(
    kubelet: KubeletServer, source: KubeletSource
) -> None:
    assert await source.poll() is True
    before = dict(source.pods)
    kubelet.serve(b'{"kind":"PodList","items":[' + b",".join([b"{}"] * 200_000) + b"]}")
    with capture_logs() as logs:
        assert await source.poll() is False
        assert await source.poll() is False
    (failed,) = _events(logs, "pod_source_failed")
    assert failed["error"] == (
        f"the kubelet at {kubelet.url} answered something that is not a usable PodList: "
        "Object missing required field `metadata` - at `items[0]`"
    )
    assert dict(source.pods) == before


async def test_too_many_pods_fail_the_read_and_keep_the_view(
    kubelet: KubeletServer, source: KubeletSource
) -> None:
    assert await source.poll() is True
    kubelet.serve({"kind": "PodList", "items": [_pod(i) for i in range(51)]})
    with capture_logs() as logs:
        assert await source.poll() is False
    (failed,) = _events(logs, "pod_source_failed")
    assert "it lists 51 pods, more than the 50 one node can run" in failed["error"]
    assert WEB_UID in source.pods


async def test_two_pods_sharing_a_uid_are_stable_and_reported_once(
    kubelet: KubeletServer, source: KubeletSource, clock: ManualClock
) -> None:
    """The first listed wins on every poll; no valid/invalid lines alternate from poll to poll."""
    good = _pod(1)
    bad = copy.deepcopy(good)
    bad["spec"]["containers"][0]["livenessProbe"]["periodSeconds"] = -1
    kubelet.serve({"kind": "PodList", "items": [good, bad]})
    with capture_logs() as logs:
        for _ in range(4):
            await source.poll()
    assert source.pods["uid-1"].containers["app"].probes  # the first one's spec
    assert [e["event"] for e in logs if e["log_level"] != "debug"] == ["pod_listed_twice"]
    clock.now += REPEAT_LOG_SECONDS + 1
    with capture_logs() as later:
        await source.poll()
    assert [e["event"] for e in later] == ["pod_listed_twice"]


async def test_many_invalid_pods_log_a_few_lines_and_one_summary(
    kubelet: KubeletServer, source: KubeletSource
) -> None:
    pods = [_pod(i) for i in range(30)]
    for pod in pods:
        pod["spec"]["containers"][0]["livenessProbe"]["periodSeconds"] = -1
    kubelet.serve({"kind": "PodList", "items": pods})
    with capture_logs() as logs:
        await source.poll()
        await source.poll()
    assert len(_events(logs, "pod_spec_invalid")) == SUMMARY_NAMES
    (summary,) = _events(logs, "pod_specs_invalid")
    assert summary["count"] == 30 - SUMMARY_NAMES
    assert summary["pods"] == [f"tenant/pod-{i}" for i in range(5, 5 + SUMMARY_NAMES)]
    assert source.invalid_pods == 30


def test_an_item_without_metadata_is_logged_once_per_repeat_period() -> None:
    """It used to be logged on every read: each listing forgot it had been logged."""
    clock = ManualClock()
    source = ListedSource("watch", stale_after=10, clock=clock)
    with capture_logs() as logs:
        for _ in range(3):
            source.upsert({"spec": {}})
            source.replace_all([_pod(1)])
    assert len(_events(logs, "pod_spec_invalid")) == 1
    clock.now += REPEAT_LOG_SECONDS + 1
    with capture_logs() as later:
        source.upsert({"spec": {}})
    assert len(_events(later, "pod_spec_invalid")) == 1


def test_http_libraries_write_no_line_per_request_at_info() -> None:
    """serve's logging setup quiets them (the test leaves the process's own logging alone)."""
    loggers = [logging.getLogger(name) for name in logs_config.CHATTY_LIBRARIES]
    saved = [logger.level for logger in loggers]
    try:
        logs_config.quiet_chatty_libraries(logging.INFO)
        for name in ("httpx2", "httpx", "httpcore2"):
            assert logging.getLogger(name).getEffectiveLevel() == logging.WARNING
        logs_config.quiet_chatty_libraries(logging.DEBUG)
        assert logging.getLogger("httpx2").getEffectiveLevel() == logging.DEBUG
        logs_config.quiet_chatty_libraries(logging.ERROR)
        assert logging.getLogger("httpx2").getEffectiveLevel() == logging.ERROR
    finally:
        for logger, level in zip(loggers, saved, strict=True):
            logger.setLevel(level)


@pytest.mark.parametrize("which", ["token", "ca", "cert", "key"])
async def test_a_fifo_in_place_of_a_file_is_a_failed_read_at_once(
    kubelet: KubeletServer, pki: KubeletPki, tmp_path: Path, which: str
) -> None:
    """Opening a FIFO blocks until a writer comes (for ever): it is refused without opening it
    for reading, and the poll goes on. (Before, the worker thread hung, and SIGTERM with it.)"""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    files: dict[str, Any] = {"token_file": token, "ca_file": pki.ca_file}
    if which in ("cert", "key"):
        files["client_cert"] = pki.client_cert
        files["client_key"] = pki.client_key
    files[
        {"token": "token_file", "ca": "ca_file", "cert": "client_cert", "key": "client_key"}[which]
    ] = fifo
    source = KubeletSource(kubelet.url, timeout=5.0, **files)
    try:
        with capture_logs() as logs:
            async with asyncio.timeout(HANG_GUARD):  # a safety net: the read fails at once
                assert await source.poll() is False
        (failed,) = _events(logs, "pod_source_failed")
        assert str(fifo) in failed["error"]
        assert "not a regular file (a FIFO)" in failed["error"]
    finally:
        await source.close()


# -- a pod missing from one read ------------------------------------------------------------------


def _polled(clock: ManualClock) -> tuple[ListedSource, PodSpecs]:
    source = ListedSource("kubelet", stale_after=10, clock=clock)
    source.missing_grace = MISSING_READS * 2.0 + 1.0  # a polled source's, at a 2 s interval
    return source, PodSpecs([source], clock=clock)


def test_a_pod_missing_from_one_read_keeps_its_spec_for_the_grace() -> None:
    clock = ManualClock()
    source, registry = _polled(clock)
    source.replace_all([_pod(1), _pod(2)])
    registry.rebuild()
    kept = registry.lookup("uid-1", "tenant", "pod-1")
    for _ in range(5):  # absent from every other read, 2 s apart: never gone
        source.replace_all([_pod(2)])
        registry.rebuild()
        clock.now += 2
        assert registry.lookup("uid-1", "tenant", "pod-1") == kept
        source.replace_all([_pod(1), _pod(2)])
        registry.rebuild()
        clock.now += 2
        assert registry.lookup("uid-1", "tenant", "pod-1") == kept


def test_a_pod_gone_past_the_grace_is_deleting_and_many_leave_in_one_line() -> None:
    clock = ManualClock()
    source, registry = _polled(clock)
    source.replace_all([_pod(i) for i in range(100)])
    registry.rebuild()
    with capture_logs() as logs:
        source.replace_all([])
        registry.rebuild()
        clock.now += source.missing_grace - 0.5
        assert not registry.expire_missing()
        spec = registry.lookup("uid-3", "tenant", "pod-3")
        assert spec is not None
        assert not spec.deleting
        clock.now += 1
        assert registry.expire_missing()
    spec = registry.lookup("uid-3", "tenant", "pod-3")
    assert spec is not None
    assert spec.deleting
    (left,) = _events(logs, "pod_left_source")
    assert (left["count"], left["source"], len(left["pods"])) == (100, "kubelet", SUMMARY_NAMES)


def test_the_api_server_source_has_no_grace() -> None:
    """A pod missing from an API server list, or DELETED, is gone: no grace (D3 stays exact)."""
    clock = ManualClock()
    source = ListedSource("apiserver", stale_after=10, clock=clock)
    registry = PodSpecs([source], clock=clock)
    source.replace_all([_pod(1)])
    registry.rebuild()
    source.remove("uid-1")
    registry.rebuild()
    spec = registry.lookup("uid-1", "tenant", "pod-1")
    assert spec is not None
    assert spec.deleting


# -- the API server's watch ----------------------------------------------------------------------


async def test_a_watch_line_that_never_ends_is_cut_and_the_watch_resumed() -> None:
    async with FakeApiServer(node_name="node-a") as server:
        server.put(_pod(1) | {"spec": {**_pod(1)["spec"], "nodeName": "node-a"}})
        source = ApiServerSource(
            node_name="node-a",
            config=KubeConfig.from_server(server.url),
            max_event_bytes=64 * 1024,
            retry_initial=0.01,
            retry_max=0.02,
        )
        task = asyncio.create_task(source.run(lambda: None))
        try:
            await server.wait_streams(1)
            with capture_logs() as logs:
                server.send_raw('{"type": "ADDED", "object": {"metadata": ' + "x" * 200_000)
                await server.wait_streams(2)
            (failed,) = _events(logs, "pod_source_failed")
            assert failed["error"] == (
                "watch pods: a line of the stream is longer than 64 KiB, which no event can be: "
                "dropped the connection"
            )
            assert "uid-1" in source.pods
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await source.close()


def _token_file_kubeconfig(path: Path, server: str, token_file: Path) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "test",
        "contexts": [{"name": "test", "context": {"cluster": "c", "user": "u"}}],
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"tokenFile": str(token_file)}}],
    }
    path.write_text(json.dumps(config))
    return path


async def test_a_token_file_is_read_again_after_a_401(tmp_path: Path) -> None:
    """A rotated service-account token: the file is read again when the server says 401."""
    token = tmp_path / "token"
    token.write_text("old-token\n")
    async with FakeApiServer(node_name="node-a") as server:
        config = _token_file_kubeconfig(tmp_path / "config", server.url, token)
        source = ApiServerSource(
            node_name="node-a", kubeconfig=config, retry_initial=0.01, streaming_list=False
        )
        task = asyncio.create_task(source.run(lambda: None))
        try:
            await server.wait_streams(1)
            token.write_text("new-token\n")
            server.fail_next("watch", 401, {"kind": "Status", "code": 401})
            server.end_watches()
            await server.wait_streams(2)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await source.close()
    seen = [request.authorization for request in server.requests]
    assert seen[:2] == ["Bearer old-token", "Bearer old-token"]  # the list, the first watch
    assert seen[2:4] == ["Bearer old-token", "Bearer new-token"]  # 401, then read again


async def test_a_fifo_as_the_api_servers_token_file_fails_without_blocking(
    tmp_path: Path,
) -> None:
    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    async with FakeApiServer(node_name="node-a") as server:
        config = _token_file_kubeconfig(tmp_path / "config", server.url, fifo)
        source = ApiServerSource(node_name="node-a", kubeconfig=config, retry_initial=10.0)
        failed = asyncio.Event()
        source_failed = source.failed

        def on_failure(message: str) -> None:
            source_failed(message)
            failed.set()

        source.failed = on_failure  # type: ignore[method-assign]
        task = asyncio.create_task(source.run(lambda: None))
        try:
            async with asyncio.timeout(HANG_GUARD):  # a safety net: it fails at once
                await failed.wait()
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await source.close()
    assert source.last_error == f"cannot read the token file {fifo}: not a regular file (a FIFO)"


async def test_a_slow_token_file_read_holds_up_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API server's token is read in a worker thread: while a read is stuck (here it waits
    on an event), the event loop runs on. httpx2 ran the read on the loop. (A guard thread
    releases the read after 60 s, so that the code before this fails instead of hanging.)"""
    token = tmp_path / "token"
    token.write_text("slow-token\n")
    entered, release, done, fired = (threading.Event() for _ in range(4))
    read = files.read_regular_file

    def slow(path: Path, *, max_bytes: int, what: str) -> bytes:
        entered.set()
        release.wait()
        return read(path, max_bytes=max_bytes, what=what)

    def guard() -> None:
        if not done.wait(60.0):
            fired.set()
            release.set()

    monkeypatch.setattr(apiserver_client, "read_regular_file", slow)
    guarding = threading.Thread(target=guard, daemon=True)
    guarding.start()
    flow = apiserver_client.TokenFileAuth(token).async_auth_flow(
        httpx2.Request("GET", "https://apiserver.invalid/api/v1/pods")
    )
    first = asyncio.ensure_future(anext(flow))
    try:
        await until(entered.is_set, timeout=HANG_GUARD, message="the token read to start")
        for _ in range(100):  # a hundred turns of the loop while the read is stuck
            await asyncio.sleep(0)
        stuck = not first.done() and not release.is_set()
        release.set()
        async with asyncio.timeout(HANG_GUARD):
            request = await first
    finally:
        release.set()
        done.set()
        guarding.join(120.0)
        await flow.aclose()
    assert not fired.is_set(), "the event loop was blocked until the guard released the read"
    assert stuck
    assert request.headers["Authorization"] == "Bearer slow-token"


def test_a_source_failing_the_same_way_every_other_read_logs_once_per_period() -> None:
    """A watch that opens (a good read), then breaks on the same line, again and again: one
    failure and one recovery line, not two lines a cycle."""
    clock = ManualClock()
    source = ListedSource("apiserver", stale_after=60, clock=clock)
    with capture_logs() as logs:
        for _ in range(10):
            source.failed("watch pods: a line of the stream is longer than 16 MiB")
            clock.now += 1
            source.succeeded()
    assert [e["event"] for e in logs] == ["pod_source_failed", "pod_source_recovered"]
    clock.now += REPEAT_LOG_SECONDS
    with capture_logs() as later:
        source.failed("watch pods: a line of the stream is longer than 16 MiB")
        source.succeeded()
    assert [e["event"] for e in later] == ["pod_source_failed", "pod_source_recovered"]


def test_pods_the_node_never_ran_are_not_kept_once_they_leave() -> None:
    """A departed pod is kept as being deleted only if the node runs it: a source listing
    thousands of pods that never run here cannot pile them up."""
    clock = ManualClock()
    source = ListedSource("apiserver", stale_after=10, clock=clock)
    registry = PodSpecs([source], clock=clock)
    source.replace_all([_pod(1), _pod(2)])
    registry.rebuild()
    registry.retain({"uid-1", "tenant/pod-1"})  # the node runs pod-1 only
    source.replace_all([])
    registry.rebuild()
    kept = registry.lookup("uid-1", "tenant", "pod-1")
    assert kept is not None
    assert kept.deleting
    assert registry.lookup("uid-2", "tenant", "pod-2") is None
