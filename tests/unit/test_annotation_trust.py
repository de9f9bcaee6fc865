"""Pod annotations are written by any pod author: what they may make cri-prober do.

``serve --annotations off|exec-only|all`` says which probes they may define; an annotation's
network probe may only reach the pod's own IP unless ``--annotation-probe-hosts`` allows the
``host`` it names (never loopback, unspecified or link-local by default), a denied probe is an
errored attempt that sends nothing, an annotation HTTP probe keeps its status but not the body,
and no expanded ``$(VAR)`` value reaches a log line, an attempt or a transition.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from click.testing import CliRunner

from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.cli.serve import serve
from cri_prober.daemon import Daemon, ServeConfig
from cri_prober.discovery.pleg import Discovery
from cri_prober.manager.events import AttemptFinished, ResultChanged
from cri_prober.manager.probe_manager import AnnotationMode, ProbeManager
from cri_prober.probing.outcome import MAX_OUTPUT_BYTES, ProbeError, ProbeResult
from cri_prober.probing.prober import (
    MAX_ERROR_CHARS,
    AnnotationHosts,
    ProbeDenied,
    Prober,
    ProbeTarget,
)
from cri_prober.probing.spec import Probe, ProbeKind, RulesFile, load_rules, parse_probe
from cri_prober.runtime.endpoints import Endpoint
from cri_prober.runtime.model import ExecResult
from tests.support.fake_runtime import FakeContainer, FakeRuntime
from tests.support.memory_cri import memory_client
from tests.support.waiting import HANG_GUARD
from tests.support.watchers import ManagerWatcher

BODY = b"internal page: token=do-not-copy-me"
ANNOTATION = "probes.cri-prober.io/"


# -- the host allow list --------------------------------------------------------------------------

HOSTS = [
    # (--annotation-probe-hosts, host, allowed)
    ((), "10.1.2.3", False),  # the default allows no explicit host at all
    ((), "127.0.0.1", False),
    (("10.0.0.0/8",), "10.1.2.3", True),
    (("10.0.0.0/8",), "11.0.0.1", False),
    (("10.0.0.0/8,192.168.0.0/16",), "192.168.1.1", True),
    (("0.0.0.0/0",), "8.8.8.8", True),
    # 0.0.0.0/0 does not open the node itself or the metadata service:
    (("0.0.0.0/0",), "127.0.0.1", False),
    (("0.0.0.0/0",), "127.1.2.3", False),
    (("0.0.0.0/0",), "0.0.0.0", False),
    (("0.0.0.0/0",), "169.254.169.254", False),
    (("0.0.0.0/0", "::/0"), "::ffff:127.0.0.1", False),  # IPv4-mapped loopback
    (("::/0",), "::1", False),
    (("::/0",), "::", False),
    (("::/0",), "fe80::1", False),
    (("::/0",), "2001:db8::1", True),
    # ... naming them does:
    (("127.0.0.1/32",), "127.0.0.1", True),
    (("169.254.169.254",), "169.254.169.254", True),
    # Names are never checked (their answer can change before the connect), nor zones.
    (("0.0.0.0/0",), "localhost", False),
    (("0.0.0.0/0",), "metadata.google.internal", False),
    (("0.0.0.0/0",), "127.1", False),  # inet_aton's shorthand for 127.0.0.1
    (("::/0",), "fe80::1%eth0", False),
    (("0.0.0.0/0",), "[::1]", False),
]


@pytest.mark.parametrize(("allowed", "host", "ok"), HOSTS, ids=[f"{h[0]}-{h[1]}" for h in HOSTS])
def test_host_allow_list(allowed: tuple[str, ...], host: str, ok: bool) -> None:
    """Only listed networks; loopback, unspecified and link-local only when named themselves."""
    denial = AnnotationHosts.parse(allowed).denial(host)
    assert (denial is None) == ok, denial


@pytest.mark.parametrize("item", ["10.0.0.1/8", "nope", "10.0.0.0/33"])
def test_bad_allow_list_entry_is_named(item: str) -> None:
    with pytest.raises(ValueError, match=repr(item).replace("[", r"\[")):
        AnnotationHosts.parse([item])


# -- the prober -----------------------------------------------------------------------------------


class HttpTarget:
    """A local HTTP server answering ``status`` with ``BODY``; it counts connections."""

    def __init__(self, status: str = "200 OK", extra: str = "") -> None:
        self.status = status
        self.extra = extra
        self.accepted = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            await reader.readuntil(b"\r\n\r\n")
            head = f"HTTP/1.1 {self.status}\r\nContent-Length: {len(BODY)}\r\n{self.extra}\r\n"
            writer.write(head.encode() + BODY)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> HttpTarget:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


class NoExec:
    async def exec_sync(self, container_id: str, cmd: Any, *, timeout: int) -> ExecResult:
        raise AssertionError("no exec expected")


def probe(spec: dict[str, Any], kind: ProbeKind = ProbeKind.READINESS) -> Probe:
    return parse_probe(spec, kind=kind, path=kind.field_name)


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A port bound but not listening: connecting is refused, and nobody else takes it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


POD = ProbeTarget(container_id="c", pod_ip="10.244.0.7")


async def test_annotation_http_probe_to_loopback_is_denied_and_sends_nothing() -> None:
    """The SSRF finding: host 127.0.0.1 and custom headers made cri-prober send the request from
    the node's network. Now the attempt errors and nothing is sent; rules still may."""
    async with HttpTarget() as server:
        spec = probe(
            {
                "httpGet": {
                    "host": "127.0.0.1",
                    "port": server.port,
                    "httpHeaders": [{"name": "Metadata-Flavor", "value": "Google"}],
                }
            }
        )
        prober = Prober(NoExec(), annotation_hosts=AnnotationHosts.parse(["0.0.0.0/0"]))
        with pytest.raises(ProbeDenied, match=r"127\.0\.0\.1 is a loopback address"):
            await prober.run(spec, POD, origin="annotation")
        assert server.accepted == 0
        # The operator's rules are trusted, like a kubelet's pod spec; the pod spec itself
        # (serve --probes-from) is sent too, since the kubelet runs the same probe with the same
        # reach, but what a host other than the pod answers is not kept (test_probe_body.py).
        outcome = await prober.run(spec, POD, origin="rules")
        assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, BODY.decode())
        assert server.accepted == 1
        outcome = await prober.run(spec, POD, origin="pod-spec")
        assert outcome.result is ProbeResult.SUCCESS
        assert BODY.decode() not in outcome.output
        assert server.accepted == 2


