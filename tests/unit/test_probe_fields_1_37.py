"""The 1.37 probe fields (issue 37): ``httpGet.protocol: HTTP2`` (h2c, KEP-5999) and ``grpc.mode:
TLS`` (KEP-4939) sent as the node's kubelet would (its release and gates), against real servers;
and a probe whose handler has a field cri-prober does not know is not run at all."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cri_prober.probing.handlers.grpc import probe_grpc
from cri_prober.probing.handlers.http import USER_AGENT, probe_http
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.kubelet_profile import KubeletProfile
from cri_prober.probing.outcome import ProbeError, ProbeResult, Reason
from cri_prober.probing.prober import Prober, ProbeTarget, run_once
from cri_prober.probing.spec import Probe, Unsupported, parse_probe
from tests.support.h2c_server import H2cServer, Http1OnlyServer, tls_health_server

pytestmark = pytest.mark.both_loops

GATES_ON = KubeletProfile(37, {"H2CContainerProbe": True, "GRPCContainerProbeTLS": True})
TARGET = ProbeTarget(container_id="c1", pod_ip="127.0.0.1")
_Status = health_pb2.HealthCheckResponse


def _prober(profile: KubeletProfile | None = None) -> Prober:
    return Prober(cast(Any, None), profile=profile)


def _probe(handler: dict[str, Any], timeout: int = 5) -> Probe:
    return parse_probe(
        {**handler, "timeoutSeconds": timeout}, kind=ProbeKind.READINESS, path="readinessProbe"
    )


@pytest.fixture(name="h2c")
async def _h2c() -> AsyncIterator[H2cServer]:
    server = H2cServer(
        routes={
            "/ok": (200, (), b"h2c ok"),
            "/down": (503, (), b"secret"),
            "/moved": (302, (("location", "/ok"),), b""),
            "/away": (302, (("location", "http://elsewhere.example/"),), b"bye"),
            "/big": (200, (), b"x" * 50_000),
        }
    )
    await server.start()
    yield server
    await server.stop()


@pytest.fixture(name="http1")
async def _http1() -> AsyncIterator[Http1OnlyServer]:
    server = Http1OnlyServer()
    await server.start()
    yield server
    await server.stop()


# -- h2c ------------------------------------------------------------------------------------------


async def test_h2c_get_is_judged_like_http1(h2c: H2cServer) -> None:
    ok = await probe_http(h2c.url("/ok"), headers=[], timeout=5, http2=True)
    assert (ok.result, ok.output, ok.http_status) == (ProbeResult.SUCCESS, "h2c ok", 200)
    sent = h2c.requests[0]
    assert sent[":method"] == "GET"
    assert sent[":authority"] == f"127.0.0.1:{h2c.port}"
    assert sent["user-agent"] == USER_AGENT
    assert sent["accept"] == "*/*"
    down = await probe_http(h2c.url("/down"), headers=[], timeout=5, http2=True)
    assert (down.result, down.reason) == (ProbeResult.FAILURE, "")
    assert down.output == "HTTP probe failed with statuscode: 503"
    # Same-host redirects are followed (over h2c too), others are the answer.
    moved = await probe_http(h2c.url("/moved"), headers=[], timeout=5, http2=True)
    assert (moved.result, moved.output) == (ProbeResult.SUCCESS, "h2c ok")
    away = await probe_http(h2c.url("/away"), headers=[], timeout=5, http2=True)
    assert away.result is ProbeResult.WARNING
    big = await probe_http(h2c.url("/big"), headers=[], timeout=5, http2=True)
    assert len(big.output) == 10 * 1024


async def test_h2c_sends_the_callers_headers(h2c: H2cServer) -> None:
    headers = [("x-custom", " v "), ("Host", "svc.example"), ("Upgrade", "h2c"), ("Accept", "a/b")]
    await probe_http(h2c.url("/ok"), headers=headers, timeout=5, http2=True)
    sent = h2c.requests[0]
    assert sent[":authority"] == "svc.example"
    assert sent["x-custom"] == "v"
    assert sent["accept"] == "a/b"
    assert "upgrade" not in sent
    assert "host" not in sent


async def test_h2c_against_an_http1_only_server_fails(http1: Http1OnlyServer) -> None:
    """The issue's measurement: a server that speaks only HTTP/1.1 (and says 200 to anything)
    fails an h2c probe, as the kubelet's does, instead of passing over HTTP/1.1."""
    outcome = await probe_http(http1.url("/"), headers=[], timeout=5, http2=True)
    assert outcome.result is ProbeResult.FAILURE
    assert "looked like an HTTP/1.1 header" in outcome.output
    assert http1.received[0].startswith(b"PRI * HTTP/2.0")


