"""The ``criprober.v1.CriProber`` servicer: list and get containers, stream transitions, run
or trigger a probe.

It reads the frozen read model and the transition log; RunProbe and TriggerProbe go through the
manager's two commands, so no servicer touches a worker.

Whoever reaches the socket may send anything, and every call runs on the daemon's one event loop,
so no request may cost more than its size: filters are RE2 expressions (linear-time matching,
never backtracking), every string field has a cap, and an error quotes at most a short piece of
what was sent (``naming.shown``) in details clipped to ``MAX_DETAIL_BYTES``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, cast

import grpc
import structlog

from cri_prober import __version__
from cri_prober._gen.criprober.v1 import query_pb2, query_pb2_grpc
from cri_prober.discovery.model import ContainerInfo
from cri_prober.discovery.naming import AmbiguousTarget, InvalidTarget, TargetError, clip, shown
from cri_prober.manager.api import NoSuchProbe, ProbeNotRunning, ProbeOnHold
from cri_prober.probing.kinds import KINDS, ProbeKind, parse_kind
from cri_prober.probing.kubelet_profile import KubeletProfile
from cri_prober.probing.results import ProbeRecord
from cri_prober.probing.spec import SpecError
from cri_prober.runtime.model import ContainerState
from cri_prober.serving.convert import attempt_pb, container_pb, transition_pb
from cri_prober.serving.snapshot import NodeView
from cri_prober.serving.transitions import (
    IncarnationRequired,
    OtherIncarnation,
    TransitionGap,
    TransitionLog,
)

if TYPE_CHECKING:
    from cri_prober.probing.spec import Probe

log = structlog.get_logger(__name__)

SERVICE_NAME = query_pb2.DESCRIPTOR.services_by_name["CriProber"].full_name
TRIGGER_INTERVAL_SECONDS = 1.0
# Per-field caps (INVALID_ARGUMENT beyond); the whole message is capped by the server (server.py).
MAX_FILTER_CHARS = 256  # each ContainerFilter field
MAX_PROBE_JSON_CHARS = 16 * 1024  # RunProbe's spec: a probe is a few hundred bytes of JSON
MAX_INCARNATION_CHARS = 64  # ours are 16 hex characters
# Error details go back in the grpc-message trailer, percent-encoded (up to 3 bytes per byte),
# and a client drops trailers past 16 KiB: 2 KiB of UTF-8 stays clear of that and of the 8 KiB
# soft limit.
MAX_DETAIL_BYTES = 2048
# RE2's memory budget per compiled filter; a pattern that needs more is "too large"
# (INVALID_ARGUMENT). re2.compile keeps its last 128 patterns, so this also bounds that cache.
RE2_MAX_MEM = 1 << 20
# Initial metadata of WatchTransitions: this process's incarnation, before any transition.
INCARNATION_METADATA_KEY = "criprober-incarnation"
# What an RE2 error means for someone used to Python's or PCRE's syntax.
_RE2_HINT = (
    "filters use RE2 syntax, like crictl (Go's regexp): no backreferences, lookaround, "
    "possessive repeats or atomic groups"
)

Context = grpc.aio.ServicerContext[Any, Any]


class _Pattern(Protocol):
    def search(self, text: str) -> object | None: ...


@functools.cache
def _re2() -> Any:
    """google-re2, imported when the first filter comes (serve need not hold it till then)."""
    import re2  # type: ignore[import-untyped]  # google-re2 ships no type information

    return re2


@functools.cache
def _re2_options() -> Any:
    options = _re2().Options()
    # A bad pattern is the client's error, answered as such, not a line on serve's stderr.
    options.log_errors = False
    options.max_mem = RE2_MAX_MEM
    return options


def _compile(field: str, pattern: str) -> _Pattern:
    """``pattern`` as an RE2 expression; raises ValueError with the message for the client."""
    re2 = _re2()
    try:
        return cast(_Pattern, re2.compile(pattern, _re2_options()))
    except re2.error as exc:
        reason = exc.args[0] if exc.args else "invalid"
        if isinstance(reason, bytes):
            reason = reason.decode("utf-8", "replace")
        # RE2 quotes the offending part of the pattern: keep it short as well.
        raise ValueError(
            f"filter.{field}: invalid regular expression {shown(pattern)}: "
            f"{clip(str(reason), 200)}; {_RE2_HINT}"
        ) from None


class ProbeCommands(Protocol):
    """What the API may ask of the manager (a part of ``cri_prober.manager.api.ProbeService``)."""

    def probe_now(self, container_id: str, kind: ProbeKind) -> None: ...
    async def run_probe(self, container: ContainerInfo, probe: Probe) -> ProbeRecord: ...


class _Filter:
    """A compiled ContainerFilter; raises ValueError with the message for the client."""

    def __init__(self, spec: query_pb2.ContainerFilter) -> None:
        for field in ("id", "name", "namespace", "pod"):
            length = len(getattr(spec, field))
            if length > MAX_FILTER_CHARS:
                raise ValueError(
                    f"filter.{field}: {length} characters, more than {MAX_FILTER_CHARS}"
                )
        self._id = spec.id
        self._patterns = [
            (field, _compile(field, pattern))
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
            pattern.search(values[field]) is not None for field, pattern in self._patterns
        )


async def _abort(context: Context, code: grpc.StatusCode, message: str) -> NoReturn:
    """End the call with ``code``; ``message`` clipped to ``MAX_DETAIL_BYTES``."""
    await context.abort(code, clip(message, MAX_DETAIL_BYTES))


async def _abort_for(context: Context, exc: TargetError) -> NoReturn:
    code = grpc.StatusCode.NOT_FOUND
    if isinstance(exc, AmbiguousTarget):
        code = grpc.StatusCode.FAILED_PRECONDITION
    elif isinstance(exc, InvalidTarget):
        code = grpc.StatusCode.INVALID_ARGUMENT
    await _abort(context, code, str(exc))


def _kind(text: str) -> ProbeKind:
    """``parse_kind`` whose message quotes at most a short piece of ``text``."""
    try:
        return parse_kind(text)
    except ValueError:
        raise ValueError(
            f"unknown probe kind {shown(text)}: expected one of {', '.join(KINDS)}"
        ) from None


def kubelet_semantics(profile: KubeletProfile) -> query_pb2.KubeletSemantics:
    """The API's view of a kubelet profile: its release, every gate it has, and a line."""
    return query_pb2.KubeletSemantics(
        version=profile.version,
        gates=[
            query_pb2.KubeletGate(name=name, enabled=on, explicit=name in profile.gates)
            for name, on in sorted(profile.effective_gates().items())
        ],
        text=profile.describe(),
    )


