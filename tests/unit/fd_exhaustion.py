"""Run a block of a test with this process out of file descriptors (a real EMFILE).

The soft RLIMIT_NOFILE goes down to just above the descriptors open now, and what is left below
it is filled with /dev/null, so the next socket() fails in the kernel exactly as it does when a
flood of connections has used up serve's descriptors. Both are undone on exit.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
from collections.abc import Iterator

# Room for the few descriptors a test opens before the block (and the fills' own headroom).
_HEADROOM = 16


@contextlib.contextmanager
def out_of_descriptors() -> Iterator[None]:
    """Inside the block, every new descriptor fails with EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + _HEADROOM, hard))
    fills: list[int] = []
    try:
        while True:
            try:
                fills.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as exc:
                if exc.errno != errno.EMFILE:
                    raise
                break
        yield
    finally:
        for fd in fills:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
