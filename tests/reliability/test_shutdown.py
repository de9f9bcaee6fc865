"""SIGTERM to a real ``cri-prober serve`` process: a prompt, clean exit 0 with nothing left behind.

The daemon runs as a subprocess in its own session, so every process it might have started can
be found afterwards by session ID. Its JSON log is read as it is written: the test waits for log
lines (events), never for time to pass. "Prompt" is told by order, not seconds (which on a busy
machine say how busy it is): serve exits while something it could have waited for is still
pending (a hung exec, a thread blocked for good, a retry's backoff), and only a hang guard
bounds the wait for its exit.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from cri_prober.daemon import SHUTDOWN_GRACE_SECONDS
from cri_prober.runtime.client import CriClient
from tests.reliability.support import processes_in_session
from tests.support.serve import Serve, launch
from tests.support.testbed import ContainerSpec, PodFactory, Testbed
from tests.support.waiting import HANG_GUARD

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


def start_serve(endpoint: str, directory: Path, *extra: str, bootstrap: str | None = None) -> Serve:
    """``serve`` with the test rules and ``extra`` flags, in its own session (anything it
    spawns is findable afterwards); ``bootstrap``: Python code run instead of ``python -m
    cri_prober`` (it must end by calling the CLI)."""
    return launch(endpoint, directory, RULES, *extra, bootstrap=bootstrap, new_session=True)


def assert_clean_exit(serve: Serve, code: int) -> None:
    output = serve.tail(40)
    assert code == 0, output
    assert serve.logged("serve_stopped"), output
    assert not [r for r in serve.records if r.get("level") in ("error", "critical")], output
    assert not [line for _, line in serve.lines if any(bad in line for bad in BAD_TEXT)], output
    # Nothing of its session survives it (it must not have spawned anything that outlives it).
    assert processes_in_session(serve.process.pid) == []


async def test_sigterm_during_heavy_probing_exits_zero_promptly(
    testbed_16: Testbed, pods_16: PodFactory, tmp_path: Path
) -> None:
    """30 containers with exec (period 1) and httpGet probes plus 2 hanging execs, then SIGTERM.

    serve exits 0 without waiting for the hanging execs' calls (their ``sleep 60`` still holds
    them when it has exited): its workers finish or are cancelled, its CRI channel closes; it
    logs no error and leaves no process behind.
    """
    for start in range(0, CONTAINERS, 10):
        await asyncio.gather(
            *(
                pods_16.create_pod(f"term-{i}", host_network=False, containers=[WEB])
                for i in range(start, start + 10)
            )
        )
    hanging = [
        (await pods_16.create_pod(f"termhang-{i}", containers=[SLEEPER])).container_ids["app"]
        for i in range(2)
    ]

    serve = start_serve(testbed_16.endpoint, tmp_path)
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
            timeout=HANG_GUARD,
        )
        # serve itself is the only process of its session (grpc and asyncio use threads).
        assert [pid for pid, _ in processes_in_session(serve.process.pid)] == [serve.process.pid]
        code, elapsed = await serve.stop(HANG_GUARD)
        print(f"serve stopped in {elapsed:.2f}s")
        assert_clean_exit(serve, code)
        assert serve.logged("serve_stopping")[0].get("workers") == 2 * CONTAINERS + 2
        # A hanging exec's call ends only when its `sleep 60` does (containerd#9568): one still
        # running now was a call serve had out when it exited, and did not wait for.
        async with CriClient.connect(testbed_16.endpoint) as cri:
            left = [
                (await cri.exec_sync(cid, ["ps", "-o", "args"], timeout=int(HANG_GUARD))).stdout
                for cid in hanging
            ]
        assert any(b"sleep 60" in out for out in left), left
    finally:
        serve.kill()


async def test_sigterm_while_the_runtime_is_unreachable_exits_zero(tmp_path: Path) -> None:
    """SIGTERM while serve is still retrying a runtime that does not answer: exit 0 at once, not
    after another retry (none is logged after it began to stop)."""
    serve = start_serve(f"unix://{tmp_path}/no-runtime.sock", tmp_path)
    try:
        await serve.until(
            lambda: len(serve.logged("runtime_version_failed")) >= 2, timeout=HANG_GUARD
        )
        code, _elapsed = await serve.stop(HANG_GUARD)
        assert_clean_exit(serve, code)
        events = [r.get("event") for r in serve.records]
        stopping = events.index("serve_stopping")
        assert "runtime_version_failed" not in events[stopping:], serve.tail(40)
    finally:
        serve.kill()


# serve, with one worker thread (asyncio.to_thread) blocked for good once the daemon runs: a
# call stuck in the kernel, as open() of a FIFO nobody writes to is.
STUCK_THREAD_BOOTSTRAP = """
import asyncio
import threading

import structlog

from cri_prober import cli, daemon
from tests.support.waiting import HANG_GUARD

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
    Now serve waits out the shutdown grace, names the stuck call, and exits 0 (exiting at all
    says it did not wait for the thread, which never returns)."""
    serve = start_serve(
        f"unix://{tmp_path}/no-runtime.sock", tmp_path, bootstrap=STUCK_THREAD_BOOTSTRAP
    )
    try:
        await serve.until(lambda: bool(serve.logged("test_thread_stuck")), timeout=HANG_GUARD)
        code, elapsed = await serve.stop(HANG_GUARD)
        print(f"serve stopped in {elapsed:.2f}s")
        assert_clean_exit(serve, code)
        [abandoned] = serve.logged("serve_threads_abandoned")
        assert abandoned["work"] == ["__main__.stuck_for_ever"]
        assert abandoned["level"] == "warning"
        # The stuck call had the whole grace (SHUTDOWN_GRACE_SECONDS) to return; no more.
        assert elapsed >= SHUTDOWN_GRACE_SECONDS - 0.5
    finally:
        serve.kill()


async def test_sigterm_with_a_fifo_as_the_kubelet_token_file_exits_zero(tmp_path: Path) -> None:
    """The case of issue 21 (item 6): the kubelet source reads its token file in a worker thread,
    and a FIFO there blocks that read for ever. serve still exits 0 on SIGTERM within the bound
    (if the read no longer blocks, the exit is only quicker; if it does, it blocks for good, so
    exiting at all says serve did not wait for it)."""
    token = tmp_path / "token"
    os.mkfifo(token)
    serve = start_serve(
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
        await serve.until(lambda: bool(serve.logged("runtime_version_failed")), timeout=HANG_GUARD)
        code, elapsed = await serve.stop(HANG_GUARD)
        print(f"serve stopped in {elapsed:.2f}s")
        assert code == 0, serve.tail(40)
        assert serve.logged("serve_stopped")
        assert not [line for _, line in serve.lines if any(bad in line for bad in BAD_TEXT)]
        assert processes_in_session(serve.process.pid) == []
        for abandoned in serve.logged("serve_threads_abandoned"):
            assert abandoned["work"] == [
                "cri_prober.podspecs.kubelet.KubeletSource._read_local_files"
            ]
    finally:
        serve.kill()
