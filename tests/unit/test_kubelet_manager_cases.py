"""The kubelet's ``prober_manager_test.go``, row by row, against the real ``ProbeManager``.

Every test names the upstream test (and row) it mirrors; /tmp/kubelet-cases.md §2 is the spec.
The manager runs on the in-process fake CRI runtime, with probes from a rules file (cri-prober
takes probes from rules, not from the pod spec). Kubelet calls map as follows:

* ``AddPod(pod)`` → the pod's sandbox and containers appear in the runtime, then a relist;
* ``RemovePod(pod)`` → the sandbox is removed, then a relist;
* ``CleanupPods(desired)`` → ``reconcile(containers of the desired pods)``;
* a worker key ``{podUID, containerName, probeType}`` → ``(pod UID, container name, kind)`` for
  every active probe of ``manager.probed()``;
* ``waitForWorkerExit`` → the manager's ``WorkerStopped`` events;
* ``UpdatePodStatus``'s ``Started``/``Ready`` → ``container_health(info).started/.ready``;
* ``resultsManager.Set`` → ``manager.results.set``.

CRI shows neither init containers nor restartPolicy: a restartable init container (sidecar) is
written as a regular container of the pod, and rows that need a non-restartable init container
are left out (listed in /tmp/kubelet-map-worker-manager.md).

Every case runs for kubelet 1.28 and 1.37 (the manager's workers follow the release: docs/
kubelet-fidelity.md, "Kubelet releases"); rows that differ say for which release.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence

import grpc
import pytest

from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.discovery.model import ContainerInfo
from cri_prober.discovery.pleg import Discovery
from cri_prober.errors import ConfigError
from cri_prober.manager import pod_sync
from cri_prober.manager.events import WorkerStopped
from cri_prober.manager.memory import Remembered
from cri_prober.manager.probe_manager import ProbeManager
from cri_prober.manager.slots import SlotTable
from cri_prober.manager.state import Health
from cri_prober.manager.status import StatusModel
from cri_prober.probing.handlers.exec import PreparedExec
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.kubelet_profile import KubeletProfile
from cri_prober.probing.outcome import ProbeOutcome, ProbeResult
from cri_prober.probing.prober import Prober
from cri_prober.probing.results import Published, ResultsStore
from cri_prober.probing.spec import RulesFile, load_rules
from cri_prober.runtime.client import CriClient
from cri_prober.runtime.model import ExecResult
from tests.support.fake_runtime import FakeContainer, FakeRuntime
from tests.support.memory_cri import memory_client
from tests.support.waiting import HANG_GUARD
from tests.support.watchers import ManagerWatcher

L, R, S = ProbeKind.LIVENESS, ProbeKind.READINESS, ProbeKind.STARTUP
# prober_manager_test.go defaultProbe: Exec, Timeout 1, Period 1, SuccessThreshold 1,
# FailureThreshold 3 (flow style, for a rules file).
DEFAULT_PROBE = (
    "{exec: {command: [check]}, timeoutSeconds: 1, periodSeconds: 1, "
    "successThreshold: 1, failureThreshold: 3}"
)
# A probe that, once its first step is done, would not run again for 10 minutes.
IDLE_PROBE = "{exec: {command: [check]}, periodSeconds: 600, failureThreshold: 1}"

Key = tuple[str, str, ProbeKind]


def rules_for(entries: Iterable[tuple[str, ProbeKind, str]]) -> RulesFile:
    """A rules file with one rule per (container name, kind, flow-style probe)."""
    lines = ["probes:"]
    for container, kind, probe in entries:
        lines.append(f"  - match: {{container: {container}}}")
        lines.append(f"    {kind.field_name}: {probe}")
    if len(lines) == 1:
        lines = ["probes: []"]
    return load_rules("\n".join(lines) + "\n", source="rules.yaml")


class GatedStopper:
    """The manager's stopper: records every stop, can hold it in flight, then calls CRI."""

    def __init__(self, cri: CriClient, manager: Callable[[], ProbeManager]) -> None:
        self._cri = cri
        self._manager = manager
        self.gate = asyncio.Event()
        self.gate.set()
        self.entered = asyncio.Event()
        # (container ID, grace, liveness result when the stop began, monotonic start)
        self.calls: list[tuple[str, int, Published | None, float]] = []
        self.failed_at: list[float] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def exec_sync(self, container_id: str, cmd: Sequence[str], *, timeout: int) -> ExecResult:
        """ExecSync for a preStop hook (none here): straight to CRI."""
        return await self._cri.exec_sync(container_id, cmd, timeout=timeout)

    async def stop_container(self, container_id: str, *, grace_seconds: int) -> None:
        live = self._manager().results.get(container_id, L)
        self.calls.append((container_id, grace_seconds, live, time.monotonic()))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.entered.set()
        try:
            await self.gate.wait()
            await self._cri.stop_container(container_id, grace_seconds=grace_seconds)
        except Exception:
            self.failed_at.append(time.monotonic())
            raise
        finally:
            self.in_flight -= 1


