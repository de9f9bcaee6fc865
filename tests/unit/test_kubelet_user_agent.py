"""The probes' User-Agent follows the kubelet release cri-prober follows (docs/kubelet-fidelity.md,
"Kubelet releases"): ``pkg/probe/http/request.go`` ``userAgent`` is ``kube-probe/<major>.<minor>``
of the kubelet's own version in every release, for HTTP and (leading) for gRPC."""

from __future__ import annotations

from typing import Any, cast

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.kubelet_profile import KubeletProfile
from cri_prober.probing.outcome import ProbeResult
from cri_prober.probing.prober import Prober, ProbeTarget
from cri_prober.probing.spec import Probe, parse_probe
from tests.support.h2c_server import Http1OnlyServer, tls_health_server

pytestmark = pytest.mark.both_loops

TARGET = ProbeTarget(container_id="c1", pod_ip="127.0.0.1")
_Status = health_pb2.HealthCheckResponse
RELEASES = [28, 33, 34, 35, 37]


def _probe(handler: dict[str, Any]) -> Probe:
    return parse_probe(
        {**handler, "timeoutSeconds": 5}, kind=ProbeKind.READINESS, path="readinessProbe"
    )


class _Recording(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.seen: list[str] = []

    async def Check(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.seen.append(dict(context.invocation_metadata())["user-agent"])
        return _Status(status=_Status.SERVING)


def test_the_profile_names_its_release() -> None:
    assert KubeletProfile(33).user_agent == "kube-probe/1.33"
    assert KubeletProfile().user_agent == "kube-probe/1.37"


@pytest.mark.parametrize("minor", RELEASES, ids=[f"1.{m}" for m in RELEASES])
async def test_http_probes_say_the_followed_release(minor: int) -> None:
    server = Http1OnlyServer()
    await server.start()
    try:
        prober = Prober(cast(Any, None), profile=KubeletProfile(minor))
        spec = _probe({"httpGet": {"path": "/", "port": server.port}})
        outcome = await prober.run(spec, TARGET)
    finally:
        await server.stop()
    assert outcome.result is ProbeResult.SUCCESS
    head = server.received[0].decode("latin-1").split("\r\n")
    assert f"User-Agent: kube-probe/1.{minor}" in head
    # A User-Agent the probe sets itself still wins, in every release.
    assert sum(line.startswith("User-Agent:") for line in head) == 1


@pytest.mark.parametrize("minor", RELEASES, ids=[f"1.{m}" for m in RELEASES])
async def test_grpc_probes_lead_with_the_followed_release(minor: int) -> None:
    servicer = _Recording()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        prober = Prober(cast(Any, None), profile=KubeletProfile(minor))
        outcome = await prober.run(_probe({"grpc": {"port": port}}), TARGET)
    finally:
        await server.stop(None)
    assert outcome.result is ProbeResult.SUCCESS
    assert servicer.seen[0].split(" ")[0] == f"kube-probe/1.{minor}"


async def test_grpc_tls_probes_say_the_followed_release() -> None:
    servicer = _Recording()
    profile = KubeletProfile(37, {"GRPCContainerProbeTLS": True})
    async with tls_health_server(servicer=servicer) as port:
        prober = Prober(cast(Any, None), profile=profile)
        outcome = await prober.run(_probe({"grpc": {"port": port, "mode": "TLS"}}), TARGET)
    assert outcome.result is ProbeResult.SUCCESS
    assert servicer.seen[0].split(" ")[0] == "kube-probe/1.37"


async def test_a_probes_own_user_agent_wins_in_every_release() -> None:
    server = Http1OnlyServer()
    await server.start()
    try:
        prober = Prober(cast(Any, None), profile=KubeletProfile(30))
        spec = _probe(
            {
                "httpGet": {
                    "path": "/",
                    "port": server.port,
                    "httpHeaders": [{"name": "User-Agent", "value": "mine/1"}],
                }
            }
        )
        await prober.run(spec, TARGET)
    finally:
        await server.stop()
    head = server.received[0].decode("latin-1").split("\r\n")
    assert "User-Agent: mine/1" in head
    assert not any(line.startswith("User-Agent: kube-probe") for line in head)
