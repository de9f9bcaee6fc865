"""The ``grpc.health.v1.Health`` servicer over cri-prober's service names.

``""`` is cri-prober itself: discovery fresh and, when the servicer is given the CRI client's
``RuntimeLiveness``, the runtime answering (NOT_SERVING once it has been asked and has answered
nothing for ``unresponsive_after``, 10 s; SERVING again at its next answer). ``namespace/pod``
is a pod, and a container ID, ID prefix or ``namespace/pod/container`` a container; a silent
runtime leaves those as they are, because it says nothing about the containers. Watch wakes on
a ``Signal`` the server notifies whenever an answer may have changed (this servicer notifies it
too when the runtime's liveness flips or a ``--probes-from`` source turns stale or fresh), never
by polling. ``""`` is NOT_SERVING while a pod spec source is stale (its last good view is used).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cri_prober.discovery.naming import TargetError
from cri_prober.podspecs.registry import PodSpecs
from cri_prober.runtime.liveness import RuntimeLiveness
from cri_prober.serving.snapshot import NodeView
from cri_prober.serving.transitions import Signal

# grpc.health.v1 List answers RESOURCE_EXHAUSTED rather than return more than this many.
MAX_LISTED_SERVICES = 100

_SERVING: int = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING: int = health_pb2.HealthCheckResponse.NOT_SERVING
_SERVICE_UNKNOWN: int = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN

Context = grpc.aio.ServicerContext[Any, Any]


def _status(serving: bool) -> int:
    return _SERVING if serving else _NOT_SERVING


class HealthService(health_pb2_grpc.HealthServicer):  # type: ignore[misc]  # untyped package
    """grpc.health.v1.Health over docs/interface.md's names."""

    def __init__(
        self,
        view: NodeView,
        changed: Signal,
        *,
        runtime: RuntimeLiveness | None = None,
        pod_specs: PodSpecs | None = None,
    ) -> None:
        self._view = view
        self._changed = changed
        self._runtime = runtime
        self._pod_specs = pod_specs
        self._unsubscribe: list[Callable[[], None]] = []
        if runtime is not None:
            self._unsubscribe.append(runtime.changes.subscribe(self._on_change))
        if pod_specs is not None:
            self._unsubscribe.append(pod_specs.freshness.subscribe(self._on_change))

    def close(self) -> None:
        """Stop following the runtime's liveness and the pod sources (the server calls it when
        it stops)."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe.clear()

    def _on_change(self, _value: object) -> None:
        self._changed.notify()

    def _serving(self, service: str) -> bool:
        """``view.serving``, and for ``""`` also a runtime that answers and pod sources that are
        fresh; raises ``TargetError``."""
        serving = self._view.serving(service)
        if service != "":
            return serving
        if self._runtime is not None and not self._runtime.responsive:
            return False
        if self._pod_specs is not None and self._pod_specs.stale_sources:
            return False
        return serving

    async def Check(  # noqa: N802 - gRPC method name
        self, request: health_pb2.HealthCheckRequest, context: Context
    ) -> health_pb2.HealthCheckResponse:
        try:
            status = _status(self._serving(request.service))
        except TargetError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service: {exc}")
        return health_pb2.HealthCheckResponse(status=status)

    async def List(  # noqa: N802 - gRPC method name
        self, request: health_pb2.HealthListRequest, context: Context
    ) -> health_pb2.HealthListResponse:
        """The server ("") and every container by namespace/pod/container, up to the limit."""
        names = ["", *sorted(self._view.container_names())]
        if len(names) > MAX_LISTED_SERVICES:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(names)} services exceed the {MAX_LISTED_SERVICES} List may return; "
                "use Check or Watch, or criprober.v1.CriProber/ListContainers",
            )
        response = health_pb2.HealthListResponse()
        for name in names:
            response.statuses[name].status = _status(self._serving(name))
        return response

    async def Watch(  # noqa: N802 - gRPC method name
        self, request: health_pb2.HealthCheckRequest, context: Context
    ) -> None:
        last: int | None = None
        while True:
            wake = self._changed.current()
            try:
                status = _status(self._serving(request.service))
            except TargetError:
                status = _SERVICE_UNKNOWN
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if self._changed.closed:
                return
            await wake.wait()


__all__ = ["MAX_LISTED_SERVICES", "HealthService"]
