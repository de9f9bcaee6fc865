"""serve follows the node's kubelet release: with ``--probes-from apiserver`` it reads the Node
object's ``status.nodeInfo.kubeletVersion`` once at start (RBAC: get on nodes); the Node wins
over --kubelet-version when readable (a disagreement is a warning); unreadable, one warning and
the flag or the default stays (issue 37 item 3)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import structlog
from lightkube import KubeConfig

from cri_prober.podspecs.apiserver import ApiServerSource
from cri_prober.podspecs.apiserver_client import ReadFailure
from cri_prober.podspecs.options import PodSourceOptions, parse_source
from cri_prober.probing.kubelet_profile import KubeletProfile
from tests.support.apiserver import FakeApiServer
from tests.support.daemon import daemon_on_fake_runtime
from tests.support.fake_runtime import FakeRuntime

NODE = "node-a"
RULES = "probes: []\n"


def _node(version: str) -> dict[str, object]:
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {"name": NODE},
        "status": {"nodeInfo": {"kubeletVersion": version}, "images": [{"names": ["x"] * 50}]},
    }


@pytest.fixture(name="server")
async def _server() -> AsyncIterator[FakeApiServer]:
    async with FakeApiServer(node_name=NODE) as fake:
        yield fake


def _kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "t",
                "contexts": [{"name": "t", "context": {"cluster": "c", "user": "u"}}],
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
            }
        )
    )
    return path


async def test_the_source_reads_the_kubelet_version(server: FakeApiServer) -> None:
    server.nodes[NODE] = _node("v1.33.4-eks-1")
    source = ApiServerSource(node_name=NODE, config=KubeConfig.from_server(server.url))
    try:
        assert await source.kubelet_version() == "v1.33.4-eks-1"
        server.node_forbidden = True
        with pytest.raises(ReadFailure, match=r"get node node-a: 403 .*cannot get resource"):
            await source.kubelet_version()
        server.node_forbidden = False
        server.nodes[NODE] = {"kind": "Node", "status": {}}
        with pytest.raises(ReadFailure, match=r"no status\.nodeInfo\.kubeletVersion"):
            await source.kubelet_version()
    finally:
        await source.close()


@pytest.mark.parametrize(
    ("node_version", "forbidden", "flag", "follows", "event"),
    [
        ("v1.28.7", False, None, "1.28", None),
        ("v1.31.2", False, "1.37", "1.31", "kubelet_version_disagrees"),
        ("v1.31.2", True, "1.34", "1.34", "kubelet_version_unread"),
        ("v1.31.2", True, None, "1.37", "kubelet_version_unread"),
        ("v1.40.0", False, None, "1.37", "kubelet_version_ignored"),
    ],
    ids=["node", "node-over-flag", "rbac-flag", "rbac-default", "unsupported-node"],
)
async def test_serve_follows_the_nodes_kubelet(
    server: FakeApiServer,
    tmp_path: Path,
    node_version: str,
    forbidden: bool,
    flag: str | None,
    follows: str,
    event: str | None,
) -> None:
    server.nodes[NODE] = _node(node_version)
    server.node_forbidden = forbidden
    options = PodSourceOptions(
        node_name=NODE, kubeconfig=_kubeconfig(tmp_path / "kubeconfig", server.url)
    )
    with structlog.testing.capture_logs() as logs:
        async with daemon_on_fake_runtime(
            tmp_path,
            FakeRuntime(),
            RULES,
            probes_from=(parse_source("apiserver"),),
            pod_sources=options,
            kubelet=KubeletProfile.parse(flag),
            kubelet_version_flag=flag,
        ) as (daemon, _watcher):
            assert daemon.manager.kubelet.version == follows
            # The handlers' gated fields follow the same release as the worker.
            assert daemon.manager.prober.profile.version == follows
    warnings = [e["event"] for e in logs if e["log_level"] == "warning" and "kubelet" in e["event"]]
    assert warnings == ([event] if event else [])
