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
import json
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

import structlog

from cri_prober.discovery.model import ContainerInfo, EventKind, LifecycleEvent, PodInfo
from cri_prober.errors import CriError, CriProberError
from cri_prober.manager.events import (
    AttemptFinished,
    ContainerGone,
    ManagerEvent,
    Reconciled,
    ResultChanged,
    WorkerStopped,
)
from cri_prober.manager.state import Health, ProbeState
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.outcome import ProbeOutcome
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
from cri_prober.probing.worker import ContainerView, ProbeWorker
from cri_prober.runtime.client import ContainerState
from cri_prober.topic import Topic

log = structlog.get_logger(__name__)

OVERRIDE_ANNOTATION_PREFIX = "probes.cri-prober.io/"
GRACE_ANNOTATION = "io.kubernetes.pod.terminationGracePeriod"
DEFAULT_GRACE_SECONDS = 30
MIN_GRACE_SECONDS = 2
# The kubelet's crash-loop back-off tops out at 5 minutes: an exited container whose pod is still
# up may be restarted until then; after that (plus slack) nobody will, and its workers end.
RESTART_WAIT_SECONDS = 300 + 30
OUTPUT_LOG_BYTES = 256

OnFailure = Literal["report", "stop"]


class Stopper(Protocol):
    """The CRI call ``--on-failure stop`` needs (``CriClient`` provides it)."""

    async def stop_container(self, container_id: str, *, grace_seconds: int) -> None: ...


class NoSuchProbe(CriProberError):
    """The container has no probe of that kind configured."""


class ProbeNotRunning(CriProberError):
    """The probe is configured but its worker ended (the container is gone for good)."""


@dataclass(frozen=True, slots=True)
class SlotKey:
    """A container slot: the kubelet keys probe workers by pod UID and container name."""

    pod_uid: str
    container: str


