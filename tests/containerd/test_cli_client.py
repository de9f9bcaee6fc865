"""The client commands as a user runs them: subprocesses against a real ``serve`` on containerd.

``ps``, ``inspect``, ``watch`` and ``health`` talk to the module's daemon; ``check`` talks to the
runtime directly. Output formats and exit statuses are what docs/interface.md promises.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cri_prober._gen.criprober.v1 import query_pb2, query_pb2_grpc
from tests.support.serve import (
    Serve,
    cli_env,
    run_cli,
    settled,
    start_serve,
    touch_ready,
    unique,
    wait_status,
)
from tests.support.testbed import ContainerSpec, PodFactory, Testbed
from tests.support.waiting import HANG_GUARD

RULES = """
probes:
  - match: {namespace: default, pod: "cli-*", container: app}
    readinessProbe: {exec: {command: [cat, /tmp/ready]}, periodSeconds: 1, timeoutSeconds: 10}
    livenessProbe: {exec: {command: ["true"]}, periodSeconds: 1, timeoutSeconds: 10}
"""
READY_APP = ContainerSpec("app", command=["sh", "-c", "touch /tmp/ready; exec sleep 3600"])
UNREADY_APP = ContainerSpec("app")
SERVING = 1
NOT_SERVING = 2


@pytest.fixture(scope="module", name="serve")
def _serve(testbed_16: Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    with start_serve(testbed_16, tmp_path_factory.mktemp("cli"), RULES) as serve:
        yield serve


def no_traceback(result: Any) -> None:
    assert "Traceback" not in result.stderr, result.stderr


def logged_incarnation(serve: Serve) -> str:
    """The incarnation ``serve`` logged when its API started listening."""
    for line in serve.log().splitlines():
        if '"api_listening"' in line:
            incarnation: str = json.loads(line)["incarnation"]
            return incarnation
    raise AssertionError(f"no api_listening line:\n{serve.log()}")


class TestPs:
    async def test_json_has_interface_keys(
        self, pods_16: PodFactory, serve: Serve, api: query_pb2_grpc.CriProberAsyncStub
    ) -> None:
        """ps -o json prints {"containers": [...]} with docs/interface.md's keys and values."""
        pod = await pods_16.create_pod(unique("cli"), containers=[READY_APP])
        await settled(
            api,
            f"default/{pod.name}/app",
            lambda c: c.healthy and c.probes.liveness.attempts >= 1,
        )
        result = await run_cli("ps", "-o", "json", "--pod", pod.name, "--address", serve.address)
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        assert list(data) == ["containers"]
        [item] = data["containers"]
        assert {
            "id",
            "name",
            "podName",
            "podNamespace",
            "podUid",
            "state",
            "started",
            "ready",
            "healthy",
            "probes",
        } <= set(item)
        assert item["id"] == pod.containers["app"].id
        assert (item["name"], item["podName"], item["podNamespace"], item["podUid"]) == (
            "app",
            pod.name,
            "default",
            pod.uid,
        )
        assert item["state"] == "CONTAINER_RUNNING"
        assert (item["started"], item["ready"], item["healthy"]) == (True, True, True)
        assert set(item["probes"]) == {"liveness", "readiness"}
        assert {status["result"] for status in item["probes"].values()} == {"success"}

        as_yaml = await run_cli("ps", "-o", "yaml", "--pod", pod.name, "--address", serve.address)
        assert yaml.safe_load(as_yaml.stdout)["containers"][0]["id"] == item["id"]

    async def test_table_and_state_filter(
        self, pods_16: PodFactory, serve: Serve, api: query_pb2_grpc.CriProberAsyncStub
    ) -> None:
        """The table shows 13-character IDs, ages and each probe's result; exited containers
        only with -a."""
        pod = await pods_16.create_pod(
            unique("cli"),
            containers=[UNREADY_APP, ContainerSpec("done", command=["true"])],
        )
        await settled(
            api, f"default/{pod.name}/done", lambda c: c.state == query_pb2.CONTAINER_EXITED
        )
        await settled(
            api,
            f"default/{pod.name}/app",
            lambda c: c.probes.liveness.result == "success" and c.probes.readiness.attempts >= 1,
        )
        compact = await run_cli("ps", "--pod", pod.name, "--address", serve.address)
        assert compact.returncode == 0, compact.stderr
        header, *rows = compact.stdout.splitlines()
        assert header.split() == [
            "CONTAINER", "POD", "NAME", "ATTEMPT", "STATE", "READY", "HEALTHY", "PROBES", "AGE",
        ]  # fmt: skip
        assert len(rows) == 1
        assert rows[0].split()[:8] == [
            pod.containers["app"].id[:13], f"default/{pod.name}", "app", "0", "Running",
            "false", "false", "L:ok",
        ]  # fmt: skip
        assert rows[0].split()[8] == "R:fail(exit-code)"  # cat /tmp/ready exits 1
        # -o wide: every column, as the table was before it was made to fit 120 columns.
        running = await run_cli("ps", "-o", "wide", "--pod", pod.name, "--address", serve.address)
        assert running.returncode == 0, running.stderr
        header, *rows = running.stdout.splitlines()
        assert header.split()[:6] == ["CONTAINER", "POD", "NAMESPACE", "NAME", "ATTEMPT", "STATE"]
        assert len(rows) == 1
        assert rows[0].split()[0] == pod.containers["app"].id[:13]
        assert header.split()[-2:] == ["CREATED", "SOURCE"]
        # The probes come from the rules file (SOURCE, the last column, after the age).
        assert re.search(r"(second|seconds|minute) ago +rules$", rows[0])
        assert rows[0].split()[5:12] == [
            "Running",
            "true",
            "false",
            "false",
            "success",
            "failure(exit-code)",  # the reason, as the narrow table's R:fail(exit-code)
            "-",
        ]
        everything = await run_cli(
            "ps", "-a", "-o", "wide", "--pod", pod.name, "--address", serve.address
        )
        names = {row.split()[3]: row.split()[5] for row in everything.stdout.splitlines()[1:]}
        assert names == {"app": "Running", "done": "Exited"}


