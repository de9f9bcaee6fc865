"""The node's pressure (PSI): sampled off the event loop, so that a FIFO, a huge or a slow file
at ``/proc/pressure`` never freezes serve, and a damaged one turns PSI off with one log line
(issue 34, item 2).

The serve tests point the daemon at PSI files of their own and let a probe fail every second:
each failed attempt asks for the pressure on the event loop. Where the code before the fix
blocked the loop (an open() of a FIFO, a slow parse), a guard thread unblocks it after
``GUARD_SECONDS`` and says so; a test fails if it needed the guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from cri_prober._gen.runtime.v1 import api_pb2
from cri_prober.probing import pressure as pressure_module
from cri_prober.probing.pressure import Pressure, PressureReader
from tests.support.daemon import daemon_on_fake_runtime
from tests.support.fake_runtime import FakeContainer, FakeRuntime
from tests.support.waiting import until

# Only matters when something hangs: the fixed code never gets near it.
GUARD_SECONDS = 60.0
HANG = 120.0
LINE = "some avg10={} avg60=1.00 avg300=0.50 total=123\nfull avg10=0.00 avg60=0.00 total=0\n"
RULES = """
probes:
  - match: {container: app}
    readinessProbe: {exec: {command: [check]}, periodSeconds: 1}
"""


def write_psi(directory: Path, cpu: str = "81.00", memory: str = "0.00", io: str = "2.50") -> Path:
    directory.mkdir(exist_ok=True)
    for name, value in (("cpu", cpu), ("memory", memory), ("io", io)):
        (directory / name).write_text(LINE.format(value))
    return directory


def disabled_lines(logs: list[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [line for line in logs if line["event"] == "node_pressure_disabled"]


# -- the reader --------------------------------------------------------------------------------


def test_read_pressure_takes_some_avg10_of_each_file(tmp_path: Path) -> None:
    assert pressure_module.read_pressure(write_psi(tmp_path / "psi")) == Pressure(
        cpu=81.0, memory=0.0, io=2.5
    )


async def test_a_failed_attempt_takes_the_latest_sample_while_it_is_fresh(tmp_path: Path) -> None:
    psi = write_psi(tmp_path / "psi")
    now = [100.0]
    reader = PressureReader(psi, clock=lambda: now[0], interval=0.01)
    assert reader() is None  # no sample yet
    sampler = asyncio.create_task(reader.run())
    try:
        await until(lambda: reader() is not None, timeout=HANG)
        assert reader() == Pressure(cpu=81.0, memory=0.0, io=2.5)
        (psi / "cpu").write_text(LINE.format("5.00"))
        await until(lambda: reader() == Pressure(cpu=5.0, memory=0.0, io=2.5), timeout=HANG)
    finally:
        sampler.cancel()
    # No sample since: too old to be "the pressure then".
    now[0] += pressure_module.MAX_AGE_SECONDS + 0.5
    assert reader() is None
    assert not reader.disabled


async def test_no_psi_in_the_kernel_is_one_info_line_and_never_looked_for_again(
    tmp_path: Path,
) -> None:
    reader = PressureReader(tmp_path / "missing", interval=0.01)
    with capture_logs() as logs:
        await reader.run()
        (tmp_path / "missing").mkdir()
        write_psi(tmp_path / "missing")
        await reader.run()  # a restart of the task: disabled for good
    assert reader() is None
    assert reader.disabled
    [line] = disabled_lines(logs)
    assert line["log_level"] == "info"
    assert line["file"] == str(tmp_path / "missing" / "cpu")
    assert "no PSI" in line["reason"]


def sparse_file(path: Path) -> None:
    with path.open("wb") as handle:
        handle.truncate(100 * 1024 * 1024)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: os.mkfifo(p), "not a regular file (a FIFO)"),
        (sparse_file, "larger than 4 KiB (100 MiB)"),
        (lambda p: p.mkdir(), "not a regular file (a directory)"),
        (lambda p: p.write_text("x" * 4097), "larger than 4 KiB (4097 bytes)"),
        (lambda p: p.write_text("full avg10=1.00\n"), "no 'some avg10' in the pressure file"),
        (lambda p: p.write_text(LINE.format("nan")), "'some avg10=nan' is not a percentage"),
        (lambda p: p.write_text(LINE.format("1e308")), "'some avg10=1e308' is not a percentage"),
        (lambda p: p.write_bytes(b"some avg10=\xff\n"), "not ASCII text"),
    ],
    ids=["fifo", "100MiB", "directory", "4KiB+1", "no-avg10", "nan", "huge-value", "binary"],
)
async def test_a_damaged_file_turns_psi_off_with_one_warning(
    tmp_path: Path, damage: Any, reason: str
) -> None:
    psi = write_psi(tmp_path / "psi")
    (psi / "memory").unlink()
    damage(psi / "memory")
    with pytest.raises(pressure_module.UnusablePressure) as raised:
        pressure_module.read_pressure(psi)
    assert (raised.value.path, raised.value.reason) == (psi / "memory", reason)
    reader = PressureReader(psi, interval=0.01)
    with capture_logs() as logs:
        await reader.run()  # returns: it samples no more
    assert reader() is None
    assert reader.disabled
    assert disabled_lines(logs) == [
        {
            "event": "node_pressure_disabled",
            "log_level": "warning",
            "file": str(psi / "memory"),
            "reason": reason,
        }
    ]


# -- serve, with a probe failing every second ----------------------------------------------------


class Guard:
    """Calls ``unblock`` on a thread after ``GUARD_SECONDS`` unless cancelled first; ``fired``
    says whether it had to (the event loop was blocked, or the test would have hung)."""

    def __init__(self, unblock: Any) -> None:
        self.fired = threading.Event()
        self._cancelled = threading.Event()

        def run() -> None:
            if not self._cancelled.wait(GUARD_SECONDS):
                self.fired.set()
                unblock()

        self._thread = threading.Thread(target=run, name="psi-guard", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        self._cancelled.set()
        self._thread.join(HANG)


@contextlib.contextmanager
def guarded(unblock: Any) -> Iterator[Guard]:
    guard = Guard(unblock)
    try:
        yield guard
    finally:
        guard.cancel()


async def exit_one(_c: FakeContainer, _cmd: list[str], _timeout: int) -> api_pb2.ExecSyncResponse:
    return api_pb2.ExecSyncResponse(exit_code=1)


def open_fifo_for_good(fifo: Path) -> None:
    """What the guard does for a FIFO: hand a reader blocked in open() a valid PSI line, then
    put a regular file at the path, so that the code before the fix goes on and fails its
    assertions instead of hanging."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: nobody is waiting to read right now
        pass
    else:
        with contextlib.suppress(OSError):
            os.write(fd, LINE.format("1.00").encode())
        os.close(fd)
    plain = fifo.with_name("plain")
    plain.write_text(LINE.format("1.00"))
    os.replace(plain, fifo)


