"""What every pod spec source shares: the last good view of its pods, updated by full listings
or single changes, with bad pods and failed reads reported in rate-limited log lines while the
last good view is kept.

A source subclasses ``PodSource`` and implements ``run`` (``apiserver.py``), or ``PolledSource``
and implements ``poll`` (``kubelet.py``, ``manifests.py``): fetch, then
``replace_all``/``upsert``/``remove``, then ``succeeded`` or ``failed``. The registry runs it
through ``follow`` and reads ``pods`` and ``stale``.

Every line a source logs carries ``source=<its name>`` without naming it: its own lines through
its bound loggers, and anything else logged while it runs (libraries, worker threads) through
structlog's context variables, which ``follow`` binds.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import contextvars
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

import structlog

from cri_prober.logs import Logged, is_repeat
from cri_prober.podspecs.decode import DecodedPod, slim_pods
from cri_prober.podspecs.memory import give_back_memory
from cri_prober.podspecs.model import PodOrigin, PodSpec, PodSpecError, parse_pod

# The longest error text a log line carries (validation messages quote the values they refuse).
ERROR_LOG_CHARS: Final = 2048
# A read at least this big is followed by handing free memory back to the system: without it,
# RSS would stay at the largest listing ever read.
BIG_READ_BYTES: Final = 1024 * 1024
# A polled source's pod counts as gone once it has been missing for this many more reads.
MISSING_READS: Final = 2
# A "poll now" (``PolledSource.poll_soon``) starts a read at most this often: a node whose pods
# churn cannot make a source read continuously.
POLL_NOW_MIN_GAP: Final = 1.0
# How many pods a summary line names (with the count of all of them).
SUMMARY_NAMES: Final = 5
# LogOnce keys that are not pods: kept when a listing forgets the pods that left.
_SOURCE_KEY: Final = "__source__"
_ITEM_KEY: Final = "__item__"
_DUPLICATE_PREFIX: Final = "duplicate:"

Changed = Callable[[], None]


@dataclass(slots=True)
class _Entry:
    digest: bytes  # of the raw object, so an unchanged pod is not parsed again
    spec: PodSpec | None  # the last good parse; None if the pod never parsed


class LogOnce:
    """Logs a keyed problem when it first appears or changes, then once per REPEAT_LOG_SECONDS."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._last: dict[str, Logged] = {}

    def should_log(self, key: str, text: str) -> bool:
        now = self._clock()
        if is_repeat(self._last.get(key), text, now):
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

    def __len__(self) -> int:
        return len(self._last)


