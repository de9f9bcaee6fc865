"""The API server's lifecycle: bind ``serve --listen``, serve criprober.v1, grpc.health.v1 and
reflection on one grpc.aio server, follow the manager's and discovery's streams, stop cleanly.

Health Watch and WatchTransitions wake on the manager's events, discovery's relists and a timer
at the moment discovery would turn stale, never by polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import structlog
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cri_prober._gen.criprober.v1 import query_pb2_grpc
from cri_prober.discovery.source import RELIST_THRESHOLD, DiscoveryUpdate, NodeSource, Relisted
from cri_prober.errors import ConfigError
from cri_prober.manager.api import ProbeService
from cri_prober.manager.events import (
    AttemptFinished,
    AttemptsRepeated,
    ManagerEvent,
    ResultChanged,
    subscribe_runs,
)
from cri_prober.runtime.liveness import RuntimeLiveness
from cri_prober.serving.address import (
    ListenAddress,
    is_loopback,
    parse_listen,
    prepare_unix_socket,
)
from cri_prober.serving.health import HealthService
from cri_prober.serving.logcontext import LogContextInterceptor
from cri_prober.serving.query import SERVICE_NAME, QueryService
from cri_prober.serving.snapshot import NodeView
from cri_prober.serving.transitions import DEFAULT_BUFFER_SIZE, Signal, TransitionLog

if TYPE_CHECKING:
    from cri_prober.podspecs.registry import PodSpecs

log = structlog.get_logger(__name__)

SHUTDOWN_GRACE_SECONDS = 1.0
# The largest request the API accepts (RESOURCE_EXHAUSTED beyond). Every request is a few names,
# filters and at most one 16 KiB probe spec (query.py's caps); gRPC's default of 4 MiB let each
# call make the daemon hold and echo megabytes, and RSS never came back down.
MAX_REQUEST_BYTES = 64 * 1024


class ApiServer:
    """The running API: its grpc.aio server, transition log and change notifications."""

    def __init__(
        self,
        address: ListenAddress,
        *,
        node: NodeSource,
        manager: ProbeService,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        runtime: RuntimeLiveness | None = None,
        pod_specs: PodSpecs | None = None,
        runtime_endpoint: str = "",
        warnings: Sequence[str] = (),
    ) -> None:
        self.address = address
        self._node = node
        self._manager = manager
        self._changed = Signal()
        self.view = NodeView(node, manager)
        self.transitions = TransitionLog(size=buffer_size)
        self._server = grpc.aio.server(
            # Every line logged while a call is served says which call, and for which container.
            interceptors=[LogContextInterceptor()],
            options=[
                # gRPC sets SO_REUSEPORT by default, which would let a second daemon bind the
                # same TCP port silently and steal half the connections.
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
            ],
        )
        # "" also follows the runtime's liveness (NOT_SERVING while it answers nothing).
        self._health = HealthService(
            self.view,
            self._changed,
            runtime=runtime,
            pod_specs=pod_specs,
            runtime_endpoint=runtime_endpoint,
            warnings=warnings,
        )
        query_pb2_grpc.add_CriProberServicer_to_server(
            QueryService(
                self.view,
                self.transitions,
                manager,
                not_serving=self._health.not_serving,
                kubelet=lambda: manager.kubelet,
            ),
            self._server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], self._server
        )
        self._unsubscribe: list[Callable[[], None]] = []
        self._healthy = False
        self._stale_timer: asyncio.TimerHandle | None = None
        self._socket_id: tuple[int, int] | None = None
        self._stopped = False

    async def start(self) -> None:
        """Bind, start serving and start following the daemon's changes."""
        path = self.address.unix_path
        if path is not None:
            await prepare_unix_socket(path)
            self._bind_unix(path)
        else:
            bound = self._bind()
            self.address = ListenAddress(self.address.uri, host=self.address.host, port=bound)
            if not is_loopback(self.address.host):
                log.warning(
                    "api_not_loopback",
                    address=self.address.uri,
                    reason="anyone who can reach it can run commands in every container",
                )
        await self._server.start()
        self._unsubscribe.append(subscribe_runs(self._manager.events, self._on_manager_event))
        self._unsubscribe.append(self._node.updates.subscribe(self._on_discovery_update))
        self._healthy = self._node.healthy()
        self._arm_stale_timer()
        log.info(
            "api_listening", address=self.address.uri, incarnation=self.transitions.incarnation
        )

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
        self._health.close()
        self._changed.close()
        self.transitions.close()
        await self._server.stop(SHUTDOWN_GRACE_SECONDS)
        if self.address.unix_path is not None and self._socket_id is not None:
            self._remove_socket(self.address.unix_path)
        log.info("api_stopped")

    # -- change notifications -------------------------------------------------------------------

    def _on_manager_event(self, event: ManagerEvent) -> None:
        if isinstance(event, ResultChanged):
            self.transitions.record(event)
        if not isinstance(event, AttemptFinished | AttemptsRepeated):
            # A transition, a worker gone or a reconcile may change what health answers.
            self._changed.notify()

    def _on_discovery_update(self, update: DiscoveryUpdate) -> None:
        if isinstance(update, Relisted):
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
        healthy = self._node.healthy()
        if healthy != self._healthy:
            self._healthy = healthy
            self._changed.notify()


async def start_api(
    listen: str,
    *,
    node: NodeSource,
    manager: ProbeService,
    buffer_size: int = DEFAULT_BUFFER_SIZE,
    runtime: RuntimeLiveness | None = None,
    pod_specs: PodSpecs | None = None,
    runtime_endpoint: str = "",
    warnings: Sequence[str] = (),
) -> ApiServer:
    """Serve the API at ``listen`` until the returned server's ``stop()``.

    Raises:
        ConfigError: ``listen`` is malformed, or cannot be bound (including a socket another
            live server answers on).
    """
    server = ApiServer(
        parse_listen(listen),
        node=node,
        manager=manager,
        buffer_size=buffer_size,
        runtime=runtime,
        pod_specs=pod_specs,
        runtime_endpoint=runtime_endpoint,
        warnings=warnings,
    )
    await server.start()
    return server


__all__ = ["MAX_REQUEST_BYTES", "ApiServer", "start_api"]
