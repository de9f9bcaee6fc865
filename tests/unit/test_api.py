"""The API server in-process, on the fake runtime: socket safety, name resolution edge cases, the
transition buffer's limit and shutdown. (tests/containerd/test_api_serve.py covers the rest on a
real ``serve`` and containerd.)
"""

from __future__ import annotations

import asyncio
import socket
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cri_prober._gen.criprober.v1 import query_pb2, query_pb2_grpc
from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.daemon import Daemon, ServeConfig, read_rules
from cri_prober.errors import ConfigError
from cri_prober.probing.spec import RulesFile
from cri_prober.runtime.endpoints import Endpoint
from cri_prober.serving.address import parse_listen
from cri_prober.serving.server import ApiServer, start_api
from cri_prober.serving.transitions import DEFAULT_BUFFER_SIZE
from tests.support.daemon import wait_until
from tests.support.fake_runtime import FakeContainer, FakeRuntime, FakeRuntimeServer
from tests.support.watchers import ManagerWatcher

RULES = """
probes:
  - match: {container: app}
    readinessProbe: {exec: {command: [check]}, periodSeconds: 1}
"""
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def serve(
    daemon: Daemon, listen: str, *, buffer_size: int = DEFAULT_BUFFER_SIZE
) -> ApiServer:
    """Start an API server of its own on ``daemon``'s discovery and manager."""
    return await start_api(
        listen, node=daemon.discovery, manager=daemon.manager, buffer_size=buffer_size
    )


@dataclass
class World:
    """A daemon serving the API at ``socket``, over a fake runtime."""

    runtime: FakeRuntime
    daemon: Daemon
    socket: Path
    task: asyncio.Task[None]

    async def stop(self) -> None:
        self.daemon.stop_event.set()
        await self.task


@pytest.fixture(name="world")
async def _world(tmp_path: Path) -> AsyncIterator[World]:
    async def exec_handler(
        _container: FakeContainer, _cmd: list[str], _timeout: int
    ) -> api_pb2.ExecSyncResponse:
        return api_pb2.ExecSyncResponse(exit_code=0)

    runtime = FakeRuntime(exec_handler=exec_handler)
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(RULES)
    async with FakeRuntimeServer(str(tmp_path / "cri.sock"), runtime) as server:
        config = ServeConfig(
            endpoint=Endpoint(server.target, "flag", server.target),
            config_file=rules_file,
            listen=f"unix://{tmp_path}/api.sock",
            pleg="relist",
            relist_period=0.1,
        )
        daemon = Daemon(config, read_rules(rules_file))
        task = asyncio.create_task(daemon.run())
        await asyncio.wait_for(daemon.ready.wait(), 10)
        world = World(runtime, daemon, tmp_path / "api.sock", task)
        yield world
        await world.stop()


@pytest.fixture(name="idle_daemon")
async def _idle_daemon() -> AsyncIterator[Daemon]:
    """A daemon that never runs: its discovery is empty and never healthy."""
    endpoint = Endpoint("unix:///nonexistent.sock", "flag", "unix:///nonexistent.sock")
    daemon = Daemon(ServeConfig(endpoint=endpoint), RulesFile(probes=()))
    yield daemon
    await daemon.cri.close()


class TestListenAddress:
    @pytest.mark.parametrize(
        ("uri", "grpc_address"),
        [
            ("unix:///run/x/api.sock", "unix:/run/x/api.sock"),
            ("tcp://127.0.0.1:50051", "127.0.0.1:50051"),
            ("tcp://[::1]:50051", "[::1]:50051"),
        ],
    )
    def test_valid(self, uri: str, grpc_address: str) -> None:
        """unix://ABSOLUTE and tcp://HOST:PORT are taken as given."""
        assert parse_listen(uri).grpc_address == grpc_address

    @pytest.mark.parametrize(
        "uri", ["unix://relative.sock", "tcp://127.0.0.1", "tcp://:80", "http://x:1", "/abs.sock"]
    )
    def test_invalid(self, uri: str) -> None:
        """Anything else is a configuration error naming the flag."""
        with pytest.raises(ConfigError, match="--listen"):
            parse_listen(uri)

    def test_path_too_long(self) -> None:
        """A socket path the kernel cannot bind is refused up front."""
        with pytest.raises(ConfigError, match="longer than 107 bytes"):
            parse_listen("unix:///" + "x" * 120)


