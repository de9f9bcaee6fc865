"""All configured pod spec sources as one lookup: the spec of the pod a CRI sandbox belongs to
(by pod UID, or by namespace/name for static pod files), including pods missing from a source's
last read (kept as they were for a short grace) and pods that left for good (being torn down);
and, for a pod no source lists yet, how long its containers wait for a listing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Final

import structlog

from cri_prober.aio import Supervisor, TaskFactory, close_logged
from cri_prober.podspecs.memory import give_back_memory
from cri_prober.podspecs.model import PodOrigin, PodSpec
from cri_prober.podspecs.source import SUMMARY_NAMES, Changed, PodSource, PolledSource
from cri_prober.topic import Topic

log = structlog.get_logger(__name__)

# How long a pod that left its source is remembered as "being deleted" when the node no longer
# shows it either; while CRI still shows its sandbox it is kept regardless.
DEPARTED_KEEP_SECONDS: Final = 600.0
# How often the registry looks whether a source turned stale (staleness comes with time passing,
# not with an event).
STALENESS_CHECK_SECONDS: Final = 1.0
# After this many pods left the view, the allocator's free memory is handed back to the system.
TRIM_AFTER_FORGOTTEN: Final = 100
# How long past the longest poll interval of the polled sources a pod the node runs but no source
# lists waits for a listing before its containers get the rules file's probes (the API server's
# watch needs the margin only). The kubelet never probes a container it has no pod spec for
# (issue 23: an init container was probed until /pods listed its pod).
LISTING_MARGIN_SECONDS: Final = 2.0
# The listing grace counts from every source's first good read (a source that has not read
# lists nothing yet: issue 34 saw an init container probed for 23 s while the API server was
# down at start), but a pod waits for sources that have not read for at most this long after
# it was first seen; the grace then counts from there (the API server source's start-up grace).
UNREAD_SOURCE_WAIT_SECONDS: Final = 30.0


@dataclasses.dataclass(slots=True)
class _Unlisted:
    """A pod the node runs that no source listed when it was first looked up."""

    seen: float  # the registry's clock: when it was first looked up
    passed: bool = False  # the grace passed (logged once)


class PodSpecs:
    """The pods every source reports; the first source listing a pod wins."""

    def __init__(
        self,
        sources: Sequence[PodSource],
        *,
        clock: Callable[[], float] = time.monotonic,
        supervisor: Supervisor | None = None,
    ) -> None:
        self.sources = tuple(sources)
        # Every source's loop and the staleness check run under the daemon's supervisor, which
        # restarts one that fails; a registry built alone (tests) has its own.
        self._owns_supervisor = supervisor is None
        self._supervisor = supervisor or Supervisor()
        self._clock = clock
        self._by_uid: dict[str, PodSpec] = {}
        self._by_name: dict[str, PodSpec] = {}  # static pod files without a UID
        # Pods missing from their source's last read, kept as they were until the deadline: a
        # source that misses a pod once (a manifest being replaced, a flaky read) must not cost
        # its workers their counters (PodSource.missing_grace). A pod whose omission is its
        # deletion (a static pod gone from the kubelet's /pods) departs at once
        # (PodSource.missing_grace_for).
        self._missing: dict[str, tuple[PodSpec, float]] = {}
        # Pods that left every source while the node may still run them: the kubelet is
        # terminating them (a removed static pod vanishes from /pods at once, with no
        # deletionTimestamp). Kept as deleting, with when they left.
        self._departed: dict[str, tuple[PodSpec, float]] = {}
        self._by_source = {source.name: source for source in self.sources}
        # The pods the node runs (UIDs and namespace/names), as the manager last said (retain);
        # None until it has.
        self._live: set[str] | None = None
        self._forgotten = 0  # pods gone since memory was last handed back
        # Pods the node runs that no source listed when the manager looked them up, by UID (or
        # namespace/name): their containers wait for a listing (unlisted_wait).
        self._unlisted: dict[str, _Unlisted] = {}
        # When the registry first saw each source with a good read (its own clock): the listing
        # grace counts from the last of these.
        self._read_since: dict[str, float] = {}
        self._unread_logged = False  # a grace passed without some source's read (logged once)
        self._changed: Changed | None = None
        self._task_names: list[str] = []
        # The names of the stale sources, published whenever that set changes (health "").
        self.stale_sources: tuple[str, ...] = tuple(s.name for s in self.sources if s.stale())
        self.freshness: Topic[tuple[str, ...]] = Topic("pod-sources")
        self.rebuild()

    # -- lookups --------------------------------------------------------------------------------

    def lookup(self, uid: str, namespace: str, name: str) -> PodSpec | None:
        """The spec of the pod with this UID (CRI sandbox metadata), else this name."""
        spec = self._by_uid.get(uid) if uid else None
        if spec is None:
            spec = self._by_name.get(f"{namespace}/{name}")
        if spec is None:
            for kept in (self._missing, self._departed):
                found = kept.get(uid) or kept.get(f"{namespace}/{name}")
                if found is not None:
                    return found[0]
        return spec

    def listing_grace(self) -> float:
        """How long a pod no source lists waits for a listing: the longest poll interval of the
        polled sources plus LISTING_MARGIN_SECONDS (the API server's watch is near-instant)."""
        polled = [s.interval for s in self.sources if isinstance(s, PolledSource)]
        return max(polled, default=0.0) + LISTING_MARGIN_SECONDS

    def unlisted_wait(self, uid: str, namespace: str, name: str) -> float | None:
        """Seconds the containers of this pod, which no source lists (``lookup`` found nothing),
        should still wait for a listing; None once the listing grace has passed.

        The first call for a pod starts its wait and asks the polled sources to read at once
        (``PolledSource.poll_soon``): the kubelet's ``/pods`` lists a pod as it admits it, so the
        spec comes within a read's round trip. The grace counts from the later of that first
        call and every source's first good read (a source that has not read lists nothing yet),
        but from no later than UNREAD_SOURCE_WAIT_SECONDS after the first call (logged once, at
        warning). When the grace passes (logged once per pod, at info), the pod is one the
        sources do not list (a container no kubelet made, a static pod of a manifest directory
        not read): the annotation's and the rules file's probes apply.
        """
        key = uid or f"{namespace}/{name}"
        now = self._clock()
        self.note_reads()
        entry = self._unlisted.get(key)
        if entry is None:
            entry = self._unlisted[key] = _Unlisted(now)
            for source in self.sources:
                if isinstance(source, PolledSource):
                    source.poll_soon()
        if entry.passed:
            return None
        start, unread = self._grace_start(entry.seen)
        grace = self.listing_grace()
        if now < start + grace:
            return start + grace - now
        entry.passed = True
        if unread and not self._unread_logged:
            self._unread_logged = True
            log.warning(
                "pod_spec_sources_unread",
                sources=unread,
                waited=round(now - entry.seen, 3),
                detail=f"no good read yet after {UNREAD_SOURCE_WAIT_SECONDS:g}s: containers of "
                "pods no source lists stop waiting for these sources (logged once)",
            )
        log.info(
            "pod_spec_grace_passed",
            pod=f"{namespace}/{name}",
            uid=uid,
            grace=round(grace, 3),
            waited=round(now - entry.seen, 3),
            detail="no pod source lists the pod: its containers get the annotation's and the "
            "rules file's probes",
        )
        return None

    def _grace_start(self, seen: float) -> tuple[float, list[str]]:
        """When the listing grace of a pod first seen at ``seen`` starts, and the sources that
        have not read yet."""
        unread = [source.name for source in self.sources if source.name not in self._read_since]
        bound = seen + UNREAD_SOURCE_WAIT_SECONDS
        if unread:
            return bound, unread
        return max(seen, min(max(self._read_since.values(), default=seen), bound)), []

    def note_reads(self) -> bool:
        """Note the sources that had their first good read since the last call; True if any."""
        now = self._clock()
        noted = False
        for source in self.sources:
            if source.name not in self._read_since and source.last_success is not None:
                self._read_since[source.name] = now
                noted = True
        return noted

    def staleness(self) -> list[str]:
        """One line per source whose view is stale; empty when all are fresh."""
        return [reason for source in self.sources if (reason := source.staleness())]

    def retain(self, live: set[str]) -> None:
        """Forget departed pods the node no longer shows (``live``: UIDs and namespace/names),
        once they have been gone for DEPARTED_KEEP_SECONDS."""
        self._live = live
        for key in self._unlisted.keys() - live:
            del self._unlisted[key]
        now = self._clock()
        for key, (_spec, since) in list(self._departed.items()):
            if key not in live and now - since > DEPARTED_KEEP_SECONDS:
                del self._departed[key]

    # -- running the sources --------------------------------------------------------------------

    def start(self, changed: Changed) -> None:
        """Start every source's loop; ``changed`` runs after the merged view changes."""

        def on_change() -> None:
            self.rebuild()
            self.check_staleness()
            changed()

        self._changed = changed

        for source in self.sources:
            self._start(f"pod-source:{source.name}", functools.partial(source.follow, on_change))
        self._start("pod-source-stale", self._follow_staleness)

    def _start(self, name: str, factory: TaskFactory) -> None:
        self._task_names.append(name)
        self._supervisor.start(name, factory, policy="restart")

    def check_staleness(self) -> None:
        """Publish on ``freshness`` if the set of stale sources changed, and log the change."""
        stale = tuple(source.name for source in self.sources if source.stale())
        if stale == self.stale_sources:
            return
        for source in self.sources:
            if source.name in stale and source.name not in self.stale_sources:
                log.warning("pod_source_stale", source=source.name, reason=source.staleness())
            elif source.name in self.stale_sources and source.name not in stale:
                log.info("pod_source_fresh", source=source.name, pods=len(source.pods))
        self.stale_sources = stale
        self.freshness.publish(stale)

    async def _follow_staleness(self) -> None:
        while True:
            self.check_staleness()
            # A source's first read that changed nothing (an empty listing) calls no listener;
            # the containers waiting for it look again here.
            waiting = any(not entry.passed for entry in self._unlisted.values())
            if self.note_reads() and waiting and self._changed is not None:
                try:
                    self._changed()
                except Exception:  # the listener's bug must not end the check
                    log.exception("pod_source_listener_failed", source="registry")
            if self.expire_missing() and self._changed is not None:
                try:
                    self._changed()
                except Exception:  # the listener's bug must not end the check
                    log.exception("pod_source_listener_failed", source="registry")
            if self._forgotten >= TRIM_AFTER_FORGOTTEN:
                # Many specs freed (a big listing left): hand the memory back to the system.
                self._forgotten = 0
                await asyncio.to_thread(give_back_memory)
            await asyncio.sleep(STALENESS_CHECK_SECONDS)

    def expire_missing(self) -> bool:
        """Move the pods missing past their grace to the departed; True if any moved."""
        now = self._clock()
        expired = [key for key, (_spec, deadline) in self._missing.items() if deadline <= now]
        if not expired:
            return False
        left: dict[str, list[str]] = {}
        for key in expired:
            spec, _deadline = self._missing.pop(key)
            self._forgotten += 1
            if self._live is None or key in self._live:
                # The node may still run it: kept as being deleted while it is torn down. A pod
                # the node never showed is not (a source listing 10,000 pods that never run here,
                # again and again with new UIDs, would otherwise pile them up for 10 minutes).
                self._departed[key] = (dataclasses.replace(spec, deleting=True), now)
            left.setdefault(spec.source, []).append(spec.label)
        for source, labels in left.items():
            # One line per source and check, however many left (50,000 pods leaving at once
            # used to be 50,000 lines).
            log.info(
                "pod_left_source",
                source=source,
                pod=labels[0],
                count=len(labels),
                pods=labels[:SUMMARY_NAMES],
            )
        return True

    async def stop(self) -> None:
        """Stop every source's loop and release its connections."""
        if self._owns_supervisor:
            await self._supervisor.stop()
        else:
            await self._supervisor.stop(self._task_names)
        self._task_names.clear()
        for source in reversed(self.sources):
            await close_logged(f"pod-source:{source.name}", source.close())

    def rebuild(self) -> None:
        """Merge the sources' views again (each source's change does it; a caller that changed
        a source's view by hand calls it too)."""
        self.note_reads()
        by_uid: dict[str, PodSpec] = {}
        by_name: dict[str, PodSpec] = {}
        for source in self.sources:
            for spec in source.pods.values():
                if spec.uid:
                    by_uid.setdefault(spec.uid, spec)
                elif spec.origin is PodOrigin.MANIFEST:
                    by_name.setdefault(spec.label, spec)
        now = self._clock()
        for key, spec in [*self._by_uid.items(), *self._by_name.items()]:
            if (
                key not in by_uid
                and key not in by_name
                and key not in self._missing
                and key not in self._departed
            ):
                owner = self._by_source.get(spec.source)
                grace = owner.missing_grace_for(spec) if owner is not None else 0.0
                self._missing[key] = (spec, now + grace)
        for key in [*by_uid, *by_name]:
            self._missing.pop(key, None)
            self._departed.pop(key, None)
            self._unlisted.pop(key, None)
        self._by_uid, self._by_name = by_uid, by_name
        self.expire_missing()