class World:
    """A fake runtime, a discovery over it and a stop-mode manager reconciled on every relist."""

    def __init__(
        self, runtime: FakeRuntime, cri: CriClient, kubelet: KubeletProfile | None = None
    ) -> None:
        self.runtime = runtime
        self.cri = cri
        self.discovery = Discovery(cri)
        self.stopper = GatedStopper(cri, lambda: self.manager)
        self.manager = ProbeManager(
            prober=Prober(cri),
            rules=rules_for([]),
            # Older than every pod: no start-up jitter and no pod-admission grid, so every
            # worker makes its first step at once.
            prober_started_at=time.time() - 1000,
            on_failure="stop",
            stopper=self.stopper,
            kubelet=kubelet,
        )
        self.watcher = ManagerWatcher(self.manager)
        self.exit_codes: dict[str, int] = {}  # container name -> exec exit code
        self.scripts: dict[str, deque[int]] = defaultdict(deque)  # command -> next exit codes
        self.gates: dict[str, asyncio.Event] = {}  # command -> answer only once set
        self.execs: list[tuple[str, str]] = []  # (container name, command) per ExecSync

    async def exec_handler(
        self, container: FakeContainer, cmd: list[str], _timeout: int
    ) -> api_pb2.ExecSyncResponse:
        self.execs.append((container.name, cmd[0]))
        gate = self.gates.get(cmd[0])
        if gate is not None:
            await gate.wait()
        script = self.scripts[cmd[0]]
        code = script.popleft() if script else self.exit_codes.get(container.name, 0)
        return api_pb2.ExecSyncResponse(exit_code=code)

    def add_pod(
        self,
        name: str,
        uid: str,
        containers: Iterable[str],
        *,
        exited: Iterable[str] = (),
    ) -> dict[str, FakeContainer]:
        """``AddPod``: a ready sandbox with this UID, created before the prober started."""
        sandbox = self.runtime.add_sandbox(name)
        sandbox.uid = uid
        sandbox.created_at = time.time_ns() - 2000 * 10**9
        made = {c: self.runtime.add_container(sandbox, c) for c in containers}
        for c in exited:
            made[c] = self.runtime.add_container(sandbox, c, state=api_pb2.CONTAINER_EXITED)
        return made

    def remove_pod(self, uid: str) -> None:
        """``RemovePod``: the pod's sandbox and containers are gone from the runtime."""
        for sandbox in [s for s in self.runtime.sandboxes.values() if s.uid == uid]:
            self.runtime.remove_sandbox(sandbox.id)

    async def relist(self) -> None:
        events = await self.discovery.relist()
        self.manager.on_lifecycle(events, self.discovery.containers().values())

    def info(self, container_id: str) -> ContainerInfo:
        return self.discovery.containers()[container_id]

    def health(self, container_id: str) -> Health:
        return self.manager.container_health(self.info(container_id))

    def keys(self) -> set[Key]:
        """``expectProbes``: the keys of every live worker."""
        return {
            (probed.container.pod.uid, probed.container.name, state.kind)
            for probed in self.manager.probed()
            for state in probed.probes
            if state.active
        }

    async def exited(self, count: int, since: int) -> list[WorkerStopped]:
        """``waitForWorkerExit``: ``count`` workers ended (unregistered and cleaned up) after the
        first ``since`` the manager reported; returns them."""
        await self.watcher.until(lambda: len(self.watcher.stopped) >= since + count, 10)
        return self.watcher.stopped[since:]

    def attempts(self, kind: ProbeKind) -> list[str]:
        """The result of every attempt of this kind the manager reported, oldest first."""
        return [e.record.result for e in self.watcher.records if e.kind is kind]


