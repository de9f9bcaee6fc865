"""serve --mirror end to end: a real ``cri-prober serve --mirror kubelet:URL --probes-from
kubelet:URL`` subprocess, the in-process fake runtime, and a local kubelet stand-in serving the
pod (/pods, with its status) and the kubelet's probe counters (/metrics/probes) as
pkg/kubelet/prober/worker.go (release-1.28) makes them: one ``prober_probe_total`` increment per
attempt by result, series starting again from zero when the kubelet restarts.

The pod's exec liveness and readiness are the kubelet's: the runtime must receive no ExecSync
for them, while ``inspect``, ``ps``, ``watch``, ``health`` and ``/metrics`` show the kubelet's
verdicts marked ``kubelet-mirror``; a counter reset and a kubelet restart invent no attempt. A
rules-file probe on a second container (a probe only cri-prober has) still runs, which also
shows that the runtime does see execs when serve runs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cri_prober._gen.runtime.v1 import api_pb2
from tests.support.apiserver import FakeApiServer
from tests.support.fake_runtime import FakeContainer, FakeRuntime, FakeRuntimeServer
from tests.support.kubelet_server import KubeletServer
from tests.support.serve import Serve, cli_env, launch, run_cli

UID = "0b1c2d3e-4f50-4a6b-8c7d-9e0f1a2b3c4d"
NAMESPACE, POD = "shop", "web"
LIVENESS_CMD = ["cat", "/tmp/alive"]
READINESS_CMD = ["cat", "/tmp/ready"]
SIDECAR_CMD = ["true", "sidecar-rule"]
# A probe only cri-prober has: the rules file's, on the sidecar (which the pod spec leaves
# unprobed).
RULES = f"""
probes:
  - match: {{namespace: {NAMESPACE}, pod: {POD}, container: sidecar}}
    livenessProbe: {{exec: {{command: {json.dumps(SIDECAR_CMD)}}}, periodSeconds: 1}}
"""
KUBELET_START = 1.7e9
NODE = "mirror-node"
HANG_GUARD = 60.0


def pod_document(app_id: str, sidecar_id: str, *, ready: bool) -> dict[str, Any]:
    """The pod as the kubelet's /pods lists it, with its status."""
    probe: dict[str, Any] = {
        "timeoutSeconds": 1,
        "periodSeconds": 1,
        "successThreshold": 1,
        "failureThreshold": 3,
    }
    return {
        "kind": "PodList",
        "apiVersion": "v1",
        "items": [
            {
                "metadata": {"name": POD, "namespace": NAMESPACE, "uid": UID},
                "spec": {
                    "nodeName": NODE,
                    "containers": [
                        {
                            "name": "app",
                            "image": "busybox",
                            "livenessProbe": {"exec": {"command": LIVENESS_CMD}, **probe},
                            "readinessProbe": {"exec": {"command": READINESS_CMD}, **probe},
                        },
                        {"name": "sidecar", "image": "busybox"},
                    ],
                },
                "status": {
                    "phase": "Running",
                    "containerStatuses": [
                        {
                            "name": "app",
                            "containerID": f"containerd://{app_id}",
                            "ready": ready,
                            "started": True,
                        },
                        {
                            "name": "sidecar",
                            "containerID": f"containerd://{sidecar_id}",
                            "ready": True,
                            "started": True,
                        },
                    ],
                },
            }
        ],
    }


def counters(
    *,
    liveness: tuple[int, int],
    readiness: tuple[int, int],
    start: float = KUBELET_START,
) -> bytes:
    """``/metrics/probes`` with the app's two probes' (successful, failed) counts; a series
    exists from its first attempt of that result, as the kubelet's do."""
    lines = ["# TYPE prober_probe_total counter"]
    for probe_type, (successes, failures) in (("Liveness", liveness), ("Readiness", readiness)):
        for result, count in (("successful", successes), ("failed", failures)):
            if count:
                lines.append(
                    f'prober_probe_total{{container="app",namespace="{NAMESPACE}",pod="{POD}",'
                    f'pod_uid="{UID}",probe_type="{probe_type}",result="{result}"}} {count}'
                )
    lines += ["# TYPE process_start_time_seconds gauge", f"process_start_time_seconds {start}"]
    return ("\n".join(lines) + "\n").encode()


class Execs:
    """Every ExecSync the fake runtime received, by command."""

    def __init__(self) -> None:
        self.commands: list[list[str]] = []
        self.changed = asyncio.Event()

    async def __call__(
        self, _container: FakeContainer, cmd: list[str], _timeout: int
    ) -> api_pb2.ExecSyncResponse:
        self.commands.append(cmd)
        self.changed.set()
        return api_pb2.ExecSyncResponse(exit_code=0)


