"""The serve daemon on real containerd: reloads, failure actions and a containerd restart.

The daemon runs in-process (same loop as the test) so the test can watch its manager; signals are
real (SIGHUP is sent to this process, whose loop the daemon registered its handler on).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import tempfile
from pathlib import Path

import pytest

from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.daemon import Daemon
from cri_prober.manager.state import ProbedContainer, ProbeState
from cri_prober.probing.results import Published
from cri_prober.probing.spec import ProbeKind
from cri_prober.runtime.client import CriClient
from cri_prober.runtime.model import ContainerState
from tests.support.daemon import running_daemon
from tests.support.testbed import ContainerSpec, PodFactory, Testbed
from tests.support.watchers import ManagerWatcher

RULES = """
probes:
  - match: {namespace: default, pod: "serve-*", container: app}
    livenessProbe:
      exec: {command: [cat, /tmp/healthy]}
      periodSeconds: 1
      failureThreshold: 1
      terminationGracePeriodSeconds: 2
    readinessProbe:
      exec: {command: [cat, /tmp/ready]}
      periodSeconds: 1
"""
APP = ContainerSpec("app", command=["sh", "-c", "touch /tmp/healthy /tmp/ready; sleep 600"])


async def start_daemon(
    testbed: Testbed, rules_file: Path, **config: object
) -> tuple[Daemon, ManagerWatcher, contextlib.AsyncExitStack]:
    """The shared in-process daemon, relisting fast, for a test that stops it in ``finally``."""
    stack = contextlib.AsyncExitStack()
    daemon, watcher = await stack.enter_async_context(
        running_daemon(
            testbed.endpoint,
            rules_file,
            ready_timeout=20,
            stop_timeout=20,
            relist_period=0.3,
            **config,  # type: ignore[arg-type]
        )
    )
    return daemon, watcher, stack


async def stop_daemon(daemon: Daemon, stack: contextlib.AsyncExitStack) -> None:
    await stack.aclose()
    assert daemon.stop_event.is_set()


def probed_in(daemon: Daemon, pod: str) -> ProbedContainer | None:
    """The pod's probed container as it stands now (a snapshot)."""
    return next((p for p in daemon.manager.probed() if p.container.pod.name == pod), None)


def probe_of(daemon: Daemon, pod: str, kind: ProbeKind) -> ProbeState | None:
    """The pod's configured ``kind`` probe as it stands now, if any."""
    probed = probed_in(daemon, pod)
    return probed.probe(kind) if probed is not None else None


def running(daemon: Daemon, pod: str) -> dict[ProbeKind, int]:
    """The attempts of each running worker of the pod's container.

    The manager hands out no workers: a worker goes on if its kind stays here, its count never
    goes back (a new worker starts at 0) and no ``WorkerStopped`` is reported for it.
    """
    probed = probed_in(daemon, pod)
    assert probed is not None
    return {state.kind: state.attempts for state in probed.probes if state.active}


def assert_kept(before: dict[ProbeKind, int], now: dict[ProbeKind, int]) -> None:
    """The same workers run: none added or dropped, no count went back."""
    assert now.keys() == before.keys()
    assert all(now[kind] >= attempts for kind, attempts in before.items()), (before, now)


