"""The kubelet's e2e probe scenarios (docs/kubelet-semantics.md §7) on real containerd, driving
workers.

Timings are shortened (initial delay 2 s, period 1 s, short container scripts). A small stand-in
for the kubelet keeps each container's status fresh from CRI, runs one worker per probe kind,
restarts the container (a new attempt) when liveness or startup publishes Failure, and triggers
readiness when startup succeeds — the parts of the kubelet these scenarios exercise.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from cri_prober.probing.outcome import ProbeOutcome
from cri_prober.probing.prober import Prober, ProbeTarget
from cri_prober.probing.results import ProbeRecord, Published, ResultsStore, ResultUpdate
from cri_prober.probing.spec import Probe, ProbeKind, parse_probe
from cri_prober.probing.worker import ContainerView, ProbeWorker
from cri_prober.runtime.client import CriClient
from cri_prober.runtime.model import ContainerState, ContainerStatus
from tests.support.testbed import ContainerSpec, Pod, PodFactory, Testbed

# A window long enough for several 1-second periods after the 2-second initial delay, used only
# where a scenario asserts that something does NOT happen.
QUIET_WINDOW = 8.0
RESTART_TIMEOUT = 20.0


def probe(kind: ProbeKind, **spec: Any) -> Probe:
    """A probe with the scenario defaults (delay 2, period 1) plus ``spec``."""
    return parse_probe(
        {"initialDelaySeconds": 2, "periodSeconds": 1, **spec}, kind=kind, path=kind.field_name
    )


def exec_probe(kind: ProbeKind, command: list[str], **spec: Any) -> Probe:
    return probe(kind, exec={"command": command}, **spec)


class MiniKubelet:
    """Just enough kubelet around the real workers to run the e2e scenarios."""

    def __init__(
        self,
        pods: PodFactory,
        cri: CriClient,
        pod: Pod,
        name: str,
        probes: Mapping[ProbeKind, Probe],
    ) -> None:
        self.pods = pods
        self.cri = cri
        self.pod = pod
        self.name = name
        self.probes = probes
        # The store is a plain cache: the workers report changes to this kubelet (their observer).
        self.results = ResultsStore()
        self.prober = Prober(cri)
        self.status: ContainerStatus | None = None
        self.env: Mapping[str, str] | None = None
        self.restarts = 0
        self.restarted = asyncio.Event()
        self.readiness_seen: list[Published] = []
        self.workers = {
            kind: ProbeWorker(
                kind,
                spec,
                status=self._view,
                run_probe=self._runner(spec),
                results=self.results,
                prober_started_at=time.time() - 3600,  # no start-up jitter
                observer=self,
                name=f"{pod.name}/{name}:{kind.value}",
            )
            for kind, spec in probes.items()
        }
        self._tasks: list[asyncio.Task[None]] = []
        self._restarting = False

    @property
    def container_id(self) -> str:
        return self.pod.container_ids[self.name]

    def _runner(self, spec: Probe) -> Any:
        async def run(view: ContainerView) -> ProbeOutcome:
            target = ProbeTarget(view.id, host_network=True, env=self.env)
            return await self.prober.run(spec, target)

        return run

    def _started(self, container_id: str) -> bool:
        if ProbeKind.STARTUP not in self.workers:
            return True
        return self.results.get(container_id, ProbeKind.STARTUP) is Published.SUCCESS

    def _view(self) -> ContainerView | None:
        status = self.status
        if status is None:
            return None
        running = status.state is ContainerState.CONTAINER_RUNNING
        return ContainerView(
            id=status.id,
            running=running,
            started_at=status.started_at / 1e9,
            started=running and self._started(status.id),
            terminated=status.state is ContainerState.CONTAINER_EXITED,
        )

    # -- the workers' observer (WorkerObserver) ---------------------------------------------------

    def attempt_finished(self, worker: ProbeWorker, record: ProbeRecord) -> None:
        pass

    def result_changed(self, worker: ProbeWorker, update: ResultUpdate) -> None:
        self._on_update(update)

    def worker_stopped(self, worker: ProbeWorker) -> None:
        pass

    def _on_update(self, update: ResultUpdate) -> None:
        if update.kind is ProbeKind.READINESS:
            self.readiness_seen.append(update.result)
        if update.container_id != self.container_id or update.result is not Published.FAILURE:
            if update.kind is ProbeKind.STARTUP and update.result is Published.SUCCESS:
                readiness = self.workers.get(ProbeKind.READINESS)
                if readiness is not None:
                    readiness.trigger()  # the kubelet's manual readiness trigger (§3.8)
            return
        if update.kind in (ProbeKind.LIVENESS, ProbeKind.STARTUP) and not self._restarting:
            self._restarting = True
            self._tasks.append(asyncio.create_task(self._restart()))

    async def _restart(self) -> None:
        self.pod = await self.pods.restart_container(self.pod, self.name)
        await self._refresh()
        self.restarts += 1
        self._restarting = False
        self.restarted.set()

    async def _refresh(self) -> None:
        status = await self.cri.container_status(self.container_id, verbose=True)
        if status.env is not None:
            self.env = status.env
        self.status = status

    async def _refresher(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self._refresh()
            await asyncio.sleep(0.2)

    async def __aenter__(self) -> MiniKubelet:
        await self._refresh()
        self._tasks.append(asyncio.create_task(self._refresher()))
        self._tasks.extend(asyncio.create_task(w.run()) for w in self.workers.values())
        return self

    async def __aexit__(self, *exc: object) -> None:
        for worker in self.workers.values():
            worker.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def wait_for_restart(self, timeout: float = RESTART_TIMEOUT) -> None:
        await asyncio.wait_for(self.restarted.wait(), timeout)

    def probes_run(self, kind: ProbeKind) -> int:
        return self.workers[kind].probes_run


@pytest.fixture(name="cri")
async def _cri(testbed_16: Testbed) -> AsyncIterator[CriClient]:
    async with CriClient.connect(testbed_16.endpoint) as client:
        yield client


async def start(
    pods: PodFactory, cri: CriClient, script: str, probes: Mapping[ProbeKind, Probe]
) -> MiniKubelet:
    pod = await pods.create_pod(
        "e2e", containers=[ContainerSpec("app", command=["sh", "-c", script])]
    )
    return MiniKubelet(pods, cri, pod, "app", probes)


async def test_3_restarted_with_exec_cat_health_liveness(
    pods_16: PodFactory, cri: CriClient
) -> None:
    """#3: liveness `cat /tmp/health` restarts the container once the file is deleted."""
    spec = exec_probe(
        ProbeKind.LIVENESS, ["cat", "/tmp/health"], timeoutSeconds=5, failureThreshold=1
    )
    kubelet = await start(
        pods_16,
        cri,
        "echo ok > /tmp/health; sleep 3; rm -f /tmp/health; sleep 600",
        {ProbeKind.LIVENESS: spec},
    )
    async with kubelet:
        await kubelet.wait_for_restart()
    assert kubelet.restarts >= 1
    assert kubelet.pod.containers["app"].attempt >= 1


