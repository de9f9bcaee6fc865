"""What a probe's target answered stays where the kubelet keeps it (issue 21, item 9).

A pod spec's (or annotation's) network probe that reaches something other than the pod itself —
an explicit ``host`` such as loopback or the metadata service, or the node a pod without an IP
dials — is sent as the kubelet sends it, but keeps only its status: never the body, a quoted
line, header or redirect URL, in the attempt, history, API, log or metrics. Rules-file probes and
probes of the pod itself keep the body, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cri_prober._gen.criprober.v1 import query_pb2, query_pb2_grpc
from cri_prober.discovery.pleg import Discovery
from cri_prober.manager.probe_manager import ProbeManager
from cri_prober.podspecs.registry import PodSpecs
from cri_prober.podspecs.source import Changed, PodSource
from cri_prober.probing.outcome import ProbeError
from cri_prober.probing.prober import Prober, ProbeTarget
from cri_prober.probing.spec import Probe, ProbeKind, ProbeOrigin, load_rules, parse_probe
from cri_prober.runtime.model import ExecResult
from cri_prober.serving.metrics import Metrics
from cri_prober.serving.server import start_api
from tests.support.fake_runtime import FakeRuntime
from tests.support.local_server import LocalServer
from tests.support.memory_cri import memory_client
from tests.support.waiting import HANG_GUARD
from tests.support.watchers import ManagerWatcher

SECRET = "SECRET-METADATA-TOKEN"
NOT_THE_POD = "(body not kept: the target is not the pod)"
# The pod under test: its IP is not where the servers listen, so host 127.0.0.1 is not the pod.
POD = ProbeTarget(container_id="c", pod_ip="10.244.0.7")
# A pod whose own IP is the loopback address, where the servers listen.
POD_ON_LOOPBACK = ProbeTarget(container_id="c", pod_ip="127.0.0.1")


def _response(status: str, body: str = "", headers: tuple[str, ...] = ()) -> bytes:
    lines = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n" + body).encode()


@dataclass
class Answers(LocalServer):
    """Answers each request with the reply its path names (query ignored), and records paths."""

    replies: dict[str, bytes] = field(default_factory=dict)
    paths: list[str] = field(default_factory=list)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        path = head.split(b" ", 2)[1].decode()
        self.paths.append(path)
        writer.write(self.replies[path.partition("?")[0]])
        await writer.drain()


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A port bound but not listening: connecting is refused, and nobody else takes it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@dataclass
class Servers:
    node: Answers  # on 127.0.0.1: the node's loopback, or the pod on loopback
    elsewhere: Answers  # on 127.0.0.2: another host, which holds the secret too
    refused: int


@pytest.fixture(name="servers")
async def _servers() -> AsyncIterator[Servers]:
    node, elsewhere = Answers(), Answers()
    await node.start("127.0.0.1")
    await elsewhere.start("127.0.0.2")
    elsewhere.replies = {"/": _response("200 OK", SECRET)}
    with refused_port() as refused:
        node.replies = {
            "/": _response("200 OK", SECRET),
            "/moved": _response("302 Found", "moved", ("Location: /",)),
            "/away": _response(
                "302 Found", "moved away", (f"Location: http://127.0.0.2:{elsewhere.port}/",)
            ),
            "/failing": _response("503 Service Unavailable", SECRET),
            "/garbage": f"{SECRET}\r\n\r\n".encode(),
            "/bad-location": _response("302 Found", "", (f"Location: http://[{SECRET}/",)),
            "/bad-encoding": _response("200 OK", "", (f"Transfer-Encoding: {SECRET}",)),
            "/loop": _response("302 Found", "", (f"Location: /loop?token={SECRET}",)),
            "/refused": _response(
                "302 Found", "", (f"Location: http://127.0.0.1:{refused}/?token={SECRET}",)
            ),
            "/to-truncated": _response("302 Found", "", (f"Location: /truncated?token={SECRET}",)),
            "/truncated": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort",
        }
        try:
            yield Servers(node, elsewhere, refused)
        finally:
            await node.stop()
            await elsewhere.stop()


class NoExec:
    async def exec_sync(self, container_id: str, cmd: Any, *, timeout: int) -> ExecResult:
        raise AssertionError("no exec expected")


def http_probe(port: int, path: str, host: str | None = None) -> Probe:
    action: dict[str, Any] = {"port": port, "path": path}
    if host is not None:
        action["host"] = host
    return parse_probe(
        {"httpGet": action}, kind=ProbeKind.READINESS, path=ProbeKind.READINESS.field_name
    )


async def attempt(probe: Probe, target: ProbeTarget, origin: ProbeOrigin) -> tuple[str, str]:
    """(result, output) of one attempt; an errored attempt's output is its error."""
    try:
        outcome = await Prober(NoExec()).run(probe, target, origin=origin)
    except ProbeError as exc:
        return "error", str(exc)
    return outcome.result.value, outcome.output


