"""``--on-failure stop``: stop a running container whose liveness, else startup, probe failed,
with the kubelet's grace periods and preStop hook (§5.2, §5.3, D6, D7, D18).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Literal, Protocol

import structlog

from cri_prober.discovery.model import ContainerInfo
from cri_prober.discovery.naming import ContainerRef
from cri_prober.errors import CriError
from cri_prober.manager.slots import Slot
from cri_prober.probing.handlers.exec import ExecRunner
from cri_prober.probing.hooks import InvalidPreStop, pre_stop_hook, run_pre_stop
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.prober import ProbeTarget
from cri_prober.probing.results import Published, ResultsStore
from cri_prober.probing.spec import ResolvedProbe
from cri_prober.runtime.model import ContainerState

if TYPE_CHECKING:
    from cri_prober.podspecs.model import PodSpec

log = structlog.get_logger(__name__)

GRACE_ANNOTATION = "io.kubernetes.pod.terminationGracePeriod"
DELETION_GRACE_ANNOTATION = "io.kubernetes.pod.deletionGracePeriod"
DEFAULT_GRACE_SECONDS = 30
MIN_GRACE_SECONDS = 2

OnFailure = Literal["report", "stop"]
# Where a published liveness or startup failure puts its probe on hold until the container
# restarts (the kubelet's rule, as its kill brings a new container): "auto" where something
# acts on the failure (``--on-failure stop``, or a pod spec's probe, which the kubelet acts on),
# "always" everywhere. Elsewhere the probe keeps running and publishes the recovery.
FailureHold = Literal["auto", "always"]


class Stopper(ExecRunner, Protocol):
    """The CRI calls ``--on-failure stop`` needs: ExecSync for a preStop hook, StopContainer
    (``CriClient`` provides both)."""

    async def stop_container(self, container_id: str, *, grace_seconds: int) -> None: ...


class FailureStops:
    """Stops containers whose liveness or startup failure is published, one stop at a time each."""

    def __init__(
        self,
        stopper: Stopper,
        results: ResultsStore,
        *,
        named_ports: Callable[[str], dict[str, int]],
        retry_later: Callable[[str], None],
    ) -> None:
        self._stopper = stopper
        self._results = results
        self._named_ports = named_ports
        self._retry_later = retry_later  # sync the pod again after the back-off
        # Containers with a StopContainer in flight (one at a time, never a shorter grace).
        self._stopping: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def would_stop(
        self,
        container: ContainerInfo,
        kind: ProbeKind,
        result: Published | None,
        *,
        by_attempt: bool,
    ) -> bool:
        """§5.2, the rule itself: a running container is stopped for a liveness or startup
        Failure that a probe attempt published (``by_attempt``; not the "not running" one).

        Both the transition's ``stop_requested`` and the pod sync's stop ask this, so what the
        surfaces announce is what the stop does.
        """
        return (
            kind is not ProbeKind.READINESS
            and result is Published.FAILURE
            and by_attempt
            and container.state is ContainerState.CONTAINER_RUNNING
        )

    def maybe_stop(self, slot: Slot) -> None:
        """§5.2: stop a running container whose liveness, else startup, failed.

        Checked on every pod sync, so a stop that failed is tried again (D7); never while one is
        in flight for the container, so a second, shorter stop cannot cut a shutdown short.
        """
        container = slot.container
        if container.id in self._stopping:
            return
        for kind in (ProbeKind.LIVENESS, ProbeKind.STARTUP):
            worker = slot.workers.get(kind)
            if worker is not None and self.would_stop(
                container,
                kind,
                self._results.get(container.id, kind),
                by_attempt=worker.snapshot().failed_container == container.id,
            ):
                self._stopping.add(container.id)
                # D18: the stop acts on this container, whatever the slot holds by then.
                self._spawn(self._stop(slot, container, kind))
                return

    def in_flight(self) -> list[asyncio.Task[None]]:
        """The stops still running (shutdown waits for them)."""
        return list(self._tasks)

    async def _stop(self, slot: Slot, container: ContainerInfo, kind: ProbeKind) -> None:
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
                target = ProbeTarget.of(container, self._named_ports(container.id))
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
            self._retry_later(slot.key.pod_uid)
        finally:
            self._stopping.discard(container.id)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.create_task(coro, name="container-stop")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


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
