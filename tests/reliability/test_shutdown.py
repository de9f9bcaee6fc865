"""SIGTERM to a real ``cri-prober serve`` process: a prompt, clean exit 0 with nothing left behind.

The daemon runs as a subprocess in its own session, so every process it might have started can
be found afterwards by session ID. Its JSON log is read as it is written: the test waits for log
lines (events), never for time to pass.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cri_prober
from tests.reliability.support import processes_in_session
from tests.support.testbed import ContainerSpec, PodFactory, Testbed

STOP_BOUND = 10.0
CONTAINERS = 30
RULES = """
probes:
  - match: {namespace: default, pod: "term-*", container: app}
    readinessProbe:
      exec: {command: ["true"]}
      periodSeconds: 1
    livenessProbe:
      httpGet: {path: /index.html, port: 8080}
      periodSeconds: 1
  - match: {namespace: default, pod: "termhang-*", container: app}
    readinessProbe:
      exec: {command: [sh, -c, "sleep 60 &"]}
      timeoutSeconds: 1
      periodSeconds: 1
"""
WEB = ContainerSpec(
    "app", command=["sh", "-c", "echo ok > /tmp/index.html && exec httpd -f -p 8080 -h /tmp"]
)
SLEEPER = ContainerSpec("app")
# Lines that mean something went wrong during shutdown even if the exit status is 0.
BAD_TEXT = ("Traceback", "Task was destroyed", "Exception in callback", "was never awaited")


def cli_env() -> dict[str, str]:
    """Environment for a subprocess that imports this checkout's cri_prober."""
    source_root = str(Path(cri_prober.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [source_root, env.get("PYTHONPATH")]))
    return env


class Serve:
    """A ``serve`` subprocess whose output is collected line by line."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []
        self.records: list[dict[str, Any]] = []
        self._changed = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict):
                self.records.append(record)
            self._changed.set()

    async def until(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Wait for log output after which ``predicate()`` holds."""
        async with asyncio.timeout(timeout):
            while not predicate():
                if self._reader.done():
                    raise AssertionError("serve exited early:\n" + "\n".join(self.lines[-30:]))
                self._changed.clear()
                await self._changed.wait()

    def logged(self, event: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("event") == event]

    async def stop(self, timeout: float) -> tuple[int, float]:
        """SIGTERM; return the exit status and how long it took."""
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(timeout):
            code = await self.process.wait()
            await self._reader
        return code, time.monotonic() - started

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


async def start_serve(endpoint: str, directory: Path) -> Serve:
    rules_file = directory / "rules.yaml"
    rules_file.write_text(RULES)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "cri_prober",
        "serve",
        "-r",
        endpoint,
        "-c",
        str(rules_file),
        "--listen",
        f"unix://{directory}/api.sock",
        "--relist-period",
        "0.5",
        "--log-format",
        "json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=cli_env(),
        start_new_session=True,  # its own session: anything it spawns is findable afterwards
    )
    return Serve(process)


def assert_clean_exit(serve: Serve, code: int, elapsed: float) -> None:
    output = "\n".join(serve.lines[-40:])
    assert code == 0, output
    assert elapsed < STOP_BOUND, output
    assert serve.logged("serve_stopped"), output
    assert not [r for r in serve.records if r.get("level") in ("error", "critical")], output
    assert not [line for line in serve.lines if any(bad in line for bad in BAD_TEXT)], output
    # Nothing of its session survives it (it must not have spawned anything that outlives it).
    assert processes_in_session(serve.process.pid) == []


async def test_sigterm_during_heavy_probing_exits_zero_promptly(
    testbed_16: Testbed, pods_16: PodFactory, tmp_path: Path
) -> None:
    """30 containers with exec (period 1) and httpGet probes plus 2 hanging execs, then SIGTERM.

    serve exits 0 within 10 s (its workers finish or are cancelled, its CRI channel closes), logs
    no error and leaves no process behind.
    """
    for start in range(0, CONTAINERS, 10):
        await asyncio.gather(
            *(
                pods_16.create_pod(f"term-{i}", host_network=False, containers=[WEB])
                for i in range(start, start + 10)
            )
        )
    for i in range(2):
        await pods_16.create_pod(f"termhang-{i}", containers=[SLEEPER])

    serve = await start_serve(testbed_16.endpoint, tmp_path)
    try:

        def ready_containers(kind: str) -> int:
            return len(
                {
                    r.get("container")
                    for r in serve.logged("probe_transition")
                    if r.get("probe") == kind
                    and r.get("result") == "success"
                    and str(r.get("container", "")).startswith("default/term-")
                }
            )

        # Heavy probing: every container's exec and http probes have passed at least once.
        await serve.until(
            lambda: (
                ready_containers("readiness") == CONTAINERS
                and len(serve.logged("runtime_connected")) == 1
            ),
            timeout=60,
        )
        # serve itself is the only process of its session (grpc and asyncio use threads).
        assert [pid for pid, _ in processes_in_session(serve.process.pid)] == [serve.process.pid]
        code, elapsed = await serve.stop(STOP_BOUND + 5)
        print(f"serve stopped in {elapsed:.2f}s")
        assert_clean_exit(serve, code, elapsed)
        assert serve.logged("serve_stopping")[0].get("workers") == 2 * CONTAINERS + 2
    finally:
        await serve.kill()


async def test_sigterm_while_the_runtime_is_unreachable_exits_zero(tmp_path: Path) -> None:
    """SIGTERM while serve is still retrying a runtime that does not answer: a prompt exit 0."""
    serve = await start_serve(f"unix://{tmp_path}/no-runtime.sock", tmp_path)
    try:
        await serve.until(lambda: bool(serve.logged("runtime_version_failed")), timeout=30)
        code, elapsed = await serve.stop(STOP_BOUND + 5)
        assert_clean_exit(serve, code, elapsed)
    finally:
        await serve.kill()
