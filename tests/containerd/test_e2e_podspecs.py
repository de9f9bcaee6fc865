"""serve --probes-from end to end on a real containerd: the pods' own probes, with no rules file.

The CRI pods carry what the kubelet's pods carry (its labels, the pod UID in the sandbox
metadata, the static pod name); the sources are a static pod directory, a kubelet /pods server
and an API server speaking the watch protocol (both local test servers). Deleting a pod stops
its liveness probing at once, while readiness goes on (the kubelet's StopLivenessAndStartup).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cri_prober.daemon import Daemon
from cri_prober.manager.events import AttemptFinished, ManagerEvent
from cri_prober.manager.state import ProbeState
from cri_prober.podspecs.options import PodSourceOptions, SourceSpec
from cri_prober.probing.results import Published
from cri_prober.probing.spec import ProbeKind
from tests.support.daemon import running_daemon
from tests.support.testbed import ContainerSpec, PodFactory, Testbed
from tests.support.waiting import HANG_GUARD
from tests.support.watchers import ManagerWatcher

pytestmark = pytest.mark.containerd(versions=("1.6", "2.1"))

NODE = "e2e-node"
# A window long enough for several 0.5 s liveness periods: none may start once it stopped.
QUIET_WINDOW = 2.0

# The pod as its author wrote it: a liveness and a readiness exec probe, the readiness one naming
# its file through $(VAR) from the spec's env (the runtime's env has no READY_FILE).
MANIFEST: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "web", "namespace": "default"},
    "spec": {
        "containers": [
            {
                "name": "app",
                "image": "busybox",
                "env": [{"name": "READY_FILE", "value": "/tmp/ready"}],
                "livenessProbe": {
                    "exec": {"command": ["cat", "/tmp/healthy"]},
                    "periodSeconds": 1,
                },
                "readinessProbe": {
                    "exec": {"command": ["cat", "$(READY_FILE)"]},
                    "periodSeconds": 1,
                },
            }
        ]
    },
}
APP = ContainerSpec("app", command=["sh", "-c", "touch /tmp/healthy /tmp/ready; sleep 600"])


class Attempts:
    """Counts attempts per (container, kind) as the manager reports them."""

    def __init__(self) -> None:
        self.times: dict[tuple[str, ProbeKind], list[float]] = {}

    def __call__(self, event: ManagerEvent) -> None:
        if isinstance(event, AttemptFinished):
            key = (event.record.container_id, event.kind)
            self.times.setdefault(key, []).append(time.monotonic())

    def count(self, container_id: str, kind: ProbeKind) -> int:
        return len(self.times.get((container_id, kind), []))


@contextlib.asynccontextmanager
async def podspec_node(
    testbed: Testbed, tmp_path: Path, source: SourceSpec, **options: Any
) -> AsyncIterator[tuple[Daemon, ManagerWatcher, Attempts]]:
    """An in-process serve with only ``source`` (no rules file), reading it every 0.2 s."""
    attempts = Attempts()
    async with running_daemon(
        testbed.endpoint,
        None,
        listen=f"unix://{tmp_path}/api.sock",
        state_file=None,
        ready_timeout=20,
        stop_timeout=20,
        relist_period=0.3,
        listeners=[attempts],
        probes_from=(source,),
        pod_sources=PodSourceOptions(node_name=NODE, interval=0.2, **options),
    ) as (daemon, watcher):
        daemon.manager.prober_started_at = time.time() - 3600
        yield daemon, watcher, attempts


def _worker(daemon: Daemon, container_id: str, kind: ProbeKind) -> ProbeState | None:
    """The container's ``kind`` probe if a worker runs it (the container still probed)."""
    probed = daemon.manager.probed_container(container_id)
    state = probed.probe(kind) if probed is not None else None
    return state if state is not None and state.has_worker else None


async def _probed_from_the_spec(
    daemon: Daemon, watcher: ManagerWatcher, container_id: str, source: str
) -> None:
    """Wait until the spec's probes run and readiness passes; check where they came from."""
    await watcher.until(
        lambda: daemon.manager.results.get(container_id, ProbeKind.READINESS) is Published.SUCCESS,
        timeout=HANG_GUARD,
    )
    assert daemon.manager.probed_container(container_id) is not None
    states = {state.kind: state for state in daemon.manager.probe_states(container_id)}
    assert set(states) == {ProbeKind.LIVENESS, ProbeKind.READINESS}
    assert {(s.origin, s.source) for s in states.values()} == {("pod-spec", source)}
    await watcher.until(
        lambda: (
            (liveness := _worker(daemon, container_id, ProbeKind.LIVENESS)) is not None
            and liveness.attempts >= 1
        ),
        timeout=HANG_GUARD,
    )


