"""The probe manager with pod specs (serve --probes-from), on the in-process fake runtime.

Each test pins one thing the pod spec makes exact that CRI alone cannot: precedence (annotation >
pod spec > rules), D3 (deletion stops liveness and startup at once), D8 (init containers), D10
(restartPolicy and phase), E1 ($(VAR) from the spec's static env), the grace periods, and where
each probe came from.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.cli.tables import probe_summary
from cri_prober.discovery.pleg import Discovery
from cri_prober.manager.api import ProbeOnHold
from cri_prober.manager.probe_manager import OnFailure, ProbeManager
from cri_prober.manager.selection import PodSpecProbes
from cri_prober.manager.state import ProbedContainer, ProbeState
from cri_prober.podspecs import registry as registry_module
from cri_prober.podspecs.registry import LISTING_MARGIN_SECONDS, PodSpecs
from cri_prober.podspecs.source import Changed, PodSource
from cri_prober.probing.kubelet_profile import KubeletProfile
from cri_prober.probing.prober import Prober
from cri_prober.probing.results import ProbeRecord, Published
from cri_prober.probing.spec import ProbeKind, load_rules
from cri_prober.serving.convert import probe_status_pb
from tests.support.clock import ManualClock
from tests.support.fake_runtime import FakeContainer, FakeRuntime, FakeSandbox
from tests.support.memory_cri import memory_client
from tests.support.waiting import HANG_GUARD
from tests.support.watchers import ManagerWatcher

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kubelet-1.28.7"
RULES = """
probes:
  - match: {namespace: jobs}
    livenessProbe: {exec: {command: [rule-live]}, periodSeconds: 600}
    readinessProbe: {exec: {command: [rule-ready]}, periodSeconds: 600}
