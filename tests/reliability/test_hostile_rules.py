"""Hostile rules files reloaded by SIGHUP never freeze, bloat or crash the daemon (issue 15).

An in-process daemon on the fake runtime probes one canary container (exec, period 1; the fake
answers at once). Each hostile file is written over the rules file and reloaded by a real
SIGHUP to this process, whose loop the daemon registered its handler on. For each one:
``config_reload_failed`` is logged with one line naming the file and the problem, the running
set is kept (the canary's worker goes on: it never stops and its count never goes back), the
event loop never works on one step for long (counted in the loop thread's CPU time, which a busy
machine does not inflate as it does wall-clock time: the tests assert what happened, not how
fast), a FIFO is refused before anyone writes to it, and the health service answers every Check
while the reload runs. After valid, large and hostile files have come and gone, RSS is back near
the baseline.

Before the fix each of these froze the loop or raised out of the signal callback: the FIFO
blocked the loop in open() until a writer came (a timer here plays the writer after 5 s, so the
old code fails instead of hanging), the 5 MB file parsed on the loop for tens of seconds, the
merge-key bomb grew exponentially, invalid UTF-8 raised UnicodeDecodeError out of the callback.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import structlog
from grpc_health.v1 import health_pb2

from cri_prober import daemon as daemon_module
from cri_prober.daemon import Daemon
from cri_prober.manager.events import AttemptFinished, ManagerEvent
from cri_prober.manager.state import ProbedContainer
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.spec import RULES_FILE_MAX_BYTES, RulesFile
from tests.reliability.support import (
    STALL_BOUND,
    Api,
    LoopStalls,
    Workers,
    api_client,
    rss_bytes,
)
from tests.support.daemon import running_daemon
from tests.support.fake_runtime import FakeRuntimeServer
from tests.support.waiting import HANG_GUARD
from tests.support.watchers import ManagerWatcher

RELOAD_TIMEOUT = HANG_GUARD  # generous: the old code took over a minute on the 5 MB file
# A hang guard for code that blocks in open() on the FIFO (the timer is the writer that releases
# it); the fixed code refuses the FIFO before the timer fires, and the test asserts that order.
FIFO_WRITER_DELAY = 30.0
REFUSED_RSS_SLACK = 8 * 1024 * 1024
# A valid file near the cap costs ~30 MiB while it loads; see the test.
LARGE_RSS_SLACK = 64 * 1024 * 1024
LARGE_CYCLES = 6
RELOAD_EVENTS = frozenset({"config_reloaded", "config_reload_failed", "config_reload_crashed"})

RULES = """\
probes:
  - match: {namespace: default, pod: canary, container: app}
    livenessProbe:
      exec: {command: ["true"]}
      periodSeconds: 1
"""
FILLER_RULE = """\
  - match: {{namespace: "filler-{index}", pod: "web-*", container: app}}
    ports: [{{name: http, containerPort: 8080}}]
    livenessProbe: {{httpGet: {{path: /healthz, port: http}}, periodSeconds: 10}}
    readinessProbe: {{exec: {{command: [cat, /tmp/ready]}}, periodSeconds: 5}}
"""


def rules_of_size(size: int) -> str:
    """The canary's rules plus rules that match nothing, to about ``size`` bytes."""
    parts = [RULES]
    total = len(RULES)
    for index in itertools.count():
        rule = FILLER_RULE.format(index=index)
        if total + len(rule) > size:
            break
        parts.append(rule)
        total += len(rule)
    return "".join(parts)


def merge_bomb(levels: int) -> str:
    """Chained merge keys, each level four copies of the one before: 419 bytes at 11 levels."""
    lines = ["a0: &a0 {k: v}"]
    for level in range(1, levels + 1):
        refs = ", ".join([f"*a{level - 1}"] * 4)
        lines.append(f"a{level}: &a{level} {{<<: [{refs}]}}")
    return "\n".join([*lines, "probes: []", ""])


# -- cases ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hostile:
    """A rules file that must be refused at reload, and the one-line reason expected."""

    name: str
    write: Callable[[Path], None]
    reason: str


