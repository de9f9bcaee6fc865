"""What every pod spec source shares: the last good view of its pods, updated by full listings
or single changes, with bad pods and failed reads reported in rate-limited log lines while the
last good view is kept.

A source subclasses ``PodSource`` and implements ``run`` (``apiserver.py``), or ``PolledSource``
and implements ``poll`` (``kubelet.py``, ``manifests.py``): fetch, then
``replace_all``/``upsert``/``remove``, then ``succeeded`` or ``failed``. The registry reads
``pods`` and ``stale``.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

import structlog

from cri_prober.podspecs.model import PodOrigin, PodSpec, PodSpecError, parse_pod, pod_key

log = structlog.get_logger(__name__)

# The same problem (a source's read error, one pod's validation error) is logged again at most
# this often while it lasts; a change of text, or recovery, is logged at once.
REPEAT_LOG_SECONDS: Final = 300.0
# The longest error text a log line carries (validation messages quote the values they refuse).
ERROR_LOG_CHARS: Final = 2048

Changed = Callable[[], None]


@dataclass(frozen=True, slots=True)
class Prepared:
    """A raw pod object with its key and digest, computed off the loop by ``prepare``."""

    key: str | None
    digest: bytes
    obj: object


def prepare(items: Iterable[object]) -> list[Prepared]:
    """Key and digest every raw pod object of a listing.

    Pure, so a source can run it in a worker thread with the JSON decoding: the digests cost
    more than anything else a poll does on the loop when little changed (bench/podsources.py).
    """
    return [Prepared(pod_key(obj), _digest(obj), obj) for obj in items]


@dataclass(slots=True)
class _Entry:
    digest: bytes  # of the raw object, so an unchanged pod is not parsed again
    spec: PodSpec | None  # the last good parse; None if the pod never parsed


class LogOnce:
    """Logs a keyed problem when it first appears or changes, then once per REPEAT_LOG_SECONDS."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._last: dict[str, tuple[str, float]] = {}

    def should_log(self, key: str, text: str) -> bool:
        now = self._clock()
        last = self._last.get(key)
        if last is not None and last[0] == text and now - last[1] < REPEAT_LOG_SECONDS:
            return False
        self._last[key] = (text, now)
        return True

    def clear(self, key: str) -> bool:
        """Forget ``key``'s problem; True if there was one (so a recovery can be logged)."""
        return self._last.pop(key, None) is not None

    def keep_only(self, keys: Iterable[str]) -> None:
        """Forget the problems of every key not in ``keys`` (they left)."""
        wanted = set(keys)
        for key in self._last.keys() - wanted:
            del self._last[key]


