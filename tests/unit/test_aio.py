"""The supervisor of long-lived tasks (``cri_prober.aio``): restart with back-off, fatal stops
serve with a non-zero exit, stop() in reverse order, never a silent death; and each of the node's
loops (pod resync, pod sources, staleness check, the daemon's tasks) killed by an injected
exception, to show what happens. Event-driven: back-offs are injected, nothing waits on time."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from structlog.testing import capture_logs

from cri_prober import aio, systemd
from cri_prober.aio import EXIT_TASK_FAILED, Supervisor, close_logged, wait_first
from cri_prober.daemon import Daemon, ServeConfig, read_rules
from cri_prober.manager import pod_sync
from cri_prober.manager.pod_sync import RESYNC_TASK, PodSyncs
from cri_prober.manager.probe_manager import ProbeManager
from cri_prober.podspecs.registry import PodSpecs
from cri_prober.podspecs.source import Changed, PodSource
from cri_prober.probing.prober import Prober
from cri_prober.probing.spec import RulesFile
from cri_prober.runtime.endpoints import Endpoint
from tests.support.fake_runtime import FakeRuntime, FakeRuntimeServer
from tests.support.waiting import HANG_GUARD, until


class Backoffs:
    """An injected back-off: records each delay and returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


class _NoJitter(random.Random):
    def random(self) -> float:
        return 0.0


def supervisor(**kwargs: Any) -> tuple[Supervisor, Backoffs]:
    backoffs = Backoffs()
    return Supervisor(sleep=backoffs, rng=_NoJitter(), **kwargs), backoffs


def failures(logs: Sequence[Mapping[str, Any]], task: str) -> list[Mapping[str, Any]]:
    return [e for e in logs if e["event"] == "task_failed" and e.get("task") == task]


class Crashes:
    """A task factory that raises on its first ``times`` runs, then signals and waits forever."""

    def __init__(self, times: int = 1) -> None:
        self.times = times
        self.runs = 0
        self.healthy = asyncio.Event()

    async def __call__(self) -> None:
        self.runs += 1
        if self.runs <= self.times:
            raise RuntimeError(f"boom {self.runs}")
        self.healthy.set()
        await asyncio.Event().wait()


# -- the supervisor ------------------------------------------------------------------------------


async def test_restart_policy_logs_the_task_and_restarts_it_after_a_back_off() -> None:
    sup, backoffs = supervisor()
    crashes = Crashes(times=3)
    with capture_logs() as logs:
        sup.start("looper", crashes)
        await crashes.healthy.wait()
    assert crashes.runs == 4
    failed = failures(logs, "looper")
    assert [e["attempt"] for e in failed] == [1, 2, 3]
    assert all(e["log_level"] == "error" and e["policy"] == "restart" for e in failed)
    assert [str(e["exc_info"]) for e in failed] == ["boom 1", "boom 2", "boom 3"]
    assert backoffs.delays == [0.5, 1.0, 2.0]  # doubling
    assert [e["retry_in"] for e in failed] == backoffs.delays
    assert sup.exit_code == 0
    assert not sup.stop_requested.is_set()
    await sup.stop()
    assert not sup.running("looper")


def test_back_off_doubles_jitters_and_is_capped() -> None:
    sup = Supervisor(rng=_NoJitter())
    assert [sup.delay(n) for n in (1, 2, 3, 7, 8, 100)] == [0.5, 1.0, 2.0, 30.0, 30.0, 30.0]

    class _Top(random.Random):
        def random(self) -> float:
            return 1.0

    jittered = Supervisor(rng=_Top())
    assert jittered.delay(1) == pytest.approx(0.5 * (1 + aio.BACKOFF_JITTER))
    assert jittered.delay(100) == aio.BACKOFF_MAX_SECONDS


async def test_back_off_starts_over_after_a_healthy_run() -> None:
    now = [0.0]
    sup, backoffs = supervisor(clock=lambda: now[0])
    runs = 0
    done = asyncio.Event()

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs == 3:
            now[0] += aio.HEALTHY_AFTER_SECONDS  # this run lasted long enough to count
        if runs == 4:
            done.set()
            await asyncio.Event().wait()
        raise RuntimeError("flaky")

    sup.start("flaky", flaky)
    await done.wait()
    assert backoffs.delays == [0.5, 1.0, 0.5]
    await sup.stop()


