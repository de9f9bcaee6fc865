"""``cri_prober.threads.WorkerThreads``: serve's default executor, whose stuck calls never keep
the process from exiting (issue 21, item 6)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from cri_prober import daemon as daemon_module
from cri_prober.threads import WorkerThreads, describe
from tests.support.daemon import running_daemon
from tests.support.fake_runtime import FakeRuntime, FakeRuntimeServer

# Bounds on things that take milliseconds; only there so that a regression fails, not hangs.
PROMPT = 10.0

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


def blocked_until(release: threading.Event, started: threading.Event | None = None) -> str:
    if started is not None:
        started.set()
    release.wait()
    return "released"


def test_calls_run_on_daemon_threads_and_return_or_raise() -> None:
    pool = WorkerThreads(join_timeout=1.0)
    try:
        assert pool.submit(lambda x: x * 2, 21).result(PROMPT) == 42
        assert pool.submit(threading.current_thread).result(PROMPT).daemon
        with pytest.raises(ZeroDivisionError):
            pool.submit(lambda: 1 / 0).result(PROMPT)
    finally:
        pool.shutdown()


def test_idle_threads_are_reused() -> None:
    pool = WorkerThreads(join_timeout=1.0, name="reuse-test")
    try:
        ran_on = {pool.submit(threading.get_ident).result(PROMPT) for _ in range(20)}
        assert len(ran_on) == 1
        assert [t.name for t in threading.enumerate() if t.name.startswith("reuse-test")] == [
            "reuse-test_0"
        ]
    finally:
        pool.shutdown()


def test_shutdown_waits_at_most_join_timeout_and_names_what_is_stuck(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At most join_timeout: every wait shutdown makes is bounded, by what is left of it (an
    unbounded one would hang here, as the stuck call is released only afterwards)."""
    release, running = threading.Event(), threading.Event()
    pool = WorkerThreads(max_workers=1, join_timeout=0.3)
    stuck = pool.submit(blocked_until, release, running)
    queued = pool.submit(blocked_until, release)
    assert running.wait(PROMPT)
    waits: list[float] = []  # the timeout of each wait (-1: none, waiting for ever)
    wait = pool._changed.wait

    def recording(timeout: float | None = None) -> bool:
        waits.append(-1.0 if timeout is None else timeout)
        return wait(timeout)

    monkeypatch.setattr(pool._changed, "wait", recording)
    pool.shutdown(wait=True, cancel_futures=True)
    assert waits  # it did wait for the running call...
    # ...within join_timeout (what is left of it each time; float rounding aside)
    assert all(0 < left <= 0.3 + 1e-9 for left in waits)
    assert waits == sorted(waits, reverse=True)  # one deadline, counting down
    assert not stuck.done()  # and left it running
    assert pool.running() == [f"{__name__}.blocked_until"]
    assert queued.cancelled()  # never started: cancelled, not abandoned
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(time.sleep, 0)
    release.set()
    assert stuck.result(PROMPT) == "released"
    assert pool.running() == []


@pytest.mark.both_loops
async def test_to_thread_runs_on_it_and_is_named_through_its_wrapping() -> None:
    """asyncio.to_thread wraps the call in partial(context.run, func): the name is func's."""
    loop = asyncio.get_running_loop()
    pool = WorkerThreads(join_timeout=0.0)
    loop.set_default_executor(pool)
    release, running = threading.Event(), threading.Event()
    request_id.set("r-1")
    try:
        assert await asyncio.to_thread(request_id.get) == "r-1"  # the context travels
        call = asyncio.ensure_future(asyncio.to_thread(blocked_until, release, running))
        assert await asyncio.to_thread(running.wait, PROMPT)
        names = await pool.wait_running(0.2)  # nothing returns: the wait ends at its timeout
        assert names == [f"{__name__}.blocked_until"]
        release.set()
        assert await call == "released"
        assert await pool.wait_running(PROMPT) == []
    finally:
        release.set()
        pool.shutdown(wait=False)