def _write_bytes(data: bytes) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        path.write_bytes(data)

    return write


def _replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


HOSTILE = [
    Hostile(
        "invalid-utf8",
        _write_bytes(RULES.encode() + b"# caf\xe9\n"),
        f"not valid UTF-8: byte {len(RULES) + 5} (line 6): invalid continuation byte",
    ),
    Hostile(
        "merge-key-bomb",
        _write_bytes(merge_bomb(11).encode()),
        "aliases expand to more than 10000 nodes",
    ),
    Hostile(
        "5-MB",
        _write_bytes(rules_of_size(5_000_000).encode()),
        "too large: ",
    ),
    Hostile("fifo", _replace_with_fifo, "not a regular file (a FIFO)"),
    Hostile(
        "sexagesimal",
        _write_bytes(RULES.replace("periodSeconds: 1", "periodSeconds: 1:30").encode()),
        'probes[0].livenessProbe.periodSeconds: must be an integer (got "1:30")',
    ),
    Hostile(
        "hex",
        _write_bytes(RULES.replace("periodSeconds: 1", "periodSeconds: 0x10").encode()),
        'probes[0].livenessProbe.periodSeconds: must be an integer (got "0x10")',
    ),
]


# -- the world ------------------------------------------------------------------------------------


@dataclass
class World:
    daemon: Daemon
    watcher: ManagerWatcher
    api: Api
    rules_file: Path
    reloads: asyncio.Queue[dict[str, Any]]
    canary_times: list[float] = field(default_factory=list)
    stalls: LoopStalls = field(default_factory=LoopStalls)  # see STALL_BOUND
    health_checks: int = 0  # Checks answered while reloads ran

    def canary(self) -> list[ProbedContainer]:
        return [p for p in self.daemon.manager.probed() if p.container.pod.name == "canary"]

    def canary_worker(self) -> Workers:
        """The canary's liveness worker, as the manager shows it (to check it is kept later)."""
        [canary] = self.canary()
        liveness = canary.probe(ProbeKind.LIVENESS)
        assert liveness is not None
        assert liveness.active
        return Workers.of([canary], self.watcher)

    def assert_same_canary_worker(self, before: Workers) -> None:
        before.assert_kept(self.canary(), self.watcher)

    async def canary_attempts(self, count: int) -> None:
        target = len(self.canary_times) + count
        await self.watcher.until(lambda: len(self.canary_times) >= target)

    async def reload_by_signal(self) -> dict[str, Any]:
        """SIGHUP, then the reload's log event; the health service is asked meanwhile."""
        done = asyncio.Event()
        checker = asyncio.create_task(self._check_health_until(done))
        try:
            os.kill(os.getpid(), signal.SIGHUP)
            async with asyncio.timeout(RELOAD_TIMEOUT):
                return await self.reloads.get()
        finally:
            done.set()
            await checker

    async def _check_health_until(self, done: asyncio.Event) -> None:
        request = health_pb2.HealthCheckRequest(service="")
        while not done.is_set():
            await self.api.health.Check(request, timeout=HANG_GUARD)
            self.health_checks += 1
            # Spaced, so the checks measure the loop instead of keeping it busy.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.05)

    def assert_loop_kept_turning(self) -> None:
        longest = self.stalls.longest
        assert longest < STALL_BOUND, f"{longest:.2f} s of CPU in one turn of the loop"
        assert self.health_checks >= 1  # the health service answered during the reload


@contextlib.contextmanager
def reload_log_events() -> Iterator[asyncio.Queue[dict[str, Any]]]:
    """The daemon's reload log events, as they are logged (on the loop's thread)."""
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    def capture(_logger: object, _method: str, event: Any) -> Any:
        if event.get("event") not in RELOAD_EVENTS:
            # Not kept: a list of every log line would grow through the test and pin memory
            # that the RSS check expects back.
            raise structlog.DropEvent
        queue.put_nowait(dict(event))
        return event

    with structlog.testing.capture_logs(processors=[capture]):
        yield queue


