"""The prober: turns a probe spec and a container into one handler call (the kubelet's prober.go).

It resolves what the spec leaves open — the address (the kubelet's status.podIP: a pod IP picked
by the node's IP family, the node's address for host-network pods, or none at all), named ports,
the URL — and dispatches to the exec, httpGet, tcpSocket or grpc handler. A spec it cannot turn
into a request raises ``ProbeError`` (the attempt is discarded).

Probes from pod annotations (any pod author writes them) are held to a stricter policy than the
operator's rules: a network probe may set ``host`` only to an address in
``--annotation-probe-hosts`` (never, by default, a loopback, unspecified or link-local one),
never dials the node itself for a pod without an IP, and an HTTP probe keeps its status code but
not the response body. A denied probe is an errored attempt (``ProbeDenied``); nothing is sent.
A pod spec's probe is sent as the kubelet sends it, but when it does not reach the pod itself
(an explicit ``host``, or a pod without an IP) it too keeps the status and nothing the target said.

``Prober.prepare`` does that resolving once for a probe and a target (a worker's ``PreparedProbe``,
rebuilt when either or the prober's settings change), so that an attempt only sends (issue 36).
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Protocol

from cri_prober.probing.handlers.exec import ExecRunner, PreparedExec
from cri_prober.probing.handlers.grpc import probe_grpc
from cri_prober.probing.handlers.http import HTTPGet, TLSOptions, build_url
from cri_prober.probing.handlers.tcp import probe_tcp
from cri_prober.probing.kubelet_profile import KubeletProfile
from cri_prober.probing.outcome import MAX_OUTPUT_BYTES, ProbeError, ProbeOutcome, Reason
from cri_prober.probing.results import ProbeRecord
from cri_prober.probing.spec import (
    KUBELET_PORTS_ANNOTATION,
    PORTS_FROM,
    ProbeOrigin,
    Unsupported,
    resolve_port,
)

if TYPE_CHECKING:
    from cri_prober.probing.spec import Probe
    from cri_prober.probing.spec.model import GRPCAction, HTTPGetAction, TCPSocketAction

# Where host-network pods are probed when no node address is configured: such a pod shares the
# node's network namespace, so its listeners are reachable on the loopback address too.
DEFAULT_NODE_ADDRESS = "127.0.0.1"
# Why an attempt keeps nothing the target sent; each completes "body not kept…" in its output.
WITHHELD_FOR_ANNOTATIONS: Final = " for annotation probes"
WITHHELD_NOT_THE_POD: Final = ": the target is not the pod"
# The longest error text an attempt keeps (and the worker logs on every errored attempt): errors
# quote specs, URLs and runtime messages, which a pod annotation can make megabytes long.
MAX_ERROR_CHARS = 1024

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Addresses that reach the node itself or what only the node should reach: loopback, "this
# host" (0.0.0.0/8 and ::, which Linux delivers locally) and link-local (169.254.169.254 is the
# cloud metadata service). An annotation probe gets one only when --annotation-probe-hosts names
# a network inside these; 0.0.0.0/0 or ::/0 alone does not open them.
_GUARDED: Final = (
    (ipaddress.ip_network("127.0.0.0/8"), "a loopback address"),
    (ipaddress.ip_network("0.0.0.0/8"), "an unspecified (this-host) address"),
    (ipaddress.ip_network("169.254.0.0/16"), "a link-local address"),
    (ipaddress.ip_network("::1/128"), "a loopback address"),
    (ipaddress.ip_network("::/128"), "an unspecified (this-host) address"),
    (ipaddress.ip_network("fe80::/10"), "a link-local address"),
)


class ProbeDenied(ProbeError):
    """An annotation probe asked for a target the policy does not allow; nothing was sent."""


@dataclass(frozen=True, slots=True)
class AnnotationHosts:
    """Where annotation probes that set an explicit ``host`` may connect (serve's
    ``--annotation-probe-hosts``). Empty, the default, allows no explicit host at all, like the
    Baseline Pod Security Standard does for the kubelet's probes. Probes without ``host`` go to
    the pod's own IP and are not affected.
    """

    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, items: Iterable[str]) -> AnnotationHosts:
        """Read CIDRs or single addresses; each item may hold several, separated by commas.

        Raises:
            ValueError: an item is not a network (the message names it).
        """
        networks: list[IPNetwork] = []
        for item in items:
            for text in item.split(","):
                if not (text := text.strip()):
                    continue
                try:
                    networks.append(ipaddress.ip_network(text))
                except ValueError as exc:
                    raise ValueError(f"{text!r} is not a CIDR or IP address: {exc}") from None
        return cls(tuple(networks))

    def denial(self, host: str) -> str | None:
        """Why a probe to ``host`` is refused, or None when it is allowed."""
        # A zone (fe80::1%eth0) picks an interface of the node's own: refused like a name.
        address = _ip(host)
        if address is None:
            # Resolving here and connecting later would let the name's answer change in between
            # (DNS rebinding), so only addresses are checked, and allowed.
            return f"host {_cut(repr(host), 100)} is not an IP address (names are not allowed)"
        guarded = next(((net, what) for net, what in _GUARDED if address in net), None)
        for network in self.networks:
            if address in network and (guarded is None or _inside(network, guarded[0])):
                return None
        if guarded is not None:
            return (
                f"host {host} is {guarded[1]}, which reaches the node itself; allow it only by "
                "naming it in --annotation-probe-hosts"
            )
        if not self.networks:
            return (
                f"host {host}: annotation probes may not set host "
                "(--annotation-probe-hosts allows none)"
            )
        return f"host {host} is not in --annotation-probe-hosts"


def _inside(inner: IPNetwork, outer: IPNetwork) -> bool:
    if isinstance(inner, ipaddress.IPv4Network) and isinstance(outer, ipaddress.IPv4Network):
        return inner.subnet_of(outer)
    if isinstance(inner, ipaddress.IPv6Network) and isinstance(outer, ipaddress.IPv6Network):
        return inner.subnet_of(outer)
    return False


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


class TargetPod(Protocol):
    """What ``ProbeTarget.of`` reads of a container's pod (``discovery.model.PodInfo``)."""

    @property
    def ip(self) -> str: ...
    @property
    def ips(self) -> tuple[str, ...]: ...
    @property
    def host_network(self) -> bool: ...