async def test_protocol_http2_follows_the_kubelets_gate(http1: Http1OnlyServer) -> None:
    spec = _probe({"httpGet": {"port": http1.port, "path": "/", "protocol": "HTTP2"}})
    on = await _prober(GATES_ON).run(spec, TARGET)
    assert on.result is ProbeResult.FAILURE
    # Without the gate (its default in 1.37), or before 1.37, the kubelet ignores the field
    # and probes over HTTP/1.1: so does cri-prober.
    for profile in (KubeletProfile(), KubeletProfile(36)):
        off = await _prober(profile).run(spec, TARGET)
        assert (off.result, off.output) == (ProbeResult.SUCCESS, "ok")


async def test_protocol_http2_succeeds_on_an_h2c_server(h2c: H2cServer) -> None:
    spec = _probe({"httpGet": {"port": h2c.port, "path": "/ok", "protocol": "HTTP2"}})
    outcome = await _prober(GATES_ON).run(spec, TARGET)
    assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, "h2c ok")


# -- gRPC over TLS --------------------------------------------------------------------------------


async def test_grpc_tls_checks_a_tls_only_server_without_verifying_it() -> None:
    statuses = {"": _Status.SERVING, "down": _Status.NOT_SERVING}
    async with tls_health_server(statuses) as port:
        ok = await probe_grpc("127.0.0.1", port, service="", timeout=5, tls=True)
        assert (ok.result, ok.output) == (ProbeResult.SUCCESS, "service healthy")
        down = await probe_grpc("127.0.0.1", port, service="down", timeout=5, tls=True)
        assert down.result is ProbeResult.FAILURE
        assert down.output == 'service unhealthy (responded with "NOT_SERVING")'
        missing = await probe_grpc("127.0.0.1", port, service="nope", timeout=5, tls=True)
        assert missing.output.startswith(
            "error: health rpc probe failed: rpc error: code = NOT_FOUND"
        )


async def test_grpc_mode_tls_follows_the_kubelets_gate() -> None:
    async with tls_health_server() as port:
        spec = _probe({"grpc": {"port": port, "mode": "TLS"}})
        on = await _prober(GATES_ON).run(spec, TARGET)
        assert (on.result, on.output) == (ProbeResult.SUCCESS, "service healthy")
        # Without the gate the kubelet dials in plaintext, which a TLS-only server fails (at
        # the deadline: a short one, as the verdict cannot come sooner).
        spec = _probe({"grpc": {"port": port, "mode": "TLS"}}, timeout=1)
        off = await _prober().run(spec, TARGET)
        assert (off.result, off.timed_out) == (ProbeResult.FAILURE, True)


async def test_grpc_tls_against_a_plaintext_port_fails_at_the_deadline(
    h2c: H2cServer,
) -> None:
    outcome = await probe_grpc("127.0.0.1", h2c.port, service="", timeout=0.5, tls=True)
    assert (outcome.result, outcome.timed_out, outcome.reason) == (
        ProbeResult.FAILURE,
        True,
        Reason.TIMEOUT,
    )
    assert outcome.output.startswith('timeout: failed to connect service "127.0.0.1:')


# -- fields cri-prober does not know ---------------------------------------------------------------


async def test_an_unknown_handler_field_is_not_run(h2c: H2cServer) -> None:
    spec = _probe({"httpGet": {"port": h2c.port, "path": "/ok"}}).with_unsupported(
        [Unsupported("httpGet.invented")]
    )
    with pytest.raises(ProbeError) as caught:
        await _prober(GATES_ON).run(spec, TARGET)
    assert caught.value.reason == Reason.UNSUPPORTED
    assert str(caught.value).startswith("unsupported: httpGet.invented:")
    assert h2c.requests == []  # nothing was sent
    record = await run_once(_prober(), spec, TARGET)
    assert (record.result, record.reason) == ("error", Reason.UNSUPPORTED)


async def test_an_unknown_value_of_a_gated_field_counts_only_under_its_gate(
    h2c: H2cServer,
) -> None:
    spec = _probe({"grpc": {"port": h2c.port}}).with_unsupported(
        [Unsupported('grpc.mode "mTLS"', gate="GRPCContainerProbeTLS")]
    )
    with pytest.raises(ProbeError, match=r'^unsupported: grpc.mode "mTLS"') as caught:
        await _prober(GATES_ON).run(spec, TARGET)
    assert caught.value.reason == Reason.UNSUPPORTED
    # A kubelet without the gate ignores the field whatever its value: the probe is run.
    outcome = await _prober(KubeletProfile(36)).run(spec, TARGET)
    assert outcome.result is ProbeResult.FAILURE  # it was sent: h2c server, no health service


async def test_grpc_tls_sends_the_kubelets_user_agent() -> None:
    """The TLS call, made without grpc python, still leads with kube-probe/<version> (D12)."""
    seen: list[str] = []

    class Recording(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
        async def Check(self, request: Any, context: Any) -> Any:  # noqa: N802
            seen.append(dict(context.invocation_metadata())["user-agent"])
            return _Status(status=_Status.SERVING)

    async with tls_health_server(servicer=Recording()) as port:
        outcome = await probe_grpc("127.0.0.1", port, service="", timeout=5, tls=True)
    assert outcome.result is ProbeResult.SUCCESS
    assert seen[0].startswith(USER_AGENT)
