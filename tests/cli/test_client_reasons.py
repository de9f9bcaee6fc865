"""Issue 24: a person who reads only ``ps``, ``health`` and ``watch`` knows which probe fails,
why, whether it counted and what it caused. Against an in-process daemon on the fake runtime,
the commands run as subprocesses."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.daemon import Daemon
from tests.support.daemon import daemon_on_fake_runtime
from tests.support.fake_runtime import FakeContainer, FakeRuntime
from tests.support.serve import run_cli
from tests.support.waiting import HANG_GUARD

RULES = """
probes:
  - match: {container: app}
    livenessProbe: {exec: {command: [check-live]}, periodSeconds: 1, failureThreshold: 2}
    readinessProbe: {exec: {command: [check-ready]}, periodSeconds: 1}
"""


async def _exec(_c: FakeContainer, cmd: list[str], _t: int) -> api_pb2.ExecSyncResponse:
    if cmd[0] == "check-live":
        return api_pb2.ExecSyncResponse(exit_code=1, stdout=b"alive file missing")
    return api_pb2.ExecSyncResponse(exit_code=0)


@pytest.fixture(name="daemon", params=["auto", "always"])
async def _daemon(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Daemon]:
    runtime = FakeRuntime(exec_handler=_exec)
    runtime.add_container(runtime.add_sandbox("web", namespace="shop"), "app")
    async with daemon_on_fake_runtime(tmp_path, runtime, RULES, failure_hold=request.param) as (
        daemon,
        watcher,
    ):
        # Both published: liveness failing, and readiness passing (its first step may come after
        # liveness's second on a busy machine).
        await watcher.until(
            lambda: (
                {("liveness", "failure"), ("readiness", "success")}
                <= {(t.kind.value, t.result.value) for t in watcher.transitions}
            ),
            timeout=HANG_GUARD,
        )
        yield daemon


async def test_health_says_which_probe_fails_why_and_what_it_caused(daemon: Daemon) -> None:
    held = daemon.config.failure_hold == "always"
    result = await run_cli("health", "shop/web/app", "--address", daemon.config.listen)
    assert result.returncode == 4, result.stderr
    assert result.stdout.strip() == "status: NOT_SERVING"
    line = result.stderr.strip()
    if held:  # the attempt that published the failure, 2 of failureThreshold 2, was the last
        assert line.startswith(
            "shop/web/app: liveness failure (exit-code 2/2, on hold until the"
        ), line
    else:  # it goes on failing: past the threshold the count is a run
        assert line.startswith("shop/web/app: liveness failure (exit-code "), line
        assert " in a row)" in line or "2/2)" in line, line
    assert line.endswith(": alive file missing"), line
    # The pod alone names the same container.
    pod = await run_cli("health", "shop/web", "--address", daemon.config.listen)
    assert pod.stderr.startswith("shop/web/app: liveness failure (exit-code "), pod.stderr


async def test_ps_and_watch_show_the_reason(daemon: Daemon) -> None:
    held = daemon.config.failure_hold == "always"
    ps = await run_cli("ps", "--address", daemon.config.listen)
    assert ps.returncode == 0, ps.stderr
    expected = "L:fail(exit-code,held)" if held else "L:fail(exit-code)"
    assert f"{expected} R:ok" in ps.stdout
    inspect = await run_cli("inspect", "shop/web/app", "--address", daemon.config.listen)
    assert "  Reason: exit-code (failure " in inspect.stdout
    assert ("on hold until the container restarts" in inspect.stdout) is held
    trigger = await run_cli(
        "inspect", "shop/web/app", "-o", "json", "--address", daemon.config.listen
    )
    liveness = json.loads(trigger.stdout)["probes"]["liveness"]
    assert liveness["lastAttempt"]["reason"] == "exit-code"
    assert liveness.get("hold", "") == ("on hold until the container restarts" if held else "")
    assert liveness["consecutiveFailures"] >= 2