async def test_fatal_policy_requests_a_stop_with_a_non_zero_exit() -> None:
    stop = asyncio.Event()
    sup, backoffs = supervisor(stop=stop)
    crashes = Crashes(times=1)
    with capture_logs() as logs:
        task = sup.start("vital", crashes, policy="fatal")
        assert task is not None
        await stop.wait()
        await task
    assert sup.exit_code == EXIT_TASK_FAILED
    assert sup.failed.is_set()
    [failed] = failures(logs, "vital")
    assert failed["policy"] == "fatal"
    assert str(failed["exc_info"]) == "boom 1"
    assert crashes.runs == 1
    assert backoffs.delays == []
    await sup.stop()


async def test_a_loop_that_returns_is_a_failure_a_one_off_task_is_not() -> None:
    sup, backoffs = supervisor()
    loop_runs = 0
    restarted = asyncio.Event()

    async def loop() -> None:
        nonlocal loop_runs
        loop_runs += 1
        if loop_runs > 1:
            restarted.set()
            await asyncio.Event().wait()

    async def one_off() -> None:
        return

    with capture_logs() as logs:
        once = sup.start("once", one_off, forever=False)
        sup.start("loop", loop)
        await restarted.wait()
        assert once is not None
        await once
    [failed] = failures(logs, "loop")
    assert failed["reason"] == "ended, but should run until stopped"
    assert failed["exc_info"] is None
    assert failures(logs, "once") == []
    assert backoffs.delays == [0.5]
    await sup.stop()


async def test_a_loop_that_ends_after_the_stop_request_is_no_failure() -> None:
    stop = asyncio.Event()
    sup, _ = supervisor(stop=stop)

    async def until_stop() -> None:
        await stop.wait()

    with capture_logs() as logs:
        task = sup.start("until-stop", until_stop)
        stop.set()
        assert task is not None
        await task
    assert failures(logs, "until-stop") == []
    await sup.stop()


async def test_stop_cancels_in_reverse_start_order_and_leaves_nothing_behind() -> None:
    sup, _ = supervisor()
    order: list[str] = []
    started = {name: asyncio.Event() for name in "abc"}

    def waiter(name: str) -> Callable[[], Any]:
        async def run() -> None:
            started[name].set()
            try:
                await asyncio.Event().wait()
            finally:
                order.append(name)
                await asyncio.sleep(0)  # cleanup that takes a turn of the loop

        return run

    tasks = [sup.start(name, waiter(name)) for name in "abc"]
    for event in started.values():
        await event.wait()
    await sup.stop()
    assert order == ["c", "b", "a"]
    assert all(task is not None and task.done() for task in tasks)
    assert sup.start("late", waiter("a")) is None  # closed: nothing starts again


async def test_a_task_failing_during_shutdown_does_not_stop_the_others_cleanup() -> None:
    sup, backoffs = supervisor()
    cleaned: list[str] = []
    started = asyncio.Event()

    async def clean() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append("clean")

    async def broken() -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            raise RuntimeError("cleanup bug")

    sup.start("clean", clean)
    sup.start("broken", broken)
    await started.wait()
    with capture_logs() as logs:
        await sup.stop()  # never raises
    assert cleaned == ["clean"]
    [failed] = failures(logs, "broken")
    assert failed["stopping"] is True
    assert str(failed["exc_info"]) == "cleanup bug"
    assert backoffs.delays == []  # not restarted while stopping
    assert not sup.running("clean")
    assert not sup.running("broken")


async def test_stopping_some_tasks_leaves_the_others_running() -> None:
    sup, _ = supervisor()
    a, b = Crashes(times=0), Crashes(times=0)
    sup.start("a", a)
    sup.start("b", b)
    await a.healthy.wait()
    await b.healthy.wait()
    await sup.stop(["a"])
    assert not sup.running("a")
    assert sup.running("b")
    await sup.stop()
    assert not sup.running("b")