RELEASES = [KubeletProfile.parse("1.28"), KubeletProfile.parse("1.37")]


@pytest.fixture(name="world", params=RELEASES, ids=[r.version for r in RELEASES])
async def _world(request: pytest.FixtureRequest) -> AsyncIterator[World]:
    runtime = FakeRuntime()
    async with memory_client(runtime) as cri:
        world = World(runtime, cri, request.param)
        runtime.exec_handler = world.exec_handler
        try:
            yield world
        finally:
            world.stopper.gate.set()
            for gate in world.gates.values():
                gate.set()
            await world.manager.shutdown(grace=2)


# -- TestAddRemovePods -----------------------------------------------------------------------------


async def test_add_remove_pods(world: World) -> None:
    """prober_manager_test.go TestAddRemovePods: start → none; AddPod(no probes) → none;
    AddPod(probe_pod) → exactly readiness/R, liveness/L, startup/S; RemovePod(no probes) →
    unchanged; RemovePod(probe_pod) → none once the workers exit; RemovePod again → none."""
    world.manager.rules = rules_for(
        [
            ("readiness", R, DEFAULT_PROBE),
            ("liveness", L, DEFAULT_PROBE),
            ("startup", S, DEFAULT_PROBE),
        ]
    )
    assert world.keys() == set()  # 1. start

    world.add_pod("no_probe_pod", "no_probe_pod", ["no_probe1", "no_probe2", "no_probe3"])
    await world.relist()
    assert world.keys() == set()  # 2. AddPod(noProbePod)

    world.add_pod(
        "probe_pod",
        "probe_pod",
        ["probe1", "readiness", "probe2", "liveness", "probe3", "startup"],
    )
    await world.relist()
    probe_keys = {
        ("probe_pod", "readiness", R),
        ("probe_pod", "liveness", L),
        ("probe_pod", "startup", S),
    }
    assert world.keys() == probe_keys  # 3. AddPod(probePod)

    world.remove_pod("no_probe_pod")
    await world.relist()
    assert world.keys() == probe_keys  # 4. RemovePod(noProbePod)

    since = len(world.watcher.stopped)
    world.remove_pod("probe_pod")
    await world.relist()
    await world.exited(3, since)
    assert world.keys() == set()  # 5. RemovePod(probePod)
    assert world.manager.worker_count() == 0
    assert len(world.manager.results) == 0

    world.remove_pod("probe_pod")
    await world.relist()
    assert world.keys() == set()  # 6. RemovePod(probePod) again


async def test_add_remove_pods_with_restartable_init_container(world: World) -> None:
    """prober_manager_test.go TestAddRemovePodsWithRestartableInitContainer, case "pod with
    sidecar" (RestartPolicy Always): only restartable-init gets L, R, S workers; RemovePod →
    none; RemovePod again → none.

    Limit: CRI has no init containers, so the completed ``init`` is an exited container and the
    sidecar a running one of the same pod; their probes come from rules. The case "pod without
    sidecar" (an init container with probes but no RestartPolicy gets no workers) is left out:
    nothing in CRI tells a non-restartable init container from a regular one.
    """
    world.manager.rules = rules_for(
        [("restartable-init", kind, DEFAULT_PROBE) for kind in (L, R, S)]
    )
    uid = "restartable_init_container_pod"
    world.add_pod(uid, uid, ["restartable-init", "main"], exited=["init"])
    await world.relist()
    assert world.keys() == {(uid, "restartable-init", kind) for kind in (L, R, S)}

    since = len(world.watcher.stopped)
    world.remove_pod(uid)
    await world.relist()
    await world.exited(3, since)
    assert world.keys() == set()
    world.remove_pod(uid)
    await world.relist()
    assert world.keys() == set()


# -- TestCleanupPods / TestCleanupRepeated ---------------------------------------------------------


async def test_cleanup_pods(world: World) -> None:
    """prober_manager_test.go TestCleanupPods: pod_cleanup and pod_keep each with prober1 (R),
    prober2 (L), prober3 (S); CleanupPods({pod_keep}) → pod_cleanup's 3 workers exit, exactly
    pod_keep's 3 remain."""
    world.manager.rules = rules_for(
        [
            ("prober1", R, DEFAULT_PROBE),
            ("prober2", L, DEFAULT_PROBE),
            ("prober3", S, DEFAULT_PROBE),
        ]
    )
    for uid in ("pod_cleanup", "pod_keep"):
        world.add_pod(uid, uid, ["prober1", "prober2", "prober3"])
    await world.relist()
    assert len(world.keys()) == 6
    since = len(world.watcher.stopped)

    desired = [c for c in world.discovery.containers().values() if c.pod.uid == "pod_keep"]
    world.manager.reconcile(desired)
    stopped = await world.exited(3, since)
    assert {e.container.pod.uid for e in stopped} == {"pod_cleanup"}
    assert world.keys() == {
        ("pod_keep", "prober1", R),
        ("pod_keep", "prober2", L),
        ("pod_keep", "prober3", S),
    }


