"""The manager's one event stream: what servers, metrics and tests follow.

Every event carries the container as discovery last saw it (a frozen ``ContainerInfo``), so a
listener needs nothing else to label it. Listeners run in the publishing task: keep them quick.
"""

from __future__ import annotations

from dataclasses import dataclass

from cri_prober.discovery.model import ContainerInfo
from cri_prober.manager.state import Health
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.results import ProbeRecord, Published


@dataclass(frozen=True, slots=True)
class AttemptFinished:
    """A worker finished one attempt (errored ones included: ``record.result == "error"``)."""

    container: ContainerInfo
    kind: ProbeKind
    record: ProbeRecord


@dataclass(frozen=True, slots=True)
class ResultChanged:
    """A published result changed (a transition), with the container's health right after."""

    container: ContainerInfo
    kind: ProbeKind
    previous: Published | None
    result: Published
    consecutive: int  # the run of identical attempt results that published it
    output: str  # the output of the attempt that published it ("" when none did)
    health: Health
    reason: str = ""  # an ``outcome.Reason``: the attempt's, or why none was needed
    threshold: int = 0  # the threshold ``consecutive`` met (0 without an attempt)
    held: bool = False  # the probe went on hold until the container restarts
    stop_requested: bool = False  # --on-failure stop: it makes the manager stop the container
    source: str = ""  # who decided it: "" cri-prober, "kubelet-mirror" the kubelet (--mirror)


@dataclass(frozen=True, slots=True)
class WorkerStopped:
    """A worker ended; ``replaced`` when a new worker for the same probe already runs."""

    container: ContainerInfo
    kind: ProbeKind
    replaced: bool


@dataclass(frozen=True, slots=True)
class Reconciled:
    """The workers were brought in line with the node and the rules."""

    tracked: int  # containers with at least one probe


@dataclass(frozen=True, slots=True)
class ContainerGone:
    """A container slot was dropped: no probes for it any more."""

    container: ContainerInfo


ManagerEvent = AttemptFinished | ResultChanged | WorkerStopped | Reconciled | ContainerGone

__all__ = [
    "AttemptFinished",
    "ContainerGone",
    "ManagerEvent",
    "Reconciled",
    "ResultChanged",
    "WorkerStopped",
]
