"""A worker's prepared probe (issue 36): the address, port, URL and request bytes are resolved once
and reused at every attempt, and resolved again at the next attempt when anything they depend on
changes (the pod's IP, a named port's number, the kubelet's release), as the kubelet's are."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import pytest

from cri_prober.discovery.model import ContainerInfo, PodInfo
from cri_prober.manager.probe_manager import ProbeManager, _WorkerHook
from cri_prober.manager.slots import Slot, SlotKey
from cri_prober.probing.handlers import http
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.kubelet_profile import KubeletProfile
from cri_prober.probing.outcome import ProbeError, ProbeResult
from cri_prober.probing.prober import Prober, ProbeTarget
from cri_prober.probing.spec import KUBELET_PORTS_ANNOTATION, ResolvedProbe, parse_probe_json
from cri_prober.probing.worker import ContainerView
from cri_prober.runtime.model import ContainerState
from tests.support.waiting import HANG_GUARD


class Server:
    """A listener that answers every request 200 and keeps the request heads it read."""

    def __init__(self) -> None:
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int = 0) -> int:
        self.server = await asyncio.start_server(self._serve, host, port)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.requests.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture(name="servers")
async def _servers() -> AsyncIterator[Callable[[], Server]]:
    made: list[Server] = []

    def make() -> Server:
        made.append(Server())
        return made[-1]

    yield make
    for server in made:
        await server.close()


class Manager:
    """What a worker hook reads of its manager, for these attempts."""

    def __init__(self, prober: Prober) -> None:
        self.prober = prober
        self.kubelet = KubeletProfile()
        self.unsupported: list[str] = []

    def _unsupported_probe(self, slot: Slot, kind: ProbeKind, error: str) -> None:
        self.unsupported.append(error)


def container(ip: str, *, ports: object = None, started_at: int = 1) -> ContainerInfo:
    annotations = {} if ports is None else {KUBELET_PORTS_ANNOTATION: json.dumps(ports)}
    pod = PodInfo(
        sandbox_id="sandbox-1", name="web", namespace="default", uid="uid-1", attempt=0,
        ready=True, ip=ip, host_network=False, labels={}, annotations={}, created_at=1,
    )  # fmt: skip
    return ContainerInfo(
        id="c1", pod_sandbox_id="sandbox-1", name="app", attempt=0,
        state=ContainerState.CONTAINER_RUNNING, created_at=1, started_at=started_at,
        finished_at=0, exit_code=0, labels={}, annotations=annotations, env=None, pod=pod,
    )  # fmt: skip


def hook(prober: Prober, info: ContainerInfo, port: int | str) -> tuple[_WorkerHook, Slot]:
    probe = parse_probe_json(
        json.dumps({"httpGet": {"path": "/healthz", "port": port}}),
        ProbeKind.LIVENESS,
        source="test",
    )
    slot = Slot(key=SlotKey.of(info), container=info)
    manager = cast(ProbeManager, Manager(prober))
    return _WorkerHook(manager, slot, ProbeKind.LIVENESS, ResolvedProbe(probe, {})), slot


VIEW = ContainerView(id="c1", running=True, started_at=1.0, started=True)


@pytest.fixture(name="heads_built")
def _heads_built(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every HTTP/1.1 request head the handler builds."""
    built: list[bytes] = []
    original = http._request_head

    def counting(*args: Any) -> bytes:
        built.append(original(*args))
        return built[-1]

    monkeypatch.setattr(http, "_request_head", counting)
    return built


async def attempt(worker_hook: _WorkerHook) -> ProbeResult:
    async with asyncio.timeout(HANG_GUARD):
        return (await worker_hook.run_probe(VIEW)).result