"""
HOUR_NS = 3600 * 10**9


class ListedSource(PodSource):
    """A pod source whose listings the test hands in."""

    def __init__(self) -> None:
        super().__init__("kubelet", stale_after=60)

    async def run(self, changed: Changed) -> None:
        await asyncio.Event().wait()


@dataclass
class Node:
    runtime: FakeRuntime
    discovery: Discovery
    manager: ProbeManager
    source: ListedSource
    registry: PodSpecs
    clock: ManualClock  # the registry's (listing graces)
    execs: list[tuple[str, list[str]]] = field(default_factory=list)
    exit_codes: dict[str, int] = field(default_factory=dict)
    watcher: ManagerWatcher = field(init=False)

    def __post_init__(self) -> None:
        self.watcher = ManagerWatcher(self.manager)

    async def relist(self) -> None:
        events = await self.discovery.relist()
        self.manager.on_lifecycle(events, self.discovery.containers().values())

    def list_pods(self, *pods: dict[str, Any]) -> None:
        self.source.replace_all(list(pods))
        self.source.succeeded()
        self.registry.rebuild()
        self.manager.on_pod_specs(self.discovery.containers().values())

    def pod(self, spec: dict[str, Any]) -> FakeSandbox:
        """The CRI sandbox of ``spec``, with its UID, created an hour ago."""
        meta = spec["metadata"]
        sandbox = self.runtime.add_sandbox(meta["name"], namespace=meta["namespace"])
        sandbox.uid = meta["uid"]
        sandbox.created_at = time.time_ns() - HOUR_NS
        return sandbox

    def probed(self, container: str) -> ProbedContainer:
        """The one probed container with this name, as it stands now."""
        [probed] = [p for p in self.manager.probed() if p.container.name == container]
        return probed

    def active(self, container: str) -> set[ProbeKind]:
        """The kinds whose workers run for the container with this name."""
        return {p.kind for p in self.probed(container).probes if p.active}

    def has_worker(self, container: str, kind: ProbeKind) -> bool:
        """False once the worker of that probe ended for good."""
        state = self.probed(container).probe(kind)
        assert state is not None
        return state.has_worker

    def attempts(self, container: str) -> dict[ProbeKind, int]:
        return {p.kind: p.attempts for p in self.probed(container).probes}

    async def exit(self, container: FakeContainer) -> None:
        """The container exits, and discovery sees it."""
        container.state = api_pb2.CONTAINER_EXITED
        container.finished_at = time.time_ns()
        await self.relist()


def _recorded(name: str) -> dict[str, Any]:
    items = json.loads((FIXTURES / "pods-running.json").read_text())["items"]
    return copy.deepcopy(next(item for item in items if item["metadata"]["name"] == name))


@pytest.fixture(name="node")
async def _node(request: pytest.FixtureRequest) -> AsyncIterator[Node]:
    # serve --pod-spec-probes, when a test asks for another than the default (indirect).
    pod_spec_probes: PodSpecProbes = getattr(request, "param", "all")
    async with _running_node(pod_spec_probes, "stop") as node:
        yield node


@pytest.fixture(name="report_node")
async def _report_node() -> AsyncIterator[Node]:
    """A node in report mode: nothing stops a container whose liveness fails."""
    async with _running_node("all", "report") as node:
        yield node


@contextlib.asynccontextmanager
async def _running_node(
    pod_spec_probes: PodSpecProbes, on_failure: OnFailure
) -> AsyncIterator[Node]:
    holder: list[Node] = []

    async def exec_handler(
        container: FakeContainer, cmd: list[str], _timeout: int
    ) -> api_pb2.ExecSyncResponse:
        holder[0].execs.append((container.name, cmd))
        return api_pb2.ExecSyncResponse(exit_code=holder[0].exit_codes.get(cmd[0], 0))

    runtime = FakeRuntime(exec_handler=exec_handler)
    source = ListedSource()
    clock = ManualClock()
    registry = PodSpecs([source], clock=clock)
    async with memory_client(runtime) as cri:
        manager = ProbeManager(
            prober=Prober(cri),
            rules=load_rules(RULES, source="rules.yaml"),
            prober_started_at=time.time() - 1800,
            on_failure=on_failure,
            stopper=cri,
            pod_specs=registry,
            rules_source="rules.yaml",
            pod_spec_probes=pod_spec_probes,
        )
        holder.append(Node(runtime, Discovery(cri), manager, source, registry, clock))
        yield holder[0]
        holder[0].watcher.unsubscribe()
        await manager.shutdown(grace=2)


async def test_pod_spec_probes_run_and_say_where_they_came_from(node: Node) -> None:
    web = _recorded("web-kd-node")
    sandbox = node.pod(web)
    app = node.runtime.add_container(sandbox, "app")
    node.runtime.add_container(sandbox, "worker")
    node.list_pods(web)
    await node.relist()
    configured = {p.container.name: {s.kind for s in p.probes} for p in node.manager.probed()}
    assert configured == {"app": set(ProbeKind), "worker": {ProbeKind.LIVENESS}}
    states = {state.kind: state for state in node.manager.probe_states(app.id)}
    assert {state.origin for state in states.values()} == {"pod-spec"}
    assert states[ProbeKind.LIVENESS].source == "kubelet"
    # Named ports come from the spec's container.
    assert states[ProbeKind.STARTUP].ports == {"http": 8080}


async def test_annotation_then_pod_spec_then_rules(node: Node) -> None:
    """The recorded web pod's annotation sets app's readiness to tcpSocket 8080; the spec keeps
    liveness and startup; rules matching a pod with a spec fill only kinds neither defines."""
    web = _recorded("web-kd-node")
    sandbox = node.pod(web)
    sandbox.annotations = dict(web["metadata"]["annotations"])
    app = node.runtime.add_container(sandbox, "app")
    batch = _recorded("batch-kd-node")
    batch_sandbox = node.pod(batch)
    main = node.runtime.add_container(batch_sandbox, "main")
    node.list_pods(web, batch)
    await node.relist()
    states = {s.kind: s for s in node.manager.probe_states(app.id)}
    assert states[ProbeKind.READINESS].origin == "annotation"
    assert states[ProbeKind.READINESS].probe.tcp_socket is not None
    assert states[ProbeKind.READINESS].source == "annotation probes.cri-prober.io/app"
    assert states[ProbeKind.LIVENESS].origin == "pod-spec"
    main_states = {s.kind: s for s in node.manager.probe_states(main.id)}
    # batch's spec defines readiness only: liveness comes from the rules file.
    assert main_states[ProbeKind.READINESS].origin == "pod-spec"
    assert main_states[ProbeKind.READINESS].probe.success_threshold == 2
    assert main_states[ProbeKind.LIVENESS].origin == "rules"
    assert main_states[ProbeKind.LIVENESS].source == "rules.yaml"


@pytest.mark.parametrize("node", ["network-only"], indirect=True)
async def test_network_only_leaves_the_specs_exec_probes_to_the_kubelet(node: Node) -> None:
    """serve --pod-spec-probes network-only: the spec's httpGet/tcpSocket probes run, its exec
    probes get no worker (the kubelet runs them), the rules file does not stand in for them, an
    annotation's exec probe still runs, and each left-out probe is logged once, not per relist."""
    web = _recorded("web-kd-node")  # app: httpGet, httpGet, tcpSocket; worker: exec liveness
    sandbox = node.pod(web)
    node.runtime.add_container(sandbox, "app")
    node.runtime.add_container(sandbox, "worker")
    batch = _recorded("batch-kd-node")  # main: exec readiness; the rules match namespace jobs
    main = node.runtime.add_container(node.pod(batch), "main")
    with capture_logs() as logs:
        node.list_pods(web, batch)
        for _ in range(3):
            await node.relist()
    configured = {p.container.name: {s.kind for s in p.probes} for p in node.manager.probed()}
    # main's liveness is the rules file's (its spec has none); its readiness is left out.
    assert configured == {"app": set(ProbeKind), "main": {ProbeKind.LIVENESS}}
    assert {s.origin for s in node.manager.probe_states(main.id)} == {"rules"}
    left = [e for e in logs if e["event"] == "pod_spec_exec_probe_left_to_kubelet"]
    assert sorted((e["pod"], e["container"], e["probe"]) for e in left) == [
        ("jobs/batch-kd-node", "main", "readinessProbe"),
        ("shop/web-kd-node", "worker", "livenessProbe"),
    ]
    await node.watcher.until(
        lambda: node.attempts("main")[ProbeKind.LIVENESS] >= 1, timeout=HANG_GUARD
    )
    assert [cmd for _, cmd in node.execs] == [["rule-live"]] * len(node.execs)


@pytest.mark.parametrize("node", ["network-only"], indirect=True)
async def test_network_only_keeps_an_annotations_exec_probe(node: Node) -> None:
    """An annotation's probe comes before the spec's: it is not the spec's to leave out."""
    web = _recorded("web-kd-node")
    sandbox = node.pod(web)
    override = {"livenessProbe": {"exec": {"command": ["from-annotation"]}}}
    sandbox.annotations = {"probes.cri-prober.io/worker": json.dumps(override)}
    node.runtime.add_container(sandbox, "worker")
    with capture_logs() as logs:
        node.list_pods(web)
        await node.relist()
    [state] = node.probed("worker").probes
    assert (state.kind, state.origin) == (ProbeKind.LIVENESS, "annotation")
    assert not [e for e in logs if e["event"] == "pod_spec_exec_probe_left_to_kubelet"]


