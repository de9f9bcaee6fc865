"""The node's pressure (Linux PSI, ``/proc/pressure``) at the moment an attempt failed, so that
"timed out while the CPU was 80 % stalled" shows in the attempt's record.

Each file's ``some avg10`` line is the share of the last 10 s in which at least one task waited
for that resource (CPU, memory, I/O). ``PressureReader.run`` samples the three files once a
second in a worker thread, and a failed attempt takes the latest sample without touching a file:
the event loop never waits on a read, so a FIFO, a huge or a slow file put at the path cannot
freeze it. The kernel updates the averages every 2 s, so a sample a second old is as good as a
fresh one. A kernel without PSI, or a file that is not what the kernel writes, stops sampling
for good with one log line; attempts then carry no pressure.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from cri_prober.files import UnsafeFile, read_regular_file

__all__ = ["PRESSURE_DIR", "Pressure", "PressureReader", "UnusablePressure", "read_pressure"]

log = structlog.get_logger(__name__)

PRESSURE_DIR: Final = Path("/proc/pressure")
# The files read, in Pressure's field order.
_FILES: Final = ("cpu", "memory", "io")
# A PSI file is two lines of about 60 bytes; anything past this is not one.
MAX_FILE_BYTES: Final = 4096
# One sample a second (the kernel's own period is 2 s).
SAMPLE_SECONDS: Final = 1.0
# A sample older than this is no longer "the pressure then" (sampling is stuck behind a slow
# read, or the worker threads are all busy): an attempt carries none rather than an old one.
MAX_AGE_SECONDS: Final = 5.0


@dataclass(frozen=True, slots=True)
class Pressure:
    """``some avg10`` of CPU, memory and I/O, in percent (0-100)."""

    cpu: float
    memory: float
    io: float

    def __str__(self) -> str:
        return f"cpu {self.cpu:g}%, memory {self.memory:g}%, io {self.io:g}%"


class UnusablePressure(Exception):
    """A PSI file that is missing (``missing``: the kernel has no PSI) or not what the kernel
    writes; ``reason`` says which rule it broke, for one log line."""

    def __init__(self, path: Path, reason: str, *, missing: bool = False) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason
        self.missing = missing


def _some_avg10(text: str) -> float:
    """``some avg10=12.34 avg60=... total=...`` → 12.34."""
    for line in text.splitlines():
        if line.startswith("some "):
            for field in line.split()[1:]:
                name, _, value = field.partition("=")
                if name == "avg10":
                    share = float(value)
                    if not (math.isfinite(share) and 0.0 <= share <= 100.0):
                        raise ValueError(f"'some avg10={value}' is not a percentage")
                    return share
    raise ValueError("no 'some avg10' in the pressure file")


def read_pressure(directory: Path = PRESSURE_DIR) -> Pressure:
    """The three files' ``some avg10``. Blocking: run it in a worker thread.

    Each file is opened without waiting (a FIFO is refused, not waited on) and read up to
    ``MAX_FILE_BYTES`` (procfs reports size 0, so the cap is on the bytes read).

    Raises:
        UnusablePressure: a file is missing, not a regular file, too large, unreadable or
            holds no ``some avg10`` percentage.
    """
    values: list[float] = []
    for name in _FILES:
        path = directory / name
        try:
            data = read_regular_file(path, max_bytes=MAX_FILE_BYTES, what="pressure file")
            values.append(_some_avg10(data.decode("ascii")))
        except UnsafeFile as exc:
            raise UnusablePressure(path, exc.reason) from None
        except FileNotFoundError:
            raise UnusablePressure(
                path, "no such file (no PSI in this kernel)", missing=True
            ) from None
        except OSError as exc:  # e.g. EOPNOTSUPP where PSI is compiled in but disabled
            raise UnusablePressure(path, f"cannot read: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise UnusablePressure(path, "not ASCII text") from None
        except ValueError as exc:
            raise UnusablePressure(path, str(exc)) from None
    return Pressure(*values)


class PressureReader:
    """The latest pressure sample (``reader()``), kept fresh by ``run``; None without one."""

    def __init__(
        self,
        directory: Path = PRESSURE_DIR,
        *,
        clock: Callable[[], float] = time.monotonic,
        interval: float = SAMPLE_SECONDS,
        max_age: float = MAX_AGE_SECONDS,
    ) -> None:
        self.directory = directory
        self._clock = clock
        self._interval = interval
        self._max_age = max_age
        self._last: tuple[float, Pressure] | None = None  # (clock() when read, the sample)
        self.disabled = False  # PSI found missing or unusable: never read again

    def __call__(self) -> Pressure | None:
        """The latest sample if it is at most ``max_age`` old, else None. Reads no file: the
        worker calls it on the event loop when an attempt fails."""
        last = self._last
        if last is None or self._clock() - last[0] > self._max_age:
            return None
        return last[1]

    async def run(self) -> None:
        """Sample every ``interval`` seconds, each read in a worker thread (the loop's default
        executor), until cancelled; return after one log line once a read fails."""
        while not self.disabled:
            try:
                reading = await asyncio.to_thread(read_pressure, self.directory)
            except UnusablePressure as exc:
                self.disabled = True
                self._last = None
                if exc.missing:
                    log.info("node_pressure_disabled", file=str(exc.path), reason=exc.reason)
                else:
                    log.warning("node_pressure_disabled", file=str(exc.path), reason=exc.reason)
                return
            self._last = (self._clock(), reading)
            await asyncio.sleep(self._interval)