async def test_close_logged_logs_and_goes_on() -> None:
    async def broken() -> None:
        raise OSError("socket gone")

    with capture_logs() as logs:
        await close_logged("api", broken())
    [entry] = [e for e in logs if e["event"] == "close_failed"]
    assert entry["part"] == "api"
    assert entry["log_level"] == "error"


async def test_wait_first_returns_on_either_event() -> None:
    first, second = asyncio.Event(), asyncio.Event()
    waiting = asyncio.ensure_future(wait_first(first, second))
    await asyncio.sleep(0)
    assert not waiting.done()
    second.set()
    await waiting
    await wait_first(second, first)  # already set: at once


# -- the manager's pod-resync loop ---------------------------------------------------------------


class _Pods:
    """The pods on a node, as the resync clock asks about them."""

    def __init__(self, *pods: str) -> None:
        self.uids = set(pods)

    def __len__(self) -> int:
        return len(self.uids)

    def has_pod(self, pod_uid: str) -> bool:
        return pod_uid in self.uids

    def pods(self) -> list[str]:
        return list(self.uids)


async def test_pod_resync_loop_restarts_after_an_exception_and_resyncs_go_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pod_sync, "RESYNC_TICK_SECONDS", 0.0)
    monkeypatch.setattr(pod_sync, "POD_RESYNC_SECONDS", 0.0)
    sup, backoffs = supervisor()
    synced: list[str] = []
    going_on = asyncio.Event()

    def sync_pod(pod_uid: str) -> None:
        synced.append(pod_uid)
        if len(synced) == 1:
            raise RuntimeError("sync bug")
        if len(synced) >= 6:
            going_on.set()

    # Two pods on the node (no probes needed to be synced again and again).
    syncs = PodSyncs(sync_pod, _Pods("pod-a", "pod-b"), supervisor=sup, rng=random.Random(1))
    with capture_logs() as logs:
        syncs.schedule("pod-a", 0.0)
        syncs.schedule("pod-b", 0.0)
        await going_on.wait()
    [failed] = failures(logs, RESYNC_TASK)
    assert str(failed["exc_info"]) == "sync bug"
    assert failed["attempt"] == 1
    assert backoffs.delays == [0.5]
    # Both pods are synced again after the restart, the one whose sync failed included.
    assert {"pod-a", "pod-b"} <= set(synced[1:])
    syncs.closed = True
    await sup.stop()
    assert not sup.running(RESYNC_TASK)
    syncs.schedule("pod-a")  # shut down: the loop does not start again
    assert not sup.running(RESYNC_TASK)


class _KeepsTasks(Supervisor):
    """A supervisor that hands the tests every task it starts."""

    def __init__(self) -> None:
        super().__init__()
        self.started: list[asyncio.Task[None]] = []

    def start(self, *args: Any, **kwargs: Any) -> asyncio.Task[None] | None:
        task = super().start(*args, **kwargs)
        if task is not None:
            self.started.append(task)
        return task


async def test_pod_resync_loop_still_ends_when_the_node_has_no_pods() -> None:
    sup = _KeepsTasks()
    pods = _Pods("pod-a")
    syncs = PodSyncs(lambda _uid: None, pods, supervisor=sup, rng=random.Random(1))
    syncs.schedule("pod-a")
    assert sup.running(RESYNC_TASK)
    pods.uids.clear()
    [task] = sup.started
    await task  # ends at its next tick: returning is its normal end
    assert not sup.running(RESYNC_TASK)
    await sup.stop()


async def test_manager_shutdown_stops_its_resync_clock() -> None:
    """A manager's own shutdown ends the clock, and nothing starts it again."""
    sup, _ = supervisor()
    manager = ProbeManager(
        prober=Prober(cast(Any, None)), rules=RulesFile(probes=()), supervisor=sup
    )
    await manager.shutdown(0)
    manager.syncs.schedule("pod-a")
    assert not sup.running(RESYNC_TASK)


# -- the pod sources and the registry's staleness check ------------------------------------------


