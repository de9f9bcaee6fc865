"""`cri-prober serve` under a fake systemd (NOTIFY_SOCKET) against real containerd 1.6.

What a ``Type=notify`` unit relies on: READY=1 once the runtime answered and the API socket is
bound, WATCHDOG=1 heartbeats when WatchdogSec= is set, STOPPING=1 on SIGTERM, then exit 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from tests.support.testbed import Testbed
from tests.support.waiting import HANG_GUARD


async def _until(sock: socket.socket, line: str, received: list[str], timeout: float) -> None:
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            while True:
                message = (await loop.sock_recv(sock, 4096)).decode()
                received.append(message)
                if line in message.splitlines():
                    return
    except TimeoutError:
        pytest.fail(f"no {line} within {timeout} s; received {received}")


async def test_serve_sends_ready_watchdog_and_stopping(testbed_16: Testbed, tmp_path: Path) -> None:
    """READY=1 within 20 s of start, heartbeats, STOPPING=1 after SIGTERM, exit 0."""
    notify_path = tmp_path / "notify.sock"
    api_socket = tmp_path / "api.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify_path))
    sock.setblocking(False)
    received: list[str] = []
    signalled = False
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cri_prober", "serve",
        "-r", testbed_16.endpoint,
        "--listen", f"unix://{api_socket}",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "2000000"},
    )  # fmt: skip
    try:
        await _until(sock, "READY=1", received, timeout=20)
        assert api_socket.exists(), "READY=1 came before the API socket was bound"
        await _until(sock, "WATCHDOG=1", received, timeout=5)
        proc.send_signal(signal.SIGTERM)
        signalled = True
        await _until(sock, "STOPPING=1", received, timeout=20)
    finally:
        # One SIGTERM only: a second one during shutdown would find the default handler again.
        if not signalled and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        _out, err = await asyncio.wait_for(proc.communicate(), HANG_GUARD)
        sock.close()
    assert proc.returncode == 0, err.decode()
    lines = [line for message in received for line in message.splitlines()]
    assert lines.index("READY=1") < lines.index("STOPPING=1")
