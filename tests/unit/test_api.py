"""The API server in-process, on the fake runtime: socket safety, name resolution edge cases, the
transition buffer's limit and incarnations, hostile filters and oversized requests, and shutdown.
(tests/containerd/test_api_serve.py covers the rest on a real ``serve`` and containerd.)
"""

from __future__ import annotations

import asyncio
import json
import socket
import stat
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cri_prober._gen.criprober.v1 import query_pb2, query_pb2_grpc
from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.daemon import Daemon, ServeConfig, read_rules
from cri_prober.discovery.naming import SHOWN_CHARS
from cri_prober.errors import ConfigError
from cri_prober.probing.spec import RulesFile
from cri_prober.runtime.endpoints import Endpoint
from cri_prober.serving.address import parse_listen
from cri_prober.serving.query import INCARNATION_METADATA_KEY, MAX_DETAIL_BYTES
from cri_prober.serving.server import ApiServer, start_api
from cri_prober.serving.transitions import DEFAULT_BUFFER_SIZE
from tests.support.fake_runtime import FakeContainer, FakeRuntime, FakeRuntimeServer
from tests.support.serve import cli_env
from tests.support.waiting import HANG_GUARD, until
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
    task: asyncio.Task[int]

    async def stop(self) -> None:
        self.daemon.stop_event.set()
        await self.task


async def start_daemon(runtime: FakeRuntime, target: str, tmp_path: Path) -> World:
    """A daemon on the fake runtime at ``target``, serving its API at ``tmp_path/api.sock``."""
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(RULES)
    config = ServeConfig(
        endpoint=Endpoint(target, "flag", target),
        config_file=rules_file,
        listen=f"unix://{tmp_path}/api.sock",
        pleg="relist",
        relist_period=0.1,
    )
    daemon = Daemon(config, read_rules(rules_file))
    task = asyncio.create_task(daemon.run())
    await asyncio.wait_for(daemon.ready.wait(), HANG_GUARD)
    return World(runtime, daemon, tmp_path / "api.sock", task)


@pytest.fixture(name="runtime")
def _runtime() -> FakeRuntime:
    async def exec_handler(
        _container: FakeContainer, _cmd: list[str], _timeout: int
    ) -> api_pb2.ExecSyncResponse:
        return api_pb2.ExecSyncResponse(exit_code=0)

    return FakeRuntime(exec_handler=exec_handler)


@pytest.fixture(name="cri_server")
async def _cri_server(runtime: FakeRuntime, tmp_path: Path) -> AsyncIterator[FakeRuntimeServer]:
    async with FakeRuntimeServer(str(tmp_path / "cri.sock"), runtime) as server:
        yield server


@pytest.fixture(name="world")
async def _world(
    runtime: FakeRuntime, cri_server: FakeRuntimeServer, tmp_path: Path
) -> AsyncIterator[World]:
    world = await start_daemon(runtime, cri_server.target, tmp_path)
    yield world
    if not world.task.done():
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
        response = await stub.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=HANG_GUARD
        )
        status: int = response.status
        return status


class TestNames:
    async def test_ambiguous_prefix(self, world: World) -> None:
        """A prefix of two IDs is FAILED_PRECONDITION for GetContainer, NOT_FOUND for health."""
        sandbox = world.runtime.add_sandbox("web-0")
        first = world.runtime.add_container(sandbox, "app")
        world.runtime.add_container(sandbox, "sidecar")
        await until(
            lambda: world.daemon.discovery.container(first.id) is not None, timeout=HANG_GUARD
        )
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
        await until(
            lambda: world.daemon.discovery.container(done.id) is not None, timeout=HANG_GUARD
        )
        assert await health_status(f"unix:{world.socket}", "default/job-0") == NOT_SERVING
        assert await health_status(f"unix:{world.socket}", "default/job-0/task") == NOT_SERVING


