"""Issue 35: the daemon says why it is NOT_SERVING (``health``, ``ps``, gRPC clients), warns when
it has nothing to probe, and logs the exit status it really ends with."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cri_prober.daemon import Daemon, ServeConfig, read_rules
from cri_prober.runtime.endpoints import Endpoint
from tests.support.daemon import daemon_on_fake_runtime
from tests.support.fake_runtime import FakeRuntime
from tests.support.serve import cli_env, run_cli
from tests.support.waiting import HANG_GUARD, until

# docs/interface.md: Check("")'s trailing metadata.
REASON_METADATA_KEY = "criprober-not-serving-reason"
WARNING_METADATA_KEY = "criprober-warning"
RULES = """
probes:
  - match: {container: app}
    readinessProbe: {exec: {command: [check]}, periodSeconds: 1}
"""


@contextlib.asynccontextmanager
async def _daemon_without_runtime(tmp_path: Path) -> AsyncIterator[Daemon]:
    """serve with no rules file, no --probes-from, and a runtime socket that does not exist,
    until the runtime counts as unreachable (after 0.2 s here instead of 10 s)."""
    endpoint = f"unix://{tmp_path}/none.sock"
    config = ServeConfig(
        endpoint=Endpoint(endpoint, "flag", endpoint),
        listen=f"unix://{tmp_path}/api.sock",
        relist_period=0.2,
        pleg="relist",
        state_file=None,
    )
    daemon = Daemon(config, read_rules(None))
    daemon.cri.liveness.unresponsive_after = 0.2
    changed = asyncio.Event()
    unsubscribe = daemon.cri.liveness.changes.subscribe(lambda _v: changed.set())
    task = asyncio.create_task(daemon.run())
    try:
        await until(
            lambda: task.done() or (daemon.api is not None and not daemon.cri.liveness.responsive),
            timeout=HANG_GUARD,
            changed=changed,
            poll=0.05,
        )
        assert not task.done(), task.result()
        yield daemon
    finally:
        unsubscribe()
        daemon.stop_event.set()
        async with asyncio.timeout(HANG_GUARD):
            await task


async def test_health_names_why_the_daemon_is_not_serving(tmp_path: Path) -> None:
    async with _daemon_without_runtime(tmp_path) as daemon:
        result = await run_cli("health", "--address", daemon.config.listen)
    assert result.returncode == 4, result.stderr
    assert result.stdout.strip() == "status: NOT_SERVING"
    lines = result.stderr.splitlines()
    assert f"cri-prober: runtime unreachable at unix://{tmp_path}/none.sock since " in "\n".join(
        lines
    ), result.stderr
    assert (
        "cri-prober: discovery not complete: no listing of the runtime's containers has "
        "succeeded yet"
    ) in lines, result.stderr
    # Item 5: nothing to probe but annotations, said in health too.
    assert (
        "cri-prober: warning: no rules file (--config) and no --probes-from: only containers "
        "whose pods carry a probes.cri-prober.io/<container> annotation are probed"
    ) in lines, result.stderr


async def test_grpc_clients_get_the_reasons_as_trailing_metadata(tmp_path: Path) -> None:
    """grpc.health.v1 has no field for them: Check("") sends them as trailing metadata, which
    grpc-health-probe ignores (the answer itself is the plain NOT_SERVING)."""
    async with (
        _daemon_without_runtime(tmp_path) as daemon,
        grpc.aio.insecure_channel(f"unix:{tmp_path}/api.sock") as channel,
    ):
        call = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        response = await call
        trailing = list(await call.trailing_metadata())
        assert daemon.api is not None
    assert response == health_pb2.HealthCheckResponse(
        status=health_pb2.HealthCheckResponse.NOT_SERVING
    )
    reasons = [value for key, value in trailing if key == REASON_METADATA_KEY]
    assert reasons[0].startswith(f"runtime unreachable at unix://{tmp_path}/none.sock since ")
    assert reasons[1].startswith("discovery not complete")
    assert [key for key, _ in trailing].count(WARNING_METADATA_KEY) == 1


async def test_ps_says_the_runtime_is_unreachable_and_exits_1(tmp_path: Path) -> None:
    async with _daemon_without_runtime(tmp_path) as daemon:
        table = await run_cli("ps", "--address", daemon.config.listen)
        as_json = await run_cli("ps", "-o", "json", "--address", daemon.config.listen)
    assert table.returncode == 1, table
    assert table.stdout.startswith("CONTAINER")  # the (empty) listing is still printed
    assert table.stderr.startswith("cri-prober: the daemon cannot see the runtime's containers"), (
        table.stderr
    )
    assert f"  runtime unreachable at unix://{tmp_path}/none.sock since " in table.stderr
    assert as_json.returncode == 1
    data = json.loads(as_json.stdout)
    assert data["containers"] == []
    assert data["notServing"]["viewStale"] is True
    assert data["notServing"]["reasons"][0].startswith("runtime unreachable at ")


async def test_a_serving_daemon_with_rules_says_nothing_more(tmp_path: Path) -> None:
    """With a rules file and a runtime that answers: no warning, no reasons, ps -o json as
    before (no notServing key)."""
    runtime = FakeRuntime()
    runtime.add_container(runtime.add_sandbox("web", namespace="shop"), "app")
    async with daemon_on_fake_runtime(tmp_path, runtime, RULES) as (daemon, _watcher):
        health = await run_cli("health", "--address", daemon.config.listen)
        ps = await run_cli("ps", "-o", "json", "--address", daemon.config.listen)
    assert (health.returncode, health.stderr) == (0, ""), health
    assert (ps.returncode, ps.stderr) == (0, ""), ps
    assert list(json.loads(ps.stdout)) == ["containers"]


@pytest.mark.parametrize("which", ["--listen", "--metrics-address"])
async def test_serve_that_cannot_start_logs_its_real_exit_code(tmp_path: Path, which: str) -> None:
    """A taken --listen or --metrics-address port: exit 2, and serve_stopped says 2, not 0."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        address = f"tcp://127.0.0.1:{port}" if which == "--listen" else f"127.0.0.1:{port}"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "cri_prober", "serve", "-r", f"unix://{tmp_path}/none.sock",
            "--listen", f"unix://{tmp_path}/api.sock", "--log-format", "json", which, address,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(),
        )  # fmt: skip
        async with asyncio.timeout(HANG_GUARD):
            _out, err = await proc.communicate()
    assert proc.returncode == 2, err.decode()
    records = [json.loads(line) for line in err.decode().splitlines() if line.startswith("{")]
    [stopped] = [r for r in records if r["event"] == "serve_stopped"]
    assert stopped["exit_code"] == 2
    assert err.decode().splitlines()[-1].startswith(f"cri-prober: {which}"), err.decode()


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({}, "only containers whose pods carry a probes.cri-prober.io/<container> annotation"),
        ({"annotations": "off"}, "nothing to probe: no rules file (--config), no --probes-from"),
        ({"config_file": Path("rules.yaml")}, None),
    ],
)
def test_serve_warns_when_nothing_but_annotations_can_define_probes(
    config: dict[str, object], expected: str | None
) -> None:
    endpoint = Endpoint("unix:///none.sock", "flag", "unix:///none.sock")
    warnings = ServeConfig(endpoint=endpoint, **config).warnings()  # type: ignore[arg-type]
    if expected is None:
        assert warnings == []
    else:
        [warning] = warnings
        assert expected in warning