# -- the prober -----------------------------------------------------------------------------------

WITHHELD = [
    # (path, result and output of a pod-spec probe with host 127.0.0.1; {url} is the probe's)
    ("/", "success", f"HTTP probe succeeded with statuscode: 200 {NOT_THE_POD}"),
    # A same-host redirect is followed: the page it leads to is no more the pod's.
    ("/moved", "success", f"HTTP probe succeeded with statuscode: 200 {NOT_THE_POD}"),
    ("/failing", "failure", "HTTP probe failed with statuscode: 503"),
    (
        "/garbage",
        "failure",
        'Get "{url}": net/http: HTTP/1.x transport connection broken: malformed HTTP response '
        "(first line not kept: the target is not the pod)",
    ),
    (
        "/bad-location",
        "failure",
        'Get "{url}": failed to parse Location header (value not kept: the target is not the pod)',
    ),
    (
        "/bad-encoding",
        "failure",
        'Get "{url}": unsupported transfer encoding (value not kept: the target is not the pod)',
    ),
    # The URLs redirects led to are the server's words: errors name the probe's own URL.
    ("/loop", "failure", 'Get "{url}": stopped after 10 redirects'),
    ("/refused", "failure", 'Get "{url}": dial tcp 127.0.0.1:{refused}: connect: '),
    ("/to-truncated", "error", 'Get "{url}": reading body: unexpected EOF'),
]


@pytest.mark.parametrize(("path", "result", "output"), WITHHELD, ids=[w[0] for w in WITHHELD])
async def test_pod_spec_probe_of_another_host_keeps_the_status_only(
    servers: Servers, path: str, result: str, output: str
) -> None:
    """The finding: a pod spec's httpGet with host 127.0.0.1 (or 169.254.169.254) kept the
    page, and every quoted line, header or redirect URL, in the attempt's output or error."""
    probe = http_probe(servers.node.port, path, host="127.0.0.1")
    got = await attempt(probe, POD, "pod-spec")
    expected = output.format(url=f"http://127.0.0.1:{servers.node.port}{path}", **vars(servers))
    assert got[0] == result
    assert got[1].startswith(expected), got[1]
    assert SECRET not in got[1]
    assert servers.node.paths  # still sent: the kubelet sends it too


@pytest.mark.parametrize(
    "path", ["/", "/moved", "/garbage", "/bad-location", "/bad-encoding", "/loop", "/refused"]
)
async def test_the_same_probe_from_the_rules_file_keeps_everything(
    servers: Servers, path: str
) -> None:
    """The operator wrote it: the kubelet's exact output, whatever it quotes."""
    probe = http_probe(servers.node.port, path, host="127.0.0.1")
    assert SECRET in (await attempt(probe, POD, "rules"))[1]


