"""The exec handler, row by row against the kubelet's pkg/probe/exec/exec_test.go (TestExec).

Upstream feeds its prober a fake command; here a stub runner hands ``probe_exec`` what CriClient
would return for the same situation (an exit status with output, a timed-out result, or a
``CriError``). The rows that depend on the CRI client itself (late answers after a drain, the
16 MiB reply limit) run through a real CriClient against the fake runtime: in memory, and over a
gRPC socket for the reply limit, which the wire enforces.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.errors import CriError
from cri_prober.probing.handlers.exec import probe_exec
from cri_prober.probing.outcome import MAX_OUTPUT_BYTES, ProbeError, ProbeResult
from cri_prober.runtime.client import CriClient
from cri_prober.runtime.model import ExecResult
from tests.support.fake_runtime import FakeContainer, FakeRuntime, FakeRuntimeServer
from tests.support.memory_cri import memory_client

TEN_KIB = "logs-123" * 128 * 10  # 10240 bytes, as upstream builds it
ELEVEN_KIB = "logs-123" * 128 * 11  # 11264 bytes
MiB = 1024 * 1024


@dataclass
class StubRunner:
    """An ExecRunner answering every call with one fixed result or error."""

    result: ExecResult | None = None
    error: CriError | None = None

    async def exec_sync(self, container_id: str, cmd: Sequence[str], *, timeout: int) -> ExecResult:
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


@dataclass(frozen=True)
class Row:
    """One TestExec row: what the runtime did, and what the kubelet's prober makes of it."""

    runner: StubRunner
    result: ProbeResult | None  # None: an error (the kubelet's Unknown + error), not a verdict
    output: str = ""


def done(exit_code: int, stdout: str = "", stderr: str = "") -> StubRunner:
    return StubRunner(ExecResult(exit_code, stdout.encode(), stderr.encode()))


ROWS = {
    # "Ok": the command succeeded with output.
    "ok": Row(done(0, "OK"), ProbeResult.SUCCESS, "OK"),
    # "Ok" with an exit error of status 0: over CRI the status is a number, so this is exit 0
    # again; the output here comes on stderr, which the kubelet appends after stdout.
    "ok-exit-status-0": Row(done(0, stderr="OK"), ProbeResult.SUCCESS, "OK"),
    # "Ok - truncated output": 11 KiB of output, 10 KiB kept.
    "ok-truncated-output": Row(done(0, ELEVEN_KIB), ProbeResult.SUCCESS, TEN_KIB),
    # "Run returns error": the command could not run; Unknown + error, the attempt is discarded.
    "run-returns-error": Row(
        StubRunner(error=CriError("ExecSync", grpc.StatusCode.UNKNOWN, "test error")), None
    ),
    # "Unhealthy": a non-zero exit. (Upstream's fake ignores the row's input and writes the
    # expected output, which is ""; a real command's output is kept.)
    "unhealthy": Row(done(1, "Fail"), ProbeResult.FAILURE, "Fail"),
    # "Timeout": the CRI client's timeout error is a Failure whose output is the error text.
    "timeout": Row(
        StubRunner(ExecResult(None, b"", b"", timed_out=True)),
        ProbeResult.FAILURE,
        'command timed out: "testcmd" timed out after 1s',
    ),
}


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
async def test_exec_table(row: Row) -> None:
    """Each row's verdict and output, or its error."""
    if row.result is None:
        with pytest.raises(ProbeError, match="test error"):
            await probe_exec(row.runner, "c", ["testcmd"], timeout=1)
        return
    outcome = await probe_exec(row.runner, "c", ["testcmd"], timeout=1)
    assert (outcome.result, outcome.output) == (row.result, row.output)
    assert outcome.timed_out == (row.runner.result is not None and row.runner.result.timed_out)
    assert outcome.note == ""


async def test_exit_status_after_the_timeout_is_the_verdict_with_a_note() -> None:
    """A late exit status (the runtime waited for the output to close) is judged by its code,
    and the outcome notes how late it came."""
    runner = StubRunner(
        ExecResult(0, b"", b"", elapsed=8.04, drained_after_timeout=True),
    )
    outcome = await probe_exec(runner, "c", ["sh", "-c", "sleep 8 & exit 0"], timeout=1)
    assert (outcome.result, outcome.exit_code, outcome.timed_out) == (ProbeResult.SUCCESS, 0, False)
    assert "exit status 0 came after 8.0s, past the 1s timeout" in outcome.note

    runner.result = ExecResult(1, b"", b"", elapsed=10.1, drained_after_timeout=True)
    outcome = await probe_exec(runner, "c", ["sh", "-c", "sleep 10 & exit 1"], timeout=1)
    assert (outcome.result, outcome.exit_code) == (ProbeResult.FAILURE, 1)
    assert "exit status 1 came after 10.1s" in outcome.note


