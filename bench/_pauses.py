"""Where the event loop's pauses come from: a thread samples the loop thread's stack while the
loop is late, and garbage collections are timed beside it, so each pause is told by what ran.

The loop beats every few ms (a ``call_later`` chain); a watcher thread wakes as often and,
when the last beat is older than the threshold, takes the loop thread's current frame
(``sys._current_frames``, which needs the GIL: during a collection, which holds it all along,
no sample is taken, and the collection's own timing says so).
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from types import FrameType

# Frames from these places are the loop's own plumbing: a sample is told by the innermost
# frame outside them (and the innermost frame of all, when it is inside them).
_PLUMBING = ("/asyncio/", "/uvloop/", "/contextlib.py", "/threading.py", "/selectors.py")


@dataclass
class Pause:
    """One stretch of time the loop did not beat: when (monotonic), how long, what ran."""

    started: float
    seconds: float = 0.0
    where: Counter[str] = field(default_factory=Counter)
    collections: list[tuple[int, float]] = field(default_factory=list)  # (generation, s)


def _place(frame: FrameType | None) -> str:
    """The innermost frame of ours (or a library's) on ``frame``'s stack, as path:function."""
    innermost = None
    while frame is not None:
        path = frame.f_code.co_filename
        name = f"{_short(path)}:{frame.f_code.co_name}"
        innermost = innermost or name
        if not any(part in path for part in _PLUMBING):
            return name
        frame = frame.f_back
    return innermost or "?"


def _short(path: str) -> str:
    for marker in ("/cri_prober/", "/bench/", "/site-packages/", "/lib/python3"):
        if marker in path:
            return path[path.index(marker) + 1 :]
    return path


class PauseSampler:
    """Samples the loop thread while the loop is later than ``threshold``; keeps every pause.

    Start it on the loop (``start()``), stop it there (``stop()``); ``pauses`` then holds each
    pause longer than the threshold, with the places sampled in it and the collections that
    ended in it."""

    def __init__(self, threshold: float = 0.03, every: float = 0.002) -> None:
        self.threshold = threshold
        self.every = every
        self.pauses: list[Pause] = []
        self._beat = time.monotonic()
        self._handle: asyncio.TimerHandle | None = None
        self._loop_thread = threading.get_ident()
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="pause-sampler", daemon=True)
        self._current: Pause | None = None
        # Reentrant: a collection can start on the loop thread while it holds the lock.
        self._lock = threading.RLock()
        self._gc_started = 0.0

    def start(self) -> None:
        self._loop_thread = threading.get_ident()
        self._beat = time.monotonic()
        self._schedule()
        gc.callbacks.append(self._collection)
        self._watcher.start()

    def stop(self) -> None:
        self._stopping.set()
        self._watcher.join()
        gc.callbacks.remove(self._collection)
        if self._handle is not None:
            self._handle.cancel()

    def _schedule(self) -> None:
        self._handle = asyncio.get_running_loop().call_later(self.every, self._on_beat)

    def _on_beat(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._beat = now
            if self._current is not None:
                self._current.seconds = now - self._current.started
                self.pauses.append(self._current)
                self._current = None
        self._schedule()

    def _collection(self, phase: str, info: dict[str, int]) -> None:
        if threading.get_ident() != self._loop_thread:
            return
        if phase == "start":
            self._gc_started = time.monotonic()
            return
        now = time.monotonic()
        with self._lock:
            # The watcher cannot run during a collection (it holds the GIL): open the pause.
            if self._current is None and now - self._beat > self.threshold:
                self._current = Pause(started=self._beat + self.every)
            if self._current is not None:
                self._current.collections.append((info["generation"], now - self._gc_started))

    def _watch(self) -> None:
        frames = sys._current_frames
        while not self._stopping.wait(self.every):
            with self._lock:
                late = time.monotonic() - self._beat
                if late <= self.threshold + self.every:
                    continue
                if self._current is None:
                    self._current = Pause(started=self._beat + self.every)
                self._current.where[_place(frames().get(self._loop_thread))] += 1

    def report(self, top: int = 12) -> list[list[str]]:
        """Rows for a table: the places that ran during pauses, by the pause time they were
        sampled in, and the collections' share."""
        if not self.pauses:
            return []
        total = sum(pause.seconds for pause in self.pauses)
        by_place: dict[str, float] = {}  # place -> seconds
        for pause in self.pauses:
            samples = sum(pause.where.values())
            collected = sum(seconds for _generation, seconds in pause.collections)
            rest = max(pause.seconds - collected, 0.0)
            for place, count in pause.where.items():
                by_place[place] = by_place.get(place, 0.0) + rest * count / samples
            if not samples:
                by_place["(no sample)"] = by_place.get("(no sample)", 0.0) + rest
            for generation, seconds in pause.collections:
                name = f"(garbage collection, generation {generation})"
                by_place[name] = by_place.get(name, 0.0) + seconds
        return [
            [place, f"{1000 * seconds:.0f}", f"{100 * seconds / total:.1f}"]
            for place, seconds in sorted(by_place.items(), key=lambda item: -item[1])[:top]
        ]

    def longest(self, count: int = 8) -> list[list[str]]:
        """Rows for a table: the longest pauses, each with what was sampled most in it."""
        rows = []
        for pause in sorted(self.pauses, key=lambda pause: -pause.seconds)[:count]:
            places = ", ".join(f"{place} ×{n}" for place, n in pause.where.most_common(3))
            collections = ", ".join(
                f"gen {generation} {1000 * seconds:.0f} ms"
                for generation, seconds in pause.collections
            )
            rows.append([f"{1000 * pause.seconds:.0f}", collections or "–", places or "–"])
        return rows


__all__ = ["Pause", "PauseSampler"]
