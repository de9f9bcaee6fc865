"""The containerd testbed and the pod harness really work, on every containerd version."""

from __future__ import annotations

import asyncio
import ipaddress
import time
import urllib.request

import pytest

from cri_prober._gen.runtime.v1 import api_pb2
from tests.support.testbed import (
    CONTAINER_NAME_LABEL,
    POD_UID_LABEL,
    ContainerSpec,
    PodFactory,
    Testbed,
)
from tests.support.waiting import HANG_GUARD

pytestmark = pytest.mark.containerd

HTTPD = ContainerSpec(
    "httpd", command=["sh", "-c", "echo ok > /www/index.html && exec httpd -f -p 8080 -h /www"]
)


async def http_get(url: str, *, timeout: float = 10.0) -> bytes:
    """GET from a thread (urllib blocks), retrying until the server has started listening."""

    def get() -> bytes:
        with urllib.request.urlopen(url, timeout=2) as response:
            body: bytes = response.read()
            return body

    deadline = time.monotonic() + timeout
    while True:
        try:
            return await asyncio.to_thread(get)
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_cri_version_matches_the_testbed(testbed: Testbed, pods: PodFactory) -> None:
    response = await pods.runtime.Version(api_pb2.VersionRequest(), timeout=HANG_GUARD)

    assert response.runtime_name == "containerd"
    assert response.runtime_api_version == "v1"
    assert response.runtime_version.removeprefix("v").startswith(f"{testbed.version}.")
    assert f" {testbed.version}." in testbed.containerd_version


async def test_host_network_pod_runs(testbed: Testbed, pods: PodFactory) -> None:
    pod = await pods.create_pod("sleeper", containers=[ContainerSpec("main")])

    listed = await pods.runtime.ListContainers(
        api_pb2.ListContainersRequest(
            filter=api_pb2.ContainerFilter(pod_sandbox_id=pod.sandbox_id)
        ),
        timeout=HANG_GUARD,
    )
    [container] = listed.containers
    assert container.id == pod.containers["main"].id
    assert container.state == api_pb2.CONTAINER_RUNNING
    assert container.metadata.name == "main"
    assert container.labels[CONTAINER_NAME_LABEL] == "main"
    assert container.labels[POD_UID_LABEL] == pod.uid
    status = await pods.runtime.ContainerStatus(
        api_pb2.ContainerStatusRequest(container_id=container.id), timeout=10
    )
    assert status.status.state == api_pb2.CONTAINER_RUNNING
    assert status.status.started_at > 0
    assert status.status.finished_at == 0
    assert pod.ip == ""  # host network: CNI is skipped


async def test_cni_pod_gets_an_ip_and_serves_http(testbed: Testbed, pods: PodFactory) -> None:
    pod = await pods.create_pod("web", host_network=False, containers=[HTTPD])

    sandbox = await pods.runtime.PodSandboxStatus(
        api_pb2.PodSandboxStatusRequest(pod_sandbox_id=pod.sandbox_id), timeout=10
    )
    ip = ipaddress.IPv4Address(sandbox.status.network.ip)
    assert ip in testbed.network
    assert pod.ip == str(ip)
    assert await http_get(f"http://{ip}:8080/") == b"ok\n"


async def test_restart_container_creates_the_next_attempt(pods: PodFactory) -> None:
    pod = await pods.create_pod("restarter", containers=[ContainerSpec("main")])
    first = pod.containers["main"]

    pod = await pods.restart_container(pod, "main")

    second = pod.containers["main"]
    assert (first.attempt, second.attempt) == (0, 1)
    assert second.id != first.id
    old = await pods.container_status(first.id)
    assert old.state == api_pb2.CONTAINER_EXITED
    new = await pods.wait_for_container_state(second.id, api_pb2.CONTAINER_RUNNING)
    assert new.metadata.attempt == 1
    assert new.annotations["io.kubernetes.container.restartCount"] == "1"


async def test_remove_pod_and_cleanup_remove_everything(testbed: Testbed) -> None:
    async with testbed.pods() as factory:
        removed = await factory.create_pod("removed", containers=[ContainerSpec("main")])
        await factory.create_pod("host", containers=[ContainerSpec("main")])
        pod = await factory.create_pod("bridge", host_network=False, containers=[HTTPD])
        await factory.restart_container(pod, "httpd")

        await factory.remove_pod(removed)
        remaining = await factory.runtime.ListPodSandbox(api_pb2.ListPodSandboxRequest())
        assert sorted(item.metadata.name for item in remaining.items) == ["bridge", "host"]

        await factory.cleanup()

        sandboxes = await factory.runtime.ListPodSandbox(api_pb2.ListPodSandboxRequest())
        containers = await factory.runtime.ListContainers(api_pb2.ListContainersRequest())
        assert list(sandboxes.items) == []
        assert list(containers.containers) == []