@pytest.mark.parametrize("damage", ["fifo", "100MiB"])
async def test_a_damaged_psi_file_never_freezes_serve(tmp_path: Path, damage: str) -> None:
    """A FIFO at /proc/pressure/cpu froze serve for good at the first failed attempt; a 100 MiB
    file was read whole at each one. Now: one warning, and the failing probe goes on."""
    psi = write_psi(tmp_path / "psi")
    cpu = psi / "cpu"
    cpu.unlink()
    if damage == "fifo":
        os.mkfifo(cpu)
    else:
        sparse_file(cpu)
    runtime = FakeRuntime(exec_handler=exit_one)
    app = runtime.add_container(runtime.add_sandbox("web-0"), "app")
    with capture_logs() as logs, guarded(lambda: open_fifo_for_good(cpu)) as guard:
        async with daemon_on_fake_runtime(
            tmp_path, runtime, RULES, pressure_directory=psi, ready_timeout=HANG
        ) as (_daemon, watcher):

            def failed() -> int:
                return sum(
                    e.record.result == "failure" and e.container.id == app.id
                    for e in watcher.records
                )

            await until(lambda: disabled_lines(logs), timeout=HANG, message="the warning")
            seen = failed()
            await watcher.until(lambda: failed() >= seen + 3, timeout=HANG)
    assert not guard.fired.is_set(), "the event loop was blocked until the guard unblocked it"
    [line] = disabled_lines(logs)  # once, whatever the number of failures
    assert (line["log_level"], line["file"]) == ("warning", str(cpu))
    assert line["reason"] == (
        "not a regular file (a FIFO)" if damage == "fifo" else "larger than 4 KiB (100 MiB)"
    )
    assert all(e.record.pressure is None for e in watcher.records)


async def test_a_slow_psi_read_never_freezes_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that takes long (here: the parse of the first sample waits on an event) holds up
    no attempt: the failing probe goes on meanwhile with no pressure, and gets it once the read
    returns. Nothing is logged: a slow read is no broken file."""
    psi = write_psi(tmp_path / "psi")
    entered, release = threading.Event(), threading.Event()
    parse = pressure_module._some_avg10

    def slow(text: str) -> float:
        if not release.is_set():
            entered.set()
            release.wait()
        return parse(text)

    monkeypatch.setattr(pressure_module, "_some_avg10", slow)
    runtime = FakeRuntime(exec_handler=exit_one)
    app = runtime.add_container(runtime.add_sandbox("web-0"), "app")
    try:
        with capture_logs() as logs, guarded(release.set) as guard:
            async with daemon_on_fake_runtime(
                tmp_path, runtime, RULES, pressure_directory=psi, ready_timeout=HANG
            ) as (_daemon, watcher):

                def failures() -> list[Pressure | None]:
                    return [
                        e.record.pressure
                        for e in watcher.records
                        if e.record.result == "failure" and e.container.id == app.id
                    ]

                await until(entered.is_set, timeout=HANG, message="the slow read to start")
                seen = len(failures())
                await watcher.until(lambda: len(failures()) >= seen + 3, timeout=HANG)
                held_up = not release.is_set()  # the attempts came while the read was stuck
                assert failures()[seen:] == [None] * (len(failures()) - seen)
                release.set()
                expected = Pressure(cpu=81.0, memory=0.0, io=2.5)
                await watcher.until(lambda: failures()[-1] == expected, timeout=HANG)
    finally:
        release.set()
    assert not guard.fired.is_set(), "the event loop was blocked until the guard unblocked it"
    assert held_up
    assert disabled_lines(logs) == []
