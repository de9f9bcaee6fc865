"""The state file that carries started/ready across cri-prober restarts (D5, KEP-4781).

A damaged or hostile file is one ``state_file_ignored`` line and an empty memory, never a hang or
a crash; writing never follows a link planted in the directory (issue 21, item 5).
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import threading
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from cri_prober.manager import memory
from cri_prober.manager.memory import (
    MAX_STATE_BYTES,
    Remembered,
    StateWriter,
    load_state,
    remove_stale_temporaries,
    write_state,
)
from tests.support.waiting import HANG_GUARD

DEEP = 100_000
# Loading a refused file takes microseconds; a FIFO opened for reading without O_NONBLOCK would
# wait for a writer for ever. Only tells the two apart.
PROMPT = 10.0


def load_logged(path: Path) -> tuple[dict[str, Remembered], list[MutableMapping[str, Any]]]:
    """load_state(path) from a daemon thread (a blocked open fails the test instead of hanging
    it), with what it logged."""
    outcome: list[dict[str, Remembered] | BaseException] = []

    def run() -> None:
        try:
            outcome.append(load_state(path))
        except BaseException as exc:
            outcome.append(exc)

    with capture_logs() as logs:
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(PROMPT)
    assert not thread.is_alive(), "load_state blocked"
    [result] = outcome
    if isinstance(result, BaseException):
        raise AssertionError(f"load_state raised {type(result).__name__}") from result
    return result, logs


def assert_ignored_once(path: Path, reason: str | None = None) -> str:
    """Loading ``path`` gives an empty memory and exactly one state_file_ignored line."""
    state, logs = load_logged(path)
    assert state == {}
    [line] = logs
    assert line["event"] == "state_file_ignored"
    assert line["log_level"] == "warning"
    assert line["file"] == str(path)
    assert len(line["reason"]) <= memory.MAX_REASON_CHARS + 1
    assert "\n" not in line["reason"]
    if reason is not None:
        assert line["reason"] == reason
    return str(line["reason"])


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    state = {"a" * 64: Remembered(started=False, ready=False), "b": Remembered(True, True)}
    write_state(path, state)
    assert load_state(path) == state
    assert os.listdir(tmp_path) == ["state.json"]  # no temporary file left behind
    # Readable by root only (it says which containers run on the node).
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_held_failures_round_trip_and_stay_out_of_files_without_one(tmp_path: Path) -> None:
    """Issue 34: the containers whose liveness failure is held are kept in ``held``, written
    only when there is one, so a file without stays as older versions read it."""
    path = tmp_path / "state.json"
    plain = {"a": Remembered(started=True, ready=False)}
    write_state(path, plain)
    assert b"held" not in path.read_bytes()
    assert load_state(path) == plain
    held = {**plain, "b": Remembered(started=True, ready=True, held=True)}
    write_state(path, held)
    assert load_state(path) == held
    # Held but left out of "containers" (started and ready, trimmed from a full file).
    path.write_bytes(b'{"version": 1, "containers": {}, "held": ["c"]}')
    assert load_state(path) == {"c": Remembered(started=True, ready=True, held=True)}


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"\xff\xfe",
        b'{"version": 1, "containers": {"\xff": [true, true]}}',
        b"",
        b'{"version": 2, "containers": {}}',
        b'{"version": "1", "containers": {}}',
        b'{"version": true, "containers": {}}',
        b'{"version": 1}',
        b'{"version": 1, "containers": []}',
        b'{"version": 1, "containers": {"a": 5}}',
        b'{"version": 1, "containers": {"a": [1, 0]}}',
        b'{"version": 1, "containers": {"a": ["yes", ""]}}',
        b'{"version": 1, "containers": {"a": [true]}}',
        b'{"version": 1, "containers": {"a": [true, false, true]}}',
        b'{"version": 1, "containers": {"a": {"0": true, "1": false}}}',
        b'{"version": 1, "containers": {}, "more": 1}',
        b'{"version": 1, "containers": {}} trailing',
        b"[]",
        b"null",
    ],
    ids=[
        "malformed",
        "not-utf8",
        "not-utf8-key",
        "empty",
        "other-version",
        "version-string",
        "version-bool",
        "no-containers",
        "wrong-shape",
        "bad-entry",
        "entry-numbers",
        "entry-strings",
        "entry-short",
        "entry-long",
        "entry-object",
        "unknown-field",
        "trailing",
        "not-object",
        "null",
    ],
)
def test_bad_file_is_an_empty_memory(tmp_path: Path, content: bytes) -> None:
    """A damaged file never stops the daemon: it starts with no memory and logs why, once."""
    path = tmp_path / "state.json"
    path.write_bytes(content)
    assert_ignored_once(path)


def test_other_version_says_so(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(b'{"version": 2, "containers": {}}')
    assert_ignored_once(path, "version 2, expected 1")


@pytest.mark.parametrize(
    "content",
    [
        b"[" * DEEP + b"]" * DEEP,
        b'{"version": 1, "containers": {"a": ' + b"[" * DEEP + b"]" * DEEP + b"}}",
        b'{"version": 1, "containers": {}, "x": ' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}",
        b'{"x": ' + b"[" * DEEP + b"]" * DEEP + b', "version": 1, "containers": {}}',
        b"[" * DEEP,
    ],
    ids=["top-level", "in-an-entry", "unknown-field-last", "unknown-field-first", "unclosed"],
)
def test_deep_nesting_is_ignored_not_raised(tmp_path: Path, content: bytes) -> None:
    """100,000 levels: once a RecursionError out of json.loads that stopped serve at every start."""
    path = tmp_path / "state.json"
    path.write_bytes(content)
    assert_ignored_once(path)


def test_a_fifo_at_the_path_is_ignored_at_once(tmp_path: Path) -> None:
    """No writer ever opens it: opening it for reading used to wait for one, and serve with it."""
    path = tmp_path / "state.json"
    os.mkfifo(path)
    assert_ignored_once(path, "not a regular file (a FIFO)")


def test_a_directory_or_device_at_the_path_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.mkdir()
    assert_ignored_once(path, "not a regular file (a directory)")
    path.rmdir()
    path.symlink_to("/dev/zero")
    assert_ignored_once(path, "not a regular file (a character device)")


def test_an_oversized_file_is_ignored(tmp_path: Path) -> None:
    """Even a valid one: the cap (1 MiB) is far above any node's containers (81 bytes each)."""
    path = tmp_path / "state.json"
    entries = {f"{i:064x}": [True, False] for i in range(MAX_STATE_BYTES // 80)}
    path.write_text(json.dumps({"version": 1, "containers": entries}, separators=(",", ":")))
    assert path.stat().st_size > MAX_STATE_BYTES
    reason = assert_ignored_once(path)
    assert reason.startswith("larger than 1 MiB")
    assert MAX_STATE_BYTES == 1024 * 1024


def test_missing_file_is_an_empty_memory_without_a_word(tmp_path: Path) -> None:
    state, logs = load_logged(tmp_path / "absent.json")
    assert state == {}
    assert logs == []


def test_an_entry_is_at_most_81_bytes_so_the_cap_holds_12900_containers(tmp_path: Path) -> None:
    """The figure behind MAX_STATE_BYTES: containerd IDs are 64 hex digits."""
    path = tmp_path / "state.json"
    count = 12_900
    state = {f"{i:064x}": Remembered(False, False) for i in range(count)}
    write_state(path, state)
    size = path.stat().st_size
    assert size <= MAX_STATE_BYTES
    assert (size - len('{"version":1,"containers":{}}')) / count <= 81
    assert load_state(path) == state


def test_too_many_containers_leave_out_the_started_and_ready_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Having no entry means started and ready: those are dropped first when the cap is near."""
    path = tmp_path / "state.json"
    monkeypatch.setattr(memory, "MAX_STATE_BYTES", 200)
    state = {f"up-{i}": Remembered(True, True) for i in range(10)}
    state["starting"] = Remembered(False, False)
    state["unready"] = Remembered(True, False)
    write_state(path, state)
    assert path.stat().st_size <= 200
    assert load_state(path) == {"starting": state["starting"], "unready": state["unready"]}
    too_many = {f"starting-{i}": Remembered(False, False) for i in range(10)}
    with pytest.raises(ValueError, match="more than the 200 bytes a state file may hold"):
        write_state(path, too_many)
    assert load_state(path) == {"starting": state["starting"], "unready": state["unready"]}
    assert os.listdir(tmp_path) == ["state.json"]


# Names a writer might predictably use; the old one was state.json.tmp.
PREDICTABLE = ["state.json.tmp", ".state.json.tmp", "state.json.new", "state.json~", ".state.json"]


def test_a_planted_link_is_never_written_through(tmp_path: Path) -> None:
    """Links at the old temporary name (and other guessable ones) point at a file root must not
    write; the state file itself may be a planted link too: it is replaced, not followed."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    directory = tmp_path / "run"
    directory.mkdir()
    for name in [*PREDICTABLE, "state.json"]:
        (directory / name).symlink_to(victim)
    path = directory / "state.json"
    for i in range(20):
        write_state(path, {f"c{i}": Remembered(False, True)})
    assert victim.read_bytes() == b"precious"
    assert not path.is_symlink()
    assert stat.S_ISREG(path.lstat().st_mode)
    assert load_state(path) == {"c19": Remembered(False, True)}
    for name in PREDICTABLE:
        assert (directory / name).is_symlink()  # left alone, not replaced or followed


def test_a_crash_left_temporary_file_blocks_nothing(tmp_path: Path) -> None:
    """A writer that died between creating its file and renaming it leaves the file behind: the
    next write goes to a new name, and the writer removes leftovers old enough to be dead."""
    path = tmp_path / "state.json"
    old = time.time() - 3600
    leftovers = [tmp_path / ".state.json.abcd1234", tmp_path / "state.json.tmp"]
    for leftover in leftovers:
        leftover.write_text("{half a write")
        os.utime(leftover, (old, old))
    os.chmod(leftovers[0], 0o400)
    write_state(path, {"a": Remembered(True, False)})
    assert load_state(path) == {"a": Remembered(True, False)}

    fresh = tmp_path / ".state.json.inflight"  # another writer's, still in progress
    fresh.write_text("{")
    (tmp_path / ".state.json.dir").mkdir()
    remove_stale_temporaries(path)
    assert not leftovers[0].exists()
    assert leftovers[1].exists()  # not a name this module creates: not ours to delete
    assert fresh.exists()
    assert (tmp_path / ".state.json.dir").is_dir()
    assert load_state(path) == {"a": Remembered(True, False)}


async def test_the_writer_sweeps_leftovers_before_its_first_write(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    leftover = tmp_path / ".state.json.x1y2z3"
    leftover.write_text("{")
    old = time.time() - 3600
    os.utime(leftover, (old, old))
    writer = StateWriter(path, lambda: {"a": Remembered(False, False)})
    writer.mark_dirty()
    await writer.flush()
    assert sorted(os.listdir(tmp_path)) == ["state.json"]
    assert load_state(path) == {"a": Remembered(False, False)}


async def test_writer_coalesces_and_flushes_on_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many changes within one interval make one write; stopping writes the last state."""
    monkeypatch.setattr(memory, "FLUSH_SECONDS", 0.2)
    path = tmp_path / "state.json"
    current = {"a": Remembered(True, True)}
    snapshots = 0

    def snapshot() -> dict[str, Remembered]:
        nonlocal snapshots
        snapshots += 1
        return dict(current)

    loop = asyncio.get_running_loop()
    written = asyncio.Event()

    def write_and_tell(target: Path, state: dict[str, Remembered]) -> None:
        write_state(target, state)  # runs in a worker thread
        loop.call_soon_threadsafe(written.set)

    monkeypatch.setattr(memory, "write_state", write_and_tell)
    writer = StateWriter(path, snapshot)
    stop = asyncio.Event()
    task = asyncio.create_task(writer.run(stop))
    for _ in range(100):
        writer.mark_dirty()
    await asyncio.wait_for(written.wait(), HANG_GUARD)
    assert load_state(path) == current
    current["b"] = Remembered(False, False)
    writer.mark_dirty()
    stop.set()
    await asyncio.wait_for(task, HANG_GUARD)
    assert load_state(path) == current
    assert snapshots == 2


async def test_unwritable_path_is_logged_once(tmp_path: Path) -> None:
    writer = StateWriter(tmp_path / "missing-dir" / "state.json", dict)
    with capture_logs() as logs:
        for _ in range(3):
            writer.mark_dirty()
            await writer.flush()
    assert not (tmp_path / "missing-dir").exists()
    assert [line["event"] for line in logs] == ["state_file_write_failed"]


async def test_a_state_too_large_to_write_is_logged_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory, "MAX_STATE_BYTES", 100)
    state = {f"starting-{i}": Remembered(False, False) for i in range(10)}
    writer = StateWriter(tmp_path / "state.json", lambda: state)
    with capture_logs() as logs:
        for _ in range(3):
            writer.mark_dirty()
            await writer.flush()
    [line] = logs
    assert line["event"] == "state_file_write_failed"
    assert "more than the 100 bytes" in line["error"]
    assert os.listdir(tmp_path) == []


async def test_the_last_write_at_shutdown_waits_a_bounded_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that hangs must not hold up SIGTERM: the final flush gives up (logged) after
    FINAL_FLUSH_SECONDS and leaves the thread behind (serve's own threads end with it)."""
    monkeypatch.setattr(memory, "FINAL_FLUSH_SECONDS", 0.2)
    release = threading.Event()

    def hung_disk(_path: Path, _state: object) -> None:
        release.wait()

    monkeypatch.setattr(memory, "write_state", hung_disk)
    writer = StateWriter(tmp_path / "state.json", lambda: {"a": Remembered(True, True)})
    stop = asyncio.Event()
    stop.set()
    writer.mark_dirty()
    try:
        with capture_logs() as logs:
            await asyncio.wait_for(writer.run(stop), PROMPT)
        [line] = logs
        assert line["event"] == "state_file_write_failed"
        assert line["error"] == "still writing after 0.2 s at shutdown"
    finally:
        release.set()  # the test process's own executor thread must end
