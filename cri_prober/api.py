"""The local gRPC API at ``serve --listen``: criprober.v1, grpc.health.v1 and server reflection.

The servicers only read what the daemon already knows (discovery's view, the probe manager, the
results store and the transition log); RunProbe is the one call that probes inline, and it
touches no state. Health Watch and WatchTransitions are driven by the manager's transitions,
worker exits, discovery's events and relists, and a timer at the moment discovery would turn
stale, never by polling.

The API can run commands in every container (RunProbe with an exec probe), so a unix socket is
created mode 0600 in a parent directory created 0700, and an existing socket file is replaced
only when nothing answers on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import re
import stat
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
import structlog
from google.protobuf import duration_pb2, timestamp_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cri_prober._gen.criprober.v1 import query_pb2, query_pb2_grpc
from cri_prober.cri import ContainerState
from cri_prober.discovery import RELIST_THRESHOLD, ContainerInfo, LifecycleEvent
from cri_prober.errors import ConfigError
from cri_prober.manager import Health, ProbeManager
from cri_prober.prober import ProbeTarget
from cri_prober.results import Published
from cri_prober.spec import KUBELET_PORTS_ANNOTATION, ProbeKind, SpecError
from cri_prober.targets import (
    AmbiguousTarget,
    ContainerRef,
    InvalidTarget,
    TargetError,
    find_container,
    newest_attempts,
    parse_kind,
    parse_probe_json,
    run_once,
)
from cri_prober.transitions import (
    DEFAULT_BUFFER_SIZE,
    Signal,
    Transition,
    TransitionGap,
    TransitionLog,
)
from cri_prober.worker import ProbeRecord, ProbeWorker

if TYPE_CHECKING:
    from cri_prober.daemon import Daemon

log = structlog.get_logger(__name__)

SERVICE_NAME = query_pb2.DESCRIPTOR.services_by_name["CriProber"].full_name
TRIGGER_INTERVAL_SECONDS = 1.0
SHUTDOWN_GRACE_SECONDS = 1.0
# grpc.health.v1 List answers RESOURCE_EXHAUSTED rather than return more than this many.
MAX_LISTED_SERVICES = 100
# The kernel's limit on a unix socket path (sun_path is 108 bytes including the final NUL).
MAX_UNIX_PATH_BYTES = 107
# How long a connection attempt to an existing socket file may take before it counts as stale.
STALE_PROBE_SECONDS = 1.0

_SERVING: int = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING: int = health_pb2.HealthCheckResponse.NOT_SERVING
_SERVICE_UNKNOWN: int = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN

_KIND_ORDER = (ProbeKind.LIVENESS, ProbeKind.READINESS, ProbeKind.STARTUP)

Context = grpc.aio.ServicerContext[Any, Any]


# -- the listen address ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ListenAddress:
    """A ``--listen`` URI: a unix socket path, or a TCP host and port."""

    uri: str
    unix_path: Path | None = None
    host: str = ""
    port: int = 0

    @property
    def grpc_address(self) -> str:
        """The address as ``add_insecure_port`` and ``insecure_channel`` take it."""
        if self.unix_path is not None:
            return f"unix:{self.unix_path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_listen(uri: str, *, flag: str = "--listen") -> ListenAddress:
    """Parse ``unix://PATH`` (absolute) or ``tcp://HOST:PORT``; raise ``ConfigError`` otherwise.

    ``flag`` names the option in messages (clients take the same URIs as ``--address``).
    """
    if uri.startswith("unix://"):
        path = uri.removeprefix("unix://")
        if not path.startswith("/"):
            raise ConfigError(f"{flag} {uri!r}: a unix socket needs an absolute path")
        if len(os.fsencode(path)) > MAX_UNIX_PATH_BYTES:
            raise ConfigError(
                f"{flag} {uri!r}: the socket path is longer than {MAX_UNIX_PATH_BYTES} bytes"
            )
        return ListenAddress(uri, unix_path=Path(path))
    if uri.startswith("tcp://"):
        hostport = uri.removeprefix("tcp://").rstrip("/")
        host, sep, port = hostport.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"{flag} {uri!r}: expected tcp://HOST:PORT")
        return ListenAddress(uri, host=host, port=int(port))
    raise ConfigError(f"{flag} {uri!r}: unsupported; use unix:///PATH or tcp://HOST:PORT")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _prepare_unix_socket(path: Path) -> None:
    """Create the parent directory (0700) and clear a stale socket file; refuse anything else."""
    _make_private_parents(path)
    if not _socket_exists(path):
        return
    if await _answers(path):
        raise ConfigError(
            f"--listen: another process is serving on {path} (is another cri-prober running?); "
            "stop it or choose another --listen address"
        )
    _remove_stale_socket(path)


# The filesystem steps below are local metadata operations: fast enough to run on the loop.


def _make_private_parents(path: Path) -> None:
    missing = [parent for parent in (path.parent, *path.parent.parents) if not parent.exists()]
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            continue
        except OSError as exc:
            raise ConfigError(f"--listen: cannot create {directory}: {exc.strerror}") from exc
        # mkdir's mode is filtered through the umask; the directory must be private regardless.
        directory.chmod(0o700)


def _remove_stale_socket(path: Path) -> None:
    # Nobody listens: a leftover from a process that died without cleaning up.
    log.info("api_stale_socket_removed", path=str(path))
    path.unlink(missing_ok=True)


def _socket_exists(path: Path) -> bool:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"--listen: {path} exists and is not a socket; refusing to replace it")
    return True


async def _answers(path: Path) -> bool:
    try:
        async with asyncio.timeout(STALE_PROBE_SECONDS):
            _reader, writer = await asyncio.open_unix_connection(str(path))
    except (ConnectionRefusedError, FileNotFoundError, TimeoutError):
        return False
    except OSError as exc:
        raise ConfigError(f"--listen: cannot check the existing socket {path}: {exc}") from exc
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


# -- reading the daemon's state -------------------------------------------------------------------


def _ref(info: ContainerInfo) -> ContainerRef:
    return ContainerRef(
        id=info.id,
        name=info.name,
        attempt=info.attempt,
        created_at=info.created_at,
        pod_name=info.pod.name,
        pod_namespace=info.pod.namespace,
        pod_uid=info.pod.uid,
        pod_sandbox_id=info.pod_sandbox_id,
        pod_created_at=info.pod.created_at,
    )


class NodeView:
    """Answers questions about containers from discovery's view and the probe manager."""

    def __init__(self, daemon: Daemon) -> None:
        self.discovery = daemon.discovery
        self.manager: ProbeManager = daemon.manager
        self.shutting_down = False

    def find(self, target: str, *, newest_only: bool = False) -> ContainerInfo:
        """The container ``target`` names; raises ``TargetError``."""
        containers = self.discovery.containers()  # one snapshot for the refs and the lookup
        refs = [_ref(info) for info in containers.values()]
        return containers[find_container(target, newest_attempts(refs) if newest_only else refs).id]

    def container_names(self) -> set[str]:
        """``namespace/pod/container`` of every container (each names its newest attempt)."""
        return {
            f"{info.pod.namespace}/{info.pod.name}/{info.name}"
            for info in self.discovery.containers().values()
        }

    def health(self, info: ContainerInfo) -> Health:
        """The container's derived state; one without probes is healthy while it runs."""
        slot = self.manager.slot_for_container(info.id)
        if slot is not None:
            return self.manager.health(slot)
        running = info.state is ContainerState.CONTAINER_RUNNING
        return Health(running=running, started=running, ready=running, live=True)

    def serving_status(self, service: str) -> int:
        """The health status of ``service`` (interface.md's names); raises ``TargetError``."""
        if service == "":
            healthy = self.discovery.healthy() and not self.shutting_down
            return _SERVING if healthy else _NOT_SERVING
        if service.count("/") == 1:
            serving = self._pod_serving(*service.split("/"))
        else:
            serving = self.health(self.find(service, newest_only=True)).serving
        return _SERVING if serving and not self.shutting_down else _NOT_SERVING

    def _pod_serving(self, namespace: str, name: str) -> bool:
        pods = [
            pod
            for pod in self.discovery.pods().values()
            if pod.namespace == namespace and pod.name == name
        ]
        if not pods:
            raise TargetError(f"no pod {namespace}/{name}")
        pod = max(pods, key=lambda p: p.created_at)
        containers = self.discovery.containers()
        mine = [_ref(info) for info in containers.values() if info.pod_sandbox_id == pod.sandbox_id]
        running = [
            containers[ref.id]
            for ref in newest_attempts(mine)
            if containers[ref.id].state is ContainerState.CONTAINER_RUNNING
        ]
        # A pod whose sandbox is down or that runs nothing serves nothing.
        return pod.ready and bool(running) and all(self.health(c).serving for c in running)