class TargetContainer(Protocol):
    """What ``ProbeTarget.of`` reads of a container (``discovery.model.ContainerInfo``).

    Named here rather than imported, so that probing depends on no module of discovery (and
    through it on none of the runtime's).
    """

    @property
    def id(self) -> str: ...
    @property
    def annotations(self) -> Mapping[str, str]: ...
    @property
    def env(self) -> Mapping[str, str] | None: ...
    @property
    def pod(self) -> TargetPod: ...


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
        cls,
        container: TargetContainer,
        ports: Mapping[str, int],
        *,
        container_id: str | None = None,
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


@dataclass(frozen=True, slots=True)
class ProberOptions:
    """How probes are sent, beyond what each spec says: what ``serve`` takes from its flags
    (``--node-address``, ``--https-verify``/``--https-ca-file``, ``--annotation-probe-hosts``)
    and ``check`` from the same ones, so that a probe run by hand goes out as the daemon's would.
    """

    node_address: str = DEFAULT_NODE_ADDRESS
    tls: TLSOptions | None = None  # None: no verification, like the kubelet
    # Only annotation probes use it (``check`` runs none, so it keeps the default).
    annotation_hosts: AnnotationHosts = field(default_factory=AnnotationHosts)
    # The node's kubelet: which 1.37 probe fields (grpc.mode, httpGet.protocol) it honours.
    profile: KubeletProfile = field(default_factory=KubeletProfile)


