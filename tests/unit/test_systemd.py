"""sd_notify: datagrams on a fake notify socket, the watchdog settings and heartbeat, and serve.

The fake notify socket is a unix datagram socket the test binds and points ``NOTIFY_SOCKET`` at,
which is all systemd's end of the protocol is.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from cri_prober import systemd as systemd_module
from cri_prober.systemd import Notifier, socket_address, watchdog_loop
from tests.support.fake_runtime import FakeRuntimeServer
from tests.support.waiting import HANG_GUARD


class NotifySocket:
    """systemd's end: a bound datagram socket collecting notifications."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.setblocking(False)
        self.received: list[str] = []

    def recv(self, timeout: float = 5.0) -> str:
        """The next datagram, waiting at most *timeout* seconds (blocking: for sync tests)."""
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(4096).decode()
        finally:
            self.sock.setblocking(False)

    def pending(self) -> list[str]:
        """Every datagram already queued."""
        messages = []
        while True:
            try:
                messages.append(self.sock.recv(4096).decode())
            except BlockingIOError:
                return messages

    async def until(self, line: str, timeout: float) -> list[str]:
        """Collect datagrams until one has *line*; everything received so far is returned."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                while True:
                    message = (await loop.sock_recv(self.sock, 4096)).decode()
                    self.received.append(message)
                    if line in message.splitlines():
                        return self.received
        except TimeoutError:
            pytest.fail(f"no {line} within {timeout} s; received {self.received}")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(name="notify_socket")
def _notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifySocket]:
    path = tmp_path / "notify.sock"
    server = NotifySocket(str(path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    yield server
    server.close()


@pytest.fixture(name="notifier")
def _notifier(notify_socket: NotifySocket) -> Iterator[Notifier]:
    notifier = Notifier.from_env()
    yield notifier
    notifier.close()


class TestNotify:
    def test_ready_sends_ready_and_status(
        self, notify_socket: NotifySocket, notifier: Notifier
    ) -> None:
        """ready() sends READY=1 and the status in one datagram."""
        assert notifier.enabled
        assert notifier.ready(status="probing 3 containers")
        assert notify_socket.recv() == "READY=1\nSTATUS=probing 3 containers\n"

    def test_ready_without_status(self, notify_socket: NotifySocket, notifier: Notifier) -> None:
        """ready() alone sends only READY=1."""
        notifier.ready()
        assert notify_socket.recv() == "READY=1\n"

    def test_status_stopping_watchdog(
        self, notify_socket: NotifySocket, notifier: Notifier
    ) -> None:
        """status(), stopping() and watchdog() each send their own datagram."""
        notifier.status("reloading rules")
        notifier.stopping()
        notifier.watchdog()
        notifier.stopping(status="bye")
        assert [notify_socket.recv() for _ in range(4)] == [
            "STATUS=reloading rules\n",
            "STOPPING=1\n",
            "WATCHDOG=1\n",
            "STOPPING=1\nSTATUS=bye\n",
        ]

    def test_arbitrary_fields_and_newlines(
        self, notify_socket: NotifySocket, notifier: Notifier
    ) -> None:
        """notify() sends any fields; a newline in a value cannot start a forged line."""
        notifier.notify(STATUS="line one\nREADY=1", ERRNO=5)
        assert notify_socket.recv() == "STATUS=line one READY=1\nERRNO=5\n"

    def test_abstract_socket(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """An '@name' NOTIFY_SOCKET is the abstract unix name '\\0name'."""
        name = f"cri-prober-test-{uuid.uuid4().hex}"
        server = NotifySocket("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        notifier = Notifier.from_env()
        try:
            assert notifier.ready()
            assert server.recv() == "READY=1\n"
            assert repr(notifier) == f"<Notifier @{name}>"
        finally:
            notifier.close()
            server.close()

    @pytest.mark.parametrize("value", [None, "", "vsock:2:1234", "relative/notify.sock", "@"])
    def test_no_usable_socket_is_a_no_op(
        self, monkeypatch: pytest.MonkeyPatch, value: str | None
    ) -> None:
        """Without a usable NOTIFY_SOCKET every call returns False and nothing is opened."""
        if value is None:
            monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
        else:
            monkeypatch.setenv("NOTIFY_SOCKET", value)
        monkeypatch.setenv("WATCHDOG_USEC", "30000000")
        notifier = Notifier.from_env()
        assert not notifier.enabled
        assert not notifier.ready(status="x")
        assert not notifier.stopping()
        assert not notifier.status("x")
        assert not notifier.watchdog()
        assert notifier.watchdog_interval() is None
        assert repr(notifier) == "<Notifier disabled>"

    def test_socket_addresses(self) -> None:
        """Paths are kept, '@' names become abstract, anything else is unsupported."""
        assert socket_address("/run/systemd/notify") == "/run/systemd/notify"
        assert socket_address("@abc") == "\0abc"
        assert socket_address("vsock:2:1") is None

    def test_no_listener_does_not_raise(self, tmp_path: Path) -> None:
        """A notify socket that is gone (systemd restarted) makes sends fail quietly."""
        notifier = Notifier(str(tmp_path / "gone.sock"))
        try:
            assert not notifier.ready()
        finally:
            notifier.close()

    def test_full_socket_buffer_drops_without_blocking(
        self, notify_socket: NotifySocket, notifier: Notifier
    ) -> None:
        """A receiver that never reads fills up; further sends are dropped, never blocking.

        Dropped (False) rather than waited for: a send that blocked would hang here, since
        nothing reads the socket; the drops show each send on a full buffer returned EAGAIN."""
        results = [notifier.watchdog() for _ in range(5000)]
        assert results[0]
        assert not all(results)  # the queue filled and the rest were dropped (EAGAIN)
        assert notify_socket.pending()[0] == "WATCHDOG=1\n"


class TestWatchdogInterval:
    @pytest.mark.parametrize(
        ("usec", "pid", "expected"),
        [
            ("30000000", None, 30.0),
            ("500000", None, 0.5),
            ("30000000", "self", 30.0),
            ("30000000", "1", None),  # meant for another process
            ("30000000", "not-a-pid", None),
            (None, None, None),
            ("", None, None),
            ("0", None, None),
            ("-5", None, None),
            ("30s", None, None),
        ],
    )
    def test_parsing(
        self,
        notify_socket: NotifySocket,
        monkeypatch: pytest.MonkeyPatch,
        usec: str | None,
        pid: str | None,
        expected: float | None,
    ) -> None:
        """WATCHDOG_USEC is the timeout in seconds, if WATCHDOG_PID (when set) is this process."""
        if usec is not None:
            monkeypatch.setenv("WATCHDOG_USEC", usec)
        if pid is not None:
            monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()) if pid == "self" else pid)
        assert Notifier.from_env().watchdog_interval() == expected

    def test_needs_a_notify_socket(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without a notify socket no heartbeat can be sent, so none is expected."""
        monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
        monkeypatch.setenv("WATCHDOG_USEC", "30000000")
        assert Notifier.from_env().watchdog_interval() is None