def test_describe() -> None:
    event = threading.Event()
    assert describe(event.wait) == "threading.Event.wait"
    assert describe(blocked_until) == f"{__name__}.blocked_until"
    context = contextvars.copy_context()
    wrapped = functools.partial(context.run, functools.partial(blocked_until, event))
    assert describe(wrapped) == f"{__name__}.blocked_until"


def test_a_stuck_call_does_not_keep_the_process_from_exiting(tmp_path: Path) -> None:
    """The property serve needs: with ThreadPoolExecutor the interpreter joins the stuck thread
    at exit, for ever; with WorkerThreads it exits at once, with its own status."""
    program = """
import sys, threading
from {module} import {pool}
pool = {pool}(join_timeout=0.1)
pool.submit(threading.Event().wait)
pool.shutdown(wait=True)
print("exiting", flush=True)
sys.exit(0)
"""
    done = subprocess.run(
        [sys.executable, "-c", program.format(module="cri_prober.threads", pool="WorkerThreads")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "exiting\n", "")
    # The control: the standard pool's stuck thread holds the exit until killed.
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run(
            [
                sys.executable,
                "-c",
                program.replace("(join_timeout=0.1)", "()")
                .replace("wait=True", "wait=False")
                .format(module="concurrent.futures", pool="ThreadPoolExecutor"),
            ],
            capture_output=True,
            timeout=3,
            check=False,
        )


@pytest.mark.both_loops
async def test_the_daemon_stops_within_its_grace_while_a_thread_is_stuck(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With its own worker threads (serve's setting) the daemon's run() returns once the grace
    is over even though a to_thread call never returns, and says which call it left behind."""
    monkeypatch.setattr(daemon_module, "SHUTDOWN_GRACE_SECONDS", 0.5)
    release, running = threading.Event(), threading.Event()
    runtime = FakeRuntime()
    rules = tmp_path / "rules.yaml"
    rules.write_text("probes: []\n")
    call: asyncio.Future[str] | None = None
    try:
        async with FakeRuntimeServer(str(tmp_path / "cri.sock"), runtime) as server:
            with capture_logs() as logs:
                async with running_daemon(
                    server.target, rules, own_worker_threads=True, stop_timeout=PROMPT
                ) as (daemon, _watcher):
                    assert daemon.threads is not None
                    call = asyncio.ensure_future(asyncio.to_thread(blocked_until, release, running))
                    assert await asyncio.to_thread(running.wait, PROMPT)
                # running_daemon's exit stopped the daemon and awaited run(); a run() that waited
                # for the stuck call would fail that wait's guard (stop_timeout), never release.
            assert not call.done()  # run() returned with the call still stuck
        events = [line["event"] for line in logs]
        assert events.index("serve_threads_abandoned") < events.index("serve_stopped")
        [abandoned] = [line for line in logs if line["event"] == "serve_threads_abandoned"]
        assert abandoned["work"] == [f"{__name__}.blocked_until"]
        assert abandoned["threads"] == 1
    finally:
        release.set()
        if call is not None:
            assert await asyncio.wait_for(call, PROMPT) == "released"


async def test_without_its_own_threads_the_daemon_leaves_the_loops_executor_alone(
    tmp_path: Path,
) -> None:
    runtime = FakeRuntime()
    rules = tmp_path / "rules.yaml"
    rules.write_text("probes: []\n")
    async with (
        FakeRuntimeServer(str(tmp_path / "cri.sock"), runtime) as server,
        running_daemon(server.target, rules) as (daemon, _watcher),
    ):
        assert daemon.threads is None
        await asyncio.to_thread(time.sleep, 0)  # makes the loop's own default executor
        loop = asyncio.get_running_loop()
        assert not isinstance(getattr(loop, "_default_executor", None), WorkerThreads)