class PodSource(abc.ABC):
    """One source of pod specs: its view of the node's pods and how fresh that view is.

    ``stale_after`` is how long without a good read before the view counts as stale: health
    ``""`` then reports NOT_SERVING (the view is still used; nothing running is dropped).
    """

    origin: PodOrigin = PodOrigin.API
    # How long a pod missing from this source's view is kept as it was before it counts as
    # gone (the registry's grace). Here 0: the API server's lists and DELETED events say a
    # pod is gone for good; polled sources may miss a pod once (PolledSource).
    missing_grace: float = 0.0
    # Watch requests sent so far, for a source that watches (None for one that polls).
    watches: int | None = None

    def missing_grace_for(self, spec: PodSpec) -> float:
        """How long ``spec``'s pod, missing from this source's view, is kept as it was.

        The grace is for an omission nothing explains (a flaky read), not for a deletion: a
        static pod the kubelet listed (``PodSpec.static``) leaves its ``/pods`` only as the
        kubelet starts terminating it (HandlePodRemoves, then SyncTerminatingPod's
        StopLivenessAndStartup), with no deletionTimestamp to show it first, so it has none.
        """
        return 0.0 if spec.static else self.missing_grace

    def __init__(
        self,
        name: str,
        *,
        stale_after: float,
        node_name: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        # This module's lines about the source; a subclass binds its own module's logger too, so
        # each line keeps the logger name of the module that wrote it.
        self.logger = structlog.get_logger(__name__, source=name)
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
        self._failure_logged = False  # the current failure was logged (so its recovery is)
        # Within one listing: invalid pods logged one by one so far, and those only counted.
        self._logged_in_read = 0
        self._unlogged: list[str] | None = None

    @abc.abstractmethod
    async def run(self, changed: Changed) -> None:
        """Keep the view current until cancelled, calling ``changed`` after each change."""

    async def close(self) -> None:
        """Release what ``run`` holds (connections); called once ``run`` has ended."""
        return

    async def follow(self, changed: Changed) -> None:
        """``run``, with ``source=<name>`` bound to every line logged meanwhile in its task and
        the threads it starts (a library's, a decoder's), as the source's own lines carry it.

        ``changed`` runs outside that binding, in the caller's context: what the listener logs,
        and the tasks it starts (the manager's workers copy the context they start in), are not
        the source's.
        """
        outer = contextvars.copy_context()

        def notify() -> None:
            outer.run(changed)

        with structlog.contextvars.bound_contextvars(source=self.name):
            await self.run(notify)

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
        """One (slim) pod object as a spec (a source may name pods its own way)."""
        return parse_pod(obj, source=self.name, origin=self.origin, node_name=self.node_name)

    def replace_all(self, items: Iterable[DecodedPod] | Iterable[object]) -> bool:
        """Take a full listing: parse new and changed pods, forget the ones not listed.

        ``items`` are decoded pods (``cri_prober.podspecs.decode``), or raw pod objects, which
        are reduced the same way. Pure CPU and safe in a worker thread (``apply_listing``): the
        new view is built aside and swapped in at the end, so the loop never sees half of it.
        Two pods under one key (a UID listed twice): the first wins, the other is reported.
        Returns whether the view changed.
        """
        entries: dict[str, _Entry] = {}
        pods: dict[str, PodSpec] = {}
        duplicates: list[str] = []
        changed = False
        self._unlogged = []
        for item in _decoded(items):
            key = item.key
            if key is None:
                self._report_item()
                continue
            if key in entries:
                duplicates.append(key)
                continue
            entry, spec_changed = self._entry(key, item, self._entries.get(key))
            entries[key] = entry
            if entry.spec is not None:
                pods[key] = entry.spec
            changed |= spec_changed
        changed |= self._pods.keys() != pods.keys()
        self._report_unlogged()
        self._report_duplicates(duplicates)
        self._entries, self._pods = entries, pods
        self._log.keep_only(
            [*entries, _SOURCE_KEY, _ITEM_KEY, *(_DUPLICATE_PREFIX + key for key in duplicates)]
        )
        self._count_invalid()
        return changed

    async def apply_listing(self, items: list[DecodedPod] | list[object]) -> bool:
        """``replace_all`` in a worker thread (parsing a node's changed pods takes a while).

        ``items`` is emptied afterwards: decoded pods point into the listing's buffer, which is
        freed only once they are gone.
        """
        try:
            return await asyncio.to_thread(self.replace_all, items)
        finally:
            items.clear()

    @staticmethod
    async def give_back(read_bytes: int) -> None:
        """After a read of ``read_bytes``, hand what it used back to the system if it was big
        (``memory.give_back_memory``), in a worker thread."""
        if read_bytes >= BIG_READ_BYTES:
            await asyncio.to_thread(give_back_memory)

    def upsert(self, obj: DecodedPod | object) -> bool:
        """Take one added or modified pod; returns whether the view changed."""
        (item,) = _decoded([obj])
        if item.key is None:
            self._report_item()
            return False
        entry, changed = self._entry(item.key, item, self._entries.get(item.key))
        self._entries[item.key] = entry
        if entry.spec is not None:
            self._pods[item.key] = entry.spec
        self._count_invalid()
        return changed

    def remove(self, obj: DecodedPod | object) -> bool:
        """Forget one pod (by its decoded or raw object, or its key); returns whether the view
        changed."""
        if isinstance(obj, str):
            key: str | None = obj
        else:
            (item,) = _decoded([obj])
            key = item.key
        if key is None:
            return False
        self._entries.pop(key, None)
        changed = self._pods.pop(key, None) is not None
        self._log.clear(key)
        self._count_invalid()
        return changed

    def succeeded(self) -> None:
        """A read went through (even if some pods in it were invalid).

        The recovery is logged if the failure was; the failure's rate limit is kept, so a
        source that fails the same way every other read (a watch that opens, then breaks on
        the same line) logs the pair once per REPEAT_LOG_SECONDS, not every cycle.
        """
        self.reads += 1
        self.last_success = self._clock()
        if self.last_error is not None and self._failure_logged:
            self.logger.info("pod_source_recovered", pods=len(self._pods))
        self._failure_logged = False
        self.last_error = None

    def failed(self, message: str) -> None:
        """A read failed: log it (rate-limited) and keep the last good view."""
        self.reads += 1
        self.read_errors += 1
        self.last_error = message[:ERROR_LOG_CHARS]
        if self._log.should_log(_SOURCE_KEY, self.last_error):
            self._failure_logged = True
            self.logger.error(
                "pod_source_failed",
                error=self.last_error,
                kept_pods=len(self._pods),
            )

    # -- internals ------------------------------------------------------------------------------

    def _entry(self, key: str, item: DecodedPod, entry: _Entry | None) -> tuple[_Entry, bool]:
        """The entry for ``item`` (the same one if its digest did not change), and whether its
        spec changed."""
        if entry is not None and entry.digest == item.digest:
            return entry, False
        previous = entry.spec if entry is not None else None
        try:
            spec = self.parse(item.obj)
        except PodSpecError as exc:
            text = str(exc)[:ERROR_LOG_CHARS]
            if self._log.should_log(key, text):
                if self._unlogged is not None and self._logged_in_read >= SUMMARY_NAMES:
                    self._unlogged.append(exc.pod)  # summed up after the listing
                    return _Entry(item.digest, previous), False
                self._logged_in_read += 1
                self.logger.error(
                    "pod_spec_invalid",
                    pod=exc.pod,
                    error=text,
                    kept="the last good spec" if previous is not None else "none",
                )
            return _Entry(item.digest, previous), False
        if self._log.clear(key):
            self.logger.info("pod_spec_valid_again", pod=spec.label)
        return _Entry(item.digest, spec), previous != spec

    def _report_unlogged(self) -> None:
        """One line for the invalid pods of a listing past the first few logged on their own."""
        unlogged, self._unlogged, self._logged_in_read = self._unlogged, None, 0
        if unlogged:
            self.logger.error(
                "pod_specs_invalid",
                count=len(unlogged),
                pods=unlogged[:SUMMARY_NAMES],
                detail=f"more pods cannot be used than the {SUMMARY_NAMES} logged one by one",
            )

    def _report_item(self) -> None:
        text = "an item is not a pod object with metadata.name"
        if self._log.should_log(_ITEM_KEY, text):
            self.logger.error("pod_spec_invalid", pod="?", error=text)

    def _report_duplicates(self, keys: list[str]) -> None:
        for key in keys:
            pod = self._pods.get(key)
            if self._log.should_log(_DUPLICATE_PREFIX + key, "duplicate"):
                self.logger.error(
                    "pod_listed_twice",
                    key=key,
                    pod=pod.label if pod is not None else "?",
                    detail="two pods share this UID: the first listed is used",
                )

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
        # Two more reads must confirm a pod is gone: a manifest replaced by an editor (removed,
        # then written), or one odd answer, costs its workers nothing.
        self.missing_grace = MISSING_READS * interval + 1.0
        # Set by poll_soon: the next read starts without waiting out the interval.
        self._poll_requested = asyncio.Event()
        self.polls_requested = 0  # reads started early by poll_soon

    @abc.abstractmethod
    async def poll(self) -> bool:
        """Read the source once and take what it lists; returns whether the view changed.

        A failed read goes through ``failed()`` and leaves the view as it was; only
        cancellation propagates.
        """

    def poll_soon(self) -> None:
        """Read again without waiting out the interval: the node shows a pod no source lists
        (the kubelet's ``/pods`` lists a pod as it admits it, before its sandbox exists).

        Requests coalesce; one made during a read makes another read follow it (that read may
        have started before the pod existed); reads start at most once per POLL_NOW_MIN_GAP.
        """
        self._poll_requested.set()

    async def run(self, changed: Changed) -> None:
        """Poll until cancelled, calling ``changed`` after each poll that changed the view."""
        loop = asyncio.get_running_loop()
        while True:
            self._poll_requested.clear()
            started = loop.time()
            if await self.poll():
                try:
                    changed()
                except Exception:  # the listener's bug must not end the source
                    self.logger.exception("pod_source_listener_failed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self._poll_requested.wait()
                    self.polls_requested += 1
                    # Early, but not more often than once per POLL_NOW_MIN_GAP.
                    await asyncio.sleep(max(0.0, started + POLL_NOW_MIN_GAP - loop.time()))


def _decoded(items: Iterable[DecodedPod] | Iterable[object]) -> Iterable[DecodedPod]:
    for item in items:
        if isinstance(item, DecodedPod):
            yield item
        else:
            yield from slim_pods([item])