class _CrashingSource(PodSource):
    """A source whose run raises the first time, then waits until cancelled."""

    def __init__(self) -> None:
        super().__init__("kubelet", stale_after=10)
        self.crashes = Crashes(times=1)
        self.closed = False

    async def run(self, changed: Changed) -> None:
        await self.crashes()

    async def close(self) -> None:
        self.closed = True


async def test_a_pod_source_whose_run_raises_is_restarted() -> None:
    sup, backoffs = supervisor()
    source = _CrashingSource()
    registry = PodSpecs([source], supervisor=sup)
    with capture_logs() as logs:
        registry.start(lambda: None)
        await source.crashes.healthy.wait()
    [failed] = failures(logs, "pod-source:kubelet")
    assert str(failed["exc_info"]) == "boom 1"
    assert source.crashes.runs == 2
    assert backoffs.delays == [0.5]
    await registry.stop()
    assert source.closed
    assert not sup.running("pod-source:kubelet")
    assert not sup.running("pod-source-stale")


async def test_the_staleness_loop_is_restarted_after_an_exception(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sup, backoffs = supervisor()
    source = _CrashingSource()
    source.crashes.times = 0
    registry = PodSpecs([source], supervisor=sup)
    checks = 0
    checked_again = asyncio.Event()

    def check_staleness() -> None:
        nonlocal checks
        checks += 1
        if checks == 1:
            raise RuntimeError("staleness bug")
        checked_again.set()

    monkeypatch.setattr(registry, "check_staleness", check_staleness)
    with capture_logs() as logs:
        registry.start(lambda: None)
        await checked_again.wait()
    [failed] = failures(logs, "pod-source-stale")
    assert str(failed["exc_info"]) == "staleness bug"
    assert backoffs.delays == [0.5]
    await registry.stop()
    assert not sup.running("pod-source-stale")


# -- the daemon ----------------------------------------------------------------------------------


def _daemon(tmp_path: Path, target: str, *, state_file: Path | None = None) -> Daemon:
    config = ServeConfig(
        endpoint=Endpoint(target, "flag", target),
        listen=f"unix://{tmp_path}/api.sock",
        pleg="relist",
        relist_period=0.05,
        state_file=state_file,
    )
    return Daemon(config, read_rules(None))


async def test_discovery_failing_is_restarted_and_the_daemon_still_gets_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeRuntimeServer(str(tmp_path / "cri.sock"), FakeRuntime()) as server:
        daemon = _daemon(tmp_path, server.target)
        real_run = daemon.discovery.run
        runs = 0

        async def run(*args: Any, **kwargs: Any) -> None:
            nonlocal runs
            runs += 1
            if runs == 1:
                raise RuntimeError("discovery bug")
            await real_run(*args, **kwargs)

        monkeypatch.setattr(daemon.discovery, "run", run)
        with capture_logs() as logs:
            task = asyncio.create_task(daemon.run())
            await daemon.ready.wait()
            daemon.stop_event.set()
            assert await task == 0
        [failed] = failures(logs, "discovery")
        assert str(failed["exc_info"]) == "discovery bug"
        assert failed["retry_in"] >= 0.5  # the first back-off
        assert runs == 2
        assert not (tmp_path / "api.sock").exists()


class _FailsOnce:
    """Stands in for a daemon loop's body: raises on its first run, then signals and runs the
    real one."""

    def __init__(self, real: Callable[..., Any]) -> None:
        self.real = real
        self.runs = 0
        self.again = asyncio.Event()

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.runs += 1
        if self.runs == 1:
            raise RuntimeError("loop bug")
        self.again.set()
        return await self.real(*args, **kwargs)


@pytest.mark.parametrize("loop", ["ready", "watchdog", "state", "reload"])
async def test_each_daemon_loop_killed_by_an_exception_is_logged_and_restarted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loop: str
) -> None:
    """Every long-lived task of the daemon (discovery has its own test above), killed once by an
    injected exception: ``task_failed`` names it, it runs again after the back-off and does its
    job, and serve stops cleanly with 0."""
    monkeypatch.setenv("WATCHDOG_USEC", "60000000")  # a heartbeat for the watchdog loop to send
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    async with FakeRuntimeServer(str(tmp_path / "cri.sock"), FakeRuntime()) as server:
        daemon = _daemon(tmp_path, server.target, state_file=tmp_path / "state.json")
        if loop == "ready":
            injected = _FailsOnce(daemon._announce_ready)
            monkeypatch.setattr(daemon, "_announce_ready", injected)
        elif loop == "watchdog":
            injected = _FailsOnce(systemd.watchdog_loop)
            monkeypatch.setattr(systemd, "watchdog_loop", injected)
        elif loop == "state":
            assert daemon.state_writer is not None
            injected = _FailsOnce(daemon.state_writer.run)
            monkeypatch.setattr(daemon.state_writer, "run", injected)
        else:
            injected = _FailsOnce(daemon._reload_on_request)
            monkeypatch.setattr(daemon, "_reload_on_request", injected)
        with capture_logs() as logs:
            task = asyncio.create_task(daemon.run())
            await injected.again.wait()
            await daemon.ready.wait()  # the restarted "ready" announced it too
            if loop == "reload":  # the restarted loop still serves SIGHUP
                daemon.request_reload()
                await until(lambda: any(e["event"] == "config_reloaded" for e in logs))
            daemon.stop_event.set()
            assert await task == 0
        [failed] = failures(logs, loop)
        assert str(failed["exc_info"]) == "loop bug"
        assert failed["attempt"] == 1
        assert injected.runs == 2
        assert [e["task"] for e in logs if e["event"] == "task_restarted"] == [loop]