async def test_d8_ordinary_init_container_is_never_probed(node: Node) -> None:
    """The rules match every container of namespace jobs, the init container `setup` too; with
    the spec it is known as an init container, and the kubelet never probes those.

    Issue 23: before the source listed the pod, the rules file's probes ran on `setup` (2-3
    attempts, transitions published) for its first second. Now a container whose pod no source
    lists waits for the listing (or the listing grace), as the kubelet runs nothing for a
    container it has no pod spec for."""
    batch = _recorded("batch-kd-node")
    sandbox = node.pod(batch)
    setup = node.runtime.add_container(sandbox, "setup", state=api_pb2.CONTAINER_EXITED)
    node.runtime.add_container(sandbox, "main")
    with capture_logs() as logs:
        await node.relist()
    assert node.manager.probed() == []  # no source lists the pod yet: nothing runs
    assert node.manager.worker_count() == 0
    waits = [e for e in logs if e["event"] == "probes_wait_for_pod_spec"]
    assert {e["container"] for e in waits} == {
        "jobs/batch-kd-node/setup",
        "jobs/batch-kd-node/main",
    }
    assert {e["log_level"] for e in waits} == {"debug"}
    node.list_pods(batch)
    assert node.manager.probed_container(setup.id) is None
    assert [p.container.name for p in node.manager.probed()] == ["main"]
    # The listing grace passing later changes nothing: the pod is listed.
    node.clock.advance(node.registry.listing_grace() + 1)
    node.manager.on_pod_specs(node.discovery.containers().values())
    assert node.manager.probed_container(setup.id) is None


async def test_a_pod_no_source_lists_gets_the_rules_once_the_listing_grace_passed(
    node: Node,
) -> None:
    """A pod the sources never list (a container no kubelet made, a static pod of a manifest
    directory not read) waits out the listing grace, then gets the rules file's probes."""
    node.list_pods()  # the source has read (the grace counts from there)
    sandbox = node.runtime.add_sandbox("adhoc", namespace="jobs")
    node.runtime.add_container(sandbox, "tool")
    await node.relist()
    assert node.manager.probed() == []
    # No polled source here: the grace is the margin alone.
    assert node.registry.listing_grace() == LISTING_MARGIN_SECONDS
    node.clock.advance(LISTING_MARGIN_SECONDS - 0.1)
    await node.relist()
    assert node.manager.probed() == []
    node.clock.advance(0.1)
    with capture_logs() as logs:
        node.manager.on_pod_specs(node.discovery.containers().values())
        node.manager.on_pod_specs(node.discovery.containers().values())
    assert node.active("tool") == {ProbeKind.LIVENESS, ProbeKind.READINESS}
    assert {s.origin for s in node.probed("tool").probes} == {"rules"}
    [passed] = [e for e in logs if e["event"] == "pod_spec_grace_passed"]
    assert passed["pod"] == "jobs/adhoc"
    assert passed["log_level"] == "info"


async def test_the_listing_grace_waits_for_a_source_that_has_not_read(node: Node) -> None:
    """Issue 34: with the API server down at start, the listing grace (2 s) ran out although the
    source had never read, and an ordinary init container got probes (for 23 s, until the first
    list). The grace counts from the source's first good read: nothing runs meanwhile."""
    batch = _recorded("batch-kd-node")
    sandbox = node.pod(batch)
    setup = node.runtime.add_container(sandbox, "setup", state=api_pb2.CONTAINER_EXITED)
    node.runtime.add_container(sandbox, "main")
    await node.relist()
    node.clock.advance(node.registry.listing_grace() + 10)  # the source still has not read
    with capture_logs() as logs:
        node.manager.on_pod_specs(node.discovery.containers().values())
    assert node.manager.probed() == []  # the rules match `setup` too: they must wait
    assert [e for e in logs if e["event"] == "pod_spec_grace_passed"] == []
    node.list_pods(batch)  # the first good read lists the pod
    assert node.manager.probed_container(setup.id) is None
    assert [p.container.name for p in node.manager.probed()] == ["main"]