async def test_annotation_tcp_probe_is_denied_by_default() -> None:
    """With --on-failure stop a tcpSocket probe's verdict is a port scanner; a denied one has
    no verdict (an error is never counted), and the default allows no explicit host."""
    with refused_port() as port:
        spec = probe({"tcpSocket": {"host": "10.0.0.9", "port": port}}, ProbeKind.LIVENESS)
        with pytest.raises(ProbeDenied, match="may not set host"):
            await Prober(NoExec()).run(spec, POD, origin="annotation")


@pytest.mark.parametrize(
    "spec",
    [
        {"httpGet": {"port": 1}},
        {"tcpSocket": {"port": 1}},
        {"grpc": {"port": 1}},
    ],
    ids=["http", "tcp", "grpc"],
)
async def test_pod_without_ip_does_not_dial_the_node(spec: dict[str, Any]) -> None:
    """Without a pod IP the empty address dials the node itself (Go's local system)."""
    no_ip = ProbeTarget(container_id="c")
    with pytest.raises(ProbeDenied, match="the pod has no IP"):
        await Prober(NoExec()).run(probe(spec), no_ip, origin="annotation")


async def test_host_network_pod_probes_the_node_address() -> None:
    """A host-network pod shares the node's network: its own address is the node's."""
    async with HttpTarget() as server:
        host_network = ProbeTarget(container_id="c", host_network=True)
        outcome = await Prober(NoExec()).run(
            probe({"httpGet": {"port": server.port}}), host_network, origin="annotation"
        )
        assert outcome.result is ProbeResult.SUCCESS
        assert server.accepted == 1


