"""The ``grpc.health.v1.Health`` servicer over cri-prober's service names.

``""`` is cri-prober itself: discovery fresh and, when the servicer is given the CRI client's
``RuntimeLiveness``, the runtime answering (NOT_SERVING once it has been asked and has answered
nothing for ``unresponsive_after``, 10 s; SERVING again at its next answer). ``namespace/pod``
is a pod, and a container ID, ID prefix or ``namespace/pod/container`` a container; a silent
runtime leaves those as they are, because it says nothing about the containers. Watch wakes on
a ``Signal`` the server notifies whenever an answer may have changed (this servicer notifies it
too when the runtime's liveness flips or a ``--probes-from`` source turns stale or fresh), never
by polling. ``""`` is NOT_SERVING while a pod spec source is stale (its last good view is used).

grpc.health.v1 has no field for why, so ``Check("")`` says it in trailing metadata, which
grpc-health-probe ignores: one ``criprober-not-serving-reason`` entry per reason while it is
NOT_SERVING, and one ``criprober-warning`` entry per start-up warning (e.g. nothing to probe).
``ListContainers`` carries the same reasons (``not_serving``).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cri_prober._gen.criprober.v1 import query_pb2
from cri_prober.discovery.naming import TargetError
from cri_prober.runtime.liveness import RuntimeLiveness
from cri_prober.serving.snapshot import NodeView
from cri_prober.serving.transitions import Signal

if TYPE_CHECKING:
    from cri_prober.podspecs.registry import PodSpecs

# grpc.health.v1 List answers RESOURCE_EXHAUSTED rather than return more than this many.
MAX_LISTED_SERVICES = 100

_SERVING: int = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING: int = health_pb2.HealthCheckResponse.NOT_SERVING
_SERVICE_UNKNOWN: int = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN

Context = grpc.aio.ServicerContext[Any, Any]

# Trailing metadata of Check(""): why it is NOT_SERVING, and what serve warned of at start.
REASON_METADATA_KEY = "criprober-not-serving-reason"
WARNING_METADATA_KEY = "criprober-warning"
# Each reason at most this long (a pod source's error may be long); gRPC's metadata is 8 KiB.
MAX_REASON_CHARS = 512


def printable(text: str, *, ascii_only: bool = False) -> str:
    """``text`` cut to MAX_REASON_CHARS, control characters (and, for metadata, whose values
    must be printable ASCII, everything outside it) written as Python escapes (``\\n``)."""
    if len(text) > MAX_REASON_CHARS:
        text = text[: MAX_REASON_CHARS - 1] + "…"
    return "".join(
        c
        if (" " <= c <= "~") or (not ascii_only and c.isprintable())
        else c.encode("unicode_escape").decode("ascii")
        for c in text
    )


def _since(seconds_ago: float | None) -> str:
    if seconds_ago is None:  # not silent now: answering again since this was asked
        return "until just now"
    moment = datetime.datetime.fromtimestamp(time.time() - seconds_ago, datetime.UTC)
    return f"since {moment:%Y-%m-%dT%H:%M:%SZ} ({seconds_ago:.0f}s ago)"


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
        runtime_endpoint: str = "",
        warnings: Sequence[str] = (),
    ) -> None:
        self._view = view
        self._changed = changed
        self._runtime = runtime
        self._pod_specs = pod_specs
        self._runtime_endpoint = runtime_endpoint or "its endpoint"
        self._warnings = tuple(warnings)
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

    def not_serving(self) -> query_pb2.NotServing | None:
        """Why ``""`` is NOT_SERVING, or None while it is SERVING."""
        reasons: list[str] = []
        view_stale = False
        runtime = self._runtime
        if runtime is not None and not runtime.responsive:
            view_stale = True
            reasons.append(
                f"runtime unreachable at {self._runtime_endpoint} {_since(runtime.silent_for())}"
            )
        node = self._view.node_reasons()
        view_stale = view_stale or any(r.startswith("discovery ") for r in node)
        reasons.extend(node)
        if self._pod_specs is not None and self._pod_specs.stale_sources:
            reasons.extend(
                f"{line} (its last good view is still probed)"
                for line in self._pod_specs.staleness()
            )
        if not reasons and self._serving(""):
            return None
        if not reasons:  # NOT_SERVING by a rule that gives no words (should not happen)
            reasons.append("not serving")
        return query_pb2.NotServing(view_stale=view_stale, reasons=map(printable, reasons))

    async def Check(  # noqa: N802 - gRPC method name
        self, request: health_pb2.HealthCheckRequest, context: Context
    ) -> health_pb2.HealthCheckResponse:
        try:
            status = _status(self._serving(request.service))
        except TargetError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service: {exc}")
        if request.service == "":
            metadata = [
                (WARNING_METADATA_KEY, printable(w, ascii_only=True)) for w in self._warnings
            ]
            why = self.not_serving() if status == _NOT_SERVING else None
            if why is not None:
                metadata.extend(
                    (REASON_METADATA_KEY, printable(r, ascii_only=True)) for r in why.reasons
                )
            if metadata:
                context.set_trailing_metadata(metadata)
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


__all__ = [
    "MAX_LISTED_SERVICES",
    "REASON_METADATA_KEY",
    "WARNING_METADATA_KEY",
    "HealthService",
    "printable",
]
