"""The node's pressure (Linux PSI, ``/proc/pressure``) at the moment an attempt failed, so that
"timed out while the CPU was 80 % stalled" shows in the attempt's record.

Each file's ``some avg10`` line is the share of the last 10 s in which at least one task waited
for that resource (CPU, memory, I/O). The kernel updates the averages every 2 s, so one reading
a second serves every failure within it: a node where thousands of probes fail at once reads
the three files once, not thousands of times. Kernels without PSI (before 4.20, or booted with
``psi=0``) give None, and the files are not looked for again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = ["Pressure", "PressureReader"]

PRESSURE_DIR: Final = Path("/proc/pressure")
# One reading serves every failure within this many seconds (the kernel's own period is 2 s).
REUSE_SECONDS: Final = 1.0


@dataclass(frozen=True, slots=True)
class Pressure:
    """``some avg10`` of CPU, memory and I/O, in percent (0-100)."""

    cpu: float
    memory: float
    io: float

    def __str__(self) -> str:
        return f"cpu {self.cpu:g}%, memory {self.memory:g}%, io {self.io:g}%"


def _some_avg10(text: str) -> float:
    """``some avg10=12.34 avg60=... total=...`` → 12.34."""
    for line in text.splitlines():
        if line.startswith("some "):
            for field in line.split()[1:]:
                name, _, value = field.partition("=")
                if name == "avg10":
                    return float(value)
    raise ValueError("no 'some avg10' in the pressure file")


class PressureReader:
    """Reads the node's pressure, at most once per ``REUSE_SECONDS``; None without PSI."""

    def __init__(
        self, directory: Path = PRESSURE_DIR, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._directory = directory
        self._clock = clock
        self._available = True
        self._last: tuple[float, Pressure | None] | None = None

    def __call__(self) -> Pressure | None:
        if not self._available:
            return None
        now = self._clock()
        if self._last is not None and now - self._last[0] < REUSE_SECONDS:
            return self._last[1]
        # Three small reads of procfs, from memory: microseconds, fine on the loop.
        try:
            values = [
                _some_avg10((self._directory / name).read_text())
                for name in ("cpu", "memory", "io")
            ]
        except FileNotFoundError:
            self._available = False  # no PSI in this kernel: do not look again
            return None
        except (OSError, ValueError):
            reading = None  # e.g. PSI disabled at boot (EOPNOTSUPP): try again later
        else:
            reading = Pressure(*values)
        self._last = (now, reading)
        return reading
