"""serve --mirror: the kubelet's own verdicts read from its /metrics/probes counters, replayed from
a real kubelet v1.28.7's recording (tests/fixtures/kubelet-1.28.7-readonly), and counters built
as the kubelet's code makes them for what the recording lacks (a kubelet restart, a counter
reset, a pod deleted): pkg/kubelet/prober/worker.go (release-1.28) increments
``prober_probe_total`` once per attempt by result, observes the duration histogram for
successful and unknown results only, and deletes a worker's series when the worker ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gzip
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from lightkube import KubeConfig

from cri_prober import logs
from cri_prober._gen.criprober.v1 import query_pb2
from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.cli.serve import serve
from cri_prober.cli.tables import attempt_lines, history_text, transition_reason
from cri_prober.discovery.pleg import Discovery
from cri_prober.manager.api import ProbeNotRunning
from cri_prober.manager.probe_manager import ProbeManager
from cri_prober.manager.slots import SlotKey
from cri_prober.podspecs.apiserver import ApiServerSource
from cri_prober.podspecs.decode import decode_pod_list
from cri_prober.podspecs.kubelet_metrics import (
    CounterTracker,
    KubeletMetricsReader,
    MetricsError,
    ProbeCounters,
    TrackerUpdate,
    parse_probe_metrics,
)
from cri_prober.podspecs.registry import PodSpecs
from cri_prober.podspecs.source import Changed, PodSource
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.mirror import KubeletStatus, MirroredAttempts, MirrorWorker
from cri_prober.probing.prober import Prober
from cri_prober.probing.results import MIRROR_SOURCE, History, ProbeRecord, Published
from cri_prober.probing.spec import load_rules
from cri_prober.serving.convert import attempt_pb
from tests.support.apiserver import FakeApiServer, running
from tests.support.fake_runtime import FakeContainer, FakeRuntime
from tests.support.kubelet_server import KubeletServer
from tests.support.memory_cri import memory_client
from tests.support.waiting import until
from tests.support.watchers import ManagerWatcher

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kubelet-1.28.7-readonly"
HOUR_NS = 3600 * 10**9


@dataclass(frozen=True)
class Read:
    t: float
    body: str
    statuses: dict[str, list[Any]]


def recorded_reads() -> Iterator[Read]:
    with gzip.open(FIXTURES / "metrics-probes.jsonl.gz", "rt") as lines:
        for line in lines:
            data = json.loads(line)
            yield Read(data["t"], data["body"], data["statuses"])


def exposition(
    series: dict[tuple[str, str, str, str, str], int],
    *,
    start: float = 1.7e9,
    durations: dict[tuple[str, str, str, str], tuple[float, int]] | None = None,
) -> str:
    """``/metrics/probes`` as the kubelet writes it: (namespace, pod, uid, container, probe
    type, result) -> count, with the histogram and its start time."""
    lines = ["# TYPE prober_probe_total counter"]
    for (pod, uid, container, probe_type, result), count in series.items():
        lines.append(
            f'prober_probe_total{{container="{container}",namespace="ns",pod="{pod}",'
            f'pod_uid="{uid}",probe_type="{probe_type}",result="{result}"}} {count}'
        )
    lines.append("# TYPE prober_probe_duration_seconds histogram")
    for (pod, container, probe_type, _), (total, count) in (durations or {}).items():
        labels = f'container="{container}",namespace="ns",pod="{pod}",probe_type="{probe_type}"'
        lines.append(f"prober_probe_duration_seconds_sum{{{labels}}} {total}")
        lines.append(f"prober_probe_duration_seconds_count{{{labels}}} {count}")
    lines.append("# TYPE process_start_time_seconds gauge")
    lines.append(f"process_start_time_seconds {start}")
    return "\n".join(lines) + "\n"


def counters(text: str, at: float) -> ProbeCounters:
    return parse_probe_metrics(text, read_at=at)


# -- the pure parts: parser and tracker -----------------------------------------------------------


def test_replay_of_the_recording_mirrors_every_attempt_once_in_its_window() -> None:
    """Every attempt the real kubelet counted between the first read and the last comes out
    exactly once, in the window between the two reads that saw it; nothing is a reset."""
    tracker = CounterTracker()
    reads = list(recorded_reads())
    mirrored: dict[tuple[str, str, ProbeKind], list[int]] = {}
    previous_t = None
    for read in reads:
        update = tracker.update(counters(read.body, read.t))
        if previous_t is None:
            assert update.baseline == "the first read"
        else:
            assert update.baseline == ""
        for window in update.attempts:
            assert (window.since, window.until) == (previous_t, read.t)
            total = mirrored.setdefault((window.pod_uid, window.container, window.kind), [0, 0, 0])
            total[0] += window.successes
            total[1] += window.failures
            total[2] += window.unknowns
        previous_t = read.t
    first, last = counters(reads[0].body, 0).counts, counters(reads[-1].body, 0).counts
    expected = {
        key: [n - b for n, b in zip(now, first.get(key, (0, 0, 0)), strict=True)]
        for key, now in last.items()
    }
    assert {k: v for k, v in expected.items() if any(v)} == mirrored
    assert tracker.resets == 0
    # The recording's flapping and failing probes are in it.
    assert sum(v[1] for v in mirrored.values()) > 100


def test_the_kubelets_duration_is_taken_where_the_histogram_tells_it() -> None:
    """A window of one successful attempt gets the histogram's exact duration; failures, which
    the kubelet does not time, get none."""
    reads = list(recorded_reads())
    tracker = CounterTracker()
    tracker.update(counters(reads[0].body, reads[0].t))
    update = tracker.update(counters(reads[1].body, reads[1].t))
    timed = [w for w in update.attempts if w.successes == 1 and not w.failures and not w.unknowns]
    assert timed
    assert all(w.duration is not None and 0 < w.duration < 10 for w in timed)
    failed_only = [w for w in update.attempts if w.failures and not w.successes]
    assert all(w.duration is None for w in failed_only)


def test_a_kubelet_restart_invents_no_attempt() -> None:
    """The kubelet restarts between two reads: its counters start again from zero, some above
    the old values; that read is a new baseline, and the next one counts from it."""
    tracker = CounterTracker()
    key = ("web", "u1", "app", "Liveness", "successful")
    tracker.update(counters(exposition({key: 10}, start=1000.0), 1.0))
    update = tracker.update(counters(exposition({key: 12}, start=2000.0), 2.0))
    assert update.attempts == ()
    assert update.baseline == "the kubelet restarted"
    update = tracker.update(counters(exposition({key: 13}, start=2000.0), 3.0))
    [window] = update.attempts
    assert (window.successes, window.since, window.until) == (1, 2.0, 3.0)
    assert tracker.resets == 1


def test_a_counter_reset_without_a_start_time_invents_no_attempt() -> None:
    tracker = CounterTracker()
    live = ("web", "u1", "app", "Liveness", "successful")
    ready = ("web", "u1", "app", "Readiness", "failed")
    tracker.update(counters(exposition({live: 10, ready: 4}), 1.0))
    # One counter went down, another up: the read cannot be compared at all.
    update = tracker.update(counters(exposition({live: 2, ready: 9}), 2.0))
    assert update.attempts == ()
    assert update.baseline.startswith("a counter went down")


def test_a_deleted_pods_series_vanish_and_a_new_pods_count_whole() -> None:
    """The kubelet deletes a worker's series when it ends (the pod deleted): no attempt; a new
    pod's series appear at their first attempt, so all they hold came since the last read."""
    tracker = CounterTracker()
    old = ("web", "u1", "app", "Readiness", "successful")
    new = ("web", "u2", "app", "Readiness", "successful")
    tracker.update(counters(exposition({old: 7}), 1.0))
    update = tracker.update(counters(exposition({new: 2}), 2.0))
    assert update.gone == (("u1", "app", ProbeKind.READINESS),)
    [window] = update.attempts
    assert (window.pod_uid, window.successes) == ("u2", 2)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('prober_probe_total{pod_uid="u" 3\n', "not the Prometheus text format"),
        (
            'prober_probe_total{container="c",pod_uid="u",probe_type="Liveness",'
            'result="failed"} 1.5\n',
            "is not a count",
        ),
    ],
)
def test_an_unusable_exposition_is_refused_in_one_line(text: str, message: str) -> None:
    with pytest.raises(MetricsError, match=message):
        parse_probe_metrics(text, read_at=0.0)


