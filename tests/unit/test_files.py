"""``cri_prober.files.read_regular_file``: a regular file, read whole, or a clear error at once."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from cri_prober.files import UnsafeFile, describe_size, read_regular_file

WHAT = "the test file"
# Refusing a file takes microseconds; a read that blocks (a FIFO opened without O_NONBLOCK
# waits for a writer that never comes) would take forever. This only tells the two apart.
PROMPT = 10.0


def promptly(call: Callable[[], bytes]) -> bytes | BaseException:
    """``call()``'s result or exception; fails if it has not returned within ``PROMPT`` s.

    A daemon thread, so a call that blocks for ever fails this test instead of hanging the run.
    """
    outcome: list[bytes | BaseException] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(PROMPT)
    assert not thread.is_alive(), "the read blocked"
    return outcome[0]


def refusal(path: Path, max_bytes: int = 1024) -> str:
    outcome = promptly(lambda: read_regular_file(path, max_bytes=max_bytes, what=WHAT))
    assert isinstance(outcome, UnsafeFile), outcome
    assert isinstance(outcome, OSError)  # callers catching OSError keep working
    message = str(outcome)
    assert message.startswith(f"{WHAT} {path}: ")
    assert "\n" not in message
    assert message == f"{WHAT} {path}: {outcome.reason}"
    return outcome.reason


def test_a_regular_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_bytes(b"x" * 1024)
    assert read_regular_file(path, max_bytes=1024, what=WHAT) == b"x" * 1024
    path.write_bytes(b"")
    assert read_regular_file(path, max_bytes=1024, what=WHAT) == b""


def test_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    """No writer ever opens it: a plain open() would wait for one for ever."""
    path = tmp_path / "fifo"
    os.mkfifo(path)
    assert refusal(path) == "not a regular file (a FIFO)"


def test_a_directory_is_refused(tmp_path: Path) -> None:
    assert refusal(tmp_path) == "not a regular file (a directory)"


def test_a_character_device_is_refused() -> None:
    """/dev/zero would otherwise be read up to the cap (or forever, by a reader without one)."""
    assert refusal(Path("/dev/zero")) == "not a regular file (a character device)"


def test_a_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        # open() of a socket fails with ENXIO before any fstat: an OSError, not a hang.
        outcome = promptly(lambda: read_regular_file(path, max_bytes=10, what=WHAT))
    assert isinstance(outcome, OSError)


def test_an_oversized_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big"
    path.write_bytes(b"x" * (1024 * 1024 + 1))
    assert refusal(path, max_bytes=1024 * 1024) == "larger than 1 MiB (1048577 bytes)"
    # Exactly at the cap is fine.
    path.write_bytes(b"x" * 1024)
    assert read_regular_file(path, max_bytes=1024, what=WHAT) == b"x" * 1024


def test_a_file_longer_than_its_size_says_is_refused() -> None:
    """/proc files report size 0 and read longer: only max_bytes + 1 bytes are ever read."""
    assert refusal(Path("/proc/self/status"), max_bytes=16) == (
        "larger than 16 bytes (it grew while being read)"
    )


def test_a_symlink_to_a_regular_file_is_read(tmp_path: Path) -> None:
    """Kubernetes projects token and secret files through symlinks: they are followed."""
    target = tmp_path / "..data" / "token"
    target.parent.mkdir()
    target.write_bytes(b"secret")
    link = tmp_path / "token"
    link.symlink_to(target)
    assert read_regular_file(link, max_bytes=64, what=WHAT) == b"secret"


def test_a_symlink_to_a_fifo_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    link.symlink_to(fifo)
    assert refusal(link) == "not a regular file (a FIFO)"


def test_missing_and_unreadable_files_raise_the_usual_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_regular_file(tmp_path / "absent", max_bytes=10, what=WHAT)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "absent")
    with pytest.raises(FileNotFoundError):
        read_regular_file(dangling, max_bytes=10, what=WHAT)


@pytest.mark.parametrize(
    ("size", "text"),
    [(1, "1 byte"), (1000, "1000 bytes"), (1024, "1 KiB"), (1536, "1536 bytes"),
     (64 * 1024, "64 KiB"), (1024 * 1024, "1 MiB"), (3 * 1024 * 1024, "3 MiB")],
)  # fmt: skip
def test_sizes_read_as_an_operator_would(size: int, text: str) -> None:
    assert describe_size(size) == text