async def test_4_not_restarted_with_exec_cat_health_liveness(
    pods_16: PodFactory, cri: CriClient
) -> None:
    """#4: the same probe with the file kept never restarts the container."""
    spec = exec_probe(
        ProbeKind.LIVENESS, ["cat", "/tmp/health"], timeoutSeconds=5, failureThreshold=1
    )
    kubelet = await start(
        pods_16, cri, "echo ok > /tmp/health; sleep 600", {ProbeKind.LIVENESS: spec}
    )
    async with kubelet:
        await asyncio.sleep(QUIET_WINDOW)
    assert kubelet.restarts == 0
    assert kubelet.probes_run(ProbeKind.LIVENESS) >= 3
    history = kubelet.workers[ProbeKind.LIVENESS].history
    assert {record.result for record in history} == {"success"}


async def test_9_restarted_by_exec_liveness_timeout(pods_16: PodFactory, cri: CriClient) -> None:
    """#9: an exec liveness probe that times out counts as a failure and restarts."""
    spec = exec_probe(
        ProbeKind.LIVENESS, ["sh", "-c", "sleep 10"], timeoutSeconds=1, failureThreshold=1
    )
    kubelet = await start(pods_16, cri, "sleep 600", {ProbeKind.LIVENESS: spec})
    async with kubelet:
        await kubelet.wait_for_restart()
    record = kubelet.workers[ProbeKind.LIVENESS].history[0]
    assert (record.result, record.output) == (
        "failure",
        'command timed out: "sh -c sleep 10" timed out after 1s',
    )


