"""The prober: turns a probe spec and a container into one handler call (the kubelet's prober.go).

It resolves what the spec leaves open — the address (the pod IP, or the node's address for
host-network pods), named ports, the URL — and dispatches to the exec, httpGet, tcpSocket or grpc
handler. A spec it cannot turn into a request raises ``ProbeError`` (the attempt is discarded).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from cri_prober.discovery.model import ContainerInfo
from cri_prober.probing.handlers.exec import ExecRunner, probe_exec
from cri_prober.probing.handlers.grpc import probe_grpc
from cri_prober.probing.handlers.http import TLSOptions, build_url, probe_http
from cri_prober.probing.handlers.tcp import probe_tcp
from cri_prober.probing.outcome import ProbeError, ProbeOutcome
from cri_prober.probing.results import ProbeRecord
from cri_prober.probing.spec import (
    KUBELET_PORTS_ANNOTATION,
    ExecAction,
    GRPCAction,
    HTTPGetAction,
    Probe,
    TCPSocketAction,
    resolve_port,
)

# Where host-network pods are probed when no node address is configured: such a pod shares the
# node's network namespace, so its listeners are reachable on the loopback address too.
DEFAULT_NODE_ADDRESS = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class ProbeTarget:
    """Everything about a container a probe may need, beyond its spec."""

    container_id: str
    pod_ip: str = ""  # primary pod IP; "" for host-network pods
    host_network: bool = False
    ports: Mapping[str, int] = field(default_factory=dict)  # named ports from the rule
    ports_annotation: str | None = None  # the kubelet's io.kubernetes.container.ports
    env: Mapping[str, str] | None = None  # the container's configured env, for $(VAR)

    @classmethod
    def of(
        cls, container: ContainerInfo, ports: Mapping[str, int], *, container_id: str | None = None
    ) -> ProbeTarget:
        """The one way to aim a probe at a container discovery knows (workers, RunProbe, check).

        ``ports`` are the named ports the probe's rule declares; ``container_id`` overrides the
        container's own ID (a worker probes the attempt it was shown).
        """
        return cls(
            container_id=container.id if container_id is None else container_id,
            pod_ip=container.pod.ip,
            host_network=container.pod.host_network,
            ports=ports,
            ports_annotation=container.annotations.get(KUBELET_PORTS_ANNOTATION),
            env=container.env,
        )


class Prober:
    """Runs one probe attempt for any handler type."""

    def __init__(
        self,
        exec_runner: ExecRunner,
        *,
        node_address: str = DEFAULT_NODE_ADDRESS,
        tls: TLSOptions | None = None,
    ) -> None:
        self._exec_runner = exec_runner
        self.node_address = node_address
        self._tls = tls

    def pod_address(self, target: ProbeTarget) -> str:
        """The address a probe without ``host`` connects to, like the kubelet's status.podIP."""
        if target.pod_ip:
            return target.pod_ip
        if target.host_network:
            return self.node_address
        raise ProbeError("the pod has no IP address (its network is not set up or already gone)")

    async def run(self, probe: Probe, target: ProbeTarget) -> ProbeOutcome:
        """Run ``probe`` once against ``target``; raise ``ProbeError`` if it could not run."""
        handler = probe.handler
        timeout = probe.timeout_seconds
        if isinstance(handler, ExecAction):
            return await probe_exec(
                self._exec_runner,
                target.container_id,
                handler.command,
                timeout=timeout,
                env=target.env,
            )
        if isinstance(handler, HTTPGetAction):
            host = handler.host or self.pod_address(target)
            port = resolve_port(handler.port, target.ports, target.ports_annotation)
            url = build_url(handler.scheme.lower(), host, port, handler.path)
            headers = [(h.name, h.value) for h in handler.http_headers]
            return await probe_http(url, headers=headers, timeout=timeout, tls=self._tls)
        if isinstance(handler, TCPSocketAction):
            host = handler.host or self.pod_address(target)
            port = resolve_port(handler.port, target.ports, target.ports_annotation)
            return await probe_tcp(host, port, timeout=timeout)
        if isinstance(handler, GRPCAction):
            return await probe_grpc(
                self.pod_address(target), handler.port, service=handler.service, timeout=timeout
            )
        raise ProbeError(f"unsupported probe handler {type(handler).__name__}")  # pragma: no cover


async def run_once(prober: Prober, probe: Probe, target: ProbeTarget) -> ProbeRecord:
    """Run one attempt and record it as a worker would, touching no worker or result state."""
    started_wall = time.time()
    started = time.monotonic()
    try:
        outcome = await prober.run(probe, target)
    except ProbeError as exc:
        # Could not run: the worker's "error" attempt, with the reason as its output.
        return ProbeRecord(
            target.container_id, started_wall, time.monotonic() - started, "error", str(exc)
        )
    return ProbeRecord(
        target.container_id,
        started_wall,
        time.monotonic() - started,
        outcome.result.value,
        outcome.output,
        outcome.exit_code,
        outcome.http_status,
        outcome.timed_out,
    )