class TestList:
    async def test_lists_the_server_and_every_container(self, world: World) -> None:
        """Health List answers "" and each container by namespace/pod/container."""
        sandbox = world.runtime.add_sandbox("web-0")
        app = world.runtime.add_container(sandbox, "app")
        await until(
            lambda: world.daemon.discovery.container(app.id) is not None, timeout=HANG_GUARD
        )
        async with grpc.aio.insecure_channel(f"unix:{world.socket}") as channel:
            health: Any = health_pb2_grpc.HealthStub(channel)
            response = await health.List(health_pb2.HealthListRequest(), timeout=HANG_GUARD)
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
            await watcher.until(lambda: small.transitions.sequence >= 4, timeout=HANG_GUARD)
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


def incarnation_of(world: World) -> str:
    assert world.daemon.api is not None
    return world.daemon.api.transitions.incarnation


class TestIncarnation:
    async def test_every_transition_and_the_stream_carry_it(self, world: World) -> None:
        """Each Transition names its incarnation; the stream's initial metadata says it first."""
        world.runtime.add_container(world.runtime.add_sandbox("web-0"), "app")
        incarnation = incarnation_of(world)
        async with grpc.aio.insecure_channel(f"unix:{world.socket}") as channel:
            api = query_pb2_grpc.CriProberStub(channel)
            call = api.WatchTransitions(query_pb2.WatchTransitionsRequest(since_sequence=0))
            try:
                metadata: Any = await call.initial_metadata()
                assert metadata[INCARNATION_METADATA_KEY] == incarnation
                first = await asyncio.wait_for(call.read(), HANG_GUARD)
            finally:
                call.cancel()
        assert isinstance(first, query_pb2.Transition)
        assert (first.sequence, first.incarnation) == (1, incarnation)

    async def test_resume_across_a_restart_is_out_of_range(
        self, world: World, runtime: FakeRuntime, cri_server: FakeRuntimeServer, tmp_path: Path
    ) -> None:
        """After a restart, sequence N of the old process never replays the new one's N+1...

        The finding: sequences start again at 1, so `since 1` used to replay the new process's
        2, 3, ... as if they followed the old 1. With its incarnation it is OUT_OF_RANGE, saying
        which process runs now and since when; without one it is refused as ambiguous.
        """
        for pod in ("web-0", "web-1"):
            runtime.add_container(runtime.add_sandbox(pod), "app")
        old = incarnation_of(world)
        watcher = ManagerWatcher(world.daemon.manager)
        try:
            assert world.daemon.api is not None
            api_log = world.daemon.api.transitions
            await watcher.until(lambda: api_log.sequence >= 2, timeout=HANG_GUARD)
        finally:
            watcher.unsubscribe()
        await world.stop()

        new_world = await start_daemon(runtime, cri_server.target, tmp_path)
        try:
            new = incarnation_of(new_world)
            assert new != old
            watcher = ManagerWatcher(new_world.daemon.manager)
            assert new_world.daemon.api is not None
            new_log = new_world.daemon.api.transitions
            try:
                # The new process has issued sequences 1 and 2 of its own.
                await watcher.until(lambda: new_log.sequence >= 2, timeout=HANG_GUARD)
            finally:
                watcher.unsubscribe()
            async with grpc.aio.insecure_channel(f"unix:{new_world.socket}") as channel:
                api = query_pb2_grpc.CriProberStub(channel)
                resumed = query_pb2.WatchTransitionsRequest(since_sequence=1, incarnation=old)
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await api.WatchTransitions(resumed).read()
                assert error.value.code() == grpc.StatusCode.OUT_OF_RANGE
                assert (error.value.details() or "").startswith(
                    f"sequence 1 belongs to incarnation {old}; this cri-prober is {new}, "
                    "started at "
                )
                bare = query_pb2.WatchTransitionsRequest(since_sequence=1)
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await api.WatchTransitions(bare).read()
                assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "needs the incarnation it came from" in (error.value.details() or "")
                # The new incarnation's own resume point replays as before.
                own = api.WatchTransitions(
                    query_pb2.WatchTransitionsRequest(since_sequence=1, incarnation=new)
                )
                try:
                    replayed = await asyncio.wait_for(own.read(), HANG_GUARD)
                finally:
                    own.cancel()
                assert isinstance(replayed, query_pb2.Transition)
                assert (replayed.sequence, replayed.incarnation) == (2, new)
        finally:
            await new_world.stop()


