"""What cri-prober remembers across its own restarts: each running container's started/ready state,
and which containers' liveness failure is held.

The kubelet keeps a container's previous ``started``/``ready`` from the pod status in the API
server when it restarts (KEP-4781, docs/kubelet-semantics.md §3.12); this small JSON state file
plays that part, so a container still starting keeps its startup probe gating after a restart. A
held liveness failure is kept too: the kubelet that acts on it does not restart with cri-prober,
and its worker holds until the container is replaced (issue 34).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog

from cri_prober.files import UnsafeFile, describe_size, read_regular_file
from cri_prober.probing.outcome import shorten

log = structlog.get_logger(__name__)

# An entry is at most 81 bytes as written ("<64-hex ID>":[false,false],), so 1 MiB holds about
# 12,900 containers: over 100 times the kubelet's default --max-pods (110) and more than the
# 10,000 containers of the largest scale benchmark. Anything larger is not ours; a node with more
# containers still gets a file (see _encode).
MAX_STATE_BYTES = 1024 * 1024
STATE_VERSION = 1
FLUSH_SECONDS = 1.0
# The last write at shutdown waits this long at most: a disk that hangs must not hold up SIGTERM
# (a write of at most 1 MiB and its fsync normally take milliseconds).
FINAL_FLUSH_SECONDS = 2.0
# A reason quotes at most this much of the file (an unknown field's name, say).
MAX_REASON_CHARS = 200
# Temporary files are created beside the state file under an unpredictable name; one older than
# this was left by a writer that crashed (a live one renames its file within milliseconds).
STALE_TEMPORARY_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class Remembered:
    """A container's derived state when the previous cri-prober last wrote it."""

    started: bool
    ready: bool
    # Its liveness failure was published and held (the container not replaced since).
    held: bool = False


# Eight values in all: every entry of a large file shares them.
_REMEMBERED = {
    (s, r, h): Remembered(started=s, ready=r, held=h)
    for s in (False, True)
    for r in (False, True)
    for h in (False, True)
}


class _StateDocument(msgspec.Struct, forbid_unknown_fields=True):
    """The file's shape. Typed decoding checks each value as it is parsed, so a wrongly shaped
    or deeply nested document fails at its first wrong token instead of being built in memory
    (and an unknown field is refused before its value is read: nothing is skipped recursively)."""

    version: int
    containers: dict[str, tuple[bool, bool]]
    # The containers whose liveness failure is held; written only when there is one, so a file
    # without stays readable by versions that do not know the field.
    held: list[str] = msgspec.field(default_factory=list)


def _temporary_prefix(path: Path) -> str:
    return f".{path.name}."


def load_state(path: Path) -> dict[str, Remembered]:
    """Read the state file. A missing file is an empty memory; so is a damaged one, logged once
    as ``state_file_ignored`` (not a regular file, too large, malformed, of the wrong shape or
    version, unreadable): it never stops the daemon from starting.
    """
    try:
        data = read_regular_file(path, max_bytes=MAX_STATE_BYTES, what="the state file")
    except FileNotFoundError:
        return {}
    except UnsafeFile as exc:
        return _ignored(path, exc.reason)
    except OSError as exc:
        return _ignored(path, f"cannot read: {exc.strerror or exc}")
    try:
        document = msgspec.json.decode(data, type=_StateDocument)
    # ValidationError is a DecodeError; invalid UTF-8 in a string is a UnicodeDecodeError. Typed
    # decoding leaves no way to nest deeply, but a RecursionError would also only mean "ignore".
    except (ValueError, RecursionError) as exc:
        return _ignored(path, str(exc) or type(exc).__name__)
    if document.version != STATE_VERSION:
        return _ignored(path, f"version {document.version}, expected {STATE_VERSION}")
    held = set(document.held)
    remembered = {
        cid: _REMEMBERED[(*entry, cid in held)] for cid, entry in document.containers.items()
    }
    for cid in held - remembered.keys():  # left out of "containers" as started and ready
        remembered[cid] = _REMEMBERED[(True, True, True)]
    return remembered


def _ignored(path: Path, reason: str) -> dict[str, Remembered]:
    log.warning("state_file_ignored", file=str(path), reason=shorten(reason, MAX_REASON_CHARS))
    return {}


