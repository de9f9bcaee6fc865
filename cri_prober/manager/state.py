"""Frozen read models of the manager's state: a container's derived health and a probe's status.

Servers and the CLI see the manager only through these values (and its event stream), never
through its workers, so what they read cannot change under them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cri_prober.discovery.model import ContainerInfo
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.results import ProbeRecord, Published
from cri_prober.probing.spec import ProbeOrigin

if TYPE_CHECKING:
    from cri_prober.probing.spec import Probe


@dataclass(frozen=True, slots=True)
class Health:
    """The derived state of one container (the kubelet's started/ready plus liveness)."""

    running: bool
    started: bool
    ready: bool
    live: bool  # not failing liveness

    @property
    def serving(self) -> bool:
        """Running, started, not failing liveness, and ready (the health service's SERVING)."""
        return self.running and self.started and self.live and self.ready


@dataclass(frozen=True, slots=True)
class ProbeState:
    """One configured probe of one container, as it stands."""

    kind: ProbeKind
    probe: Probe
    ports: Mapping[str, int]  # the named ports of the rule that configured it
    published: Published | None  # None until the worker published for this container
    has_worker: bool  # False once its worker ended for good (the container is gone)
    active: bool  # the worker runs
    on_hold: bool
    last_result: Published | None  # the worker's lastResult (what its run counts)
    result_run: int  # how many attempts in a row gave last_result
    # The counters and history below outlive the worker: an ended one keeps saying what it did.
    attempts: int  # probes run (not counting errored attempts)
    last_record: ProbeRecord | None  # the newest attempt, output kept whole
    history: tuple[ProbeRecord, ...]  # the newest attempts, oldest first, outputs shortened
    probing_since: float | None = None  # wall-clock start of the attempt in progress
    origin: ProbeOrigin = "rules"  # who wrote it: the rules file, an annotation, the pod spec
    source: str = ""  # where it was read (rules file, annotation name, pod source)
    # The run of failures whose published failure put it on hold (0 unless held after one).
    held_after: int = 0
    holds_failures: bool = True  # a published failure holds it (serve --failure-hold)

    @property
    def hold(self) -> str:
        """Why it runs no more for this container, for people; "" while it runs."""
        if not self.on_hold:
            return ""
        if self.held_after:
            return "on hold until the container restarts"
        return "passed"  # a startup probe that succeeded

    @property
    def consecutive_failures(self) -> int:
        """Failed attempts in a row, counting those that put it on hold (which the kubelet's
        worker forgets: it starts its run again while holding)."""
        if self.held_after:
            return self.held_after
        return self.result_run if self.last_result is Published.FAILURE else 0

    @property
    def consecutive_successes(self) -> int:
        return (
            self.result_run if self.last_result is Published.SUCCESS and not self.held_after else 0
        )

    @property
    def threshold(self) -> int:
        """The threshold the current run counts toward."""
        if self.consecutive_failures:
            return self.probe.failure_threshold
        return self.probe.success_threshold


@dataclass(frozen=True, slots=True)
class ProbedContainer:
    """A container with at least one probe configured: its newest attempt, health and probes."""

    container: ContainerInfo
    health: Health
    probes: tuple[ProbeState, ...]  # liveness first
    # The pod's spec (serve --probes-from) says it is being deleted: liveness and startup
    # probing stopped (D3), readiness goes on until the containers stop.
    terminating: bool = False

    @property
    def label(self) -> str:
        """``namespace/pod/container``, the name users and the health service use."""
        pod = self.container.pod
        return f"{pod.namespace}/{pod.name}/{self.container.name}"

    def probe(self, kind: ProbeKind) -> ProbeState | None:
        """The configured probe of that kind, if any."""
        return next((state for state in self.probes if state.kind is kind), None)


__all__ = ["Health", "ProbeState", "ProbedContainer"]