@pytest.fixture(name="rules_file")
def _rules_file(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(RULES)
    return path


async def test_sighup_reload_keeps_unchanged_and_survives_a_bad_file(
    testbed_16: Testbed, pods_16: PodFactory, rules_file: Path
) -> None:
    """SIGHUP: unchanged probes keep worker, task and counters; a bad file keeps the old set."""
    await pods_16.create_pod("serve-reload", containers=[APP])
    daemon, watcher, task = await start_daemon(testbed_16, rules_file)
    try:
        await watcher.until(
            lambda: (
                (s := probe_of(daemon, "serve-reload", ProbeKind.LIVENESS)) is not None
                and s.attempts >= 2
            )
        )
        before = running(daemon, "serve-reload")
        assert set(before) == {ProbeKind.LIVENESS, ProbeKind.READINESS}
        readiness = probe_of(daemon, "serve-reload", ProbeKind.READINESS)
        assert readiness is not None
        assert watcher.stopped == []

        # Change only readiness: liveness must be untouched.
        rules_file.write_text(RULES.replace("cat, /tmp/ready", "test, -f, /tmp/ready"))
        os.kill(os.getpid(), signal.SIGHUP)
        # A new readiness worker runs the new probe, and the old one stops, replaced.
        await watcher.until(
            lambda: (
                (s := probe_of(daemon, "serve-reload", ProbeKind.READINESS)) is not None
                and s.probe != readiness.probe
                and s.active
                and bool(watcher.stopped)
            )
        )
        [replaced] = watcher.stopped
        assert (replaced.kind, replaced.replaced) == (ProbeKind.READINESS, True)
        # Liveness keeps its worker (and task): it goes on counting and never stopped.
        liveness = probe_of(daemon, "serve-reload", ProbeKind.LIVENESS)
        assert liveness is not None
        assert liveness.active
        assert liveness.attempts >= before[ProbeKind.LIVENESS]

        # A broken file is reported and the running set is kept.
        workers = running(daemon, "serve-reload")
        stopped = len(watcher.stopped)
        rules_file.write_text(RULES.replace("periodSeconds: 1", "periodSeconds: -1", 1))
        assert not await daemon.reload()
        assert_kept(workers, running(daemon, "serve-reload"))
        assert watcher.stopped[stopped:] == []
    finally:
        await stop_daemon(daemon, task)
    assert daemon.manager.worker_count() == 0 or all(
        not s.active for p in daemon.manager.probed() for s in p.probes
    )


@pytest.mark.parametrize("on_failure", ["stop", "report"])
async def test_on_failure_action(
    testbed_16: Testbed, pods_16: PodFactory, rules_file: Path, on_failure: str
) -> None:
    """--on-failure stop stops a container whose liveness fails; report leaves it running."""
    pod = await pods_16.create_pod(f"serve-{on_failure}", containers=[APP])
    cid = pod.container_ids["app"]
    daemon, watcher, task = await start_daemon(testbed_16, rules_file, on_failure=on_failure)
    try:
        await watcher.until(
            lambda: (
                daemon.manager.results.get(cid, ProbeKind.LIVENESS) is Published.SUCCESS
                and (s := probe_of(daemon, pod.name, ProbeKind.LIVENESS)) is not None
                and s.attempts >= 1
            )
        )
        async with CriClient.connect(testbed_16.endpoint) as cri:
            await cri.exec_sync(cid, ["rm", "/tmp/healthy"], timeout=5)
            await watcher.until(
                lambda: daemon.manager.results.get(cid, ProbeKind.LIVENESS) is Published.FAILURE
            )
            if on_failure == "stop":
                status = await pods_16.wait_for_container_state(
                    cid, api_pb2.CONTAINER_EXITED, timeout=15
                )
                assert status is not None
            else:
                # Give a wrongly issued stop (grace 2 s) the time it would take to land.
                await asyncio.sleep(3)
                assert (await cri.container_status(cid)).state is ContainerState.CONTAINER_RUNNING
    finally:
        await stop_daemon(daemon, task)


async def test_survives_containerd_restart(rules_file: Path) -> None:
    """containerd killed and restarted: serve reconnects, relists and probes on, no duplicates."""
    with tempfile.TemporaryDirectory(prefix="cprb-restart-") as tmp:
        directory = Path(tmp) / "tb"
        testbed = Testbed.start(directory, version="1.6")
        try:
            async with testbed.pods() as pods:
                pod = await pods.create_pod("serve-restart", containers=[APP])
                cid = pod.container_ids["app"]
                daemon, watcher, task = await start_daemon(testbed, rules_file)
                try:
                    await watcher.until(
                        lambda: (
                            daemon.manager.results.get(cid, ProbeKind.READINESS)
                            is Published.SUCCESS
                        )
                    )
                    workers = running(daemon, pod.name)
                    stopped = len(watcher.stopped)

                    def readiness() -> ProbeState:
                        state = probe_of(daemon, pod.name, ProbeKind.READINESS)
                        assert state is not None
                        return state

                    os.kill(testbed.pid, signal.SIGKILL)
                    # While containerd is down the probes error (discarded), nothing is lost.
                    await watcher.until(
                        lambda: any(r.result == "error" for r in readiness().history)
                    )
                    restarted = await asyncio.to_thread(Testbed.start, directory, version="1.6")
                    assert restarted.pid != testbed.pid
                    testbed = restarted
                    runs = readiness().attempts
                    await watcher.until(
                        lambda: (
                            readiness().attempts >= runs + 2
                            and readiness().history[-1].result == "success"
                        )
                    )
                    assert daemon.manager.worker_count() == 2
                    # The same container, probed by the same workers: none stopped or restarted.
                    probed = probed_in(daemon, pod.name)
                    assert probed is not None
                    assert probed.container.id == cid
                    assert_kept(workers, running(daemon, pod.name))
                    assert watcher.stopped[stopped:] == []
                    assert daemon.manager.results.get(cid, ProbeKind.READINESS) is Published.SUCCESS
                finally:
                    await stop_daemon(daemon, task)
        finally:
            await asyncio.to_thread(testbed.stop)


NAMED_PORT_RULES = """
probes:
  - match: {namespace: default, pod: "named-*", container: web, labels: {tier: front}}
    ports: [{name: http, containerPort: 8080}]
    readinessProbe:
      httpGet: {path: /index.html, port: http}
      periodSeconds: 1
  - match: {namespace: default, pod: "named-*", container: web}
    livenessProbe:
      tcpSocket: {port: web-port}
      periodSeconds: 1
"""
HTTPD = ContainerSpec(
    "web",
    command=["sh", "-c", "echo ok > /www/index.html && exec httpd -f -p 8080 -h /www"],
    # The kubelet writes the container's ports here; named ports resolve from it too.
    annotations={
        "io.kubernetes.container.ports": json.dumps(
            [{"name": "web-port", "containerPort": 8080, "protocol": "TCP"}]
        )
    },
)


async def test_named_ports_over_the_pod_network(
    testbed_16: Testbed, pods_16: PodFactory, tmp_path: Path
) -> None:
    """httpGet via a rule's named port and tcpSocket via the kubelet's ports annotation, pod IP."""
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(NAMED_PORT_RULES)
    pod = await pods_16.create_pod(
        "named-ports", host_network=False, labels={"tier": "front"}, containers=[HTTPD]
    )
    assert pod.ip
    cid = pod.container_ids["web"]
    daemon, watcher, task = await start_daemon(testbed_16, rules_file)
    try:
        await watcher.until(
            lambda: (
                daemon.manager.results.get(cid, ProbeKind.READINESS) is Published.SUCCESS
                and (s := probe_of(daemon, "named-ports", ProbeKind.LIVENESS)) is not None
                and s.attempts >= 1
            )
        )
        probed = probed_in(daemon, "named-ports")
        assert probed is not None
        readiness_state = probed.probe(ProbeKind.READINESS)
        liveness_state = probed.probe(ProbeKind.LIVENESS)
        assert readiness_state is not None
        assert liveness_state is not None
        readiness = readiness_state.last_record
        liveness = liveness_state.last_record
        assert readiness is not None
        assert liveness is not None
        assert (readiness.result, readiness.http_status, readiness.output) == (
            "success",
            200,
            "ok\n",
        )
        assert liveness.result == "success"
        assert daemon.manager.container_health(probed.container).serving
    finally:
        await stop_daemon(daemon, task)
