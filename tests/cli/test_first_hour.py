"""Issue 35, "the first hour": what a newcomer reads is in the words they typed (flags and
variables, not API fields), and says what it means (which threshold is which, why a startup
probe never ran, why a wide table's probe failed)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from cri_prober._gen.criprober.v1 import query_pb2
from cri_prober.cli.tables import container_summary, ps_wide_row
from tests.support.daemon import daemon_on_fake_runtime
from tests.support.fake_runtime import FakeRuntime
from tests.support.serve import cli_env, run_cli
from tests.support.waiting import HANG_GUARD

NOW = 1_790_000_000.0
RULES = """
probes:
  - match: {container: app}
    readinessProbe: {exec: {command: [check]}, periodSeconds: 1}
"""


def _container(**probes: query_pb2.ProbeStatus) -> query_pb2.Container:
    c = query_pb2.Container(
        id="a" * 64, name="app", pod_name="web", pod_namespace="shop",
        state=query_pb2.CONTAINER_RUNNING, started=True, ready=True, healthy=True,
        probes=query_pb2.Probes(**probes),
    )  # fmt: skip
    c.created_at.FromSeconds(int(NOW) - 60)
    return c


def test_inspect_says_which_threshold_is_which() -> None:
    spec = {"exec": {"command": ["true"]}, "periodSeconds": 10, "timeoutSeconds": 1,
            "successThreshold": 1, "failureThreshold": 3}  # fmt: skip
    status = query_pb2.ProbeStatus(
        result="success", active=True, detail=query_pb2.ProbeDetail(spec_json=json.dumps(spec))
    )
    lines = container_summary(_container(liveness=status), NOW)
    assert (
        "  In a row: 0 successes, 0 failures (thresholds: success 1, failure 3); 0 attempts in all"
    ) in lines


def test_inspect_says_why_a_startup_probe_of_a_started_container_never_ran() -> None:
    """A container running before serve started counts as started (KEP-4781): its startup
    probe stays unknown with 0 attempts, and inspect says why."""
    startup = query_pb2.ProbeStatus(result="unknown", active=True)
    lines = container_summary(_container(startup=startup), NOW)
    assert (
        "  Result: unknown (not run: the container was running when cri-prober started, so it "
        "counts as started)"
    ) in lines
    # Not said of a container that has not started: its startup probe is simply pending.
    pending = _container(startup=startup)
    pending.started = False
    assert "  Result: unknown" in container_summary(pending, NOW)


def test_ps_wide_keeps_the_reason_of_a_failure() -> None:
    failing = query_pb2.ProbeStatus(
        result="failure", active=True, hold="on hold until the container restarts",
        last_attempt=query_pb2.ProbeAttempt(reason="exit-code"),
    )  # fmt: skip
    ok = query_pb2.ProbeStatus(result="success", active=True)
    row = ps_wide_row(_container(liveness=failing, readiness=ok), NOW, no_trunc=False)
    assert row[9:12] == ("failure(exit-code,held)", "success", "-")


async def test_ps_help_explains_a_startup_probe_that_stays_unknown() -> None:
    result = await run_cli("ps", "--help")
    assert "running when cri-prober started and counts as started" in " ".join(
        result.stdout.split()
    )


async def test_watch_since_another_incarnation_names_the_flag(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    runtime.add_container(runtime.add_sandbox("web", namespace="shop"), "app")
    async with daemon_on_fake_runtime(tmp_path, runtime, RULES) as (daemon, _watcher):
        assert daemon.api is not None
        mine = daemon.api.transitions.incarnation
        result = await run_cli(
            "watch", "--since", "0123456789abcdef:3", "--address", daemon.config.listen
        )
    assert result.returncode == 1, result
    assert "since_sequence" not in result.stderr, result.stderr
    assert f"run watch without --since, or with --since {mine}:0 to replay" in result.stderr


async def test_a_bad_cri_prober_address_is_named_as_the_variable(tmp_path: Path) -> None:
    env = {**cli_env(), "CRI_PROBER_ADDRESS": "relative.sock"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cri_prober", "ps",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    async with asyncio.timeout(HANG_GUARD):
        _out, err = await proc.communicate()
    assert proc.returncode == 2
    assert err.decode().startswith("cri-prober: CRI_PROBER_ADDRESS 'relative.sock': "), err
    # The flag is still called the flag.
    flag = await run_cli("ps", "--address", "relative.sock")
    assert flag.stderr.startswith("cri-prober: --address 'relative.sock': "), flag.stderr