class TestWatchdogLoop:
    async def test_heartbeats_at_half_the_interval_until_stopped(
        self, notify_socket: NotifySocket, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """WATCHDOG=1 goes out at once and then every interval/2; stop ends the loop promptly.

        Every interval/2 is checked as the wait the loop arms between two heartbeats (not as
        time measured, which a busy machine stretches); promptly as the loop ending on stop
        while its 0.1 s wait is still running, without another heartbeat."""
        monkeypatch.setenv("WATCHDOG_USEC", "200000")  # 0.2 s: a heartbeat every 0.1 s
        notifier = Notifier.from_env()
        steps: list[str | float] = []  # "beat", or the seconds a wait was armed for
        send = notifier.watchdog

        def beat() -> bool:
            steps.append("beat")
            return send()

        class RecordingAsyncio:
            """The asyncio module as systemd.py sees it, noting each timeout it arms."""

            def __getattr__(self, name: str) -> Any:
                return getattr(asyncio, name)

            def timeout(self, delay: float | None) -> asyncio.Timeout:
                steps.append(-1.0 if delay is None else delay)
                return asyncio.timeout(delay)

        monkeypatch.setattr(notifier, "watchdog", beat)
        monkeypatch.setattr(systemd_module, "asyncio", RecordingAsyncio())
        stop = asyncio.Event()
        task = asyncio.create_task(watchdog_loop(notifier, stop))
        try:
            for _ in range(3):
                await notify_socket.until("WATCHDOG=1", timeout=HANG_GUARD)
            assert set(notify_socket.received) == {"WATCHDOG=1\n"}
            # At once, then a 0.1 s wait before each next heartbeat.
            assert steps[:5] == ["beat", 0.1, "beat", 0.1, "beat"]
            stop.set()
            await asyncio.wait_for(
                task, HANG_GUARD
            )  # a guard: it ends on the event, not on a timer
            # It ended inside a wait: no heartbeat after the last wait began.
            assert steps[-1] == 0.1
            assert steps == ["beat", 0.1] * (len(steps) // 2)
        finally:
            task.cancel()
            notifier.close()

    async def test_blocked_loop_sends_no_heartbeat(
        self, notify_socket: NotifySocket, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The heartbeat comes from the event loop: while the loop is blocked none is sent."""
        monkeypatch.setenv("WATCHDOG_USEC", "100000")  # a heartbeat every 0.05 s
        notifier = Notifier.from_env()
        stop = asyncio.Event()
        task = asyncio.create_task(watchdog_loop(notifier, stop))
        try:
            await notify_socket.until("WATCHDOG=1", timeout=HANG_GUARD)
            notify_socket.pending()
            time.sleep(0.3)  # noqa: ASYNC251  # a wedged loop: six heartbeat periods
            assert notify_socket.pending() == []
            await notify_socket.until("WATCHDOG=1", timeout=HANG_GUARD)  # it resumes with the loop
            stop.set()
            await asyncio.wait_for(task, HANG_GUARD)
        finally:
            task.cancel()
            notifier.close()

    async def test_returns_at_once_without_watchdog(self, notify_socket: NotifySocket) -> None:
        """No WATCHDOG_USEC: the loop sends nothing and returns without waiting for stop."""
        notifier = Notifier.from_env()
        await asyncio.wait_for(watchdog_loop(notifier, asyncio.Event()), HANG_GUARD)
        assert notify_socket.pending() == []


# -- serve end to end (subprocess) ------------------------------------------------------------


@pytest.fixture(name="serve_notify")
async def _serve_notify(tmp_path: Path) -> AsyncIterator[NotifySocket]:
    server = NotifySocket(str(tmp_path / "notify.sock"))
    yield server
    server.close()


async def _serve(tmp_path: Path, runtime_socket: Path, **env: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cri_prober", "serve",
        "-r", f"unix://{runtime_socket}",
        "--listen", f"unix://{tmp_path}/api.sock",
        "--relist-period", "0.2",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify.sock"), **env},
    )  # fmt: skip


async def _logged(proc: asyncio.subprocess.Process, event: str, *, timeout: float) -> None:
    """Read serve's log (stderr) until a line with this ``event``."""
    assert proc.stderr is not None
    async with asyncio.timeout(timeout):
        while line := await proc.stderr.readline():
            if f'"event": "{event}"' in line.decode(errors="replace"):
                return
    pytest.fail(f"serve exited before logging {event} (status {await proc.wait()})")


async def _sigterm(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is not None:
        _out, err = await proc.communicate()
        pytest.fail(f"serve exited early with status {proc.returncode}:\n{err.decode()}")
    proc.send_signal(signal.SIGTERM)


async def _reap(proc: asyncio.subprocess.Process, *, signalled: bool) -> bytes:
    # One SIGTERM only: a second one during shutdown would find the default handler again.
    if not signalled and proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    _out, err = await asyncio.wait_for(proc.communicate(), HANG_GUARD)
    return err


async def test_serve_notifies_ready_watchdog_and_stopping(
    tmp_path: Path, serve_notify: NotifySocket
) -> None:
    """serve under Type=notify: READY=1 once the (fake) runtime answered, heartbeats, STOPPING=1."""
    async with FakeRuntimeServer(str(tmp_path / "cri.sock")) as runtime:
        proc = await _serve(
            tmp_path, Path(runtime.socket_path), WATCHDOG_USEC="1000000", WATCHDOG_PID=""
        )
        signalled = False
        try:
            await serve_notify.until("READY=1", timeout=HANG_GUARD)
            assert (tmp_path / "api.sock").exists(), "READY=1 before the API socket was bound"
            await serve_notify.until("WATCHDOG=1", timeout=HANG_GUARD)
            await _sigterm(proc)
            signalled = True
            messages = await serve_notify.until("STOPPING=1", timeout=HANG_GUARD)
        finally:
            err = await _reap(proc, signalled=signalled)
    assert proc.returncode == 0, err.decode()
    lines = [line for message in messages for line in message.splitlines()]
    assert lines.index("READY=1") < lines.index("STOPPING=1")


async def test_serve_without_runtime_is_not_ready_but_stops_cleanly(
    tmp_path: Path, serve_notify: NotifySocket
) -> None:
    """No runtime: READY=1 never comes, but SIGTERM still sends STOPPING=1 and exits 0."""
    proc = await _serve(tmp_path, tmp_path / "none.sock")
    signalled = False
    try:
        # Its signal handlers are in place once the API listens (a SIGTERM before that would
        # find Python's default and kill it, on a machine slow enough to take 1.5 s to start).
        await _logged(proc, "api_listening", timeout=HANG_GUARD)
        await asyncio.sleep(1.5)  # a window for a (wrong) early READY=1 to show up
        await _sigterm(proc)
        signalled = True
        messages = await serve_notify.until("STOPPING=1", timeout=HANG_GUARD)
    finally:
        err = await _reap(proc, signalled=signalled)
    assert proc.returncode == 0, err.decode()
    assert not any("READY=1" in message.splitlines() for message in messages)