async def test_10_not_ready_with_exec_readiness_timeout(
    pods_16: PodFactory, cri: CriClient
) -> None:
    """#10: a readiness probe that times out keeps the container not ready."""
    spec = exec_probe(
        ProbeKind.READINESS, ["sh", "-c", "sleep 10"], timeoutSeconds=1, failureThreshold=1
    )
    kubelet = await start(pods_16, cri, "sleep 600", {ProbeKind.READINESS: spec})
    async with kubelet:
        await asyncio.sleep(QUIET_WINDOW)
        assert kubelet.results.get(kubelet.container_id, ProbeKind.READINESS) is Published.FAILURE
    assert kubelet.probes_run(ProbeKind.READINESS) >= 2
    assert Published.SUCCESS not in kubelet.readiness_seen


async def test_11_restarted_by_failing_exec_that_outlives_timeout(
    pods_16: PodFactory, cri: CriClient
) -> None:
    """#11: `sleep 10 & exit 1` fails (non-zero or timeout) and restarts the container."""
    spec = exec_probe(
        ProbeKind.LIVENESS, ["sh", "-c", "sleep 10 & exit 1"], timeoutSeconds=1, failureThreshold=1
    )
    kubelet = await start(pods_16, cri, "sleep 600", {ProbeKind.LIVENESS: spec})
    async with kubelet:
        await kubelet.wait_for_restart()
    assert kubelet.workers[ProbeKind.LIVENESS].history[0].result == "failure"


async def test_14_restarted_when_startup_probe_fails(pods_16: PodFactory, cri: CriClient) -> None:
    """#14: a failing startup probe (F=3) restarts the container; liveness never ran."""
    probes = {
        ProbeKind.LIVENESS: exec_probe(ProbeKind.LIVENESS, ["/bin/true"], failureThreshold=1),
        ProbeKind.STARTUP: exec_probe(ProbeKind.STARTUP, ["/bin/false"], failureThreshold=3),
    }
    kubelet = await start(pods_16, cri, "sleep 600", probes)
    async with kubelet:
        await kubelet.wait_for_restart()
    assert kubelet.probes_run(ProbeKind.STARTUP) >= 3
    assert kubelet.probes_run(ProbeKind.LIVENESS) == 0


async def test_15_startup_probe_delays_liveness(pods_16: PodFactory, cri: CriClient) -> None:
    """#15: with startup still failing (F=60), a failing liveness probe never runs."""
    probes = {
        ProbeKind.LIVENESS: exec_probe(ProbeKind.LIVENESS, ["/bin/false"], failureThreshold=1),
        ProbeKind.STARTUP: exec_probe(ProbeKind.STARTUP, ["/bin/false"], failureThreshold=60),
    }
    kubelet = await start(pods_16, cri, "sleep 600", probes)
    async with kubelet:
        await asyncio.sleep(QUIET_WINDOW)
    assert kubelet.restarts == 0
    assert kubelet.probes_run(ProbeKind.STARTUP) >= 3
    assert kubelet.probes_run(ProbeKind.LIVENESS) == 0


async def test_16_liveness_enabled_after_startup_succeeds(
    pods_16: PodFactory, cri: CriClient
) -> None:
    """#16: once startup passes, the failing liveness probe runs and restarts the container."""
    probes = {
        ProbeKind.LIVENESS: exec_probe(ProbeKind.LIVENESS, ["/bin/false"], failureThreshold=1),
        ProbeKind.STARTUP: exec_probe(
            ProbeKind.STARTUP, ["cat", "/tmp/startup"], failureThreshold=60
        ),
    }
    kubelet = await start(pods_16, cri, "sleep 3; touch /tmp/startup; sleep 600", probes)
    async with kubelet:
        await kubelet.wait_for_restart()
    startup, liveness = kubelet.workers[ProbeKind.STARTUP], kubelet.workers[ProbeKind.LIVENESS]
    first_container = startup.history[0].container_id
    startup_success = [
        r for r in startup.history if r.container_id == first_container and r.result == "success"
    ]
    assert startup_success, "startup must have passed before liveness ran"
    assert liveness.history[0].result == "failure"
    assert liveness.history[0].started_at >= startup_success[0].started_at
