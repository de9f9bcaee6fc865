"""A ``HealthService`` on a private unix socket over a stub node view, for tests of what
health ``""`` follows (the runtime's liveness, the pod sources' freshness)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any, cast

import grpc
from grpc_health.v1 import health_pb2_grpc

from cri_prober.podspecs.registry import PodSpecs
from cri_prober.runtime.liveness import RuntimeLiveness
from cri_prober.serving.health import HealthService
from cri_prober.serving.snapshot import NodeView
from cri_prober.serving.transitions import Signal


class StubView:
    """What HealthService reads from the node view: every name serves."""

    def __init__(self, containers: Iterable[str]) -> None:
        self._containers = set(containers)

    def serving(self, service: str) -> bool:
        return True

    def container_names(self) -> set[str]:
        return set(self._containers)

    def node_reasons(self) -> list[str]:
        return []


@contextlib.asynccontextmanager
async def health_stub(
    socket_dir: Path,
    *,
    containers: Iterable[str],
    runtime: RuntimeLiveness | None = None,
    pod_specs: PodSpecs | None = None,
) -> AsyncIterator[Any]:
    """A grpc.health.v1 stub talking to a HealthService over ``containers``; stopped after."""
    changed = Signal()
    service = HealthService(
        cast(NodeView, StubView(containers)), changed, runtime=runtime, pod_specs=pod_specs
    )
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(service, server)
    server.add_insecure_port(f"unix://{socket_dir}/health.sock")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{socket_dir}/health.sock") as channel:
            yield health_pb2_grpc.HealthStub(channel)
    finally:
        service.close()
        changed.close()
        await server.stop(None)