@pytest.mark.parametrize(
    ("status", "extra", "result", "output"),
    [
        ("200 OK", "", ProbeResult.SUCCESS, "HTTP probe succeeded with statuscode: 200"),
        (
            "302 Found",
            "Location: http://elsewhere.example/\r\n",
            ProbeResult.WARNING,
            "Probe terminated redirects, statuscode: 302",
        ),
    ],
)
async def test_allowed_annotation_http_probe_keeps_status_not_body(
    status: str, extra: str, result: ProbeResult, output: str
) -> None:
    """The body was kept in the API and the transition log; an annotation probe keeps only the
    status (the page may belong to whatever host the operator allowed)."""
    async with HttpTarget(status, extra) as server:
        prober = Prober(NoExec(), annotation_hosts=AnnotationHosts.parse(["127.0.0.1/32"]))
        spec = probe({"httpGet": {"host": "127.0.0.1", "port": server.port}})
        outcome = await prober.run(spec, POD, origin="annotation")
        assert server.accepted == 1
        assert outcome.result is result
        assert outcome.output == f"{output} (body not kept for annotation probes)"
        assert outcome.http_status == int(status[:3])
        assert BODY.decode() not in (await prober.run(spec, POD, origin="annotation")).output
        assert BODY.decode() in (await prober.run(spec, POD, origin="rules")).output


async def test_errors_and_outputs_are_capped() -> None:
    """What an attempt keeps (and the worker logs each period) is bounded whatever the spec:
    a 1 MB path made 1 MB errors and outputs."""
    long_path = "/" + "p" * (1 << 20)
    with refused_port() as port:
        prober = Prober(NoExec())
        local = ProbeTarget(container_id="c", pod_ip="127.0.0.1")
        outcome = await prober.run(
            probe({"httpGet": {"port": port, "path": long_path}}), local, origin="annotation"
        )
        assert outcome.result is ProbeResult.FAILURE
        assert len(outcome.output) < MAX_OUTPUT_BYTES + 100
        with pytest.raises(ProbeError) as raised:
            await prober.run(
                probe({"httpGet": {"port": port, "path": long_path + "\ud800"}}),
                local,
                origin="annotation",
            )
        assert len(str(raised.value)) < MAX_ERROR_CHARS + 100


# -- through the manager --------------------------------------------------------------------------

RULES = """
probes:
  - match: {namespace: shop}
    readinessProbe: {exec: {command: [from-rules]}, periodSeconds: 600}
"""

ExecHandler = Callable[[FakeContainer, list[str], int], Any]


class World:
    def __init__(self, runtime: FakeRuntime, manager: ProbeManager, discovery: Discovery) -> None:
        self.runtime = runtime
        self.manager = manager
        self.discovery = discovery
        self.watcher = ManagerWatcher(manager)

    async def relist(self) -> None:
        events = await self.discovery.relist()
        self.manager.on_lifecycle(events, self.discovery.containers().values())

    def attempts(self, kind: ProbeKind) -> list[AttemptFinished]:
        return [r for r in self.watcher.records if r.kind is kind]


@contextlib.asynccontextmanager
async def world(
    *,
    rules: str = RULES,
    annotations: AnnotationMode = "all",
    on_failure: str = "report",
    exec_handler: ExecHandler | None = None,
) -> AsyncIterator[World]:
    runtime = FakeRuntime() if exec_handler is None else FakeRuntime(exec_handler=exec_handler)
    async with memory_client(runtime) as cri:
        manager = ProbeManager(
            prober=Prober(cri),
            rules=load_rules(rules, source="rules.yaml"),
            prober_started_at=0,
            on_failure=on_failure,  # type: ignore[arg-type]
            stopper=cri,
            annotations=annotations,
        )
        try:
            yield World(runtime, manager, Discovery(cri))
        finally:
            await manager.shutdown(grace=2)