async def test_the_manager_looks_again_when_a_listing_grace_ends(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing else needs to happen on the node: the manager reconciles when the grace ends."""
    monkeypatch.setattr(registry_module, "LISTING_MARGIN_SECONDS", 0.05)
    node.list_pods()  # the source has read (the grace counts from there)
    sandbox = node.runtime.add_sandbox("adhoc", namespace="jobs")
    node.runtime.add_container(sandbox, "tool")
    await node.relist()
    assert node.manager.tracked() == 0
    node.clock.advance(0.05)
    await node.watcher.until(lambda: node.manager.tracked() == 1)
    assert node.active("tool") == {ProbeKind.LIVENESS, ProbeKind.READINESS}


async def test_d3_deletion_stops_liveness_and_startup_at_once(node: Node) -> None:
    web = _recorded("web-kd-node")
    sandbox = node.pod(web)
    app = node.runtime.add_container(sandbox, "app")
    node.list_pods(web)
    await node.relist()
    assert node.active("app") == set(ProbeKind)
    deleted = copy.deepcopy(web)
    deleted["metadata"]["deletionTimestamp"] = "2026-11-23T10:00:00Z"
    deleted["metadata"]["deletionGracePeriodSeconds"] = 20
    node.list_pods(deleted)
    # Stopped in the same call, before any relist: the kubelet's StopLivenessAndStartup.
    assert node.active("app") == {ProbeKind.READINESS}
    assert node.probed("app").terminating
    await node.watcher.until(lambda: node.manager.results.get(app.id, ProbeKind.LIVENESS) is None)
    # Readiness goes on while the containers shut down.
    assert node.active("app") == {ProbeKind.READINESS}
    # A further relist does not bring them back.
    await node.relist()
    assert node.active("app") == {ProbeKind.READINESS}


async def test_d3_pod_leaving_the_source_counts_as_deletion(node: Node) -> None:
    """A removed static pod vanishes from /pods at once, with no deletionTimestamp."""
    web = _recorded("web-kd-node")
    sandbox = node.pod(web)
    node.runtime.add_container(sandbox, "app")
    node.list_pods(web)
    await node.relist()
    terminating = json.loads((FIXTURES / "pods-terminating.json").read_text())["items"]
    node.list_pods(*terminating)
    assert node.active("app") == {ProbeKind.READINESS}
    assert node.probed("app").terminating


def _api_pod(name: str) -> dict[str, Any]:
    """A recorded pod as the kubelet lists a pod it got from the API server."""
    pod = _recorded(name)
    pod["metadata"]["annotations"]["kubernetes.io/config.source"] = "api"
    return pod


async def test_a_completed_ordinary_init_container_is_ready_as_in_the_kubelets_status(
    node: Node,
) -> None:
    """Issue 34 (9): the recorded kubelet shows batch's completed init container `setup` with
    ready true and started false (fixtures/kubelet-1.28.7/pods-running.json): an ordinary init
    container is ready once it exited 0 (UpdatePodStatus). cri-prober said not ready."""
    batch = _recorded("batch-kd-node")
    recorded = {s["name"]: s for s in batch["status"]["initContainerStatuses"]}
    assert (recorded["setup"]["ready"], recorded["setup"]["started"]) == (True, False)
    sandbox = node.pod(batch)
    setup = node.runtime.add_container(sandbox, "setup", state=api_pb2.CONTAINER_EXITED)
    setup.exit_code = 0
    node.runtime.add_container(sandbox, "main")
    await node.relist()
    info = node.discovery.containers()[setup.id]
    before = node.manager.container_health(info)  # no source lists the pod: CRI alone
    assert (before.running, before.started, before.ready) == (False, False, False)
    node.list_pods(batch)
    health = node.manager.container_health(node.discovery.containers()[setup.id])
    assert (health.running, health.started, health.ready) == (False, False, True)
    # One that failed is not ready, nor is a regular container that exited 0.
    info = node.discovery.containers()[setup.id]
    failed = node.manager.container_health(dataclasses.replace(info, exit_code=1))
    assert (failed.started, failed.ready) == (False, False)
    regular = node.manager.container_health(dataclasses.replace(info, name="main"))
    assert regular.ready is False


async def test_a_pod_missing_from_one_read_keeps_its_workers_and_counters(node: Node) -> None:
    """A polled source that misses a pod once (one odd answer) costs its workers nothing within
    the grace: the same workers go on counting. Past the grace it is gone, as a deletion (D3).
    (An API pod: the kubelet shows its deletion as a deletionTimestamp first, so an omission
    alone explains nothing.)"""
    node.source.missing_grace = 3600.0  # a polled source's grace, long enough for the test
    web = _api_pod("web-kd-node")
    sandbox = node.pod(web)
    node.runtime.add_container(sandbox, "app")
    node.list_pods(web)
    await node.relist()
    watcher = ManagerWatcher(node.manager)
    assert node.active("app") == set(ProbeKind)
    for _ in range(3):
        node.list_pods()  # missing from this read
        assert node.active("app") == set(ProbeKind)
        assert not node.probed("app").terminating
        node.list_pods(web)  # back in the next
        assert node.active("app") == set(ProbeKind)
    node.source.missing_grace = 0.0
    node.list_pods()
    node.registry.expire_missing()
    node.manager.on_pod_specs(node.discovery.containers().values())
    assert node.active("app") == {ProbeKind.READINESS}
    assert node.probed("app").terminating
    # No worker was replaced while the pod came and went: only the two deletion stops.
    await watcher.until(lambda: len(watcher.stopped) == 2)
    assert {(e.kind, e.replaced) for e in watcher.stopped} == {
        (ProbeKind.LIVENESS, False),
        (ProbeKind.STARTUP, False),
    }


async def test_a_static_pod_gone_from_the_kubelets_listing_stops_liveness_at_once(
    node: Node,
) -> None:
    """Issue 34 (5): a static pod leaves the kubelet's /pods the moment its manifest is removed,
    with no deletionTimestamp (fixtures/kubelet-1.28.7/pods-terminating.json), and the kubelet
    stops its liveness and startup as it starts terminating it. Its omission is its deletion:
    no missing-pod grace (it used to keep liveness probed, and failing, for 5 s more)."""
    node.source.missing_grace = 3600.0  # a polled source's grace: would keep it for an hour
    web = _recorded("web-kd-node")  # kubernetes.io/config.source: file
    sandbox = node.pod(web)
    node.runtime.add_container(sandbox, "app")
    node.list_pods(web)
    await node.relist()
    assert node.active("app") == set(ProbeKind)
    node.list_pods()  # web.yaml removed: the kubelet's next /pods lists no web
    assert node.active("app") == {ProbeKind.READINESS}  # readiness runs until the kill ends
    assert node.probed("app").terminating
    # Back in a listing (a manifest written again): probed in full again.
    node.list_pods(web)
    assert node.active("app") == set(ProbeKind)
    assert not node.probed("app").terminating


async def test_d10_restart_policy_never_ends_the_worker_of_an_exited_container(
    node: Node,
) -> None:
    """batch is restartPolicy Never: its exited container's worker ends while the sandbox is
    still up (CRI alone kept it going until the sandbox stopped)."""
    batch = _recorded("batch-kd-node")
    sandbox = node.pod(batch)
    main = node.runtime.add_container(sandbox, "main")
    node.list_pods(batch)
    await node.relist()
    watcher = ManagerWatcher(node.manager)
    await node.exit(main)
    await node.watcher.until(lambda: not node.has_worker("main", ProbeKind.READINESS))
    # Ended, not replaced (the liveness worker too, when its tick came first).
    replaced = {stopped.kind: stopped.replaced for stopped in watcher.stopped}
    assert replaced[ProbeKind.READINESS] is False
    assert set(replaced.values()) == {False}
    assert sandbox.ready  # the pod still runs: only the restart policy ended it


async def test_d10_restart_policy_always_keeps_the_worker(node: Node) -> None:
    web = _recorded("web-kd-node")
    sandbox = node.pod(web)
    worker_container = node.runtime.add_container(sandbox, "worker")
    node.list_pods(web)
    await node.relist()
    watcher = ManagerWatcher(node.manager)
    await node.exit(worker_container)
    await node.watcher.until(
        lambda: (
            node.manager.results.get(worker_container.id, ProbeKind.LIVENESS) is Published.FAILURE
        )
    )
    assert node.active("worker") == {ProbeKind.LIVENESS}
    assert watcher.stopped == []


async def test_d10_finished_pod_phase_ends_workers_silently(node: Node) -> None:
    web = _recorded("web-kd-node")
    sandbox = node.pod(web)
    node.runtime.add_container(sandbox, "worker")
    node.list_pods(web)
    await node.relist()
    watcher = ManagerWatcher(node.manager)
    [probed] = node.manager.probed()
    failed = copy.deepcopy(web)
    failed["status"]["phase"] = "Failed"
    node.list_pods(failed)
    node.manager.probe_now(probed.container.id, ProbeKind.LIVENESS)
    await node.watcher.until(lambda: not node.has_worker("worker", ProbeKind.LIVENESS))
    [stopped] = watcher.stopped
    assert (stopped.kind, stopped.replaced) == (ProbeKind.LIVENESS, False)
    assert watcher.transitions == []  # silently: nothing published


async def test_e1_exec_expands_only_the_specs_static_env(node: Node) -> None:
    """The runtime reports the container's whole environment; the kubelet expands $(VAR) in a
    probe command from the spec's env only, valueFrom variables as ""."""
    pod = _recorded("web-kd-node")
    worker_spec = pod["spec"]["containers"][1]
    worker_spec["env"] = [
        {"name": "FILE", "value": "/tmp/alive"},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
    ]
    worker_spec["livenessProbe"]["exec"]["command"] = ["check", "$(FILE)", "$(TOKEN)", "$(HOME)"]
    sandbox = node.pod(pod)
    node.runtime.add_container(
        sandbox, "worker", env={"FILE": "/from/runtime", "TOKEN": "s3cret", "HOME": "/root"}
    )
    node.list_pods(pod)
    await node.relist()
    [probed] = node.manager.probed()
    node.manager.probe_now(probed.container.id, ProbeKind.LIVENESS)
    await node.watcher.until(lambda: any(cmd[0] == "check" for _name, cmd in node.execs))
    [cmd] = [cmd for _name, cmd in node.execs if cmd[0] == "check"]
    assert cmd == ["check", "/tmp/alive", "", "$(HOME)"]


async def test_kill_grace_comes_from_the_spec(node: Node) -> None:
    """web's app: liveness terminationGracePeriodSeconds 7 (the probe's) over the pod's 20."""
    web = _recorded("web-kd-node")
    # The recorded probes are httpGet and tcpSocket with no server behind them here: make
    # liveness an exec probe that fails at once, and drop the startup probe that gates it.
    app_spec = web["spec"]["containers"][0]
    del app_spec["startupProbe"]
    app_spec["livenessProbe"] = {
        "exec": {"command": ["check-live"]},
        "periodSeconds": 600,
        "failureThreshold": 1,
        "terminationGracePeriodSeconds": 7,
    }
    node.exit_codes["check-live"] = 1
    sandbox = node.pod(web)
    app = node.runtime.add_container(sandbox, "app")
    node.list_pods(web)
    await node.relist()
    node.manager.probe_now(app.id, ProbeKind.LIVENESS)
    await asyncio.wait_for(node.runtime.container_stopped.wait(), HANG_GUARD)
    assert node.runtime.stop_requests == [(app.id, 7)]


async def test_d10_sidecar_keeps_its_worker_in_a_never_pod(node: Node) -> None:
    """A restartable init container is restarted whatever the pod's restartPolicy (§3.6): its
    worker goes on after it exits, in a Never pod."""
    batch = _recorded("batch-kd-node")
    batch["spec"]["initContainers"].append(
        {
            "name": "proxy",
            "image": "busybox",
            "restartPolicy": "Always",
            "readinessProbe": {"exec": {"command": ["proxy-ready"]}, "periodSeconds": 600},
        }
    )
    sandbox = node.pod(batch)
    proxy = node.runtime.add_container(sandbox, "proxy")
    node.list_pods(batch)
    await node.relist()
    watcher = ManagerWatcher(node.manager)
    await node.exit(proxy)
    await node.watcher.until(
        lambda: node.manager.results.get(proxy.id, ProbeKind.READINESS) is Published.FAILURE
    )
    # Step (7) published the failure and went on: a worker whose exited container will not
    # restart ends in that same step, before anyone hears of the failure (main's exit in this
    # Never pod would end its worker). Liveness comes from the rules and goes on too.
    assert node.active("proxy") == {ProbeKind.LIVENESS, ProbeKind.READINESS}
    assert watcher.stopped == []


@pytest.mark.parametrize(
    ("kubelet", "probed"),
    [
        (KubeletProfile.parse("1.28"), False),
        (KubeletProfile.parse("1.28", "SidecarContainers=true"), True),
        (KubeletProfile.parse("1.29"), True),
        (KubeletProfile.parse("1.32", "SidecarContainers=false"), False),
        (KubeletProfile.parse("1.33"), True),
    ],
    ids=["1.28", "1.28-gate-on", "1.29", "1.32-gate-off", "1.33-GA"],
)
async def test_a_sidecar_is_probed_where_the_kubelets_gate_is_on(
    node: Node, kubelet: KubeletProfile, probed: bool
) -> None:
    """prober_manager.go AddPod (release-1.28): workers for a restartable init container only
    with SidecarContainers on (alpha in 1.28, beta and on in 1.29, GA and locked in 1.33); off,
    it is an ordinary init container, which the kubelet never probes (D8)."""
    node.manager.set_kubelet(kubelet)
    batch = _recorded("batch-kd-node")
    batch["spec"]["initContainers"].append(
        {
            "name": "proxy",
            "image": "busybox",
            "restartPolicy": "Always",
            "readinessProbe": {"exec": {"command": ["proxy-ready"]}, "periodSeconds": 600},
        }
    )
    sandbox = node.pod(batch)
    proxy = node.runtime.add_container(sandbox, "proxy")
    node.list_pods(batch)
    await node.relist()
    assert (node.manager.probed_container(proxy.id) is not None) is probed


async def test_counters_and_history_survive_the_exit_that_ends_the_worker(node: Node) -> None:
    """Issue 23: after an exit that ends the worker (restartPolicy Never here), `inspect` showed
    attempts 0 and an empty history: the read model forgot the ended worker. The kubelet's
    worker is gone then too, but what it did stays readable (D10): the probe keeps its counts."""
    batch = _recorded("batch-kd-node")
    sandbox = node.pod(batch)
    main = node.runtime.add_container(sandbox, "main")
    node.list_pods(batch)
    await node.relist()

    def readiness() -> ProbeState:
        [state] = [s for s in node.manager.probe_states(main.id) if s.kind is ProbeKind.READINESS]
        return state

    await node.watcher.until(lambda: readiness().attempts >= 1)
    node.manager.probe_now(main.id, ProbeKind.READINESS)
    await node.watcher.until(lambda: readiness().attempts >= 2)
    before = readiness()
    await node.exit(main)
    await node.watcher.until(lambda: not node.has_worker("main", ProbeKind.READINESS))
    after = readiness()
    assert not after.active
    assert after.attempts >= before.attempts >= 2
    assert len(after.history) == after.attempts
    assert after.history[: len(before.history)] == before.history
    assert after.last_record == after.history[-1]
    assert after.last_result is Published.SUCCESS
    assert after.result_run == before.result_run
    # The result itself is gone with the worker, as the kubelet's is.
    assert after.published is None
    assert node.attempts("main")[ProbeKind.READINESS] == after.attempts


async def test_a_held_failure_survives_a_source_gap(report_node: Node) -> None:
    """Issue 34 item 3: a pod-spec liveness failure, held (the kubelet's rule), became
    ``liveness (none) -> success (initial)`` for the same, never restarted container once the
    kubelet's /pods left the pod out past the missing-pod grace and then listed it again. The
    kubelet's one worker for the pod keeps its hold and result until a new container ID: the
    worker started again for the same container takes both over, and probes nothing."""
    node = report_node
    web = _recorded("web-kd-node")
    [spec] = [c for c in web["spec"]["containers"] if c["name"] == "worker"]
    spec["livenessProbe"]["failureThreshold"] = 1  # exec cat /tmp/alive, period 10
    sandbox = node.pod(web)
    worker = node.runtime.add_container(sandbox, "worker")
    node.exit_codes["cat"] = 1
    node.list_pods(web)
    await node.relist()
    live = ProbeKind.LIVENESS
    await node.watcher.until(lambda: node.manager.results.get(worker.id, live) is Published.FAILURE)
    state = node.probed("worker").probe(live)
    assert state is not None
    assert state.on_hold
    assert state.origin == "pod-spec"
    execs, transitions = len(node.execs), len(node.watcher.transitions)

    # The gap: /pods leaves the pod out past its grace (a deletion, D3: liveness stops).
    node.source.missing_grace = 0.0
    node.list_pods()
    node.registry.expire_missing()
    node.manager.on_pod_specs(node.discovery.containers().values())
    await node.watcher.until(lambda: [e.kind for e in node.watcher.stopped] == [live])
    assert node.manager.results.get(worker.id, live) is None  # as the kubelet's Remove

    node.list_pods(web)  # listed again: the same container, never restarted
    assert node.manager.results.get(worker.id, live) is Published.FAILURE
    with pytest.raises(ProbeOnHold, match="after 1 in a row"):
        node.manager.probe_now(worker.id, live)
    await node.relist()
    await node.relist()
    state = node.probed("worker").probe(live)
    assert state is not None
    assert state.on_hold
    assert state.active
    assert state.published is Published.FAILURE
    assert state.attempts == 1  # the counts and history carried on
    assert node.watcher.transitions[transitions:] == []
    assert len(node.execs) == execs


async def test_a_kept_result_goes_with_its_container(report_node: Node) -> None:
    """What a gap keeps for a container (issue 34) is dropped once the container leaves the
    runtime: nothing is kept for containers the node no longer has."""
    node = report_node
    web = _recorded("web-kd-node")
    sandbox = node.pod(web)
    worker = node.runtime.add_container(sandbox, "worker")
    node.list_pods(web)
    await node.relist()
    await node.watcher.until(
        lambda: node.manager.results.get(worker.id, ProbeKind.LIVENESS) is Published.SUCCESS
    )
    node.source.missing_grace = 0.0
    node.list_pods()
    node.registry.expire_missing()
    node.manager.on_pod_specs(node.discovery.containers().values())
    assert node.manager.kept_count() == 1
    node.list_pods(web)  # taken over: no longer kept
    assert node.manager.kept_count() == 0
    node.list_pods()
    node.registry.expire_missing()
    node.manager.on_pod_specs(node.discovery.containers().values())
    assert node.manager.kept_count() == 1
    node.runtime.remove_container(worker.id)
    await node.relist()
    assert node.manager.kept_count() == 0


async def test_inspect_shows_the_ended_probes_counts_beside_its_history(node: Node) -> None:
    """Issue 34: the read model kept an ended probe's counts (issue 23), but the API sent them
    only while a worker ran, so `inspect` showed "0 attempts in all" beside a history of
    several attempts. The counts it shows are the ended worker's."""
    batch = _recorded("batch-kd-node")
    sandbox = node.pod(batch)
    main = node.runtime.add_container(sandbox, "main")
    node.list_pods(batch)
    await node.relist()

    def readiness() -> ProbeState:
        [state] = [s for s in node.manager.probe_states(main.id) if s.kind is ProbeKind.READINESS]
        return state

    async def probe_until(count: int) -> None:
        node.manager.probe_now(main.id, ProbeKind.READINESS)
        await node.watcher.until(lambda: readiness().attempts >= count)

    await node.watcher.until(lambda: readiness().attempts >= 1)
    await probe_until(2)
    await probe_until(3)
    await node.exit(main)
    await node.watcher.until(lambda: not node.has_worker("main", ProbeKind.READINESS))
    ended = readiness()
    assert ended.attempts >= 3

    status = probe_status_pb(ended, detail=True)
    assert status.attempts == ended.attempts == len(status.detail.history)
    assert status.consecutive_successes == ended.result_run >= 3  # every exec exited 0
    assert status.threshold == 2  # the run counts toward successThreshold
    assert (status.consecutive_failures, status.active) == (0, False)
    block = "\n".join(probe_summary("readiness", status, time.time()))
    assert f"{ended.attempts} attempts in all" in block
    assert f"In a row: {ended.result_run} successes, 0 failures" in block
    # An exec in flight at the exit may have errored ("container is not running"): counted in
    # the attempts and the history, not in the run.
    assert f"History: success x{ended.result_run}" in block
    assert "(no longer probed: the container is gone)" in block


def _attempted(node: Node, steps: int) -> bool:
    """app's startup and worker's liveness have made ``steps`` attempts each (errored ones too)."""
    for name, kind in (("app", ProbeKind.STARTUP), ("worker", ProbeKind.LIVENESS)):
        state = node.probed(name).probe(kind)
        if state is None or len(state.history) < steps:
            return False
    return True


async def test_a_probe_with_an_unknown_handler_field_is_not_run(node: Node) -> None:
    """Issue 37: a handler field cri-prober does not know (here one invented in an exec and
    in a tcpSocket handler) is never sent some other way: every attempt errors with reason
    ``unsupported`` naming it, nothing is published from them (the exec never runs), and the
    pod is logged once, however many of its probes and attempts meet it."""
    web = _recorded("web-kd-node")
    containers = web["spec"]["containers"]
    containers[0]["startupProbe"]["tcpSocket"]["proxyProtocol"] = "v2"
    containers[1]["livenessProbe"]["exec"]["user"] = 0
    sandbox = node.pod(web)
    app = node.runtime.add_container(sandbox, "app")
    worker = node.runtime.add_container(sandbox, "worker")
    with capture_logs() as logs:
        node.list_pods(web)
        await node.relist()
        for steps in (1, 2):
            node.manager.probe_now(app.id, ProbeKind.STARTUP)
            node.manager.probe_now(worker.id, ProbeKind.LIVENESS)
            await node.watcher.until(functools.partial(_attempted, node, steps), timeout=30)
    for name, kind, field_name in (
        ("app", ProbeKind.STARTUP, "tcpSocket.proxyProtocol"),
        ("worker", ProbeKind.LIVENESS, "exec.user"),
    ):
        state = node.probed(name).probe(kind)
        assert state is not None
        assert state.last_record is not None
        assert (state.last_record.result, state.last_record.reason) == ("error", "unsupported")
        assert state.last_record.output.startswith(f"unsupported: {field_name}:")
        assert state.published is not Published.FAILURE
    assert node.execs == []
    unsupported = [e for e in logs if e["event"] == "probe_unsupported"]
    assert len(unsupported) == 1
    assert unsupported[0]["pod"] == "shop/web-kd-node"


# KEP-5307 (ContainerRestartRules: alpha 1.34, beta and on from 1.35): worker.go doProbe step 7
# (release-1.35) ends the worker of an exited container by podutil.ContainerShouldRestart, which
# reads the container's own restartPolicy and restartPolicyRules; before, by the pod's policy.
_RESTART_RULE_RELEASES = [
    KubeletProfile.parse("1.28"),
    KubeletProfile.parse("1.34"),
    KubeletProfile.parse("1.34", "ContainerRestartRules=true"),
    KubeletProfile.parse("1.35"),
    KubeletProfile.parse("1.35", "ContainerRestartRules=false"),
    KubeletProfile.parse("1.37"),
]
_RESTART_RULE_IDS = ["1.28", "1.34", "1.34-gate-on", "1.35", "1.35-gate-off", "1.37"]


async def _exit_and_see_step_7(
    node: Node, pod: dict[str, Any], container: str, exit_code: int, kind: ProbeKind
) -> bool:
    """Run ``pod``, let ``container`` exit with ``exit_code``; whether its worker goes on."""
    sandbox = node.pod(pod)
    fake = node.runtime.add_container(sandbox, container)
    node.list_pods(pod)
    await node.relist()
    fake.exit_code = exit_code
    await node.exit(fake)
    # Step (7) publishes the failure and, for a container that will not restart, ends the worker
    # in that same step (its result goes with it): whichever is seen first says which it was.
    await node.watcher.until(
        lambda: (
            not node.has_worker(container, kind)
            or node.manager.results.get(fake.id, kind) is Published.FAILURE
        )
    )
    return node.has_worker(container, kind)


@pytest.mark.parametrize(
    ("exit_code", "goes_on_with_rules"),
    [(0, False), (42, True)],
    ids=["exit-0", "exit-42-restart-rule"],
)
@pytest.mark.parametrize("kubelet", _RESTART_RULE_RELEASES, ids=_RESTART_RULE_IDS)
async def test_kep5307_a_containers_own_restart_policy_and_rules_decide_step_7(
    node: Node, kubelet: KubeletProfile, exit_code: int, goes_on_with_rules: bool
) -> None:
    """web is restartPolicy Always; its container worker says Never, with a rule that restarts
    on exit code 42. With the gate on, exit 0 ends the worker and 42 restarts (goes on); off, the
    pod's Always keeps the worker whatever the exit."""
    node.manager.set_kubelet(kubelet)
    web = _recorded("web-kd-node")
    [spec] = [c for c in web["spec"]["containers"] if c["name"] == "worker"]
    spec["restartPolicy"] = "Never"
    spec["restartPolicyRules"] = [
        {"action": "Restart", "exitCodes": {"operator": "In", "values": [42]}}
    ]
    goes_on = await _exit_and_see_step_7(node, web, "worker", exit_code, ProbeKind.LIVENESS)
    rules = kubelet.gate("ContainerRestartRules")
    assert goes_on is (goes_on_with_rules if rules else True)


@pytest.mark.parametrize("kubelet", _RESTART_RULE_RELEASES, ids=_RESTART_RULE_IDS)
async def test_kep5307_on_failure_pod_ends_the_worker_after_a_clean_exit(
    node: Node, kubelet: KubeletProfile
) -> None:
    """No container-level field at all: an OnFailure pod whose container exits 0. Before the
    gate, step 7 went on for any pod policy but Never; ContainerShouldRestart says OnFailure
    restarts only a failed exit, so from 1.35 (gate on) the worker ends."""
    node.manager.set_kubelet(kubelet)
    web = _recorded("web-kd-node")
    web["spec"]["restartPolicy"] = "OnFailure"
    goes_on = await _exit_and_see_step_7(node, web, "worker", 0, ProbeKind.LIVENESS)
    assert goes_on is not kubelet.gate("ContainerRestartRules")


@pytest.mark.parametrize(
    ("kubelet", "goes_on"),
    [
        (KubeletProfile.parse("1.35"), False),
        (KubeletProfile.parse("1.35", "RestartAllContainersOnContainerExits=true"), True),
        (KubeletProfile.parse("1.36"), True),
        (KubeletProfile.parse("1.36", "RestartAllContainersOnContainerExits=false"), False),
    ],
    ids=["1.35", "1.35-gate-on", "1.36", "1.36-gate-off"],
)
async def test_kep5532_an_exit_that_restarts_every_container_keeps_the_worker(
    node: Node, kubelet: KubeletProfile, goes_on: bool
) -> None:
    """worker.go doProbe (release-1.35): with RestartAllContainersOnContainerExits on (beta in
    1.36), an exit whose rule says RestartAllContainers will be followed by new containers, so
    the worker goes on though the container's own policy (Never) would not restart it."""
    node.manager.set_kubelet(kubelet)
    web = _recorded("web-kd-node")
    [spec] = [c for c in web["spec"]["containers"] if c["name"] == "worker"]
    spec["restartPolicy"] = "Never"
    spec["restartPolicyRules"] = [
        {"action": "RestartAllContainers", "exitCodes": {"operator": "NotIn", "values": [0]}}
    ]
    assert await _exit_and_see_step_7(node, web, "worker", 3, ProbeKind.LIVENESS) is goes_on


@pytest.mark.parametrize(
    ("kubelet", "counted"),
    [
        (KubeletProfile.parse("1.34"), True),
        (KubeletProfile.parse("1.35"), False),
        (KubeletProfile.parse("1.36"), True),
        (KubeletProfile.parse("1.37"), True),
    ],
    ids=["1.34", "1.35", "1.36", "1.37"],
)
async def test_readiness_exec_during_termination_follows_the_release(
    node: Node, kubelet: KubeletProfile, counted: bool
) -> None:
    """Kubernetes #140881: kubelet 1.35 ran the probe workers on the pod sync's context, which
    the pod worker cancels at teardown (pod_workers.go, #130487), so an exec readiness probe of a
    terminating pod errored (context canceled) and was discarded; 1.36.0 and 1.37 (#140882)
    run it. Readiness keeps its last value under 1.35."""
    node.manager.set_kubelet(kubelet)
    web = _recorded("web-kd-node")
    [spec] = [c for c in web["spec"]["containers"] if c["name"] == "app"]
    for key in ("livenessProbe", "startupProbe"):
        spec.pop(key, None)
    spec["readinessProbe"] = {"exec": {"command": ["ready"]}, "periodSeconds": 600}
    sandbox = node.pod(web)
    app = node.runtime.add_container(sandbox, "app")
    node.list_pods(web)
    await node.relist()

    def readiness() -> ProbeState:
        [state] = [s for s in node.manager.probe_states(app.id) if s.kind is ProbeKind.READINESS]
        return state

    await node.watcher.until(lambda: len(readiness().history) >= 1)
    assert readiness().last_record is not None
    deleted = copy.deepcopy(web)
    deleted["metadata"]["deletionTimestamp"] = "2026-11-23T10:00:00Z"
    deleted["metadata"]["deletionGracePeriodSeconds"] = 20
    node.list_pods(deleted)
    # Attempts started from here on see the deletion (one started before may still finish).
    mark = time.time()

    def after_deletion() -> list[ProbeRecord]:
        return [r for r in readiness().history if r.started_at >= mark]

    node.manager.probe_now(app.id, ProbeKind.READINESS)
    await node.watcher.until(after_deletion)
    record = after_deletion()[0]
    assert (record.result != "error") is counted
    if not counted:
        assert "context canceled" in record.output
    assert node.manager.results.get(app.id, ProbeKind.READINESS) is Published.SUCCESS
