"""crictl's habits in the client commands, run as subprocesses against an in-process daemon on
the fake runtime: ``CRI_PROBER_ADDRESS``, ``ps -q``, ``--state``, ``--no-trunc``, a ``ps`` that
fits 120 columns with long Kubernetes names, and ``inspect``'s summary beside its unchanged JSON.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from cri_prober._gen.criprober.v1 import query_pb2, query_pb2_grpc
from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.cli.client import _to_dict
from cri_prober.daemon import Daemon
from tests.support.daemon import daemon_on_fake_runtime
from tests.support.fake_runtime import FakeRuntime
from tests.support.serve import run_cli
from tests.support.waiting import HANG_GUARD

RULES = """
probes:
  - match: {container: app}
    readinessProbe: {exec: {command: [check]}, periodSeconds: 1}
    livenessProbe: {exec: {command: [check]}, periodSeconds: 1}
"""
LONG_POD = "checkout-api-canary-europe-west1-7f9c8d6b54-x2k4q"
LONG_NAMESPACE = "payments-production-eu"


@pytest.fixture(name="daemon")
async def _daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    runtime = FakeRuntime()
    runtime.add_container(runtime.add_sandbox(LONG_POD, namespace=LONG_NAMESPACE), "app")
    runtime.add_container(runtime.add_sandbox("cache"), "app")
    runtime.add_container(runtime.add_sandbox("job"), "old", state=api_pb2.CONTAINER_EXITED)
    async with daemon_on_fake_runtime(tmp_path, runtime, RULES) as (daemon, watcher):
        assert daemon.api is not None
        log = daemon.api.transitions
        # Both running containers' liveness and readiness publish their first result.
        await watcher.until(lambda: log.sequence >= 4, timeout=HANG_GUARD)
        yield daemon


async def cli(daemon: Daemon, *args: str) -> str:
    result = await run_cli(*args, "--address", daemon.config.listen)
    assert result.returncode == 0, result.stderr
    return result.stdout


async def listed(daemon: Daemon, *args: str) -> list[dict[str, Any]]:
    containers: list[dict[str, Any]] = json.loads(await cli(daemon, "ps", "-o", "json", *args))[
        "containers"
    ]
    return containers


class TestAddressFromEnvironment:
    async def test_env_names_the_daemon(
        self, daemon: Daemon, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Without --address, CRI_PROBER_ADDRESS says where the daemon is."""
        monkeypatch.setenv("CRI_PROBER_ADDRESS", daemon.config.listen)
        result = await run_cli("ps", "-q")
        assert result.returncode == 0, result.stderr
        assert len(result.stdout.split()) == 2

    @pytest.mark.parametrize("command", [["ps"], ["inspect", "x"], ["watch"], ["health"]])
    async def test_every_client_command_reads_it(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str]
    ) -> None:
        """Each command that takes --address reads CRI_PROBER_ADDRESS (here: an absent socket,
        named in the error)."""
        monkeypatch.setenv("CRI_PROBER_ADDRESS", f"unix://{tmp_path}/from-env.sock")
        result = await run_cli(*command)
        assert "from-env.sock" in result.stderr
        assert result.returncode in (1, 2)

    async def test_the_flag_wins(self, daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CRI_PROBER_ADDRESS", "unix:///nonexistent/from-env.sock")
        assert len((await cli(daemon, "ps", "-q")).split()) == 2


class TestPs:
    async def test_fits_120_columns_with_long_names(self, daemon: Daemon) -> None:
        """The default table fits 120 columns with a 49-character pod in a long namespace."""
        lines = (await cli(daemon, "ps", "-a")).splitlines()
        assert max(map(len, lines)) <= 120, "\n".join(lines)
        assert lines[0].split() == [
            "CONTAINER", "POD", "NAME", "ATTEMPT", "STATE", "READY", "HEALTHY", "PROBES", "AGE",
        ]  # fmt: skip
        assert any("L:ok R:ok" in line and "…" in line for line in lines[1:])

    async def test_wide_keeps_every_column(self, daemon: Daemon) -> None:
        """-o wide prints the full table as before, with STARTED, each probe and SOURCE."""
        lines = (await cli(daemon, "ps", "-o", "wide")).splitlines()
        assert lines[0].split()[-6:] == [
            "HEALTHY", "LIVENESS", "READINESS", "STARTUP", "CREATED", "SOURCE",
        ]  # fmt: skip
        assert any(LONG_POD in line and "success" in line for line in lines[1:])

    async def test_quiet_prints_full_ids(self, daemon: Daemon) -> None:
        """-q: only the containers' full IDs, one per line (crictl ps -q)."""
        ids = [c["id"] for c in await listed(daemon)]
        assert (await cli(daemon, "ps", "-q")).splitlines() == ids
        assert all(len(i) > 13 for i in ids)

    async def test_no_trunc_prints_full_ids_and_names(self, daemon: Daemon) -> None:
        ids = {c["id"] for c in await listed(daemon)}
        out = await cli(daemon, "ps", "--no-trunc")
        assert {line.split()[0] for line in out.splitlines()[1:]} == ids
        assert f"{LONG_NAMESPACE}/{LONG_POD}" in out

    @pytest.mark.parametrize("value", ["exited", "EXITED", "Exited"])
    async def test_state_filters_in_any_case(self, daemon: Daemon, value: str) -> None:
        """--state takes crictl's values in any case and replaces the running-only default."""
        exited = await listed(daemon, "--state", value)
        assert [c["name"] for c in exited] == ["old"]

    async def test_state_with_quiet_and_all(self, daemon: Daemon) -> None:
        """-s is --state; with -a the state still decides (crictl: the state filter wins)."""
        (exited,) = await listed(daemon, "-a", "--state", "exited")
        assert (await cli(daemon, "ps", "-s", "exited", "-q")).splitlines() == [exited["id"]]
        assert len(await listed(daemon, "--state", "running", "-a")) == 2

    async def test_unknown_state_is_refused(self, daemon: Daemon) -> None:
        result = await run_cli("ps", "--state", "paused", "--address", daemon.config.listen)
        assert result.returncode == 2
        assert "--state should be one of created, running, exited or unknown" in result.stderr


class TestInspect:
    async def test_default_is_a_short_summary(self, daemon: Daemon) -> None:
        (container,) = await listed(daemon, "--pod", "^cache$")
        out = await cli(daemon, "inspect", "default/cache/app")
        lines = out.splitlines()
        assert lines[0] == f"ID: {container['id']}"
        assert "Liveness probe: exec [check], every 1s, timeout 1s" in lines
        assert "Readiness probe: exec [check], every 1s, timeout 1s" in lines
        assert "  Result: success" in lines
        assert any(line.startswith("  Last attempt: ") and "success, exit code 0" in line
                   for line in lines)  # fmt: skip
        assert len(lines) < 30
        assert max(map(len, lines)) <= 120

    @pytest.mark.parametrize("output", ["json", "yaml"])
    async def test_json_and_yaml_are_unchanged(self, daemon: Daemon, output: str) -> None:
        """-o json|yaml print everything exactly as inspect's JSON always did: the container's
        protobuf JSON with each probe's detail lifted into spec, namedPorts and history."""
        out = await cli(daemon, "inspect", "default/cache/app", "-o", output)
        async with grpc.aio.insecure_channel(daemon.config.listen) as channel:
            stub = query_pb2_grpc.CriProberStub(channel)
            answer = await stub.GetContainer(
                query_pb2.GetContainerRequest(target="default/cache/app")
            )
        expected = _to_dict(answer.container)
        for status in expected["probes"].values():
            detail = status.pop("detail", {})
            status["spec"] = json.loads(detail.get("specJson") or "{}")
            status["namedPorts"] = detail.get("namedPorts", {})
            status["history"] = detail.get("history", [])
        got = json.loads(out) if output == "json" else yaml.safe_load(out)
        # History grows between the two reads: compare what cannot change, and the key order.
        for data in (got, expected):
            for status in data["probes"].values():
                for key in ("history", "lastAttempt", "attempts", "consecutiveSuccesses",
                            "probingSince", "inProgress"):  # fmt: skip
                    status.pop(key, None)
        assert got == expected
        assert list(got) == list(expected)
        for kind in ("liveness", "readiness"):
            assert list(got["probes"][kind]) == list(expected["probes"][kind])
            assert list(got["probes"][kind])[-2:] == ["spec", "namedPorts"]
