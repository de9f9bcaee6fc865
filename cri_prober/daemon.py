"""The ``serve`` daemon's composition root: CRI client, discovery, probe manager, API and signals.

It builds each part, wires discovery's stream into the manager, and hands each server only the
collaborators it needs. Everything runs on one asyncio loop; every long-lived task runs under one
``Supervisor`` (``cri_prober.aio``), which restarts a task that fails. SIGHUP re-reads
the rules file (a bad file is logged and the running set kept); SIGTERM/SIGINT stop workers
cleanly and exit 0 within the shutdown grace, even if a worker thread is stuck.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import structlog

from cri_prober import __version__, fdlimit, malloc, systemd
from cri_prober.aio import Supervisor, close_logged, wait_first
from cri_prober.discovery.pleg import Discovery
from cri_prober.discovery.source import DiscoveryUpdate, ViewChanged
from cri_prober.errors import ConfigError, CriError
from cri_prober.manager.dropped_ticks import DroppedTicks, ExecPressure
from cri_prober.manager.events import AttemptFinished, AttemptsRepeated, ManagerEvent
from cri_prober.manager.memory import StateWriter, load_state
from cri_prober.manager.probe_manager import AnnotationMode, FailureHold, OnFailure, ProbeManager
from cri_prober.manager.selection import PodSpecProbes
from cri_prober.podspecs.options import (
    PodSourceOptions,
    SourceSpec,
    build_mirror,
    build_sources,
)
from cri_prober.probing.handlers.http import TLSOptions
from cri_prober.probing.kubelet_profile import KubeletProfile
from cri_prober.probing.pressure import PRESSURE_DIR, PressureReader
from cri_prober.probing.prober import (
    DEFAULT_NODE_ADDRESS,
    AnnotationHosts,
    Prober,
    ProberOptions,
)
from cri_prober.probing.spec import RulesFile, SpecError, load_rules, read_rules_file
from cri_prober.runtime.client import (
    DEFAULT_MAX_CONCURRENT_EXECS,
    DEFAULT_RUNTIME_REQUEST_TIMEOUT,
    CriClient,
)
from cri_prober.runtime.endpoints import Endpoint
from cri_prober.serving.server import ApiServer, start_api
from cri_prober.threads import WorkerThreads

if TYPE_CHECKING:
    from cri_prober.podspecs.apiserver import ApiServerSource
    from cri_prober.podspecs.kubelet_metrics import KubeletMetricsReader, TrackerUpdate
    from cri_prober.podspecs.registry import PodSpecs
    from cri_prober.podspecs.unhealthy_events import UnhealthyEvents

    # Imported where --metrics-address asks for it: prometheus_client and the metrics modules
    # hold about 4.5 MiB that a serve without metrics does not need (bench/idle_rss.py).
    from cri_prober.serving.metrics_http import MetricsServer

log = structlog.get_logger(__name__)

# serve --mirror: the task reading the kubelet's probe counters.
MIRROR_TASK = "kubelet-mirror"
# serve --mirror with --probes-from apiserver: the task watching the kubelet's Unhealthy events.
EVENTS_TASK = "kubelet-events"


def _no_pods() -> None:
    """The mirror reader lists no pods: nothing to tell the registry."""


PlegMode = Literal["auto", "relist", "events"]
# From SIGTERM: probe workers finish their step, and worker threads their call, within this.
SHUTDOWN_GRACE_SECONDS = 5.0
# The collector's thresholds once serve is ready (CPython's default: 700, 10, 10). Every probe
# attempt allocates a few dozen tracked objects, and every waiting worker's future, timer and
# coroutines live a whole period, long enough to reach the oldest generation: at 5,000
# containers the defaults ran 24 young collections a second and a full one every 5 s, each
# stopping the loop up to 0.22 s (docs/benchmarks.md §3). Fewer, larger young collections
# (about 10 ms each), and a full collection only after 100 middle ones.
GC_THRESHOLDS = (10_000, 10, 10)
# serve asks the runtime's version to announce it is ready, again after a failure: first after
# this many seconds, doubling up to the last.
READY_RETRY_INITIAL = 0.1
READY_RETRY_MAX = 5.0
# The exit status of a serve that could not start (a ConfigError: an unbindable --listen or
# --metrics-address, a live server on the socket), as the serve command exits with it
# (cli.common.EXIT_USAGE); and of one that ended with an unexpected exception, as Python exits.
EXIT_START_ERROR = 2
EXIT_CRASHED = 1
# The daemon's own supervised tasks, in start order.
DAEMON_TASKS = ("discovery", "ready", "watchdog", "state", "reload")


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Everything ``cri-prober serve`` was asked to do."""

    endpoint: Endpoint
    config_file: Path | None = None
    listen: str = "unix:///run/cri-prober/cri-prober.sock"
    metrics_address: str | None = None
    metrics_attempt_durations: bool = False  # export cri_prober_probe_duration_seconds
    # gc.freeze() once ready (see _announce_ready): the serve command's choice; off by default
    # so that a daemon run inside another program (tests, benchmarks) leaves its GC alone.
    freeze_gc: bool = False
    # glibc's allocator set for a long-running daemon (cri_prober/malloc.py): the serve
    # command's choice too, off by default for the same reason.
    tune_malloc: bool = False
    # Run blocking calls (asyncio.to_thread) on the daemon's own WorkerThreads, set as the loop's
    # default executor, so a call stuck in the kernel cannot keep the process from exiting: the
    # serve command's choice; off by default so that a daemon run inside another program leaves
    # its loop's executor alone.
    own_worker_threads: bool = False
    pleg: PlegMode = "auto"
    relist_period: float = 1.0
    on_failure: OnFailure = "report"
    failure_hold: FailureHold = "auto"
    node_address: str = DEFAULT_NODE_ADDRESS
    max_concurrent_execs: int = DEFAULT_MAX_CONCURRENT_EXECS
    runtime_request_timeout: float = DEFAULT_RUNTIME_REQUEST_TIMEOUT
    https: TLSOptions | None = None  # None: no verification, like the kubelet
    history_size: int = 32
    # Where started/ready survive our own restarts (KEP-4781); "auto": beside a unix --listen.
    state_file: Path | Literal["auto"] | None = "auto"
    probe_on_exit: bool = True
    # What pod annotations may do (README "Security"): which probes they may define, and where
    # their network probes may connect when they set an explicit host.
    annotations: AnnotationMode = "all"
    annotation_probe_hosts: AnnotationHosts = field(default_factory=AnnotationHosts)
    # serve --probes-from: the pods' own specs, and what their sources need.
    probes_from: tuple[SourceSpec, ...] = ()
    pod_sources: PodSourceOptions | None = None
    # Which of their probes run here: all, or the network ones (exec stays the kubelet's alone).
    pod_spec_probes: PodSpecProbes = "all"
    # serve --mirror: the URL of the kubelet's /metrics/probes; the pod specs' probes are then
    # mirrored from the kubelet's counters and pod status, not run ("": they run).
    mirror: str = ""
    # --mirror-explain rerun: run a mirrored probe once on a new kubelet failure, for its output.
    mirror_explain: bool = False
    # Where the node's PSI files are (tests point it at files of their own).
    pressure_directory: Path = PRESSURE_DIR
    # The kubelet release and gates whose probe behaviour to follow (--kubelet-version,
    # --kubelet-feature-gates); with --probes-from apiserver the Node object's kubeletVersion
    # replaces the release (kubelet_version_flag: what the flag said, None when not given).
    kubelet: KubeletProfile = field(default_factory=KubeletProfile)
    kubelet_version_flag: str | None = None
    kubelet_gates_flag: str | None = None

    def prober_options(self) -> ProberOptions:
        """How the daemon's probes are sent (``check`` builds the same from the same flags)."""
        return ProberOptions(
            node_address=self.node_address,
            tls=self.https,
            annotation_hosts=self.annotation_probe_hosts,
            profile=self.kubelet,
        )

    def warnings(self) -> list[str]:
        """What ``serve`` warns of once at start (logged as ``no_probe_source``) and ``health``
        repeats: neither a rules file nor ``--probes-from``, so only annotations can define
        probes (with ``--annotations off``, nothing is probed at all)."""
        if self.config_file is not None or self.probes_from:
            return []
        if self.annotations == "off":
            return [
                "nothing to probe: no rules file (--config), no --probes-from, and "
                "--annotations off"
            ]
        return [
            "no rules file (--config) and no --probes-from: only containers whose pods carry a "
            "probes.cri-prober.io/<container> annotation are probed"
        ]

    def resolved_state_file(self) -> Path | None:
        """The state file to use: the explicit one, or state.json beside the unix API socket."""
        if self.state_file != "auto":
            return self.state_file
        if self.listen.startswith("unix://"):
            return Path(self.listen.removeprefix("unix://")).with_name("state.json")
        return None


