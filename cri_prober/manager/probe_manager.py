"""The probe manager: one worker per (pod, container name, probe kind), reconciled with the node.

It plays the kubelet's prober manager and the parts of its sync loop that consume probe results:
it keeps the set of workers equal to (containers x matching probe specs), hands each worker a
view of the newest attempt of its container, derives ``started``/``ready``/``healthy``, triggers
readiness when startup passes, logs every published transition, and with ``--on-failure stop``
stops containers whose liveness or startup probe failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import json
import random
import time
from collections.abc import Awaitable, Callable, Container, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

import structlog

from cri_prober.aio import Supervisor
from cri_prober.discovery.model import ContainerInfo, EventKind, LifecycleEvent, PodInfo
from cri_prober.discovery.naming import ContainerRef
from cri_prober.errors import CriError, CriProberError
from cri_prober.manager.events import (
    AttemptFinished,
    ContainerGone,
    ManagerEvent,
    Reconciled,
    ResultChanged,
    WorkerStopped,
)
from cri_prober.manager.memory import Remembered
from cri_prober.manager.state import Health, ProbeState
from cri_prober.podspecs.model import PodSpec
from cri_prober.probing.handlers.exec import ExecRunner
from cri_prober.probing.hooks import InvalidPreStop, pre_stop_hook, run_pre_stop
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.outcome import ProbeOutcome, shorten
from cri_prober.probing.prober import Prober, ProbeTarget, run_once
from cri_prober.probing.results import ProbeRecord, Published, ResultsStore, ResultUpdate
from cri_prober.probing.spec import (
    ContainerOverride,
    Probe,
    ResolvedProbe,
    RulesFile,
    SpecError,
    parse_annotation,
    select_probes,
)
from cri_prober.probing.worker import ContainerView, ProbeWorker, predates_prober
from cri_prober.runtime.model import ContainerState
from cri_prober.topic import Topic

log = structlog.get_logger(__name__)

OVERRIDE_ANNOTATION_PREFIX = "probes.cri-prober.io/"
GRACE_ANNOTATION = "io.kubernetes.pod.terminationGracePeriod"
DELETION_GRACE_ANNOTATION = "io.kubernetes.pod.deletionGracePeriod"
DEFAULT_GRACE_SECONDS = 30
MIN_GRACE_SECONDS = 2
OUTPUT_LOG_BYTES = 256
# The longest error text logged for a bad override annotation: validation messages quote the
# values they reject, and an annotation can be as big as the API server lets a pod's be.
ANNOTATION_ERROR_LOG_CHARS = 2048
# The kubelet's pod workers sync every pod again this long after its last sync, stretched by up
# to half (pod_workers.go resyncInterval and its jitter), and retry a failed sync (such as a kill
# that failed) after the back-off period, stretched the same way. §3.8, §5.2.
POD_RESYNC_SECONDS = 60.0
SYNC_BACKOFF_SECONDS = 10.0
SYNC_JITTER = 0.5
# How often the resync clock checks for pods due (the kubelet's syncCh ticks every second).
RESYNC_TICK_SECONDS = 1.0
RESYNC_TASK = "pod-resync"  # the supervised task's name

OnFailure = Literal["report", "stop"]
# Which probes pod annotations may define (serve --annotations): none, exec probes only (they run
# inside the pod's own container), or all (network probes then follow --annotation-probe-hosts).
AnnotationMode = Literal["off", "exec-only", "all"]


class Stopper(ExecRunner, Protocol):
    """The CRI calls ``--on-failure stop`` needs: ExecSync for a preStop hook, StopContainer
    (``CriClient`` provides both)."""

    async def stop_container(self, container_id: str, *, grace_seconds: int) -> None: ...


class PodSpecLookup(Protocol):
    """Pod specs from ``serve --probes-from`` (``cri_prober.podspecs.registry.PodSpecs``)."""

    def lookup(self, uid: str, namespace: str, name: str) -> PodSpec | None: ...

    def retain(self, live: set[str]) -> None: ...


class NoSuchProbe(CriProberError):
    """The container has no probe of that kind configured."""


class ProbeNotRunning(CriProberError):
    """The probe is configured but its worker ended (the container is gone for good)."""


@dataclass(frozen=True, slots=True)
class SlotKey:
    """A container slot: the kubelet keys probe workers by pod UID and container name."""

    pod_uid: str
    container: str


@dataclass(frozen=True, slots=True)
class _CachedOverride:
    """A container's parsed override annotation, with the text it was parsed from.

    Keeping the text costs nothing extra: it is the string discovery's PodInfo holds for as
    long as the pod exists, and the entry goes when the container leaves the node.
    """

    value: str
    override: ContainerOverride | None  # None: the annotation was refused (and logged once)


@dataclass
class Slot:
    """The newest attempt of one container of one pod, its probe specs and workers."""

    key: SlotKey
    container: ContainerInfo
    specs: dict[ProbeKind, ResolvedProbe] = field(default_factory=dict)
    workers: dict[ProbeKind, ProbeWorker] = field(default_factory=dict)
    tasks: dict[ProbeKind, asyncio.Task[None]] = field(default_factory=dict)
    # Workers that ended on their own; a worker started later for the same kind inherits their
    # counters and history (the kubelet's worker lives as long as the pod).
    retired: dict[ProbeKind, ProbeWorker] = field(default_factory=dict)
    # The pod's spec from serve --probes-from, when a source lists the pod.
    pod_spec: PodSpec | None = None

    @property
    def pod(self) -> PodInfo:
        return self.container.pod

    @property
    def label(self) -> str:
        """``namespace/pod/container``, the name users and the health service use."""
        return f"{self.pod.namespace}/{self.pod.name}/{self.key.container}"


class _WorkerHook:
    """Turns one worker's observer calls into manager events with its container attached."""

    def __init__(self, manager: ProbeManager, slot: Slot, kind: ProbeKind) -> None:
        self._manager = manager
        self._slot = slot
        self._kind = kind

    def probe_finished(self, worker: ProbeWorker, record: ProbeRecord) -> None:
        self._manager.events.publish(AttemptFinished(self._slot.container, self._kind, record))

    def worker_stopped(self, worker: ProbeWorker) -> None:
        self._manager._worker_exited(self._slot, self._kind, worker)