class TestInspect:
    async def test_shows_spec_state_and_history(
        self, pods_16: PodFactory, serve: Serve, api: query_pb2_grpc.CriProberAsyncStub
    ) -> None:
        """inspect prints the container with each probe's spec and attempt history."""
        pod = await pods_16.create_pod(unique("cli"), containers=[UNREADY_APP])
        target = f"default/{pod.name}/app"
        await settled(api, target, lambda c: c.probes.readiness.attempts >= 2)
        result = await run_cli("inspect", target, "-o", "json", "--address", serve.address)
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        assert data["id"] == pod.containers["app"].id
        readiness = data["probes"]["readiness"]
        assert readiness["spec"]["exec"]["command"] == ["cat", "/tmp/ready"]
        assert readiness["spec"]["failureThreshold"] == 3
        assert len(readiness["history"]) >= 2
        assert {attempt["result"] for attempt in readiness["history"]} == {"failure"}
        assert "/tmp/ready" in readiness["history"][-1]["output"]

        summary = (await run_cli("inspect", target, "--address", serve.address)).stdout
        assert summary.startswith(f"ID: {data['id']}\n")
        assert any(
            line.startswith("Readiness probe: exec [cat /tmp/ready]")
            for line in summary.splitlines()
        ), summary
        assert "  Output: " in summary

        by_prefix = await run_cli(
            "inspect", data["id"][:10], "-o", "yaml", "--address", serve.address
        )
        assert yaml.safe_load(by_prefix.stdout)["id"] == data["id"]

    async def test_unknown_target(self, serve: Serve) -> None:
        """inspect of an unknown container says NOT_FOUND and exits 1."""
        result = await run_cli("inspect", "default/no-such-pod/app", "--address", serve.address)
        assert result.returncode == 1
        assert "NOT_FOUND" in result.stderr
        no_traceback(result)


class TestWatch:
    async def test_json_lines(self, pods_16: PodFactory, serve: Serve, testbed_16: Testbed) -> None:
        """watch -o json prints one JSON object per transition, with its sequence and time."""
        pod = await pods_16.create_pod(unique("cli"), containers=[UNREADY_APP])
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "cri_prober",
            "watch",
            "-o",
            "json",
            "--since",
            "0",
            "--pod",
            f"^{pod.name}$",
            "--address",
            serve.address,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=cli_env(),
        )
        assert proc.stdout is not None
        lines: list[dict[str, Any]] = []

        async def read_until(kind: str, result: str) -> None:
            assert proc.stdout is not None
            async with asyncio.timeout(HANG_GUARD):
                while not any((t["kind"], t["result"]) == (kind, result) for t in lines):
                    lines.append(json.loads(await proc.stdout.readline()))

        try:
            await read_until("readiness", "failure")
            await touch_ready(testbed_16, pod.containers["app"].id)
            await read_until("readiness", "success")
        finally:
            proc.send_signal(signal.SIGINT)
            await proc.wait()
        sequences = [line["sequence"] for line in lines]
        assert all(isinstance(sequence, int) for sequence in sequences)
        assert sequences == sorted(set(sequences))
        assert {line["incarnation"] for line in lines} == {logged_incarnation(serve)}
        assert {line["podName"] for line in lines} == {pod.name}
        assert all(re.match(r"\d{4}-\d\d-\d\dT", line["time"]) for line in lines)
        assert lines[-1]["previous"] == "failure"

    async def test_resume_across_a_restart_fails_instead_of_replaying(
        self, pods_16: PodFactory, testbed_16: Testbed, tmp_path: Path
    ) -> None:
        """The finding: `watch --since` from before a restart replayed the new process's
        sequences as if they followed. Now it exits 1 with OUT_OF_RANGE naming both processes.
        """
        pod = await pods_16.create_pod(unique("cli"), containers=[READY_APP])
        only_pod = ("--pod", f"^{pod.name}$")

        async def first_transition(serve: Serve) -> dict[str, Any]:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "cri_prober", "watch", "-o", "json", "--since", "0",
                *only_pod, "--address", serve.address,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(),
            )  # fmt: skip
            assert proc.stdout is not None
            try:
                async with asyncio.timeout(HANG_GUARD):
                    line: dict[str, Any] = json.loads(await proc.stdout.readline())
            finally:
                proc.send_signal(signal.SIGINT)
                await proc.wait()
            return line

        (tmp_path / "before").mkdir()
        (tmp_path / "after").mkdir()
        with start_serve(testbed_16, tmp_path / "before", RULES) as before:
            old = await first_transition(before)
        with start_serve(testbed_16, tmp_path / "after", RULES) as after:
            new = await first_transition(after)  # the new process numbers from 1 again
            assert new["incarnation"] != old["incarnation"]
            result = await run_cli(
                "watch", "--since", f"{old['incarnation']}:{old['sequence']}",
                *only_pod, "--address", after.address,
            )  # fmt: skip
        assert result.returncode == 1
        assert (
            f"OUT_OF_RANGE: sequence {old['sequence']} belongs to incarnation "
            f"{old['incarnation']}; this cri-prober is {new['incarnation']}, started at "
        ) in result.stderr
        assert len(result.stdout.splitlines()) == 1  # the header: nothing replayed
        no_traceback(result)