async def test_cleanup_repeated(world: World) -> None:
    """prober_manager_test.go TestCleanupRepeated: 100 pods with prober1 (R, L, S) = 300
    workers; CleanupPods({}) 10 times must not deadlock or fail; every worker then exits."""
    world.manager.rules = rules_for([("prober1", kind, DEFAULT_PROBE) for kind in (L, R, S)])
    for i in range(100):
        world.add_pod(f"pod{i}", str(i), ["prober1"])
    await world.relist()
    assert world.manager.worker_count() == 300
    since = len(world.watcher.stopped)
    for _ in range(10):
        world.manager.reconcile([])
    await world.exited(300, since)
    assert world.keys() == set()
    assert world.manager.worker_count() == 0
    assert len(world.manager.results) == 0


# -- TestUpdatePodStatus ---------------------------------------------------------------------------

UPDATE_POD_STATUS_ROWS = [
    # (container, workers, cached results, expected started, expected ready)
    ("unprobed_container", [L], {}, True, True),
    ("probed_container_ready", [R], {R: Published.SUCCESS}, True, True),
    ("probed_container_pending", [R], {}, True, False),
    ("probed_container_unready", [R], {R: Published.FAILURE}, True, False),
    ("not_started_container_no_readiness", [S], {}, False, False),
    ("started_container_no_readiness", [S], {S: Published.SUCCESS}, True, True),
    ("terminated_container", [R], {R: Published.SUCCESS}, False, False),
]


@pytest.mark.parametrize(
    ("container", "expect_started", "expect_ready"),
    [(row[0], row[3], row[4]) for row in UPDATE_POD_STATUS_ROWS],
    ids=[row[0] for row in UPDATE_POD_STATUS_ROWS],
)
async def test_update_pod_status(
    world: World, container: str, expect_started: bool, expect_ready: bool
) -> None:
    """prober_manager_test.go TestUpdatePodStatus, one container of the table.

    As upstream, the workers exist but have not run and the cached results are set by hand;
    Started/Ready are then read at once (upstream asserts Ready only; Started is what
    UpdatePodStatus derives on the way). terminated_container is an exited container whose
    readiness cache still says Success.
    """
    world.manager.rules = rules_for(
        [(name, kind, IDLE_PROBE) for name, kinds, *_ in UPDATE_POD_STATUS_ROWS for kind in kinds]
    )
    names = [row[0] for row in UPDATE_POD_STATUS_ROWS]
    made = world.add_pod(
        "test_pod",
        "test_pod",
        [n for n in names if n != "terminated_container"],
        exited=["terminated_container"],
    )
    await world.relist()
    # No await from here on: no worker has stepped yet, as with upstream's fake workers.
    for name, kinds, cached, *_ in UPDATE_POD_STATUS_ROWS:
        probed = world.manager.probed_container(made[name].id)
        assert probed is not None
        assert {state.kind for state in probed.probes if state.active} == set(kinds), name
        assert all(state.attempts == 0 and state.published is None for state in probed.probes), name
        for kind, result in cached.items():
            world.manager.results.set(made[name].id, kind, result)
    health = world.health(made[container].id)
    assert health.started is expect_started
    assert health.ready is expect_ready


