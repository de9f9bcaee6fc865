"""The exec handler on real containerd: verdicts, output, timeouts, $(VAR) and errors."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from cri_prober.probing.handlers.exec import probe_exec
from cri_prober.probing.outcome import ProbeError, ProbeResult
from cri_prober.runtime.client import CriClient
from tests.support.testbed import ContainerSpec, PodFactory, Testbed

APP = ContainerSpec("app", env={"HEALTH_FILE": "/tmp/health", "MODE": "live"})


@pytest.fixture(name="cri")
async def _cri(testbed_16: Testbed) -> AsyncIterator[CriClient]:
    async with CriClient.connect(testbed_16.endpoint) as client:
        yield client


@pytest.fixture(name="container_id")
async def _container_id(pods_16: PodFactory, cri: CriClient) -> str:
    pod = await pods_16.create_pod("exec-probe", containers=[APP])
    return pod.container_ids["app"]


async def test_exit_zero_is_success(cri: CriClient, container_id: str) -> None:
    """A command exiting 0 is a success carrying its output."""
    outcome = await probe_exec(cri, container_id, ["sh", "-c", "echo fine"], timeout=5)
    assert (outcome.result, outcome.output, outcome.exit_code) == (ProbeResult.SUCCESS, "fine\n", 0)


async def test_nonzero_exit_is_failure_with_stdout_then_stderr(
    cri: CriClient, container_id: str
) -> None:
    """A non-zero exit is a failure; output is stdout followed by stderr."""
    outcome = await probe_exec(
        cri, container_id, ["sh", "-c", "echo err >&2; echo out; exit 3"], timeout=5
    )
    assert (outcome.result, outcome.output, outcome.exit_code) == (
        ProbeResult.FAILURE,
        "out\nerr\n",
        3,
    )


async def test_timeout_is_failure(cri: CriClient, container_id: str) -> None:
    """A command outliving timeoutSeconds is a failure with the kubelet's timeout message."""
    outcome = await probe_exec(cri, container_id, ["sleep", "10"], timeout=1)
    assert outcome.result is ProbeResult.FAILURE
    assert outcome.output == 'command "sleep 10" timed out'
    assert outcome.timed_out


async def test_var_expansion_uses_the_containers_env(cri: CriClient, container_id: str) -> None:
    """$(VAR) expands from the container's env read from the runtime; unknown names stay."""
    status = await cri.container_status(container_id, verbose=True)
    assert status.env is not None
    await probe_exec(cri, container_id, ["touch", "$(HEALTH_FILE)"], timeout=5, env=status.env)
    outcome = await probe_exec(
        cri,
        container_id,
        ["sh", "-c", "cat $(HEALTH_FILE) && echo $(MODE) '$(NOPE)'"],
        timeout=5,
        env=status.env,
    )
    assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, "live $(NOPE)\n")


async def test_unknown_executable_is_an_error_not_a_failure(
    cri: CriClient, container_id: str
) -> None:
    """A missing binary means the probe could not run: ProbeError, which the worker discards."""
    with pytest.raises(ProbeError, match="/bin/nope"):
        await probe_exec(cri, container_id, ["/bin/nope"], timeout=5)


async def test_gone_container_is_an_error(cri: CriClient) -> None:
    """An unknown container is a ProbeError too."""
    with pytest.raises(ProbeError):
        await probe_exec(cri, "f" * 64, ["true"], timeout=5)
