"""What cri-prober remembers across its own restarts: each running container's started/ready state.

The kubelet keeps a container's previous ``started``/``ready`` from the pod status in the API
server when it restarts (KEP-4781, docs/kubelet-semantics.md §3.12); this small JSON state file
plays that part, so a container still starting keeps its startup probe gating after a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

# A state file holds a few dozen bytes per container; anything larger is not ours.
MAX_STATE_BYTES = 16 * 1024 * 1024
STATE_VERSION = 1
FLUSH_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class Remembered:
    """A container's derived state when the previous cri-prober last wrote it."""

    started: bool
    ready: bool


def load_state(path: Path) -> dict[str, Remembered]:
    """Read the state file; a missing, oversized or malformed file is an empty memory (logged)."""
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_STATE_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log.warning("state_file_unreadable", file=str(path), error=exc.strerror)
        return {}
    if len(data) > MAX_STATE_BYTES:
        log.warning("state_file_ignored", file=str(path), reason="larger than 16 MiB")
        return {}
    try:
        document = json.loads(data)
        if document.get("version") != STATE_VERSION:
            raise ValueError(f"version {document.get('version')!r}, expected {STATE_VERSION}")
        containers = document["containers"]
        return {
            str(container_id): Remembered(started=bool(entry[0]), ready=bool(entry[1]))
            for container_id, entry in containers.items()
        }
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        log.warning("state_file_ignored", file=str(path), reason=str(exc))
        return {}


def write_state(path: Path, state: Mapping[str, Remembered]) -> None:
    """Replace the state file atomically (write a sibling, then rename over it)."""
    document = {
        "version": STATE_VERSION,
        "containers": {cid: [r.started, r.ready] for cid, r in state.items()},
    }
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(document, separators=(",", ":")), encoding="utf-8")
    os.replace(temporary, path)


class StateWriter:
    """Writes the manager's state to the file at most once per ``FLUSH_SECONDS`` when it changed.

    Writing happens in a worker thread so the event loop never waits on the disk.
    """

    def __init__(self, path: Path, snapshot: Callable[[], dict[str, Remembered]]) -> None:
        self.path = path
        self._snapshot = snapshot
        self._dirty = asyncio.Event()
        self._failed = False

    def mark_dirty(self, _event: object = None) -> None:
        """Note that the state changed (cheap: call it on every manager event)."""
        self._dirty.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Flush changes until ``stop`` is set, then flush once more."""
        while not stop.is_set():
            dirty = asyncio.ensure_future(self._dirty.wait())
            stopping = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({dirty, stopping}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                dirty.cancel()
                stopping.cancel()
            if self._dirty.is_set():
                await self.flush()
                # At most one write per interval, however busy the node is.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), FLUSH_SECONDS)
        await self.flush()

    async def flush(self) -> None:
        """Write the current state now if it changed since the last write."""
        if not self._dirty.is_set():
            return
        self._dirty.clear()
        state = self._snapshot()
        try:
            await asyncio.to_thread(write_state, self.path, state)
        except OSError as exc:
            if not self._failed:  # say it once, not once per second
                log.warning("state_file_write_failed", file=str(self.path), error=exc.strerror)
            self._failed = True
            return
        if self._failed:
            log.info("state_file_written", file=str(self.path))
        self._failed = False


__all__ = ["Remembered", "StateWriter", "load_state", "write_state"]