def read_rules(path: Path | None) -> RulesFile:
    """Load the rules file; no file means no rules (annotations can still define probes).

    Blocking: it reads and parses up to spec.RULES_FILE_MAX_BYTES, which takes up to a second or
    so. The daemon's reloads run it in a worker thread.

    Raises:
        SpecError: the file cannot be read, is no regular file, too large, or invalid.
    """
    if path is None:
        return RulesFile(probes=())
    return load_rules(read_rules_file(path), source=str(path))


class Daemon:
    """One running ``serve``: owns the client, discovery, manager and the API servers."""

    def __init__(self, config: ServeConfig, rules: RulesFile) -> None:
        self.config = config
        self.started_at = time.time()
        self.stop_event = asyncio.Event()
        # Every long-lived task runs under it; a fatal failure sets stop_event (exit non-zero).
        self.supervisor = Supervisor(stop=self.stop_event)
        self.cri = CriClient.connect(
            config.endpoint.target,
            max_concurrent_execs=config.max_concurrent_execs,
            runtime_request_timeout=config.runtime_request_timeout,
        )
        self.discovery = Discovery(self.cri)
        self.prober = Prober.from_options(self.cri, config.prober_options())
        self.pod_specs: PodSpecs | None = None
        self.mirror: KubeletMetricsReader | None = None
        if config.mirror and not config.probes_from:
            raise ConfigError(
                "--mirror needs --probes-from kubelet or apiserver: the pod specs say which "
                "probes the kubelet runs, and the pod status their ready and started"
            )
        if config.probes_from:
            options = config.pod_sources or PodSourceOptions(node_name="")
            if config.mirror:
                options = dataclasses.replace(options, keep_statuses=True)
                self.mirror = build_mirror(config.mirror, options)
            # Imported here: pod sources load the models, msgspec and an HTTP client (issue 36).
            from cri_prober.podspecs.registry import PodSpecs

            self.pod_specs = PodSpecs(
                build_sources(config.probes_from, options), supervisor=self.supervisor
            )
        self.state_file = config.resolved_state_file()
        remembered = load_state(self.state_file) if self.state_file is not None else {}
        self._remembered_pruned = False
        # Sampled in a worker thread by the "pressure" task; failed attempts take its latest.
        self.pressure = PressureReader(config.pressure_directory)
        self.manager = ProbeManager(
            prober=self.prober,
            rules=rules,
            prober_started_at=self.started_at,
            on_failure=config.on_failure,
            failure_hold=config.failure_hold,
            pressure=self.pressure,
            kubelet=config.kubelet,
            stopper=self.cri,
            history_size=config.history_size,
            probe_on_exit=config.probe_on_exit,
            remembered=remembered,
            annotations=config.annotations,
            pod_spec_probes=config.pod_spec_probes,
            pod_specs=self.pod_specs,
            rules_source=str(config.config_file) if config.config_file else "",
            supervisor=self.supervisor,
            mirror=self.mirror is not None,
            mirror_explain=config.mirror_explain,
        )
        if self.mirror is not None:
            self.mirror.attach(self._on_mirrored)
        self.unhealthy_events = self._unhealthy_events()
        self.dropped_ticks = DroppedTicks(execs=self._exec_pressure)
        self.state_writer = (
            StateWriter(self.state_file, self.manager.remembered_state)
            if self.state_file is not None
            else None
        )
        # join_timeout 0: run() already waited what the grace allowed, so the loop's own shutdown
        # (asyncio.Runner waits for its default executor) returns at once.
        self.threads = (
            WorkerThreads(join_timeout=0.0, name="cri-prober-worker")
            if config.own_worker_threads
            else None
        )
        self._reload_requested = asyncio.Event()  # set by SIGHUP (request_reload)
        self._reload_lock = asyncio.Lock()
        self.notifier = systemd.Notifier.from_env()  # a no-op unless run by systemd (Type=notify)
        self.ready = asyncio.Event()  # set once the runtime answered and the API is bound
        self.api: ApiServer | None = None
        self.metrics: MetricsServer | None = None

    def _exec_pressure(self) -> ExecPressure:
        cri = self.cri
        return ExecPressure(
            cap=cri.max_concurrent_execs,
            waiting=cri.execs_waiting,
            slot_wait_seconds=cri.exec_slot_wait_seconds,
            pace=cri.exec_pace,
            runtime_slow=cri.exec_runtime_slow,
        )

    # -- discovery -> manager ------------------------------------------------------------------

    def _on_manager_event(self, event: ManagerEvent) -> None:
        # An attempt changes no remembered state (started/ready); transitions and the set of
        # containers do. Marking on every attempt rewrote the file every second for nothing.
        if self.state_writer is not None and not isinstance(
            event, AttemptFinished | AttemptsRepeated
        ):
            self.state_writer.mark_dirty()

    def _on_discovery(self, update: DiscoveryUpdate) -> None:
        # Discovery publishes a relist's (or an event batch's) changes at once: reconcile once.
        if isinstance(update, ViewChanged):
            self.manager.on_lifecycle(update.events, self.discovery.containers().values())
        elif update.ok and not self._remembered_pruned and self.discovery.complete:
            # The first complete relist (its view is already in place) shows which remembered
            # containers are still on the node; the rest left while cri-prober was down. From
            # now on the manager forgets each one as it is removed.
            self._remembered_pruned = True
            self.manager.retain_remembered(self.discovery.containers())

    def _on_pod_specs(self) -> None:
        self.manager.on_pod_specs(self.discovery.containers().values())

    # -- reload ---------------------------------------------------------------------------------

    def request_reload(self) -> None:
        """SIGHUP: reload soon. Requests made while a reload runs lead to one more, not many."""
        self._reload_requested.set()

    async def _reload_on_request(self) -> None:
        while True:
            await self._reload_requested.wait()
            # Cleared before reading: a SIGHUP from now on may mean a newer file, so it gets a
            # reload of its own; any number of them while this one runs make one more.
            self._reload_requested.clear()
            try:
                await self.reload()
            except Exception:
                # A bug, not a bad file (that is a SpecError): keep serving the running set, as
                # a signal callback that raised used to.
                log.exception("config_reload_crashed", file=str(self.config.config_file))

    async def reload(self) -> bool:
        """Re-read the rules file; keep the running set if it is bad. Returns success.

        Reading and parsing run in a worker thread, so the loop keeps probing and answering
        meanwhile; only applying the new rules runs on it. Reloads run one at a time, in order.
        """
        async with self._reload_lock:
            try:
                rules = await asyncio.to_thread(read_rules, self.config.config_file)
            except SpecError as exc:
                log.error(
                    "config_reload_failed", file=str(self.config.config_file), errors=exc.lines
                )
                return False
            self.manager.set_rules(rules, self.discovery.containers().values())
            log.info(
                "config_reloaded",
                file=str(self.config.config_file),
                rules=len(rules.probes),
                workers=self.manager.worker_count(),
            )
            return True

    # -- running --------------------------------------------------------------------------------

    async def run(self) -> int:
        """Run until SIGTERM/SIGINT (or ``stop_event``), then shut down cleanly.

        Returns the exit status: 0, or the supervisor's when a fatal task failed. Shutdown stops
        everything in reverse start order, each part even if another failed.
        """
        loop = asyncio.get_running_loop()
        if self.threads is not None:
            loop.set_default_executor(self.threads)
        grace_ends: float | None = None  # set when the stop is requested
        exit_code: int | None = None  # set when run ends with an exception (its exit status)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.stop_event.set)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)
        unsubscribe = self.discovery.updates.subscribe(self._on_discovery)
        # Both take a steady probe's repeated attempts in runs (nothing dropped, no state).
        unsubscribe_dropped = self.manager.events.subscribe(self.dropped_ticks.on_event, runs=True)
        unsubscribe_state = (
            self.manager.events.subscribe(self._on_manager_event, runs=True)
            if self.state_writer is not None
            else None
        )
        log.info(
            "serve_starting",
            version=__version__,
            runtime_endpoint=self.config.endpoint.uri,
            endpoint_source=self.config.endpoint.source,
            config=str(self.config.config_file) if self.config.config_file else None,
            pleg=self.config.pleg,
            on_failure=self.config.on_failure,
            probes_from=[spec.text for spec in self.config.probes_from],
            pod_spec_probes=self.config.pod_spec_probes,
            # "uvloop" or "asyncio": the module of the loop's class.
            event_loop=type(loop).__module__.split(".")[0],
        )
        if self.config.probes_from and self.config.pod_spec_probes == "network-only":
            # Said once here; each probe left out is logged once as it is first seen.
            log.info(
                "pod_spec_exec_probes_left_to_kubelet",
                reason="serve --pod-spec-probes network-only: the pod specs' exec probes run once,"
                " by the kubelet; cri-prober runs their httpGet, tcpSocket and grpc probes",
            )
        warnings = self.config.warnings()
        for warning in warnings:
            log.warning("no_probe_source", reason=warning)
        # Probes need descriptors; services start with a soft limit of 1,024 (docs/reliability.md).
        fdlimit.raise_nofile_limit()
        if self.config.tune_malloc:
            malloc.tune()
        try:
            # Bound before anything runs, so a bad address fails the start (exit 2) and the
            # transition log sees every worker's first result.
            if self.config.metrics_address is not None:
                from cri_prober.serving.metrics_http import start_metrics

                self.metrics = await start_metrics(
                    self.config.metrics_address,
                    manager=self.manager,
                    node=self.discovery,
                    cri=self.cri,
                    pod_specs=self.pod_specs,
                    attempt_durations=self.config.metrics_attempt_durations,
                    mirror=self.mirror,
                )
            self.api = await start_api(
                self.config.listen,
                node=self.discovery,
                manager=self.manager,
                runtime=self.cri.liveness,
                pod_specs=self.pod_specs,
                runtime_endpoint=self.config.endpoint.uri,
                warnings=warnings,
            )
            await self._follow_node_kubelet()
            if self.pod_specs is not None:
                self.pod_specs.start(self._on_pod_specs)
            if (mirror := self.mirror) is not None:
                self.supervisor.start(MIRROR_TASK, lambda: mirror.follow(_no_pods))
            if (events := self.unhealthy_events) is not None:
                self.supervisor.start(EVENTS_TASK, events.run)
            self._start_tasks()
            await self.stop_event.wait()
            grace_ends = loop.time() + SHUTDOWN_GRACE_SECONDS
            # A parse in progress finishes in its thread (bounded by the file's size cap).
            await self.supervisor.stop(["reload"])
            self.notifier.stopping()
            log.info("serve_stopping", workers=self.manager.worker_count())
        except ConfigError:
            exit_code = EXIT_START_ERROR  # serve reports it and exits with this status
            raise
        except Exception:
            exit_code = EXIT_CRASHED
            raise
        finally:
            if grace_ends is None:  # stopped by an error rather than a signal
                grace_ends = loop.time() + SHUTDOWN_GRACE_SECONDS
            self.stop_event.set()  # the tasks that watch it end on their own
            unsubscribe()
            unsubscribe_dropped()
            if unsubscribe_state is not None:
                unsubscribe_state()
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(signum)
            # Discovery, the state writer (its last write) and the watchdog end on the stop
            # event within the grace; what is left is cancelled.
            await self.supervisor.stop(DAEMON_TASKS, grace=max(0.0, grace_ends - loop.time()))
            if self.mirror is not None:
                await self.supervisor.stop([MIRROR_TASK, EVENTS_TASK])
                await close_logged(MIRROR_TASK, self.mirror.close())
            if self.pod_specs is not None:
                await close_logged("pod-specs", self.pod_specs.stop())
            await close_logged("manager", self.manager.shutdown(SHUTDOWN_GRACE_SECONDS))
            await self.supervisor.stop()  # anything left, and nothing starts again
            if self.api is not None:
                await close_logged("api", self.api.stop())
            if self.metrics is not None:
                await close_logged("metrics", self.metrics.stop())
            await close_logged("cri", self.cri.close())
            if self.threads is not None:
                await close_logged("threads", self._release_threads(grace_ends))
            log.info(
                "serve_stopped",
                exit_code=self.supervisor.exit_code if exit_code is None else exit_code,
            )
        return self.supervisor.exit_code

    async def _follow_node_kubelet(self) -> None:
        """With --probes-from apiserver: follow the release of the node's kubelet, as its Node
        object says (read once, before any worker starts). The Node object is the truth when
        readable; a --kubelet-version that disagrees is warned of. Unreadable (RBAC: get on
        nodes), one warning, and the flag or the default stays."""
        source = self._apiserver_source()
        config = self.config
        if source is None:
            log.info("kubelet_semantics", kubelet=config.kubelet.describe(), source="flag")
            return
        # Imported here: only the apiserver source needs lightkube (options.build_sources).
        from cri_prober.podspecs.apiserver_client import ReadFailure

        try:
            version = await source.kubelet_version()
        except ReadFailure as exc:
            log.warning(
                "kubelet_version_unread",
                error=str(exc),
                kubelet=config.kubelet.describe(),
                hint="grant get on nodes (deploy/kubernetes) or set --kubelet-version",
            )
            return
        try:
            profile = KubeletProfile.parse(version, config.kubelet_gates_flag)
        except ConfigError as exc:
            log.warning(
                "kubelet_version_ignored",
                node_kubelet_version=version,
                error=str(exc),
                kubelet=config.kubelet.describe(),
            )
            return
        if config.kubelet_version_flag is not None and profile.minor != config.kubelet.minor:
            log.warning(
                "kubelet_version_disagrees",
                flag=config.kubelet_version_flag,
                node_kubelet_version=version,
                following=profile.describe(),
            )
        self.manager.set_kubelet(profile)
        log.info(
            "kubelet_semantics",
            kubelet=profile.describe(),
            source="node",
            node_kubelet_version=version,
        )

    def _apiserver_source(self) -> ApiServerSource | None:
        if self.pod_specs is None or not any(
            s.kind == "apiserver" for s in self.config.probes_from
        ):
            return None
        from cri_prober.podspecs.apiserver import ApiServerSource

        for source in self.pod_specs.sources:
            if isinstance(source, ApiServerSource):
                return source
        return None

    def _unhealthy_events(self) -> UnhealthyEvents | None:
        """serve --mirror with --probes-from apiserver: the watch of the kubelet's Unhealthy
        events, whose texts a mirrored failure shows as its output (the counters carry none)."""
        source = self._apiserver_source() if self.mirror is not None else None
        if source is None:
            return None
        from cri_prober.podspecs.unhealthy_events import UnhealthyEvents

        events = UnhealthyEvents(source)
        self.manager.mirror_texts = events.texts
        return events

    def _on_mirrored(self, update: TrackerUpdate) -> None:
        """serve --mirror: one read of the kubelet's counters, its attempts to the workers."""
        self.manager.on_mirrored(update.attempts)

    def _start_tasks(self) -> None:
        """Start the daemon's long-lived tasks under the supervisor (names: DAEMON_TASKS).

        All restart with back-off when they fail: each keeps serving something the node needs
        (discovery the view, the state writer started/ready across restarts, the watchdog the
        heartbeat, reload SIGHUP) and starts over cleanly. Discovery retries the runtime's errors
        itself, so an exception escaping it is a bug: restarting relists from scratch, and the
        health service reports the view stale meanwhile. None is fatal: stopping the whole
        node's probing for one of them would be worse than running it again.
        """
        config = self.config
        supervisor = self.supervisor
        supervisor.start(
            "discovery",
            lambda: self.discovery.run(
                config.pleg, relist_period=config.relist_period, stop=self.stop_event
            ),
        )
        # Ends once ready (or stopped): returning is its normal end.
        supervisor.start("ready", self._announce_ready, forever=False)
        # Returns at once when systemd expects no heartbeat.
        supervisor.start(
            "watchdog",
            lambda: systemd.watchdog_loop(self.notifier, self.stop_event),
            forever=False,
        )
        if (writer := self.state_writer) is not None:
            supervisor.start("state", lambda: writer.run(self.stop_event))
        supervisor.start("reload", self._reload_on_request)
        # Ends on its own only once PSI is found missing or unusable (logged once). Not one of
        # DAEMON_TASKS: probe workers use its samples until the manager stops, and the last
        # supervisor.stop() cancels it then.
        supervisor.start("pressure", self.pressure.run, forever=False)

    async def _release_threads(self, grace_ends: float) -> None:
        """Let running thread calls finish until the grace ends, then leave the rest behind.

        A call stuck in the kernel (open() of a FIFO nobody writes, a hung network filesystem)
        cannot be interrupted; its thread is a daemon thread, so it ends with the process.
        """
        assert self.threads is not None
        self.threads.shutdown(wait=False, cancel_futures=True)
        loop = asyncio.get_running_loop()
        stuck = await self.threads.wait_running(max(0.0, grace_ends - loop.time()))
        if stuck:
            log.warning(
                "serve_threads_abandoned",
                threads=len(stuck),
                work=stuck,
                reason="still running at the end of the shutdown grace; they end with the process",
            )

    async def _announce_ready(self) -> None:
        # Ready once the runtime has answered a first relist; discovery keeps retrying on its own,
        # so this only waits (on the stop event too, to stay interruptible).
        await wait_first(self.discovery.listed, self.stop_event)
        if self.stop_event.is_set():
            return
        # Asked again until it answers: a runtime too busy to answer once (a node under load,
        # thousands of containers being listed) must not leave serve never ready, never
        # READY=1 to systemd and its collector's start-up state never frozen (issue 36: seen
        # at 5,000 containers on a loaded machine).
        delay = READY_RETRY_INITIAL
        while True:
            try:
                version = await self.cri.version()
                break
            except CriError as exc:
                log.warning("runtime_version_failed", error=str(exc), retry_in=delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop_event.wait(), delay)
            if self.stop_event.is_set():
                return
            delay = min(2 * delay, READY_RETRY_MAX)
        log.info(
            "runtime_connected",
            runtime=version.runtime_name,
            runtime_version=version.runtime_version,
            mode=self.discovery.effective_mode,
            containers=len(self.discovery.containers()),
        )
        if self.config.freeze_gc:
            # The node's workers, discovery's view and the servers exist now and live long. A
            # full collection scans every tracked object, stopping the loop (~0.3 s at 5,000
            # containers, docs/benchmarks.md §3): frozen, these are left out of all of them.
            # Refcounting still frees them; only garbage cycles among them stay, bounded by
            # this one set.
            gc.freeze()
            gc.set_threshold(*GC_THRESHOLDS)
        self.ready.set()
        self.notifier.ready(status=f"probing on {version.runtime_name} {version.runtime_version}")
