"""glibc's allocator, set for a long-running daemon: large blocks mapped on their own (so a
freed one goes back to the system at once) and freed heap pages given back.

glibc raises its mmap threshold each time a mapped block is freed, up to 32 MiB, so after a few
metrics expositions (pieces of a few hundred KB, made and freed every scrape) such blocks come
from the heap, whose freed middle glibc keeps: at 5,000 containers 38 MiB of free heap stayed
resident (docs/benchmarks.md §0). A fixed threshold (which also stops the raising) and a low
trim threshold cost a system call per large block, tens per scrape. Off glibc, nothing is done.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks from this size up are mapped on their own; free heap above this much at its top is
# given back.
MMAP_THRESHOLD = 64 * 1024
TRIM_THRESHOLD = 128 * 1024


def _libc_function(name: str) -> Callable[..., int] | None:
    try:
        function: Callable[..., int] = getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        return None
    return function


_MALLOPT = _libc_function("mallopt")
_MALLOC_TRIM = _libc_function("malloc_trim")


def tune() -> bool:
    """Set the thresholds above; False where the C library is not glibc."""
    if _MALLOPT is None:
        return False
    mapped = _MALLOPT(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    trimmed = _MALLOPT(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return bool(mapped and trimmed)


def give_back_free_pages() -> None:
    """Return the free pages inside every heap to the system (``malloc_trim``): milliseconds;
    call it from a worker thread after freeing much at once."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "give_back_free_pages", "tune"]
