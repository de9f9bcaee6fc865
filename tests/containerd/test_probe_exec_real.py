"""The exec handler on real containerd (1.6 and 2.1): verdicts, output, timeouts, $(VAR), errors.

The first tests mirror the rows of the kubelet's pkg/probe/exec/exec_test.go (TestExec) with real
commands. The rest pin down what the kubelet's CRI client does around ExecSync (cri-client
remote_runtime.go): it waits for containerd's answer up to timeout + runtime request timeout, so a
background child that holds the exec's stdout delays the verdict instead of turning it into a
timeout; and it refuses replies over 16 MiB, which makes the attempt an error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from cri_prober.probing.handlers.exec import probe_exec
from cri_prober.probing.outcome import MAX_OUTPUT_BYTES, ProbeError, ProbeResult
from cri_prober.runtime.client import DEFAULT_EXEC_START_HOLD, CriClient
from tests.support.testbed import ContainerSpec, PodFactory, Testbed

pytestmark = pytest.mark.containerd(versions=["1.6", "2.1"])

APP = ContainerSpec("app", env={"HEALTH_FILE": "/tmp/health", "MODE": "live"})
MiB = 1024 * 1024


@pytest.fixture(name="cri")
async def _cri(testbed: Testbed) -> AsyncIterator[CriClient]:
    async with CriClient.connect(testbed.endpoint) as client:
        yield client


@pytest.fixture(name="container_id")
async def _container_id(pods: PodFactory, cri: CriClient) -> str:
    pod = await pods.create_pod("exec-probe", containers=[APP])
    return pod.container_ids["app"]


# -- pkg/probe/exec/exec_test.go TestExec, row by row --------------------------------------------


async def test_exit_zero_is_success(cri: CriClient, container_id: str) -> None:
    """Row "Ok": a command exiting 0 is a success carrying its output."""
    outcome = await probe_exec(cri, container_id, ["sh", "-c", "echo fine"], timeout=5)
    assert (outcome.result, outcome.output, outcome.exit_code) == (ProbeResult.SUCCESS, "fine\n", 0)
    assert outcome.note == ""


async def test_output_is_cut_at_10_kib(cri: CriClient, container_id: str) -> None:
    """Row "Ok - truncated output": 11 KiB of output, the first 10 KiB kept."""
    outcome = await probe_exec(
        cri, container_id, ["sh", "-c", "yes logs-123 | head -c 11264"], timeout=5
    )
    assert outcome.result is ProbeResult.SUCCESS
    assert outcome.output == ("logs-123\n" * 1252)[:MAX_OUTPUT_BYTES]


async def test_nonzero_exit_is_failure_with_stdout_then_stderr(
    cri: CriClient, container_id: str
) -> None:
    """Row "Unhealthy": a non-zero exit is a failure; output is stdout followed by stderr."""
    outcome = await probe_exec(
        cri, container_id, ["sh", "-c", "echo err >&2; echo out; exit 3"], timeout=5
    )
    assert (outcome.result, outcome.output, outcome.exit_code) == (
        ProbeResult.FAILURE,
        "out\nerr\n",
        3,
    )


async def test_timeout_is_failure(cri: CriClient, container_id: str) -> None:
    """Row "Timeout": a command outliving timeoutSeconds is a failure with the timeout message."""
    outcome = await probe_exec(cri, container_id, ["sleep", "10"], timeout=1)
    assert outcome.result is ProbeResult.FAILURE
    assert outcome.output == 'command timed out: "sleep 10" timed out after 1s'
    assert outcome.timed_out
    assert outcome.note == ""  # containerd killed it and answered at once


async def test_unknown_executable_is_an_error_not_a_failure(
    cri: CriClient, container_id: str
) -> None:
    """Row "Run returns error": a missing binary means the probe could not run: ProbeError, which
    the worker discards."""
    with pytest.raises(ProbeError, match="/bin/nope"):
        await probe_exec(cri, container_id, ["/bin/nope"], timeout=5)


async def test_gone_container_is_an_error(cri: CriClient) -> None:
    """An unknown container is a ProbeError too."""
    with pytest.raises(ProbeError):
        await probe_exec(cri, "f" * 64, ["true"], timeout=5)


async def test_var_expansion_uses_the_containers_env(cri: CriClient, container_id: str) -> None:
    """$(VAR) expands from the container's env read from the runtime; unknown names stay. The
    output shows expanded values as their $(NAME) again (issue 15: values are never shown)."""
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
    # `cat` found the file only because $(HEALTH_FILE) expanded; MODE's value is masked.
    assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, "$(MODE) $(NOPE)\n")


# -- the kubelet's ExecSync deadline: timeout + runtime request timeout ---------------------------


async def test_background_child_delays_the_verdict_and_frees_the_slot(
    testbed: Testbed, container_id: str
) -> None:
    """`sleep 8 & exit 0` with timeout 1: the shell exits at once, but containerd answers only
    when the background sleep lets go of stdout, ~8 s later. The kubelet waits for that answer
    (its deadline is timeout + 2 min) and reports Success; so do we, with a note. Meanwhile the
    only exec slot went back at its start hold, since another call waited for it (issue 21: a
    hanging exec keeps a slot only while it is being started): that exec ran to completion in
    between."""
    async with CriClient.connect(testbed.endpoint, max_concurrent_execs=1) as cri:
        started = time.monotonic()
        late = asyncio.create_task(
            probe_exec(cri, container_id, ["sh", "-c", "sleep 8 & exit 0"], timeout=1)
        )
        queued = asyncio.create_task(probe_exec(cri, container_id, ["true"], timeout=1))
        other = await queued
        other_done = time.monotonic() - started
        assert other.result is ProbeResult.SUCCESS
        assert not late.done()
        assert cri.exec_slot_preemptions == 1
        # It took the late exec's slot once that was past its start hold, not after it ended.
        assert other_done >= DEFAULT_EXEC_START_HOLD - 0.05, other_done

        outcome = await late
        seconds = time.monotonic() - started
        print(
            f"\n{testbed.version}: sleep 8 & exit 0 -> {outcome.result.value} after {seconds:.2f}s"
        )
        assert (outcome.result, outcome.exit_code, outcome.timed_out) == (
            ProbeResult.SUCCESS,
            0,
            False,
        )
        # When the child let go, not at the client's own deadline (timeout + request timeout).
        assert 7.5 <= seconds < 1 + cri.runtime_request_timeout, seconds
        assert "past the 1s timeout" in outcome.note
        assert (cri.execs_in_flight, cri.execs_overdue) == (0, 0)


async def test_background_child_then_exit_1_is_a_failure(
    cri: CriClient, testbed: Testbed, container_id: str
) -> None:
    """The e2e #11 command, `sleep 10 & exit 1` with timeout 1: a Failure, and (as for the
    kubelet) from exit status 1 once the output drains ~10 s later, not from a timeout."""
    started = time.monotonic()
    outcome = await probe_exec(cri, container_id, ["sh", "-c", "sleep 10 & exit 1"], timeout=1)
    seconds = time.monotonic() - started
    print(f"\n{testbed.version}: sleep 10 & exit 1 -> {outcome.result.value} after {seconds:.2f}s")
    assert (outcome.result, outcome.exit_code, outcome.timed_out) == (
        ProbeResult.FAILURE,
        1,
        False,
    )
    assert 9.5 <= seconds < 1 + cri.runtime_request_timeout, seconds
    assert outcome.note


# -- the kubelet's 16 MiB reply limit ------------------------------------------------------------


async def test_15_mib_of_output_is_judged(cri: CriClient, container_id: str) -> None:
    """15 MiB of output fits in a reply: a verdict, with the first 10 KiB kept."""
    outcome = await probe_exec(
        cri, container_id, ["sh", "-c", "yes | head -c 15728640"], timeout=10
    )
    assert (outcome.result, outcome.output) == (
        ProbeResult.SUCCESS,
        "y\n" * (MAX_OUTPUT_BYTES // 2),
    )


async def test_17_mib_of_output_is_an_error(cri: CriClient, container_id: str) -> None:
    """17 MiB does not: RESOURCE_EXHAUSTED, so the attempt is an error (recorded as "error" and
    discarded by the worker), never a verdict."""
    with pytest.raises(ProbeError, match="RESOURCE_EXHAUSTED"):
        await probe_exec(cri, container_id, ["sh", "-c", "yes | head -c 17825792"], timeout=10)
