"""Harness for tests and the demo: real containerd testbeds and kubelet-like pods created over CRI.

`Testbed` drives scripts/testbed.py (which starts a private containerd); `PodFactory` creates pod
sandboxes and containers the way the kubelet does (same metadata, labels and annotations) and
removes everything it created; `ManagerWatcher` lets a test await what a probe manager does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import ipaddress
import json
import os
import subprocess
import sys
import time
import uuid
import zlib
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Self

import grpc

from cri_prober._gen.runtime.v1 import api_pb2, api_pb2_grpc

if TYPE_CHECKING:
    from cri_prober._gen.runtime.v1.api_pb2_grpc import RuntimeServiceAsyncStub

# Labels the kubelet puts on every sandbox (the first three) and container (all four).
POD_NAME_LABEL = "io.kubernetes.pod.name"
POD_NAMESPACE_LABEL = "io.kubernetes.pod.namespace"
POD_UID_LABEL = "io.kubernetes.pod.uid"
CONTAINER_NAME_LABEL = "io.kubernetes.container.name"

DEFAULT_COMMAND = ("sleep", "3600")

_SCRIPT_ENV = "CRI_PROBER_TESTBED_SCRIPT"


class TestbedError(RuntimeError):
    """scripts/testbed.py failed; the message carries its output (including containerd's log)."""

    __test__: ClassVar[bool] = False  # not a pytest test class despite the name


def testbed_script() -> Path:
    """scripts/testbed.py of this checkout (this file is tests/support/testbed.py in it)."""
    override = os.environ.get(_SCRIPT_ENV)
    script = (
        Path(override)
        if override
        else Path(__file__).resolve().parents[2] / "scripts" / "testbed.py"
    )
    if not script.is_file():
        raise TestbedError(
            f"cannot find scripts/testbed.py (looked at {script}; set {_SCRIPT_ENV})"
        )
    return script


def _run_script(*args: str, timeout: float) -> str:
    # This interpreter has grpcio (this module imports it), which `start` and `stop` need.
    proc = subprocess.run(
        [sys.executable, str(testbed_script()), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise TestbedError(
            f"testbed.py {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}{proc.stdout}"
        )
    return proc.stdout


@dataclass(frozen=True)
class Testbed:
    """A running private containerd, as described by `testbed.py start` (DIR/testbed.json)."""

    __test__: ClassVar[bool] = False  # not a pytest test class despite the name

    version: str
    endpoint: str
    socket: Path
    pid: int
    dir: Path
    busybox_image: str
    pause_image: str
    subnet: str
    bridge: str
    containerd_version: str

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Testbed:
        return cls(
            version=str(data["version"]),
            endpoint=str(data["endpoint"]),
            socket=Path(data["socket"]),
            pid=int(data["pid"]),
            dir=Path(data["dir"]),
            busybox_image=str(data["busybox_image"]),
            pause_image=str(data["pause_image"]),
            subnet=str(data["subnet"]),
            bridge=str(data["bridge"]),
            containerd_version=str(data["containerd_version"]),
        )

    @classmethod
    def load(cls, directory: Path | str) -> Testbed:
        """The testbed already running in `directory`."""
        return cls.from_json(json.loads((Path(directory) / "testbed.json").read_text()))

    @classmethod
    def start(
        cls,
        directory: Path | str,
        *,
        version: str = "1.6",
        subnet_index: int | None = None,
        install: bool = True,
        timeout: float = 60.0,
    ) -> Testbed:
        """Start containerd `version` in `directory` (installing it first unless install=False).

        subnet_index None lets the script pick a free one, so parallel sessions do not collide.
        Installing is a no-op when everything is present, but may take minutes on a fresh machine.
        """
        if install:
            _run_script("install", "--version", version, timeout=900)
        output = _run_script(
            "start",
            "--dir",
            str(directory),
            "--version",
            version,
            "--subnet-index",
            "auto" if subnet_index is None else str(subnet_index),
            "--timeout",
            str(timeout),
            timeout=timeout + 30,
        )
        return cls.from_json(json.loads(output.strip().splitlines()[-1]))

    def stop(self, *, keep_dir: bool = False) -> None:
        """Tear down pods, containerd, shims, mounts, the bridge and (unless keep_dir) DIR."""
        self.stop_dir(self.dir, keep_dir=keep_dir)

    @staticmethod
    def stop_dir(directory: Path | str, *, keep_dir: bool = False) -> None:
        """Like stop(), for a directory whose start may have failed half-way (idempotent)."""
        args = ["stop", "--dir", str(directory)] + (["--keep-dir"] if keep_dir else [])
        _run_script(*args, timeout=180)

    @property
    def network(self) -> ipaddress.IPv4Network:
        """The pod subnet of the testbed's CNI bridge."""
        return ipaddress.IPv4Network(self.subnet)

    def pods(self, *, rpc_timeout: float = 30.0) -> PodFactory:
        """A PodFactory for this testbed; container logs go to DIR/pod-logs."""
        return PodFactory(
            self.endpoint,
            image=self.busybox_image,
            log_root=self.dir / "pod-logs",
            rpc_timeout=rpc_timeout,
        )


@dataclass(frozen=True)
class ContainerSpec:
    """What to run in one container of a pod (the parts of a PodSpec container CRI sees)."""

    name: str
    command: Sequence[str] = DEFAULT_COMMAND
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    # Added to the kubelet's own container annotations; a key given here wins.
    annotations: Mapping[str, str] = field(default_factory=dict)
    image: str | None = None  # None: the factory's image (the testbed's busybox)
    working_dir: str = ""


@dataclass(frozen=True)
class ContainerHandle:
    """One created and started container."""

    id: str
    name: str
    attempt: int
    spec: ContainerSpec


@dataclass(frozen=True)
class Pod:
    """A pod sandbox and its containers (by container name, the latest attempt of each)."""

    sandbox_id: str
    name: str
    namespace: str
    uid: str
    host_network: bool
    ip: str  # "" for host-network pods
    containers: Mapping[str, ContainerHandle] = field(default_factory=dict)

    @property
    def container_ids(self) -> dict[str, str]:
        """Container ID by container name."""
        return {name: handle.id for name, handle in self.containers.items()}


async def _ignoring_not_found(call: Awaitable[object]) -> None:
    """Await a CRI call, treating NOT_FOUND as success (the object is already gone)."""
    try:
        await call
    except grpc.aio.AioRpcError as error:
        if error.code() != grpc.StatusCode.NOT_FOUND:
            raise


class PodFactory:
    """Creates kubelet-like pods on a CRI endpoint and cleans up everything it created.

    Use as `async with PodFactory(endpoint, image=...) as pods:`; cleanup() runs on exit. It must be
    used from a single event loop (grpc.aio channels are bound to one).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        image: str,
        log_root: Path | None = None,
        rpc_timeout: float = 30.0,
    ) -> None:
        self.endpoint = endpoint
        self.image = image
        self.log_root = log_root
        self.rpc_timeout = rpc_timeout
        self._channel: grpc.aio.Channel | None = None
        self._stub: RuntimeServiceAsyncStub | None = None
        # Everything created and not yet removed, in creation order:
        # container ID -> its sandbox ID, and sandbox ID -> its config (CreateContainer needs it).
        self._containers: dict[str, str] = {}
        self._sandboxes: dict[str, api_pb2.PodSandboxConfig] = {}

    @property
    def runtime(self) -> RuntimeServiceAsyncStub:
        """The raw CRI RuntimeService stub on this factory's channel."""
        if self._stub is None:
            # Opened lazily so the channel binds to the event loop that uses it.
            self._channel = grpc.aio.insecure_channel(
                self.endpoint, options=[("grpc.max_receive_message_length", 16 * 1024 * 1024)]
            )
            self._stub = api_pb2_grpc.RuntimeServiceStub(self._channel)
        return self._stub

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            await self.cleanup()
        finally:
            await self.close()

    async def close(self) -> None:
        """Close the channel (does not remove anything: see cleanup())."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    # ---------------------------------------------------------------------------------- pods

    async def create_pod(
        self,
        name: str,
        *,
        namespace: str = "default",
        host_network: bool = True,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        containers: Iterable[ContainerSpec] = (),
        uid: str | None = None,
    ) -> Pod:
        """RunPodSandbox, then create and start each container in order.

        Host-network pods skip CNI (no pod IP: probe 127.0.0.1); others get an IP on the bridge.
        ``uid`` is the pod's UID as a pod spec source knows it (default: a new one).
        """
        uid = uid or str(uuid.uuid4())
        config = api_pb2.PodSandboxConfig(
            metadata=api_pb2.PodSandboxMetadata(name=name, uid=uid, namespace=namespace),
            # A hostname needs a private UTS namespace, which host-network pods do not get.
            hostname="" if host_network else name,
            labels={
                **(labels or {}),
                POD_NAME_LABEL: name,
                POD_NAMESPACE_LABEL: namespace,
                POD_UID_LABEL: uid,
            },
            annotations={
                "kubernetes.io/config.source": "api",
                "kubernetes.io/config.seen": datetime.datetime.now(datetime.UTC).isoformat(),
                **(annotations or {}),
            },
            linux=api_pb2.LinuxPodSandboxConfig(
                security_context=api_pb2.LinuxSandboxSecurityContext(
                    namespace_options=api_pb2.NamespaceOption(
                        network=api_pb2.NODE if host_network else api_pb2.POD,
                        pid=api_pb2.CONTAINER,  # the kubelet's default (no shareProcessNamespace)
                        ipc=api_pb2.POD,
                    )
                )
            ),
        )
        if self.log_root is not None:
            log_directory = self.log_root / f"{namespace}_{name}_{uid}"
            log_directory.mkdir(parents=True, exist_ok=True)
            config.log_directory = str(log_directory)
        response = await self.runtime.RunPodSandbox(
            api_pb2.RunPodSandboxRequest(config=config), timeout=self.rpc_timeout
        )
        self._sandboxes[response.pod_sandbox_id] = config
        ip = ""
        if not host_network:
            status = await self.runtime.PodSandboxStatus(
                api_pb2.PodSandboxStatusRequest(pod_sandbox_id=response.pod_sandbox_id),
                timeout=self.rpc_timeout,
            )
            ip = status.status.network.ip
        pod = Pod(
            sandbox_id=response.pod_sandbox_id,
            name=name,
            namespace=namespace,
            uid=uid,
            host_network=host_network,
            ip=ip,
        )
        for spec in containers:
            pod = await self.add_container(pod, spec)
        return pod

    async def add_container(self, pod: Pod, spec: ContainerSpec, *, attempt: int = 0) -> Pod:
        """CreateContainer + StartContainer in `pod`; returns the pod with the container added."""
        sandbox_config = self._sandboxes.get(pod.sandbox_id)
        if sandbox_config is None:
            raise ValueError(f"pod {pod.name} was not created by this factory or was removed")
        config = api_pb2.ContainerConfig(
            metadata=api_pb2.ContainerMetadata(name=spec.name, attempt=attempt),
            image=api_pb2.ImageSpec(image=spec.image or self.image),
            command=list(spec.command),
            args=list(spec.args),
            working_dir=spec.working_dir,
            envs=[api_pb2.KeyValue(key=key, value=value) for key, value in spec.env.items()],
            # Exactly the four labels the kubelet sets; pod labels are not copied onto containers.
            labels={
                POD_NAME_LABEL: pod.name,
                POD_NAMESPACE_LABEL: pod.namespace,
                POD_UID_LABEL: pod.uid,
                CONTAINER_NAME_LABEL: spec.name,
            },
            annotations={
                "io.kubernetes.container.hash": f"{zlib.crc32(repr(spec).encode()):x}",
                "io.kubernetes.container.restartCount": str(attempt),
                "io.kubernetes.container.terminationMessagePath": "/dev/termination-log",
                "io.kubernetes.container.terminationMessagePolicy": "File",
                "io.kubernetes.pod.terminationGracePeriod": "30",
                **spec.annotations,
            },
        )
        if sandbox_config.log_directory:
            (Path(sandbox_config.log_directory) / spec.name).mkdir(exist_ok=True)
            config.log_path = f"{spec.name}/{attempt}.log"
        created = await self.runtime.CreateContainer(
            api_pb2.CreateContainerRequest(
                pod_sandbox_id=pod.sandbox_id, config=config, sandbox_config=sandbox_config
            ),
            timeout=self.rpc_timeout,
        )
        self._containers[created.container_id] = pod.sandbox_id
        await self.runtime.StartContainer(
            api_pb2.StartContainerRequest(container_id=created.container_id),
            timeout=self.rpc_timeout,
        )
        handle = ContainerHandle(
            id=created.container_id, name=spec.name, attempt=attempt, spec=spec
        )
        return dataclasses.replace(pod, containers={**pod.containers, spec.name: handle})

    async def restart_container(self, pod: Pod, name: str, *, stop_timeout: int = 0) -> Pod:
        """Restart like the kubelet: stop the current attempt, then create and start attempt+1.

        The exited container is kept (as the kubelet keeps one dead container) until cleanup().
        """
        current = pod.containers[name]
        await self.stop_container(current.id, timeout=stop_timeout)
        return await self.add_container(pod, current.spec, attempt=current.attempt + 1)

    async def stop_container(self, container_id: str, *, timeout: int = 0) -> None:
        """StopContainer: the stop signal, then SIGKILL after `timeout` s (0: SIGKILL at once)."""
        # Older containerd patch releases answer NOT_FOUND for unknown IDs; that is success too.
        await _ignoring_not_found(
            self.runtime.StopContainer(
                api_pb2.StopContainerRequest(container_id=container_id, timeout=timeout),
                timeout=self.rpc_timeout + timeout,
            )
        )

    async def remove_container(self, container_id: str) -> None:
        """RemoveContainer (the container must not be running: stop it first)."""
        await _ignoring_not_found(
            self.runtime.RemoveContainer(
                api_pb2.RemoveContainerRequest(container_id=container_id),
                timeout=self.rpc_timeout,
            )
        )
        self._containers.pop(container_id, None)

    async def remove_pod(self, pod: Pod) -> None:
        """Stop and remove the pod's containers (every attempt this factory made), then the pod."""
        mine = [cid for cid, sandbox in self._containers.items() if sandbox == pod.sandbox_id]
        for container_id in mine:
            await self.stop_container(container_id)
            await self.remove_container(container_id)
        await self._remove_sandbox(pod.sandbox_id)

    # ------------------------------------------------------------------------------ queries

    async def container_status(self, container_id: str) -> api_pb2.ContainerStatus:
        response = await self.runtime.ContainerStatus(
            api_pb2.ContainerStatusRequest(container_id=container_id), timeout=self.rpc_timeout
        )
        return response.status

    async def wait_for_container_state(
        self, container_id: str, state: api_pb2.ContainerState.ValueType, *, timeout: float = 10.0
    ) -> api_pb2.ContainerStatus:
        """Poll ContainerStatus until the container is in `state`; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            status = await self.container_status(container_id)
            if status.state == state:
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"container {container_id[:13]} is {api_pb2.ContainerState.Name(status.state)},"
                    f" not {api_pb2.ContainerState.Name(state)}, after {timeout}s"
                )
            await asyncio.sleep(0.05)

    # ------------------------------------------------------------------------------ cleanup

    async def cleanup(self) -> None:
        """Remove everything this factory created and has not removed yet.

        Clean order StopContainer → RemoveContainer → StopPodSandbox → RemovePodSandbox; NOT_FOUND
        is ignored. Every step is attempted; failures are raised together afterwards.
        """
        errors: list[Exception] = []
        for container_id in reversed(list(self._containers)):
            try:
                await self.stop_container(container_id)
                await self.remove_container(container_id)
            except (TimeoutError, grpc.RpcError) as error:
                errors.append(error)
        for sandbox_id in reversed(list(self._sandboxes)):
            try:
                await self._remove_sandbox(sandbox_id)
            except (TimeoutError, grpc.RpcError) as error:
                errors.append(error)
        if errors:
            raise ExceptionGroup("PodFactory.cleanup could not remove everything", errors)

    async def _remove_sandbox(self, sandbox_id: str) -> None:
        await _ignoring_not_found(
            self.runtime.StopPodSandbox(
                api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=self.rpc_timeout
            )
        )
        await _ignoring_not_found(
            self.runtime.RemovePodSandbox(
                api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id),
                timeout=self.rpc_timeout,
            )
        )
        self._sandboxes.pop(sandbox_id, None)
