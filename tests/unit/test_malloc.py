"""cri_prober.malloc: serve's allocator settings take effect (glibc)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cri_prober import malloc

# Run in a fresh process: in this one, earlier tests may have left a free chunk in the heap
# big enough for the block below, and glibc serves a request from its free chunks before it
# weighs the mmap threshold at all.
_PROGRAM = """
import ctypes, sys
from cri_prober import malloc
tune = sys.argv[1] == "tune"
if tune:
    assert malloc.tune()
first = ctypes.create_string_buffer(16 << 20)
del first  # without tune(): glibc's threshold is 16 MiB from here
before = malloc.heap_stats().mapped_blocks
second = ctypes.create_string_buffer(12 << 20)
during = malloc.heap_stats().mapped_blocks
del second
after = malloc.heap_stats().mapped_blocks
malloc.give_back_free_pages()  # safe to call at any time
print(during - before, after - before)
"""


def _mapped_blocks_added(mode: str) -> tuple[int, int]:
    """(mapped blocks the 12 MiB block added, and left after it was freed) in a fresh process."""
    # glibc's own settings from the environment (MALLOC_*_) would change what is measured.
    env = {name: value for name, value in os.environ.items() if not name.startswith("MALLOC_")}
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM, mode],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    during, after = done.stdout.split()
    return int(during), int(after)


def test_large_blocks_stay_mapped_after_a_large_one_is_freed() -> None:
    """glibc raises its mmap threshold to the size of each mapped block freed (up to 32 MiB),
    so after an exposition's multi-MB pieces the next ones came from the heap, whose holes
    stayed resident. After ``tune()`` the threshold is fixed: a 12 MiB block after a freed
    16 MiB one is still mapped on its own, and its pages go back as soon as it is freed.
    Without ``tune()`` the same block comes from the heap."""
    if malloc.heap_stats() is None:
        pytest.skip("not glibc 2.33 or later: no mallinfo2 to check with")
    assert _mapped_blocks_added("tune") == (1, 0)
    assert _mapped_blocks_added("default") == (0, 0)