# -- protobuf builders ----------------------------------------------------------------------------


def _timestamp_ns(ns: int) -> timestamp_pb2.Timestamp | None:
    if ns <= 0:
        return None
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(ns)
    return stamp


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    return _timestamp_ns(int(seconds * 1e9)) or timestamp_pb2.Timestamp()


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(int(seconds * 1e9))
    return duration


def attempt_pb(record: ProbeRecord) -> query_pb2.ProbeAttempt:
    """One probe attempt as the API reports it."""
    return query_pb2.ProbeAttempt(
        container_id=record.container_id,
        time=_timestamp(record.started_at),
        duration=_duration(record.duration),
        result=record.result,
        output=record.output,
        exit_code=record.exit_code,
        http_status=record.http_status,
        timed_out=record.timed_out,
    )


def _probe_status(
    view: NodeView, info: ContainerInfo, kind: ProbeKind, worker: ProbeWorker | None
) -> query_pb2.ProbeStatus:
    published = view.manager.results.get(info.id, kind)
    status = query_pb2.ProbeStatus(result=(published or Published.UNKNOWN).value)
    if worker is not None:
        if worker.last_result is Published.SUCCESS:
            status.consecutive_successes = worker.result_run
        else:
            status.consecutive_failures = worker.result_run
        status.on_hold = worker.on_hold
        status.active = not worker.stopped
        status.attempts = worker.probes_run
    return status