async def test_ssrf_through_the_manager_sends_nothing_and_stops_nothing() -> None:
    """The finding end to end, in stop mode: an annotation's liveness tcpSocket at a refused
    loopback port and readiness httpGet with headers at a loopback server. Each attempt is an
    error naming the reason; the server sees no connection and no container is stopped."""
    async with HttpTarget() as server, world(on_failure="stop") as w:
        with refused_port() as refused:
            override = {
                "livenessProbe": {
                    "tcpSocket": {"host": "127.0.0.1", "port": refused},
                    "periodSeconds": 1,
                    "failureThreshold": 1,
                },
                "readinessProbe": {
                    "httpGet": {
                        "host": "127.0.0.1",
                        "port": server.port,
                        "httpHeaders": [{"name": "X-Auth", "value": "x"}],
                    },
                    "periodSeconds": 1,
                },
            }
            sandbox = w.runtime.add_sandbox(
                "web",
                namespace="shop",
                ip="10.244.0.7",
                annotations={ANNOTATION + "app": json.dumps(override)},
            )
            app = w.runtime.add_container(sandbox, "app")
            await w.relist()
            [probed] = w.manager.probed()
            assert {p.kind: p.origin for p in probed.probes} == {
                ProbeKind.LIVENESS: "annotation",
                ProbeKind.READINESS: "annotation",
            }
            await w.watcher.until(
                lambda: all(len(w.attempts(p.kind)) >= 2 for p in probed.probes), timeout=10
            )
        for event in w.watcher.records:
            assert event.record.result == "error", event.record
            assert "annotation probe denied, nothing sent" in event.record.output
        assert server.accepted == 0
        assert "StopContainer" not in w.runtime.calls
        assert w.runtime.containers[app.id].state == api_pb2.CONTAINER_RUNNING


MODES: list[tuple[AnnotationMode, str, str]] = [
    # mode, origin of app's readiness (exec annotation), of web's (httpGet annotation)
    ("off", "rules", "rules"),
    ("exec-only", "annotation", "rules"),
    ("all", "annotation", "annotation"),
]


@pytest.mark.parametrize(("mode", "app_origin", "web_origin"), MODES, ids=[m[0] for m in MODES])
async def test_annotations_mode(mode: AnnotationMode, app_origin: str, web_origin: str) -> None:
    """off: annotations ignored; exec-only: an annotation with any network probe is refused as a
    whole (the rules apply); all: every kind. Each refusal is logged once, not per relist."""
    app_override = {"readinessProbe": {"exec": {"command": ["from-annotation"]}}}
    web_override = {"readinessProbe": {"httpGet": {"port": 8080}, "periodSeconds": 600}}
    async with world(annotations=mode) as w:
        sandbox = w.runtime.add_sandbox(
            "web",
            namespace="shop",
            ip="10.244.0.7",
            annotations={
                ANNOTATION + "app": json.dumps(app_override),
                ANNOTATION + "web": json.dumps(web_override),
            },
        )
        w.runtime.add_container(sandbox, "app")
        w.runtime.add_container(sandbox, "web")
        with structlog.testing.capture_logs() as logs:
            for _ in range(3):
                await w.relist()
        origins = {
            p.container.name: state.origin
            for p in w.manager.probed()
            if (state := p.probe(ProbeKind.READINESS)) is not None
        }
        assert origins == {"app": app_origin, "web": web_origin}
    refusals = [
        e for e in logs if e["event"] in ("bad_probe_annotation", "probe_annotation_ignored")
    ]
    if mode == "off":
        assert [e["event"] for e in refusals] == ["probe_annotation_ignored"] * 2
    elif mode == "exec-only":
        [refusal] = refusals
        assert "readinessProbe: only exec probes are allowed" in refusal["error"]
        assert "annotation probes.cri-prober.io/web" in refusal["error"]
    else:
        assert refusals == []


SECRET = "s3cr3t-Pa55w0rd"


