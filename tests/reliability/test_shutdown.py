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
from cri_prober.daemon import SHUTDOWN_GRACE_SECONDS
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


async def start_serve(
    endpoint: str, directory: Path, *extra: str, bootstrap: str | None = None
) -> Serve:
    """``serve`` with the test rules and ``extra`` flags; ``bootstrap``: Python code run instead
    of ``python -m cri_prober`` (it must end by calling the CLI)."""
    rules_file = directory / "rules.yaml"
    rules_file.write_text(RULES)
    program = ["-c", bootstrap] if bootstrap is not None else ["-m", "cri_prober"]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *program,
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
        *extra,
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


# serve, with one worker thread (asyncio.to_thread) blocked for good once the daemon runs: a
# call stuck in the kernel, as open() of a FIFO nobody writes to is.
STUCK_THREAD_BOOTSTRAP = """
import asyncio
import threading

import structlog

from cri_prober import cli, daemon

_tasks = []


def stuck_for_ever():
    structlog.get_logger("test").info("test_thread_stuck")
    threading.Event().wait()


def _start_stuck_call():
    _tasks.append(asyncio.ensure_future(asyncio.to_thread(stuck_for_ever)))


_run = daemon.Daemon.run


async def _run_with_a_stuck_thread(self):
    # Called back once run() has installed its executor (before its first await).
    asyncio.get_running_loop().call_soon(_start_stuck_call)
    await _run(self)


daemon.Daemon.run = _run_with_a_stuck_thread
cli.main()
"""


async def test_sigterm_ends_serve_whatever_a_worker_thread_does(tmp_path: Path) -> None:
    """A worker thread blocked for good used to keep serve from exiting after SIGTERM (the
    loop's shutdown and the interpreter's exit both wait for the default executor's threads).
    Now serve waits out the shutdown grace, names the stuck call, and exits 0."""
    serve = await start_serve(
        f"unix://{tmp_path}/no-runtime.sock", tmp_path, bootstrap=STUCK_THREAD_BOOTSTRAP
    )
    try:
        await serve.until(lambda: bool(serve.logged("test_thread_stuck")), timeout=30)
        code, elapsed = await serve.stop(STOP_BOUND + 5)
        print(f"serve stopped in {elapsed:.2f}s")
        assert_clean_exit(serve, code, elapsed)
        [abandoned] = serve.logged("serve_threads_abandoned")
        assert abandoned["work"] == ["__main__.stuck_for_ever"]
        assert abandoned["level"] == "warning"
        # The stuck call had the whole grace (SHUTDOWN_GRACE_SECONDS) to return; no more.
        assert elapsed >= SHUTDOWN_GRACE_SECONDS - 0.5
    finally:
        await serve.kill()


async def test_sigterm_with_a_fifo_as_the_kubelet_token_file_exits_zero(tmp_path: Path) -> None:
    """The case of issue 21 (item 6): the kubelet source reads its token file in a worker thread,
    and a FIFO there blocks that read for ever. serve still exits 0 on SIGTERM within the bound
    (if the read no longer blocks, the exit is only quicker)."""
    token = tmp_path / "token"
    os.mkfifo(token)
    serve = await start_serve(
        f"unix://{tmp_path}/no-runtime.sock",
        tmp_path,
        "--probes-from",
        "kubelet:http://127.0.0.1:9/pods",
        "--kubelet-token-file",
        str(token),
    )
    try:
        # The pod source's first poll starts (and its thread opens the FIFO) before discovery
        # first asks the runtime, whose failure is this line.
        await serve.until(lambda: bool(serve.logged("runtime_version_failed")), timeout=30)
        code, elapsed = await serve.stop(STOP_BOUND + 5)
        print(f"serve stopped in {elapsed:.2f}s")
        assert code == 0, "\n".join(serve.lines[-40:])
        assert elapsed < STOP_BOUND  # the shutdown grace (5 s) and a generous margin
        assert serve.logged("serve_stopped")
        assert not [line for line in serve.lines if any(bad in line for bad in BAD_TEXT)]
        assert processes_in_session(serve.process.pid) == []
        for abandoned in serve.logged("serve_threads_abandoned"):
            assert abandoned["work"] == [
                "cri_prober.podspecs.kubelet.KubeletSource._read_local_files"
            ]
    finally:
        await serve.kill()