def container_pb(view: NodeView, info: ContainerInfo, *, detail: bool) -> query_pb2.Container:
    """A container with its probe state; ``detail`` adds specs, histories and whole outputs."""
    health = view.health(info)
    container = query_pb2.Container(
        id=info.id,
        name=info.name,
        pod_name=info.pod.name,
        pod_namespace=info.pod.namespace,
        pod_uid=info.pod.uid,
        pod_sandbox_id=info.pod_sandbox_id,
        attempt=info.attempt,
        state=query_pb2.ContainerState.ValueType(info.state),
        created_at=_timestamp_ns(info.created_at),
        started_at=_timestamp_ns(info.started_at),
        finished_at=_timestamp_ns(info.finished_at),
        started=health.started,
        ready=health.ready,
        healthy=health.serving,
    )
    container.probes.SetInParent()  # `probes: {}` for a container without any
    slot = view.manager.slot_for_container(info.id)
    if slot is None:
        return container
    for kind in _KIND_ORDER:
        resolved = slot.specs.get(kind)
        if resolved is None:
            continue
        worker = slot.workers.get(kind)
        status = _probe_status(view, info, kind, worker)
        if worker is not None and worker.last_record is not None:
            # The list shows the history's shortened copy of the same attempt, keeping a node's
            # worth of containers in one message.
            last = worker.last_record if detail else worker.history[-1]
            status.last_attempt.CopyFrom(attempt_pb(last))
        if detail:
            spec = resolved.probe.model_dump(mode="json", by_alias=True, exclude_none=True)
            status.detail.spec_json = json.dumps(spec, separators=(",", ":"))
            status.detail.named_ports.update(resolved.ports)
            if worker is not None:
                status.detail.history.extend(attempt_pb(record) for record in worker.history)
        getattr(container.probes, kind.value).CopyFrom(status)
    return container


def transition_pb(transition: Transition) -> query_pb2.Transition:
    """A logged transition as the API streams it."""
    return query_pb2.Transition(
        sequence=transition.sequence,
        time=_timestamp(transition.time),
        container_id=transition.container_id,
        container_name=transition.container_name,
        pod_name=transition.pod_name,
        pod_namespace=transition.pod_namespace,
        pod_uid=transition.pod_uid,
        kind=transition.kind.value,
        previous=transition.previous.value if transition.previous is not None else "",
        result=transition.result.value,
        consecutive=transition.consecutive,
        output=transition.output,
        started=transition.started,
        ready=transition.ready,
        healthy=transition.healthy,
    )


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


# -- the services ---------------------------------------------------------------------------------


