"""A probe manager slot built by hand, for tests of what observes the manager."""

from __future__ import annotations

from cri_prober.discovery.pleg import ContainerInfo, PodInfo
from cri_prober.manager.slots import Slot, SlotKey
from cri_prober.runtime.model import ContainerState


def make_slot(name: str = "app") -> Slot:
    """A running container ``shop/web-0/<name>`` (ID ``id-<name>``) with no probes yet."""
    pod = PodInfo(
        sandbox_id="sandbox-1",
        name="web-0",
        namespace="shop",
        uid="uid-1",
        attempt=0,
        ready=True,
        ip="10.0.0.2",
        host_network=False,
        labels={},
        annotations={},
        created_at=1,
    )
    container = ContainerInfo(
        id=f"id-{name}",
        pod_sandbox_id=pod.sandbox_id,
        name=name,
        attempt=0,
        state=ContainerState.CONTAINER_RUNNING,
        created_at=1,
        started_at=1,
        finished_at=0,
        exit_code=0,
        labels={},
        annotations={},
        env=None,
        pod=pod,
    )
    return Slot(key=SlotKey(pod.uid, name), container=container)