async def test_update_pod_status_unready_sync_triggers_readiness(world: World) -> None:
    """prober_manager_test.go TestUpdatePodStatus, the trigger of probed_container_pending /
    probed_container_unready: a sync of a started, running container whose readiness result is
    not Success triggers its readiness worker.

    Upstream's fake worker drops the trigger (nil channel) and asserts only Ready; here the
    worker is real. Readiness fails (F=1, period 600 s): its first step, plus the one the
    initial value's sync triggers, leave it idle at Failure. Then a plain pod sync (a PLEG event
    would do the same) must make it probe at once.
    """
    world.manager.rules = rules_for([("probed_container_unready", R, IDLE_PROBE)])
    world.exit_codes["probed_container_unready"] = 1
    made = world.add_pod("test_pod", "test_pod", ["probed_container_unready"])
    cid = made["probed_container_unready"].id
    await world.relist()
    await world.watcher.until(lambda: world.attempts(R) == ["failure", "failure"])
    assert world.manager.results.get(cid, R) is Published.FAILURE
    assert not world.health(cid).ready

    world.exit_codes["probed_container_unready"] = 0
    world.manager.request_sync("test_pod")
    await world.watcher.until(lambda: world.health(cid).ready)
    assert world.attempts(R) == ["failure", "failure", "success"]


# -- TestUpdatePodStatusWithInitContainers ---------------------------------------------------------


@pytest.mark.parametrize(
    ("container", "expect_started", "expect_ready"),
    [
        ("not_started_container", False, False),
        ("started_container", True, True),
        ("terminated_container", False, False),
    ],
)
async def test_update_pod_status_with_init_containers_sidecar(
    world: World, container: str, expect_started: bool, expect_ready: bool
) -> None:
    """prober_manager_test.go TestUpdatePodStatusWithInitContainers, case "init container with
    Always restartPolicy": not_started F/F, started T/T (no readiness worker), terminated F/F.

    Limit: the sidecars are regular containers here (CRI has no init containers). The case
    "init containers" (RestartPolicy nil: Ready only when terminated with exit 0, never for a
    running one) is left out: CRI cannot tell a non-restartable init container apart.
    """
    world.manager.rules = rules_for(
        [("not_started_container", S, IDLE_PROBE), ("started_container", S, IDLE_PROBE)]
    )
    made = world.add_pod(
        "test_pod",
        "test_pod",
        ["not_started_container", "started_container"],
        exited=["terminated_container"],
    )
    await world.relist()
    # No await from here on: the startup workers exist but have not run.
    world.manager.results.set(made["started_container"].id, S, Published.SUCCESS)
    health = world.health(made[container].id)
    assert health.started is expect_started
    assert health.ready is expect_ready


# -- TestUpdateReadiness ---------------------------------------------------------------------------


async def test_update_readiness(world: World) -> None:
    """prober_manager_test.go TestUpdateReadiness: a real readiness worker (Period 1, thresholds
    1), exec Success → Ready; exec Failure → not Ready."""
    world.manager.rules = rules_for(
        [("cOnTaInEr_NaMe", R, "{exec: {command: [check]}, periodSeconds: 1}")]
    )
    made = world.add_pod("testPod", "pOd_UiD", ["cOnTaInEr_NaMe"])
    cid = made["cOnTaInEr_NaMe"].id
    await world.relist()
    assert world.keys() == {("pOd_UiD", "cOnTaInEr_NaMe", R)}
    await world.watcher.until(lambda: world.health(cid).ready)
    world.exit_codes["cOnTaInEr_NaMe"] = 1
    await world.watcher.until(lambda: not world.health(cid).ready)
    assert world.manager.results.get(cid, R) is Published.FAILURE


async def test_update_readiness_startup_success_triggers_readiness(world: World) -> None:
    """TestUpdateReadiness as the brief asks (no upstream test does it through the real manager,
    §2): startup Success → pod sync → UpdatePodStatus sees the container started → readiness
    triggered. Period 600 s for both: only the trigger explains the readiness probe."""
    world.manager.rules = rules_for(
        [
            ("app", S, "{exec: {command: [check-start]}, periodSeconds: 600, timeoutSeconds: 30}"),
            ("app", R, "{exec: {command: [check-ready]}, periodSeconds: 600}"),
        ]
    )
    world.gates["check-start"] = asyncio.Event()
    made = world.add_pod("web", "web", ["app"])
    cid = made["app"].id
    await world.relist()
    # The readiness worker made its first step: initial Failure, gated (not started), no probe.
    await world.watcher.until(
        lambda: (
            world.manager.results.get(cid, R) is Published.FAILURE
            and world.manager.results.get(cid, S) is Published.UNKNOWN
        )
    )
    assert world.attempts(R) == []
    assert not world.health(cid).started

    world.gates["check-start"].set()
    await world.watcher.until(lambda: world.health(cid).ready)
    assert world.manager.results.get(cid, S) is Published.SUCCESS
    assert world.attempts(R) == ["success"]
    assert [cmd for _, cmd in world.execs] == ["check-start", "check-ready"]