async def test_expanded_values_reach_no_log_attempt_or_transition() -> None:
    """The finding: $(VAR) in an annotation's command put the container's secrets in
    probe_errored, timed-out output and API history. The runtime still gets the value."""
    seen: list[list[str]] = []

    async def exec_handler(
        _container: FakeContainer, cmd: list[str], _timeout: int
    ) -> api_pb2.ExecSyncResponse:
        seen.append(cmd)
        if cmd[0] == "crash":
            raise RuntimeError(f"exec failed: {cmd}")  # the runtime quoting the argv back
        return api_pb2.ExecSyncResponse(exit_code=1, stdout=f"bad password {cmd[1]}".encode())

    override = {
        "livenessProbe": {
            "exec": {"command": ["check", "$(DB_PASSWORD)"]},
            "periodSeconds": 1,
            "failureThreshold": 1,
        },
        "readinessProbe": {"exec": {"command": ["crash", "$(DB_PASSWORD)"]}, "periodSeconds": 1},
    }
    async with world(exec_handler=exec_handler) as w:
        sandbox = w.runtime.add_sandbox(
            "web", namespace="shop", annotations={ANNOTATION + "app": json.dumps(override)}
        )
        w.runtime.add_container(sandbox, "app", env={"DB_PASSWORD": SECRET})
        with structlog.testing.capture_logs() as logs:
            await w.relist()
            await w.watcher.until(
                lambda: (
                    bool(w.attempts(ProbeKind.READINESS))
                    and any(t.kind is ProbeKind.LIVENESS for t in w.watcher.transitions[1:])
                ),
                timeout=HANG_GUARD,
            )
        [probed] = w.manager.probed()
    assert ["check", SECRET] in seen
    assert ["crash", SECRET] in seen
    texts: list[str] = [repr(entry) for entry in logs]
    texts += [repr(event.record) for event in w.watcher.records]
    # (A ResultChanged's container carries the env itself; what it reports is its output.)
    texts += [t.output for t in w.watcher.transitions if isinstance(t, ResultChanged)]
    texts += [repr(list(p.history)) + repr(p.last_record) for p in probed.probes]
    assert not [text for text in texts if SECRET in text]
    errored = [e for e in logs if e["event"] == "probe_errored"]
    assert errored
    assert "crash', '$(DB_PASSWORD)']" in errored[0]["error"]
    assert any("bad password $(DB_PASSWORD)" in r.record.output for r in w.watcher.records)


# -- flags ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--annotation-probe-hosts", "10.0.0.1/8"], "--annotation-probe-hosts"),
        (["--annotation-probe-hosts", "10.0.0.0/8,bogus"], "'bogus'"),
        (["--annotations", "some"], "--annotations"),
    ],
)
def test_bad_annotation_flags_exit_2(args: list[str], named: str) -> None:
    # The command itself, not the group: the group configures logging for the whole process.
    result = CliRunner().invoke(serve, ["-r", "unix:///nonexistent.sock", *args])
    assert result.exit_code == 2, result.output
    assert named in result.output


def test_help_documents_the_flags() -> None:
    result = CliRunner().invoke(serve, ["--help"])
    assert "--annotations [off|exec-only|all]" in result.output
    assert "--annotation-probe-hosts CIDR[,CIDR...]" in result.output


async def test_daemon_wires_the_flags(tmp_path: Path) -> None:
    """ServeConfig reaches the manager (mode) and the prober (hosts); the default is all, with
    no explicit host allowed."""
    assert ServeConfig(endpoint=Endpoint("unix:///x", "flag", "unix:///x")).annotations == "all"
    endpoint = f"unix://{tmp_path}/cri.sock"
    config = ServeConfig(
        endpoint=Endpoint(endpoint, "flag", endpoint),
        state_file=None,
        annotations="exec-only",
        annotation_probe_hosts=AnnotationHosts.parse(["10.0.0.0/8"]),
    )
    daemon = Daemon(config, RulesFile(probes=()))
    try:
        assert daemon.manager.annotations == "exec-only"
        assert daemon.prober.annotation_hosts.denial("10.1.2.3") is None
        assert daemon.prober.annotation_hosts.denial("11.1.2.3") is not None
    finally:
        await daemon.cri.close()