def test_too_many_series_are_refused() -> None:
    text = exposition({("p", f"u{i}", "c", "Liveness", "failed"): 1 for i in range(5)})
    with pytest.raises(MetricsError, match="more than 3 probe series"):
        parse_probe_metrics(text, read_at=0.0, max_series=3)


def test_unknown_probe_types_and_results_are_skipped() -> None:
    text = exposition(
        {("p", "u", "c", "Sideness", "failed"): 1, ("p", "u", "c", "Liveness", "odd"): 1}
    )
    assert parse_probe_metrics(text, read_at=0.0).counts == {}


# -- the manager: mirror workers fed the replay ---------------------------------------------------


class ListedSource(PodSource):
    """A pod source whose listings the test hands in."""

    def __init__(self) -> None:
        super().__init__("kubelet", stale_after=60)

    async def run(self, changed: Changed) -> None:
        await asyncio.Event().wait()


@dataclass
class MirrorNode:
    runtime: FakeRuntime
    discovery: Discovery
    manager: ProbeManager
    source: ListedSource
    registry: PodSpecs
    execs: list[list[str]] = field(default_factory=list)
    exec_answer: api_pb2.ExecSyncResponse = field(
        default_factory=lambda: api_pb2.ExecSyncResponse(exit_code=0)
    )
    watcher: ManagerWatcher = field(init=False)

    def __post_init__(self) -> None:
        self.watcher = ManagerWatcher(self.manager)

    async def relist(self) -> None:
        events = await self.discovery.relist()
        self.manager.on_lifecycle(events, self.discovery.containers().values())

    def list_pods(self, pods: list[dict[str, Any]]) -> None:
        body = json.dumps({"kind": "PodList", "items": pods}).encode()
        self.source.replace_all(decode_pod_list(body, statuses=True).pods)
        self.source.succeeded()
        self.registry.rebuild()
        self.manager.on_pod_specs(self.discovery.containers().values())


