"""What the layers above may ask of the manager: the ``ProbeService`` Protocol and its errors.

Serving depends on this module (with the frozen read models in ``state`` and the event stream's
types in ``events``), never on the manager's classes, so the manager can be rearranged freely
and a server can be tested against any object with this surface.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from cri_prober.discovery.model import ContainerInfo
from cri_prober.errors import CriProberError
from cri_prober.manager.events import ManagerEvent
from cri_prober.manager.state import Health, ProbeState
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.kubelet_profile import KubeletProfile
from cri_prober.probing.results import ProbeRecord
from cri_prober.topic import Topic

if TYPE_CHECKING:
    from cri_prober.probing.spec import Probe


class NoSuchProbe(CriProberError):
    """The container has no probe of that kind configured."""


class ProbeNotRunning(CriProberError):
    """The probe is configured but its worker ended (the container is gone for good)."""


class ProbeOnHold(CriProberError):
    """The probe runs no more for this container: held after its failure until the container
    restarts, or a startup probe that already passed. The message says which."""


class ProbeService(Protocol):
    """The manager as servers, metrics and the API see it (``ProbeManager`` provides it)."""

    @property
    def events(self) -> Topic[ManagerEvent]:
        """Every attempt, transition and worker change, as it happens."""
        ...

    def tracked(self) -> int:
        """How many containers have at least one probe configured."""
        ...

    @property
    def kubelet(self) -> KubeletProfile:
        """The kubelet release and gates whose probe behaviour the workers follow."""
        ...

    def container_health(self, info: ContainerInfo) -> Health:
        """The derived state of any container; one without probes is healthy while it runs."""
        ...

    def probe_states(self, container_id: str) -> tuple[ProbeState, ...]:
        """The configured probes of this container (newest attempt only), liveness first."""
        ...

    def probe_now(self, container_id: str, kind: ProbeKind) -> None:
        """Run the container's configured ``kind`` probe at once, as a normal step.

        Raises:
            NoSuchProbe: the container has no such probe configured.
            ProbeNotRunning: the probe's worker ended (the container is gone for good).
        """
        ...

    async def run_probe(self, container: ContainerInfo, probe: Probe) -> ProbeRecord:
        """Run ``probe`` once on ``container`` and record it; no worker or result changes."""
        ...