async def test_late_timeout_error_is_a_timeout_with_a_note() -> None:
    runner = StubRunner(
        ExecResult(None, b"", b"", timed_out=True, elapsed=6.0, drained_after_timeout=True)
    )
    outcome = await probe_exec(runner, "c", ["sleep", "60"], timeout=1)
    assert (outcome.result, outcome.timed_out) == (ProbeResult.FAILURE, True)
    assert "the timeout error came after 6.0s" in outcome.note


# -- through a CriClient and the fake runtime ---------------------------------------------------


CLIENT_SETTINGS = {"runtime_request_timeout": 5.0, "exec_slot_margin": 0.2}


@pytest.fixture(name="runtime")
def _runtime() -> FakeRuntime:
    return FakeRuntime()


@pytest.fixture(name="cri")
async def _cri(runtime: FakeRuntime) -> AsyncIterator[CriClient]:
    async with memory_client(runtime, **CLIENT_SETTINGS) as client:
        yield client


@pytest.fixture(name="wire_cri")
async def _wire_cri(runtime: FakeRuntime, tmp_path: Path) -> AsyncIterator[CriClient]:
    """A client over a real gRPC socket, for what the wire itself decides (its receive limit)."""
    async with (
        FakeRuntimeServer(str(tmp_path / "cri.sock"), runtime) as server,
        CriClient.connect(server.target, **CLIENT_SETTINGS) as client,
    ):
        yield client


async def test_late_success_through_the_client(cri: CriClient, runtime: FakeRuntime) -> None:
    """The D1 case end to end: exit 0, answered 1.5 s after timeout 1 s, is a Success."""
    drained = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def child_holds_stdout(_c: FakeContainer, _cmd: list[str]) -> None:
        # Let go 1.5 s after the command started: past the timeout and the slot margin.
        loop.call_later(1.5, drained.set)
        await drained.wait()

    runtime.exec_drain = child_holds_stdout
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    outcome = await probe_exec(cri, container.id, ["sh", "-c", "sleep 8 & exit 0"], timeout=1)
    assert (outcome.result, outcome.exit_code, outcome.timed_out) == (ProbeResult.SUCCESS, 0, False)
    assert "past the 1s timeout" in outcome.note


@pytest.mark.parametrize(
    ("size", "judged"), [(15 * MiB, True), (17 * MiB, False)], ids=["15MiB", "17MiB"]
)
async def test_output_size_limit_through_the_client(
    wire_cri: CriClient, runtime: FakeRuntime, size: int, judged: bool
) -> None:
    """15 MiB of output is judged (10 KiB kept); 17 MiB exceeds the kubelet's 16 MiB reply limit:
    RESOURCE_EXHAUSTED, which the prober reports as an error and the worker discards."""

    async def flood(_c: FakeContainer, _cmd: list[str], _t: int) -> api_pb2.ExecSyncResponse:
        return api_pb2.ExecSyncResponse(stdout=b"x" * size, exit_code=0)

    runtime.exec_handler = flood
    container = runtime.add_container(runtime.add_sandbox("p"), "c")
    if judged:
        outcome = await probe_exec(wire_cri, container.id, ["flood"], timeout=5)
        assert (outcome.result, outcome.output) == (ProbeResult.SUCCESS, "x" * MAX_OUTPUT_BYTES)
    else:
        with pytest.raises(ProbeError, match="RESOURCE_EXHAUSTED") as caught:
            await probe_exec(wire_cri, container.id, ["flood"], timeout=5)
        assert isinstance(caught.value.__cause__, CriError)


@pytest.mark.parametrize(
    ("seconds", "text"), [(1, "1s"), (59, "59s"), (60, "1m0s"), (90, "1m30s"), (3600, "1h0m0s")]
)
def test_timeout_is_printed_as_a_go_duration(seconds: int, text: str) -> None:
    """The kubelet's timeout message ends with the timeout as Go prints a time.Duration."""
    from cri_prober.probing.handlers.exec import go_duration

    assert go_duration(seconds) == text