# -- §4 sync mechanics: readiness re-trigger, failed-kill retry ------------------------------------


async def test_readiness_failure_is_reprobed_at_once(world: World) -> None:
    """§4 "How readiness gets re-triggered": a readiness Failure published by the worker sends an
    update → handleProbeSync → UpdatePodStatus → manual trigger, so a one-off failure lasts about
    one probe. Period 600 s: only the trigger explains the attempt after the failure."""
    world.manager.rules = rules_for([("app", R, IDLE_PROBE)])
    made = world.add_pod("web", "web", ["app"])
    cid = made["app"].id
    await world.relist()
    # First step (Success), then the step the initial value's sync triggered: then idle.
    await world.watcher.until(lambda: world.attempts(R) == ["success", "success"])
    assert world.health(cid).ready

    world.scripts["check"].extend([1])  # the next attempt fails, later ones succeed
    world.manager.probe_now(cid, R)  # one attempt off schedule, as a person would ask
    await world.watcher.until(lambda: len(world.attempts(R)) >= 3)
    assert world.attempts(R)[2] == "failure"
    # until()'s guard (30 s) is far below the 600 s period: only the trigger can be in time.
    await world.watcher.until(lambda: world.health(cid).ready)
    assert world.attempts(R) == ["success", "success", "failure", "success"]
    transitions = [(t.previous, t.result) for t in world.watcher.transitions if t.kind is R]
    assert transitions == [
        (None, Published.FAILURE),
        (Published.FAILURE, Published.SUCCESS),
        (Published.SUCCESS, Published.FAILURE),
        (Published.FAILURE, Published.SUCCESS),
    ]