@contextlib.asynccontextmanager
async def world(tmp_path: Path) -> AsyncIterator[World]:
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(RULES)
    canary_times: list[float] = []

    def on_event(event: ManagerEvent) -> None:
        if isinstance(event, AttemptFinished) and event.container.pod.name == "canary":
            canary_times.append(time.monotonic())

    async with FakeRuntimeServer(str(tmp_path / "cri.sock")) as cri:
        sandbox = cri.runtime.add_sandbox("canary", ip="127.0.0.1")
        cri.runtime.add_container(sandbox, "app")
        with reload_log_events() as reloads:
            async with (
                running_daemon(cri.target, rules_file, listeners=[on_event]) as (daemon, watcher),
                api_client(daemon) as api,
            ):
                w = World(daemon, watcher, api, rules_file, reloads, canary_times)
                await w.canary_attempts(2)
                async with w.stalls:
                    yield w


def restore(path: Path) -> None:
    if path.is_fifo():
        path.unlink()
    path.write_text(RULES)


@contextlib.contextmanager
def fifo_writer_after(path: Path, delay: float) -> Iterator[threading.Event]:
    """After ``delay``, open ``path`` for writing once if it is a FIFO someone is reading; the
    event yielded is set if that released a reader.

    The fixed code never waits on the FIFO, so this finds no reader and does nothing; code that
    blocks in open() is released by it, and then fails the test instead of hanging it.
    """
    released = threading.Event()

    def release() -> None:
        with contextlib.suppress(OSError):  # ENXIO: nobody has it open for reading
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            released.set()

    timer = threading.Timer(delay, release)
    timer.start()
    try:
        yield released
    finally:
        timer.cancel()


# -- tests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", HOSTILE, ids=[case.name for case in HOSTILE])
async def test_hostile_file_is_refused_at_reload_without_freezing(
    tmp_path: Path, case: Hostile
) -> None:
    async with world(tmp_path) as w:
        worker = w.canary_worker()
        case.write(w.rules_file)
        with fifo_writer_after(w.rules_file, FIFO_WRITER_DELAY) as released:
            event = await w.reload_by_signal()
        assert not released.is_set(), "the reload waited in open() for a FIFO writer"
        assert event["event"] == "config_reload_failed", event
        # One line, naming the file and what is wrong with it.
        [error] = event["errors"]
        assert error.startswith(f"{w.rules_file}: "), error
        assert case.reason in error, error
        assert "\n" not in error
        w.assert_same_canary_worker(worker)  # the running set must be kept
        # The canary goes on probing after the reload, and the loop kept turning and answering.
        await w.canary_attempts(2)
        w.assert_loop_kept_turning()

        restore(w.rules_file)
        event = await w.reload_by_signal()
        assert event["event"] == "config_reloaded", event
        w.assert_same_canary_worker(worker)  # an unchanged probe keeps its worker


async def test_refused_files_leave_rss_at_the_baseline(tmp_path: Path) -> None:
    """Every hostile file, three times over: refused before it costs memory."""
    async with world(tmp_path) as w:
        gc.collect()
        baseline = rss_bytes()
        for _ in range(3):
            for case in HOSTILE:
                case.write(w.rules_file)
                with fifo_writer_after(w.rules_file, FIFO_WRITER_DELAY):
                    assert (await w.reload_by_signal())["event"] == "config_reload_failed"
                restore(w.rules_file)
                assert (await w.reload_by_signal())["event"] == "config_reloaded"
        gc.collect()
        growth = rss_bytes() - baseline
        assert growth < REFUSED_RSS_SLACK, f"RSS grew {growth / 2**20:.1f} MiB"