class PreparedProbe:
    """``probe`` aimed at ``target`` by ``Prober.prepare``: each ``run`` is one attempt, sending
    what was resolved once (address, port, URL, headers, request bytes, what to withhold).

    It stays right while the probe, the target and the prober's settings do: ``fits`` tells (a
    worker keeps one and asks before each attempt). A probe that could not be prepared (a port
    not found, a denied host, an unsupported field) resolves again at each attempt, which raises
    the same ``ProbeError`` as before.
    """

    __slots__ = ("_send", "generation", "origin", "probe", "prober", "target")

    def __init__(
        self,
        prober: Prober,
        probe: Probe,
        target: ProbeTarget,
        origin: ProbeOrigin,
        send: Callable[[], Awaitable[ProbeOutcome]],
    ) -> None:
        self.prober = prober
        self.probe = probe
        self.target = target
        self.origin = origin
        self.generation = prober.generation  # the prober's settings it was built with
        self._send = send

    def fits(self, prober: Prober, probe: Probe, target: ProbeTarget, origin: ProbeOrigin) -> bool:
        """Whether this is still what ``prober.prepare(probe, target, origin)`` would build."""
        return (
            prober is self.prober
            and self.generation == prober.generation
            and (probe is self.probe or probe == self.probe)
            and (target is self.target or target == self.target)
            and origin == self.origin
        )

    async def run(self) -> ProbeOutcome:
        """One attempt; raise ``ProbeError`` if it could not run (see ``Prober.run``)."""
        try:
            outcome = await self._send()
        except ProbeError as exc:
            message = str(exc)
            if len(message) <= MAX_ERROR_CHARS:
                raise
            raise type(exc)(_cut(message, MAX_ERROR_CHARS)) from exc
        if len(outcome.output) > MAX_OUTPUT_BYTES:
            # Handlers cap what a target says; this also caps what they say about the spec
            # (an HTTP failure quotes its URL, whose path an annotation can make huge).
            outcome = dataclasses.replace(outcome, output=_cut(outcome.output, MAX_OUTPUT_BYTES))
        return outcome