@contextlib.asynccontextmanager
async def mirror_node(*, mirror: bool = True, explain: bool = False) -> AsyncIterator[MirrorNode]:
    holder: list[MirrorNode] = []

    async def exec_handler(
        _container: FakeContainer, cmd: list[str], _timeout: int
    ) -> api_pb2.ExecSyncResponse:
        holder[0].execs.append(cmd)
        return holder[0].exec_answer

    runtime = FakeRuntime(exec_handler=exec_handler)
    source = ListedSource()
    registry = PodSpecs([source])
    async with memory_client(runtime) as cri:
        manager = ProbeManager(
            prober=Prober(cri),
            rules=load_rules("probes: []", source="rules.yaml"),
            prober_started_at=time.time() - 1800,
            pod_specs=registry,
            mirror=mirror,
            mirror_explain=explain,
        )
        holder.append(MirrorNode(runtime, Discovery(cri), manager, source, registry))
        try:
            yield holder[0]
        finally:
            holder[0].watcher.unsubscribe()
            await manager.shutdown(grace=2)


def recorded_pod(name: str) -> dict[str, Any]:
    items = json.loads((FIXTURES / "pods-first.json").read_text())["items"]
    return copy.deepcopy(next(i for i in items if i["metadata"]["name"] == name))


async def start_recorded(node: MirrorNode, name: str, container: str) -> tuple[dict[str, Any], str]:
    """The recorded pod ``name`` on the fake runtime, its container running for an hour, and its
    status's containerID set to the fake container's."""
    pod = recorded_pod(name)
    sandbox = node.runtime.add_sandbox(name, namespace=pod["metadata"]["namespace"])
    sandbox.uid = pod["metadata"]["uid"]
    sandbox.created_at = time.time_ns() - HOUR_NS
    fake = node.runtime.add_container(sandbox, container)
    fake.started_at = time.time_ns() - HOUR_NS
    for status in pod["status"]["containerStatuses"]:
        if status["name"] == container:
            status["containerID"] = f"containerd://{fake.id}"
    await node.relist()
    node.list_pods([pod])
    return pod, fake.id


