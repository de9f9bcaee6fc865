"""Aiming probes: container names, one-off probe specs, and the address a probe connects to."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from typing import Any, cast

import pytest

from cri_prober.discovery.model import container_info, pod_info
from cri_prober.discovery.naming import (
    AmbiguousTarget,
    ContainerRef,
    InvalidTarget,
    TargetNotFound,
    find_container,
    newest_attempts,
)
from cri_prober.probing.kinds import ProbeKind, parse_kind
from cri_prober.probing.outcome import ProbeOutcome, ProbeResult
from cri_prober.probing.prober import DEFAULT_NODE_ADDRESS, Prober, ProbeTarget, run_once
from cri_prober.probing.spec import Probe, ProbeOrigin, SpecError, parse_probe_json
from cri_prober.runtime.model import ExecResult, PodSandbox, SandboxState, SandboxStatus
from tests.support.fake_runtime import FakeRuntime
from tests.support.memory_cri import memory_client
from tests.support.waiting import HANG_GUARD


def ref(
    container_id: str,
    *,
    name: str = "app",
    pod: str = "web-0",
    uid: str = "uid-1",
    attempt: int = 0,
    created_at: int = 1,
    pod_created_at: int = 1,
) -> ContainerRef:
    return ContainerRef(
        id=container_id,
        name=name,
        attempt=attempt,
        created_at=created_at,
        pod_name=pod,
        pod_namespace="default",
        pod_uid=uid,
        pod_sandbox_id=f"sandbox-{uid}",
        pod_created_at=pod_created_at,
    )


REFS = [
    ref("abc111", attempt=0, created_at=1),
    ref("abc222", attempt=1, created_at=2),  # the restarted app of web-0
    ref("def333", name="sidecar"),
    ref("fed444", uid="uid-2", pod_created_at=5),  # web-0 recreated: a newer pod, same name
]


class TestFindContainer:
    def test_full_id_wins_over_prefixes(self) -> None:
        """An exact ID picks that container even when it prefixes another."""
        refs = [ref("abc"), ref("abcd", name="other")]
        assert find_container("abc", refs).id == "abc"

    def test_unique_prefix(self) -> None:
        """A prefix of exactly one ID picks that container."""
        assert find_container("def", REFS).id == "def333"

    def test_ambiguous_prefix_names_the_candidates(self) -> None:
        """A prefix of several IDs is ambiguous, and the message lists them."""
        with pytest.raises(AmbiguousTarget, match=r"matches 2 containers: abc111 .*abc222"):
            find_container("abc", REFS)

    def test_name_picks_newest_pod_then_newest_attempt(self) -> None:
        """namespace/pod/container is the newest attempt in the newest pod of that name."""
        assert find_container("default/web-0/app", REFS).id == "fed444"
        older_pod_only = REFS[:3]
        assert find_container("default/web-0/app", older_pod_only).id == "abc222"

    @pytest.mark.parametrize("target", ["nope", "default/web-0/db", "kube-system/web-0/app"])
    def test_not_found(self, target: str) -> None:
        """Names that match nothing are not found."""
        with pytest.raises(TargetNotFound):
            find_container(target, REFS)

    @pytest.mark.parametrize("target", ["", "default/web-0", "a/b/c/d", "default//app"])
    def test_invalid(self, target: str) -> None:
        """Empty names and the wrong number of parts are not container names."""
        with pytest.raises(InvalidTarget):
            find_container(target, REFS)


def test_newest_attempts_follow_the_manager_keys() -> None:
    """One container per (pod UID, name): the highest attempt."""
    assert sorted(r.id for r in newest_attempts(REFS)) == ["abc222", "def333", "fed444"]


class TestProbeJson:
    def test_valid_probe_gets_defaults(self) -> None:
        """A bare core/v1 Probe is validated and defaulted like a configured one."""
        probe = parse_probe_json('{"exec": {"command": ["true"]}}', ProbeKind.LIVENESS, source="x")
        assert (probe.period_seconds, probe.timeout_seconds, probe.failure_threshold) == (10, 1, 3)

    def test_errors_name_the_field_path(self) -> None:
        """Every broken rule is reported with its path inside the object."""
        with pytest.raises(SpecError) as error:
            parse_probe_json(
                '{"httpGet": {"port": 0}, "successThreshold": 2}',
                ProbeKind.LIVENESS,
                source="--probe",
            )
        assert error.value.lines == [
            "--probe: httpGet.port: must be a valid port name or number 1-65535 (got 0)",
            "--probe: successThreshold: must be 1",
        ]

    def test_kind_decides_the_rules(self) -> None:
        """A readiness probe may need several successes; a liveness probe may not."""
        text = '{"exec": {"command": ["true"]}, "successThreshold": 2}'
        assert parse_probe_json(text, ProbeKind.READINESS, source="x").success_threshold == 2

    def test_not_json(self) -> None:
        """Text that is not JSON says where it breaks."""
        with pytest.raises(SpecError, match="not valid JSON: line 1, column 2"):
            parse_probe_json("{nope", ProbeKind.LIVENESS, source="x")


def test_parse_kind() -> None:
    """Kinds are the lowercase names; anything else lists the choices."""
    assert parse_kind("startup") is ProbeKind.STARTUP
    with pytest.raises(ValueError, match="liveness, readiness, startup"):
        parse_kind("Liveness")


# --- the address of a probe without host: the kubelet's status.podIP (D14, D15) ---------------


class _NoExec:
    """An exec runner for probers that only run network probes here."""

    async def exec_sync(self, container_id: str, cmd: Sequence[str], *, timeout: int) -> ExecResult:
        raise AssertionError("no exec expected")


def _prober(node_address: str = DEFAULT_NODE_ADDRESS) -> Prober:
    return Prober(_NoExec(), node_address=node_address)


def _target(ips: Sequence[str], *, host_network: bool = False) -> ProbeTarget:
    return ProbeTarget(
        "c1", pod_ip=ips[0] if ips else "", pod_ips=tuple(ips), host_network=host_network
    )


# TestSortPodIPs in kubernetes pkg/kubelet/kubelet_pods_test.go; status.podIP is its first IP. A
# node IP of "" (no --node-ip) is our default node address, which is IPv4 too.
@pytest.mark.parametrize(
    ("node_ip", "ips", "expected"),
    [
        pytest.param("", ["10.0.0.1"], "10.0.0.1", id="Simple"),
        pytest.param("", ["10.0.0.1", "fd01::1234"], "10.0.0.1", id="Dual-stack"),
        pytest.param(
            "192.168.1.1",
            ["10.0.0.1", "fd01::1234"],
            "10.0.0.1",
            id="Dual-stack with explicit node IP",
        ),
        pytest.param(
            "",
            ["fd01::1234", "10.0.0.1"],
            "10.0.0.1",
            id="Dual-stack with CRI returning wrong family first",
        ),
        pytest.param(
            "192.168.1.1",
            ["fd01::1234", "10.0.0.1"],
            "10.0.0.1",
            id="Dual-stack with explicit node IP with CRI returning wrong family first",
        ),
        pytest.param(
            "fd00::5678",
            ["10.0.0.1", "fd01::1234"],
            "fd01::1234",
            id="Dual-stack with IPv6 node IP",
        ),
        pytest.param(
            "fd00::5678",
            ["fd01::1234", "10.0.0.1"],
            "fd01::1234",
            id="Dual-stack with IPv6 node IP, other CRI order",
        ),
        pytest.param("fd00::5678", ["10.0.0.1"], "10.0.0.1", id="No Pod IP matching Node IP"),
        pytest.param(
            "", ["fd01::1234"], "fd01::1234", id="No Pod IP matching (unspecified) Node IP"
        ),
        pytest.param("", ["10.0.0.1", "10.0.0.2", "10.0.0.3"], "10.0.0.1", id="Multiple IPv4 IPs"),
        pytest.param(
            "",
            ["10.0.0.1", "10.0.0.2", "fd01::1234", "10.0.0.3", "fd01::5678"],
            "10.0.0.1",
            id="Multiple Dual-Stack IPs",
        ),
    ],
)
def test_kubelet_sort_pod_ips(node_ip: str, ips: list[str], expected: str) -> None:
    """TestSortPodIPs: the pod IP of the node's primary family comes first, whatever CRI's order."""
    prober = _prober(node_ip or DEFAULT_NODE_ADDRESS)
    assert prober.pod_address(_target(ips)) == expected


@pytest.mark.parametrize(
    ("node_address", "ips", "expected"),
    [
        pytest.param(
            "node-1.example", ["fd01::1", "10.0.0.1"], "10.0.0.1", id="named-node-is-ipv4"
        ),
        pytest.param("::ffff:10.1.1.1", ["fd01::1", "10.0.0.1"], "10.0.0.1", id="v4-mapped-node"),
        pytest.param("fd00::1", ["10.0.0.1", "::ffff:10.0.0.2"], "10.0.0.1", id="v4-mapped-pod-ip"),
        # determinePodSandboxIPs keeps no IP at all when one of them does not parse.
        pytest.param("", ["10.0.0.1", "not-an-ip"], "", id="unparseable-ip-drops-all"),
        pytest.param("", ["fe80::1%eth0", "10.0.0.1"], "", id="zoned-ip-is-unparseable"),
        pytest.param("", [], "", id="no-ip"),
    ],
)
def test_pod_address_edge_cases(node_address: str, ips: list[str], expected: str) -> None:
    """Families as Go's net.IP sees them; an IP that does not parse leaves the pod without one."""
    assert _prober(node_address or DEFAULT_NODE_ADDRESS).pod_address(_target(ips)) == expected


