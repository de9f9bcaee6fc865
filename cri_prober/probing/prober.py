"""The prober: turns a probe spec and a container into one handler call (the kubelet's prober.go).

It resolves what the spec leaves open — the address (the kubelet's status.podIP: a pod IP picked
by the node's IP family, the node's address for host-network pods, or none at all), named ports,
the URL — and dispatches to the exec, httpGet, tcpSocket or grpc handler. A spec it cannot turn
into a request raises ``ProbeError`` (the attempt is discarded).
"""

from __future__ import annotations

import functools
import ipaddress
import time
from collections.abc import Mapping, Sequence
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


def ip_family(ip: str) -> int | None:
    """4 or 6, as the kubelet's IsIPv4String/IsIPv6String see ``ip``; None if it is not an IP."""
    if "%" in ip:
        return None  # Go's IP parser takes no IPv6 zone
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return 4  # Go's To4 turns an IPv4-mapped IPv6 address into an IPv4 one
    return address.version


@functools.lru_cache(maxsize=16)
def primary_family(node_address: str) -> int:
    """The node's primary IP family, which the kubelet takes from its first node IP.

    Only an IPv6 node address makes it IPv6: a kubelet without ``--node-ip`` prefers IPv4, and
    so does a node address that is a name rather than an IP.
    """
    return 6 if ip_family(node_address) == 6 else 4


def pick_pod_ip(ips: Sequence[str], primary: int) -> str:
    """The kubelet's status.podIP out of a sandbox's IPs in CRI order (its sortPodIPs).

    The first IP of the ``primary`` family wins, else the first of the other family. If any IP
    fails to parse, the kubelet keeps none of them, and neither does this: the result is "".
    """
    families = [ip_family(ip) for ip in ips]
    if None in families:
        return ""
    for ip, family in zip(ips, families, strict=True):
        if family == primary:
            return ip
    return ips[0] if ips else ""


@dataclass(frozen=True, slots=True)
class ProbeTarget:
    """Everything about a container a probe may need, beyond its spec."""

    container_id: str
    pod_ip: str = ""  # CRI's primary pod IP (lifecycle hooks use it); "" for host-network pods
    host_network: bool = False
    ports: Mapping[str, int] = field(default_factory=dict)  # named ports from the rule
    ports_annotation: str | None = None  # the kubelet's io.kubernetes.container.ports
    env: Mapping[str, str] | None = None  # the container's configured env, for $(VAR)
    # Every pod IP in CRI order; probes pick theirs by IP family (Prober.pod_address).
    pod_ips: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # A target built with only ``pod_ip`` still has that IP to probe.
        if not self.pod_ips and self.pod_ip:
            object.__setattr__(self, "pod_ips", (self.pod_ip,))

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
            pod_ips=container.pod.ips,
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
        """The address a probe without ``host`` connects to: the kubelet's status.podIP.

        That is the pod IP of the node's primary family (see ``pick_pod_ip``; the family comes
        from ``node_address``), else ``node_address`` for a host-network pod. A pod with no IP
        gets "": like the kubelet, the handlers then dial the local system, and the attempt is
        a verdict rather than an error.
        """
        if ip := pick_pod_ip(target.pod_ips, primary_family(self.node_address)):
            return ip
        if target.host_network:
            return self.node_address
        return ""

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
