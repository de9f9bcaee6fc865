"""The probe manager: one worker per (pod, container name, probe kind), reconciled with the node.

It plays the kubelet's prober manager and the parts of its sync loop that consume probe results:
it keeps the set of workers equal to (containers x matching probe specs), hands each worker a
view of the newest attempt of its container, publishes every result change, and asks for pod
syncs as the kubelet does. The jobs it delegates each have their own module: slots (``slots``),
which probes a container gets (``selection``), the read model (``status``), pod syncs
(``pod_sync``) and ``--on-failure stop`` (``stopping``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import random
import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

import structlog

from cri_prober.aio import Supervisor
from cri_prober.discovery.model import ContainerInfo, EventKind, LifecycleEvent, PodInfo
from cri_prober.manager.api import NoSuchProbe, ProbeNotRunning, ProbeOnHold
from cri_prober.manager.events import (
    AttemptFinished,
    AttemptsRepeated,
    ContainerGone,
    ManagerTopic,
    Reconciled,
    ResultChanged,
    WorkerStopped,
)
from cri_prober.manager.memory import Remembered
from cri_prober.manager.pod_sync import RESYNC_TASK, PodSyncs
from cri_prober.manager.selection import (
    OVERRIDE_ANNOTATION_PREFIX,
    AnnotationMode,
    PodSpecProbes,
    ProbeSelection,
)
from cri_prober.manager.slots import Slot, SlotKey, SlotTable
from cri_prober.manager.state import Health, ProbedContainer, ProbeState
from cri_prober.manager.status import StatusModel
from cri_prober.manager.stopping import (
    FailureHold,
    FailureStops,
    OnFailure,
    Stopper,
    grace_period,
    kill_grace,
)
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.kubelet_profile import KubeletProfile
from cri_prober.probing.mirror import FailureTexts, MirroredAttempts, MirrorWorker
from cri_prober.probing.outcome import ProbeError, ProbeOutcome, Reason, shorten
from cri_prober.probing.pressure import Pressure
from cri_prober.probing.prober import PreparedProbe, Prober, ProbeTarget, run_once
from cri_prober.probing.results import ProbeRecord, Published, ResultsStore, ResultUpdate
from cri_prober.probing.spec import ResolvedProbe, RulesFile
from cri_prober.probing.worker import ContainerView, ProbeWorker
from cri_prober.runtime.model import ContainerState

if TYPE_CHECKING:
    from cri_prober.podspecs.model import PodSpec
    from cri_prober.probing.spec import Probe

log = structlog.get_logger(__name__)

OUTPUT_LOG_BYTES = 256
# Slots whose workers tell their held-back repeats per step of a catch-up: about 1-2 ms of work
# (a few hundred AttemptsRepeated events through their listeners) between two turns of the loop.
TELL_STEP = 256
# How long after a pod's listing grace ends (the registry's clock) the manager looks again.
LISTING_TIMER_SLACK = 0.05

__all__ = [
    "OVERRIDE_ANNOTATION_PREFIX",
    "RESYNC_TASK",
    "AnnotationMode",
    "FailureHold",
    "NoSuchProbe",
    "OnFailure",
    "PodSpecLookup",
    "ProbeManager",
    "ProbeNotRunning",
    "Stopper",
    "grace_period",
    "kill_grace",
]


class PodSpecLookup(Protocol):
    """Pod specs from ``serve --probes-from`` (``cri_prober.podspecs.registry.PodSpecs``)."""

    def lookup(self, uid: str, namespace: str, name: str) -> PodSpec | None: ...

    def retain(self, live: set[str]) -> None: ...

    def unlisted_wait(self, uid: str, namespace: str, name: str) -> float | None: ...


class _WorkerHook:
    """One worker's view of its slot: its container's status, its probe runner, and its reports
    passed to the manager with the worker's slot and kind attached.

    One slotted object per worker, whose bound methods the worker is given: closures for the
    status and the runner took about 300 bytes more per worker (issue 25: a node's memory).
    """

    __slots__ = ("_aimed_at", "_kind", "_manager", "_prepared", "_resolved", "_slot")

    def __init__(
        self, manager: ProbeManager, slot: Slot, kind: ProbeKind, resolved: ResolvedProbe
    ) -> None:
        self._manager = manager
        self._slot = slot
        self._kind = kind
        self._resolved = resolved
        # The probe resolved for its target (issue 36: an attempt only sends), and the container
        # object it was checked against: discovery replaces that object when anything changes.
        self._prepared: PreparedProbe | None = None
        self._aimed_at: ContainerInfo | None = None

    def status(self) -> ContainerView | None:
        return self._manager.status.view(self._slot)

    def _prepare(self, view: ContainerView) -> PreparedProbe:
        """The prepared probe for this attempt: the kept one while the container (the same
        object, or an equal target built from a new one), the attempt shown, the prober and its
        settings are as they were; else one built anew, so that a changed pod IP, port or env
        is used from the next attempt on, as the kubelet's are."""
        container = self._slot.container
        prober = self._manager.prober
        prepared = self._prepared
        if (
            prepared is not None
            and container is self._aimed_at
            and prepared.prober is prober
            and prepared.generation == prober.generation
            and prepared.target.container_id == view.id
        ):
            return prepared
        resolved = self._resolved
        target = ProbeTarget.of(container, resolved.ports, container_id=view.id)
        if resolved.env is not None:
            # E1: a pod spec's probe expands $(VAR) with the spec's static env only.
            target = dataclasses.replace(target, env=resolved.env)
        if prepared is None or not prepared.fits(prober, resolved.probe, target, resolved.origin):
            prepared = prober.prepare(resolved.probe, target, origin=resolved.origin)
            self._prepared = prepared
        self._aimed_at = container
        return prepared

    async def run_probe(self, view: ContainerView) -> ProbeOutcome:
        resolved = self._resolved
        prepared = self._prepare(view)
        if (
            view.deleting
            and self._kind is ProbeKind.READINESS
            and resolved.probe.exec is not None
            and self._manager.kubelet.readiness_exec_canceled_at_teardown
        ):
            # Kubelet 1.35 (kubernetes #140881): the pod worker cancelled the probe workers'
            # context at teardown, so the exec failed at once and the worker discarded it.
            raise ProbeError(
                "rpc error: code = Canceled desc = context canceled "
                "(kubelet 1.35 during pod termination, kubernetes #140881: not counted)",
                reason=Reason.RUNTIME_ERROR,
            )
        try:
            outcome = await prepared.run()
        except ProbeError as exc:
            if exc.reason == Reason.UNSUPPORTED:
                self._manager._unsupported_probe(self._slot, self._kind, str(exc))
            raise
        if (
            outcome.timed_out
            and resolved.probe.exec is not None
            and not self._manager.kubelet.gate("ExecProbeTimeout")
        ):
            # ExecProbeTimeout off (settable up to 1.34, locked on from 1.35): the kubelet's
            # exec prober answers Unknown with the timeout error (pkg/probe/exec/exec.go,
            # release-1.28), and the worker discards such an attempt as errored.
            raise ProbeError(
                f"{outcome.output} (ExecProbeTimeout=false: not counted)", reason=Reason.TIMEOUT
            )
        return outcome

    def attempt_finished(self, worker: ProbeWorker, record: ProbeRecord) -> None:
        self._manager.events.publish(AttemptFinished(self._slot.container, self._kind, record))

    @property
    def takes_runs(self) -> bool:
        return self._manager.events.takes_runs

    def attempts_repeated(self, worker: ProbeWorker, count: int) -> None:
        history = worker.history
        self._manager.events.publish(
            AttemptsRepeated(
                self._slot.container,
                self._kind,
                history[-1],
                history.durations(count),
                history.starts(count),
            )
        )

    def result_changed(self, worker: ProbeWorker, update: ResultUpdate) -> None:
        self._manager._result_changed(self._slot, update)

    def worker_stopped(self, worker: ProbeWorker) -> None:
        self._manager._worker_exited(self._slot, self._kind, worker)


def _same_probe(a: ResolvedProbe, b: ResolvedProbe) -> bool:
    """The same probe from the same place (``ResolvedProbe`` equality leaves the origin out)."""
    return a == b and a.origin == b.origin


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
        probe_on_exit: bool = True,
        rng: random.Random | None = None,
        remembered: Mapping[str, Remembered] | None = None,
        annotations: AnnotationMode = "all",
        pod_spec_probes: PodSpecProbes = "all",
        pod_specs: PodSpecLookup | None = None,
        rules_source: str = "",
        supervisor: Supervisor | None = None,
        failure_hold: FailureHold = "auto",
        pressure: Callable[[], Pressure | None] | None = None,
        kubelet: KubeletProfile | None = None,
        mirror: bool = False,
        mirror_explain: bool = False,
    ) -> None:
        if on_failure == "stop" and stopper is None:
            raise ValueError("on_failure='stop' needs a stopper")
        self.prober = prober
        self.results = results or ResultsStore()
        self.prober_started_at = prober_started_at if prober_started_at is not None else time.time()
        self.on_failure = on_failure
        self.failure_hold = failure_hold
        self._pressure = pressure
        # serve --probes-from: the pods' own specs, which come before the rules file.
        self.pod_specs = pod_specs
        # The one stream servers, metrics and tests follow (see ``cri_prober.manager.events``).
        self.events = ManagerTopic("manager")
        self.events.flush = self._tell_repeats
        self._history_size = history_size
        # D9: run every worker of a container that died at once, so its Failure follows the exit
        # (cri-prober's speed-up); False keeps the kubelet's timing (each at its next tick).
        self.probe_on_exit = probe_on_exit
        self._slots = SlotTable()
        # Pods whose unsupported probe was logged (``probe_unsupported``, once per pod): one
        # UID per pod on the node at most, dropped with the pod's last slot.
        self._unsupported_logged: set[str] = set()
        self.selection = ProbeSelection(rules, annotations=annotations, rules_source=rules_source)
        self.selection.pod_spec_probes = pod_spec_probes  # serve --pod-spec-probes
        self.selection.sidecars = (kubelet or KubeletProfile()).gate("SidecarContainers")
        self.status = StatusModel(
            self._slots,
            self.results,
            prober_started_at=self.prober_started_at,
            remembered=remembered,
            kubelet=kubelet,
        )
        # The pod-resync clock runs under the daemon's supervisor (restarted if it fails); a
        # manager built alone (tests) has its own.
        self._owns_supervisor = supervisor is None
        self._supervisor = supervisor or Supervisor()
        self.syncs = PodSyncs(
            self._sync_pod, self._slots, supervisor=self._supervisor, rng=rng or random.Random()
        )
        self._stops = (
            FailureStops(
                stopper,
                self.results,
                named_ports=self.status.named_ports,
                retry_later=self.syncs.retry_later,
            )
            if on_failure == "stop" and stopper is not None
            else None
        )
        # Gate for new workers joining the pod-admission tick grid (D4); off while reloading.
        self._anchor_new_workers = True
        # Workers that ended on their own for a container (it exited for good): not recreated
        # for that same container ID.
        self._finished: set[tuple[SlotKey, ProbeKind, str]] = set()
        # Workers stopped while their container lived on (its pod left the pod specs' view past
        # the missing-pod grace, as a source gap does), by container ID and kind, with the probe
        # they ran: a worker started again for that same container and probe takes over their
        # published result, hold and counts (issue 34), as the kubelet's one worker per pod keeps
        # them. Kept only while the container is a newest attempt on the node (see reconcile).
        self._kept: dict[tuple[str, ProbeKind], tuple[ProbeWorker, ResolvedProbe]] = {}
        # serve --probes-from: containers of pods no source lists yet, which get no worker until
        # a source lists the pod or its listing grace passes (D8: the kubelet never probes a
        # container it has no pod spec for); the timer reconciles again when a grace ends.
        self._waiting: set[SlotKey] = set()
        # The newest attempts the last reconcile saw (its own dict, never changed after), for
        # the listing timer's reconcile.
        self._seen: Mapping[SlotKey, ContainerInfo] = {}
        self._listing_timer: asyncio.TimerHandle | None = None
        # serve --mirror: the pod spec's probes (the ones the kubelet runs) get a MirrorWorker,
        # fed the kubelet's attempts (on_mirrored) and pod status, instead of running them.
        self.mirror = mirror
        # --mirror-explain rerun: a mirror worker runs its probe once on a new kubelet failure.
        self.mirror_explain = mirror_explain
        # serve --mirror with --probes-from apiserver: the kubelet's Unhealthy event texts
        # (podspecs/unhealthy_events.py), a mirrored failure's output; set by the daemon.
        self.mirror_texts: FailureTexts | None = None
        self.mirrored_attempts = 0  # kubelet attempts recorded by mirror workers
        self.mirror_unmatched = 0  # kubelet attempts of probes no mirror worker stands for

    # -- configuration --------------------------------------------------------------------------

    @property
    def rules(self) -> RulesFile:
        return self.selection.rules

    @rules.setter
    def rules(self, rules: RulesFile) -> None:
        self.selection.rules = rules

    @property
    def annotations(self) -> AnnotationMode:
        return self.selection.annotations

    @property
    def remembered(self) -> dict[str, Remembered]:
        """D5: started/ready of each container as the previous cri-prober left them."""
        return self.status.remembered

    # -- queries (the ProbeService surface, and the daemon's) -----------------------------------

    def probed(self) -> list[ProbedContainer]:
        """Every container with at least one probe configured (newest attempts only)."""
        return [self._probed(slot) for slot in self._slots]

    def probed_container(self, container_id: str) -> ProbedContainer | None:
        """The probed container whose newest attempt has this ID, if any."""
        slot = self._slots.for_container(container_id)
        return self._probed(slot) if slot is not None else None

    def _probed(self, slot: Slot) -> ProbedContainer:
        return ProbedContainer(
            container=slot.container,
            health=self.status.health(slot),
            probes=self.status.probe_states(slot.container.id),
            terminating=slot.pod_spec is not None and slot.pod_spec.deleting,
        )

    def container_health(self, info: ContainerInfo) -> Health:
        """The derived state of any container; one without probes is healthy while it runs.

        With pod specs, an ordinary init container that exited 0 is ready, as in the kubelet's
        status (UpdatePodStatus, pkg/kubelet/prober/prober_manager.go: a non-restartable init
        container is ready once terminated with exit code 0); started stays false.
        """
        health = self.status.container_health(info)
        if (
            info.state is ContainerState.CONTAINER_EXITED
            and info.exit_code == 0
            and self._slots.for_container(info.id) is None
        ):
            spec = self._pod_spec(info.pod)
            if spec is not None and info.name in spec.init_containers:
                return dataclasses.replace(health, ready=True)
        return health

    def probe_states(self, container_id: str) -> tuple[ProbeState, ...]:
        """The configured probes of this container (newest attempt only), liveness first."""
        return self.status.probe_states(container_id)

    def named_ports(self, container_id: str) -> dict[str, int]:
        """Every named port the container's configured probes can use."""
        return self.status.named_ports(container_id)

    def remembered_state(self) -> dict[str, Remembered]:
        """started/ready of every running probed container, for the state file."""
        return self.status.remembered_state()

    def retain_remembered(self, live: Container[str]) -> None:
        """Forget the remembered state of every container whose ID is not in ``live``."""
        self.status.retain_remembered(live)

    def tracked(self) -> int:
        """How many containers have at least one probe configured."""
        return len(self._slots)

    def kept_count(self) -> int:
        """How many stopped workers are kept for a worker of their container to take over."""
        return len(self._kept)

    def worker_count(self) -> int:
        """How many workers are running."""
        return sum(len(slot.workers) for slot in self._slots)

    # -- commands from users --------------------------------------------------------------------

    def probe_now(self, container_id: str, kind: ProbeKind) -> None:
        """Run the container's configured ``kind`` probe at once, as a normal step.

        Raises:
            NoSuchProbe: the container has no such probe configured.
            ProbeNotRunning: the probe's worker ended (the container is gone for good).
            ProbeOnHold: the probe is on hold until the container restarts, or it is a startup
                probe that passed: a step would run nothing.
        """
        slot = self._slots.for_container(container_id)
        if slot is None or kind not in slot.specs:
            raise NoSuchProbe(f"no {kind.value} probe")
        worker = slot.workers.get(kind)
        if isinstance(worker, MirrorWorker):
            raise ProbeNotRunning(
                f"the kubelet runs this {kind.value} probe: cri-prober mirrors its verdicts "
                "(serve --mirror) and runs none itself"
            )
        if worker is None or worker.stopped:
            raise ProbeNotRunning(
                f"the {kind.value} probe is not running (the container is gone for good)"
            )
        state = worker.snapshot()
        if state.holds(slot.container.id):
            if state.held_after:
                raise ProbeOnHold(
                    f"the {kind.value} probe is on hold until the container restarts (its "
                    f"failure was published after {state.held_after} in a row)"
                )
            raise ProbeOnHold(f"the {kind.value} probe passed: it runs no more for this container")
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
        self.selection.rules = rules
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
                slot = self._slots.for_container(event.container.id)
                if slot is not None and event.kind is EventKind.DIED and self.probe_on_exit:
                    # D9: step (7) publishes Failure for a container that is not running; run it
                    # now rather than at each worker's next tick, so the transition follows the
                    # exit. The kubelet's workers notice at their own next tick.
                    for worker in slot.workers.values():
                        worker.trigger()
            if event.kind is EventKind.POD_CHANGED and event.container is None and pod is not None:
                self._expect_spec(pod)
            if event.kind is EventKind.REMOVED and event.container is not None:
                self.status.forget(event.container.id)  # gone for good
            # Every PLEG event but a removal syncs its pod.
            removal = event.kind in (EventKind.REMOVED, EventKind.POD_REMOVED)
            if pod is not None and not removal:
                self.request_sync(pod.uid or pod.sandbox_id)
        self.events.publish(Reconciled(len(self._slots)))

    def on_pod_specs(self, containers: Iterable[ContainerInfo]) -> None:
        """A pod spec source changed its view: reconcile, then sync every pod whose spec changed
        (the kubelet syncs a pod on every update from its sources, deletion included)."""
        before = {slot.key: slot.pod_spec for slot in self._slots}
        self.reconcile(containers)
        for slot in self._slots:
            if slot.key not in before or before[slot.key] is not slot.pod_spec:
                self.request_sync(slot.key.pod_uid)
        self.events.publish(Reconciled(len(self._slots)))

    def reconcile(self, containers: Iterable[ContainerInfo]) -> None:
        """Make the workers match (newest attempt of every container) x (its probe specs)."""
        newest: dict[SlotKey, ContainerInfo] = {}
        for info in containers:
            key = SlotKey.of(info)
            current = newest.get(key)
            if current is None or (info.attempt, info.created_at) > (
                current.attempt,
                current.created_at,
            ):
                newest[key] = info

        for key in self._slots.keys() - newest.keys():
            slot = self._slots.get(key)
            if slot is not None:
                self._drop_slot(slot)

        if self.pod_specs is not None:
            live_pods = set()
            for info in newest.values():
                live_pods.add(info.pod.uid)
                live_pods.add(f"{info.pod.namespace}/{info.pod.name}")
            self.pod_specs.retain(live_pods)

        self._seen = newest
        if self._waiting:
            self._waiting &= newest.keys()
        for key, info in newest.items():
            pod_spec = self._pod_spec(info.pod)
            specs = self.selection.specs_for(info, pod_spec)
            slot = self._slots.get(key)
            if slot is None:
                # Whether or not the rules give it probes: its spec may.
                if pod_spec is None and self._awaits_listing(key, info):
                    continue
                if not specs:
                    continue
                slot = self._slots.add(key, info)
                self.syncs.schedule(key.pod_uid)
            self._slots.bind(slot, info)
            slot.pod_spec = pod_spec
            self._sync_workers(slot, specs)
            if self.mirror and pod_spec is not None:
                self._mirror_status(slot, pod_spec)
            if not slot.workers and not specs:
                self._drop_slot(slot)
            elif info.state is not ContainerState.CONTAINER_RUNNING:
                self._publish_exit(slot)

        self.selection.forget_others({(info.pod.sandbox_id, info.name) for info in newest.values()})
        if self._kept:
            # A container gone from the runtime, or replaced by a newer attempt, gets no worker
            # again: what was kept for it goes.
            live = {info.id for info in newest.values()}
            self._kept = {key: kept for key, kept in self._kept.items() if key[0] in live}

    # -- serve --mirror ---------------------------------------------------------------------------

    def on_mirrored(self, attempts: Iterable[MirroredAttempts]) -> int:
        """The kubelet's attempts since its counters were read before: each goes to the mirror
        worker of its probe (by pod UID, container name and kind); returns how many were
        recorded. Attempts of a probe no mirror worker stands for (a container not found yet,
        a probe cri-prober's own annotation replaced) are counted in ``mirror_unmatched``."""
        recorded = 0
        for window in attempts:
            slot = self._slots.get(SlotKey(window.pod_uid, window.container))
            worker = slot.workers.get(window.kind) if slot is not None else None
            if not isinstance(worker, MirrorWorker):
                self.mirror_unmatched += window.total
                continue
            recorded += worker.mirror(window)
            self.mirrored_attempts += window.total
        return recorded

    def _mirror_status(self, slot: Slot, spec: PodSpec) -> None:
        """Hand the kubelet's pod status of the slot's container to its mirror workers."""
        status = spec.statuses.get(slot.key.container)
        if status is None:
            return
        for worker in slot.workers.values():
            if isinstance(worker, MirrorWorker):
                worker.kubelet_status(status)

    def _pod_spec(self, pod: PodInfo) -> PodSpec | None:
        if self.pod_specs is None:
            return None
        return self.pod_specs.lookup(pod.uid, pod.namespace, pod.name)

    def _expect_spec(self, pod: PodInfo) -> None:
        """A new sandbox, before its containers: if no source lists its pod, its listing grace
        starts now and the polled sources read at once (the kubelet admitted the pod already)."""
        if self.pod_specs is not None and self._pod_spec(pod) is None:
            self.pod_specs.unlisted_wait(pod.uid, pod.namespace, pod.name)

    def _awaits_listing(self, key: SlotKey, info: ContainerInfo) -> bool:
        """With --probes-from, a new container of a pod no source lists yet waits for its pod's
        spec (or for the listing grace to pass) before it gets a worker."""
        if self.pod_specs is None:
            return False
        pod = info.pod
        wait = self.pod_specs.unlisted_wait(pod.uid, pod.namespace, pod.name)
        if wait is None:
            self._waiting.discard(key)
            return False
        if key not in self._waiting:
            self._waiting.add(key)
            log.debug(
                "probes_wait_for_pod_spec",
                container=f"{pod.namespace}/{pod.name}/{info.name}",
                pod_uid=pod.uid,
                seconds=round(wait, 3),
            )
        self._arm_listing_timer(wait)
        return True

    def _arm_listing_timer(self, delay: float) -> None:
        """Reconcile again when the earliest listing grace ends (a little after, so the registry
        sees it passed); later ones re-arm it then."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # reconciled outside a loop (a test): the next reconcile decides
            return
        when = loop.time() + delay + LISTING_TIMER_SLACK
        if self._listing_timer is not None:
            if self._listing_timer.when() <= when:
                return
            self._listing_timer.cancel()
        self._listing_timer = loop.call_at(when, self._listing_grace_ended)

    def _listing_grace_ended(self) -> None:
        self._listing_timer = None
        if self._waiting and not self.syncs.closed:
            self.on_pod_specs(self._seen.values())

    def _sync_workers(self, slot: Slot, specs: dict[ProbeKind, ResolvedProbe]) -> None:
        for kind in list(slot.workers):
            new, old = specs.get(kind), slot.specs.get(kind)
            # A worker's runner keeps the origin it started with, and ResolvedProbe equality
            # leaves the origin out: compare it here.
            if new != old or (new is not None and old is not None and new.origin != old.origin):
                # A changed spec is a new probe: its worker starts over (initial value, its own
                # counts, no hold), taking the published result over from the old one so the
                # change shows as a transition. The kubelet has no such path (probe specs of a
                # pod never change); see docs/kubelet-fidelity.md.
                self._stop_worker(slot, kind, handover=new is not None)
        slot.specs = specs
        # The kubelet creates workers in the order startup, readiness, liveness.
        for kind in (ProbeKind.STARTUP, ProbeKind.READINESS, ProbeKind.LIVENESS):
            if kind in specs and kind not in slot.workers:
                if (slot.key, kind, slot.container.id) in self._finished:
                    continue
                self._start_worker(slot, kind)

    @property
    def kubelet(self) -> KubeletProfile:
        """The kubelet release (and gates) whose probe behaviour the workers follow."""
        return self.status.kubelet

    def set_kubelet(self, kubelet: KubeletProfile) -> None:
        """Follow ``kubelet`` from now on (the node's version, read once its Node object is):
        new workers start with it and running ones take it at their next step."""
        if kubelet == self.status.kubelet:
            return
        self.status.kubelet = kubelet
        # The handlers' gated fields (h2c, gRPC over TLS) follow it from the next attempt on.
        self.prober.profile = kubelet
        # Set before the node's workers start (serve reads the Node first): the probes already
        # selected keep their sidecar decision until their pod's next reconcile.
        self.selection.sidecars = kubelet.gate("SidecarContainers")
        for slot in self._slots:
            for worker in slot.workers.values():
                worker.kubelet = kubelet
        log.info("kubelet_semantics", kubelet=kubelet.describe())

    def holds_failures(self, resolved: ResolvedProbe) -> bool:
        """Whether a published liveness or startup failure puts this probe on hold until the
        container restarts, as the kubelet's does: where something acts on the failure (our
        stop, or the kubelet on its own pod spec's probe), or everywhere with ``always``."""
        return (
            self.failure_hold == "always"
            or self.on_failure == "stop"
            or resolved.origin == "pod-spec"
        )

    def _grid_anchor(self, slot: Slot) -> float | None:
        """D4: where the kubelet's worker would have started its ticker (pod admission).

        With a pod spec that says when the kubelet first saw the pod (``kubernetes.io/
        config.seen``, on the kubelet's ``/pods`` and on mirror pods), that is admission: the
        kubelet starts the pod's workers right after. Otherwise the sandbox's creation time
        stands in for it (0.2-0.3 s later in the recorded kubelet 1.28.7, more when volumes are
        slow to mount). Only for pods that appeared while cri-prober was watching; otherwise
        (our own start, reloaded rules) there is no anchor.
        """
        if not self._anchor_new_workers:
            return None
        spec = slot.pod_spec
        admitted = spec.admitted_at if spec is not None else None
        anchor = admitted if admitted is not None else slot.pod.created_at / 1e9
        if anchor <= self.prober_started_at:
            return None
        return anchor

    def _held_at_start(self, slot: Slot) -> bool:
        """The container ran, in its pod, before cri-prober started, as the kubelet's pods are
        there when it starts (and it draws their workers' first steps and phases from the whole
        period, §3.2). Not a container started since (a restart's new container is probed at
        once), nor workers that reloaded rules start (their grid starts now)."""
        if not self._anchor_new_workers:
            return False
        spec = slot.pod_spec
        admitted = spec.admitted_at if spec is not None else None
        seen = admitted if admitted is not None else slot.pod.created_at / 1e9
        started = slot.container.started_at / 1e9
        return seen <= self.prober_started_at and 0 < started <= self.prober_started_at

    def _start_worker(self, slot: Slot, kind: ProbeKind) -> None:
        resolved = slot.specs[kind]
        previous = slot.retired.pop(kind, None)
        hook = _WorkerHook(self, slot, kind, resolved)
        # serve --mirror: the kubelet runs the pod spec's probes; cri-prober mirrors them.
        mirrored = self.mirror and resolved.origin == "pod-spec"
        worker = (MirrorWorker if mirrored else ProbeWorker)(
            kind,
            resolved.probe,
            status=hook.status,
            run_probe=hook.run_probe,
            results=self.results,
            prober_started_at=self.prober_started_at,
            observer=hook,
            history_size=self._history_size,
            name=f"{slot.label}:{kind.value}",
            grid_anchor=self._grid_anchor(slot),
            held_at_start=self._held_at_start(slot),
            log_context={"container": slot.label},
            hold_failures=self.holds_failures(resolved),
            pressure=self._pressure,
            kubelet=self.kubelet,
            keeps_state=self.status.keeps_state,
            runs=hook,
        )
        if isinstance(worker, MirrorWorker):
            worker.explain = self.mirror_explain
            if (texts := self.mirror_texts) is not None:
                worker.failure_text = functools.partial(
                    texts.get, slot.key.pod_uid, slot.key.container, kind
                )
        kept = self._kept.pop((slot.container.id, kind), None)
        if kept is not None and _same_probe(kept[1], resolved):
            # The same probe of the same container again: carry on where the stopped worker left
            # off (its hold and published result included), never from the initial value.
            worker.take_over(kept[0])
        elif previous is not None and previous.timing == resolved.probe:
            worker.inherit(previous)
        elif kind is ProbeKind.LIVENESS and worker.hold_failures and self._held_before(slot):
            worker.resume_hold(slot.container.id)
            # Once: a worker started later for it (a changed probe, D21) starts over.
            remembered = self.status.remembered[slot.container.id]
            self.status.remembered[slot.container.id] = dataclasses.replace(remembered, held=False)
        slot.workers[kind] = worker
        # A fresh context: the worker binds its own log context, and must not inherit the
        # bindings of whatever task reconciled (a pod source's, say).
        slot.tasks[kind] = asyncio.create_task(
            worker.run(), name=f"probe:{slot.label}:{kind.value}", context=contextvars.Context()
        )

    def _tell_repeats(self) -> Iterator[None]:
        """Every worker tells the repeated attempts it holds back (``ManagerTopic.catch_up``;
        a stopped worker told its own as it ended), ``TELL_STEP`` slots per step. The slots
        are those of when it began: a slot added since has told nothing yet worth waiting for,
        and one removed since told its workers' repeats as they stopped."""
        slots = list(self._slots)
        for start in range(0, len(slots), TELL_STEP):
            for slot in slots[start : start + TELL_STEP]:
                for worker in slot.workers.values():
                    worker.tell_repeats()
            yield

    def _held_before(self, slot: Slot) -> bool:
        """The previous cri-prober held this running container's liveness failure (the state
        file says so) and the container has not been replaced since: it started before we did."""
        remembered = self.status.remembered.get(slot.container.id)
        container = slot.container
        return (
            remembered is not None
            and remembered.held
            and container.state is ContainerState.CONTAINER_RUNNING
            and 0 < container.started_at / 1e9 < self.prober_started_at
        )

    def _stop_worker(self, slot: Slot, kind: ProbeKind, *, handover: bool = False) -> None:
        worker = slot.workers.pop(kind, None)
        slot.tasks.pop(kind, None)
        if worker is not None:
            worker.stop(handover=handover)
            resolved = slot.specs.get(kind)
            state = worker.snapshot()
            if not handover and resolved is not None and state.container_id == slot.container.id:
                self._kept[(slot.container.id, kind)] = (worker, resolved)
            # Its task ends on its own (after the current step) and cleans up its result.

    def _drop_slot(self, slot: Slot) -> None:
        for kind in list(slot.workers):
            self._stop_worker(slot, kind)
        if self._slots.remove(slot):
            self.syncs.forget(slot.key.pod_uid)
            self._unsupported_logged.discard(slot.key.pod_uid)
        self.events.publish(ContainerGone(slot.container))
        self._finished = {f for f in self._finished if f[0] != slot.key}

    def _unsupported_probe(self, slot: Slot, kind: ProbeKind, error: str) -> None:
        """Log once per pod that a probe of it is not run: its handler has a field cri-prober
        cannot send as the spec asks (every attempt errors with reason ``unsupported``)."""
        if slot.key.pod_uid in self._unsupported_logged:
            return
        self._unsupported_logged.add(slot.key.pod_uid)
        log.warning(
            "probe_unsupported",
            pod=f"{slot.pod.namespace}/{slot.pod.name}",
            container=slot.key.container,
            probe=kind.field_name,
            error=error,
        )

    def _worker_exited(self, slot: Slot, kind: ProbeKind, worker: ProbeWorker) -> None:
        if slot.workers.get(kind) is worker:
            # It ended by itself: the container exited for good. Don't recreate it for this ID.
            slot.workers.pop(kind, None)
            slot.tasks.pop(kind, None)
            slot.retired[kind] = worker
            container_id = worker.snapshot().container_id
            if container_id is not None:
                self._finished.add((slot.key, kind, container_id))
        self.events.publish(WorkerStopped(slot.container, kind, replaced=kind in slot.workers))

    def _publish_exit(self, slot: Slot) -> None:
        """Issue 34: publish an exit that no worker will, so every surface says not started and
        not ready.

        The kubelet derives ready and started from the container's state (UpdatePodStatus: a
        container that is not running is neither), not from a probe result. A worker publishes
        Failure for a container that is not running (step 7), unless it is on hold (a published
        liveness or startup result) or its result is Failure already: then nothing would carry
        the new health to the gauges and the watch until the restart, minutes of back-off
        later. Then the held (else the failing) probe's result is published again, unchanged,
        with the exit's health and reason ``not-running``.
        """
        published = slot.published
        if published is None or not (published.started or published.ready):
            return
        health = self.status.health(slot)
        if (health.started, health.ready) == (published.started, published.ready):
            return
        container_id = slot.container.id
        view = self.status.view(slot)
        # Workers of a finished pod end without publishing (step 3).
        silent = view is None or view.pod_finished
        restated: tuple[ProbeKind, Published] | None = None
        for kind in (ProbeKind.LIVENESS, ProbeKind.STARTUP, ProbeKind.READINESS):
            worker = slot.workers.get(kind)
            if worker is None:
                continue
            result = self.results.get(container_id, kind)
            held = worker.snapshot().holds(container_id)
            if not (held or silent or result is Published.FAILURE):
                return  # this worker publishes the exit itself, at its step (7)
            if result is not None and restated is None:
                restated = (kind, result)
        if restated is None:
            return
        kind, result = restated
        slot.published = health
        log.info(
            "container_exit_published",
            container=slot.label,
            container_id=container_id[:13],
            probe=kind.value,
            result=result.value,
            detail="no probe publishes the exit (on hold, or failing already): its result is "
            "published again with the container's state",
        )
        self.events.publish(
            ResultChanged(
                container=slot.container,
                kind=kind,
                previous=result,
                result=result,
                consecutive=0,
                output="",
                health=health,
                reason=Reason.NOT_RUNNING,
            )
        )

    # -- consuming results ----------------------------------------------------------------------

    def _result_changed(self, slot: Slot, update: ResultUpdate) -> None:
        if slot.container.id != update.container_id or self._slots.get(slot.key) is not slot:
            # The slot moved on to a newer attempt (or left) while the attempt ran: the change
            # belongs to a container nobody asks about any more.
            return
        record = update.record
        output = record.output if record is not None else ""
        threshold = record.threshold if record is not None else 0
        held = record is not None and record.held
        # --on-failure stop acts on it at the pod sync requested below.
        stop_requested = self._stops is not None and self._stops.would_stop(
            slot.container, update.kind, update.result, by_attempt=record is not None
        )
        log.info(
            "probe_transition",
            container=slot.label,
            container_id=update.container_id[:13],
            probe=update.kind.value,
            previous=update.previous.value if update.previous else None,
            result=update.result.value,
            reason=update.reason,
            consecutive=update.consecutive,
            threshold=threshold,
            held=held,
            stop_requested=stop_requested,
            output=shorten(output, OUTPUT_LOG_BYTES),
        )
        health = self.status.health(slot)
        slot.published = health
        self.events.publish(
            ResultChanged(
                container=slot.container,
                kind=update.kind,
                previous=update.previous,
                result=update.result,
                consecutive=update.consecutive,
                output=output,
                health=health,
                reason=update.reason,
                threshold=threshold,
                held=held,
                stop_requested=stop_requested,
                source=update.source,
            )
        )
        # §5.2: the kubelet syncs the pod on every readiness and startup change and on a
        # liveness Failure; the sync re-triggers readiness (§3.8) and kills what must die.
        if update.kind is not ProbeKind.LIVENESS or update.result is Published.FAILURE:
            self.request_sync(slot.key.pod_uid)

    # -- pod syncs (the parts of the kubelet's SyncPod that follow probe results) ---------------

    def request_sync(self, pod_uid: str) -> None:
        """Sync the pod soon (coalesced), as the kubelet's pod worker would after an update."""
        self.syncs.request(pod_uid)

    def _sync_pod(self, pod_uid: str) -> None:
        for slot in self._slots.of_pod(pod_uid):
            self._maybe_trigger_readiness(slot)
            if self._stops is not None:
                self._stops.maybe_stop(slot)

    def _maybe_trigger_readiness(self, slot: Slot) -> None:
        """§3.8: a started container whose readiness is not Success is probed at once.

        A worker in its start-up jitter keeps the trigger until after its first step, so this
        never lines the node's readiness probes up.
        """
        worker = slot.workers.get(ProbeKind.READINESS)
        if worker is None or not self.status.health(slot).started:
            return
        if self.results.get(slot.container.id, ProbeKind.READINESS) is not Published.SUCCESS:
            worker.trigger()

    # -- shutdown -------------------------------------------------------------------------------

    async def shutdown(self, grace: float = 5.0) -> None:
        """Stop every worker, wait up to ``grace`` seconds for them, then cancel stragglers."""
        self.syncs.closed = True
        if self._listing_timer is not None:
            self._listing_timer.cancel()
            self._listing_timer = None
        if self._owns_supervisor:
            await self._supervisor.stop()
        else:
            await self._supervisor.stop([RESYNC_TASK])
        tasks: list[asyncio.Task[None]] = []
        for slot in self._slots:
            tasks.extend(slot.tasks.values())
            for worker in slot.workers.values():
                worker.stop()
        if self._stops is not None:
            tasks.extend(self._stops.in_flight())
        if not tasks:
            return
        _done, pending = await asyncio.wait(tasks, timeout=grace)
        for task in pending:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*pending, return_exceptions=True)