def test_host_network_pod_uses_the_node_address() -> None:
    """A host-network pod has no CRI IP: it is probed at the node address, as before."""
    assert _prober("192.0.2.7").pod_address(_target([], host_network=True)) == "192.0.2.7"


def test_target_with_only_pod_ip_keeps_it() -> None:
    """A hand-built target with just ``pod_ip`` still probes that IP."""
    target = ProbeTarget("c1", pod_ip="10.0.0.9")
    assert (target.pod_ips, _prober().pod_address(target)) == (("10.0.0.9",), "10.0.0.9")


def _sandbox_status(ip: str, additional: Sequence[str]) -> SandboxStatus:
    sandbox = PodSandbox("s1", "web-0", "default", "uid-1", 0, SandboxState.SANDBOX_READY, 1)
    return SandboxStatus(sandbox, ip, tuple(additional), host_network=False)


@pytest.mark.parametrize(
    ("ip", "additional", "expected"),
    [
        pytest.param("fd01::1", ["10.0.0.1"], ("fd01::1", "10.0.0.1"), id="dual-stack"),
        pytest.param("10.0.0.1", [], ("10.0.0.1",), id="single"),
        pytest.param("", ["10.0.0.1"], ("10.0.0.1",), id="empty-primary-skipped"),
        pytest.param("", [], (), id="none"),
    ],
)
def test_pod_info_lists_every_ip_in_cri_order(
    ip: str, additional: list[str], expected: tuple[str, ...]
) -> None:
    """PodInfo.ips is CRI's ip then additional_ips, like the kubelet's determinePodSandboxIPs."""
    pod = pod_info(_sandbox_status(ip, additional))
    assert (pod.ip, pod.ips) == (ip, expected)


