"""Reading small files that someone else may have replaced: only a regular file, only so much.

``read_regular_file`` never blocks on a FIFO or device put where a file was expected and never
reads more than its cap, so a hostile or damaged file is an ``UnsafeFile`` error, not a hang.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from cri_prober.errors import CriProberError

_KIB = 1024
_MIB = 1024 * _KIB

# The open flags: O_NONBLOCK makes opening a FIFO (with no writer) return at once instead of
# waiting for a writer forever; it has no effect on a regular file's reads. Symlinks are followed:
# Kubernetes projects its token and secret files through them.
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class UnsafeFile(CriProberError, OSError):
    """A file that is not a regular file, or larger than its reader accepts.

    An ``OSError``, so code that handles a file it cannot read handles this one too.
    ``str(exc)`` is one line for an operator: what the file is, its path and the rule broken;
    ``reason`` is the rule alone (for a structured log field); ``too_large`` says which rule,
    with the file's ``size`` when it was known before reading (None if it grew while read).
    """

    def __init__(
        self,
        what: str,
        path: Path,
        reason: str,
        *,
        too_large: bool = False,
        size: int | None = None,
    ) -> None:
        super().__init__(f"{what} {path}: {reason}")
        self.path = path
        self.reason = reason
        self.too_large = too_large
        self.size = size


def describe_size(size: int) -> str:
    """A byte count as an operator reads it: ``1 MiB``, ``64 KiB``, ``100 bytes``."""
    if size >= _MIB and size % _MIB == 0:
        return f"{size // _MIB} MiB"
    if size >= _KIB and size % _KIB == 0:
        return f"{size // _KIB} KiB"
    return "1 byte" if size == 1 else f"{size} bytes"


def file_kind(mode: int) -> str:
    """What a non-regular file is, from its ``st_mode``: ``a FIFO``, ``a directory``, ..."""
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((name for test, name in kinds if test(mode)), "not a file")


def read_regular_file(path: Path, *, max_bytes: int, what: str) -> bytes:
    """The contents of the regular file at ``path`` (symlinks followed), at most ``max_bytes``.

    The type is checked on the open descriptor, so nothing can be swapped in between the check
    and the read; at most ``max_bytes + 1`` bytes are read, so a file that grows while it is read
    (or whose size lies, as in /proc) is refused too. ``what`` names the file in the error, e.g.
    ``"the kubelet token file"``. Blocking on a slow disk: call it from a worker thread.

    Raises:
        UnsafeFile: not a regular file (a FIFO, socket, device or directory), or too large.
        OSError: it cannot be opened or read (FileNotFoundError, PermissionError, ...).
    """
    fd = os.open(path, _OPEN_FLAGS)
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise UnsafeFile(what, path, f"not a regular file ({file_kind(status.st_mode)})")
        if status.st_size > max_bytes:
            raise UnsafeFile(
                what,
                path,
                f"larger than {describe_size(max_bytes)} ({describe_size(status.st_size)})",
                too_large=True,
                size=status.st_size,
            )
        chunks: list[bytes] = []
        left = max_bytes + 1
        while left > 0 and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    if left <= 0:
        grew = f"larger than {describe_size(max_bytes)} (it grew while being read)"
        raise UnsafeFile(what, path, grew, too_large=True)
    return b"".join(chunks)


__all__ = ["UnsafeFile", "describe_size", "file_kind", "read_regular_file"]