# A nested quantifier that Python's re (a backtracking engine) takes 2^n steps to reject on a
# name of n characters: ~18 s for a 29-character pod name, with the daemon's loop blocked, and
# over 200 days for this 49-character one, so that only a linear-time engine answers at all.
CATASTROPHIC = r"^([a-z0-9-]+)+\.svc$"
VICTIM_POD = "checkout-api-canary-europe-west1-7f9c8d6b54-x2k4q"


class TestFilters:
    async def test_a_backtracking_pattern_cannot_freeze_the_daemon(self, world: World) -> None:
        """The catastrophic filter answers at once, and health answers meanwhile.

        At once is shown without a clock: against this name a backtracking engine would block
        the daemon's loop for months, so an answer at all (the RPCs' deadlines and pytest's
        timeout are the guards) means the filter ran in linear time; no time is measured, as a
        busy machine stretches any answer."""
        assert len(VICTIM_POD) == 49
        victim = world.runtime.add_container(world.runtime.add_sandbox(VICTIM_POD), "app")
        match = world.runtime.add_container(world.runtime.add_sandbox("cache.svc"), "app")
        await until(
            lambda: all(world.daemon.discovery.container(c.id) for c in (victim, match)),
            timeout=HANG_GUARD,
        )
        request = query_pb2.ListContainersRequest(
            filter=query_pb2.ContainerFilter(pod=CATASTROPHIC), all=True
        )
        async with grpc.aio.insecure_channel(f"unix:{world.socket}") as channel:
            api = query_pb2_grpc.CriProberStub(channel)
            health: Any = health_pb2_grpc.HealthStub(channel)
            listing = asyncio.ensure_future(api.ListContainers(request, timeout=60))
            status = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=60)
            listed = await listing
        assert status.status == SERVING
        assert [c.pod_name for c in listed.containers] == ["cache.svc"]

    @pytest.mark.parametrize(
        ("pattern", "expected"),
        [
            (r"(web)-\1", "invalid escape sequence"),  # a backreference
            (r"(?<=web)-0", "invalid perl operator"),  # lookbehind
            (r"web(?=-0)", "invalid perl operator"),  # lookahead
            (r"a++", "bad repetition operator"),  # possessive
            (r"web-\Z", "invalid escape sequence"),  # Python's \Z is RE2's \z
            ("(", "missing )"),
        ],
    )
    async def test_syntax_re2_lacks_is_invalid_argument(
        self, world: World, pattern: str, expected: str
    ) -> None:
        """What RE2 has no syntax for is INVALID_ARGUMENT, saying so and why."""
        request = query_pb2.ListContainersRequest(filter=query_pb2.ContainerFilter(pod=pattern))
        async with grpc.aio.insecure_channel(f"unix:{world.socket}") as channel:
            api = query_pb2_grpc.CriProberStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await api.ListContainers(request, timeout=HANG_GUARD)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = error.value.details() or ""
        assert details.startswith(f"filter.pod: invalid regular expression {pattern!r}: ")
        assert expected in details
        assert "RE2 syntax, like crictl" in details

    async def test_crictl_style_matching_is_kept(self, world: World) -> None:
        """Searched anywhere (not anchored), flags and classes as in Go's regexp (crictl)."""
        app = world.runtime.add_container(world.runtime.add_sandbox("web-10"), "app")
        await until(
            lambda: world.daemon.discovery.container(app.id) is not None, timeout=HANG_GUARD
        )
        async with grpc.aio.insecure_channel(f"unix:{world.socket}") as channel:
            api = query_pb2_grpc.CriProberStub(channel)

            async def pods(**fields: str) -> list[str]:
                request = query_pb2.ListContainersRequest(
                    filter=query_pb2.ContainerFilter(**fields)
                )
                response = await api.ListContainers(request, timeout=HANG_GUARD)
                return [c.pod_name for c in response.containers]

            assert await pods(pod="eb-1") == ["web-10"]
            assert await pods(pod=r"^web-\d+$", name="^app$", namespace="def") == ["web-10"]
            assert await pods(pod="(?i)WEB") == ["web-10"]
            assert await pods(pod="^eb") == []

    async def test_a_pattern_longer_than_the_cap_is_invalid_argument(self, world: World) -> None:
        """Each filter field holds at most 256 characters."""
        async with grpc.aio.insecure_channel(f"unix:{world.socket}") as channel:
            api = query_pb2_grpc.CriProberStub(channel)
            await api.ListContainers(
                query_pb2.ListContainersRequest(filter=query_pb2.ContainerFilter(pod="a" * 256))
            )
            for field in ("id", "name", "namespace", "pod"):
                request = query_pb2.ListContainersRequest(
                    filter=query_pb2.ContainerFilter(**{field: "a" * 257})
                )
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await api.ListContainers(request, timeout=HANG_GUARD)
                assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert error.value.details() == f"filter.{field}: 257 characters, more than 256"


