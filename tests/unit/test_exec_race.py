"""Issue 34, item 8: an exec probe that races its container's stop or removal (containerd
answers that the container is not running, or not found) is an errored attempt, as the
kubelet's is, with reason ``not-running`` and a debug line, not a ``probe_errored`` warning per
container stopped under churn. Other ExecSync errors keep their reason and their warning."""

from __future__ import annotations

import grpc
import pytest
from structlog.testing import capture_logs

from cri_prober.errors import CriContainerNotRunning, CriError, CriNotFound
from cri_prober.probing.outcome import Reason
from cri_prober.probing.spec import ProbeKind, load_rules
from cri_prober.runtime.client import container_not_running
from tests.support.fake_runtime import FakeRuntime
from tests.support.manager_world import manager_world
from tests.support.memory_cri import memory_client

RULES = """
probes:
  - match: {container: app}
    readinessProbe: {exec: {command: [check]}, periodSeconds: 600}
"""


@pytest.mark.parametrize(
    ("code", "details", "not_running"),
    [
        # containerd's CRI check, its shim's task states, runc (cri-facts.md, section 2.1).
        (
            grpc.StatusCode.UNKNOWN,
            "failed to exec in container: container is in CONTAINER_EXITED state",
            True,
        ),
        (
            grpc.StatusCode.UNKNOWN,
            'failed to exec in container: failed to create exec "1f2e": '
            "cannot exec in a stopped state: unknown",
            True,
        ),
        (
            grpc.StatusCode.UNKNOWN,
            'failed to exec in container: failed to create exec "1f2e": '
            "cannot exec in a deleted state: unknown",
            True,
        ),
        (
            grpc.StatusCode.UNKNOWN,
            'failed to exec in container: failed to start exec "1f2e": OCI runtime exec failed: '
            "exec failed: cannot exec in a stopped container: unknown",
            True,
        ),
        (
            grpc.StatusCode.NOT_FOUND,
            'failed to exec in container: failed to find container "c1" in store: not found',
            True,
        ),
        (
            grpc.StatusCode.NOT_FOUND,
            "failed to exec in container: failed to load task: no running task found: "
            "task c1 not found: not found",
            True,
        ),
        # The exec itself failed: the container runs.
        (
            grpc.StatusCode.UNKNOWN,
            'failed to exec in container: failed to start exec "1f2e": OCI runtime exec failed: '
            'exec failed: unable to start container process: exec: "chek": executable file not '
            "found in $PATH: unknown",
            False,
        ),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "received message larger than max", False),
        (grpc.StatusCode.UNAVAILABLE, "connection refused", False),
    ],
)
def test_which_execsync_errors_say_the_container_is_not_running(
    code: grpc.StatusCode, details: str, not_running: bool
) -> None:
    assert container_not_running(CriError("ExecSync", code, details)) is not_running


async def test_exec_sync_on_a_stopped_or_removed_container_raises_not_running() -> None:
    runtime = FakeRuntime()
    sandbox = runtime.add_sandbox("web")
    stopped = runtime.add_container(sandbox, "stopped")
    removed = runtime.add_container(sandbox, "removed")
    runtime.exit_container(stopped.id)
    runtime.remove_container(removed.id)
    async with memory_client(runtime) as cri:
        for container_id in (stopped.id, removed.id):
            with pytest.raises(CriContainerNotRunning):
                await cri.exec_sync(container_id, ["check"], timeout=1)
        # A removed container is still a CriNotFound to callers that ask about the container.
        with pytest.raises(CriNotFound):
            await cri.exec_sync(removed.id, ["check"], timeout=1)


async def test_an_exec_that_races_the_stop_is_not_running_and_logged_at_debug() -> None:
    """The runtime stopped the container; discovery has not seen it yet (no relist), so the
    worker still probes it: every try is refused, and the attempt is discarded as before."""
    async with manager_world(load_rules(RULES, source="rules.yaml"), {"check": 0}) as world:
        app = await world.start()
        ready = ProbeKind.READINESS
        await world.watcher.until(lambda: world.state(app.id, ready).attempts >= 1, 10)
        world.runtime.exit_container(app.id)  # the stop, not yet seen by discovery
        with capture_logs() as logs:
            world.manager.probe_now(app.id, ready)
            await world.watcher.until(lambda: world.state(app.id, ready).attempts >= 2, 10)
        state = world.state(app.id, ready)
        errored = state.history[-1]
        assert errored.result == "error"
        assert errored.reason == Reason.NOT_RUNNING
        assert "container is in CONTAINER_EXITED state" in errored.output
        # Discarded, as the kubelet discards it: the run of successes is untouched.
        assert (state.consecutive_successes, state.consecutive_failures) == (1, 0)
        lines = [entry for entry in logs if entry["event"] == "probe_errored"]
        assert [(line["log_level"], line["reason"]) for line in lines] == [
            ("debug", Reason.NOT_RUNNING)
        ]
        assert not [entry for entry in logs if entry["log_level"] in ("warning", "error")]


async def test_other_exec_errors_keep_their_reason_and_warning() -> None:
    """An error that says nothing of the container's state (here the fake's runtime refusing
    the call) is still a runtime error, logged as a warning."""
    async with manager_world(load_rules(RULES, source="rules.yaml"), {"check": 0}) as world:
        app = await world.start()
        ready = ProbeKind.READINESS
        await world.watcher.until(lambda: world.state(app.id, ready).attempts >= 1, 10)
        world.runtime.fail_next("ExecSync", *[grpc.StatusCode.UNKNOWN] * 3)  # every try
        with capture_logs() as logs:
            world.manager.probe_now(app.id, ready)
            await world.watcher.until(lambda: world.state(app.id, ready).attempts >= 2, 10)
        errored = world.state(app.id, ready).history[-1]
        assert (errored.result, errored.reason) == ("error", Reason.RUNTIME_ERROR)
        lines = [entry for entry in logs if entry["event"] == "probe_errored"]
        assert [line["log_level"] for line in lines] == ["warning"]
