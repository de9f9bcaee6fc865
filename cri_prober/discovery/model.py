"""What discovery knows about the node: pods, containers and the changes between two views.

These frozen values are what every layer above discovery sees of the runtime's objects; the two
builders turn CRI statuses into them (discovery uses them, and so does ``cri-prober check``).
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from cri_prober.runtime.model import (
    Container,
    ContainerState,
    ContainerStatus,
    PodSandbox,
    SandboxState,
    SandboxStatus,
)


class EventKind(enum.StrEnum):
    """What happened; the container kinds follow the kubelet's PLEG event types."""

    STARTED = "started"
    DIED = "died"
    REMOVED = "removed"
    CHANGED = "changed"  # created, or its state became unknown
    POD_CHANGED = "pod_changed"  # a sandbox appeared or its readiness/network changed
    POD_REMOVED = "pod_removed"


@dataclass(frozen=True, slots=True)
class PodInfo:
    """A pod sandbox as discovery knows it (from PodSandboxStatus)."""

    sandbox_id: str
    name: str
    namespace: str
    uid: str
    attempt: int
    ready: bool
    ip: str  # CRI's primary pod IP; "" for host-network pods and stopped sandboxes
    host_network: bool
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    created_at: int  # ns since the epoch
    # Every pod IP in CRI's order (``ip``, then ``additional_ips``), empty ones left out. The
    # kubelet's status.podIP is picked from these by IP family, which need not be ``ip``.
    ips: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # A PodInfo built with only ``ip`` (by hand, in tests) still lists that IP in ``ips``.
        if not self.ips and self.ip:
            object.__setattr__(self, "ips", (self.ip,))


@dataclass(frozen=True, slots=True)
class ContainerInfo:
    """A container as discovery knows it (from ContainerStatus), with its pod."""

    id: str
    pod_sandbox_id: str
    name: str
    attempt: int
    state: ContainerState
    created_at: int  # ns since the epoch
    started_at: int  # 0 until started
    finished_at: int  # 0 until exited
    exit_code: int  # meaningful once finished_at != 0
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    env: Mapping[str, str] | None  # the configured env, when the runtime reports it
    pod: PodInfo


@dataclass(frozen=True, slots=True)
class LifecycleEvent:
    """One change in the node view.

    Container events carry the container and its pod; pod events carry only the pod. A container
    that vanished without being seen exited yields ``died`` then ``removed``, both with its last
    known info (as the kubelet's PLEG does).
    """

    kind: EventKind
    container: ContainerInfo | None
    pod: PodInfo | None


# A node's view holds one of these per container (issue 36): its strings are the ones the CRI
# client already keeps for its listings where they are equal (a status call makes new ones of
# every field), names every pod shares are interned, and the env's names and values too (the
# kubelet gives every container of a namespace the same service variables).
_NO_ENV: Mapping[str, str] = MappingProxyType({})


def _same(listed: str | None, fetched: str) -> str:
    """The listing's string when it is equal to the status's: one object kept, not two."""
    return listed if listed is not None and listed == fetched else fetched


def _env(env: Mapping[str, str] | None) -> Mapping[str, str] | None:
    if env is None:
        return None
    if not env:
        return _NO_ENV
    return {sys.intern(name): sys.intern(value) for name, value in env.items()}


def pod_info(status: SandboxStatus, listed: PodSandbox | None = None) -> PodInfo:
    """``listed``: the sandbox as the CRI client's listing holds it, whose strings are kept."""
    sandbox = status.sandbox
    return PodInfo(
        sandbox_id=_same(None if listed is None else listed.id, sandbox.id),
        name=_same(None if listed is None else listed.name, sandbox.name),
        namespace=sys.intern(sandbox.namespace),
        uid=_same(None if listed is None else listed.uid, sandbox.uid),
        attempt=sandbox.attempt,
        ready=sandbox.state is SandboxState.SANDBOX_READY,
        ip=status.ip,
        host_network=status.host_network,
        labels=sandbox.labels,
        annotations=sandbox.annotations,
        created_at=sandbox.created_at,
        # The kubelet skips an empty primary IP but still takes the additional ones.
        ips=tuple(ip for ip in (status.ip, *status.additional_ips) if ip),
    )


def container_info(
    status: ContainerStatus,
    pod: PodInfo,
    previous: ContainerInfo | None,
    listed: Container | None = None,
) -> ContainerInfo:
    """``listed``: the container as the CRI client's listing holds it, whose strings are kept."""
    return ContainerInfo(
        id=_same(None if listed is None else listed.id, status.id),
        pod_sandbox_id=pod.sandbox_id,
        name=sys.intern(status.name),
        attempt=status.attempt,
        state=status.state,
        created_at=status.created_at,
        started_at=status.started_at,
        finished_at=status.finished_at,
        exit_code=status.exit_code,
        labels=status.labels,
        annotations=status.annotations,
        # The env is fixed at creation, so a refresh without verbose info keeps the known one.
        env=previous.env if status.env is None and previous is not None else _env(status.env),
        pod=pod,
    )


__all__ = [
    "ContainerInfo",
    "EventKind",
    "LifecycleEvent",
    "PodInfo",
    "container_info",
    "pod_info",
]