# -- requests bounded in size ---------------------------------------------------------------------

FILL = "z" * 60_000  # fits the 64 KiB message cap; far beyond every field's own cap


def _echoes_little(details: str, quoted: int = SHOWN_CHARS) -> bool:
    """An error quotes at most ``quoted`` characters of what was sent, within the detail cap."""
    return len(details.encode()) <= MAX_DETAIL_BYTES and "z" * (quoted + 1) not in details


class TestRequestBounds:
    async def test_oversized_fields_are_refused_and_never_echoed(self, world: World) -> None:
        """Every string field has a cap; the error names it and quotes at most 128 characters."""
        async with grpc.aio.insecure_channel(f"unix:{world.socket}") as channel:
            api = query_pb2_grpc.CriProberStub(channel)
            health: Any = health_pb2_grpc.HealthStub(channel)
            spec = json.dumps({"exec": {"command": ["echo", FILL[:20_000]]}})
            invalid = grpc.StatusCode.INVALID_ARGUMENT
            not_found = grpc.StatusCode.NOT_FOUND
            cases: list[tuple[str, Callable[[], Awaitable[Any]], grpc.StatusCode, str]] = [
                (
                    "GetContainer target",
                    lambda: api.GetContainer(query_pb2.GetContainerRequest(target=FILL)),
                    invalid,
                    "longer than 512 characters",
                ),
                (
                    "GetContainer namespace/pod/container",
                    lambda: api.GetContainer(
                        query_pb2.GetContainerRequest(target=f"default/{FILL}/app")
                    ),
                    invalid,
                    "longer than 512 characters",
                ),
                (
                    "TriggerProbe kind",
                    lambda: api.TriggerProbe(
                        query_pb2.TriggerProbeRequest(target="default/web-0/app", kind=FILL)
                    ),
                    invalid,
                    "kind: unknown probe kind 'zzz",
                ),
                (
                    "RunProbe kind",
                    lambda: api.RunProbe(
                        query_pb2.RunProbeRequest(target="x", probe_json="{}", kind=FILL)
                    ),
                    invalid,
                    "(60000 characters)",
                ),
                (
                    "RunProbe probe_json",
                    lambda: api.RunProbe(
                        query_pb2.RunProbeRequest(target="default/web-0/app", probe_json=spec)
                    ),
                    invalid,
                    f"probe_json: {len(spec)} characters, more than the 16384",
                ),
                (
                    "RunProbe target",
                    lambda: api.RunProbe(
                        query_pb2.RunProbeRequest(
                            target=FILL, probe_json='{"exec": {"command": ["true"]}}'
                        )
                    ),
                    invalid,
                    "not a container name",
                ),
                (
                    "ListContainers filter",
                    lambda: api.ListContainers(
                        query_pb2.ListContainersRequest(filter=query_pb2.ContainerFilter(name=FILL))
                    ),
                    invalid,
                    "filter.name: 60000 characters, more than 256",
                ),
                (
                    "WatchTransitions incarnation",
                    lambda: api.WatchTransitions(
                        query_pb2.WatchTransitionsRequest(since_sequence=1, incarnation=FILL)
                    ).read(),
                    invalid,
                    "incarnation: 'zzzzzzzzzzzzzzzz'… (60000 characters) is not one",
                ),
                (
                    "Health container name",
                    lambda: health.Check(health_pb2.HealthCheckRequest(service=FILL)),
                    not_found,
                    "longer than 512 characters",
                ),
                (
                    "Health pod name",
                    lambda: health.Check(health_pb2.HealthCheckRequest(service=f"ns/{FILL}")),
                    not_found,
                    "unknown service: no pod 'ns/zzz",
                ),
            ]
            for label, call, code, expected in cases:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await asyncio.wait_for(call(), HANG_GUARD)
                details = error.value.details() or ""
                assert (error.value.code(), label) == (code, label), details[:300]
                assert expected in details, (label, details[:300])
                assert _echoes_little(details, SHOWN_CHARS), (label, len(details))

    async def test_a_request_over_64_kib_is_resource_exhausted(self, world: World) -> None:
        """The server takes messages of at most 64 KiB; a 1 MB one never reaches a handler."""
        async with grpc.aio.insecure_channel(f"unix:{world.socket}") as channel:
            api = query_pb2_grpc.CriProberStub(channel)
            request = query_pb2.GetContainerRequest(target="z" * 1_000_000)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await api.GetContainer(request, timeout=HANG_GUARD)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in (error.value.details() or "")


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def _oversized_round(api: Any, health: Any, size: int) -> list[grpc.StatusCode]:
    """One request of ``size`` characters to each RPC that takes a name, filter or spec."""
    text = "z" * size
    calls = [
        api.GetContainer(query_pb2.GetContainerRequest(target=text), timeout=HANG_GUARD),
        api.RunProbe(
            query_pb2.RunProbeRequest(target=text, probe_json='{"exec":{"command":["true"]}}'),
            timeout=HANG_GUARD,
        ),
        api.RunProbe(query_pb2.RunProbeRequest(target="x", probe_json=text), timeout=HANG_GUARD),
        api.ListContainers(
            query_pb2.ListContainersRequest(filter=query_pb2.ContainerFilter(pod=text)),
            timeout=HANG_GUARD,
        ),
        health.Check(health_pb2.HealthCheckRequest(service=text), timeout=HANG_GUARD),
    ]
    codes = []
    for call in calls:
        try:
            await call
            codes.append(grpc.StatusCode.OK)
        except grpc.aio.AioRpcError as error:
            codes.append(error.code())
    return codes


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
async def test_daemon_rss_stays_flat_after_oversized_requests(
    cri_server: FakeRuntimeServer, runtime: FakeRuntime, tmp_path: Path
) -> None:
    """A real ``serve`` process keeps its RSS after 1-4 MB (and 60 KB) names, filters and specs.

    The finding: gRPC's default 4 MiB messages were accepted (and echoed back), and the daemon's
    RSS went from 57 to 198 MB after a series of them, never returned. On the code before the
    caps this test saw 100 -> 321 MB.
    """
    runtime.add_container(runtime.add_sandbox("web-0"), "app")
    socket_path = tmp_path / "api.sock"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cri_prober", "serve",
        "-r", cri_server.target,
        "--listen", f"unix://{socket_path}",
        "--state-file", "none",
        "--log-level", "warning",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        env=cli_env(),
    )  # fmt: skip
    try:
        async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
            api = query_pb2_grpc.CriProberStub(channel)
            health: Any = health_pb2_grpc.HealthStub(channel)
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""), wait_for_ready=True)
            async with asyncio.timeout(HANG_GUARD):
                async for response in watch:
                    if response.status == SERVING:
                        break
            watch.cancel()
            # One round first: gRPC's own buffers and pools reach their working size.
            await _oversized_round(api, health, 60_000)
            await _oversized_round(api, health, 1_000_000)
            before = _rss_mib(process.pid)
            codes: set[grpc.StatusCode] = set()
            for index in range(16):
                size = 60_000 if index % 2 else (1 + index % 4) * 1_000_000
                codes.update(await _oversized_round(api, health, size))
            after = _rss_mib(process.pid)
            # Still answering normally.
            await api.ListContainers(query_pb2.ListContainersRequest(), timeout=HANG_GUARD)
    finally:
        process.terminate()
        _out, err = await process.communicate()
    assert after - before < 16, (before, after)
    assert codes <= {
        grpc.StatusCode.RESOURCE_EXHAUSTED,  # over 64 KiB
        grpc.StatusCode.INVALID_ARGUMENT,  # over a field's cap
        grpc.StatusCode.NOT_FOUND,  # a health service name that names nothing
    }, (codes, err.decode()[-2000:])


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