@dataclass
class Slot:
    """The newest attempt of one container of one pod, its probe specs and workers."""

    key: SlotKey
    container: ContainerInfo
    specs: dict[ProbeKind, ResolvedProbe] = field(default_factory=dict)
    workers: dict[ProbeKind, ProbeWorker] = field(default_factory=dict)
    tasks: dict[ProbeKind, asyncio.Task[None]] = field(default_factory=dict)

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
    ) -> None:
        if on_failure == "stop" and stopper is None:
            raise ValueError("on_failure='stop' needs a stopper")
        self.prober = prober
        self.rules = rules
        self.results = results or ResultsStore()
        self.prober_started_at = prober_started_at if prober_started_at is not None else time.time()
        self.on_failure = on_failure
        # The one stream servers, metrics and tests follow (see ``cri_prober.manager.events``).
        self.events: Topic[ManagerEvent] = Topic("manager")
        self._stopper = stopper
        self._history_size = history_size
        self._wall = wall_clock
        self._slots: dict[SlotKey, Slot] = {}
        self._by_container_id: dict[str, Slot] = {}
        # Workers that ended on their own for a container (it exited for good): not recreated
        # for that same container ID.
        self._finished: set[tuple[SlotKey, ProbeKind, str]] = set()
        self._override_cache: dict[tuple[str, str], ContainerOverride | None] = {}
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
        result = self.results.get(slot.container.id, kind)
        if result is None:
            return worker.state_preserved
        return result is Published.SUCCESS

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
        self.reconcile(containers)
        self.events.publish(Reconciled(len(self._slots)))

    def on_lifecycle(
        self, events: Iterable[LifecycleEvent], containers: Iterable[ContainerInfo]
    ) -> None:
        """React to a batch of discovery events: reconcile once, then re-check readiness."""
        self.reconcile(containers)
        for event in events:
            if event.container is None:
                continue
            slot = self._by_container_id.get(event.container.id)
            if slot is None:
                continue
            if event.kind is EventKind.DIED:
                # Step (7) publishes Failure for a container that is not running; run it now
                # rather than at each worker's next tick, so the transition follows the exit.
                for worker in slot.workers.values():
                    worker.trigger()
            else:
                self._maybe_trigger_readiness(slot)
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

        for key, info in newest.items():
            specs = self._specs_for(info)
            slot = self._slots.get(key)
            if slot is None:
                if not specs:
                    continue
                slot = Slot(key=key, container=info)
                self._slots[key] = slot
            elif slot.container.id != info.id:
                self._by_container_id.pop(slot.container.id, None)
            slot.container = info
            self._by_container_id[info.id] = slot
            self._sync_workers(slot, specs)
            if not slot.workers and not specs:
                self._drop_slot(slot)

    def _specs_for(self, info: ContainerInfo) -> dict[ProbeKind, ResolvedProbe]:
        override = self._override(info.pod, info.name)
        return select_probes(
            self.rules,
            namespace=info.pod.namespace,
            pod=info.pod.name,
            container=info.name,
            labels=info.labels,
            pod_labels=info.pod.labels,
            override=override,
        )

    def _override(self, pod: PodInfo, container: str) -> ContainerOverride | None:
        annotation = OVERRIDE_ANNOTATION_PREFIX + container
        value = pod.annotations.get(annotation)
        if value is None:
            return None
        cache_key = (pod.sandbox_id + "/" + container, value)
        if cache_key not in self._override_cache:
            source = f"pod {pod.namespace}/{pod.name} annotation {annotation}"
            try:
                self._override_cache[cache_key] = parse_annotation(value, source=source)
            except SpecError as exc:
                # A bad annotation must not take the file's probes away: report it, use the file.
                log.error("bad_probe_annotation", error=str(exc))
                self._override_cache[cache_key] = None
        return self._override_cache[cache_key]

    def _sync_workers(self, slot: Slot, specs: dict[ProbeKind, ResolvedProbe]) -> None:
        for kind in list(slot.workers):
            if specs.get(kind) != slot.specs.get(kind):
                self._stop_worker(slot, kind)
        slot.specs = specs
        # The kubelet creates workers in the order startup, readiness, liveness.
        for kind in (ProbeKind.STARTUP, ProbeKind.READINESS, ProbeKind.LIVENESS):
            if kind in specs and kind not in slot.workers:
                if (slot.key, kind, slot.container.id) in self._finished:
                    continue
                self._start_worker(slot, kind)

    def _start_worker(self, slot: Slot, kind: ProbeKind) -> None:
        resolved = slot.specs[kind]
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
        )
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
        self.events.publish(ContainerGone(slot.container))
        self._finished = {f for f in self._finished if f[0] != slot.key}
        self._override_cache = {
            k: v
            for k, v in self._override_cache.items()
            if not k[0].startswith(slot.pod.sandbox_id)
        }

    def _worker_exited(self, slot: Slot, kind: ProbeKind, worker: ProbeWorker) -> None:
        if slot.workers.get(kind) is worker:
            # It ended by itself: the container exited for good. Don't recreate it for this ID.
            slot.workers.pop(kind, None)
            slot.tasks.pop(kind, None)
            if worker.container_id is not None:
                self._finished.add((slot.key, kind, worker.container_id))
        self.events.publish(WorkerStopped(slot.container, kind, replaced=kind in slot.workers))

    # -- what workers see -----------------------------------------------------------------------

    def _view(self, slot: Slot) -> ContainerView | None:
        container = slot.container
        if not container.id:
            return None
        running = container.state is ContainerState.CONTAINER_RUNNING
        exited = container.state is ContainerState.CONTAINER_EXITED
        # Nobody restarts a container of a torn-down pod, nor one that has been dead for longer
        # than the kubelet's maximum back-off.
        will_restart = container.pod.ready and (
            not exited
            or container.finished_at == 0
            or self._wall() - container.finished_at / 1e9 < RESTART_WAIT_SECONDS
        )
        return ContainerView(
            id=container.id,
            running=running,
            started_at=container.started_at / 1e9,
            started=running and self._started(slot),
            terminated=exited,
            will_restart=will_restart,
            deleting=not container.pod.ready,
        )

    def _runner(
        self, slot: Slot, resolved: ResolvedProbe
    ) -> Callable[[ContainerView], Awaitable[ProbeOutcome]]:
        async def run(view: ContainerView) -> ProbeOutcome:
            target = ProbeTarget.of(slot.container, resolved.ports, container_id=view.id)
            return await self.prober.run(resolved.probe, target)

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
        if update.kind is ProbeKind.STARTUP and update.result is Published.SUCCESS:
            self._maybe_trigger_readiness(slot)
        if (
            update.result is Published.FAILURE
            and update.kind in (ProbeKind.LIVENESS, ProbeKind.STARTUP)
            and self.on_failure == "stop"
            and slot.container.state is ContainerState.CONTAINER_RUNNING
            and worker is not None
            and worker.probes_run > 0
        ):
            self._spawn(self._stop_container(slot, update.kind))

    def _maybe_trigger_readiness(self, slot: Slot) -> None:
        """§3.8: a started container whose readiness has not passed is probed at once."""
        worker = slot.workers.get(ProbeKind.READINESS)
        # A worker that has not stepped yet probes on its own first step; triggering it would
        # also cut short its start-up jitter and line every readiness probe on the node up.
        if worker is None or worker.container_id is None:
            return
        if not self.health(slot).started:
            return
        if self.results.get(slot.container.id, ProbeKind.READINESS) is not Published.SUCCESS:
            worker.trigger()

    async def _stop_container(self, slot: Slot, kind: ProbeKind) -> None:
        assert self._stopper is not None
        container = slot.container
        grace = grace_period(slot.specs.get(kind), container.annotations)
        log.warning(
            "container_stopping",
            container=slot.label,
            container_id=container.id[:13],
            reason=f"failed {kind.value} probe",
            grace_seconds=grace,
        )
        try:
            await self._stopper.stop_container(container.id, grace_seconds=grace)
        except CriError as exc:
            log.error("container_stop_failed", container=slot.label, error=str(exc))

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- shutdown -------------------------------------------------------------------------------

    async def shutdown(self, grace: float = 5.0) -> None:
        """Stop every worker, wait up to ``grace`` seconds for them, then cancel stragglers."""
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
    """§5.3: the probe's terminationGracePeriodSeconds, else the pod's, else 30; at least 2."""
    grace: int | None = None
    if resolved is not None:
        grace = resolved.probe.termination_grace_period_seconds
    if grace is None:
        with contextlib.suppress(ValueError, TypeError):
            grace = int(json.loads(annotations.get(GRACE_ANNOTATION, "null")))
    if grace is None:
        grace = DEFAULT_GRACE_SECONDS
    return max(grace, MIN_GRACE_SECONDS)


def _excerpt(output: str) -> str:
    return output if len(output) <= OUTPUT_LOG_BYTES else output[:OUTPUT_LOG_BYTES] + "…"
