"""One probe worker per (container, probe kind): the kubelet's prober worker, step by step.

``ProbeWorker.step`` is the kubelet's ``doProbe`` (docs/kubelet-semantics.md §3.3) with its
numbered steps marked in comments, so the two can be read side by side. ``ProbeWorker.run`` is
the kubelet's ``run``: an optional start-up jitter, an immediate first step, then one step per
tick of a ``period`` ticker or per manual trigger, until ``stop()`` or a step says not to keep
going.
Time and randomness come from an injected clock and RNG, so tests never sleep through periods.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

import structlog

from cri_prober.logs import REPEAT_LOG_SECONDS, Logged, is_repeat
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.kubelet_profile import KubeletProfile
from cri_prober.probing.outcome import ProbeError, ProbeOutcome, ProbeResult, Reason
from cri_prober.probing.pressure import Pressure
from cri_prober.probing.results import History, ProbeRecord, Published, ResultsStore, ResultUpdate
from cri_prober.probing.ticks import (
    LOOP_CLOCK,
    Cancellable,
    Clock,
    LoopClock,
    TickLoop,
    TickTimers,
    Wake,
)

log = structlog.get_logger(__name__)

# The kubelet re-runs a probe that *errored* (could not run) at most this many times back to back.
MAX_PROBE_ATTEMPTS = 3
# KEP-4781: containers that started this long before the prober did keep their state until the
# first real probe instead of being reset to the initial value.
RESTART_GRACE_SECONDS = 10.0
DEFAULT_HISTORY_SIZE = 32
# History entries keep a short excerpt of the output; the latest output is kept whole (10 KiB max).
HISTORY_OUTPUT_BYTES = 1024
# A worker logs the same probe error (an undeclared named port, say: every attempt errors) when it
# first appears or its text changes, then at most this often (the shared rate limit), with how
# many it did not log. The kubelet logs each one at V(1) (hidden by default); at warning, one a
# period flooded the log.
ERROR_REPEAT_LOG_SECONDS = REPEAT_LOG_SECONDS

# What a kind publishes when it first sees a container (§3.1).
INITIAL_VALUE = {
    ProbeKind.READINESS: Published.FAILURE,
    ProbeKind.LIVENESS: Published.SUCCESS,
    ProbeKind.STARTUP: Published.UNKNOWN,
}


def predates_prober(*, running: bool, started_at: float, prober_started_at: float) -> bool:
    """KEP-4781 (§3.12): running since more than ``RESTART_GRACE_SECONDS`` before the prober
    started, so it is adopted without publishing the initial value (whole seconds)."""
    return running and 0 < started_at < prober_started_at - RESTART_GRACE_SECONDS


class ProbeTiming(Protocol):
    """The numeric fields of a (defaulted) probe spec that drive a worker."""

    @property
    def initial_delay_seconds(self) -> int: ...
    @property
    def period_seconds(self) -> int: ...
    @property
    def success_threshold(self) -> int: ...
    @property
    def failure_threshold(self) -> int: ...


@dataclass(frozen=True, slots=True)
class ContainerView:
    """What a worker knows of its container at one moment (the kubelet's status cache entry)."""

    id: str
    running: bool
    started_at: float  # wall-clock seconds since the epoch; 0 when never started
    started: bool  # startup probe passed, or none configured
    terminated: bool = False  # exited (as opposed to created and not yet running)
    will_restart: bool = True  # False once an exited container will not be replaced
    deleting: bool = False  # its pod is being torn down
    pod_finished: bool = False  # the pod is over (the kubelet's phase Succeeded/Failed)


@dataclass(frozen=True, slots=True)
class WorkerState:
    """One frozen look at a worker's counters and hold (``ProbeWorker.snapshot``): what its
    owners read of it, instead of its attributes one by one while it may change them."""

    container_id: str | None  # the container its steps last saw (None before the first)
    last_result: Published  # the result its run counts (Go's zero value, Success, at first)
    result_run: int  # attempts in a row with ``last_result`` (0 once a hold zeroed it)
    on_hold: bool  # waiting for a new container (a published liveness failure, a startup result)
    held_after: int  # the run of failures whose published failure it holds on (0: none)
    probes_run: int  # attempts recorded, errored ones included
    failed_container: str | None  # the container its own attempts published Failure for
    preserved_for: str | None  # the container adopted with its state kept (KEP-4781)
    probing_since: float | None  # wall-clock start of the attempt in progress (None: none)
    hold_failures: bool  # a published liveness or startup failure holds it
    stopped: bool  # stop() was called
    # With ``snapshot(records=True)`` only: the history, oldest first, and the newest attempt
    # with its output whole.
    history: tuple[ProbeRecord, ...] = ()
    last_record: ProbeRecord | None = None

    def preserves(self, container_id: str) -> bool:
        """True while ``container_id`` keeps its pre-restart state (KEP-4781, §3.12)."""
        return self.preserved_for is not None and self.preserved_for == container_id

    def holds(self, container_id: str) -> bool:
        """On hold for ``container_id`` (not for a container it saw before)."""
        return self.on_hold and self.container_id == container_id


class WorkerObserver(Protocol):
    """The one channel through which a worker reports what its steps did, as they do it.

    Calls are synchronous, from the worker's task: they must be quick (queue work, don't do it).
    """

    def attempt_finished(self, worker: ProbeWorker, record: ProbeRecord) -> None:
        """An attempt ran (or could not run: ``record.result == "error"``)."""
        ...

    def result_changed(self, worker: ProbeWorker, update: ResultUpdate) -> None:
        """The published result changed; ``update.record`` is the attempt that changed it."""
        ...

    def worker_stopped(self, worker: ProbeWorker) -> None:
        """The worker ended (stopped, or its container is gone for good)."""
        ...


class RepeatObserver(Protocol):
    """An owner that takes a steady probe's repeated attempts in runs: an attempt like the one
    before (the same container, outcome and threshold; nothing changed, held or dropped) is
    counted and kept in the history's columns, and told later with the others of its run, in
    one ``attempts_repeated``, instead of one ``attempt_finished`` each."""

    @property
    def takes_runs(self) -> bool:
        """Whether repeats may be held back now (False while someone needs every attempt)."""
        ...

    def attempts_repeated(self, worker: ProbeWorker, count: int) -> None:
        """The history's newest ``count`` attempts were repeats nobody was told of yet; they
        are told before anything else the worker reports, and at least once per history."""
        ...


# Re-exported: the tick machinery lived here before ``ticks.py``.
__all__ = [
    "DEFAULT_HISTORY_SIZE",
    "HISTORY_OUTPUT_BYTES",
    "INITIAL_VALUE",
    "LOOP_CLOCK",
    "MAX_PROBE_ATTEMPTS",
    "RESTART_GRACE_SECONDS",
    "Cancellable",
    "Clock",
    "ContainerView",
    "LoopClock",
    "ProbeWorker",
    "TickTimers",
    "Wake",
    "WorkerObserver",
    "WorkerState",
    "predates_prober",
]

StatusSource = Callable[[], ContainerView | None]
ProbeRunner = Callable[[ContainerView], Awaitable[ProbeOutcome]]


# The jitter's draws (the event loop's thread only).
_SHARED_RNG = random.Random()


class ProbeWorker(TickLoop):
    """Probes one container for one kind, publishing results with the kubelet's semantics.

    Its ticks (waits, triggers, dropped ticks, lateness) are ``TickLoop``'s (``ticks.py``).
    """

    # A node has one worker per probe (10,000 at 5,000 containers): slots instead of a dict
    # of some 30 attributes save about 1 KiB each.
    __slots__ = (
        "_error_logged",
        "_errors_unlogged",
        "_handed_over",
        "_held_at_start",
        "_log_bound",
        "_log_context",
        "_observer",
        "_pressure",
        "_prober_started_at",
        "_repeats",
        "_results",
        "_rng",
        "_run_probe",
        "_runs",
        "_status",
        "_steady",
        "_whole_output",
        "container_id",
        "exit_result",
        "failed_container",
        "held_after",
        "history",
        "hold_failures",
        "keeps_state",
        "kind",
        "kubelet",
        "last_result",
        "name",
        "on_hold",
        "preserved_for",
        "probes_run",
        "probing_since",
        "result_run",
        "run_spent",
        "timing",
    )
    # Who decides what it publishes without an attempt record (the initial value, a container
    # that is not running): "" cri-prober; a mirror worker the kubelet (serve --mirror).
    publishes_as: ClassVar[str] = ""

    def __init__(
        self,
        kind: ProbeKind,
        timing: ProbeTiming,
        *,
        status: StatusSource,
        run_probe: ProbeRunner,
        results: ResultsStore,
        prober_started_at: float,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        observer: WorkerObserver | None = None,
        history_size: int = DEFAULT_HISTORY_SIZE,
        name: str = "",
        grid_anchor: float | None = None,
        held_at_start: bool = False,
        log_context: Mapping[str, str] | None = None,
        hold_failures: bool = True,
        pressure: Callable[[], Pressure | None] | None = None,
        kubelet: KubeletProfile | None = None,
        keeps_state: Callable[[str], bool] | None = None,
        runs: RepeatObserver | None = None,
    ) -> None:
        self.kind = kind
        # The kubelet release whose worker this one follows where releases differ (the ticker
        # after a trigger, the startup hold, KEP-4781): docs/kubelet-fidelity.md, "Kubelet
        # releases". The manager replaces it when it learns the node's kubelet version.
        self.kubelet = kubelet or KubeletProfile()
        # Whether a container that predates the prober keeps its previous state (KEP-4781):
        # the manager's answer weighs the release and the state file (PR #141487, 1.37).
        # None: the release's rule alone.
        self.keeps_state = keeps_state
        self.timing = timing
        self.name = name or kind.value
        self._status = status
        self._run_probe = run_probe
        self._results = results
        TickLoop.__init__(self, clock or LOOP_CLOCK, grid_anchor)
        # One generator for every worker: each Random holds 2.5 KiB of state.
        self._rng = rng or _SHARED_RNG
        self._observer = observer
        # Who takes repeated attempts in runs (None: every attempt is told as it finishes), the
        # repeats not told yet, and what the newest attempt was, to tell a repeat: (container
        # ID, outcome, threshold, pressure) of a counted attempt kept whole, else None.
        self._runs = runs
        self._repeats = 0
        self._steady: tuple[str, ProbeOutcome, int, Pressure | None] | None = None
        # Wall-clock time the prober (our "kubelet") started: drives jitter and KEP-4781.
        self._prober_started_at = prober_started_at
        # The pod was there when the prober started: the kubelet, which holds its pods when it
        # starts, draws such a worker's first step and phase from the whole period. Discovery
        # can take longer than a period on a big node; such a worker still draws them (from
        # when it is found), or the node's workers would tick in the bursts discovery found
        # them in.
        self._held_at_start = held_at_start
        # Bound to the lines logged in this worker's task, with the container ID it probes,
        # once the worker logs a line of its own (``_bind_log_context``, ``_log_bound``): lines
        # say which container and probe without passing them. Bound lazily: a binding is two
        # blocks per worker of the task's context (1.45 MiB at 5,000 containers, issue 36), and
        # a steady probe logs nothing.
        self._log_context = {"probe": kind.value, **(log_context or {})}
        self._log_bound = False

        # The kubelet's hold after a published liveness or startup failure: it waits for the
        # new container its kill brings. False where nothing acts on the failure (report mode
        # with rules or annotations): the worker keeps probing and publishes the recovery.
        self.hold_failures = hold_failures
        # The node's pressure, read when an attempt fails (None: not recorded).
        self._pressure = pressure
        # Kubelet worker state (§3.1). lastResult starts at Go's zero value, which is Success.
        self.container_id: str | None = None
        self.last_result = Published.SUCCESS
        self.result_run = 0
        self.on_hold = False
        # The run of failures that published the failure it holds on (the kubelet zeroes
        # resultRun on hold; this keeps what the surfaces show as consecutive failures).
        self.held_after = 0
        # A published liveness failure or startup result put the kubelet's worker on hold for
        # this container, which zeroes its resultRun there: the next container's run starts at 0
        # even where this worker keeps probing (``hold_failures`` False) and counts on.
        self.run_spent = False
        # The container adopted without publishing the initial value because it predates the
        # prober (KEP-4781): its state is kept, not reset, until the first real probe. Keyed by
        # container ID so the flag never leaks to a replacement the worker has not seen yet.
        self.preserved_for: str | None = None

        self.history = History(history_size)
        # The newest attempt's output when the history kept only an excerpt of it (else None:
        # the newest attempt is the history's, not a record of its own per worker).
        self._whole_output: str | None = None
        self.probes_run = 0
        # The container for which this worker's own attempts published Failure (not step 7's
        # "not running"): what a probe-triggered stop acts on (§5.2).
        self.failed_container: str | None = None
        # What this worker had published for its container when it ended (its cleanup removes
        # it from the store): a successor for the same container takes it over (``take_over``).
        self.exit_result: Published | None = None
        # Wall-clock start of the attempt in progress (None between attempts), for the API.
        self.probing_since: float | None = None
        # The last probe error logged (its text, and when: monotonic), and how many identical
        # ones went unlogged since (ERROR_REPEAT_LOG_SECONDS).
        self._error_logged: Logged | None = None
        self._errors_unlogged = 0

        self._handed_over = False  # see stop(handover=True)

    # -- control (non-blocking, idempotent, like the kubelet's 1-slot channels) -----------------

    def stop(self, *, handover: bool = False) -> None:
        """Ask the worker to exit after its current step; safe to call any number of times.

        ``handover``: a worker for a changed spec of the same probe takes over. This one then
        publishes nothing more (not even from the step in progress) and leaves the published
        result in place on exit, for its successor to replace with a visible transition.
        """
        self._handed_over = self._handed_over or handover
        self._request_stop()

    def preserves(self, container_id: str) -> bool:
        """True while ``container_id`` keeps its pre-restart state (KEP-4781, §3.12)."""
        return self.preserved_for is not None and self.preserved_for == container_id

    def snapshot(self, *, records: bool = False) -> WorkerState:
        """The worker's state now, frozen; with ``records`` its history and newest record too
        (a read that builds a record per attempt kept: only the API's listings need it)."""
        return WorkerState(
            self.container_id,
            self.last_result,
            self.result_run,
            self.on_hold,
            self.held_after,
            self.probes_run,
            self.failed_container,
            self.preserved_for,
            self.probing_since,
            self.hold_failures,
            self._stop_requested,
            tuple(self.history) if records else (),
            self.last_record if records else None,
        )

    def inherit(self, previous: ProbeWorker) -> None:
        """Take over the counters and history of the worker this one replaces.

        The kubelet keeps one worker per (pod, container, kind) for the pod's whole life; when
        cri-prober has to end a worker and start another for the same slot, the new one carries
        on where the old left off: counters, history and the §3.4 run-length quirk.
        """
        self.history.extend(previous.history)
        self._whole_output = previous._whole_output
        self.probes_run = previous.probes_run
        self.last_result = previous.last_result
        self.result_run = previous.result_run
        self.run_spent = previous.run_spent

    def take_over(self, previous: ProbeWorker) -> None:
        """Carry on for ``previous``'s container, which it was stopped on while the container
        lived on (its pod left the pod specs' view for a while): its counters and history, its
        container, its hold and its published result, which stays as it was (no transition).

        The kubelet's one worker for the pod would have kept all of it: only a new container
        ID starts over (§3.3 step 5). Call it before ``run``.
        """
        self.inherit(previous)
        self.container_id = previous.container_id
        self.on_hold = previous.on_hold
        self.held_after = previous.held_after
        self.preserved_for = previous.preserved_for
        self.failed_container = previous.failed_container
        if self.container_id is None:
            return
        # Still running, it must leave the result to this worker; already ended, it removed the
        # result on its way out: put back what it had published, silently as it went.
        previous.stop(handover=True)
        if (
            previous.exit_result is not None
            and self._results.get(self.container_id, self.kind) is None
        ):
            self._results.set(self.container_id, self.kind, previous.exit_result)

    def resume_hold(self, container_id: str) -> None:
        """Hold on ``container_id``'s liveness failure, which a previous cri-prober published
        and held (its state file says so): publish it again, silently, and probe nothing until
        a new container ID, as the kubelet's worker, which did not restart, still holds. Call it
        before ``run``."""
        self.container_id = container_id
        self.on_hold = True
        self.run_spent = True
        self.last_result = Published.FAILURE
        self.held_after = self.timing.failure_threshold
        self.failed_container = container_id
        self._results.set(container_id, self.kind, Published.FAILURE)

    # -- the loop (§3.2) ------------------------------------------------------------------------

    async def run(self) -> None:
        """Probe until stopped or until a step says to stop; then clean up.

        Run it in a task of its own (with a fresh context): the log context it binds (once it
        logs, ``_bind_log_context``) is the task's.
        """
        period = float(self.timing.period_seconds)
        try:
            # (2) Jitter only when the prober itself started less than one period ago, so a
            # restart does not fire every probe on the node in the same instant.
            since_start = self._clock.wall() - self._prober_started_at
            ticker_phase: float | None = None
            if period > since_start or self._held_at_start:
                # The kubelet draws from the whole period: its workers start with it, from
                # pods it already holds. Ours start once discovery has seen the container
                # (seconds on a big node), so the draw is from what is left of the prober's
                # first period: every container there at start is probed within one period.
                # When discovery took longer than that, a pod that was there at start draws
                # from a whole period from when it is found, as the kubelet's would from its
                # start: at once, thousands of first steps made a burst that took every file
                # descriptor the process had (10,000 containers, docs/benchmarks.md §0).
                elapsed = max(0.0, since_start) if period > since_start else 0.0
                now = self._clock.monotonic()
                jitter_end = now + self._rng.uniform(0, period - elapsed)
                # The ticker then keeps a phase drawn from the whole period, as the kubelet's
                # do: phases taken from what was left would crowd the node's probes into the
                # end of every period. So the second step comes at most a period after the first.
                ticker_phase = now - elapsed + self._rng.uniform(0, period)
                deferred_trigger = False
                while True:
                    wake = self._woken(await self._wait(jitter_end))
                    if wake is Wake.STOP:
                        return
                    if wake is Wake.TICK or self._urgent:
                        break
                    # The kubelet sleeps through its jitter; its manual trigger stays buffered
                    # and runs right after the first step. Keep this one pending the same way.
                    deferred_trigger = True
                self._urgent = False
                self._trigger_pending = self._trigger_pending or deferred_trigger
                anchor_tick = None
            else:
                anchor_tick = self._first_anchored_tick(period)
            if anchor_tick is not None:
                # The kubelet's worker started at pod admission and already made its immediate
                # step then (finding no container); ours joins its ticker at the next tick.
                next_tick = anchor_tick
                keep_going = True
            else:
                # (3) The ticker starts now; (4) the first step runs at once.
                now = self._clock.monotonic()
                next_tick = now + period
                if ticker_phase is not None:
                    next_tick = ticker_phase + (((now - ticker_phase) // period) + 1) * period
                keep_going = await self._guarded_step()
            # The kubelet's buffered start-up trigger (the pod syncs that find a new readiness
            # worker not yet Success) runs right after its first step and resets its ticker
            # there: to its drawn phase. Ours stands for that, so such a trigger (pending when
            # the first step ends) runs at once and leaves the drawn phase as it is; resetting
            # it put every readiness worker back on the instants discovery reached it.
            keep_phase = ticker_phase is not None and self._trigger_pending
            while keep_going and not self._stop_requested:
                wake = self._woken(await self._wait(next_tick))
                if wake is Wake.STOP:
                    break
                now = self._clock.monotonic()
                if wake is Wake.TRIGGER and keep_phase:
                    keep_phase = False
                    self._urgent = False
                elif wake is Wake.TRIGGER:
                    # (5) A manual run resets the ticker: the next tick is a full period later
                    # (PR #119089, kubelet 1.32). Before, the ticks kept their phase: a
                    # readiness worker triggered at its container's start stayed on the grid
                    # of the pod's admission.
                    self._urgent = False
                    if self.kubelet.trigger_resets_ticker:
                        next_tick = now + period
                else:
                    next_tick = self._take_tick(now, next_tick, period)
                keep_going = await self._guarded_step()
                self._tick_served()
        finally:
            self._cleanup()

    async def _guarded_step(self) -> bool:
        # The kubelet recovers panics in doProbe and keeps going; so do we with exceptions.
        try:
            return await self.step()
        except asyncio.CancelledError:
            raise
        except Exception:
            self._bind_log_context()
            log.exception("probe_step_crashed", worker=self.name)
            return True

    def _bind_log_context(self) -> None:
        """Bind the worker's log context (its probe, container and container ID) to its task
        before its first line; the container ID follows changes from then on (``step``)."""
        if self._log_bound:
            return
        self._log_bound = True
        context = self._log_context
        if self.container_id is not None:
            context["container_id"] = self.container_id[:13]
        structlog.contextvars.bind_contextvars(**context)

    def _cleanup(self) -> None:
        # (6) Forget the published result (silently) and tell the owner the worker is gone;
        # a worker that handed over leaves it to its successor.
        if self.container_id is not None and not self._handed_over:
            self.exit_result = self._results.get(self.container_id, self.kind)
            self._results.remove(self.container_id, self.kind)
        self.tell_repeats()
        if self._observer is not None:
            self._observer.worker_stopped(self)

    # -- one step (§3.3) ------------------------------------------------------------------------

    async def step(self) -> bool:
        """Run one probe cycle; return False when the worker should exit."""
        # (1) Start time, for the duration metric.
        started_mono = self._clock.monotonic()
        started_wall = self._clock.wall()

        # (2) No status yet (or any more): try again next tick.
        view = self._status()
        if view is None:
            return True
        # (3) The pod is over: end without publishing anything.
        if view.pod_finished:
            return False
        # (4) No container yet.
        if not view.id:
            return True

        # (5) A new container ID: forget the old result, adopt the new ID, publish the initial
        # value, leave hold. lastResult and resultRun deliberately survive (§3.4 quirk), except
        # a run the kubelet's hold zeroed (``run_spent``): its worker never carries that over.
        if view.id != self.container_id:
            if self.run_spent:
                self.result_run = 0
                self.run_spent = False
            if self.container_id is not None:
                self._results.remove(self.container_id, self.kind)
            self.container_id = view.id
            if self._log_bound:  # follow the change
                structlog.contextvars.bind_contextvars(container_id=view.id[:13])
            adopted = predates_prober(
                running=view.running,
                started_at=view.started_at,
                prober_started_at=self._prober_started_at,
            ) and self._keeps_state(view.id)
            self.preserved_for = view.id if adopted else None
            if not adopted:
                self._publish(view.id, INITIAL_VALUE[self.kind], reason=Reason.INITIAL)
            self.on_hold = False
            self.held_after = 0

        # (6) On hold after a liveness failure or a startup result: wait for a new container.
        if self.on_hold:
            return True

        # (7) Not running: publish failure; keep going unless it exited for good.
        if not view.running:
            self.preserved_for = None
            self._publish(view.id, Published.FAILURE, reason=Reason.NOT_RUNNING)
            return not (view.terminated and not view.will_restart)

        # (8) Pod being deleted: liveness and startup report success and stop, for a quiet end.
        if view.deleting and self.kind in (ProbeKind.LIVENESS, ProbeKind.STARTUP):
            self._publish(view.id, Published.SUCCESS, reason=Reason.POD_DELETING)
            return False

        # (9) Initial delay, in whole seconds since the container started.
        if int(started_wall - view.started_at) < self.timing.initial_delay_seconds:
            return True

        # (10) Startup gating: before startup passes only the startup worker probes; after it,
        # the startup worker idles (kept for a restarted container).
        if view.started:
            if self.kind is ProbeKind.STARTUP:
                return True
        elif self.kind is not ProbeKind.STARTUP:
            return True

        # (11) Probe; an attempt that could not run is retried, then discarded without counting.
        self.probing_since = started_wall
        try:
            outcome, error = await self._probe_with_retries(view)
        finally:
            self.probing_since = None
        duration = self._clock.monotonic() - started_mono
        if outcome is None:
            reason = error.reason if error is not None else Reason.NOT_RUN
            pressure = self._pressure() if self._pressure is not None else None
            errored = ProbeRecord.errored(
                view.id, started_wall, duration, str(error), reason=reason, pressure=pressure
            )
            late, dropped = self._lateness(started_mono)
            self._record(
                errored.counted(0, 0, changed=False, held=False, late=late, dropped=dropped)
            )
            return True
        # (12) Metrics: the observer hears of the record below.

        # (13) Count consecutive identical results.
        result = (
            Published.SUCCESS
            if outcome.result in (ProbeResult.SUCCESS, ProbeResult.WARNING)
            else Published.FAILURE
        )
        if result is self.last_result:
            self.result_run += 1
        else:
            self.last_result = result
            self.result_run = 1
        failed = result is Published.FAILURE
        threshold = self.timing.failure_threshold if failed else self.timing.success_threshold
        publishes = self.result_run >= threshold
        # Before kubelet 1.32 (PR #121206) only a failure held the startup worker: after a
        # success it kept its run and idled at step (10) once the status said started.
        holds_startup_success = self.kubelet.startup_holds_on_success
        holds = publishes and (
            (self.kind is ProbeKind.LIVENESS and failed and self.hold_failures)
            or (
                self.kind is ProbeKind.STARTUP
                and ((not failed and holds_startup_success) or (failed and self.hold_failures))
            )
        )
        changed = (
            publishes
            and not self._handed_over
            and self._results.get(view.id, self.kind) is not result
        )
        pressure = self._pressure() if failed and self._pressure is not None else None
        late, dropped = self._lateness(started_mono)
        held = holds and failed
        runs = self._runs
        steady = self._steady
        if (
            steady is not None
            and not (changed or held or dropped)
            and runs is not None
            and runs.takes_runs
            and steady == (view.id, outcome, threshold, pressure)
        ):
            # The steady path: the same attempt again. Counters and the history's columns
            # only; no record, and no report until its run is told (``tell_repeats``).
            self.probes_run += 1
            self.history.repeat(started_wall, duration, late, self.result_run)
            self._repeats += 1
            if self._repeats >= self.history.maxlen:
                self.tell_repeats()  # the history holds every untold repeat's duration
            record = None
        else:
            record = self._record(
                ProbeRecord.of(
                    view.id,
                    started_wall,
                    duration,
                    outcome,
                    pressure=pressure,
                    run=self.result_run,
                    threshold=threshold,
                    changed=changed,
                    held=held,
                    late=late,
                    dropped=dropped,
                )
            )
            if runs is not None:
                self._steady = (view.id, outcome, threshold, pressure)

        # (14) Below the threshold: nothing is published.
        if not publishes:
            return True

        # (15) Publish (the observer hears only about changes). ``changed`` has read the store
        # (no await since, and only workers write it): an unchanged result needs no second look.
        self.preserved_for = None
        self.failed_container = view.id if failed else None
        if changed:
            self._publish(view.id, result, record)

        # (16) Hold after a published liveness failure or any startup result (where something
        # acts on failures: ``hold_failures``). The kubelet's worker holds on each of them,
        # zeroing its run: where this one does not, its next container starts at 0 all the same.
        if (self.kind is ProbeKind.STARTUP and (failed or holds_startup_success)) or (
            self.kind is ProbeKind.LIVENESS and failed
        ):
            self.run_spent = True
        if holds:
            self.on_hold = True
            self.held_after = self.result_run if failed else 0
            self.result_run = 0

        # (17)
        return True

    def _keeps_state(self, container_id: str) -> bool:
        """Whether ``container_id``, which predates the prober, keeps its previous state."""
        if self.keeps_state is not None:
            return self.keeps_state(container_id)
        return self.kubelet.keeps_status_on_restart

    async def _probe_with_retries(
        self, view: ContainerView
    ) -> tuple[ProbeOutcome | None, ProbeError | None]:
        error: ProbeError | None = None
        for _ in range(MAX_PROBE_ATTEMPTS):
            try:
                return await self._run_probe(view), None
            except ProbeError as exc:
                error = exc
        self._bind_log_context()
        if error is not None and error.reason == Reason.UNSUPPORTED:
            # Every attempt errors the same way for the spec's life: the manager logs it once
            # per pod (``probe_unsupported``), not once per worker and period.
            log.debug("probe_errored", worker=self.name, error=str(error), reason=error.reason)
        elif error is not None and error.reason == Reason.NOT_RUNNING:
            # The exec raced its container's stop or removal: expected under churn (one per
            # container stopped mid-exec), and what step 7 publishes next says it all. The
            # kubelet logs every errored probe at V(1) only (prober.go, 1.28).
            log.debug("probe_errored", worker=self.name, error=str(error), reason=error.reason)
        else:
            self._log_error(str(error))
        return None, error

    def _log_error(self, text: str) -> None:
        """``probe_errored``, rate-limited: a new text at once, the same one once per
        ERROR_REPEAT_LOG_SECONDS with ``repeated``, the count of those not logged meanwhile."""
        now = self._clock.monotonic()
        last = self._error_logged
        if is_repeat(last, text, now):
            self._errors_unlogged += 1
            return
        repeated, self._errors_unlogged = self._errors_unlogged, 0
        self._error_logged = (text, now)
        self._bind_log_context()
        if repeated and last is not None and last[0] == text:
            log.warning("probe_errored", worker=self.name, error=text, repeated=repeated)
        else:
            log.warning("probe_errored", worker=self.name, error=text)

    def _publish(
        self,
        container_id: str,
        result: Published,
        record: ProbeRecord | None = None,
        *,
        reason: str = "",
    ) -> None:
        """Store ``result`` and, if it changed, report it with the attempt that caused it (or,
        without one, the ``reason`` it was published)."""
        if self._handed_over:
            return  # the step in progress ended after a successor took over: not ours to say
        self.tell_repeats()
        previous = self._results.set(container_id, self.kind, result)
        if previous is not result and self._observer is not None:
            consecutive = self.result_run if record is not None else 0
            update = ResultUpdate(
                container_id,
                self.kind,
                previous,
                result,
                consecutive,
                record,
                reason=record.reason if record is not None else reason,
                source=record.source if record is not None else self.publishes_as,
            )
            self._observer.result_changed(self, update)

    @property
    def last_record(self) -> ProbeRecord | None:
        """The newest attempt, its output whole (None before the first)."""
        if not self.history:
            return None
        newest = self.history[-1]
        if self._whole_output is None:
            return newest
        return dataclasses.replace(newest, output=self._whole_output)

    def tell_repeats(self) -> None:
        """Tell the owner of the repeats it was not told of yet (``RepeatObserver``); its
        readers of counts call it before they read."""
        count = self._repeats
        if count and self._runs is not None:
            self._repeats = 0
            self._runs.attempts_repeated(self, count)

    def _record(self, record: ProbeRecord) -> ProbeRecord:
        """Count and keep one attempt (the history keeps an excerpt of its output, and the
        newest output whole)."""
        self.tell_repeats()
        self._steady = None
        self.probes_run += 1
        kept, self._whole_output = record, None
        if len(record.output) > HISTORY_OUTPUT_BYTES:
            kept = dataclasses.replace(record, output=record.output[:HISTORY_OUTPUT_BYTES])
            self._whole_output = record.output
        self.history.append(kept)
        if self._observer is not None:
            self._observer.attempt_finished(self, record)
        return record