async def next_reads(kubelet: KubeletServer, reads: int = 2) -> None:
    """Wait until serve has read the counters ``reads`` more times: the reader reads, hands the
    read on, then waits, so after two requests begun from now the first has been acted on."""
    await asyncio.wait_for(
        kubelet.wait_metrics_requests(kubelet.metrics_requests + reads), HANG_GUARD
    )


async def scrape(port: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: node\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), HANG_GUARD)
    finally:
        writer.close()
    return answer.decode().split("\r\n\r\n", 1)[1]


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the series ``name`` whose labels include ``labels``."""
    for line in text.splitlines():
        if not line.startswith((name + "{", name + " ")):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{key}="{val}"' in head for key, val in labels.items()):
            return float(value)
    return None


def kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "test", "cluster": {"server": server}}],
                "users": [{"name": "test", "user": {"token": "e2e"}}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
                "current-context": "test",
            }
        )
    )
    return path


@contextlib.asynccontextmanager
async def mirrored_node(
    tmp_path: Path, source: str
) -> AsyncIterator[tuple[Serve, KubeletServer, Execs, str]]:
    """serve --mirror with the pod (spec and status) from the kubelet's /pods or from the API
    server's list and watch; the counters from the kubelet stand-in either way."""
    execs = Execs()
    runtime = FakeRuntime(exec_handler=execs)
    sandbox = runtime.add_sandbox(POD, namespace=NAMESPACE)
    sandbox.uid = UID
    app = runtime.add_container(sandbox, "app")
    sidecar = runtime.add_container(sandbox, "sidecar")
    for container in (app, sidecar):
        container.labels["io.kubernetes.pod.uid"] = UID
    async with (
        FakeRuntimeServer(str(tmp_path / "cri.sock"), runtime) as cri_server,
        KubeletServer(tls=False) as kubelet,
        FakeApiServer(node_name=NODE) as apiserver,
    ):
        document = pod_document(app.id, sidecar.id, ready=True)
        if source == "kubelet":
            kubelet.serve(document)
            flags = ["--probes-from", f"kubelet:{kubelet.url}"]
        else:
            for pod in document["items"]:
                apiserver.put(pod)
            config = kubeconfig(tmp_path / "kubeconfig", apiserver.url)
            flags = ["--probes-from", "apiserver", "--kubeconfig", str(config)]
            flags += ["--node-name", NODE]
        kubelet.metrics = counters(liveness=(10, 0), readiness=(10, 0))
        serve = launch(
            cri_server.target,
            tmp_path,
            RULES,
            *flags,
            "--mirror",
            f"kubelet:{kubelet.metrics_url}",
            "--pod-source-interval",
            "0.5",
            metrics_address="127.0.0.1:0",
        )
        try:
            await serve.until(lambda: bool(serve.logged("metrics_listening")), timeout=HANG_GUARD)
            yield serve, kubelet, execs, app.id
        finally:
            await serve.close()


async def inspect_json(serve: Serve, target: str) -> dict[str, Any]:
    result = await run_cli("inspect", target, "-o", "json", "--address", serve.address)
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


async def probes_settled(serve: Serve, target: str, liveness: int, readiness: int) -> Any:
    """inspect -o json once the two probes have recorded these many attempts."""

    async def read() -> dict[str, Any]:
        return await inspect_json(serve, target)

    async with asyncio.timeout(HANG_GUARD):
        while True:
            data = await read()
            probes = data["probes"]
            if (
                int(probes["liveness"]["attempts"]) >= liveness
                and int(probes["readiness"]["attempts"]) >= readiness
            ):
                return data
            await asyncio.sleep(0.2)