async def test_repeated_attempts_send_the_request_built_once(
    servers: Callable[[], Server], heads_built: list[bytes]
) -> None:
    server = servers()
    port = await server.start("127.0.0.1")
    worker_hook, _ = hook(Prober(cast(Any, None)), container("127.0.0.1"), port)
    for _ in range(3):
        assert await attempt(worker_hook) is ProbeResult.SUCCESS
    assert len(heads_built) == 1  # on the code before issue 36: once per attempt
    assert len(server.requests) == 3
    assert server.requests[0].startswith(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:")
    assert len(set(server.requests)) == 1


async def test_an_equal_container_from_a_new_relist_keeps_the_prepared_probe(
    servers: Callable[[], Server], heads_built: list[bytes]
) -> None:
    """Discovery replaces the container object when anything about it changes; what the probe
    does not read (here its start time) does not rebuild the request."""
    server = servers()
    port = await server.start("127.0.0.1")
    worker_hook, slot = hook(Prober(cast(Any, None)), container("127.0.0.1"), port)
    assert await attempt(worker_hook) is ProbeResult.SUCCESS
    slot.container = container("127.0.0.1", started_at=2)
    assert await attempt(worker_hook) is ProbeResult.SUCCESS
    assert len(heads_built) == 1
    assert len(server.requests) == 2


async def test_a_changed_pod_ip_is_probed_at_the_next_attempt(
    servers: Callable[[], Server], heads_built: list[bytes]
) -> None:
    first, second = servers(), servers()
    port = await first.start("127.0.0.1")
    await second.start("127.0.0.2", port)  # the same port on the pod's new IP
    worker_hook, slot = hook(Prober(cast(Any, None)), container("127.0.0.1"), port)
    assert await attempt(worker_hook) is ProbeResult.SUCCESS
    slot.container = container("127.0.0.2")
    assert await attempt(worker_hook) is ProbeResult.SUCCESS
    assert await attempt(worker_hook) is ProbeResult.SUCCESS
    assert len(first.requests) == 1
    assert len(second.requests) == 2
    assert b"Host: 127.0.0.2:" in second.requests[0]
    assert len(heads_built) == 2  # once per address


async def test_a_renamed_port_is_resolved_again_at_the_next_attempt(
    servers: Callable[[], Server], heads_built: list[bytes]
) -> None:
    """A named port follows the kubelet's list of the container's ports: a container whose
    list maps the name to another number (or no longer names it) is probed accordingly."""
    first, second = servers(), servers()
    port1 = await first.start("127.0.0.1")
    port2 = await second.start("127.0.0.1")
    info = container("127.0.0.1", ports=[{"name": "web", "containerPort": port1}])
    worker_hook, slot = hook(Prober(cast(Any, None)), info, "web")
    assert await attempt(worker_hook) is ProbeResult.SUCCESS
    slot.container = container("127.0.0.1", ports=[{"name": "web", "containerPort": port2}])
    assert await attempt(worker_hook) is ProbeResult.SUCCESS
    assert (len(first.requests), len(second.requests)) == (1, 1)
    slot.container = container("127.0.0.1", ports=[{"name": "admin", "containerPort": port2}])
    for _ in range(2):  # every attempt errors, as before: nothing is sent
        with pytest.raises(ProbeError, match='port "web" not found'):
            await worker_hook.run_probe(VIEW)
    slot.container = info
    assert await attempt(worker_hook) is ProbeResult.SUCCESS
    assert (len(first.requests), len(second.requests)) == (2, 1)
    assert len(heads_built) == 3


async def test_a_new_kubelet_release_changes_the_user_agent_at_the_next_attempt(
    servers: Callable[[], Server], heads_built: list[bytes]
) -> None:
    server = servers()
    port = await server.start("127.0.0.1")
    prober = Prober(cast(Any, None), profile=KubeletProfile(33))
    worker_hook, _ = hook(prober, container("127.0.0.1"), port)
    assert await attempt(worker_hook) is ProbeResult.SUCCESS
    prober.profile = KubeletProfile(36)  # what the manager does once it reads the Node
    assert await attempt(worker_hook) is ProbeResult.SUCCESS
    assert b"User-Agent: kube-probe/1.33\r\n" in server.requests[0]
    assert b"User-Agent: kube-probe/1.36\r\n" in server.requests[1]
    assert len(heads_built) == 2


def test_a_prepared_probe_fits_only_what_it_was_built_for() -> None:
    prober = Prober(cast(Any, None))
    probe = parse_probe_json('{"tcpSocket": {"port": 80}}', ProbeKind.LIVENESS, source="test")
    target = ProbeTarget("c1", pod_ip="10.0.0.1")
    prepared = prober.prepare(probe, target)
    assert prepared.fits(prober, probe, dataclasses.replace(target), "rules")
    assert not prepared.fits(prober, probe, dataclasses.replace(target, pod_ip="10.0.0.2"), "rules")
    assert not prepared.fits(prober, probe, target, "annotation")
    assert not prepared.fits(Prober(cast(Any, None)), probe, target, "rules")
    other = parse_probe_json('{"tcpSocket": {"port": 81}}', ProbeKind.LIVENESS, source="test")
    assert not prepared.fits(prober, other, target, "rules")
    prober.node_address = "10.1.0.1"
    assert not prepared.fits(prober, probe, target, "rules")


async def test_an_unresolvable_probe_errors_at_every_attempt() -> None:
    """A probe that cannot be prepared raises the attempt's own error each time it runs."""
    prober = Prober(cast(Any, None))
    probe = parse_probe_json('{"httpGet": {"port": "web"}}', ProbeKind.LIVENESS, source="test")
    prepared = prober.prepare(probe, ProbeTarget("c1", pod_ip="10.0.0.1"))
    for _ in range(2):
        with pytest.raises(ProbeError, match='port "web" not found'):
            await prepared.run()
