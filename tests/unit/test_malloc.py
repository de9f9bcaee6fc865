"""cri_prober.malloc: serve's allocator settings take effect (glibc)."""

from __future__ import annotations

import ctypes

import pytest

from cri_prober import malloc


def _mapped_blocks() -> int:
    stats = malloc.heap_stats()
    if stats is None:
        pytest.skip("not glibc 2.33 or later: no mallinfo2 to check with")
    return stats.mapped_blocks


def test_large_blocks_stay_mapped_after_a_large_one_is_freed() -> None:
    """glibc raises its mmap threshold to the size of each mapped block freed (up to 32 MiB),
    so after an exposition's multi-MB pieces the next ones came from the heap, whose holes
    stayed resident. After ``tune()`` the threshold is fixed: a 12 MiB block after a freed
    16 MiB one is still mapped on its own, and its pages go back as soon as it is freed."""
    assert malloc.tune()
    first = ctypes.create_string_buffer(16 << 20)
    del first  # without tune(): the threshold is 16 MiB from here
    before = _mapped_blocks()
    second = ctypes.create_string_buffer(12 << 20)
    assert _mapped_blocks() == before + 1
    del second
    assert _mapped_blocks() == before
    malloc.give_back_free_pages()  # safe to call at any time