@pytest.mark.parametrize(
    ("target", "host"),
    [
        (POD_ON_LOOPBACK, None),
        (POD_ON_LOOPBACK, "127.0.0.1"),  # a host naming the pod's own IP
        (ProbeTarget(container_id="c", pod_ips=("10.0.0.9", "127.0.0.1")), "127.0.0.1"),
        # A host-network pod is the node: its address is the node address (127.0.0.1 here).
        (ProbeTarget(container_id="c", host_network=True), None),
    ],
    ids=["no-host", "own-ip", "second-ip", "host-network"],
)
async def test_a_pod_spec_probe_of_the_pod_itself_keeps_its_body(
    servers: Servers, target: ProbeTarget, host: str | None
) -> None:
    probe = http_probe(servers.node.port, "/", host=host)
    assert await attempt(probe, target, "pod-spec") == ("success", SECRET)


async def test_a_host_network_pod_naming_any_host_keeps_the_status_only(
    servers: Servers,
) -> None:
    """A host-network pod's addresses are the node's: naming one explicitly (even the node
    address its probes go to anyway) may reach any of the node's services."""
    probe = http_probe(servers.node.port, "/", host="127.0.0.1")
    host_network = ProbeTarget(container_id="c", host_network=True)
    expected = ("success", f"HTTP probe succeeded with statuscode: 200 {NOT_THE_POD}")
    assert await attempt(probe, host_network, "pod-spec") == expected


async def test_a_pod_without_ip_dials_the_node_and_keeps_the_status_only(
    servers: Servers,
) -> None:
    """Like the kubelet, a pod without an IP dials the local system: that is the node."""
    probe = http_probe(servers.node.port, "/")
    no_ip = ProbeTarget(container_id="c")
    expected = ("success", f"HTTP probe succeeded with statuscode: 200 {NOT_THE_POD}")
    assert await attempt(probe, no_ip, "pod-spec") == expected
    assert servers.node.paths == ["/"]


async def test_a_redirect_from_the_pod_to_another_host_is_not_followed(servers: Servers) -> None:
    """The kubelet follows redirects to the same host only; the 3xx is the pod's own answer
    (kept), and the other host, which holds the secret, hears nothing."""
    probe = http_probe(servers.node.port, "/away")
    result = await attempt(probe, POD_ON_LOOPBACK, "pod-spec")
    assert result == ("warning", "Probe terminated redirects, Response body: moved away")
    assert servers.elsewhere.paths == []


async def test_a_redirect_from_another_host_keeps_the_status_only(servers: Servers) -> None:
    probe = http_probe(servers.node.port, "/away", host="127.0.0.1")
    result = await attempt(probe, POD, "pod-spec")
    assert result == ("warning", f"Probe terminated redirects, statuscode: 302 {NOT_THE_POD}")
    assert servers.elsewhere.paths == []


async def test_annotation_probes_keep_no_response_text_either(servers: Servers) -> None:
    """Annotation probes already kept no body; now no quoted line either."""
    probe = http_probe(servers.node.port, "/garbage")
    status, output = await attempt(probe, POD_ON_LOOPBACK, "annotation")
    assert status == "failure"
    assert output.endswith("(first line not kept for annotation probes)")


class DeniedHealth(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    async def Check(  # noqa: N802 - the generated servicer's method name
        self,
        request: health_pb2.HealthCheckRequest,
        context: grpc.aio.ServicerContext[
            health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
        ],
    ) -> health_pb2.HealthCheckResponse:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, SECRET)
        raise AssertionError("abort returns no answer")


