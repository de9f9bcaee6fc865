"""The manager's read model: what each container's probes say, derived as the kubelet does.

``started``/``ready``/``live`` of a container (§3.8, with KEP-4781's memory across restarts), the
frozen ``ProbeState`` of each configured probe, and the ``ContainerView`` a worker sees of its
container. Nothing here changes a worker or a result.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import TYPE_CHECKING

from cri_prober.discovery.model import ContainerInfo
from cri_prober.manager.memory import Remembered
from cri_prober.manager.slots import Slot, SlotTable
from cri_prober.manager.state import Health, ProbeState
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.kubelet_profile import KubeletProfile
from cri_prober.probing.results import Published, ResultsStore
from cri_prober.probing.worker import ContainerView, predates_prober
from cri_prober.runtime.model import ContainerState

if TYPE_CHECKING:
    from cri_prober.podspecs.model import SpecContainer

# The order probes are listed in (the API's and the CLI's).
LISTING_ORDER = (ProbeKind.LIVENESS, ProbeKind.READINESS, ProbeKind.STARTUP)


class StatusModel:
    """Derives health and probe states from the slots, the results cache and remembered state."""

    def __init__(
        self,
        slots: SlotTable,
        results: ResultsStore,
        *,
        prober_started_at: float,
        remembered: Mapping[str, Remembered] | None = None,
        kubelet: KubeletProfile | None = None,
    ) -> None:
        self._slots = slots
        # The kubelet release whose KEP-4781 rules apply (the manager updates it).
        self.kubelet = kubelet or KubeletProfile()
        self.results = results
        self.prober_started_at = prober_started_at
        # D5: started/ready of each container as the previous cri-prober left them (KEP-4781).
        # Only containers on the node need theirs: see retain_remembered.
        self.remembered: dict[str, Remembered] = dict(remembered or {})
        # Whether the state file named any container at start: the "previous status" that
        # PR #141487 (1.37) checks a container against (pruning later must not change that).
        self._memory_named = frozenset(self.remembered)

    # -- health ---------------------------------------------------------------------------------

    def health(self, slot: Slot) -> Health:
        """started/ready/live for the slot's newest attempt, as the kubelet derives them (§3.8)."""
        container = slot.container
        running = container.state is ContainerState.CONTAINER_RUNNING
        started = running and self.started(slot)
        ready = started and self._passed(slot, ProbeKind.READINESS)
        live = self.results.get(container.id, ProbeKind.LIVENESS) is not Published.FAILURE
        return Health(running=running, started=started, ready=ready, live=live)

    def started(self, slot: Slot) -> bool:
        return self._passed(slot, ProbeKind.STARTUP)

    def container_health(self, info: ContainerInfo) -> Health:
        """The derived state of any container; one without probes is healthy while it runs."""
        slot = self._slots.for_container(info.id)
        if slot is not None:
            return self.health(slot)
        running = info.state is ContainerState.CONTAINER_RUNNING
        return Health(running=running, started=running, ready=running, live=True)

    def _passed(self, slot: Slot, kind: ProbeKind) -> bool:
        """No probe of this kind, a published success, or state kept across our own restart."""
        worker = slot.workers.get(kind)
        if worker is None:
            return kind not in slot.specs
        container_id = slot.container.id
        result = self.results.get(container_id, kind)
        if result is not None:
            return result is Published.SUCCESS
        state = worker.snapshot()
        adopting = state.container_id != container_id and self._predates_prober(slot.container)
        if not (state.preserves(container_id) or adopting):
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
        ) and self.keeps_state(container.id)

    def keeps_state(self, container_id: str) -> bool:
        """Whether a container that predates the prober keeps its previous state, as the
        kubelet release says (docs/kubelet-fidelity.md, "Kubelet releases"): never before 1.35
        (every probe starts from its initial value); from 1.35 (KEP-4781) yes; from 1.37
        (PR #141487) only a container the previous status names, which here is the state file:
        one that names other containers but not this one (a replacement made while cri-prober
        was down) starts from the initial values. With a state file that named nothing (none,
        the first start, an unreadable one) there is no previous status to check against, and
        the container keeps its state, as in 1.35 and 1.36."""
        kubelet = self.kubelet
        if not kubelet.keeps_status_on_restart:
            return False
        if kubelet.kept_status_needs_same_container and self._memory_named:
            return container_id in self._memory_named
        return True

    # -- remembered state (KEP-4781) ------------------------------------------------------------

    def remembered_state(self) -> dict[str, Remembered]:
        """started/ready of every running probed container, and whether its liveness failure is
        held, for the state file."""
        state: dict[str, Remembered] = {}
        for slot in self._slots:
            health = self.health(slot)
            if health.running:
                state[slot.container.id] = Remembered(
                    started=health.started, ready=health.ready, held=self._held(slot)
                )
        return state

    def _held(self, slot: Slot) -> bool:
        """The slot's liveness worker holds on a failure it published for this container."""
        worker = slot.workers.get(ProbeKind.LIVENESS)
        if worker is None:
            return False
        state = worker.snapshot()
        return (
            state.holds(slot.container.id)
            and state.held_after > 0
            and self.results.get(slot.container.id, ProbeKind.LIVENESS) is Published.FAILURE
        )

    def retain_remembered(self, live: Container[str]) -> None:
        """Forget the remembered state of every container whose ID is not in ``live``.

        Call it with every container on the node (a complete relist): container IDs are never
        reused, so the others are gone for good and their memory, read from a file that may hold
        thousands, would otherwise stay for the process's life.
        """
        if self.remembered:
            self.remembered = {cid: r for cid, r in self.remembered.items() if cid in live}

    def forget(self, container_id: str) -> None:
        """The container was removed for good: its remembered state is no use any more."""
        self.remembered.pop(container_id, None)

    # -- probe states ---------------------------------------------------------------------------

    def probe_states(self, container_id: str) -> tuple[ProbeState, ...]:
        """The configured probes of this container (newest attempt only), liveness first."""
        slot = self._slots.for_container(container_id)
        if slot is None:
            return ()
        states = []
        for kind in LISTING_ORDER:
            resolved = slot.specs.get(kind)
            if resolved is None:
                continue
            worker = slot.workers.get(kind)
            # A worker that ended on its own (its container exited for good, the pod is over)
            # still says what it did: counters and history stay readable (issue 23), and a
            # worker started later for the slot inherits them.
            counted_by = worker if worker is not None else slot.retired.get(kind)
            counted = counted_by.snapshot(records=True) if counted_by is not None else None
            live = counted if worker is not None else None
            states.append(
                ProbeState(
                    kind=kind,
                    probe=resolved.probe,
                    ports=resolved.ports,
                    published=self.results.get(container_id, kind),
                    has_worker=live is not None,
                    active=live is not None and not live.stopped,
                    on_hold=live is not None and live.on_hold,
                    last_result=counted.last_result if counted is not None else None,
                    result_run=counted.result_run if counted is not None else 0,
                    attempts=counted.probes_run if counted is not None else 0,
                    last_record=counted.last_record if counted is not None else None,
                    history=counted.history if counted is not None else (),
                    probing_since=live.probing_since if live is not None else None,
                    origin=resolved.origin,
                    source=resolved.source,
                    held_after=live.held_after if live is not None and live.on_hold else 0,
                    holds_failures=live.hold_failures if live is not None else True,
                )
            )
        return tuple(states)

    def named_ports(self, container_id: str) -> dict[str, int]:
        """Every named port the container's configured probes can use."""
        ports: dict[str, int] = {}
        slot = self._slots.for_container(container_id)
        if slot is not None:
            for resolved in slot.specs.values():
                ports.update(resolved.ports)
        return ports

    # -- what workers see -----------------------------------------------------------------------

    def _restarts(
        self, container: SpecContainer, pod_policy: str, exit_code: int, legacy: bool
    ) -> bool:
        """Whether the kubelet restarts an exited container, by its release: worker.go
        ``doProbe`` (release-1.35) decides by ``podutil.ContainerShouldRestart`` with the
        ContainerRestartRules gate on (KEP-5307: beta, on, from 1.35; alpha 1.34), and then
        also when RestartAllContainersOnContainerExits is on and the exit asks every container
        to restart (KEP-5532); with the gate off, by the pod's restartPolicy (``legacy``)."""
        kubelet = self.kubelet
        if not kubelet.gate("ContainerRestartRules"):
            return legacy
        if container.should_restart(pod_policy, exit_code):
            return True
        return kubelet.gate("RestartAllContainersOnContainerExits") and (
            container.restarts_all_on(exit_code)
        )

    def view(self, slot: Slot) -> ContainerView | None:
        """What the slot's workers see of its newest attempt (the kubelet's status cache)."""
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
            if exited and spec_container is not None and not sidecar:
                will_restart = not sandbox_down and self._restarts(
                    spec_container, spec.restart_policy, container.exit_code, will_restart
                )
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
            started=running and self.started(slot),
            terminated=exited,
            will_restart=will_restart,
            deleting=deleting,
            pod_finished=finished,
        )