class TestSocketSafety:
    async def test_private_dir_and_socket(self, idle_daemon: Daemon, tmp_path: Path) -> None:
        """Missing parent directories are created 0700; the socket is 0600 and gone at stop."""
        path = tmp_path / "a" / "b" / "api.sock"
        server = await serve(idle_daemon, f"unix://{path}")
        try:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o700
            assert stat.S_IMODE((tmp_path / "a" / "b").stat().st_mode) == 0o700
        finally:
            await server.stop()
            await server.stop()  # idempotent
        assert not path.exists()

    async def test_stale_socket_is_replaced(self, idle_daemon: Daemon, tmp_path: Path) -> None:
        """A socket file nobody answers on is a leftover and gets replaced."""
        path = tmp_path / "api.sock"
        with socket.socket(socket.AF_UNIX) as stale:
            stale.bind(str(path))
        server = await serve(idle_daemon, f"unix://{path}")
        try:
            assert await health_status(f"unix:{path}", "") == NOT_SERVING  # not relisted yet
        finally:
            await server.stop()

    async def test_live_socket_is_refused(self, idle_daemon: Daemon, tmp_path: Path) -> None:
        """A socket another server answers on is never taken over."""
        path = tmp_path / "api.sock"
        first = await serve(idle_daemon, f"unix://{path}")
        try:
            with pytest.raises(ConfigError, match="another process is serving"):
                await ApiServer(
                    parse_listen(f"unix://{path}"),
                    node=idle_daemon.discovery,
                    manager=idle_daemon.manager,
                    buffer_size=8,
                ).start()
            assert await health_status(f"unix:{path}", "") == NOT_SERVING
        finally:
            await first.stop()

    async def test_other_files_are_refused(self, idle_daemon: Daemon, tmp_path: Path) -> None:
        """A path holding anything but a socket is left alone."""
        path = tmp_path / "api.sock"
        path.write_text("precious")
        with pytest.raises(ConfigError, match="not a socket"):
            await serve(idle_daemon, f"unix://{path}")
        assert path.read_text() == "precious"

    async def test_tcp_as_given(self, idle_daemon: Daemon) -> None:
        """tcp://127.0.0.1:0 binds a free loopback port and serves there."""
        server = await serve(idle_daemon, "tcp://127.0.0.1:0")
        try:
            assert server.address.port > 0
            target = f"127.0.0.1:{server.address.port}"
            assert await health_status(target, "") == NOT_SERVING
        finally:
            await server.stop()


async def health_status(target: str, service: str) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        stub: Any = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        status: int = response.status
        return status


class TestNames:
    async def test_ambiguous_prefix(self, world: World) -> None:
        """A prefix of two IDs is FAILED_PRECONDITION for GetContainer, NOT_FOUND for health."""
        sandbox = world.runtime.add_sandbox("web-0")
        first = world.runtime.add_container(sandbox, "app")
        world.runtime.add_container(sandbox, "sidecar")
        await wait_until(lambda: world.daemon.discovery.container(first.id) is not None, timeout=10)
        prefix = first.id[:10]  # the fake runtime numbers its IDs: 0000000000...
        async with grpc.aio.insecure_channel(f"unix:{world.socket}") as channel:
            api = query_pb2_grpc.CriProberStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await api.GetContainer(query_pb2.GetContainerRequest(target=prefix))
            assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "ambiguous" in (error.value.details() or "")
            health: Any = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await health.Check(health_pb2.HealthCheckRequest(service=prefix))
            assert error.value.code() == grpc.StatusCode.NOT_FOUND
            assert "ambiguous" in (error.value.details() or "")

    async def test_pod_without_running_containers(self, world: World) -> None:
        """A pod whose containers all exited serves nothing."""
        sandbox = world.runtime.add_sandbox("job-0")
        done = world.runtime.add_container(sandbox, "task", state=api_pb2.CONTAINER_EXITED)
        await wait_until(lambda: world.daemon.discovery.container(done.id) is not None, timeout=10)
        assert await health_status(f"unix:{world.socket}", "default/job-0") == NOT_SERVING
        assert await health_status(f"unix:{world.socket}", "default/job-0/task") == NOT_SERVING


class TestList:
    async def test_lists_the_server_and_every_container(self, world: World) -> None:
        """Health List answers "" and each container by namespace/pod/container."""
        sandbox = world.runtime.add_sandbox("web-0")
        app = world.runtime.add_container(sandbox, "app")
        await wait_until(lambda: world.daemon.discovery.container(app.id) is not None, timeout=10)
        async with grpc.aio.insecure_channel(f"unix:{world.socket}") as channel:
            health: Any = health_pb2_grpc.HealthStub(channel)
            response = await health.List(health_pb2.HealthListRequest(), timeout=5)
        statuses = {name: entry.status for name, entry in response.statuses.items()}
        assert statuses.keys() == {"", "default/web-0/app"}
        assert statuses[""] == SERVING


