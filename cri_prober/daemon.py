"""The ``serve`` daemon's composition root: CRI client, discovery, probe manager, API and signals.

Everything runs on one asyncio loop under one TaskGroup. SIGHUP re-reads the rules file (a bad
file is logged and the running set kept); SIGTERM/SIGINT stop workers cleanly and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import structlog

from cri_prober import __version__, api, metrics, systemd
from cri_prober.cri import DEFAULT_MAX_CONCURRENT_EXECS, CriClient
from cri_prober.discovery import Discovery, LifecycleEvent
from cri_prober.endpoints import Endpoint
from cri_prober.errors import CriError
from cri_prober.manager import ManagerObserver, OnFailure, ProbeManager, Slot
from cri_prober.prober import DEFAULT_NODE_ADDRESS, Prober
from cri_prober.probes.http import TLSOptions
from cri_prober.results import ResultUpdate
from cri_prober.spec import ProbeKind, RulesFile, SpecError, load_rules
from cri_prober.worker import ProbeRecord, ProbeWorker

log = structlog.get_logger(__name__)

PlegMode = Literal["auto", "relist", "events"]
SHUTDOWN_GRACE_SECONDS = 5.0
READY_POLL_SECONDS = 0.05


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Everything ``cri-prober serve`` was asked to do."""

    endpoint: Endpoint
    config_file: Path | None = None
    listen: str = "unix:///run/cri-prober/cri-prober.sock"
    metrics_address: str | None = None
    pleg: PlegMode = "auto"
    relist_period: float = 1.0
    on_failure: OnFailure = "report"
    node_address: str = DEFAULT_NODE_ADDRESS
    max_concurrent_execs: int = DEFAULT_MAX_CONCURRENT_EXECS
    https: TLSOptions | None = None  # None: no verification, like the kubelet
    history_size: int = 32


def read_rules(path: Path | None) -> RulesFile:
    """Load the rules file; no file means no rules (annotations can still define probes)."""
    if path is None:
        return RulesFile(probes=())
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError([f"cannot read: {exc.strerror}"], source=str(path)) from exc
    return load_rules(text, source=str(path))


class FanoutObserver:
    """Forwards manager events to several observers (metrics, the API's transition log)."""

    def __init__(self, *observers: ManagerObserver) -> None:
        self.observers = list(observers)

    def probe_finished(self, slot: Slot, kind: ProbeKind, record: ProbeRecord) -> None:
        for observer in self.observers:
            observer.probe_finished(slot, kind, record)

    def transition(self, slot: Slot, update: ResultUpdate, worker: ProbeWorker | None) -> None:
        for observer in self.observers:
            observer.transition(slot, update, worker)

    def worker_stopped(self, slot: Slot, kind: ProbeKind) -> None:
        for observer in self.observers:
            observer.worker_stopped(slot, kind)


class Daemon:
    """One running ``serve``: owns the client, discovery, manager and the API servers."""

    def __init__(self, config: ServeConfig, rules: RulesFile) -> None:
        self.config = config
        self.started_at = time.time()
        self.observer = FanoutObserver()
        self.cri_call_observers: list[Callable[[str, str, float], None]] = []
        self.cri = CriClient.connect(
            config.endpoint.target,
            max_concurrent_execs=config.max_concurrent_execs,
            on_call=self._on_cri_call,
        )
        self.discovery = Discovery(self.cri)
        self.prober = Prober(self.cri, node_address=config.node_address, tls=config.https)
        self.manager = ProbeManager(
            prober=self.prober,
            rules=rules,
            prober_started_at=self.started_at,
            on_failure=config.on_failure,
            stopper=self.cri,
            observer=self.observer,
            history_size=config.history_size,
        )
        self.stop_event = asyncio.Event()
        self.notifier = systemd.Notifier.from_env()  # a no-op unless run by systemd (Type=notify)
        self.ready = asyncio.Event()  # set once the runtime answered and the API is bound
        self._pending_events: list[LifecycleEvent] = []
        self._flush_scheduled = False
        self._services: list[Callable[[], Coroutine[Any, Any, None]]] = []

    # -- discovery -> manager, batched ----------------------------------------------------------

    def _on_lifecycle(self, event: LifecycleEvent) -> None:
        # Discovery emits a whole relist's events synchronously; reconcile once per batch.
        self._pending_events.append(event)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        events, self._pending_events = self._pending_events, []
        self.manager.on_lifecycle(events, self.discovery.containers().values())

    # -- reload ---------------------------------------------------------------------------------

    def reload(self) -> bool:
        """Re-read the rules file; keep the running set if it is bad. Returns success."""
        try:
            rules = read_rules(self.config.config_file)
        except SpecError as exc:
            log.error("config_reload_failed", file=str(self.config.config_file), errors=exc.lines)
            return False
        self.manager.set_rules(rules, self.discovery.containers().values())
        log.info(
            "config_reloaded",
            file=str(self.config.config_file),
            rules=len(rules.probes),
            workers=self.manager.worker_count(),
        )
        return True

    def _on_cri_call(self, method: str, code: str, seconds: float) -> None:
        # The client exists before any observer (metrics) does; fan its calls out to them.
        for observer in self.cri_call_observers:
            observer(method, code, seconds)

    def add_service(self, stop: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Register a coroutine function that stops a started service at shutdown."""
        self._services.append(stop)

    # -- running --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run until SIGTERM/SIGINT (or ``stop_event``), then shut down cleanly."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.stop_event.set)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        unsubscribe = self.discovery.on_event(self._on_lifecycle)
        log.info(
            "serve_starting",
            version=__version__,
            runtime_endpoint=self.config.endpoint.uri,
            endpoint_source=self.config.endpoint.source,
            config=str(self.config.config_file) if self.config.config_file else None,
            pleg=self.config.pleg,
            on_failure=self.config.on_failure,
        )
        try:
            # Bound before anything runs, so a bad address fails the start (exit 2) and the
            # transition log sees every worker's first result.
            if self.config.metrics_address is not None:
                await metrics.start_metrics(self, self.config.metrics_address)
            await api.start_api(self, self.config.listen)
            async with asyncio.TaskGroup() as group:
                group.create_task(
                    self.discovery.run(
                        self.config.pleg,
                        relist_period=self.config.relist_period,
                        stop=self.stop_event,
                    ),
                    name="discovery",
                )
                group.create_task(self._announce_ready(), name="ready")
                group.create_task(
                    systemd.watchdog_loop(self.notifier, self.stop_event), name="watchdog"
                )
                await self.stop_event.wait()
                self.notifier.stopping()
            log.info("serve_stopping", workers=self.manager.worker_count())
        finally:
            unsubscribe()
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(signum)
            await self.manager.shutdown(SHUTDOWN_GRACE_SECONDS)
            for stop in reversed(self._services):
                await stop()
            await self.cri.close()
            log.info("serve_stopped")

    async def _announce_ready(self) -> None:
        # Ready once the runtime has answered a first relist; discovery keeps retrying on its own,
        # so this only waits (on the stop event, to stay interruptible) and looks again.
        while self.discovery.last_relist_ok is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop_event.wait(), READY_POLL_SECONDS)
            if self.stop_event.is_set():
                return
        try:
            version = await self.cri.version()
        except CriError as exc:
            log.warning("runtime_version_failed", error=str(exc))
            return
        log.info(
            "runtime_connected",
            runtime=version.runtime_name,
            runtime_version=version.runtime_version,
            mode=self.discovery.effective_mode,
            containers=len(self.discovery.containers()),
        )
        self.ready.set()
        self.notifier.ready(status=f"probing on {version.runtime_name} {version.runtime_version}")