class QueryService(query_pb2_grpc.CriProberServicer):
    """criprober.v1.CriProber."""

    def __init__(self, view: NodeView, transitions: TransitionLog) -> None:
        self._view = view
        self._transitions = transitions
        # Last trigger time per worker; weak so stopped workers are forgotten with them.
        self._triggered: weakref.WeakKeyDictionary[ProbeWorker, float] = weakref.WeakKeyDictionary()

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
            for info in self._view.discovery.containers().values()
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
            containers=[container_pb(self._view, info, detail=False) for info in containers]
        )

    async def GetContainer(  # noqa: N802 - gRPC method name
        self, request: query_pb2.GetContainerRequest, context: Context
    ) -> query_pb2.GetContainerResponse:
        try:
            info = self._view.find(request.target)
        except TargetError as exc:
            await _abort_for(context, exc)
        return query_pb2.GetContainerResponse(container=container_pb(self._view, info, detail=True))

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
        try:
            info = self._view.find(request.target)
        except TargetError as exc:
            await _abort_for(context, exc)
        ports: dict[str, int] = {}
        slot = self._view.manager.slot_for_container(info.id)
        if slot is not None:
            # The names the container's configured probes can use, so a variant of one of them
            # resolves its ports the same way.
            for resolved in slot.specs.values():
                ports.update(resolved.ports)
        target = ProbeTarget(
            container_id=info.id,
            pod_ip=info.pod.ip,
            host_network=info.pod.host_network,
            ports=ports,
            ports_annotation=info.annotations.get(KUBELET_PORTS_ANNOTATION),
            env=info.env,
        )
        record = await run_once(self._view.manager.prober, probe, target)
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
        try:
            info = self._view.find(request.target)
        except TargetError as exc:
            await _abort_for(context, exc)
        name = f"{info.pod.namespace}/{info.pod.name}/{info.name} ({info.id[:13]})"
        slot = self._view.manager.slot_for_container(info.id)
        if slot is None or kind not in slot.specs:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{name} has no {kind.value} probe")
        worker = slot.workers.get(kind)
        if worker is None or worker.stopped:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the {kind.value} probe of {name} is not running (the container is gone for good)",
            )
        now = time.monotonic()
        last = self._triggered.get(worker)
        if last is not None and now - last < TRIGGER_INTERVAL_SECONDS:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the {kind.value} probe of {name} was triggered {now - last:.2f}s ago; "
                f"at most once per {TRIGGER_INTERVAL_SECONDS:g}s",
            )
        self._triggered[worker] = now
        worker.probe_now()
        log.info("probe_triggered", container=name, probe=kind.value)
        return query_pb2.TriggerProbeResponse(container_id=info.id, kind=kind.value)


class HealthService(health_pb2_grpc.HealthServicer):  # type: ignore[misc]  # untyped package
    """grpc.health.v1.Health over interface.md's names."""

    def __init__(self, view: NodeView, changed: Signal) -> None:
        self._view = view
        self._changed = changed

    async def Check(  # noqa: N802 - gRPC method name
        self, request: health_pb2.HealthCheckRequest, context: Context
    ) -> health_pb2.HealthCheckResponse:
        try:
            status = self._view.serving_status(request.service)
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
            response.statuses[name].status = self._view.serving_status(name)
        return response

    async def Watch(  # noqa: N802 - gRPC method name
        self, request: health_pb2.HealthCheckRequest, context: Context
    ) -> None:
        last: int | None = None
        while True:
            wake = self._changed.current()
            try:
                status = self._view.serving_status(request.service)
            except TargetError:
                status = _SERVICE_UNKNOWN
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if self._changed.closed:
                return
            await wake.wait()


# -- the server -----------------------------------------------------------------------------------