async def test_mirror_runs_nothing_and_shows_the_kubelets_attempts() -> None:
    """The recorded flapping readiness probe (exec, period 5): with the mirror on, cri-prober
    runs no exec at all, and its history holds the kubelet's attempts, marked as the kubelet's,
    as many as the kubelet counted."""
    async with mirror_node() as node:
        pod, container_id = await start_recorded(node, "flap", "c")
        uid = pod["metadata"]["uid"]
        tracker = CounterTracker()
        expected = 0
        for read in recorded_reads():
            update = tracker.update(counters(read.body, read.t))
            node.manager.on_mirrored(update.attempts)
            expected += sum(
                w.total for w in update.attempts if w.pod_uid == uid and w.container == "c"
            )
        await asyncio.sleep(0)  # let the mirror worker's task start and wait
        assert node.execs == []
        [state] = node.manager.probe_states(container_id)
        assert state.kind is ProbeKind.READINESS
        assert state.attempts == expected > 40
        assert state.history
        assert {r.source for r in state.history} == {MIRROR_SOURCE}
        # Each attempt went out as an AttemptFinished, as a probe worker's do.
        assert len(node.watcher.records) == expected
        assert all(r.window > 0 for r in state.history)
        # The flapping shows as transitions through the same events every surface follows.
        results = [e.result for e in node.watcher.transitions if e.kind is state.kind]
        assert Published.SUCCESS in results
        assert Published.FAILURE in results
        with pytest.raises(ProbeNotRunning, match="the kubelet runs this"):
            node.manager.probe_now(container_id, ProbeKind.READINESS)


async def test_the_mirrors_readiness_follows_the_kubelets_status() -> None:
    """At each recorded read, the readiness cri-prober publishes for the flapping probe is the
    ready the kubelet's /pods said (its status and its counters agree after every window but
    those the status had not caught up with yet)."""
    async with mirror_node() as node:
        _pod, container_id = await start_recorded(node, "flap", "c")
        tracker = CounterTracker()
        agree = total = 0
        for read in recorded_reads():
            node.manager.on_mirrored(tracker.update(counters(read.body, read.t)).attempts)
            ready = read.statuses["probes/flap/c"][1]
            published = node.manager.results.get(container_id, ProbeKind.READINESS)
            total += 1
            agree += (published is Published.SUCCESS) == ready
        assert agree >= total - 10


async def test_the_status_sets_where_a_mirrored_container_starts() -> None:
    """Before any counted attempt, the kubelet's pod status says ready: published at once."""
    async with mirror_node() as node:
        _pod, container_id = await start_recorded(node, "flap", "c")
        # The first recorded /pods says flap/c was ready.
        assert node.manager.results.get(container_id, ProbeKind.READINESS) is Published.SUCCESS


async def test_a_kubelet_restart_keeps_the_published_state() -> None:
    """A restart between reads: no attempt recorded, the published result unchanged."""
    async with mirror_node() as node:
        pod, container_id = await start_recorded(node, "flap", "c")
        uid = pod["metadata"]["uid"]
        key = ("flap", uid, "c", "Readiness", "failed")
        tracker = CounterTracker()
        node.manager.on_mirrored(tracker.update(counters(exposition({key: 50}), 1.0)).attempts)
        node.manager.on_mirrored(tracker.update(counters(exposition({key: 53}), 2.0)).attempts)
        assert node.manager.results.get(container_id, ProbeKind.READINESS) is Published.FAILURE
        [state] = node.manager.probe_states(container_id)
        before = state.attempts
        restarted = tracker.update(counters(exposition({key: 80}, start=2e9), 3.0))
        assert node.manager.on_mirrored(restarted.attempts) == 0
        [state] = node.manager.probe_states(container_id)
        assert state.attempts == before == 3
        assert node.manager.results.get(container_id, ProbeKind.READINESS) is Published.FAILURE


async def test_without_the_mirror_the_same_probe_runs() -> None:
    """The control: the same pod without --mirror gets its exec probe run by cri-prober."""
    async with mirror_node(mirror=False) as node:
        _pod, container_id = await start_recorded(node, "flap", "c")
        await node.watcher.until(lambda: node.execs)
        [state] = node.manager.probe_states(container_id)
        assert all(r.source == "" for r in state.history)


# -- the reader: a local kubelet serving the recorded counters ------------------------------------


async def test_reader_reads_the_counters_and_hands_on_each_window() -> None:
    reads = list(recorded_reads())
    updates: list[TrackerUpdate] = []
    async with KubeletServer() as server:
        reader = KubeletMetricsReader(server.metrics_url, interval=1.0)
        reader.attach(updates.append)
        try:
            server.metrics = reads[0].body.encode()
            await reader.poll()
            server.metrics = reads[1].body.encode()
            await reader.poll()
        finally:
            await reader.close()
    assert [u.baseline for u in updates] == ["the first read", ""]
    assert updates[1].attempts
    assert reader.last_error is None
    assert server.metrics_requests == 2