class TestTransitionBuffer:
    async def test_overrun_is_out_of_range(self, world: World, tmp_path: Path) -> None:
        """Resuming from a sequence the buffer no longer holds is OUT_OF_RANGE, saying so."""
        small = await serve(world.daemon, f"unix://{tmp_path}/small.sock", buffer_size=2)
        # Subscribed after ``small``: it hears of each transition after ``small`` logged it.
        watcher = ManagerWatcher(world.daemon.manager)
        try:
            sandbox = world.runtime.add_sandbox("web-0")
            world.runtime.add_container(sandbox, "app")
            world.runtime.add_container(world.runtime.add_sandbox("web-1"), "app")
            # Each container's readiness goes none -> failure -> success: four transitions.
            await watcher.until(lambda: small.transitions.sequence >= 4, timeout=10)
            async with grpc.aio.insecure_channel(f"unix:{tmp_path}/small.sock") as channel:
                api = query_pb2_grpc.CriProberStub(channel)
                call = api.WatchTransitions(query_pb2.WatchTransitionsRequest(since_sequence=0))
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await call.read()
        finally:
            watcher.unsubscribe()
            await small.stop()
        assert error.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert "no longer buffered (only the last 2 are kept)" in (error.value.details() or "")


class TestShutdown:
    async def test_watchers_hear_not_serving_then_the_end(self, world: World) -> None:
        """At shutdown Watch sends NOT_SERVING and ends; WatchTransitions ends too."""
        async with grpc.aio.insecure_channel(f"unix:{world.socket}") as channel:
            health: Any = health_pb2_grpc.HealthStub(channel)
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == SERVING
            api = query_pb2_grpc.CriProberStub(channel)
            transitions = api.WatchTransitions(query_pb2.WatchTransitionsRequest())
            # A call after it on the same connection: the stream has reached the server.
            await api.ListContainers(query_pb2.ListContainersRequest())
            await world.stop()
            assert [response.status async for response in rest(watch)] == [NOT_SERVING]
            assert [transition async for transition in rest(transitions)] == []
            assert await watch.code() == grpc.StatusCode.OK
            assert await transitions.code() == grpc.StatusCode.OK


async def rest(call: Any) -> AsyncIterator[Any]:
    """What is left of a stream already read with ``read()`` (styles must not be mixed)."""
    while (message := await call.read()) is not grpc.aio.EOF:
        yield message


def test_in_progress_says_an_exec_past_its_timeout_waits_for_its_io() -> None:
    """D1: while an exec attempt waits out the kubelet's deadline, the API says what for."""
    from cri_prober.manager.state import ProbeState
    from cri_prober.probing.kinds import ProbeKind as Kind
    from cri_prober.probing.spec import parse_probe
    from cri_prober.serving.convert import in_progress, probe_status_pb

    def state(spec: dict[str, object], since: float | None) -> ProbeState:
        probe = parse_probe(spec, kind=Kind.LIVENESS, path="livenessProbe")
        return ProbeState(
            kind=Kind.LIVENESS,
            probe=probe,
            ports={},
            published=None,
            has_worker=True,
            active=True,
            on_hold=False,
            last_result=None,
            result_run=0,
            attempts=0,
            last_record=None,
            history=(),
            probing_since=since,
        )

    exec_spec: dict[str, object] = {"exec": {"command": ["sh"]}, "timeoutSeconds": 1}
    late = in_progress(state(exec_spec, 100.0), 105.0)
    assert late.startswith("exec running for 5.0s, past its 1s timeout")
    assert "waiting for the exec's I/O to drain" in late
    assert in_progress(state(exec_spec, 100.0), 100.5) == "exec running for 0.5s"
    tcp_spec: dict[str, object] = {"tcpSocket": {"port": 1}}
    assert in_progress(state(tcp_spec, 100.0), 105.0) == "probe running for 5.0s"
    assert in_progress(state(exec_spec, None), 105.0) == ""
    status = probe_status_pb(state(exec_spec, 100.0), detail=False)
    assert status.HasField("probing_since")
    assert status.in_progress.startswith("exec running for")
    idle = probe_status_pb(state(exec_spec, None), detail=False)
    assert (idle.HasField("probing_since"), idle.in_progress) == (False, "")