class Prober:
    """Runs one probe attempt for any handler type."""

    def __init__(
        self,
        exec_runner: ExecRunner,
        *,
        node_address: str = DEFAULT_NODE_ADDRESS,
        tls: TLSOptions | None = None,
        annotation_hosts: AnnotationHosts | None = None,
        profile: KubeletProfile | None = None,
    ) -> None:
        self._exec_runner = exec_runner
        # Bumped whenever a setting an attempt depends on changes: prepared probes then rebuild.
        self.generation = 0
        self._node_address = node_address
        self._tls = tls
        self._annotation_hosts = annotation_hosts or AnnotationHosts()
        self._profile = profile or KubeletProfile()

    @property
    def node_address(self) -> str:
        """Where host-network pods are probed (``--node-address``); its family picks pod IPs."""
        return self._node_address

    @node_address.setter
    def node_address(self, value: str) -> None:
        self._node_address = value
        self.generation += 1

    @property
    def annotation_hosts(self) -> AnnotationHosts:
        """Where annotation probes with a ``host`` may connect (``--annotation-probe-hosts``)."""
        return self._annotation_hosts

    @annotation_hosts.setter
    def annotation_hosts(self, value: AnnotationHosts) -> None:
        self._annotation_hosts = value
        self.generation += 1

    @property
    def profile(self) -> KubeletProfile:
        """The node's kubelet: its User-Agent and the gates of the 1.37 probe fields."""
        return self._profile

    @profile.setter
    def profile(self, value: KubeletProfile) -> None:
        # The manager sets it once the Node is read: gated fields follow from the next attempt.
        self._profile = value
        self.generation += 1

    @classmethod
    def from_options(cls, exec_runner: ExecRunner, options: ProberOptions) -> Prober:
        """The prober ``serve`` and ``check`` build: exec probes through ``exec_runner`` (the
        runtime client, which holds the exec options), the rest as ``options`` say."""
        return cls(
            exec_runner,
            node_address=options.node_address,
            tls=options.tls,
            annotation_hosts=options.annotation_hosts,
            profile=options.profile,
        )

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

    async def run(
        self, probe: Probe, target: ProbeTarget, *, origin: ProbeOrigin = "rules"
    ) -> ProbeOutcome:
        """Run ``probe`` once against ``target``; raise ``ProbeError`` if it could not run.

        ``origin`` is who wrote the probe: annotation probes get the stricter policy (see the
        module's docstring). The manager passes every configured probe's own origin; the
        default serves RunProbe and ``check``, whose callers are root on the node.
        """
        return await self.prepare(probe, target, origin=origin).run()

    def prepare(
        self, probe: Probe, target: ProbeTarget, *, origin: ProbeOrigin = "rules"
    ) -> PreparedProbe:
        """``probe`` aimed at ``target``, resolved once for every attempt (see ``run``).

        Never raises: a probe that cannot be resolved errors at each attempt instead.
        """
        try:
            send = self._sender(probe, target, origin)
        except ProbeError:
            # Resolved again (and so raising again) at every attempt, exactly as before.
            send = functools.partial(self._run, probe, target, origin)
        return PreparedProbe(self, probe, target, origin, send)

    def _sender(
        self, probe: Probe, target: ProbeTarget, origin: ProbeOrigin
    ) -> Callable[[], Awaitable[ProbeOutcome]]:
        """What one attempt of ``probe`` calls, with everything but the sending resolved; raises
        the ``ProbeError`` an attempt would (``_run`` resolves the same way, per attempt)."""
        # Imported here: a probe exists only once the models were loaded (issue 36: serve with
        # nothing to probe does not load them), and this runs once per prepared probe.
        from cri_prober.probing.spec.model import (
            ExecAction,
            GRPCAction,
            HTTPGetAction,
            TCPSocketAction,
        )

        if unsupported := self.unsupported(probe):
            raise ProbeError(unsupported_message(unsupported), reason=Reason.UNSUPPORTED)
        handler = probe.handler
        timeout = probe.timeout_seconds
        if isinstance(handler, HTTPGetAction):
            url, headers, withhold, http2 = self._http_request(handler, target, origin)
            return HTTPGet(
                url,
                headers=headers,
                timeout=timeout,
                tls=self._tls,
                withhold=withhold,
                http2=http2,
                user_agent=self.profile.user_agent,
            ).send
        if isinstance(handler, TCPSocketAction):
            host, port = self._tcp_address(handler, target, origin)
            return functools.partial(probe_tcp, host, port, timeout=timeout)
        if isinstance(handler, GRPCAction):
            return self._grpc_check(handler, target, origin, timeout)
        if isinstance(handler, ExecAction):
            # The expansion and the runtime's request, once (a command that cannot be expanded
            # raises here, and so errors at every attempt, as before).
            return PreparedExec(
                self._exec_runner,
                target.container_id,
                handler.command,
                timeout=timeout,
                env=target.env,
            ).send
        raise ProbeError(f"unsupported probe handler {type(handler).__name__}")  # pragma: no cover

    def unsupported(self, probe: Probe) -> list[str]:
        """The fields of ``probe``'s handler that keep it from being sent as the node's kubelet
        would send it: unknown ones, and a 1.37 field's unknown value where the kubelet's gate
        for it is on (without the gate the kubelet ignores the field, and so does this)."""
        return [item.field for item in probe.unsupported if self._honours(item)]

    def _honours(self, item: Unsupported) -> bool:
        return item.gate is None or self.profile.gate(item.gate)

    async def _run(self, probe: Probe, target: ProbeTarget, origin: ProbeOrigin) -> ProbeOutcome:
        """One attempt of a probe that could not be prepared: resolved again, so that it raises
        the same ``ProbeError`` at every attempt (the kubelet discards an errored attempt, so
        nothing false is published)."""
        return await self._sender(probe, target, origin)()

    def _http_request(
        self, handler: HTTPGetAction, target: ProbeTarget, origin: ProbeOrigin
    ) -> tuple[str, list[tuple[str, str]], str | None, bool]:
        """An httpGet's URL, headers, what to withhold and whether it goes over h2c."""
        host = self._address(handler.host, target, origin)
        port = resolve_port(
            handler.port, target.ports, target.ports_annotation, ports_from=PORTS_FROM[origin]
        )
        try:
            url = build_url(handler.scheme.lower(), host, port, handler.path)
        except (UnicodeError, ValueError) as exc:
            # A path the URL cannot carry (a lone surrogate from a JSON "\ud800"): the
            # kubelet cannot build such a request either, which makes the attempt an error.
            raise ProbeError(f"cannot build a request for path {handler.path!r}: {exc}") from exc
        headers = [(h.name, h.value) for h in handler.http_headers]
        if origin == "annotation":
            # Whatever the target, a pod author may not copy a page into our logs and API.
            withhold: str | None = WITHHELD_FOR_ANNOTATIONS
        else:
            withhold = self._withhold(origin, handler.host, host, target)
        # KEP-5999: h2c only where the kubelet's gate is on; else the field is ignored.
        http2 = handler.protocol == "HTTP2" and self.profile.gate("H2CContainerProbe")
        return url, headers, withhold, http2

    def _tcp_address(
        self, handler: TCPSocketAction, target: ProbeTarget, origin: ProbeOrigin
    ) -> tuple[str, int]:
        host = self._address(handler.host, target, origin)
        port = resolve_port(
            handler.port, target.ports, target.ports_annotation, ports_from=PORTS_FROM[origin]
        )
        return host, port

    def _grpc_check(
        self, handler: GRPCAction, target: ProbeTarget, origin: ProbeOrigin, timeout: float
    ) -> Callable[[], Awaitable[ProbeOutcome]]:
        host = self._address("", target, origin)
        return functools.partial(
            probe_grpc,
            host,
            handler.port,
            service=handler.service,
            timeout=timeout,
            withhold=self._withhold(origin, "", host, target),
            # KEP-4939: TLS only where the kubelet's gate is on; else the field is ignored.
            tls=handler.mode == "TLS" and self.profile.gate("GRPCContainerProbeTLS"),
            user_agent=self.profile.user_agent,
        )

    def _withhold(
        self, origin: ProbeOrigin, host: str, address: str, target: ProbeTarget
    ) -> str | None:
        """Why a network probe keeps nothing its target sent, or None when it keeps all of it.

        The rules file is the operator's and keeps everything. Otherwise what the pod itself
        answered is kept: the probe names no ``host`` (so it goes to the pod's address: its IP,
        or for a host-network pod the node address, its own), or, for a pod with its own network,
        names one of the pod's IPs. Anything else (loopback, the metadata service, the node,
        another pod, a name, any explicit host of a host-network pod, whose addresses are the
        node's, or the empty address of a pod without an IP, which dials the node) may answer
        with what the node can read and the pod's author cannot, so only the status is kept.
        Redirects need no check of their own: only those to the same host are followed.
        """
        if origin == "rules" or (address and not host):
            return None
        if address and not target.host_network and _is_pod_ip(host, target.pod_ips):
            return None
        return WITHHELD_NOT_THE_POD

    def _address(self, host: str, target: ProbeTarget, origin: ProbeOrigin) -> str:
        """Where a network probe connects: its ``host``, else the pod's address.

        Raises:
            ProbeDenied: an annotation probe's ``host`` is not allowed, or the pod has no IP
                (the empty address would dial the node itself).
        """
        if origin != "annotation":
            # The rules file and the pod's own spec (the kubelet runs the same probe anyway).
            return host or self.pod_address(target)
        if host:
            if (reason := self.annotation_hosts.denial(host)) is not None:
                raise ProbeDenied(f"annotation probe denied, nothing sent: {reason}")
            return host
        if not (address := self.pod_address(target)):
            raise ProbeDenied(
                "annotation probe denied, nothing sent: the pod has no IP, and the empty address "
                "would reach the node itself"
            )
        return address