def _encode(state: Mapping[str, Remembered]) -> bytes:
    """The file's bytes, at most ``MAX_STATE_BYTES`` long.

    Beyond that, containers both started and ready are left out: having no entry means the same
    (the default for a container the file does not list).

    Raises:
        ValueError: even the containers not started or not ready take more than the limit.
    """
    entries = {cid: (r.started, r.ready) for cid, r in state.items()}
    document: dict[str, object] = {"version": STATE_VERSION, "containers": entries}
    held = [cid for cid, r in state.items() if r.held]
    if held:
        document["held"] = held
    data = msgspec.json.encode(document)
    if len(data) <= MAX_STATE_BYTES:
        return data
    kept = {cid: entry for cid, entry in entries.items() if entry != (True, True)}
    document["containers"] = kept
    data = msgspec.json.encode(document)
    if len(data) > MAX_STATE_BYTES:
        raise ValueError(
            f"{len(kept)} containers not started or not ready need {len(data)} bytes, more than "
            f"the {describe_size(MAX_STATE_BYTES)} a state file may hold"
        )
    return data


def write_state(path: Path, state: Mapping[str, Remembered]) -> None:
    """Replace the state file atomically: write a new file beside it, then rename it over.

    The new file is created exclusively (O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600) under an
    unpredictable name, so nothing planted in the directory is ever written through, and a file
    left by a crash never blocks the next write. It is synced before the rename, so the file is
    always either the old or the new state, never a torn one.

    Raises:
        OSError: the directory cannot be written.
        ValueError: the state does not fit in ``MAX_STATE_BYTES``.
    """
    # Imported here: a serve with --state-file none writes none (issue 36, idle RSS).
    import tempfile

    data = _encode(state)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=_temporary_prefix(path))
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def remove_stale_temporaries(path: Path) -> None:
    """Delete the temporary files a crashed writer left beside the state file.

    Only names this module creates, never a directory (unlinking a link never touches its
    target), and only those older than ``STALE_TEMPORARY_SECONDS``, so another process's write
    in progress is left alone. Best effort: errors are ignored.
    """
    now = time.time()
    prefix = _temporary_prefix(path)
    with contextlib.suppress(OSError), os.scandir(path.parent) as entries:
        for entry in entries:
            if not entry.name.startswith(prefix) or entry.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(OSError):
                if now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMPORARY_SECONDS:
                    os.unlink(entry.path)


class StateWriter:
    """Writes the manager's state to the file at most once per ``FLUSH_SECONDS`` when it changed.

    Writing happens in a worker thread so the event loop never waits on the disk.
    """

    def __init__(self, path: Path, snapshot: Callable[[], dict[str, Remembered]]) -> None:
        self.path = path
        self._snapshot = snapshot
        self._dirty = asyncio.Event()
        self._failed = False
        self._swept = False  # crash leftovers removed (once, before the first write)

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
        try:
            await asyncio.wait_for(self.flush(), FINAL_FLUSH_SECONDS)
        except TimeoutError:
            log.warning(
                "state_file_write_failed",
                file=str(self.path),
                error=f"still writing after {FINAL_FLUSH_SECONDS:g} s at shutdown",
            )

    async def flush(self) -> None:
        """Write the current state now if it changed since the last write."""
        if not self._dirty.is_set():
            return
        self._dirty.clear()
        state = self._snapshot()
        try:
            await asyncio.to_thread(self._write, state)
        except (OSError, ValueError) as exc:
            if not self._failed:  # say it once, not once per second
                error = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                log.warning("state_file_write_failed", file=str(self.path), error=error)
            self._failed = True
            return
        if self._failed:
            log.info("state_file_written", file=str(self.path))
        self._failed = False

    def _write(self, state: Mapping[str, Remembered]) -> None:
        if not self._swept:
            self._swept = True
            remove_stale_temporaries(self.path)
        write_state(self.path, state)


__all__ = [
    "MAX_STATE_BYTES",
    "Remembered",
    "StateWriter",
    "load_state",
    "remove_stale_temporaries",
    "write_state",
]