class ProbeManager:
    """Keeps one worker per configured probe of every container and publishes their results."""

    def __init__(
        self,
        *,
        prober: Prober,
        rules: RulesFile,
        results: ResultsStore | None = None,
        prober_started_at: float | None = None,
        on_failure: OnFailure = "report",
        stopper: Stopper | None = None,
        history_size: int = 32,
        wall_clock: Callable[[], float] = time.time,
        probe_on_exit: bool = True,
        rng: random.Random | None = None,
        remembered: Mapping[str, Remembered] | None = None,
        annotations: AnnotationMode = "all",
        pod_specs: PodSpecLookup | None = None,
        rules_source: str = "",
        supervisor: Supervisor | None = None,
    ) -> None:
        if on_failure == "stop" and stopper is None:
            raise ValueError("on_failure='stop' needs a stopper")
        self.prober = prober
        self.rules = rules
        self.results = results or ResultsStore()
        self.prober_started_at = prober_started_at if prober_started_at is not None else time.time()
        self.on_failure = on_failure
        self.annotations: AnnotationMode = annotations
        # serve --probes-from: the pods' own specs, which come before the rules file.
        self.pod_specs = pod_specs
        self.rules_source = rules_source
        # The one stream servers, metrics and tests follow (see ``cri_prober.manager.events``).
        self.events: Topic[ManagerEvent] = Topic("manager")
        self._stopper = stopper
        self._history_size = history_size
        self._wall = wall_clock
        # D9: run every worker of a container that died at once, so its Failure follows the exit
        # (cri-prober's speed-up); False keeps the kubelet's timing (each at its next tick).
        self.probe_on_exit = probe_on_exit
        # D5: started/ready of each container as the previous cri-prober left them (KEP-4781).
        # Only containers on the node need theirs: see retain_remembered and on_lifecycle.
        self.remembered: dict[str, Remembered] = dict(remembered or {})
        self._rng = rng or random.Random()
        self._slots: dict[SlotKey, Slot] = {}
        self._by_container_id: dict[str, Slot] = {}
        self._by_pod: dict[str, set[SlotKey]] = {}
        # Pod syncs (the kubelet's pod workers, §3.8): requested ones run once, soon; every pod
        # is also synced again POD_RESYNC_SECONDS (jittered) after its last sync.
        self._sync_requested: set[str] = set()
        self._next_resync: dict[str, float] = {}
        self._resync_heap: list[tuple[float, str]] = []
        # The pod-resync loop runs under the daemon's supervisor (restarted if it fails); a
        # manager built alone (tests) has its own.
        self._owns_supervisor = supervisor is None
        self._supervisor = supervisor or Supervisor()
        self._closed = False  # shut down: no loop starts again
        # Containers with a StopContainer in flight (one at a time, never a shorter grace).
        self._stopping: set[str] = set()
        # Gate for new workers joining the pod-admission tick grid (D4); off while reloading.
        self._anchor_new_workers = True
        # Workers that ended on their own for a container (it exited for good): not recreated
        # for that same container ID.
        self._finished: set[tuple[SlotKey, ProbeKind, str]] = set()
        # Parsed override annotations by (sandbox ID, container name), for containers on the node
        # now: reconcile drops the others (pods without a slot included).
        self._override_cache: dict[tuple[str, str], _CachedOverride] = {}
        self._background: set[asyncio.Task[None]] = set()
        self.results.subscribe(self._on_result)

    # -- queries --------------------------------------------------------------------------------

    def slots(self) -> list[Slot]:
        """Every slot that has at least one probe configured."""
        return list(self._slots.values())

    def slot_for_container(self, container_id: str) -> Slot | None:
        """The slot whose newest attempt has this container ID."""
        return self._by_container_id.get(container_id)

    def health(self, slot: Slot) -> Health:
        """started/ready/live for the slot's newest attempt, as the kubelet derives them (§3.8)."""
        container = slot.container
        running = container.state is ContainerState.CONTAINER_RUNNING
        started = running and self._started(slot)
        ready = started and self._passed(slot, ProbeKind.READINESS)
        live = self.results.get(container.id, ProbeKind.LIVENESS) is not Published.FAILURE
        return Health(running=running, started=started, ready=ready, live=live)

    def _passed(self, slot: Slot, kind: ProbeKind) -> bool:
        """No probe of this kind, a published success, or state kept across our own restart."""
        worker = slot.workers.get(kind)
        if worker is None:
            return kind not in slot.specs
        container_id = slot.container.id
        result = self.results.get(container_id, kind)
        if result is not None:
            return result is Published.SUCCESS
        adopting = worker.container_id != container_id and self._predates_prober(slot.container)
        if not (worker.preserves(container_id) or adopting):
            return False
        # KEP-4781 (§3.12): keep what the previous status said; with no memory of the container
        # (no state file, or it predates it), assume it had started and was ready.
        previous = self.remembered.get(container_id)
        if previous is None:
            return True
        return previous.started if kind is ProbeKind.STARTUP else previous.ready

    def _predates_prober(self, container: ContainerInfo) -> bool:
        """KEP-4781: running since more than 10 s before the prober started (the worker will
        adopt it without publishing its initial value; §3.12)."""
        return predates_prober(
            running=container.state is ContainerState.CONTAINER_RUNNING,
            started_at=container.started_at // 1_000_000_000,
            prober_started_at=self.prober_started_at,
        )

    def remembered_state(self) -> dict[str, Remembered]:
        """started/ready of every running probed container, for the state file."""
        state: dict[str, Remembered] = {}
        for slot in self._slots.values():
            health = self.health(slot)
            if health.running:
                state[slot.container.id] = Remembered(started=health.started, ready=health.ready)
        return state

    def retain_remembered(self, live: Container[str]) -> None:
        """Forget the remembered state of every container whose ID is not in ``live``.

        Call it with every container on the node (a complete relist): container IDs are never
        reused, so the others are gone for good and their memory, read from a file that may hold
        thousands, would otherwise stay for the process's life.
        """
        if self.remembered:
            self.remembered = {cid: r for cid, r in self.remembered.items() if cid in live}

    def _started(self, slot: Slot) -> bool:
        return self._passed(slot, ProbeKind.STARTUP)

    def container_health(self, info: ContainerInfo) -> Health:
        """The derived state of any container; one without probes is healthy while it runs."""
        slot = self._by_container_id.get(info.id)
        if slot is not None:
            return self.health(slot)
        running = info.state is ContainerState.CONTAINER_RUNNING
        return Health(running=running, started=running, ready=running, live=True)

    def probe_states(self, container_id: str) -> tuple[ProbeState, ...]:
        """The configured probes of this container (newest attempt only), liveness first."""
        slot = self._by_container_id.get(container_id)
        if slot is None:
            return ()
        states = []
        for kind in (ProbeKind.LIVENESS, ProbeKind.READINESS, ProbeKind.STARTUP):
            resolved = slot.specs.get(kind)
            if resolved is None:
                continue
            worker = slot.workers.get(kind)
            states.append(
                ProbeState(
                    kind=kind,
                    probe=resolved.probe,
                    ports=resolved.ports,
                    published=self.results.get(container_id, kind),
                    has_worker=worker is not None,
                    active=worker is not None and not worker.stopped,
                    on_hold=worker is not None and worker.on_hold,
                    last_result=worker.last_result if worker is not None else None,
                    result_run=worker.result_run if worker is not None else 0,
                    attempts=worker.probes_run if worker is not None else 0,
                    last_record=worker.last_record if worker is not None else None,
                    history=tuple(worker.history) if worker is not None else (),
                    probing_since=worker.probing_since if worker is not None else None,
                    origin=resolved.origin,
                    source=resolved.source,
                )
            )
        return tuple(states)

    def named_ports(self, container_id: str) -> dict[str, int]:
        """Every named port the container's configured probes can use."""
        ports: dict[str, int] = {}
        slot = self._by_container_id.get(container_id)
        if slot is not None:
            for resolved in slot.specs.values():
                ports.update(resolved.ports)
        return ports

    def tracked(self) -> int:
        """How many containers have at least one probe configured."""
        return len(self._slots)

    # -- commands from users --------------------------------------------------------------------

    def probe_now(self, container_id: str, kind: ProbeKind) -> None:
        """Run the container's configured ``kind`` probe at once, as a normal step.

        Raises:
            NoSuchProbe: the container has no such probe configured.
            ProbeNotRunning: the probe's worker ended (the container is gone for good).
        """
        slot = self._by_container_id.get(container_id)
        if slot is None or kind not in slot.specs:
            raise NoSuchProbe(f"no {kind.value} probe")
        worker = slot.workers.get(kind)
        if worker is None or worker.stopped:
            raise ProbeNotRunning(
                f"the {kind.value} probe is not running (the container is gone for good)"
            )
        worker.probe_now()

    async def run_probe(self, container: ContainerInfo, probe: Probe) -> ProbeRecord:
        """Run ``probe`` once on ``container`` and record it; no worker or result changes.

        Named ports resolve like the container's configured probes' do.
        """
        target = ProbeTarget.of(container, self.named_ports(container.id))
        return await run_once(self.prober, probe, target)

    # -- reconciling ----------------------------------------------------------------------------

    def set_rules(self, rules: RulesFile, containers: Iterable[ContainerInfo]) -> None:
        """Swap in new rules: unchanged probes keep their workers, changed ones restart."""
        self.rules = rules
        # Workers for changed rules start their grid now: the kubelet has nothing to compare.
        self._anchor_new_workers = False
        try:
            self.reconcile(containers)
        finally:
            self._anchor_new_workers = True
        self.events.publish(Reconciled(len(self._slots)))

    def on_lifecycle(
        self, events: Iterable[LifecycleEvent], containers: Iterable[ContainerInfo]
    ) -> None:
        """React to a batch of discovery events: reconcile once, then sync the pods they touch.

        Like the kubelet's PLEG events, every event syncs its pod (§3.8: readiness re-trigger,
        and in stop mode a kill that is still due).
        """
        self.reconcile(containers)
        for event in events:
            pod = event.pod if event.pod is not None else None
            if event.container is not None:
                pod = event.container.pod
                slot = self._by_container_id.get(event.container.id)
                if slot is not None and event.kind is EventKind.DIED and self.probe_on_exit:
                    # D9: step (7) publishes Failure for a container that is not running; run it
                    # now rather than at each worker's next tick, so the transition follows the
                    # exit. The kubelet's workers notice at their own next tick.
                    for worker in slot.workers.values():
                        worker.trigger()
            if event.kind is EventKind.REMOVED and event.container is not None:
                self.remembered.pop(event.container.id, None)  # gone for good
            # Every PLEG event but a removal syncs its pod.
            removal = event.kind in (EventKind.REMOVED, EventKind.POD_REMOVED)
            if pod is not None and not removal:
                self.request_sync(pod.uid or pod.sandbox_id)
        self.events.publish(Reconciled(len(self._slots)))

    def on_pod_specs(self, containers: Iterable[ContainerInfo]) -> None:
        """A pod spec source changed its view: reconcile, then sync every pod whose spec changed
        (the kubelet syncs a pod on every update from its sources, deletion included)."""
        before = {key: slot.pod_spec for key, slot in self._slots.items()}
        self.reconcile(containers)
        for key, slot in self._slots.items():
            if key not in before or before[key] is not slot.pod_spec:
                self.request_sync(key.pod_uid)
        self.events.publish(Reconciled(len(self._slots)))

    def reconcile(self, containers: Iterable[ContainerInfo]) -> None:
        """Make the workers match (newest attempt of every container) x (its probe specs)."""
        newest: dict[SlotKey, ContainerInfo] = {}
        for info in containers:
            key = SlotKey(info.pod.uid or info.pod_sandbox_id, info.name)
            current = newest.get(key)
            if current is None or (info.attempt, info.created_at) > (
                current.attempt,
                current.created_at,
            ):
                newest[key] = info

        for key in [k for k in self._slots if k not in newest]:
            self._drop_slot(self._slots[key])

        if self.pod_specs is not None:
            live_pods = set()
            for info in newest.values():
                live_pods.add(info.pod.uid)
                live_pods.add(f"{info.pod.namespace}/{info.pod.name}")
            self.pod_specs.retain(live_pods)

        for key, info in newest.items():
            pod_spec = self._pod_spec(info.pod)
            specs = self._specs_for(info, pod_spec)
            slot = self._slots.get(key)
            if slot is None:
                if not specs:
                    continue
                slot = Slot(key=key, container=info)
                self._slots[key] = slot
                self._by_pod.setdefault(key.pod_uid, set()).add(key)
                self._schedule_resync(key.pod_uid)
            elif slot.container.id != info.id:
                self._by_container_id.pop(slot.container.id, None)
            slot.container = info
            slot.pod_spec = pod_spec
            self._by_container_id[info.id] = slot
            self._sync_workers(slot, specs)
            if not slot.workers and not specs:
                self._drop_slot(slot)

        # Forget the annotations of containers that left the node. A pod whose bad annotation
        # gave it no probe never had a slot, so dropping slots alone would keep its entry (and
        # the annotation's text) forever.
        live = {(info.pod.sandbox_id, info.name) for info in newest.values()}
        for gone in self._override_cache.keys() - live:
            del self._override_cache[gone]

    def _pod_spec(self, pod: PodInfo) -> PodSpec | None:
        if self.pod_specs is None:
            return None
        return self.pod_specs.lookup(pod.uid, pod.namespace, pod.name)

    def _specs_for(
        self, info: ContainerInfo, pod_spec: PodSpec | None = None
    ) -> dict[ProbeKind, ResolvedProbe]:
        spec_container = None
        if pod_spec is not None:
            if info.name in pod_spec.init_containers:
                # D8: the kubelet never probes an ordinary init container, whatever else
                # matches it.
                return {}
            spec_container = pod_spec.containers.get(info.name)
        override = self._override(info.pod, info.name)
        selected = select_probes(
            self.rules,
            namespace=info.pod.namespace,
            pod=info.pod.name,
            container=info.name,
            labels=info.labels,
            pod_labels=info.pod.labels,
            override=override,
            pod_spec=spec_container,
            pod_env=spec_container.env if spec_container is not None else None,
            sources_named={
                "rules": self.rules_source,
                "annotation": f"annotation {OVERRIDE_ANNOTATION_PREFIX}{info.name}",
                "pod-spec": pod_spec.source if pod_spec is not None else "",
            },
        )
        if pod_spec is not None and pod_spec.deleting:
            # D3: the kubelet stops liveness and startup probing as soon as a pod's termination
            # begins (StopLivenessAndStartup); readiness goes on until the containers stop.
            selected.pop(ProbeKind.LIVENESS, None)
            selected.pop(ProbeKind.STARTUP, None)
        return selected

    def _override(self, pod: PodInfo, container: str) -> ContainerOverride | None:
        value = pod.annotations.get(OVERRIDE_ANNOTATION_PREFIX + container)
        if value is None:
            return None
        key = (pod.sandbox_id, container)
        cached = self._override_cache.get(key)
        # Discovery hands back the same PodInfo, and so the same string, while a pod is
        # unchanged: the identity test settles nearly every call without comparing the text.
        if cached is not None and (cached.value is value or cached.value == value):
            return cached.override
        override = self._parse_override(pod, container, value)
        self._override_cache[key] = _CachedOverride(value, override)
        return override

    def _parse_override(self, pod: PodInfo, container: str, value: str) -> ContainerOverride | None:
        """The annotation's probes if ``--annotations`` lets them in; else log why not, once."""
        source = (
            f"pod {pod.namespace}/{pod.name} annotation {OVERRIDE_ANNOTATION_PREFIX}{container}"
        )
        if self.annotations == "off":
            log.info("probe_annotation_ignored", source=source, reason="serve --annotations off")
            return None
        try:
            override = parse_annotation(value, source=source)
        except SpecError as exc:
            # A bad annotation must not take the file's probes away: report it, use the file.
            log.error("bad_probe_annotation", error=shorten(str(exc), ANNOTATION_ERROR_LOG_CHARS))
            return None
        if self.annotations == "exec-only":
            refused = [
                f"{source}: {kind.field_name}: only exec probes are allowed "
                "(serve --annotations exec-only)"
                for kind in ProbeKind
                if (probe := override.probe(kind)) is not None and probe.exec is None
            ]
            if refused:
                # All or nothing, like an invalid annotation: the file's probes apply instead.
                log.error("bad_probe_annotation", error="\n".join(refused))
                return None
        return override

    def _sync_workers(self, slot: Slot, specs: dict[ProbeKind, ResolvedProbe]) -> None:
        for kind in list(slot.workers):
            new, old = specs.get(kind), slot.specs.get(kind)
            # A worker's runner keeps the origin it started with, and ResolvedProbe equality
            # leaves the origin out: compare it here.
            if new != old or (new is not None and old is not None and new.origin != old.origin):
                self._stop_worker(slot, kind)
        slot.specs = specs
        # The kubelet creates workers in the order startup, readiness, liveness.
        for kind in (ProbeKind.STARTUP, ProbeKind.READINESS, ProbeKind.LIVENESS):
            if kind in specs and kind not in slot.workers:
                if (slot.key, kind, slot.container.id) in self._finished:
                    continue
                self._start_worker(slot, kind)

    def _grid_anchor(self, slot: Slot) -> float | None:
        """D4: where the kubelet's worker would have started its ticker (pod admission).

        The sandbox's creation time stands in for admission, for pods that appeared while
        cri-prober was watching; otherwise (our own start, reloaded rules) there is no anchor.
        """
        if not self._anchor_new_workers:
            return None
        created = slot.pod.created_at / 1e9
        if created <= self.prober_started_at:
            return None
        return created

    def _start_worker(self, slot: Slot, kind: ProbeKind) -> None:
        resolved = slot.specs[kind]
        previous = slot.retired.pop(kind, None)
        worker = ProbeWorker(
            kind,
            resolved.probe,
            status=lambda: self._view(slot),
            run_probe=self._runner(slot, resolved),
            results=self.results,
            prober_started_at=self.prober_started_at,
            observer=_WorkerHook(self, slot, kind),
            history_size=self._history_size,
            name=f"{slot.label}:{kind.value}",
            grid_anchor=self._grid_anchor(slot),
        )
        if previous is not None and previous.timing == resolved.probe:
            worker.inherit(previous)
        slot.workers[kind] = worker
        slot.tasks[kind] = asyncio.create_task(
            worker.run(), name=f"probe:{slot.label}:{kind.value}"
        )

    def _stop_worker(self, slot: Slot, kind: ProbeKind) -> None:
        worker = slot.workers.pop(kind, None)
        slot.tasks.pop(kind, None)
        if worker is not None:
            worker.stop()
            # Its task ends on its own (after the current step) and cleans up its result.

    def _drop_slot(self, slot: Slot) -> None:
        for kind in list(slot.workers):
            self._stop_worker(slot, kind)
        self._slots.pop(slot.key, None)
        self._by_container_id.pop(slot.container.id, None)
        pod_slots = self._by_pod.get(slot.key.pod_uid)
        if pod_slots is not None:
            pod_slots.discard(slot.key)
            if not pod_slots:
                del self._by_pod[slot.key.pod_uid]
                self._next_resync.pop(slot.key.pod_uid, None)
        self.events.publish(ContainerGone(slot.container))
        self._finished = {f for f in self._finished if f[0] != slot.key}

    def _worker_exited(self, slot: Slot, kind: ProbeKind, worker: ProbeWorker) -> None:
        if slot.workers.get(kind) is worker:
            # It ended by itself: the container exited for good. Don't recreate it for this ID.
            slot.workers.pop(kind, None)
            slot.tasks.pop(kind, None)
            slot.retired[kind] = worker
            if worker.container_id is not None:
                self._finished.add((slot.key, kind, worker.container_id))
        self.events.publish(WorkerStopped(slot.container, kind, replaced=kind in slot.workers))

    # -- what workers see -----------------------------------------------------------------------

    def _view(self, slot: Slot) -> ContainerView | None:
        container = slot.container
        if not container.id:
            return None
        if container.state is ContainerState.CONTAINER_CREATED and container.started_at == 0:
            # D19: the kubelet creates and starts a container in one sync, so its status cache
            # shows no created-but-not-started container: the worker sees nothing yet (step 4).
            return None
        running = container.state is ContainerState.CONTAINER_RUNNING
        exited = container.state is ContainerState.CONTAINER_EXITED
        sandbox_down = not container.pod.ready
        spec = slot.pod_spec
        if spec is not None:
            # D10 with the pod's spec: an exited container is restarted unless the pod's
            # restartPolicy is Never; a restartable init container always is (§3.6).
            spec_container = spec.containers.get(slot.key.container)
            sidecar = spec_container is not None and spec_container.sidecar
            will_restart = (sidecar or spec.restart_policy != "Never") and not sandbox_down
            deleting = spec.deleting or sandbox_down
            finished = spec.finished or (sandbox_down and not running)
        else:
            # D10: the kubelet's worker ends for an exited container only when nothing will
            # restart it; through CRI alone that is when the pod's sandbox is down (the pod is
            # finished or gone), since the restartPolicy is not visible (docs: "differs").
            will_restart = not sandbox_down
            deleting = sandbox_down
            # The kubelet stops the sandbox of a finished pod, and of a deleted one once its
            # containers are dead (after RemovePod): either way its workers end silently.
            finished = sandbox_down and not running
        return ContainerView(
            id=container.id,
            running=running,
            # D13: the kubelet's status cache keeps StartedAt at whole seconds (RFC 3339).
            started_at=float(container.started_at // 1_000_000_000),
            started=running and self._started(slot),
            terminated=exited,
            will_restart=will_restart,
            deleting=deleting,
            pod_finished=finished,
        )

    def _runner(
        self, slot: Slot, resolved: ResolvedProbe
    ) -> Callable[[ContainerView], Awaitable[ProbeOutcome]]:
        async def run(view: ContainerView) -> ProbeOutcome:
            target = ProbeTarget.of(slot.container, resolved.ports, container_id=view.id)
            if resolved.env is not None:
                # E1: a pod spec's probe expands $(VAR) with the spec's static env only.
                target = dataclasses.replace(target, env=resolved.env)
            return await self.prober.run(resolved.probe, target, origin=resolved.origin)

        return run

    # -- consuming results ----------------------------------------------------------------------

    def _on_result(self, update: ResultUpdate) -> None:
        slot = self._by_container_id.get(update.container_id)
        if slot is None:
            return
        worker = slot.workers.get(update.kind)
        record = worker.last_record if worker is not None else None
        log.info(
            "probe_transition",
            container=slot.label,
            container_id=update.container_id[:13],
            probe=update.kind.value,
            previous=update.previous.value if update.previous else None,
            result=update.result.value,
            consecutive=worker.result_run if worker is not None else 0,
            output=_excerpt(record.output) if record is not None else "",
        )
        output = (
            record.output
            if record is not None and record.container_id == update.container_id
            else ""
        )
        self.events.publish(
            ResultChanged(
                container=slot.container,
                kind=update.kind,
                previous=update.previous,
                result=update.result,
                consecutive=worker.result_run if worker is not None else 0,
                output=output,
                health=self.health(slot),
            )
        )
        # §5.2: the kubelet syncs the pod on every readiness and startup change and on a
        # liveness Failure; the sync re-triggers readiness (§3.8) and kills what must die.
        if update.kind is not ProbeKind.LIVENESS or update.result is Published.FAILURE:
            self.request_sync(slot.key.pod_uid)

    # -- pod syncs (the parts of the kubelet's SyncPod that follow probe results) ---------------

    def request_sync(self, pod_uid: str) -> None:
        """Sync the pod soon (coalesced), as the kubelet's pod worker would after an update."""
        if pod_uid not in self._by_pod:
            return
        if not self._sync_requested:
            asyncio.get_running_loop().call_soon(self._run_requested_syncs)
        self._sync_requested.add(pod_uid)

    def _run_requested_syncs(self) -> None:
        pods, self._sync_requested = self._sync_requested, set()
        for pod_uid in pods:
            self._sync_pod(pod_uid)

    def _sync_pod(self, pod_uid: str) -> None:
        keys = self._by_pod.get(pod_uid)
        if not keys:
            return
        for key in list(keys):
            slot = self._slots.get(key)
            if slot is None:
                continue
            self._maybe_trigger_readiness(slot)
            self._maybe_stop(slot)
        self._schedule_resync(pod_uid)

    def _schedule_resync(self, pod_uid: str, delay: float | None = None) -> None:
        if delay is None:
            delay = POD_RESYNC_SECONDS
        due = time.monotonic() + delay * (1 + self._rng.random() * SYNC_JITTER)
        self._next_resync[pod_uid] = due
        heapq.heappush(self._resync_heap, (due, pod_uid))
        if not self._closed and not self._supervisor.running(RESYNC_TASK):
            # It ends when the node has no pods left (returning is its normal end), and the
            # next pod starts it again.
            self._supervisor.start(RESYNC_TASK, self._resync_loop, policy="restart", forever=False)

    async def _resync_loop(self) -> None:
        """Sync every pod again when its resync (or back-off after a failed stop) is due."""
        self._rearm_resyncs()
        while self._by_pod:
            await asyncio.sleep(RESYNC_TICK_SECONDS)
            now = time.monotonic()
            heap = self._resync_heap
            while heap and heap[0][0] <= now:
                due, pod_uid = heapq.heappop(heap)
                if self._next_resync.get(pod_uid) == due:
                    self._sync_pod(pod_uid)
        # No pods left: end, and let the next pod start the clock again.
        self._resync_heap.clear()

    def _rearm_resyncs(self) -> None:
        """(Re)starting: a pod whose resync was due, or was being run when the loop failed, gets
        the next regular one, so one pod's failing sync cannot hold up the others'."""
        now = time.monotonic()
        for pod_uid in self._by_pod:
            due = self._next_resync.get(pod_uid)
            if due is None or due <= now:
                self._schedule_resync(pod_uid)

    def _maybe_trigger_readiness(self, slot: Slot) -> None:
        """§3.8: a started container whose readiness is not Success is probed at once.

        A worker in its start-up jitter keeps the trigger until after its first step, so this
        never lines the node's readiness probes up.
        """
        worker = slot.workers.get(ProbeKind.READINESS)
        if worker is None or not self.health(slot).started:
            return
        if self.results.get(slot.container.id, ProbeKind.READINESS) is not Published.SUCCESS:
            worker.trigger()

    def _maybe_stop(self, slot: Slot) -> None:
        """§5.2 (stop mode): stop a running container whose liveness, else startup, failed.

        Checked on every pod sync, so a stop that failed is tried again (D7); never while one is
        in flight for the container, so a second, shorter stop cannot cut a shutdown short.
        """
        container = slot.container
        if (
            self.on_failure != "stop"
            or container.state is not ContainerState.CONTAINER_RUNNING
            or container.id in self._stopping
        ):
            return
        for kind in (ProbeKind.LIVENESS, ProbeKind.STARTUP):
            worker = slot.workers.get(kind)
            if (
                worker is not None
                and worker.failed_container == container.id
                and self.results.get(container.id, kind) is Published.FAILURE
            ):
                self._stopping.add(container.id)
                # D18: the stop acts on this container, whatever the slot holds by then.
                self._spawn(self._stop_container(slot, container, kind))
                return

    async def _stop_container(self, slot: Slot, container: ContainerInfo, kind: ProbeKind) -> None:
        assert self._stopper is not None
        full_grace = kill_grace(slot.specs.get(kind), container.annotations, slot.pod_spec)
        grace = max(full_grace, MIN_GRACE_SECONDS)
        label = ContainerRef.of(container).label
        log.warning(
            "container_stopping",
            container=label,
            container_id=container.id[:13],
            reason=f"failed {kind.value} probe",
            grace_seconds=grace,
        )
        try:
            # D6: the kubelet runs the preStop hook first, within the grace period, and gives
            # StopContainer what is left of it (at least 2 s).
            hook = pre_stop_hook(container.annotations)
            if isinstance(hook, InvalidPreStop):
                log.warning("pre_stop_hook_invalid", container=label, error=hook.message)
            elif hook is not None and full_grace > 0:
                target = ProbeTarget.of(container, self.named_ports(container.id))
                run = await run_pre_stop(
                    hook, target, grace_seconds=full_grace, exec_runner=self._stopper
                )
                grace = run.remaining_grace
                log.info(
                    "pre_stop_hook_ran",
                    container=label,
                    hook=run.kind,
                    outcome=run.outcome.value,
                    seconds=round(run.seconds, 3),
                    message=run.message,
                    grace_seconds=grace,
                )
            await self._stopper.stop_container(container.id, grace_seconds=grace)
        except CriError as exc:
            log.error("container_stop_failed", container=label, error=str(exc))
            # The kubelet's sync failed: its pod worker tries again after the back-off.
            self._schedule_resync(slot.key.pod_uid, SYNC_BACKOFF_SECONDS)
        finally:
            self._stopping.discard(container.id)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- shutdown -------------------------------------------------------------------------------

    async def shutdown(self, grace: float = 5.0) -> None:
        """Stop every worker, wait up to ``grace`` seconds for them, then cancel stragglers."""
        self._closed = True
        if self._owns_supervisor:
            await self._supervisor.stop()
        else:
            await self._supervisor.stop([RESYNC_TASK])
        tasks: list[asyncio.Task[None]] = []
        for slot in list(self._slots.values()):
            tasks.extend(slot.tasks.values())
            for worker in slot.workers.values():
                worker.stop()
        tasks.extend(self._background)
        if not tasks:
            return
        _done, pending = await asyncio.wait(tasks, timeout=grace)
        for task in pending:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*pending, return_exceptions=True)

    def worker_count(self) -> int:
        """How many workers are running."""
        return sum(len(slot.workers) for slot in self._slots.values())


