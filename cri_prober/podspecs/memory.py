"""Handing memory back to the system after a big read.

A listing of a few tens of MB is read, decoded and dropped every poll. glibc keeps freed heap
memory for reuse and returns it only at the top of the heap (and raises its mmap threshold after
each big free, so later big buffers land in that heap too): without a trim, RSS stays at the
largest listing ever read.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

__all__ = ["give_back_memory"]


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    return trim


def give_back_memory() -> bool:
    """Return the allocator's free memory to the system (glibc's ``malloc_trim(0)``, every arena).

    Blocking for a few ms on a large heap: call it in a worker thread. Returns whether anything
    was given back (False also where the C library has no such call).
    """
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
