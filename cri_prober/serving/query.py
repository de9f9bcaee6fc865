"""The ``criprober.v1.CriProber`` servicer: list and get containers, stream transitions, run
or trigger a probe.

It reads the frozen read model and the transition log; RunProbe and TriggerProbe go through the
manager's two commands, so no servicer touches a worker.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from typing import Any, NoReturn, Protocol

import grpc
import structlog

from cri_prober._gen.criprober.v1 import query_pb2, query_pb2_grpc
from cri_prober.discovery.model import ContainerInfo
from cri_prober.discovery.naming import AmbiguousTarget, InvalidTarget, TargetError
from cri_prober.manager.probe_manager import NoSuchProbe, ProbeNotRunning
from cri_prober.probing.kinds import ProbeKind, parse_kind
from cri_prober.probing.results import ProbeRecord
from cri_prober.probing.spec import Probe, SpecError, parse_probe_json
from cri_prober.runtime.client import ContainerState
from cri_prober.serving.convert import attempt_pb, container_pb, transition_pb
from cri_prober.serving.snapshot import NodeView
from cri_prober.serving.transitions import TransitionGap, TransitionLog

log = structlog.get_logger(__name__)

SERVICE_NAME = query_pb2.DESCRIPTOR.services_by_name["CriProber"].full_name
TRIGGER_INTERVAL_SECONDS = 1.0

Context = grpc.aio.ServicerContext[Any, Any]


class ProbeCommands(Protocol):
    """What the API may ask of the manager (``ProbeManager`` provides it)."""

    def probe_now(self, container_id: str, kind: ProbeKind) -> None: ...
    async def run_probe(self, container: ContainerInfo, probe: Probe) -> ProbeRecord: ...


class _Filter:
    """A compiled ContainerFilter."""

    def __init__(self, spec: query_pb2.ContainerFilter) -> None:
        self._id = spec.id
        self._patterns = [
            (field, re.compile(pattern))
            for field, pattern in (
                ("name", spec.name),
                ("namespace", spec.namespace),
                ("pod", spec.pod),
            )
            if pattern
        ]

    def matches(self, *, container_id: str, name: str, namespace: str, pod: str) -> bool:
        values = {"name": name, "namespace": namespace, "pod": pod}
        return container_id.startswith(self._id) and all(
            pattern.search(values[field]) for field, pattern in self._patterns
        )


def _compile_filter(spec: query_pb2.ContainerFilter) -> _Filter:
    try:
        return _Filter(spec)
    except re.error as exc:
        raise ValueError(f"filter: bad regular expression {exc.pattern!r}: {exc}") from exc
    except (OverflowError, RecursionError) as exc:
        # Python's re raises these (not re.error) for huge repeat counts and deep nesting.
        raise ValueError(f"filter: regular expression too large: {exc}") from exc


async def _abort_for(context: Context, exc: TargetError) -> NoReturn:
    code = grpc.StatusCode.NOT_FOUND
    if isinstance(exc, AmbiguousTarget):
        code = grpc.StatusCode.FAILED_PRECONDITION
    elif isinstance(exc, InvalidTarget):
        code = grpc.StatusCode.INVALID_ARGUMENT
    await context.abort(code, str(exc))


class QueryService(query_pb2_grpc.CriProberServicer):
    """criprober.v1.CriProber."""

    def __init__(self, view: NodeView, transitions: TransitionLog, commands: ProbeCommands) -> None:
        self._view = view
        self._transitions = transitions
        self._commands = commands
        # Last trigger time per (container ID, kind); entries older than the interval are pruned.
        self._triggered: dict[tuple[str, ProbeKind], float] = {}

    async def ListContainers(  # noqa: N802 - gRPC method name
        self, request: query_pb2.ListContainersRequest, context: Context
    ) -> query_pb2.ListContainersResponse:
        try:
            wanted = _compile_filter(request.filter)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.HasField("state"):
            if request.state not in ContainerState._value2member_map_:
                # proto3 enums are open: a client may send any number.
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"state: unknown value {request.state}"
                )
            states = {ContainerState(request.state)}
        elif request.all:
            states = set(ContainerState)
        else:
            states = {ContainerState.CONTAINER_RUNNING}
        containers = [
            info
            for info in self._view.containers().values()
            if info.state in states
            and wanted.matches(
                container_id=info.id,
                name=info.name,
                namespace=info.pod.namespace,
                pod=info.pod.name,
            )
        ]
        containers.sort(key=lambda info: info.created_at, reverse=True)
        return query_pb2.ListContainersResponse(
            containers=[self._container(info, detail=False) for info in containers]
        )

    async def GetContainer(  # noqa: N802 - gRPC method name
        self, request: query_pb2.GetContainerRequest, context: Context
    ) -> query_pb2.GetContainerResponse:
        info = await self._find(request.target, context)
        return query_pb2.GetContainerResponse(container=self._container(info, detail=True))

    async def WatchTransitions(  # noqa: N802 - gRPC method name
        self, request: query_pb2.WatchTransitionsRequest, context: Context
    ) -> AsyncIterator[query_pb2.Transition]:
        try:
            wanted = _compile_filter(request.filter)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        since = request.since_sequence if request.HasField("since_sequence") else None
        try:
            async for transition in self._transitions.follow(since):
                if wanted.matches(
                    container_id=transition.container_id,
                    name=transition.container_name,
                    namespace=transition.pod_namespace,
                    pod=transition.pod_name,
                ):
                    yield transition_pb(transition)
        except TransitionGap as exc:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(exc))

    async def RunProbe(  # noqa: N802 - gRPC method name
        self, request: query_pb2.RunProbeRequest, context: Context
    ) -> query_pb2.RunProbeResponse:
        try:
            kind = parse_kind(request.kind or ProbeKind.LIVENESS.value)
            probe = parse_probe_json(request.probe_json, kind, source="probe_json")
        except SpecError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(exc.lines))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"kind: {exc}")
        info = await self._find(request.target, context)
        record = await self._commands.run_probe(info, probe)
        return query_pb2.RunProbeResponse(attempt=attempt_pb(record))

    async def TriggerProbe(  # noqa: N802 - gRPC method name
        self, request: query_pb2.TriggerProbeRequest, context: Context
    ) -> query_pb2.TriggerProbeResponse:
        if not request.kind:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "kind: required (liveness, readiness or startup)"
            )
        try:
            kind = parse_kind(request.kind)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"kind: {exc}")
        info = await self._find(request.target, context)
        name = f"{info.pod.namespace}/{info.pod.name}/{info.name} ({info.id[:13]})"
        now = time.monotonic()
        self._triggered = {
            key: at for key, at in self._triggered.items() if now - at < TRIGGER_INTERVAL_SECONDS
        }
        last = self._triggered.get((info.id, kind))
        if last is not None:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the {kind.value} probe of {name} was triggered {now - last:.2f}s ago; "
                f"at most once per {TRIGGER_INTERVAL_SECONDS:g}s",
            )
        try:
            self._commands.probe_now(info.id, kind)
        except NoSuchProbe:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{name} has no {kind.value} probe")
        except ProbeNotRunning:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the {kind.value} probe of {name} is not running (the container is gone for good)",
            )
        self._triggered[(info.id, kind)] = now
        log.info("probe_triggered", container=name, probe=kind.value)
        return query_pb2.TriggerProbeResponse(container_id=info.id, kind=kind.value)

    async def _find(self, target: str, context: Context) -> ContainerInfo:
        """The container ``target`` names, or the call aborted with the status that fits."""
        try:
            return self._view.find(target)
        except TargetError as exc:
            await _abort_for(context, exc)

    def _container(self, info: ContainerInfo, *, detail: bool) -> query_pb2.Container:
        return container_pb(info, self._view.health(info), self._view.probes(info), detail=detail)


__all__ = ["SERVICE_NAME", "TRIGGER_INTERVAL_SECONDS", "ProbeCommands", "QueryService"]
