"""CriClient against real containerd (1.6, 2.1, 1.7): listing, status and ExecSync semantics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from cri_prober.errors import CriError, CriNotFound
from cri_prober.runtime.client import CriClient
from cri_prober.runtime.model import ContainerState, SandboxState
from tests.support.testbed import ContainerSpec, PodFactory, Testbed

SLEEPER = ContainerSpec("app", env={"GREETING": "hello"})


@pytest.fixture(name="cri")
async def _cri(testbed: Testbed) -> AsyncIterator[CriClient]:
    async with CriClient.connect(testbed.endpoint) as client:
        yield client


async def test_version_reports_containerd(testbed: Testbed, cri: CriClient) -> None:
    """Version names containerd, its version and CRI v1."""
    info = await cri.version()
    assert info.runtime_name == "containerd"
    assert info.runtime_api_version == "v1"
    assert info.runtime_version.removeprefix("v").startswith(f"{testbed.version}.")


async def test_status_reports_runtime_ready(cri: CriClient) -> None:
    """Status carries the RuntimeReady condition, true while containerd answers."""
    conditions = {c.type: c.status for c in await cri.status()}
    assert conditions["RuntimeReady"] is True


async def test_list_sandboxes_and_containers_with_metadata(
    cri: CriClient, pods: PodFactory
) -> None:
    """Listings carry pod metadata, kubelet labels, states and creation times."""
    pod = await pods.create_pod(
        "web-1", namespace="shop", labels={"tier": "web"}, containers=[SLEEPER]
    )
    sandboxes = {s.id: s for s in await cri.list_pod_sandboxes()}
    sandbox = sandboxes[pod.sandbox_id]
    assert (sandbox.name, sandbox.namespace, sandbox.uid) == ("web-1", "shop", pod.uid)
    assert sandbox.state is SandboxState.SANDBOX_READY
    assert sandbox.labels["tier"] == "web"

    containers = [c for c in await cri.list_containers() if c.pod_sandbox_id == pod.sandbox_id]
    assert [c.name for c in containers] == ["app"]
    [container] = containers
    assert container.id == pod.container_ids["app"]
    assert container.state is ContainerState.CONTAINER_RUNNING
    assert container.created_at > 0
    assert container.labels["io.kubernetes.container.name"] == "app"
    assert container.labels["io.kubernetes.pod.namespace"] == "shop"


async def test_container_status_lifecycle(cri: CriClient, pods: PodFactory) -> None:
    """ContainerStatus shows started_at while running, then finished_at and the exit code."""
    pod = await pods.create_pod("status", containers=[SLEEPER])
    cid = pod.container_ids["app"]
    running = await cri.container_status(cid, verbose=True)
    assert running.state is ContainerState.CONTAINER_RUNNING
    assert running.started_at > 0
    assert running.finished_at == 0
    assert running.env is not None
    assert running.env["GREETING"] == "hello"
    await pods.stop_container(cid, timeout=0)
    exited = await cri.container_status(cid[:12])  # a unique prefix works too
    assert exited.id == cid
    assert exited.state is ContainerState.CONTAINER_EXITED
    assert exited.finished_at >= exited.started_at > 0
    assert exited.exit_code == 137


async def test_sandbox_status_host_network(cri: CriClient, pods: PodFactory) -> None:
    """A host-network sandbox reports no pod IP and the NODE network mode."""
    pod = await pods.create_pod("hostnet", containers=[SLEEPER])
    status = await cri.pod_sandbox_status(pod.sandbox_id)
    assert status.host_network
    assert status.ip == ""


async def test_exec_sync_success_and_failure(cri: CriClient, pods: PodFactory) -> None:
    """Exit 0 and a non-zero exit both come back as results with separate stdout and stderr."""
    pod = await pods.create_pod("exec", containers=[SLEEPER])
    cid = pod.container_ids["app"]
    ok = await cri.exec_sync(cid, ["sh", "-c", "echo out; echo $GREETING"], timeout=5)
    assert (ok.exit_code, ok.stdout, ok.stderr, ok.timed_out) == (0, b"out\nhello\n", b"", False)
    bad = await cri.exec_sync(cid, ["sh", "-c", "echo to-out; echo to-err >&2; exit 1"], timeout=5)
    assert (bad.exit_code, bad.stdout, bad.stderr) == (1, b"to-out\n", b"to-err\n")


async def test_exec_sync_timeout_is_a_timeout(cri: CriClient, pods: PodFactory) -> None:
    """A command outliving its timeout is reported as timed out by the runtime, at the timeout
    (not by the client's own deadline, timeout + the runtime request timeout)."""
    pod = await pods.create_pod("exec-timeout", containers=[SLEEPER])
    loop = asyncio.get_running_loop()
    started = loop.time()
    result = await cri.exec_sync(pod.container_ids["app"], ["sleep", "10"], timeout=1)
    elapsed = loop.time() - started
    assert result.timed_out
    assert result.exit_code is None
    assert elapsed < 1 + cri.runtime_request_timeout


async def test_exec_sync_child_holding_stdout_waits_like_the_kubelet(
    cri: CriClient, pods: PodFactory
) -> None:
    """D1: containerd answers when the exec's output closes; like the kubelet (deadline timeout
    + 2 min) the client waits for it, so a background child holding stdout makes the exit
    status of the command arrive late, judged by its exit code, not as a timeout."""
    pod = await pods.create_pod("exec-hang", containers=[SLEEPER])
    loop = asyncio.get_running_loop()
    started = loop.time()
    result = await cri.exec_sync(
        pod.container_ids["app"], ["sh", "-c", "sleep 4 & exit 1"], timeout=1
    )
    elapsed = loop.time() - started
    assert (result.timed_out, result.exit_code) == (False, 1)
    assert result.drained_after_timeout
    assert 3.5 < elapsed < 1 + cri.runtime_request_timeout


async def test_exec_sync_missing_container_is_not_found(cri: CriClient) -> None:
    """ExecSync on an unknown container ID raises CriNotFound."""
    with pytest.raises(CriNotFound):
        await cri.exec_sync("0" * 64, ["true"], timeout=1)


async def test_exec_sync_unknown_executable_is_an_error(cri: CriClient, pods: PodFactory) -> None:
    """An executable that does not exist is a CRI error, not an exit code."""
    pod = await pods.create_pod("exec-missing", containers=[SLEEPER])
    with pytest.raises(CriError) as caught:
        await cri.exec_sync(pod.container_ids["app"], ["/no/such/binary"], timeout=5)
    assert "no/such/binary" in caught.value.details