async def test_a_file_near_the_cap_loads_off_the_loop_and_memory_plateaus(
    tmp_path: Path,
) -> None:
    """A valid file just under the cap (~4000 rules) loads in a worker thread while the canary
    keeps its period; reloading it again and reverting reuses the memory of the first time."""
    async with world(tmp_path) as w:
        worker = w.canary_worker()
        gc.collect()
        baseline = rss_bytes()
        large = rules_of_size(RULES_FILE_MAX_BYTES - 1024)
        after: list[int] = []
        for _ in range(LARGE_CYCLES):
            w.rules_file.write_text(large)
            event = await w.reload_by_signal()
            assert event["event"] == "config_reloaded", event
            assert event["rules"] > 3000
            restore(w.rules_file)
            assert (await w.reload_by_signal())["rules"] == 1
            gc.collect()
            after.append(rss_bytes())
        w.assert_same_canary_worker(worker)
        await w.canary_attempts(2)
        w.assert_loop_kept_turning()
        # The allocator keeps what the first loads touched (a high-water mark) and reuses it:
        # after a few cycles RSS stays flat, so it is no leak. (Before the fix the 5 MB file
        # alone left ~480 MB.)
        growth = [round((rss - baseline) / 2**20, 1) for rss in after]
        print(f"RSS growth after each cycle: {growth} MiB")
        assert after[-1] - baseline < LARGE_RSS_SLACK, f"RSS grew {growth} MiB"
        assert after[-1] - after[2] < REFUSED_RSS_SLACK, f"RSS grew {growth} MiB"


async def test_a_reload_stuck_in_its_read_freezes_nothing_and_signals_coalesce(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that hangs (a slow disk) holds only its thread; SIGHUPs meanwhile make one more."""
    entered = threading.Semaphore(0)
    release = threading.Event()
    calls: list[Path | None] = []
    real_read_rules = daemon_module.read_rules

    def slow_read_rules(path: Path | None) -> RulesFile:
        calls.append(path)
        entered.release()
        # Released by the test; after 30 s anyway, so code that reads on the loop (which the
        # test could then never release) fails the test instead of hanging it.
        release.wait(30)
        return real_read_rules(path)

    async with world(tmp_path) as w:
        monkeypatch.setattr(daemon_module, "read_rules", slow_read_rules)
        worker = w.canary_worker()
        checker_done = asyncio.Event()
        checker = asyncio.create_task(w._check_health_until(checker_done))
        try:
            os.kill(os.getpid(), signal.SIGHUP)
            assert await asyncio.to_thread(entered.acquire, True, HANG_GUARD)
            for _ in range(5):
                os.kill(os.getpid(), signal.SIGHUP)
            # The read hangs for 3 canary periods: the loop must not notice.
            await w.canary_attempts(3)
            # All three while it hung: not yet released, and the SIGHUPs made no second read.
            assert not release.is_set()
            assert len(calls) == 1
            release.set()
            first = await asyncio.wait_for(w.reloads.get(), RELOAD_TIMEOUT)
            second = await asyncio.wait_for(w.reloads.get(), RELOAD_TIMEOUT)
        finally:
            release.set()
            checker_done.set()
            await checker
        assert (first["event"], second["event"]) == ("config_reloaded", "config_reloaded")
        # One reload for the first signal, one more for the five that came while it ran.
        assert len(calls) == 2
        assert w.reloads.empty()
        w.assert_same_canary_worker(worker)
        w.assert_loop_kept_turning()


async def test_a_reload_in_progress_does_not_hold_up_shutdown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM while a reload reads the file: the daemon stops without waiting for the file (its
    stop ends while the read is still held; a daemon that waited for it would hit the stop's
    hang guard)."""
    entered = threading.Semaphore(0)
    release = threading.Event()
    real_read_rules = daemon_module.read_rules

    def held_read_rules(path: Path | None) -> RulesFile:
        entered.release()
        release.wait(3 * HANG_GUARD)  # past the stop's guard: the test releases it
        return real_read_rules(path)

    try:
        async with world(tmp_path) as w:
            w.rules_file.write_text(rules_of_size(RULES_FILE_MAX_BYTES - 1024))
            monkeypatch.setattr(daemon_module, "read_rules", held_read_rules)
            os.kill(os.getpid(), signal.SIGHUP)
            assert await asyncio.to_thread(entered.acquire, True, HANG_GUARD)
            w.daemon.stop_event.set()
        assert not release.is_set()  # the daemon stopped while the read was still held
        assert w.reloads.empty()  # and no reload finished
    finally:
        release.set()
