"""The runtime's model: the frozen values the CRI client returns instead of protobuf messages.

Everything above the runtime layer sees the runtime's sandboxes, containers, events and exec
results only as these enums and dataclasses; ``convert`` builds them from protobuf and
``client.CriClient`` hands them out.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

# Like the kubelet's CRI client, keep at most 10 KiB of an exec's output (stdout first). Probing
# has its own equal cap (``probing.outcome.MAX_OUTPUT_BYTES``), as it imports nothing from here.
MAX_EXEC_OUTPUT_BYTES = 10 * 1024


class ContainerState(enum.IntEnum):
    """CRI ContainerState; the names are the CRI enum names users see in crictl's JSON."""

    CONTAINER_CREATED = 0
    CONTAINER_RUNNING = 1
    CONTAINER_EXITED = 2
    CONTAINER_UNKNOWN = 3


class SandboxState(enum.IntEnum):
    """CRI PodSandboxState."""

    SANDBOX_READY = 0
    SANDBOX_NOTREADY = 1


class ContainerEventType(enum.IntEnum):
    """CRI ContainerEventType."""

    CONTAINER_CREATED_EVENT = 0
    CONTAINER_STARTED_EVENT = 1
    CONTAINER_STOPPED_EVENT = 2
    CONTAINER_DELETED_EVENT = 3


@dataclass(frozen=True, slots=True)
class RuntimeVersion:
    """What the runtime says about itself (CRI Version)."""

    version: str
    runtime_name: str
    runtime_version: str
    runtime_api_version: str


@dataclass(frozen=True, slots=True)
class RuntimeCondition:
    """One runtime condition from CRI Status (e.g. RuntimeReady, NetworkReady)."""

    type: str
    status: bool
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class PodSandbox:
    """A pod sandbox as ListPodSandbox reports it."""

    id: str
    name: str
    namespace: str
    uid: str
    attempt: int
    state: SandboxState
    created_at: int  # ns since the epoch
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    runtime_handler: str = ""


@dataclass(frozen=True, slots=True)
class SandboxStatus:
    """PodSandboxStatus: a sandbox plus its network view."""

    sandbox: PodSandbox
    ip: str  # primary pod IP; "" for host-network pods
    additional_ips: tuple[str, ...]
    host_network: bool


@dataclass(frozen=True, slots=True)
class Container:
    """A container as ListContainers reports it."""

    id: str
    pod_sandbox_id: str
    name: str
    attempt: int
    image: str
    image_ref: str
    state: ContainerState
    created_at: int  # ns since the epoch
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ContainerStatus:
    """ContainerStatus: a container's lifecycle timestamps and exit details."""

    id: str
    name: str
    attempt: int
    state: ContainerState
    created_at: int  # ns since the epoch
    started_at: int  # 0 until started
    finished_at: int  # 0 until exited
    exit_code: int
    image: str
    image_ref: str
    reason: str
    message: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    # Only with verbose=True, from the runtime's info: the container's configured environment
    # (what the kubelet would have put in the spec) and its init process's host PID.
    env: Mapping[str, str] | None = None
    pid: int | None = None


@dataclass(frozen=True, slots=True)
class ExecResult:
    """The outcome of one ExecSync call.

    Like the kubelet, at most ``MAX_EXEC_OUTPUT_BYTES`` of output are kept: stdout first, then
    as much of stderr as still fits. ``timed_out`` is set (and ``exit_code`` is None) when the
    runtime's timeout or the client deadline fired: the kubelet reads any DEADLINE_EXCEEDED from
    ExecSync as a probe timeout.

    ``elapsed`` is how long the call took once it had an exec slot. ``drained_after_timeout``
    says the runtime answered only after the exec's timeout had passed, because it waited for
    the exec's output to close (a background child holding stdout or stderr): an exit status
    that came after the timeout, or the runtime's own timeout error later than the slot margin
    after it. Such an answer still counts, as it does for the kubelet.

    A timeout while the runtime itself was silent is not a result: ``exec_sync`` raises
    ``CriRuntimeStalled`` instead.
    """

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    message: str = ""
    elapsed: float = 0.0
    drained_after_timeout: bool = False


@dataclass(frozen=True, slots=True)
class ContainerEvent:
    """One GetContainerEvents message (``container_id`` is the sandbox ID for sandbox events)."""

    container_id: str
    type: ContainerEventType
    created_at: int
    sandbox: SandboxStatus | None
    containers: tuple[ContainerStatus, ...]


@dataclass(frozen=True, slots=True)
class CriCall:
    """One finished CRI call: its method, gRPC status code name ("OK" on success) and duration."""

    method: str
    code: str
    seconds: float


__all__ = [
    "MAX_EXEC_OUTPUT_BYTES",
    "Container",
    "ContainerEvent",
    "ContainerEventType",
    "ContainerState",
    "ContainerStatus",
    "CriCall",
    "ExecResult",
    "PodSandbox",
    "RuntimeCondition",
    "RuntimeVersion",
    "SandboxState",
    "SandboxStatus",
]