async def test_reader_refusals_are_one_clear_line() -> None:
    async with KubeletServer() as server:
        reader = KubeletMetricsReader(server.metrics_url, interval=1.0, max_body_bytes=100)
        try:
            server.metrics = b"x" * 200
            await reader.poll()
            assert reader.last_error is not None
            assert "larger than" in reader.last_error
            reader.max_body_bytes = 10_000
            server.metrics = b'prober_probe_total{pod_uid="u" 3\n'
            await reader.poll()
            assert reader.last_error is not None
            assert "counters cri-prober cannot use" in reader.last_error
            server.forbidden = True
            await reader.poll()
            assert reader.last_error is not None
            assert "nodes/metrics" in reader.last_error
        finally:
            await reader.close()


# -- the flag -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mirror", "prometheus"], "expected kubelet[:URL]"),
        (["--mirror", "kubelet:ftp://x"], "must start with http:// or https://"),
        (["--mirror", "kubelet"], "--mirror needs --probes-from kubelet or apiserver"),
        (
            ["--mirror", "kubelet", "--probes-from", "manifests:/etc/kubernetes/manifests"],
            "--mirror needs --probes-from kubelet or apiserver",
        ),
        (
            ["--mirror", "kubelet", "--probes-from", "kubelet", "--on-failure", "stop"],
            "the kubelet already acts",
        ),
    ],
)
def test_bad_mirror_flags_exit_2_with_one_line(
    args: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The command itself, not the group, and without its logging set-up, which would cache the
    # process's loggers for every later test (tests/conftest.py, no_cached_logging).
    monkeypatch.setattr(logs, "configure", lambda **_: None)
    result = CliRunner().invoke(serve, ["-r", "unix:///nonexistent.sock", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_the_api_says_whose_attempt_it_was() -> None:
    mirrored = ProbeRecord("c", 10.0, 0.2, "success", "", source=MIRROR_SOURCE, window=1.5)
    message = attempt_pb(mirrored)
    assert message.source == "kubelet-mirror"
    assert message.window.ToNanoseconds() == 1_500_000_000
    own = attempt_pb(ProbeRecord("c", 10.0, 0.2, "success", ""))
    assert own.source == ""
    assert not own.HasField("window")


def test_a_mirrors_window_costs_the_history_no_column() -> None:
    """A mirrored attempt keeps its window where a run attempt keeps its lateness (it served no
    tick of cri-prober's), so every history entry is still three floats: a probe cri-prober
    runs pays nothing for the mirror. Both read back exactly."""
    history = History(4)
    own = ProbeRecord("c", 10.0, 0.2, "success", "", late=0.3, dropped=1)
    mirrored = ProbeRecord("c", 11.0, 0.0, "failure", "", reason="kubelet", source=MIRROR_SOURCE,
                           window=1.25)  # fmt: skip
    history.extend([own, mirrored, own])
    assert list(history) == [own, mirrored, own]
    assert len(history._floats) == 3 * len(history)


def test_inspect_and_watch_say_the_kubelet_ran_it() -> None:
    """inspect's summary names who ran a mirrored attempt and its window, and does not claim a
    duration the kubelet did not measure; watch's reason names the source."""
    record = ProbeRecord("c", time.time(), 0.0, "failure", "", reason="kubelet",
                         source=MIRROR_SOURCE, window=1.5)  # fmt: skip
    lines = attempt_lines(attempt_pb(record), time.time())
    assert "took ?" in lines[0]
    assert (
        "  Ran by: the kubelet (kubelet-mirror), within the 1.5s before the read that showed it"
        in lines
    )
    own = attempt_lines(attempt_pb(ProbeRecord("c", time.time(), 0.2, "success", "")), time.time())
    assert not any("Ran by" in line for line in own)
    assert "1 run by the kubelet" in history_text([attempt_pb(record)])
    transition = query_pb2.Transition(reason="kubelet", consecutive=3, threshold=3,
                                      source=MIRROR_SOURCE)  # fmt: skip
    assert transition_reason(transition) == "kubelet 3/3 [kubelet-mirror]"


# -- the pod status from the apiserver source -----------------------------------------------------

APISERVER_NODE = "kd-node"
WEB_UID = "f177263d9de7365e9da06d5ff3b3399b"


def _recorded_node_pods() -> list[dict[str, Any]]:
    document = json.loads((FIXTURES.parent / "kubelet-1.28.7" / "pods-running.json").read_text())
    items: list[dict[str, Any]] = document["items"]
    return items


async def test_the_apiserver_source_keeps_the_status_for_the_mirror() -> None:
    """With keep_statuses (serve --mirror), the apiserver source keeps each container's ready,
    started and container ID, from its list and from a watch's MODIFIED event (a readiness
    flip, which changes nothing else of the pod); without it, none."""
    async with FakeApiServer(node_name=APISERVER_NODE) as fake:
        for pod in _recorded_node_pods():
            fake.put(pod)
        config = KubeConfig.from_server(fake.url)
        source = ApiServerSource(
            node_name=APISERVER_NODE, config=config, streaming_list=False, keep_statuses=True
        )
        plain = ApiServerSource(node_name=APISERVER_NODE, config=config, streaming_list=False)
        async with running(source) as changes, running(plain):
            await fake.wait_streams(2)
            status = source.pods[WEB_UID].statuses["app"]
            assert status == KubeletStatus(
                container_id=status.container_id, ready=True, started=True
            )
            assert status.container_id.startswith("ddb531537fd90cf7f")
            assert plain.pods[WEB_UID].statuses == {}
            calls = changes.calls
            flipped = copy.deepcopy(fake.pods[WEB_UID])
            flipped["status"]["containerStatuses"][0]["ready"] = False
            fake.put(flipped)
            await changes.wait(calls + 1)
            assert source.pods[WEB_UID].statuses["app"].ready is False
        assert fake.protocol_errors == []


# -- --mirror-explain rerun -----------------------------------------------------------------------


async def test_explain_reruns_a_new_kubelet_failure_once_as_its_own_attempt() -> None:
    """On a new kubelet failure (the run was passing), the mirror worker runs the probe once:
    its output is recorded as cri-prober's own attempt (no source), counted toward nothing and
    publishing nothing; a failure that goes on is not run again."""
    async with mirror_node(explain=True) as node:
        pod, _container_id = await start_recorded(node, "flap", "c")
        uid = pod["metadata"]["uid"]
        node.exec_answer = api_pb2.ExecSyncResponse(exit_code=1, stderr=b"db down")
        [worker] = [
            w
            for w in node.manager._slots.get(SlotKey(uid, "c")).workers.values()  # type: ignore[union-attr]
            if isinstance(w, MirrorWorker)
        ]

        def window(successes: int, failures: int, at: float) -> MirroredAttempts:
            return MirroredAttempts(
                uid, "c", ProbeKind.READINESS, successes, failures, 0, at, at + 1
            )

        node.manager.on_mirrored([window(2, 0, 100.0)])
        assert not worker._explain_due
        assert node.execs == []
        node.manager.on_mirrored([window(0, 1, 101.0)])
        await until(lambda: len(worker.history) == 4, timeout=30, changed=node.watcher.changed)
        assert len(node.execs) == 1
        explained = worker.history[-1]
        assert explained.source == ""
        assert explained.result == "failure"
        assert "db down" in explained.output
        assert "--mirror-explain rerun" in explained.note
        assert (explained.run, explained.threshold) == (0, 0)
        # It counted for nothing: the kubelet's run of failures is still 1 of 3.
        assert worker.result_run == 1
        assert worker.mirrored == 3
        # The failure goes on: nothing more to explain.
        node.manager.on_mirrored([window(0, 1, 102.0)])
        assert not worker._explain_due
        assert len(node.execs) == 1


async def test_without_explain_a_kubelet_failure_runs_nothing() -> None:
    async with mirror_node() as node:
        pod, _container_id = await start_recorded(node, "flap", "c")
        uid = pod["metadata"]["uid"]
        node.manager.on_mirrored(
            [MirroredAttempts(uid, "c", ProbeKind.READINESS, 1, 0, 0, 100.0, 101.0)]
        )
        node.manager.on_mirrored(
            [MirroredAttempts(uid, "c", ProbeKind.READINESS, 0, 1, 0, 101.0, 102.0)]
        )
        slot = node.manager._slots.get(SlotKey(uid, "c"))
        assert slot is not None
        assert not any(getattr(w, "_explain_due", False) for w in slot.workers.values())
        assert node.execs == []


def test_mirror_explain_needs_the_mirror(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs, "configure", lambda **_: None)
    result = CliRunner().invoke(
        serve, ["-r", "unix:///nonexistent.sock", "--mirror-explain", "rerun"]
    )
    assert result.exit_code == 2, result.output
    assert "--mirror-explain needs --mirror" in result.output