async def _liveness_stops_readiness_goes_on(
    daemon: Daemon, watcher: ManagerWatcher, attempts: Attempts, container_id: str
) -> None:
    await watcher.until(
        lambda: _worker(daemon, container_id, ProbeKind.LIVENESS) is None, timeout=10
    )
    await watcher.until(
        lambda: daemon.manager.results.get(container_id, ProbeKind.LIVENESS) is None
    )
    stopped_at = attempts.count(container_id, ProbeKind.LIVENESS)
    readiness_before = attempts.count(container_id, ProbeKind.READINESS)
    await asyncio.sleep(QUIET_WINDOW)
    assert attempts.count(container_id, ProbeKind.LIVENESS) <= stopped_at + 1  # one in flight
    assert attempts.count(container_id, ProbeKind.READINESS) > readiness_before
    assert _worker(daemon, container_id, ProbeKind.READINESS) is not None


async def test_manifests_source_runs_the_static_pods_probes(
    testbed: Testbed, pods: PodFactory, tmp_path: Path
) -> None:
    """The done-when line: `serve --probes-from manifests:DIR` with no rules file runs the
    specs' probes; removing the manifest (the kubelet deletes the static pod) stops liveness."""
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    (manifests / "web.yaml").write_text(yaml.safe_dump(MANIFEST))
    source = SourceSpec("manifests", str(manifests))
    async with podspec_node(testbed, tmp_path, source) as (daemon, watcher, attempts):
        # The kubelet names a static pod <name>-<node name>; its UID is its own hash.
        pod = await pods.create_pod(f"web-{NODE}", containers=[APP])
        container_id = pod.container_ids["app"]
        await _probed_from_the_spec(daemon, watcher, container_id, source.text)

        ps = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "cri_prober",
            "ps",
            "-o",
            "wide",
            "--address",
            f"unix://{tmp_path}/api.sock",
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await ps.communicate()
        header, *rows = out.decode().splitlines()
        assert header.split()[-1] == "SOURCE"
        [row] = [r for r in rows if r.startswith(container_id[:13])]
        assert row.split()[-1] == "pod-spec"

        (manifests / "web.yaml").unlink()
        await _liveness_stops_readiness_goes_on(daemon, watcher, attempts, container_id)


async def test_kubelet_source_runs_the_pods_probes_and_follows_deletion(
    testbed: Testbed, pods: PodFactory, tmp_path: Path
) -> None:
    """The kubelet's /pods (a local server serving the pod with the CRI sandbox's UID): the
    probes run; the pod getting a deletionTimestamp stops liveness at once."""
    from tests.support.kubelet_server import KubeletServer

    pod = await pods.create_pod("shop-web", containers=[APP])
    container_id = pod.container_ids["app"]
    listed = _as_listed(pod.name, pod.namespace, pod.uid)
    async with KubeletServer(tls=False) as server:
        server.set_pods({"kind": "PodList", "apiVersion": "v1", "items": [listed]})
        source = SourceSpec("kubelet", server.url)
        async with podspec_node(testbed, tmp_path, source) as (daemon, watcher, attempts):
            await _probed_from_the_spec(daemon, watcher, container_id, source.text)
            deleted = copy.deepcopy(listed)
            deleted["metadata"]["deletionTimestamp"] = "2026-11-23T10:00:00Z"
            deleted["metadata"]["deletionGracePeriodSeconds"] = 30
            server.set_pods({"kind": "PodList", "apiVersion": "v1", "items": [deleted]})
            await _liveness_stops_readiness_goes_on(daemon, watcher, attempts, container_id)


async def test_apiserver_source_runs_the_pods_probes_and_follows_deletion(
    testbed: Testbed, pods: PodFactory, tmp_path: Path
) -> None:
    """The API server's list+watch (a local server speaking the watch protocol): the probes
    run; a MODIFIED event with a deletionTimestamp stops liveness at once."""
    from tests.support.apiserver import FakeApiServer

    pod = await pods.create_pod("shop-api", containers=[APP])
    container_id = pod.container_ids["app"]
    listed = _as_listed(pod.name, pod.namespace, pod.uid)
    listed["spec"]["nodeName"] = NODE
    async with FakeApiServer(node_name=NODE) as server:
        server.put(listed)
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "test", "cluster": {"server": server.url}}],
                    "users": [{"name": "test", "user": {"token": "e2e"}}],
                    "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
                    "current-context": "test",
                }
            )
        )
        source = SourceSpec("apiserver")
        async with podspec_node(testbed, tmp_path, source, kubeconfig=kubeconfig) as (
            daemon,
            watcher,
            attempts,
        ):
            await _probed_from_the_spec(daemon, watcher, container_id, source.text)
            deleted = copy.deepcopy(listed)
            deleted["metadata"]["deletionTimestamp"] = "2026-11-23T10:00:00Z"
            server.put(deleted)
            await _liveness_stops_readiness_goes_on(daemon, watcher, attempts, container_id)


def _as_listed(name: str, namespace: str, uid: str) -> dict[str, Any]:
    """MANIFEST as a source lists it: the pod's real name and UID, as the API has them."""
    listed = copy.deepcopy(MANIFEST)
    listed["metadata"] = {"name": name, "namespace": namespace, "uid": uid}
    listed["status"] = {"phase": "Running"}
    return listed
