"""The servers' read model: answers about containers from discovery's view and the manager.

Everything it returns is frozen (discovery's ``ContainerInfo``, the manager's ``Health`` and
``ProbeState``), so a request builds its answer from values that cannot change under it.
"""

from __future__ import annotations

from collections.abc import Mapping

from cri_prober.discovery.model import ContainerInfo, PodInfo
from cri_prober.discovery.naming import (
    ContainerRef,
    TargetError,
    find_container,
    newest_attempts,
    shown,
)
from cri_prober.discovery.source import RELIST_THRESHOLD, NodeSource
from cri_prober.manager.api import ProbeService
from cri_prober.manager.state import Health, ProbeState
from cri_prober.runtime.model import ContainerState


class NodeView:
    """What the API servers may read: containers, their health and their probes."""

    def __init__(self, node: NodeSource, manager: ProbeService) -> None:
        self._node = node
        self._manager = manager
        self.shutting_down = False

    def containers(self) -> Mapping[str, ContainerInfo]:
        """Every known container by ID (a consistent snapshot)."""
        return self._node.containers()

    def pods(self) -> Mapping[str, PodInfo]:
        """Every known pod sandbox by sandbox ID (a consistent snapshot)."""
        return self._node.pods()

    def node_healthy(self) -> bool:
        """Discovery is fresh and the daemon is not shutting down (health service ``""``)."""
        return self._node.healthy() and not self.shutting_down

    def node_reasons(self) -> list[str]:
        """Why ``node_healthy`` is False, one line each; empty while it is True."""
        reasons: list[str] = []
        if self.shutting_down:
            reasons.append("cri-prober is shutting down")
        if self._node.last_relist_ok is None:
            reasons.append(
                "discovery not complete: no listing of the runtime's containers has succeeded yet"
            )
        elif not self._node.healthy():
            reasons.append(
                "discovery stale: no listing of the runtime's containers has succeeded for "
                f"{RELIST_THRESHOLD:g}s (the kubelet's PLEG threshold)"
            )
        return reasons

    def find(self, target: str, *, newest_only: bool = False) -> ContainerInfo:
        """The container ``target`` names; raises ``TargetError``."""
        containers = self._node.containers()  # one snapshot for the refs and the lookup
        refs = [ContainerRef.of(info) for info in containers.values()]
        return containers[find_container(target, newest_attempts(refs) if newest_only else refs).id]

    def container_names(self) -> set[str]:
        """``namespace/pod/container`` of every container (each names its newest attempt)."""
        return {
            f"{info.pod.namespace}/{info.pod.name}/{info.name}"
            for info in self._node.containers().values()
        }

    def health(self, info: ContainerInfo) -> Health:
        """The container's derived state; one without probes is healthy while it runs."""
        return self._manager.container_health(info)

    def probes(self, info: ContainerInfo) -> tuple[ProbeState, ...]:
        """The container's configured probes with their state, liveness first."""
        return self._manager.probe_states(info.id)

    def serving(self, service: str) -> bool:
        """Whether ``service`` (a health service name) serves; raises ``TargetError``.

        ``""`` is cri-prober itself, ``namespace/pod`` a pod (every running container serving),
        anything else names a container like ``find`` does (its newest attempt).
        """
        if service == "":
            return self.node_healthy()
        if service.count("/") == 1:
            serving = self._pod_serving(*service.split("/"))
        else:
            serving = self.health(self.find(service, newest_only=True)).serving
        return serving and not self.shutting_down

    def _pod_serving(self, namespace: str, name: str) -> bool:
        pods = [
            pod
            for pod in self._node.pods().values()
            if pod.namespace == namespace and pod.name == name
        ]
        if not pods:
            raise TargetError(f"no pod {shown(f'{namespace}/{name}')}")
        pod = max(pods, key=lambda p: p.created_at)
        containers = self._node.containers()
        mine = [
            ContainerRef.of(info)
            for info in containers.values()
            if info.pod_sandbox_id == pod.sandbox_id
        ]
        running = [
            containers[ref.id]
            for ref in newest_attempts(mine)
            if containers[ref.id].state is ContainerState.CONTAINER_RUNNING
        ]
        # A pod whose sandbox is down or that runs nothing serves nothing.
        return pod.ready and bool(running) and all(self.health(c).serving for c in running)


__all__ = ["NodeView"]
