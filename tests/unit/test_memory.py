"""The state file that carries started/ready across cri-prober restarts (D5, KEP-4781)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cri_prober.manager import memory
from cri_prober.manager.memory import Remembered, StateWriter, load_state, write_state


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    state = {"a" * 64: Remembered(started=False, ready=False), "b": Remembered(True, True)}
    write_state(path, state)
    assert load_state(path) == state
    assert not (tmp_path / "state.json.tmp").exists()


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"\xff\xfe",
        b'{"version": 2, "containers": {}}',
        b'{"version": 1, "containers": []}',
        b'{"version": 1, "containers": {"a": 5}}',
        b"[]",
    ],
    ids=["malformed", "not-utf8", "other-version", "wrong-shape", "bad-entry", "not-object"],
)
def test_bad_file_is_an_empty_memory(tmp_path: Path, content: bytes) -> None:
    """A damaged file never stops the daemon: it starts with no memory (and logs why)."""
    path = tmp_path / "state.json"
    path.write_bytes(content)
    assert load_state(path) == {}


def test_missing_and_oversized(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_state(tmp_path / "absent.json") == {}
    path = tmp_path / "state.json"
    write_state(path, {"a": Remembered(True, False)})
    monkeypatch.setattr(memory, "MAX_STATE_BYTES", 10)
    assert load_state(path) == {}


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
    await asyncio.wait_for(written.wait(), 5)
    assert load_state(path) == current
    current["b"] = Remembered(False, False)
    writer.mark_dirty()
    stop.set()
    await asyncio.wait_for(task, 5)
    assert load_state(path) == current
    assert snapshots == 2


async def test_unwritable_path_is_logged_once(tmp_path: Path) -> None:
    writer = StateWriter(tmp_path / "missing-dir" / "state.json", dict)
    writer.mark_dirty()
    await writer.flush()
    writer.mark_dirty()
    await writer.flush()
    assert writer._failed