class QueryService(query_pb2_grpc.CriProberServicer):
    """criprober.v1.CriProber."""

    def __init__(
        self,
        view: NodeView,
        transitions: TransitionLog,
        commands: ProbeCommands,
        *,
        not_serving: Callable[[], query_pb2.NotServing | None] = lambda: None,
        kubelet: Callable[[], KubeletProfile] = KubeletProfile,
    ) -> None:
        self._view = view
        # The kubelet release and gates the probes follow (it may change once at start).
        self._kubelet = kubelet
        # Why cri-prober itself is not SERVING (the health service's words), for ListContainers.
        self._not_serving = not_serving
        self._transitions = transitions
        self._commands = commands
        # Last trigger time per (container ID, kind); entries older than the interval are pruned.
        self._triggered: dict[tuple[str, ProbeKind], float] = {}

    async def ListContainers(  # noqa: N802 - gRPC method name
        self, request: query_pb2.ListContainersRequest, context: Context
    ) -> query_pb2.ListContainersResponse:
        try:
            wanted = _Filter(request.filter)
        except ValueError as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.HasField("state"):
            if request.state not in ContainerState._value2member_map_:
                # proto3 enums are open: a client may send any number.
                await _abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"state: unknown value {request.state}",
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
            containers=[self._container(info, detail=False) for info in containers],
            not_serving=self._not_serving(),
        )

    async def GetContainer(  # noqa: N802 - gRPC method name
        self, request: query_pb2.GetContainerRequest, context: Context
    ) -> query_pb2.GetContainerResponse:
        info = await self._find(request.target, context)
        return query_pb2.GetContainerResponse(
            container=self._container(info, detail=True),
            kubelet=kubelet_semantics(self._kubelet()),
        )

    async def GetInfo(  # noqa: N802 - gRPC method name
        self, request: query_pb2.GetInfoRequest, context: Context
    ) -> query_pb2.GetInfoResponse:
        return query_pb2.GetInfoResponse(
            version=__version__, kubelet=kubelet_semantics(self._kubelet())
        )

    async def WatchTransitions(  # noqa: N802 - gRPC method name
        self, request: query_pb2.WatchTransitionsRequest, context: Context
    ) -> AsyncIterator[query_pb2.Transition]:
        try:
            wanted = _Filter(request.filter)
        except ValueError as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if len(request.incarnation) > MAX_INCARNATION_CHARS:
            await _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"incarnation: {shown(request.incarnation, 16)} is not one "
                f"(at most {MAX_INCARNATION_CHARS} characters)",
            )
        since = request.since_sequence if request.HasField("since_sequence") else None
        incarnation = request.incarnation or None
        try:
            self._transitions.check_resume(since, incarnation)
        except OtherIncarnation as exc:
            await _abort(context, grpc.StatusCode.OUT_OF_RANGE, str(exc))
        except IncarnationRequired as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # A client learns the incarnation before any transition arrives, so even one that saw
        # none can resume safely (since 0 with it).
        await context.send_initial_metadata(
            ((INCARNATION_METADATA_KEY, self._transitions.incarnation),)
        )
        try:
            async for transition in self._transitions.follow(since, incarnation):
                if wanted.matches(
                    container_id=transition.container_id,
                    name=transition.container_name,
                    namespace=transition.pod_namespace,
                    pod=transition.pod_name,
                ):
                    yield transition_pb(transition)
        except TransitionGap as exc:
            await _abort(context, grpc.StatusCode.OUT_OF_RANGE, str(exc))

    async def RunProbe(  # noqa: N802 - gRPC method name
        self, request: query_pb2.RunProbeRequest, context: Context
    ) -> query_pb2.RunProbeResponse:
        if len(request.probe_json) > MAX_PROBE_JSON_CHARS:
            await _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"probe_json: {len(request.probe_json)} characters, more than the "
                f"{MAX_PROBE_JSON_CHARS} a probe spec may have",
            )
        # Imported here: the models (pydantic) load with the first probe to validate (issue 36).
        from cri_prober.probing.spec.model import parse_probe_json

        try:
            kind = _kind(request.kind or ProbeKind.LIVENESS.value)
            probe = parse_probe_json(request.probe_json, kind, source="probe_json")
        except SpecError as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "; ".join(exc.lines))
        except ValueError as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"kind: {exc}")
        info = await self._find(request.target, context)
        record = await self._commands.run_probe(info, probe)
        return query_pb2.RunProbeResponse(attempt=attempt_pb(record))

    async def TriggerProbe(  # noqa: N802 - gRPC method name
        self, request: query_pb2.TriggerProbeRequest, context: Context
    ) -> query_pb2.TriggerProbeResponse:
        if not request.kind:
            await _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "kind: required (liveness, readiness or startup)",
            )
        try:
            kind = _kind(request.kind)
        except ValueError as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"kind: {exc}")
        info = await self._find(request.target, context)
        name = f"{info.pod.namespace}/{info.pod.name}/{info.name} ({info.id[:13]})"
        now = time.monotonic()
        self._triggered = {
            key: at for key, at in self._triggered.items() if now - at < TRIGGER_INTERVAL_SECONDS
        }
        last = self._triggered.get((info.id, kind))
        if last is not None:
            await _abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the {kind.value} probe of {name} was triggered {now - last:.2f}s ago; "
                f"at most once per {TRIGGER_INTERVAL_SECONDS:g}s",
            )
        try:
            self._commands.probe_now(info.id, kind)
        except NoSuchProbe:
            await _abort(context, grpc.StatusCode.NOT_FOUND, f"{name} has no {kind.value} probe")
        except ProbeNotRunning:
            await _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the {kind.value} probe of {name} is not running (the container is gone for good)",
            )
        except ProbeOnHold as exc:
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"{name}: {exc}")
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


__all__ = [
    "INCARNATION_METADATA_KEY",
    "MAX_DETAIL_BYTES",
    "MAX_FILTER_CHARS",
    "MAX_INCARNATION_CHARS",
    "MAX_PROBE_JSON_CHARS",
    "SERVICE_NAME",
    "TRIGGER_INTERVAL_SECONDS",
    "ProbeCommands",
    "QueryService",
]