class PodSource(abc.ABC):
    """One source of pod specs: its view of the node's pods and how fresh that view is.

    ``stale_after`` is how long without a good read before the view counts as stale: health
    ``""`` then reports NOT_SERVING (the view is still used; nothing running is dropped).
    """

    origin: PodOrigin = PodOrigin.API

    def __init__(
        self,
        name: str,
        *,
        stale_after: float,
        node_name: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.stale_after = stale_after
        self.node_name = node_name
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._pods: dict[str, PodSpec] = {}
        self._log = LogOnce(clock)
        self.last_success: float | None = None  # monotonic time of the last good read
        self.last_error: str | None = None  # the last read's error, None after a good read
        self.reads = 0
        self.read_errors = 0
        self.invalid_pods = 0  # pods in the last view that never parsed

    @abc.abstractmethod
    async def run(self, changed: Changed) -> None:
        """Keep the view current until cancelled, calling ``changed`` after each change."""

    async def close(self) -> None:
        """Release what ``run`` holds (connections); called once ``run`` has ended."""
        return

    # -- the view -------------------------------------------------------------------------------

    @property
    def pods(self) -> Mapping[str, PodSpec]:
        """The last good spec of every pod the source lists, by UID (or namespace/name)."""
        return self._pods

    def stale(self) -> bool:
        """No good read within ``stale_after`` (or none at all yet)."""
        if self.last_success is None:
            return True
        return self._clock() - self.last_success > self.stale_after

    def staleness(self) -> str:
        """Why the view is stale, for health and logs; "" while it is fresh."""
        if not self.stale():
            return ""
        if self.last_success is None:
            reason = "no good read yet"
        else:
            reason = f"no good read for {self._clock() - self.last_success:.0f}s"
        if self.last_error:
            reason += f": {self.last_error}"
        return f"pod source {self.name}: {reason}"

    # -- updating it ----------------------------------------------------------------------------

    def parse(self, obj: object) -> PodSpec:
        """One raw pod object as a spec (a source may name pods its own way)."""
        return parse_pod(obj, source=self.name, origin=self.origin, node_name=self.node_name)

    def replace_all(self, items: Iterable[object] | Iterable[Prepared]) -> bool:
        """Take a full listing: parse new and changed pods, forget the ones not listed.

        ``items`` are raw pod objects, or the same ``prepare``d off the loop. Returns whether the
        view changed.
        """
        seen: set[str] = set()
        changed = False
        for item in items:
            if isinstance(item, Prepared):
                key, digest, obj = item.key, item.digest, item.obj
            else:
                key, digest, obj = pod_key(item), None, item
            if key is None:
                self._report_item(None, obj)
                continue
            seen.add(key)
            changed |= self._put(key, obj, digest)
        for key in self._entries.keys() - seen:
            changed |= self._drop(key)
        self._log.keep_only([*seen, "__source__"])
        self._count_invalid()
        return changed

    def upsert(self, obj: object) -> bool:
        """Take one added or modified pod; returns whether the view changed."""
        key = pod_key(obj)
        if key is None:
            self._report_item(None, obj)
            return False
        changed = self._put(key, obj)
        self._count_invalid()
        return changed

    def remove(self, obj: object) -> bool:
        """Forget one pod (by its object, or its key); returns whether the view changed."""
        key = obj if isinstance(obj, str) else pod_key(obj)
        if key is None:
            return False
        changed = self._drop(key)
        self._log.clear(key)
        self._count_invalid()
        return changed

    def succeeded(self) -> None:
        """A read went through (even if some pods in it were invalid)."""
        self.reads += 1
        self.last_success = self._clock()
        if self.last_error is not None:
            log.info("pod_source_recovered", source=self.name, pods=len(self._pods))
        self.last_error = None
        self._log.clear("__source__")

    def failed(self, message: str) -> None:
        """A read failed: log it (rate-limited) and keep the last good view."""
        self.reads += 1
        self.read_errors += 1
        self.last_error = message[:ERROR_LOG_CHARS]
        if self._log.should_log("__source__", self.last_error):
            log.error(
                "pod_source_failed",
                source=self.name,
                error=self.last_error,
                kept_pods=len(self._pods),
            )

    # -- internals ------------------------------------------------------------------------------

    def _put(self, key: str, obj: object, digest: bytes | None = None) -> bool:
        if digest is None:
            digest = _digest(obj)
        entry = self._entries.get(key)
        if entry is not None and entry.digest == digest:
            return False
        previous = entry.spec if entry is not None else None
        try:
            spec = self.parse(obj)
        except PodSpecError as exc:
            text = str(exc)[:ERROR_LOG_CHARS]
            if self._log.should_log(key, text):
                log.error(
                    "pod_spec_invalid",
                    source=self.name,
                    pod=exc.pod,
                    error=text,
                    kept="the last good spec" if previous is not None else "none",
                )
            self._entries[key] = _Entry(digest, previous)
            return False
        if self._log.clear(key):
            log.info("pod_spec_valid_again", source=self.name, pod=spec.label)
        self._entries[key] = _Entry(digest, spec)
        changed = self._pods.get(key) != spec
        self._pods[key] = spec
        return changed

    def _drop(self, key: str) -> bool:
        self._entries.pop(key, None)
        return self._pods.pop(key, None) is not None

    def _report_item(self, key: str | None, obj: object) -> None:
        text = "an item is not a pod object with metadata.name"
        if self._log.should_log("__item__", text):
            log.error("pod_spec_invalid", source=self.name, pod="?", error=text)

    def _count_invalid(self) -> None:
        self.invalid_pods = sum(1 for entry in self._entries.values() if entry.spec is None)


class PolledSource(PodSource):
    """A source read again every ``interval`` seconds (the kubelet's ``/pods``, a manifest
    directory): its ``run`` is the poll loop, subclasses implement ``poll``.

    Unless given, ``stale_after`` is five intervals, at least 10 s.
    """

    def __init__(
        self,
        name: str,
        *,
        interval: float,
        stale_after: float | None = None,
        node_name: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            name,
            stale_after=max(10.0, 5 * interval) if stale_after is None else stale_after,
            node_name=node_name,
            clock=clock,
        )
        self.interval = interval

    @abc.abstractmethod
    async def poll(self) -> bool:
        """Read the source once and take what it lists; returns whether the view changed.

        A failed read goes through ``failed()`` and leaves the view as it was; only
        cancellation propagates.
        """

    async def run(self, changed: Changed) -> None:
        """Poll until cancelled, calling ``changed`` after each poll that changed the view."""
        while True:
            if await self.poll():
                try:
                    changed()
                except Exception:  # the listener's bug must not end the source
                    log.exception("pod_source_listener_failed", source=self.name)
            await asyncio.sleep(self.interval)


def _digest(obj: object) -> bytes:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
