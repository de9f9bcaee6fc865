"""glibc's allocator, set for a long-running daemon: large blocks mapped on their own (so a
freed one goes back to the system at once) and freed heap pages given back; and what it holds
(``heap_stats``, for the benchmarks and tests).

glibc raises its mmap threshold each time a mapped block is freed, up to 32 MiB, so after a few
metrics expositions (pieces of a few hundred KB, made and freed every scrape) such blocks come
from the heap, whose freed middle glibc keeps: at 5,000 containers 38 MiB of free heap stayed
resident (docs/benchmarks.md §0). A fixed threshold (which also stops the raising) and a low
trim threshold cost a system call per large block, tens per scrape. Off glibc, nothing is done.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

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


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _load_mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return None
    function.restype = _MallInfo2
    return cast(Callable[[], _MallInfo2], function)


_MALLINFO2 = _load_mallinfo2()


@dataclass(frozen=True, slots=True)
class HeapStats:
    """What glibc's allocator holds now (``mallinfo2``), in bytes."""

    in_use: int  # allocated from its heaps
    free: int  # free inside its heaps (some of it may have been given back)
    mapped: int  # in blocks mapped on their own
    mapped_blocks: int


def heap_stats() -> HeapStats | None:
    """glibc's figures (2.33 and later), or None elsewhere: for benchmarks and tests."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return HeapStats(
        in_use=info.uordblks, free=info.fordblks, mapped=info.hblkhd, mapped_blocks=info.hblks
    )


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


__all__ = [
    "MMAP_THRESHOLD",
    "TRIM_THRESHOLD",
    "HeapStats",
    "give_back_free_pages",
    "heap_stats",
    "tune",
]