async def test_dual_stack_pod_is_probed_at_the_primary_family_ip() -> None:
    """From CRI to the probe: a dual-stack sandbox whose primary CRI IP is IPv6 is probed at its
    IPv4 address on an IPv4 node, and at the IPv6 one on an IPv6 node."""
    runtime = FakeRuntime()
    sandbox = runtime.add_sandbox("web-0", ip="fd01::1234", additional_ips=["10.0.0.1"])
    container = runtime.add_container(sandbox, "app")
    async with memory_client(runtime) as cri:
        pod = pod_info(await cri.pod_sandbox_status(sandbox.id))
        info = container_info(await cri.container_status(container.id), pod, None)
    target = ProbeTarget.of(info, {})
    assert (target.pod_ip, target.pod_ips) == ("fd01::1234", ("fd01::1234", "10.0.0.1"))
    assert _prober().pod_address(target) == "10.0.0.1"
    assert _prober("fd00::5678").pod_address(target) == "fd01::1234"


@pytest.fixture(name="closed_port")
def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_pod_without_ip_is_probed_on_the_node() -> None:
    """No pod IP is not an error: like the kubelet's dial of ":port", the probe reaches a listener
    on the node, and its verdict counts."""
    accepted = asyncio.Event()

    def accept(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        probe = parse_probe_json(
            f'{{"tcpSocket": {{"port": {port}}}}}', ProbeKind.LIVENESS, source="x"
        )
        record = await run_once(_prober(), probe, ProbeTarget("c1"))
        await asyncio.wait_for(accepted.wait(), HANG_GUARD)
    assert (record.result, record.output) == ("success", "")


async def test_pod_without_ip_and_nothing_listening_fails_with_the_kubelets_url(
    closed_port: int,
) -> None:
    """An httpGet to a pod without an IP fails (not errors) with the kubelet's URL http://:port/."""
    probe = parse_probe_json(
        f'{{"httpGet": {{"port": {closed_port}, "path": "/healthz"}}}}',
        ProbeKind.READINESS,
        source="x",
    )
    record = await run_once(_prober(), probe, ProbeTarget("c1"))
    url = f"http://:{closed_port}/healthz"
    assert (record.result, record.output) == (
        "failure",
        f'Get "{url}": dial tcp :{closed_port}: connect: connection refused',
    )


class _LateAnswer(Prober):
    """A prober whose exec answer came after the probe's timeout."""

    async def run(
        self, probe: Probe, target: ProbeTarget, *, origin: ProbeOrigin = "rules"
    ) -> ProbeOutcome:
        return ProbeOutcome(
            ProbeResult.FAILURE, "", exit_code=None, timed_out=True, note="answered 2.1s late"
        )


async def test_run_once_records_an_attempt_as_a_worker_does_note_included() -> None:
    """RunProbe and ``check`` build their record the worker's way: the note is kept."""
    probe = parse_probe_json('{"exec": {"command": ["true"]}}', ProbeKind.LIVENESS, source="x")
    record = await run_once(_LateAnswer(cast(Any, None)), probe, ProbeTarget("c1"))
    assert (record.container_id, record.result, record.timed_out) == ("c1", "failure", True)
    assert record.note == "answered 2.1s late"
