"""An in-process fake CRI runtime served over a real gRPC unix socket, for error paths and scale.

It keeps sandboxes and containers in memory, records every call, answers scripted gRPC errors
per method (like cri-api's fake runtime service), runs ExecSync through a pluggable async handler
and streams container events when asked to. It never replaces a real containerd in tests of
behaviour the runtime defines; it exists for what a real runtime cannot be made to do on cue.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from cri_prober._gen.runtime.v1 import api_pb2, api_pb2_grpc

ExecHandler = Callable[["FakeContainer", list[str], int], Awaitable[api_pb2.ExecSyncResponse]]
# Awaited after an exec's command ended (normally or killed at its timeout): a stand-in for a
# background child still holding the exec's stdout.
ExecDrain = Callable[["FakeContainer", list[str]], Awaitable[None]]


@dataclass
class FakeSandbox:
    """A sandbox held by the fake runtime."""

    id: str
    name: str
    namespace: str
    uid: str
    attempt: int = 0
    ready: bool = True
    ip: str = ""
    host_network: bool = False
    created_at: int = field(default_factory=time.time_ns)
    additional_ips: list[str] = field(default_factory=list)  # e.g. the IPv6 one on dual-stack
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass
class FakeContainer:
    """A container held by the fake runtime."""

    id: str
    sandbox_id: str
    name: str
    attempt: int = 0
    state: int = api_pb2.CONTAINER_RUNNING
    created_at: int = field(default_factory=time.time_ns)
    started_at: int = 0
    finished_at: int = 0
    exit_code: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


async def exit_zero(_c: FakeContainer, _cmd: list[str], _timeout: int) -> api_pb2.ExecSyncResponse:
    """Default exec behaviour: every command succeeds at once with no output."""
    return api_pb2.ExecSyncResponse(exit_code=0)


class FakeRuntime(api_pb2_grpc.RuntimeServiceServicer):
    """The servicer: state, scripted errors and call records.

    ``errors[method]`` is a queue of gRPC status codes answered (one per call) before the method
    behaves normally again; ``unimplemented`` lists methods that always answer UNIMPLEMENTED.
    """

    def __init__(self, *, exec_handler: ExecHandler = exit_zero) -> None:
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.containers: dict[str, FakeContainer] = {}
        self.calls: list[str] = []
        self.errors: dict[str, collections.deque[grpc.StatusCode]] = collections.defaultdict(
            collections.deque
        )
        self.unimplemented: set[str] = set()
        self.exec_handler = exec_handler
        # What Version reports; tests set a containerd name/version to steer version-based choices.
        self.runtime_name = "fake"
        self.runtime_version = "0.0.0-fake"
        # False imitates a runtime that ignores the exec timeout altogether.
        self.enforce_exec_timeout = True
        # Set, it imitates containerd with drain_exec_sync_io_timeout = 0: after the command
        # ends (exits, or is killed at its timeout) the answer waits for the exec's output to
        # close, however long past the timeout that is.
        self.exec_drain: ExecDrain | None = None
        # (container ID, grace seconds) of every StopContainer call, and an event that is set
        # on each, so tests can await a stop instead of polling for it.
        self.stop_requests: list[tuple[str, int]] = []
        self.container_stopped = asyncio.Event()
        self.execs_in_flight = 0
        self.max_execs_in_flight = 0
        self._event_queues: list[asyncio.Queue[api_pb2.ContainerEventResponse | None]] = []
        # Set whenever a GetContainerEvents stream opens or closes (`event_subscribers` changes).
        self.subscribers_changed = asyncio.Event()
        self._ids = itertools.count(1)

    # -- scripting ------------------------------------------------------------------------------

    def fail_next(self, method: str, *codes: grpc.StatusCode) -> None:
        """Answer the next ``len(codes)`` calls of ``method`` with these status codes."""
        self.errors[method].extend(codes)

    def add_sandbox(
        self,
        name: str,
        *,
        namespace: str = "default",
        ip: str = "",
        host_network: bool = False,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        additional_ips: Sequence[str] = (),
    ) -> FakeSandbox:
        """Create a ready sandbox and return it."""
        sandbox = FakeSandbox(
            id=self._new_id(),
            name=name,
            namespace=namespace,
            uid=str(uuid.uuid4()),
            ip=ip,
            additional_ips=list(additional_ips),
            host_network=host_network,
            labels=dict(labels or {}),
            annotations=dict(annotations or {}),
        )
        self.sandboxes[sandbox.id] = sandbox
        return sandbox

    def add_container(
        self,
        sandbox: FakeSandbox,
        name: str,
        *,
        attempt: int = 0,
        state: int = api_pb2.CONTAINER_RUNNING,
        annotations: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> FakeContainer:
        """Create a container in ``sandbox`` (labelled the way the kubelet labels them)."""
        labels = {
            "io.kubernetes.pod.name": sandbox.name,
            "io.kubernetes.pod.namespace": sandbox.namespace,
            "io.kubernetes.pod.uid": sandbox.uid,
            "io.kubernetes.container.name": name,
        }
        container = FakeContainer(
            id=self._new_id(),
            sandbox_id=sandbox.id,
            name=name,
            attempt=attempt,
            state=state,
            labels=labels,
            annotations=dict(annotations or {}),
            env=dict(env or {}),
        )
        if state == api_pb2.CONTAINER_RUNNING:
            container.started_at = time.time_ns()
        self.containers[container.id] = container
        self.emit(container.id, api_pb2.CONTAINER_STARTED_EVENT)
        return container

    def exit_container(self, container_id: str, exit_code: int = 0) -> None:
        """Mark a container exited, as if its process ended."""
        container = self.containers[container_id]
        container.state = api_pb2.CONTAINER_EXITED
        container.finished_at = time.time_ns()
        container.exit_code = exit_code
        self.emit(container_id, api_pb2.CONTAINER_STOPPED_EVENT)

    def remove_container(self, container_id: str) -> None:
        """Forget a container, as RemoveContainer would."""
        self.containers.pop(container_id, None)
        self.emit(container_id, api_pb2.CONTAINER_DELETED_EVENT)

    def remove_sandbox(self, sandbox_id: str) -> None:
        """Forget a sandbox and its containers."""
        for cid in [c.id for c in self.containers.values() if c.sandbox_id == sandbox_id]:
            self.remove_container(cid)
        self.sandboxes.pop(sandbox_id, None)

    def emit(self, container_id: str, event_type: int) -> None:
        """Send an event to every GetContainerEvents subscriber (containerd 2.x broadcasts)."""
        if not self._event_queues:
            return
        container = self.containers.get(container_id)
        sandbox = self.sandboxes.get(container.sandbox_id) if container else None
        event = api_pb2.ContainerEventResponse(
            container_id=container_id,
            container_event_type=event_type,  # type: ignore[arg-type]
            created_at=time.time_ns(),
        )
        if sandbox is not None:
            event.pod_sandbox_status.CopyFrom(self._sandbox_status(sandbox))
            event.containers_statuses.extend(
                self._container_status(c)
                for c in self.containers.values()
                if c.sandbox_id == sandbox.id
            )
        for queue in self._event_queues:
            queue.put_nowait(event)

    def end_event_streams(self) -> None:
        """End every open GetContainerEvents stream (as a runtime restart would)."""
        for queue in self._event_queues:
            queue.put_nowait(None)

    @property
    def event_subscribers(self) -> int:
        """How many GetContainerEvents streams are open."""
        return len(self._event_queues)

    # -- helpers --------------------------------------------------------------------------------

    def _new_id(self) -> str:
        return f"{next(self._ids):064x}"

    async def _enter(self, method: str, context: grpc.aio.ServicerContext) -> None:  # type: ignore[type-arg]
        self.calls.append(method)
        if method in self.unimplemented:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"method {method} not implemented")
        queue = self.errors.get(method)
        if queue:
            code = queue.popleft()
            await context.abort(code, f"scripted {code.name} for {method}")

    @staticmethod
    def _lookup(table: Mapping[str, object], ident: str) -> str | None:
        """Resolve a full ID or a unique prefix, as containerd does."""
        if ident in table:
            return ident
        matches = [key for key in table if key.startswith(ident)] if ident else []
        return matches[0] if len(matches) == 1 else None

    async def _require(
        self,
        table: Mapping[str, object],
        ident: str,
        context: grpc.aio.ServicerContext,  # type: ignore[type-arg]
    ) -> str:
        """Resolve ``ident`` in ``table`` or answer NOT_FOUND."""
        key = self._lookup(table, ident)
        if key is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{ident!r} not found")
            raise AssertionError("abort raises")  # pragma: no cover
        return key

    def _sandbox_pb(self, s: FakeSandbox) -> api_pb2.PodSandbox:
        return api_pb2.PodSandbox(
            id=s.id,
            metadata=api_pb2.PodSandboxMetadata(
                name=s.name, uid=s.uid, namespace=s.namespace, attempt=s.attempt
            ),
            state=api_pb2.SANDBOX_READY if s.ready else api_pb2.SANDBOX_NOTREADY,
            created_at=s.created_at,
            labels=s.labels,
            annotations=s.annotations,
        )

    def _sandbox_status(self, s: FakeSandbox) -> api_pb2.PodSandboxStatus:
        status = api_pb2.PodSandboxStatus(
            id=s.id,
            metadata=api_pb2.PodSandboxMetadata(
                name=s.name, uid=s.uid, namespace=s.namespace, attempt=s.attempt
            ),
            state=api_pb2.SANDBOX_READY if s.ready else api_pb2.SANDBOX_NOTREADY,
            created_at=s.created_at,
            network=api_pb2.PodSandboxNetworkStatus(
                ip=s.ip, additional_ips=[api_pb2.PodIP(ip=ip) for ip in s.additional_ips]
            ),
            labels=s.labels,
            annotations=s.annotations,
        )
        if s.host_network:
            status.linux.namespaces.options.network = api_pb2.NODE
        return status

    def _container_pb(self, c: FakeContainer) -> api_pb2.Container:
        return api_pb2.Container(
            id=c.id,
            pod_sandbox_id=c.sandbox_id,
            metadata=api_pb2.ContainerMetadata(name=c.name, attempt=c.attempt),
            image=api_pb2.ImageSpec(image="fake"),
            state=c.state,  # type: ignore[arg-type]
            created_at=c.created_at,
            labels=c.labels,
            annotations=c.annotations,
        )

    def _container_status(self, c: FakeContainer) -> api_pb2.ContainerStatus:
        return api_pb2.ContainerStatus(
            id=c.id,
            metadata=api_pb2.ContainerMetadata(name=c.name, attempt=c.attempt),
            state=c.state,  # type: ignore[arg-type]
            created_at=c.created_at,
            started_at=c.started_at,
            finished_at=c.finished_at,
            exit_code=c.exit_code,
            labels=c.labels,
            annotations=c.annotations,
        )

    # -- RuntimeService -------------------------------------------------------------------------

    async def Version(self, request, context):  # noqa: N802 - gRPC method name
        await self._enter("Version", context)
        return api_pb2.VersionResponse(
            version="0.1.0",
            runtime_name=self.runtime_name,
            runtime_version=self.runtime_version,
            runtime_api_version="v1",
        )

    async def Status(self, request, context):  # noqa: N802 - gRPC method name
        await self._enter("Status", context)
        return api_pb2.StatusResponse(
            status=api_pb2.RuntimeStatus(
                conditions=[
                    api_pb2.RuntimeCondition(type="RuntimeReady", status=True),
                    api_pb2.RuntimeCondition(type="NetworkReady", status=True),
                ]
            )
        )

    async def ListPodSandbox(self, request, context):  # noqa: N802 - gRPC method name
        await self._enter("ListPodSandbox", context)
        return api_pb2.ListPodSandboxResponse(
            items=[self._sandbox_pb(s) for s in self.sandboxes.values()]
        )

    async def PodSandboxStatus(self, request, context):  # noqa: N802 - gRPC method name
        await self._enter("PodSandboxStatus", context)
        key = await self._require(self.sandboxes, request.pod_sandbox_id, context)
        return api_pb2.PodSandboxStatusResponse(status=self._sandbox_status(self.sandboxes[key]))

    async def ListContainers(self, request, context):  # noqa: N802 - gRPC method name
        await self._enter("ListContainers", context)
        f = request.filter
        items = [
            self._container_pb(c)
            for c in self.containers.values()
            if (not f.pod_sandbox_id or c.sandbox_id.startswith(f.pod_sandbox_id))
            and (not f.HasField("state") or c.state == f.state.state)
        ]
        return api_pb2.ListContainersResponse(containers=items)

    async def ContainerStatus(self, request, context):  # noqa: N802 - gRPC method name
        await self._enter("ContainerStatus", context)
        key = await self._require(self.containers, request.container_id, context)
        container = self.containers[key]
        response = api_pb2.ContainerStatusResponse(status=self._container_status(container))
        if request.verbose:
            # The subset of containerd's verbose info that clients read: the configured env.
            envs = [{"key": k, "value": v} for k, v in container.env.items()]
            response.info["info"] = json.dumps({"config": {"envs": envs}})
        return response

    async def StopContainer(self, request, context):  # noqa: N802 - gRPC method name
        await self._enter("StopContainer", context)
        self.stop_requests.append((request.container_id, request.timeout))
        self.container_stopped.set()
        key = self._lookup(self.containers, request.container_id)
        if key is not None and self.containers[key].state == api_pb2.CONTAINER_RUNNING:
            self.exit_container(key, exit_code=137 if request.timeout == 0 else 143)
        return api_pb2.StopContainerResponse()

    async def RunPodSandbox(self, request, context):  # noqa: N802 - gRPC method name
        await self._enter("RunPodSandbox", context)
        meta = request.config.metadata
        sandbox = self.add_sandbox(
            meta.name,
            namespace=meta.namespace,
            host_network=request.config.linux.security_context.namespace_options.network
            == api_pb2.NODE,
            labels=request.config.labels,
            annotations=request.config.annotations,
        )
        sandbox.uid = meta.uid or sandbox.uid
        return api_pb2.RunPodSandboxResponse(pod_sandbox_id=sandbox.id)

    async def StopPodSandbox(self, request, context):  # noqa: N802 - gRPC method name
        await self._enter("StopPodSandbox", context)
        key = self._lookup(self.sandboxes, request.pod_sandbox_id)
        if key is not None:
            self.sandboxes[key].ready = False
        return api_pb2.StopPodSandboxResponse()

    async def RemovePodSandbox(self, request, context):  # noqa: N802 - gRPC method name
        await self._enter("RemovePodSandbox", context)
        key = self._lookup(self.sandboxes, request.pod_sandbox_id)
        if key is not None:
            self.remove_sandbox(key)
        return api_pb2.RemovePodSandboxResponse()

    async def CreateContainer(self, request, context):  # noqa: N802 - gRPC method name
        await self._enter("CreateContainer", context)
        key = await self._require(self.sandboxes, request.pod_sandbox_id, context)
        config = request.config
        container = self.add_container(
            self.sandboxes[key],
            config.metadata.name,
            attempt=config.metadata.attempt,
            state=api_pb2.CONTAINER_CREATED,
            annotations=config.annotations,
            env={kv.key: kv.value for kv in config.envs},
        )
        return api_pb2.CreateContainerResponse(container_id=container.id)

    async def StartContainer(self, request, context):  # noqa: N802 - gRPC method name
        await self._enter("StartContainer", context)
        key = await self._require(self.containers, request.container_id, context)
        container = self.containers[key]
        container.state = api_pb2.CONTAINER_RUNNING
        container.started_at = time.time_ns()
        self.emit(key, api_pb2.CONTAINER_STARTED_EVENT)
        return api_pb2.StartContainerResponse()

    async def RemoveContainer(self, request, context):  # noqa: N802 - gRPC method name
        await self._enter("RemoveContainer", context)
        key = self._lookup(self.containers, request.container_id)
        if key is not None:
            self.remove_container(key)
        return api_pb2.RemoveContainerResponse()

    async def ExecSync(self, request, context):  # noqa: N802 - gRPC method name
        await self._enter("ExecSync", context)
        key = await self._require(self.containers, request.container_id, context)
        container = self.containers[key]
        if container.state != api_pb2.CONTAINER_RUNNING:
            state = api_pb2.ContainerState.Name(api_pb2.ContainerState.ValueType(container.state))
            # containerd's answer, word for word (cri-facts.md, section 2.1).
            await context.abort(
                grpc.StatusCode.UNKNOWN,
                f"failed to exec in container: container is in {state} state",
            )
        self.execs_in_flight += 1
        self.max_execs_in_flight = max(self.max_execs_in_flight, self.execs_in_flight)
        cmd = list(request.cmd)
        try:
            run = self.exec_handler(container, cmd, request.timeout)
            if request.timeout > 0 and self.enforce_exec_timeout:
                try:
                    response = await asyncio.wait_for(run, request.timeout)
                except TimeoutError:
                    await self._drain_exec(container, cmd)
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"timeout {request.timeout}s exceeded: context deadline exceeded",
                    )
            else:
                response = await run
            await self._drain_exec(container, cmd)
            return response
        finally:
            self.execs_in_flight -= 1

    async def _drain_exec(self, container: FakeContainer, cmd: list[str]) -> None:
        if self.exec_drain is not None:
            await self.exec_drain(container, cmd)

    async def GetContainerEvents(  # noqa: N802 - gRPC method name
        self, request, context
    ) -> AsyncIterator[api_pb2.ContainerEventResponse]:
        await self._enter("GetContainerEvents", context)
        queue: asyncio.Queue[api_pb2.ContainerEventResponse | None] = asyncio.Queue()
        self._event_queues.append(queue)
        self.subscribers_changed.set()
        try:
            while (event := await queue.get()) is not None:
                yield event
        finally:
            self._event_queues.remove(queue)
            self.subscribers_changed.set()


class FakeRuntimeServer:
    """A ``FakeRuntime`` served by grpc.aio on a unix socket; use ``async with``."""

    def __init__(self, socket_path: str, runtime: FakeRuntime | None = None) -> None:
        self.socket_path = socket_path
        self.runtime = runtime or FakeRuntime()
        self._server = grpc.aio.server()
        api_pb2_grpc.add_RuntimeServiceServicer_to_server(self.runtime, self._server)
        self._server.add_insecure_port(f"unix://{socket_path}")

    @property
    def target(self) -> str:
        """The gRPC target clients connect to."""
        return f"unix://{self.socket_path}"

    async def start(self) -> None:
        """Start serving; returns once the socket accepts connections."""
        await self._server.start()

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving and end every open stream."""
        self.runtime.end_event_streams()
        await self._server.stop(grace)

    async def __aenter__(self) -> FakeRuntimeServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