def grace_period(resolved: ResolvedProbe | None, annotations: Mapping[str, str]) -> int:
    """§5.3: the StopContainer grace of a probe-triggered stop without a preStop hook."""
    return max(kill_grace(resolved, annotations), MIN_GRACE_SECONDS)


def kill_grace(
    resolved: ResolvedProbe | None,
    annotations: Mapping[str, str],
    pod_spec: PodSpec | None = None,
) -> int:
    """§5.3: a deleted pod's grace, else the probe's, else the pod's, else 30 (before the 2 s
    floor, which applies after a preStop hook's time is taken off).

    The pod's grace periods come from its spec when there is one (it is newer: a pod's
    deletionGracePeriodSeconds is set only once it is deleted), else from the kubelet's
    annotations. The kubelet uses the probe's value only when the pod's is set, which the API's
    defaulting always does; for containers not made by a kubelet (no pod annotation) the probe's
    counts.
    """
    grace: int | None = None
    if pod_spec is not None and pod_spec.deleting:
        grace = pod_spec.deletion_grace_seconds
    if grace is None:
        grace = _annotated_seconds(annotations, DELETION_GRACE_ANNOTATION)
    if grace is None and resolved is not None:
        grace = resolved.probe.termination_grace_period_seconds
    if grace is None:
        grace = (
            pod_spec.termination_grace_seconds
            if pod_spec is not None
            else _annotated_seconds(annotations, GRACE_ANNOTATION)
        )
    if grace is None:
        grace = DEFAULT_GRACE_SECONDS
    return grace


def _annotated_seconds(annotations: Mapping[str, str], key: str) -> int | None:
    with contextlib.suppress(ValueError, TypeError):
        return int(json.loads(annotations.get(key, "null")))
    return None


def _excerpt(output: str) -> str:
    return shorten(output, OUTPUT_LOG_BYTES)
