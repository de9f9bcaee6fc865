"""``serve --pod-spec-probes all|network-only``: the flag, its wiring through the daemon, and the
start line saying the pod specs' exec probes are left to the kubelet.

What the manager does with the mode is pinned in test_manager_podspecs.py.
"""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner
from structlog.testing import capture_logs

from cri_prober.cli.serve import serve
from cri_prober.daemon import ServeConfig
from cri_prober.podspecs.options import PodSourceOptions, SourceSpec
from cri_prober.probing.spec import ProbeKind
from cri_prober.runtime.endpoints import Endpoint
from tests.support.daemon import running_daemon
from tests.support.fake_runtime import FakeRuntimeServer
from tests.support.waiting import HANG_GUARD, until

NODE = "node-1"
# A static pod with an exec liveness probe and a tcpSocket readiness probe.
MANIFEST = """
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: shop}
spec:
  containers:
    - name: app
      image: busybox
      livenessProbe: {exec: {command: ["true"]}, periodSeconds: 600}
      readinessProbe: {tcpSocket: {port: 1}, periodSeconds: 600}
"""


def test_help_documents_the_flag() -> None:
    result = CliRunner().invoke(serve, ["--help"])
    assert "--pod-spec-probes [all|network-only]" in result.output


def test_a_bad_value_exits_2() -> None:
    # The command itself, not the group: the group configures logging for the whole process.
    result = CliRunner().invoke(
        serve, ["-r", "unix:///nonexistent.sock", "--pod-spec-probes", "exec-only"]
    )
    assert result.exit_code == 2, result.output
    assert "--pod-spec-probes" in result.output


def test_the_default_runs_every_probe() -> None:
    assert ServeConfig(endpoint=Endpoint("unix:///x", "flag", "unix:///x")).pod_spec_probes == "all"


async def test_network_only_runs_the_network_probes_and_says_so_at_start(tmp_path: Path) -> None:
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    (manifests / "web.yaml").write_text(MANIFEST)
    async with FakeRuntimeServer(str(tmp_path / "cri.sock")) as cri:
        sandbox = cri.runtime.add_sandbox(f"web-{NODE}", namespace="shop")
        cri.runtime.add_container(sandbox, "app")
        with capture_logs() as logs:
            async with running_daemon(
                cri.target,
                None,
                listen=f"unix://{tmp_path}/api.sock",
                state_file=None,
                pleg="relist",
                relist_period=0.1,
                probes_from=(SourceSpec("manifests", str(manifests)),),
                pod_sources=PodSourceOptions(node_name=NODE, interval=0.2),
                pod_spec_probes="network-only",
            ) as (daemon, _watcher):
                await until(lambda: daemon.manager.worker_count() > 0, timeout=HANG_GUARD)
                [probed] = daemon.manager.probed()
    assert [(p.kind, p.origin) for p in probed.probes] == [(ProbeKind.READINESS, "pod-spec")]
    events = [e["event"] for e in logs]
    assert "pod_spec_exec_probes_left_to_kubelet" in events
    [left] = [e for e in logs if e["event"] == "pod_spec_exec_probe_left_to_kubelet"]
    assert (left["pod"], left["container"], left["probe"]) == (
        f"shop/web-{NODE}",
        "app",
        "livenessProbe",
    )
