"""Container discovery like the kubelet's PLEG: a cached view of the node's pods and containers.

`Discovery` keeps the view fresh by relisting (ListPodSandbox + ListContainers, diffed against the
last view) or by following GetContainerEvents, and publishes what started, died, changed or
went away on ``updates`` (it is the CRI ``NodeSource``). Either way statuses are fetched only for
objects that are new or changed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import operator
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol, TypeVar

import structlog

from cri_prober.discovery.model import (
    ContainerInfo,
    EventKind,
    LifecycleEvent,
    PodInfo,
    container_info,
    pod_info,
)
from cri_prober.discovery.source import (
    RELIST_THRESHOLD,
    DiscoveryUpdate,
    EffectiveMode,
    Mode,
    Relisted,
    ViewChanged,
)
from cri_prober.errors import CriError, CriNotFound, CriUnimplemented
from cri_prober.runtime.model import (
    Container,
    ContainerEvent,
    ContainerEventType,
    ContainerState,
    ContainerStatus,
    PodSandbox,
    RuntimeVersion,
    SandboxState,
    SandboxStatus,
)
from cri_prober.topic import Topic

log = structlog.get_logger(__name__)

# While events flow, a slow relist still catches anything the stream missed (e.g. events emitted
# between the runtime accepting the stream and our relist, or dropped by containerd 1.7).
DEFAULT_SAFETY_RELIST_PERIOD = 30.0
DEFAULT_BACKOFF_INITIAL = 0.1
DEFAULT_BACKOFF_MAX = 5.0
# Status calls for a burst of new containers run in parallel, but bounded so a node-wide change
# (a runtime restart, thousands of containers) does not flood the runtime.
DEFAULT_MAX_CONCURRENT_STATUS = 16

_T = TypeVar("_T")
_VERSION = re.compile(r"v?(\d+)\.(\d+)")


class CriSource(Protocol):
    """The CRI reads discovery needs (``cri_prober.runtime.client.CriClient`` implements them)."""

    async def version(self) -> RuntimeVersion: ...
    async def list_pod_sandboxes(self) -> list[PodSandbox]: ...
    async def pod_sandbox_status(self, sandbox_id: str) -> SandboxStatus: ...
    async def list_containers(self) -> list[Container]: ...
    async def container_status(
        self, container_id: str, *, verbose: bool = False
    ) -> ContainerStatus: ...
    def container_events(self) -> AsyncIterator[ContainerEvent]: ...


def containerd_version(runtime: RuntimeVersion) -> tuple[int, int] | None:
    """(major, minor) of a containerd runtime; None for other runtimes or unparsable versions.

    Accepts release tags ("v2.1.9") as well as distro builds ("2.1.9+unknown", "1.6.20~ds1").
    """
    if runtime.runtime_name != "containerd":
        return None
    match = _VERSION.match(runtime.runtime_version)
    return (int(match[1]), int(match[2])) if match else None


def pick_mode(runtime: RuntimeVersion) -> EffectiveMode:
    """``events`` only where the runtime broadcasts them to every subscriber (containerd >= 2.0).

    containerd 1.7 hands each event to just one of the open streams, so a second subscriber would
    steal events from the kubelet; 1.6 and unknown runtimes are relisted.
    """
    version = containerd_version(runtime)
    return "events" if version is not None and version >= (2, 0) else "relist"


class _Listed(Protocol):
    """What discovery reads of every listed object to tell whether it knows it."""

    @property
    def id(self) -> str: ...


def _gone(known: Mapping[str, object], listed: Sequence[_Listed], new: int) -> dict[str, None]:
    """The known IDs a listing lacks, in the view's order (``new``: listed IDs not known).

    Listings have unique IDs (they come from the runtime's store), so when the listed known
    objects are as many as the known ones nothing is gone, which costs no pass to find out.
    """
    if len(listed) - new == len(known):
        return {}
    ids = {item.id for item in listed}
    return {object_id: None for object_id in known if object_id not in ids}


def _same(listing: Sequence[object], last: Sequence[object]) -> bool:
    """Whether a listing holds the very objects of the last one, in the same order."""
    return len(listing) == len(last) and all(map(operator.is_, listing, last))


def _transition(previous: ContainerInfo | None, current: ContainerInfo) -> LifecycleEvent | None:
    """The kubelet's generateEvents for a container that exists now."""
    if previous is not None and previous.state is current.state:
        return None
    if current.state is ContainerState.CONTAINER_RUNNING:
        kind = EventKind.STARTED
    elif current.state is ContainerState.CONTAINER_EXITED:
        kind = EventKind.DIED
    else:
        kind = EventKind.CHANGED
    return LifecycleEvent(kind, current, current.pod)


def _disappearance(previous: ContainerInfo) -> list[LifecycleEvent]:
    """The kubelet's generateEvents for a container that no longer exists."""
    removed = LifecycleEvent(EventKind.REMOVED, previous, previous.pod)
    if previous.state is ContainerState.CONTAINER_EXITED:
        return [removed]  # its death was already reported
    return [LifecycleEvent(EventKind.DIED, previous, previous.pod), removed]


class Discovery:
    """The node's pods and containers, kept fresh by relisting or by CRI container events.

    Every change of the view is published on ``updates`` with the same semantics in
    both modes, because both build a new view and diff it against the old one. Subscribers are
    called synchronously from discovery's task, so they must be quick (queue work, don't do it).
    """

    def __init__(
        self,
        cri: CriSource,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_concurrent_status: int = DEFAULT_MAX_CONCURRENT_STATUS,
        backoff_initial: float = DEFAULT_BACKOFF_INITIAL,
        backoff_max: float = DEFAULT_BACKOFF_MAX,
    ) -> None:
        self._cri = cri
        self._clock = clock
        self._max_concurrent_status = max_concurrent_status
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        # Replaced, never mutated, so a mapping handed out stays a consistent snapshot.
        self._pods: dict[str, PodInfo] = {}
        self._containers: dict[str, ContainerInfo] = {}
        self.updates: Topic[DiscoveryUpdate] = Topic("discovery")
        # The last listings a relist found the view matching, until the view changes.
        self._unchanged_listing: tuple[Sequence[PodSandbox], Sequence[Container]] | None = None
        # Relists and event batches each swap in a view computed from the previous one.
        self._lock = asyncio.Lock()
        # Set when a relist or a status refresh failed: retry soon rather than at the safety pace.
        self._incomplete = False
        self._last_relist_attempt = float("-inf")  # event-loop time
        self.last_relist_ok: float | None = None
        self.listed = asyncio.Event()  # set by the first successful relist, and stays set
        self.effective_mode: EffectiveMode | None = None

    # -- reading --------------------------------------------------------------------------------

    def containers(self) -> Mapping[str, ContainerInfo]:
        """Every known container by ID (a read-only snapshot)."""
        return MappingProxyType(self._containers)

    def pods(self) -> Mapping[str, PodInfo]:
        """Every known pod sandbox by sandbox ID (a read-only snapshot)."""
        return MappingProxyType(self._pods)

    def container(self, container_id: str) -> ContainerInfo | None:
        """One container, or None if it is not (or no longer) known."""
        return self._containers.get(container_id)

    def pod(self, sandbox_id: str) -> PodInfo | None:
        """One pod sandbox, or None if it is not (or no longer) known."""
        return self._pods.get(sandbox_id)

    def _listed_ok(self, listed_at: float) -> None:
        self.last_relist_ok = listed_at
        self.listed.set()

    @property
    def complete(self) -> bool:
        """Whether the view holds every container the runtime listed last time: the last relist
        (or event batch) succeeded and so did every status call it made."""
        return self.last_relist_ok is not None and not self._incomplete

    def healthy(self, now: float | None = None) -> bool:
        """Whether a relist succeeded within the kubelet's threshold (``now`` is ``clock`` time)."""
        if self.last_relist_ok is None:
            return False
        return (self._clock() if now is None else now) - self.last_relist_ok <= RELIST_THRESHOLD

    # -- relisting ------------------------------------------------------------------------------

    async def relist(self) -> list[LifecycleEvent]:
        """List everything, refresh what is new or changed, and emit and return the events.

        Raises ``CriError`` if a listing fails; the view is then left as it was. A failed status
        call only leaves that object as it was (or unknown), so the next relist retries it.
        """
        async with self._lock:
            return await self._relist_locked()

    async def _relist_locked(self) -> list[LifecycleEvent]:
        started = self._clock()
        ok = False
        try:
            events = await self._relist_view()
            ok = True
        finally:
            self.updates.publish(Relisted(self._clock() - started, ok))
        return events

    async def _relist_view(self) -> list[LifecycleEvent]:
        self._last_relist_attempt = asyncio.get_running_loop().time()
        self._incomplete = True  # kept if a listing fails; a failed status call sets it again
        sandboxes = await self._cri.list_pod_sandboxes()
        containers = await self._cri.list_containers()
        # Published only once the new view is committed, so whoever sees a successful relist
        # (the daemon's readiness, health "") also sees the containers it found.
        listed_at = self._clock()
        self._incomplete = False
        # The client answers an unchanged listing with the very objects of the last one, in the
        # same order: if a relist found those matching a view that has not changed since, this
        # one would too, and an identity check is ~20x cheaper than looking each one up.
        if (last := self._unchanged_listing) is not None and (
            _same(sandboxes, last[0]) and _same(containers, last[1])
        ):
            self._listed_ok(listed_at)
            return []
        old_pods, old_containers = self._pods, self._containers

        # One cheap pass over each listing finds what is new or changed (CRI fixes everything
        # but the state of an object with a given ID); the rest of the work is proportional to
        # that, so a relist of an unchanged node touches no view object and publishes nothing.
        ready = SandboxState.SANDBOX_READY
        known_pod = old_pods.get
        stale_listed = {
            s.id: s
            for s in sandboxes
            if (pod := known_pod(s.id)) is None or pod.ready is not (s.state is ready)
        }
        stale = list(stale_listed)
        known_container = old_containers.get
        changed = [
            c
            for c in containers
            if (info := known_container(c.id)) is None or info.state is not c.state
        ]
        new_pods = {sandbox_id for sandbox_id in stale if sandbox_id not in old_pods}
        gone_pods = _gone(old_pods, sandboxes, len(new_pods))
        new_count = sum(1 for c in changed if c.id not in old_containers)
        gone_containers = _gone(old_containers, containers, new_count)
        if not (stale or changed or gone_pods or gone_containers):
            self._unchanged_listing = (sandboxes, containers)
            self._listed_ok(listed_at)
            return []

        # A container whose sandbox was created after ListPodSandbox answered has no listed
        # sandbox; fetching that sandbox's status beats ignoring the container until next time.
        def listed(sandbox_id: str) -> bool:
            return sandbox_id in new_pods or (
                sandbox_id in old_pods and sandbox_id not in gone_pods
            )

        unlisted = [c.pod_sandbox_id for c in changed if not listed(c.pod_sandbox_id)]
        if gone_pods:  # an unchanged container may still name a sandbox no longer listed
            unlisted.extend(
                info.pod_sandbox_id
                for container_id, info in old_containers.items()
                if info.pod_sandbox_id in gone_pods and container_id not in gone_containers
            )
        touched_pods = list(dict.fromkeys([*stale, *unlisted, *gone_pods]))
        # Each status becomes its view object as it arrives, so a node's first relist holds a
        # few statuses at a time rather than all of them while the view (and then the workers)
        # is built: those freed all at once left pymalloc's pools unused (issue 36).

        async def fetch_pod(sandbox_id: str) -> PodInfo:
            status = await self._cri.pod_sandbox_status(sandbox_id)
            return pod_info(status, stale_listed.get(sandbox_id))

        pod_infos = await self._fetch([*stale, *unlisted], fetch_pod)
        pods = dict(old_pods)
        for sandbox_id in gone_pods:
            del pods[sandbox_id]
        asked = {*stale, *unlisted}
        for sandbox_id in touched_pods:
            if sandbox_id not in pod_infos:
                # Unasked and gone, or its refresh failed: the previous info is kept in the
                # latter case (as unchanged), and the next relist asks again.
                if sandbox_id in asked and sandbox_id in old_pods:
                    pods[sandbox_id] = old_pods[sandbox_id]
            elif (fetched_pod := pod_infos[sandbox_id]) is None:
                pods.pop(sandbox_id, None)
            else:
                pods[sandbox_id] = fetched_pod

        listed_of = {c.id: c for c in changed}
        sandbox_of = {c.id: c.pod_sandbox_id for c in changed}

        async def fetch_container(container_id: str) -> ContainerInfo:
            status = await self._container_status(container_id)
            return container_info(
                status,
                pods[sandbox_of[container_id]],
                old_containers.get(container_id),
                listed_of[container_id],
            )

        refresh = [c.id for c in changed if c.pod_sandbox_id in pods]
        container_infos = await self._fetch(refresh, fetch_container)
        new_containers = dict(old_containers)
        for container_id in gone_containers:
            del new_containers[container_id]
        for container_id, fetched in container_infos.items():
            # Not fetched (its sandbox is gone) or failed: the previous info, if any, is kept
            # and retried next time; _commit drops it if its sandbox is gone.
            if fetched is None:
                new_containers.pop(container_id, None)
            else:
                new_containers[container_id] = fetched
        events = self._commit(pods, new_containers, touched_pods, [*sandbox_of, *gone_containers])
        self._listed_ok(listed_at)
        return events

    async def _container_status(self, container_id: str) -> ContainerStatus:
        known = self._containers.get(container_id)
        # Verbose answers are much larger (they carry the OCI spec) and only the env is wanted.
        verbose = known is None or known.env is None
        return await self._cri.container_status(container_id, verbose=verbose)

    async def _fetch(
        self, ids: Iterable[str], fetch: Callable[[str], Awaitable[_T]]
    ) -> dict[str, _T | None]:
        """Fetch statuses in parallel: the value, None if the object is gone, absent on error."""
        results: dict[str, _T | None] = {}
        unique = list(dict.fromkeys(ids))
        pending = iter(unique)

        async def worker() -> None:
            for object_id in pending:  # the workers share one iterator: each ID is fetched once
                try:
                    results[object_id] = await fetch(object_id)
                except CriNotFound:
                    results[object_id] = None
                except CriError as exc:
                    self._incomplete = True
                    log.warning("status_refresh_failed", id=object_id, error=str(exc))

        async with asyncio.TaskGroup() as group:
            for _ in range(min(len(unique), self._max_concurrent_status)):
                group.create_task(worker())
        return results

    # -- committing -----------------------------------------------------------------------------

    def _commit(
        self,
        pods: dict[str, PodInfo],
        containers: dict[str, ContainerInfo],
        touched_pods: Iterable[str],
        touched_containers: Iterable[str],
    ) -> list[LifecycleEvent]:
        """Swap in a new view, then emit and return the events that lead from the old one to it.

        ``pods`` and ``containers`` are the new view, fresh dicts (the old ones are snapshots
        handed out); ``touched_*`` name every object that may differ from the old view (added,
        replaced or gone). Containers of a pod that changed or went are found here.
        """
        old_pods, old_containers = self._pods, self._containers
        pod_ids = list(dict.fromkeys(touched_pods))
        container_ids = dict.fromkeys(touched_containers)
        moved = {
            sandbox_id
            for sandbox_id in pod_ids
            if sandbox_id in old_pods and pods.get(sandbox_id) is not old_pods[sandbox_id]
        }
        if moved:  # one cheap pass, only when a known pod was refreshed or went away
            for container_id, info in containers.items():
                if info.pod_sandbox_id in moved:
                    container_ids[container_id] = None
        for container_id in container_ids:
            if (current := containers.get(container_id)) is None:
                continue
            pod = pods.get(current.pod_sandbox_id)
            if pod is None:
                del containers[container_id]  # its sandbox is gone, and so is it
            elif current.pod is not pod:
                containers[container_id] = dataclasses.replace(current, pod=pod)

        events = [
            LifecycleEvent(EventKind.POD_CHANGED, None, pod)
            for sandbox_id in pod_ids
            if (pod := pods.get(sandbox_id)) is not None
            and (old := old_pods.get(sandbox_id)) is not pod
            and old != pod
        ]
        for container_id in container_ids:
            if (current := containers.get(container_id)) is not None and (
                event := _transition(old_containers.get(container_id), current)
            ) is not None:
                events.append(event)
        for container_id in container_ids:
            if (
                container_id not in containers
                and (previous := old_containers.get(container_id)) is not None
            ):
                events.extend(_disappearance(previous))
        events.extend(
            LifecycleEvent(EventKind.POD_REMOVED, None, old_pods[sandbox_id])
            for sandbox_id in pod_ids
            if sandbox_id not in pods and sandbox_id in old_pods
        )
        self._pods, self._containers = pods, containers
        self._unchanged_listing = None
        self._emit(events)
        return events

    def _emit(self, events: list[LifecycleEvent]) -> None:
        if events:
            self.updates.publish(ViewChanged(tuple(events)))

    # -- events ---------------------------------------------------------------------------------

    async def _apply_events(self, events: list[ContainerEvent]) -> None:
        """Refresh just the objects these events name; relist if one cannot be placed."""
        async with self._lock:
            latest: dict[str, ContainerEvent] = {}
            for event in events:  # several events for one object need one refresh
                latest.pop(event.container_id, None)
                latest[event.container_id] = event
            pods, containers = dict(self._pods), dict(self._containers)
            pod_ids: dict[str, None] = {}  # sandboxes to refresh, in order
            container_pods: dict[str, str] = {}  # container to refresh -> its sandbox
            removed_pods: list[str] = []
            removed_containers: list[str] = []
            for object_id, event in latest.items():
                deleted = event.type is ContainerEventType.CONTAINER_DELETED_EVENT
                event_sandbox = event.sandbox.sandbox.id if event.sandbox else None
                if object_id in pods or event_sandbox == object_id:  # sandbox events carry its ID
                    if deleted:
                        pods.pop(object_id, None)
                        removed_pods.append(object_id)
                    else:
                        pod_ids[object_id] = None
                    continue
                if deleted:
                    containers.pop(object_id, None)
                    removed_containers.append(object_id)
                    continue
                known = containers.get(object_id)
                sandbox_id = known.pod_sandbox_id if known is not None else event_sandbox
                if sandbox_id is None:
                    # Unknown, and the event names no sandbox: only a listing can place it.
                    await self._relist_locked()
                    return
                container_pods[object_id] = sandbox_id
                if sandbox_id not in pods:
                    pod_ids[sandbox_id] = None

            async def fetch_pod(sandbox_id: str) -> PodInfo:
                return pod_info(await self._cri.pod_sandbox_status(sandbox_id))

            for sandbox_id, pod in (await self._fetch(pod_ids, fetch_pod)).items():
                if pod is None:
                    pods.pop(sandbox_id, None)
                else:
                    pods[sandbox_id] = pod

            async def fetch_container(container_id: str) -> ContainerInfo:
                status = await self._container_status(container_id)
                pod = pods[container_pods[container_id]]
                return container_info(status, pod, containers.get(container_id))

            refresh = [cid for cid, sandbox_id in container_pods.items() if sandbox_id in pods]
            for container_id, info in (await self._fetch(refresh, fetch_container)).items():
                if info is None:
                    containers.pop(container_id, None)
                else:
                    containers[container_id] = info
            self._commit(
                pods, containers, [*pod_ids, *removed_pods], [*container_pods, *removed_containers]
            )

    async def _read_events(self, queue: asyncio.Queue[ContainerEvent | None]) -> None:
        """Pump the event stream into ``queue``, reconnecting; return if the runtime lacks it.

        Only cheap work happens between reads: on containerd 2.x a reader that stalls blocks the
        runtime's own CRI calls. ``None`` in the queue asks for a relist, which every (re)connect
        needs because events from before the stream existed are gone.
        """
        loop = asyncio.get_running_loop()
        delay = self._backoff_initial
        while True:
            queue.put_nowait(None)
            connected_at = loop.time()
            received = False
            try:
                async for event in self._cri.container_events():
                    received = True
                    queue.put_nowait(event)
                error = "stream ended"
            except CriUnimplemented as exc:
                log.warning(
                    "pleg_fallback_relist",
                    reason="the runtime does not implement GetContainerEvents",
                    error=str(exc),
                )
                return
            except Exception as exc:
                # Whatever broke the stream (runtime restart, an event we cannot decode), the
                # cure is the same: reconnect and relist.
                error = str(exc) or type(exc).__name__
            if received or loop.time() - connected_at >= self._backoff_max:
                delay = self._backoff_initial  # the stream worked: this is a fresh failure
            log.info("events_stream_reconnect", error=error, retry_in=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._backoff_max)

    async def _apply_queued(
        self,
        queue: asyncio.Queue[ContainerEvent | None],
        *,
        relist_period: float,
        safety_relist_period: float,
    ) -> None:
        """Apply queued events in batches; relist on request, on a failure and as a safety net."""
        loop = asyncio.get_running_loop()
        while True:
            period = relist_period if self._incomplete else safety_relist_period
            batch: list[ContainerEvent | None] = []
            try:
                # asyncio.timeout around Queue.get cannot lose an item, unlike wait_for on 3.11.
                async with asyncio.timeout(self._last_relist_attempt + period - loop.time()):
                    batch.append(await queue.get())
            except TimeoutError:
                batch.append(None)
            while not queue.empty():
                batch.append(queue.get_nowait())
            events = [item for item in batch if item is not None]
            if len(events) < len(batch):
                # The relist is newer than every event in the batch, so it covers them all.
                await self._relist_logged()
            else:
                await self._apply_logged(events)

    # -- running --------------------------------------------------------------------------------

    async def run(
        self,
        mode: Mode = "auto",
        *,
        relist_period: float = 1.0,
        safety_relist_period: float = DEFAULT_SAFETY_RELIST_PERIOD,
        stop: asyncio.Event,
    ) -> None:
        """Keep the view fresh until ``stop`` is set.

        ``relist`` relists every ``relist_period`` s. ``events`` follows GetContainerEvents,
        relisting on every (re)connect, every ``safety_relist_period`` s, and ``relist_period`` s
        after a failure; a runtime without the stream makes it fall back to ``relist`` for good.
        ``auto`` asks the runtime's version and picks ``events`` only on containerd >= 2.0.
        Keep ``safety_relist_period`` well under ``RELIST_THRESHOLD``: ``healthy()`` counts relists.
        """
        async with asyncio.TaskGroup() as group:
            task = group.create_task(
                self._run(mode, relist_period, safety_relist_period), name="discovery"
            )
            await stop.wait()
            task.cancel()

    async def _run(self, mode: Mode, relist_period: float, safety_relist_period: float) -> None:
        self.effective_mode = await self._resolve_mode(mode)
        log.info("discovery_mode", requested=mode, mode=self.effective_mode)
        if self.effective_mode == "events":
            queue: asyncio.Queue[ContainerEvent | None] = asyncio.Queue()
            async with asyncio.TaskGroup() as group:
                applier = group.create_task(
                    self._apply_queued(
                        queue,
                        relist_period=relist_period,
                        safety_relist_period=safety_relist_period,
                    ),
                    name="discovery-apply-events",
                )
                await self._read_events(queue)
                applier.cancel()
            self.effective_mode = "relist"
        while True:
            await self._relist_logged()
            await asyncio.sleep(relist_period)

    async def _resolve_mode(self, mode: Mode) -> EffectiveMode:
        if mode == "relist":
            return "relist"
        runtime = await self._runtime_version()
        if mode == "auto":
            return pick_mode(runtime)
        if (version := containerd_version(runtime)) is not None and (1, 7) <= version < (2, 0):
            log.warning(
                "events_mode_splits_events",
                runtime_version=runtime.runtime_version,
                reason="containerd 1.7 delivers each container event to only one subscriber, so"
                " this stream steals events from the kubelet's Evented PLEG (use auto or relist)",
            )
        return "events"

    async def _runtime_version(self) -> RuntimeVersion:
        """CRI Version, retried with backoff for as long as the runtime is not answering."""
        delay = self._backoff_initial
        while True:
            try:
                return await self._cri.version()
            except CriError as exc:
                log.warning("runtime_version_failed", error=str(exc), retry_in=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._backoff_max)

    async def _apply_logged(self, events: list[ContainerEvent]) -> None:
        """Apply events; a failure is logged and leaves a relist due soon, never raised."""
        try:
            await self._apply_events(events)
        except Exception as exc:
            self._incomplete = True
            if isinstance(exc, CriError):
                log.warning("events_apply_failed", error=str(exc))
            else:
                log.exception("events_apply_failed")

    async def _relist_logged(self) -> None:
        """Relist; a failure is logged and left for the next attempt, never raised."""
        try:
            await self.relist()
        except CriError as exc:
            log.warning("relist_failed", error=str(exc))
        except Exception:
            log.exception("relist_failed")


__all__ = [
    "DEFAULT_SAFETY_RELIST_PERIOD",
    "RELIST_THRESHOLD",
    "ContainerInfo",
    "CriSource",
    "Discovery",
    "EffectiveMode",
    "EventKind",
    "LifecycleEvent",
    "Mode",
    "PodInfo",
    "containerd_version",
    "pick_mode",
]
