"""Process inspection through /proc: liveness, argv, parents, and the testbed's own containerd.

Standard library only; the PID checks guard against PID reuse.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """True for a live process; a zombie (e.g. our own unreaped containerd child) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The command name in field 2 may contain spaces and parentheses: split after it.
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [arg.decode(errors="replace") for arg in raw.split(b"\0")[:-1]]


def containerd_pid(directory: Path) -> int | None:
    """The PID recorded for this testbed, if that process is alive and is still our containerd."""
    try:
        pid = int((directory / "containerd.pid").read_text())
    except (OSError, ValueError):
        return None
    # Guards against PID reuse: our containerd carries our config path in its argv.
    if pid_alive(pid) and str(directory / "config.toml") in cmdline(pid):
        return pid
    return None


def processes() -> Iterator[int]:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            yield int(entry.name)


def parent_pids() -> dict[int, int]:
    parents = {}
    for pid in processes():
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{pid}/stat").read_text()  # as in pid_alive
            parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def wait_gone(pids: Sequence[int], timeout: float) -> list[int]:
    """Wait up to `timeout` s for the processes to exit; return those still alive."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in alive if pid_alive(pid)]
    return alive