class TestHealth:
    async def test_exit_codes(self, pods_16: PodFactory, serve: Serve, health: Any) -> None:
        """health exits 0 SERVING, 4 NOT_SERVING, 3 unknown service, 2 no daemon."""
        ready = await pods_16.create_pod(unique("cli"), containers=[READY_APP])
        unready = await pods_16.create_pod(unique("cli"), containers=[UNREADY_APP])
        await wait_status(health, f"default/{ready.name}/app", SERVING)
        await wait_status(health, f"default/{unready.name}/app", NOT_SERVING)

        for service, code, status in (
            (f"default/{ready.name}/app", 0, "SERVING"),
            ("", 0, "SERVING"),
            (f"default/{unready.name}", 4, "NOT_SERVING"),
        ):
            result = await run_cli("health", service, "--address", serve.address)
            assert (result.returncode, result.stdout.strip()) == (code, f"status: {status}")

        # NOT_SERVING says why on stderr: which probe, its reason and count, its output.
        why = await run_cli("health", f"default/{unready.name}", "--address", serve.address)
        assert why.stderr.startswith(
            f"default/{unready.name}/app: readiness failure (exit-code "
        ), why.stderr
        assert "/tmp/ready" in why.stderr  # cat's complaint, the probe's last output

        # --answering: any answer is alive (the DaemonSets' liveness check).
        answering = await run_cli(
            "health", f"default/{unready.name}", "--answering", "--address", serve.address
        )
        assert (answering.returncode, answering.stdout.strip()) == (0, "status: NOT_SERVING")

        unknown = await run_cli("health", "default/no-such-pod/app", "--address", serve.address)
        assert unknown.returncode == 3
        assert "not found" in unknown.stderr
        no_traceback(unknown)

        gone = await run_cli("health", "--address", f"unix://{serve.socket_path}.absent")
        assert gone.returncode == 2
        assert "cannot connect" in gone.stderr
        no_traceback(gone)


class TestCheck:
    async def test_exit_codes(
        self, pods_16: PodFactory, testbed_16: Testbed, tmp_path: Path
    ) -> None:
        """check exits 0 on success, 1 on failure and 2 for a bad spec or target."""
        pod = await pods_16.create_pod(unique("cli"), containers=[READY_APP])
        target = f"default/{pod.name}/app"
        runtime = ("-r", testbed_16.endpoint)

        ok = await run_cli(
            "check", target, "--probe", '{"exec": {"command": ["cat", "/tmp/ready"]}}', *runtime
        )
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout.startswith("success (exit code 0)")

        spec_file = tmp_path / "probe.json"
        spec_file.write_text('{"exec": {"command": ["sh", "-c", "echo nope; exit 7"]}}')
        failed = await run_cli(
            "check",
            pod.containers["app"].id[:12],
            "--probe",
            f"@{spec_file}",
            "--count",
            "2",
            *runtime,
        )
        assert failed.returncode == 1
        assert failed.stdout.splitlines()[0].startswith("attempt 1/2: failure (exit code 7)")
        assert failed.stdout.count("nope") == 2

        bad = await run_cli("check", target, "--probe", '{"exec": {"command": []}}', *runtime)
        assert bad.returncode == 2
        assert "exec.command" in bad.stderr
        no_traceback(bad)

        unknown = await run_cli(
            "check",
            "default/no-such-pod/app",
            "--probe",
            '{"exec": {"command": ["true"]}}',
            *runtime,
        )
        assert unknown.returncode == 2
        assert "no container" in unknown.stderr
        no_traceback(unknown)