@pytest.mark.parametrize(
    ("target", "details"),
    [
        (POD_ON_LOOPBACK, SECRET),
        # No IP: the empty address dials the node (tcp.dial_host), whose words are not kept.
        (ProbeTarget(container_id="c"), "(details not kept: the target is not the pod)"),
    ],
    ids=["the-pod", "no-ip"],
)
async def test_grpc_error_details_are_kept_only_from_the_pod(
    target: ProbeTarget, details: str
) -> None:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(DeniedHealth(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        probe = parse_probe({"grpc": {"port": port}}, kind=ProbeKind.LIVENESS, path="livenessProbe")
        result = await attempt(probe, target, "pod-spec")
    finally:
        await server.stop(None)
    assert result == (
        "failure",
        f"error: health rpc probe failed: rpc error: code = PERMISSION_DENIED desc = {details}",
    )


# -- end to end: history, API, log and metrics -----------------------------------------------------


class ListedSource(PodSource):
    """A pod source whose listings the test hands in."""

    def __init__(self) -> None:
        super().__init__("kubelet", stale_after=60)

    async def run(self, changed: Changed) -> None:
        await asyncio.Event().wait()


def pod(name: str, probe: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "shop", "uid": f"uid-{name}"},
        "spec": {"containers": [{"name": "app", "readinessProbe": probe}]},
    }


async def test_nothing_the_node_answered_reaches_history_api_log_or_metrics(
    servers: Servers, tmp_path: Path
) -> None:
    """Three readiness probes of the same page: a pod spec's with host 127.0.0.1 (the node's
    loopback), the rules file's, and a pod spec's of its own pod on loopback. Only the first
    keeps no body, wherever the attempt is shown."""
    port = servers.node.port

    def get(**host: str) -> dict[str, Any]:
        return {"httpGet": {"port": port, "path": "/", **host}, "periodSeconds": 1}

    rules = load_rules(
        "probes:\n  - match: {namespace: ops}\n"
        f"    readinessProbe: {{httpGet: {{host: 127.0.0.1, port: {port}}}, periodSeconds: 1}}\n",
        source="rules.yaml",
    )
    pods = [pod("web", get(host="127.0.0.1")), pod("self", get())]
    runtime = FakeRuntime()
    source = ListedSource()
    registry = PodSpecs([source])
    metrics = Metrics()
    async with memory_client(runtime) as cri:
        manager = ProbeManager(
            prober=Prober(cri),
            rules=rules,
            prober_started_at=time.time() - 1800,
            on_failure="report",
            stopper=cri,
            pod_specs=registry,
            rules_source="rules.yaml",
        )
        discovery = Discovery(cri)
        watcher = ManagerWatcher(manager)
        manager.events.subscribe(metrics.manager_event)
        ids: dict[str, str] = {}
        for name, namespace, ip in [
            ("web", "shop", "10.244.0.7"),
            ("self", "shop", "127.0.0.1"),
            ("ops", "ops", "10.244.0.8"),
        ]:
            sandbox = runtime.add_sandbox(name, namespace=namespace, ip=ip)
            sandbox.uid = f"uid-{name}"
            ids[name] = runtime.add_container(sandbox, "app").id
        api = await start_api(f"unix://{tmp_path}/api.sock", node=discovery, manager=manager)
        try:
            with structlog.testing.capture_logs() as logs:
                source.replace_all(pods)
                source.succeeded()
                registry.rebuild()
                events = await discovery.relist()
                manager.on_lifecycle(events, discovery.containers().values())
                await watcher.until(
                    lambda: (
                        {t.container.id for t in watcher.transitions if t.result.value == "success"}
                        == set(ids.values())
                    ),
                    timeout=HANG_GUARD,
                )
            origins = {name: manager.probe_states(cid)[0].origin for name, cid in ids.items()}
            assert origins == {"web": "pod-spec", "self": "pod-spec", "ops": "rules"}
            async with grpc.aio.insecure_channel(f"unix:{tmp_path}/api.sock") as channel:
                stub = query_pb2_grpc.CriProberStub(channel)
                shown = {
                    name: str(await stub.GetContainer(query_pb2.GetContainerRequest(target=cid)))
                    for name, cid in ids.items()
                }
        finally:
            await api.stop()
            await manager.shutdown(grace=2)
    for name, cid in ids.items():
        seen = {
            "record": [repr(r.record) for r in watcher.records if r.container.id == cid],
            "transition": [t.output for t in watcher.transitions if t.container.id == cid],
            "log": [
                repr(e)
                for e in logs
                if e["event"] == "probe_transition" and e["container"].endswith(f"/{name}/app")
            ],
            "api": [shown[name]],
        }
        assert all(seen.values()), seen
        kept = {where: any(SECRET in text for text in texts) for where, texts in seen.items()}
        assert kept == dict.fromkeys(seen, name != "web"), (name, seen)
    assert SECRET.encode() not in metrics.exposition()
    assert {r.record.result for r in watcher.records} == {"success"}