async def test_a_fatal_task_stops_serve_non_zero_and_everything_is_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeRuntimeServer(str(tmp_path / "cri.sock"), FakeRuntime()) as server:
        daemon = _daemon(tmp_path, server.target)
        closed: list[str] = []
        real_close = daemon.cri.close

        async def close() -> None:
            closed.append("cri")
            await real_close()

        async def broken_shutdown(grace: float = 5.0) -> None:
            closed.append("manager")
            raise RuntimeError("shutdown bug")

        monkeypatch.setattr(daemon.cri, "close", close)
        # The manager's shutdown failing too must not keep the API and the CRI client open.
        monkeypatch.setattr(daemon.manager, "shutdown", broken_shutdown)
        crashes = Crashes(times=1)
        with capture_logs() as logs:
            task = asyncio.create_task(daemon.run())
            await daemon.ready.wait()
            assert (tmp_path / "api.sock").exists()
            daemon.supervisor.start("vital", crashes, policy="fatal")
            assert await task == EXIT_TASK_FAILED
        [failed] = failures(logs, "vital")
        assert failed["policy"] == "fatal"
        assert [e["part"] for e in logs if e["event"] == "close_failed"] == ["manager"]
        assert closed == ["manager", "cri"]
        assert not (tmp_path / "api.sock").exists()  # the API stopped and removed its socket
        assert not any(daemon.supervisor.running(name) for name in ("discovery", "vital"))
        assert [e["exit_code"] for e in logs if e["event"] == "serve_stopped"] == [1]


async def test_the_daemon_gets_ready_when_the_runtime_missed_its_version_call(
    tmp_path: Path,
) -> None:
    """serve announces it is ready with the runtime's version; a runtime too busy to answer
    that once (seen at 5,000 containers on a loaded machine, issue 36) is asked again, instead
    of serve never getting ready (no READY=1, the collector's start-up state never frozen)."""
    runtime = FakeRuntime()
    async with FakeRuntimeServer(str(tmp_path / "cri.sock"), runtime) as server:
        runtime.fail_next("Version", grpc.StatusCode.INTERNAL, grpc.StatusCode.INTERNAL)
        daemon = _daemon(tmp_path, server.target)
        with capture_logs() as logs:
            task = asyncio.create_task(daemon.run())
            await asyncio.wait_for(daemon.ready.wait(), HANG_GUARD)
            daemon.stop_event.set()
            assert await task == 0
        failed = [entry for entry in logs if entry["event"] == "runtime_version_failed"]
        assert [entry["retry_in"] for entry in failed] == [0.1, 0.2]
        assert any(entry["event"] == "runtime_connected" for entry in logs)