async def test_failed_stop_is_retried_on_later_sync(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """§5 "Retry" and "Blocking" (kuberuntime SyncPod + pod worker completeWork): with
    --on-failure stop, a StopContainer that fails is retried on a later sync (the back-off one)
    while liveness stays Failure; syncs that come while a stop is in flight start no second one.
    """
    monkeypatch.setattr(pod_sync, "RESYNC_TICK_SECONDS", 0.02)
    monkeypatch.setattr(pod_sync, "SYNC_BACKOFF_SECONDS", 0.1)
    syncs: list[str] = []
    synced = asyncio.Event()
    real_sync = world.manager.syncs.sync

    def counting_sync(pod_uid: str) -> None:
        syncs.append(pod_uid)
        synced.set()
        real_sync(pod_uid)

    monkeypatch.setattr(world.manager.syncs, "sync", counting_sync)
    # The back-offs scheduled, as (delay, the monotonic time it was asked for): the pod's next
    # sync is due no sooner than their sum (jitter only adds).
    backoffs: list[tuple[float, float]] = []
    real_schedule = world.manager.syncs.schedule

    def recording_schedule(pod_uid: str, delay: float | None = None) -> None:
        if delay is not None:
            backoffs.append((delay, time.monotonic()))
        real_schedule(pod_uid, delay)

    monkeypatch.setattr(world.manager.syncs, "schedule", recording_schedule)

    async def one_more_sync() -> None:
        count = len(syncs)
        async with asyncio.timeout(HANG_GUARD):
            while len(syncs) <= count:
                synced.clear()
                await synced.wait()

    liveness = (
        "{exec: {command: [check]}, periodSeconds: 600, failureThreshold: 1, "
        "terminationGracePeriodSeconds: 5}"
    )
    world.manager.rules = rules_for([("app", L, liveness)])
    world.exit_codes["app"] = 1
    world.runtime.fail_next("StopContainer", grpc.StatusCode.INTERNAL)
    world.stopper.gate.clear()
    made = world.add_pod("web", "web", ["app"])
    cid = made["app"].id
    await world.relist()

    # Liveness Failure → sync → stop #1, held in flight.
    await asyncio.wait_for(world.stopper.entered.wait(), HANG_GUARD)
    assert world.manager.results.get(cid, L) is Published.FAILURE
    for _ in range(3):  # syncs while the stop is in flight (probe/PLEG updates)
        world.manager.request_sync("web")
        await one_more_sync()
    assert len(world.stopper.calls) == 1

    # Stop #1 fails at the runtime; the back-off sync retries it, and it succeeds.
    world.stopper.gate.set()
    await asyncio.wait_for(world.runtime.container_stopped.wait(), HANG_GUARD)
    assert [(c[0], c[1], c[2]) for c in world.stopper.calls] == [
        (cid, 5, Published.FAILURE),
        (cid, 5, Published.FAILURE),
    ]
    assert world.stopper.max_in_flight == 1
    assert len(world.stopper.failed_at) == 1
    # The retry waited for the back-off the failure scheduled (its due time, as computed).
    assert [delay for delay, _ in backoffs] == [0.1]
    assert world.stopper.calls[1][3] >= backoffs[0][1] + backoffs[0][0]
    assert world.runtime.calls.count("StopContainer") == 2
    assert world.runtime.stop_requests == [(cid, 5)]
    assert world.runtime.containers[cid].state == api_pb2.CONTAINER_EXITED

    # Once the exit is seen, a sync stops nothing more.
    await world.relist()
    world.manager.request_sync("web")
    await one_more_sync()
    assert len(world.stopper.calls) == 2


# -- Kubelet restart state by release (KEP-4781, PR #141487) -------------------------------------


@pytest.mark.parametrize(
    ("version", "named", "replacement"),
    [
        ("1.28", False, False),
        ("1.34", False, False),
        ("1.35", True, True),
        ("1.36", True, True),
        ("1.37", True, False),
    ],
)
def test_kubelet_restart_keeps_the_state_of_the_container_the_previous_status_names(
    version: str, named: bool, replacement: bool
) -> None:
    """prober_manager.go setReadyStateOnKubeletRestart and worker.go isRestart: from 1.35
    (KEP-4781) a container that predates the kubelet keeps its ready/started; PR #141487
    (kubernetes #141473, in 1.37; cherry-picks to 1.35/1.36 open) keeps it only for the
    container the previous status names, so a replacement the runtime made while the kubelet
    was away starts from its initial values. cri-prober's previous status is its state file."""
    status = StatusModel(
        SlotTable(),
        ResultsStore(),
        prober_started_at=time.time(),
        remembered={"old": Remembered(started=True, ready=True)},
        kubelet=KubeletProfile.parse(version),
    )
    assert status.keeps_state("old") is named
    assert status.keeps_state("replacement") is replacement
    # A state file that named nothing (none, or the first start): nothing to check against.
    empty = StatusModel(
        SlotTable(), ResultsStore(), prober_started_at=0, kubelet=KubeletProfile.parse(version)
    )
    assert empty.keeps_state("replacement") is named


@pytest.mark.parametrize(
    ("gates", "published"),
    [("ExecProbeTimeout=false", None), ("", Published.FAILURE)],
    ids=["gate-off", "gate-on"],
)
async def test_exec_probe_timeout_gate(
    world: World, gates: str, published: Published | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pkg/probe/exec/exec.go (release-1.28): a timed-out exec is a Failure with
    ExecProbeTimeout on; off (settable until 1.34; locked on from 1.35) it is Unknown with the
    timeout error, which the worker discards as errored (retried, never counted)."""
    if world.manager.kubelet.at_least(35) and gates:
        # Locked on from 1.35: the setting is refused (serve exits 2), never silently ignored.
        with pytest.raises(ConfigError, match="locked to true"):
            KubeletProfile.parse(world.manager.kubelet.version, gates)
        return
    world.manager.set_kubelet(KubeletProfile.parse(world.manager.kubelet.version, gates))
    calls = 0

    async def timed_out(*_args: object, **_kwargs: object) -> ProbeOutcome:
        nonlocal calls
        calls += 1
        return ProbeOutcome(ProbeResult.FAILURE, "command timed out", timed_out=True)

    # The exec handler itself: workers send through a probe prepared once (issue 36), whose
    # exec is a PreparedExec (its expansion and request built once).
    monkeypatch.setattr(PreparedExec, "send", timed_out)
    world.manager.rules = rules_for([("app", L, IDLE_PROBE)])
    made = world.add_pod("web", "uid-web", ["app"])
    cid = made["app"].id
    await world.relist()
    await world.watcher.until(lambda: bool(world.watcher.records), 10)
    [record] = [e.record for e in world.watcher.records]
    assert record.result == ("error" if published is None else "failure")
    assert calls == (3 if published is None else 1)  # an errored attempt is tried 3 times
    assert world.manager.results.get(cid, L) is (published or Published.SUCCESS)