class ApiServer:
    """The running API: its grpc.aio server, transition log and change notifications."""

    def __init__(self, daemon: Daemon, address: ListenAddress, *, buffer_size: int) -> None:
        self.address = address
        self._daemon = daemon
        self._changed = Signal()
        self.view = NodeView(daemon)
        self.transitions = TransitionLog(
            daemon.manager, size=buffer_size, on_change=self._changed.notify
        )
        self._server = grpc.aio.server(
            # gRPC sets SO_REUSEPORT by default, which would let a second daemon bind the same
            # TCP port silently and steal half the connections.
            options=[("grpc.so_reuseport", 0)]
        )
        query_pb2_grpc.add_CriProberServicer_to_server(
            QueryService(self.view, self.transitions), self._server
        )
        health_pb2_grpc.add_HealthServicer_to_server(
            HealthService(self.view, self._changed), self._server
        )
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], self._server
        )
        self._unsubscribe: list[Callable[[], None]] = []
        self._discovery_batch_pending = False
        self._healthy = False
        self._stale_timer: asyncio.TimerHandle | None = None
        self._socket_id: tuple[int, int] | None = None
        self._stopped = False

    async def start(self) -> None:
        """Bind, start serving and start following the daemon's changes."""
        path = self.address.unix_path
        if path is not None:
            await _prepare_unix_socket(path)
            self._bind_unix(path)
        else:
            bound = self._bind()
            self.address = ListenAddress(self.address.uri, host=self.address.host, port=bound)
            if not _is_loopback(self.address.host):
                log.warning(
                    "api_not_loopback",
                    address=self.address.uri,
                    reason="anyone who can reach it can run commands in every container",
                )
        await self._server.start()
        daemon = self._daemon
        daemon.observer.observers.append(self.transitions)
        self._unsubscribe.append(lambda: daemon.observer.observers.remove(self.transitions))
        self._unsubscribe.append(daemon.discovery.on_event(self._on_discovery_event))
        self._unsubscribe.append(daemon.discovery.on_relist(self._on_relist))
        self._healthy = daemon.discovery.healthy()
        self._arm_stale_timer()
        log.info("api_listening", address=self.address.uri)

    def _bind_unix(self, path: Path) -> None:
        # The socket must never be reachable by others, not even between bind and chmod.
        old_umask = os.umask(0o177)
        try:
            self._bind()
        finally:
            os.umask(old_umask)
        path.chmod(0o600)
        info = path.stat()
        self._socket_id = (info.st_dev, info.st_ino)

    def _remove_socket(self, path: Path) -> None:
        # Only our own socket: a successor may already have replaced it.
        with contextlib.suppress(FileNotFoundError):
            info = path.stat()
            if (info.st_dev, info.st_ino) == self._socket_id:
                path.unlink()

    def _bind(self) -> int:
        try:
            port = self._server.add_insecure_port(self.address.grpc_address)
        except RuntimeError as exc:
            raise ConfigError(f"--listen {self.address.uri}: cannot bind: {exc}") from exc
        if port == 0:
            raise ConfigError(f"--listen {self.address.uri}: cannot bind (address in use?)")
        return port

    async def stop(self) -> None:
        """Report NOT_SERVING to watchers, end the streams, stop and remove the socket."""
        if self._stopped:
            return
        self._stopped = True
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        if self._stale_timer is not None:
            self._stale_timer.cancel()
        self.view.shutting_down = True
        self._changed.close()
        self.transitions.close()
        await self._server.stop(SHUTDOWN_GRACE_SECONDS)
        if self.address.unix_path is not None and self._socket_id is not None:
            self._remove_socket(self.address.unix_path)
        log.info("api_stopped")

    # -- change notifications -------------------------------------------------------------------

    def _on_discovery_event(self, _event: LifecycleEvent) -> None:
        # Discovery emits a relist's events synchronously and the daemon hands them to the
        # manager one loop turn later; look again after that, once per batch.
        if not self._discovery_batch_pending:
            self._discovery_batch_pending = True
            asyncio.get_running_loop().call_soon(self._discovery_batch_done)

    def _discovery_batch_done(self) -> None:
        self._discovery_batch_pending = False
        self._changed.notify()

    def _on_relist(self, _seconds: float, _ok: bool) -> None:
        self._arm_stale_timer()
        self._check_discovery_health()

    def _arm_stale_timer(self) -> None:
        # Discovery turns stale by time passing, not by an event: look again right after the
        # moment it would, unless a relist moves that moment first.
        if self._stale_timer is not None:
            self._stale_timer.cancel()
        self._stale_timer = asyncio.get_running_loop().call_later(
            RELIST_THRESHOLD + 0.1, self._check_discovery_health
        )

    def _check_discovery_health(self) -> None:
        healthy = self._daemon.discovery.healthy()
        if healthy != self._healthy:
            self._healthy = healthy
            self._changed.notify()


async def start_api(
    daemon: Daemon, listen: str, *, buffer_size: int = DEFAULT_BUFFER_SIZE
) -> ApiServer:
    """Serve the API at ``listen``; its stop is registered with ``daemon.add_service``.

    Raises:
        ConfigError: ``listen`` is malformed, or cannot be bound (including a socket another
            live server answers on).
    """
    server = ApiServer(daemon, parse_listen(listen), buffer_size=buffer_size)
    await server.start()
    daemon.add_service(server.stop)
    return server


__all__ = [
    "SERVICE_NAME",
    "ApiServer",
    "HealthService",
    "ListenAddress",
    "NodeView",
    "QueryService",
    "parse_listen",
    "start_api",
]