def unsupported_message(fields: Sequence[str]) -> str:
    """The error of an attempt not run for ``fields`` (names already bounded and escaped)."""
    return (
        f"unsupported: {', '.join(fields)}: cri-prober cannot send this probe as its spec "
        "asks, so it is not run (nothing was sent)"
    )


def _is_pod_ip(host: str, pod_ips: Sequence[str]) -> bool:
    address = _ip(host)
    return address is not None and any(_ip(ip) == address for ip in pod_ips)


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``text`` as the address the kernel connects to, or None for a name (or a zone)."""
    try:
        address = ipaddress.ip_address(text) if "%" not in text else None
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text) - limit} more characters)"


async def run_once(
    prober: Prober, probe: Probe, target: ProbeTarget, *, origin: ProbeOrigin = "rules"
) -> ProbeRecord:
    """Run one attempt and record it as a worker would, touching no worker or result state.

    Its callers (RunProbe, ``cri-prober check``) are root on the node, hence ``"rules"``.
    """
    started_wall = time.time()
    started = time.monotonic()
    try:
        outcome = await prober.run(probe, target, origin=origin)
    except ProbeError as exc:
        # Could not run: the worker's "error" attempt, with the reason as its output.
        return ProbeRecord.errored(
            target.container_id,
            started_wall,
            time.monotonic() - started,
            str(exc),
            reason=exc.reason,
        )
    return ProbeRecord.of(target.container_id, started_wall, time.monotonic() - started, outcome)