@pytest.mark.parametrize("source", ["kubelet", "apiserver"])
async def test_serve_mirror_shows_the_kubelets_verdicts_and_runs_none_of_its_probes(
    tmp_path: Path, source: str
) -> None:
    target = f"{NAMESPACE}/{POD}/app"
    async with mirrored_node(tmp_path, source) as (serve, kubelet, execs, _app_id):
        # The first read is a baseline; then the kubelet runs liveness twice (both pass) and
        # readiness three times (all fail: its failure threshold).
        await next_reads(kubelet)
        kubelet.metrics = counters(liveness=(12, 0), readiness=(10, 3))
        await next_reads(kubelet)
        data = await probes_settled(serve, target, liveness=2, readiness=3)
        readiness = data["probes"]["readiness"]
        assert readiness["result"] == "failure"
        assert readiness["consecutiveFailures"] == 3
        assert {a["source"] for a in readiness["history"]} == {"kubelet-mirror"}
        assert [a["result"] for a in readiness["history"]] == ["failure"] * 3
        assert all(a["reason"] == "kubelet" for a in readiness["history"])
        assert all(float(a["window"].rstrip("s")) > 0 for a in readiness["history"])
        assert data["probes"]["liveness"]["result"] == "success"

        # A counter reset (counts down, the same kubelet) and then a kubelet restart whose new
        # counts happen to be above the old ones: neither is an attempt.
        kubelet.metrics = counters(liveness=(1, 0), readiness=(0, 1))
        await next_reads(kubelet)
        kubelet.metrics = counters(liveness=(50, 0), readiness=(20, 5), start=KUBELET_START + 600)
        await next_reads(kubelet)
        await serve.until(lambda: len(serve.logged("kubelet_counters_reset")) >= 2, timeout=30)
        assert len(serve.logged("kubelet_counters_reset")) == 2
        # One more attempt of each after the restart: only these count.
        kubelet.metrics = counters(liveness=(51, 0), readiness=(21, 5), start=KUBELET_START + 600)
        await next_reads(kubelet)
        data = await probes_settled(serve, target, liveness=3, readiness=4)
        probes = data["probes"]
        assert int(probes["liveness"]["attempts"]) == 3
        assert int(probes["readiness"]["attempts"]) == 4
        assert probes["readiness"]["result"] == "success"
        assert [a["result"] for a in probes["readiness"]["history"]] == ["failure"] * 3 + [
            "success"
        ]

        # inspect's table says whose attempts they were.
        table = await run_cli("inspect", target, "--address", serve.address)
        assert table.returncode == 0, table.stderr
        assert "kubelet-mirror" in table.stdout
        assert "Ran by: the kubelet" in table.stdout

        # ps: the kubelet's verdicts.
        ps = await run_cli("ps", "-o", "json", "--address", serve.address)
        assert ps.returncode == 0, ps.stderr
        [row] = [c for c in json.loads(ps.stdout)["containers"] if c["name"] == "app"]
        assert row["ready"] is True
        assert row["healthy"] is True

        # health: SERVING, as the kubelet's verdicts say.
        health = await run_cli("health", target, "--address", serve.address)
        assert health.returncode == 0, health.stdout + health.stderr
        assert "SERVING" in health.stdout

        # watch: the readiness failure and the recovery, from the kubelet.
        watched = await watch_transitions(serve)
        readiness_changes = [t for t in watched if t["kind"] == "readiness"]
        assert [t["result"] for t in readiness_changes[-2:]] == ["failure", "success"]
        assert {t["source"] for t in readiness_changes[-2:]} == {"kubelet-mirror"}
        assert readiness_changes[-2]["reason"] == "kubelet"

        # /metrics counts the mirrored attempts as it counts run ones, and says they were.
        port = int(serve.logged("metrics_listening")[0]["port"])
        text = await scrape(port)
        labels = {"container": "app", "pod": POD, "namespace": NAMESPACE}
        assert (
            sample(text, "prober_probe_total", probe_type="Readiness", result="failed", **labels)
            == 3
        )
        assert (
            sample(text, "prober_probe_total", probe_type="Liveness", result="successful", **labels)
            == 3
        )
        assert (
            sample(
                text,
                "cri_prober_probe_mirrored_attempts_total",
                probe_type="Readiness",
                result="failure",
            )
            == 3
        )
        assert sample(text, "cri_prober_kubelet_counter_resets_total") == 2

        # The kubelet's probes were never run here; the rules file's probe was.
        assert LIVENESS_CMD not in execs.commands
        assert READINESS_CMD not in execs.commands
        assert SIDECAR_CMD in execs.commands


def failed_then_recovered(seen: list[dict[str, Any]]) -> bool:
    """The readiness failure the kubelet's counters published (not a new container's initial
    value), then a success."""
    changes = [t for t in seen if t["kind"] == "readiness"]
    failed = [
        i for i, t in enumerate(changes) if t["result"] == "failure" and t["reason"] == "kubelet"
    ]
    return bool(failed) and any(t["result"] == "success" for t in changes[failed[0] :])


async def watch_transitions(serve: Serve) -> list[dict[str, Any]]:
    """``watch --since 0 -o json``'s transitions of the app, read until its readiness failure
    and recovery have come (the command streams until killed)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "cri_prober",
        "watch",
        "--since",
        "0",
        "--name",
        "^app$",
        "-o",
        "json",
        "--address",
        serve.address,
        stdout=asyncio.subprocess.PIPE,
        env=cli_env(),
    )
    seen: list[dict[str, Any]] = []
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(HANG_GUARD):
            while not failed_then_recovered(seen):
                line = await proc.stdout.readline()
                assert line, "watch ended"
                seen.append(json.loads(line))
    finally:
        proc.kill()
        await proc.wait()
    return seen
