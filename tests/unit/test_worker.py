"""The probe worker against docs/kubelet-semantics.md §3.2-§3.4, table-driven, without real sleeps.

``step()`` is driven directly (like the kubelet's worker_test.go); ``run()`` is driven with a fake
clock whose waits return at once with the time advanced, so tick alignment, jitter, triggers and
stop can be checked exactly.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import math
import random
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import pytest
import structlog
import uvloop
from structlog.testing import capture_logs

from cri_prober.probing.outcome import ProbeError, ProbeOutcome, ProbeResult
from cri_prober.probing.pressure import Pressure
from cri_prober.probing.results import History, ProbeRecord, Published, ResultsStore, ResultUpdate
from cri_prober.probing.spec import ProbeKind
from cri_prober.probing.worker import ContainerView, LoopClock, ProbeWorker, TickTimers, Wake
from tests.support.clock import WALL0, WorkerClock
from tests.support.waiting import HANG_GUARD
from tests.support.worker_reports import WorkerReports

log = structlog.get_logger(__name__)

OK = ProbeOutcome(ProbeResult.SUCCESS, "ok")
BAD = ProbeOutcome(ProbeResult.FAILURE, "bad")


@dataclass(frozen=True)
class Timing:
    initial_delay_seconds: int = 0
    period_seconds: int = 10
    success_threshold: int = 1
    failure_threshold: int = 3


class Harness:
    """A worker wired to a fake container view, scripted probe outcomes and a results store."""

    def __init__(
        self,
        kind: ProbeKind,
        timing: Timing | None = None,
        *,
        prober_started_at: float = WALL0 - 3600,
        rng: random.Random | None = None,
        grid_anchor: float | None = None,
        held_at_start: bool = False,
    ) -> None:
        self.clock = WorkerClock()
        # What the worker's probes do: the script below, unless a test puts another runner here.
        self.runner: Callable[[ContainerView], Awaitable[ProbeOutcome]] = self._run_probe
        self.view: ContainerView | None = ContainerView(
            id="c1", running=True, started_at=WALL0 - 100, started=kind is not ProbeKind.STARTUP
        )
        if kind is ProbeKind.STARTUP:
            self.view = replace(self.view, started=False)
        self.script: deque[ProbeOutcome | ProbeError] = deque()
        self.probe_calls = 0
        self.probe_times: list[float] = []
        self.results = ResultsStore()
        self.reports = WorkerReports()
        self.updates: list[ResultUpdate] = self.reports.updates
        self.worker = ProbeWorker(
            kind,
            timing or Timing(),
            status=lambda: self.view,
            run_probe=lambda view: self.runner(view),
            results=self.results,
            prober_started_at=prober_started_at,
            clock=self.clock,
            rng=rng or random.Random(7),
            observer=self.reports,
            grid_anchor=grid_anchor,
            held_at_start=held_at_start,
        )

    async def _run_probe(self, _view: ContainerView) -> ProbeOutcome:
        self.probe_calls += 1
        self.probe_times.append(self.clock.now)
        item = self.script.popleft() if self.script else OK
        if isinstance(item, ProbeError):
            raise item
        return item

    @property
    def published(self) -> Published | None:
        assert self.view is not None
        return self.results.get(self.view.id, self.worker.kind)

    async def steps(self, *outcomes: ProbeOutcome | ProbeError) -> list[Published | None]:
        """Run one step per outcome and collect what is published after each."""
        seen = []
        for outcome in outcomes:
            self.script.append(outcome)
            assert await self.worker.step()
            seen.append(self.published)
        return seen


# -- §3.1 initial values, §3.3 step 5 ------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "initial"),
    [
        (ProbeKind.READINESS, Published.FAILURE),
        (ProbeKind.LIVENESS, Published.SUCCESS),
        (ProbeKind.STARTUP, Published.UNKNOWN),
    ],
)
async def test_new_container_publishes_initial_value(kind: ProbeKind, initial: Published) -> None:
    """A new container ID publishes the kind's initial value before any probe counts."""
    h = Harness(kind, Timing(initial_delay_seconds=1000))
    assert await h.worker.step()
    assert h.published is initial
    assert h.probe_calls == 0
    assert [u.result for u in h.updates] == [initial]


async def test_no_container_yet_keeps_going_silently() -> None:
    """(2)-(4) No status for the container: keep going, publish nothing."""
    h = Harness(ProbeKind.READINESS)
    h.view = None
    assert await h.worker.step()
    assert h.updates == []
    assert h.probe_calls == 0


async def test_container_id_change_resets_publication_but_not_counters() -> None:
    """(5) New ID: old result removed, initial value published, hold cleared, run kept (quirk)."""
    h = Harness(ProbeKind.READINESS, Timing(success_threshold=3, failure_threshold=1))
    assert await h.steps(OK, OK, OK) == [Published.FAILURE, Published.FAILURE, Published.SUCCESS]
    assert h.worker.result_run == 3
    assert h.view is not None
    h.view = replace(h.view, id="c2")
    # §3.4 quirk: the success run survives the restart, so one success makes the new one ready.
    assert await h.steps(OK) == [Published.SUCCESS]
    assert h.results.get("c1", ProbeKind.READINESS) is None
    assert [u.result for u in h.updates if u.container_id == "c2"] == [
        Published.FAILURE,
        Published.SUCCESS,
    ]


async def test_prober_restart_keeps_running_containers_state() -> None:
    """KEP-4781: a container started >10 s before the prober is not reset to not-ready."""
    h = Harness(ProbeKind.READINESS, Timing(initial_delay_seconds=1000), prober_started_at=WALL0)
    assert await h.worker.step()
    assert h.published is None
    assert h.worker.preserves("c1")
    assert h.updates == []


async def test_prober_restart_grace_is_ten_seconds() -> None:
    """A container started within 10 s of the prober's start still gets the initial value."""
    h = Harness(ProbeKind.READINESS, Timing(initial_delay_seconds=1000), prober_started_at=WALL0)
    assert h.view is not None
    h.view = replace(h.view, started_at=WALL0 - 9)
    assert await h.worker.step()
    assert h.published is Published.FAILURE
    assert not h.worker.preserves("c1")


# -- steps 6-10 ----------------------------------------------------------------------------------


async def test_on_hold_skips_probing_until_new_container() -> None:
    """(6)/(16) A published liveness failure puts the worker on hold until the ID changes."""
    h = Harness(ProbeKind.LIVENESS, Timing(failure_threshold=1))
    assert await h.steps(BAD) == [Published.FAILURE]
    assert h.worker.on_hold
    assert h.worker.result_run == 0
    assert await h.steps(BAD) == [Published.FAILURE]
    assert h.probe_calls == 1
    h.script.clear()  # the outcome offered while on hold was never used
    assert h.view is not None
    h.view = replace(h.view, id="c2")
    assert await h.steps(OK) == [Published.SUCCESS]
    assert h.probe_calls == 2
    assert not h.worker.on_hold


@pytest.mark.parametrize("kind", list(ProbeKind))
async def test_waiting_container_publishes_failure(kind: ProbeKind) -> None:
    """(7) A container that is not running publishes Failure for every kind and keeps going."""
    h = Harness(kind)
    assert h.view is not None
    h.view = replace(h.view, running=False, started=False)
    assert await h.worker.step()
    assert h.published is Published.FAILURE
    assert h.probe_calls == 0


async def test_terminated_container_that_restarts_keeps_worker() -> None:
    """(7) Exited but will be replaced: Failure, keep going."""
    h = Harness(ProbeKind.READINESS)
    assert h.view is not None
    h.view = replace(h.view, running=False, terminated=True, will_restart=True)
    assert await h.worker.step()
    assert h.published is Published.FAILURE


async def test_terminated_container_never_restarted_ends_worker() -> None:
    """(7) Exited for good: Failure published, and the worker exits."""
    h = Harness(ProbeKind.LIVENESS)
    assert h.view is not None
    h.view = replace(h.view, running=False, terminated=True, will_restart=False)
    assert not await h.worker.step()
    assert h.published is Published.FAILURE


@pytest.mark.parametrize("kind", [ProbeKind.LIVENESS, ProbeKind.STARTUP])
async def test_deleting_pod_quiets_liveness_and_startup(kind: ProbeKind) -> None:
    """(8) Pod deletion: liveness/startup publish Success and exit without probing."""
    h = Harness(kind)
    assert h.view is not None
    h.view = replace(h.view, deleting=True)
    assert not await h.worker.step()
    assert h.published is Published.SUCCESS
    assert h.probe_calls == 0


async def test_deleting_pod_keeps_readiness_probing() -> None:
    """(8) Readiness is not affected by deletion and keeps probing."""
    h = Harness(ProbeKind.READINESS, Timing(failure_threshold=1))
    assert h.view is not None
    h.view = replace(h.view, deleting=True)
    assert await h.steps(BAD) == [Published.FAILURE]
    assert h.probe_calls == 1


@pytest.mark.parametrize(("age", "probed"), [(0.0, False), (4.99, False), (5.0, True), (7.5, True)])
async def test_initial_delay_is_whole_seconds_since_started_at(age: float, probed: bool) -> None:
    """(9) The delay compares truncated seconds since StartedAt with initialDelaySeconds."""
    h = Harness(ProbeKind.LIVENESS, Timing(initial_delay_seconds=5))
    assert h.view is not None
    h.view = replace(h.view, started_at=h.clock.wall() - age)
    assert await h.worker.step()
    assert h.probe_calls == int(probed)
    assert h.published is Published.SUCCESS


@pytest.mark.parametrize(
    ("kind", "started", "probed"),
    [
        (ProbeKind.LIVENESS, False, False),
        (ProbeKind.READINESS, False, False),
        (ProbeKind.STARTUP, False, True),
        (ProbeKind.LIVENESS, True, True),
        (ProbeKind.READINESS, True, True),
        (ProbeKind.STARTUP, True, False),
    ],
)
async def test_startup_gating(kind: ProbeKind, started: bool, probed: bool) -> None:
    """(10) Before startup passes only startup probes; after, startup idles."""
    h = Harness(kind)
    assert h.view is not None
    h.view = replace(h.view, started=started)
    assert await h.worker.step()
    assert h.probe_calls == int(probed)


# -- step 11: errors ----------------------------------------------------------------------------


async def test_error_is_retried_three_times_then_discarded() -> None:
    """(11) A probe that could not run is tried 3 times back to back, then nothing counts."""
    h = Harness(ProbeKind.READINESS, Timing(failure_threshold=1))
    h.script.extend([ProbeError("no"), ProbeError("no"), ProbeError("no")])
    assert await h.worker.step()
    assert h.probe_calls == 3
    assert h.published is Published.FAILURE  # still the initial value
    assert h.worker.result_run == 0
    assert [u.result for u in h.updates] == [Published.FAILURE]
    assert h.worker.history[-1].result == "error"


async def test_error_then_success_counts_once() -> None:
    """(11) An error followed by a success within the retries is one counted success."""
    h = Harness(ProbeKind.READINESS)
    h.script.extend([ProbeError("flaky"), OK])
    assert await h.worker.step()
    assert h.probe_calls == 2
    assert h.published is Published.SUCCESS
    assert h.worker.result_run == 1


# -- steps 13-16: thresholds (§3.4) --------------------------------------------------------------


async def test_readiness_failure_threshold_three() -> None:
    """§3.4: ready container, F=3: F, F stay ready; the 3rd F publishes NotReady; S recovers."""
    h = Harness(ProbeKind.READINESS, Timing(failure_threshold=3))
    assert await h.steps(OK, BAD, BAD, BAD, OK) == [
        Published.SUCCESS,
        Published.SUCCESS,
        Published.SUCCESS,
        Published.FAILURE,
        Published.SUCCESS,
    ]


async def test_readiness_success_threshold_three() -> None:
    """§3.4: S=3 needs three consecutive successes; one failure resets the run."""
    h = Harness(ProbeKind.READINESS, Timing(success_threshold=3, failure_threshold=1))
    assert await h.steps(OK, OK, BAD, OK, OK, OK) == [
        Published.FAILURE,
        Published.FAILURE,
        Published.FAILURE,
        Published.FAILURE,
        Published.FAILURE,
        Published.SUCCESS,
    ]


async def test_runs_never_mix() -> None:
    """§3.4: only consecutive identical results count toward a threshold."""
    h = Harness(ProbeKind.LIVENESS, Timing(failure_threshold=2))
    assert await h.steps(BAD, OK, BAD, OK) == [Published.SUCCESS] * 4
    assert await h.steps(BAD, BAD) == [Published.SUCCESS, Published.FAILURE]


async def test_liveness_third_failure_publishes_and_holds() -> None:
    """§3.4: liveness F=3 publishes Failure on the 3rd consecutive failure, then holds."""
    h = Harness(ProbeKind.LIVENESS, Timing(failure_threshold=3))
    assert await h.steps(BAD, BAD, BAD) == [
        Published.SUCCESS,
        Published.SUCCESS,
        Published.FAILURE,
    ]
    assert h.worker.on_hold


@pytest.mark.parametrize(
    ("outcomes", "published"),
    [
        ([BAD, BAD, BAD], Published.FAILURE),
        ([BAD, OK], Published.SUCCESS),
    ],
)
async def test_startup_holds_after_any_published_result(
    outcomes: list[ProbeOutcome], published: Published
) -> None:
    """(16) Startup goes on hold after publishing Success or Failure (#117153)."""
    h = Harness(ProbeKind.STARTUP, Timing(failure_threshold=3))
    seen = await h.steps(*outcomes)
    assert seen[-1] is published
    assert h.worker.on_hold
    calls = h.probe_calls
    assert await h.steps(OK) == [published]
    assert h.probe_calls == calls


@pytest.mark.parametrize(
    ("low_level", "published"),
    [
        (ProbeResult.SUCCESS, Published.SUCCESS),
        (ProbeResult.WARNING, Published.SUCCESS),
        (ProbeResult.FAILURE, Published.FAILURE),
        (ProbeResult.UNKNOWN, Published.FAILURE),
    ],
)
async def test_result_mapping(low_level: ProbeResult, published: Published) -> None:
    """§4.5: warning counts as success, unknown as failure."""
    h = Harness(ProbeKind.READINESS, Timing(failure_threshold=1))
    assert await h.steps(ProbeOutcome(low_level, "x")) == [published]
    assert h.worker.history[-1].result == low_level.value


def test_history_rows_leave_the_garbage_collectors_view() -> None:
    """A node keeps 32 records per probe: kept as tracked objects, they made every full
    collection (a stall of the event loop) longer. A history is a few columns, whatever it
    holds: numbers in arrays, and its words in a palette of untracked tuples."""
    history = History(2)
    history.extend([ProbeRecord("c1", 1.0, 0.1, "success", "ok", exit_code=0)] * 3)
    gc.collect()
    assert len(history) == 2
    # Its columns (three arrays and the palette) and its class, however many attempts it holds.
    assert len([o for o in gc.get_referents(history) if gc.is_tracked(o)]) == 5
    assert not any(gc.is_tracked(o) for o in history._palette)
    assert history[-1] == ProbeRecord("c1", 1.0, 0.1, "success", "ok", exit_code=0)


def test_history_is_a_ring_that_shares_equal_neighbours() -> None:
    """Oldest first across the ring's wrap; an output equal to the newest one's is kept once
    (a steady probe's identical outputs are one string)."""
    history = History(3)
    records = [
        ProbeRecord("c1", float(i), 0.01, "failure", "down " + "x" * (i // 2), exit_code=i,
                    http_status=None if i % 2 else 503, timed_out=i == 4, reason="exit-code",
                    run=i, threshold=3, changed=i == 3, held=i == 3,
                    pressure=Pressure(1.0, 2.0, float(i)) if i % 2 else None)
        for i in range(7)
    ]  # fmt: skip
    history.extend(records)
    assert list(history) == records[-3:]
    assert history[0] == records[4]
    assert history[-1] == records[6]
    with pytest.raises(IndexError):
        history[3]
    same = History(4)
    same.extend(ProbeRecord("c1", float(i), 0.01, "success", "".join(["o", "k"])) for i in range(4))
    assert len(same._palette) == 1


def test_history_palette_stays_bounded_and_reads_back_every_attempt() -> None:
    """An attempt keeps an index into a palette of distinct words: a flapping probe's two
    answers are two entries however long it runs, and outputs that never repeat make the
    palette drop the entries no attempt uses once it reaches twice the size."""
    flapping = History(4)
    for i in range(40):
        flapping.append(ProbeRecord("c1", float(i), 0.01, "success" if i % 2 else "failure",
                                    "ok" if i % 2 else "down", exit_code=i % 2))  # fmt: skip
    assert len(flapping._palette) == 2
    assert [r.output for r in flapping] == ["down", "ok", "down", "ok"]
    history = History(3)
    records = []
    for i in range(50):
        # Outputs that come back now and then (i % 7) and outputs seen once (i % 5 == 0).
        output = f"once {i}" if i % 5 == 0 else f"again {i % 7}"
        records.append(ProbeRecord(f"c{i // 20}", float(i), 0.5, "failure", output, run=i))
        history.append(records[-1])
        assert list(history) == records[-3:]
        assert len(history._palette) <= 6


async def test_history_is_bounded_and_records_details() -> None:
    """Every attempt lands in a bounded history with its result, code and output excerpt."""
    h = Harness(ProbeKind.READINESS)
    h.worker.history = History(4)
    for i in range(6):
        await h.steps(ProbeOutcome(ProbeResult.FAILURE, f"out{i}" + "x" * 5000, exit_code=i))
    assert [r.exit_code for r in h.worker.history] == [2, 3, 4, 5]
    last = h.worker.history[-1]
    assert isinstance(last, ProbeRecord)
    assert (last.container_id, last.result) == ("c1", "failure")
    assert len(last.output) == 1024
    assert h.worker.last_record is not None
    assert h.worker.last_record.output == "out5" + "x" * 5000
    assert replace(h.worker.last_record, output=last.output) == last


async def test_last_record_is_the_history_newest_with_its_whole_output() -> None:
    """The newest attempt is not kept twice: it is the history's, its output whole only when
    the history kept an excerpt; a worker that inherits a slot inherits it too."""
    h = Harness(ProbeKind.READINESS)
    assert h.worker.last_record is None
    await h.steps(ProbeOutcome(ProbeResult.FAILURE, "long " + "y" * 2000, exit_code=1))
    assert h.worker.last_record is not None
    assert h.worker.last_record.output == "long " + "y" * 2000
    assert len(h.worker.history[-1].output) == 1024
    await h.steps(ProbeOutcome(ProbeResult.SUCCESS, "short", exit_code=0))
    assert h.worker.last_record == h.worker.history[-1]
    assert h.worker.last_record.output == "short"
    await h.steps(ProbeOutcome(ProbeResult.FAILURE, "again " + "z" * 3000, exit_code=2))
    heir = Harness(ProbeKind.READINESS)
    heir.worker.inherit(h.worker)
    assert heir.worker.last_record == h.worker.last_record
    assert heir.worker.last_record is not None
    assert heir.worker.last_record.output == "again " + "z" * 3000


# -- §3.2 the run loop -----------------------------------------------------------------------------


async def _run_until(h: Harness, probes: int) -> None:
    """Run the worker until it has probed ``probes`` times, then stop it."""

    async def runner(_view: ContainerView) -> ProbeOutcome:
        h.probe_times.append(h.clock.now)
        if len(h.probe_times) >= probes:
            h.worker.stop()
        return OK

    h.runner = runner
    await asyncio.wait_for(h.worker.run(), HANG_GUARD)


async def test_first_probe_immediate_then_every_period() -> None:
    """(3)/(4) Without jitter the first step runs at once, then one per period."""
    h = Harness(ProbeKind.LIVENESS, Timing(period_seconds=10))
    await _run_until(h, 4)
    assert h.probe_times == [0.0, 10.0, 20.0, 30.0]


async def test_jitter_only_when_prober_just_started() -> None:
    """(2) A prober that started less than a period ago delays the first step by a jitter drawn
    from what is left of its first period: U(0, period - 3 s) for a worker 3 s after start. The
    ticker then keeps a phase drawn from the whole period (counted from the prober's start)."""
    h = Harness(ProbeKind.LIVENESS, Timing(period_seconds=10), prober_started_at=WALL0 - 3)
    await _run_until(h, 3)
    rng = random.Random(7)
    first = rng.uniform(0, 7)
    phase = -3 + rng.uniform(0, 10)
    second = phase + (math.floor((first - phase) / 10) + 1) * 10
    assert first < second <= first + 10
    assert h.probe_times == pytest.approx([first, second, second + 10])


async def test_restart_phases_cover_the_whole_period() -> None:
    """Workers that discovery starts late in the first period still tick on phases spread over
    the whole period (not crowded into what was left of it), after a first step in time."""
    phases = []
    for seed in range(200):
        h = Harness(
            ProbeKind.LIVENESS,
            Timing(period_seconds=10),
            prober_started_at=WALL0 - 8,  # discovery took 8 s: 2 s of the first period left
            rng=random.Random(seed),
        )
        await _run_until(h, 2)
        assert h.probe_times[0] <= 2
        phases.append((h.probe_times[1] + 8) % 10)  # the phase from the prober's start
    # Evenly over 10 s: each 2 s fifth holds about 40 of 200; crowded, all would be in one.
    fifths = [sum(1 for p in phases if k * 2 <= p < (k + 1) * 2) for k in range(5)]
    assert min(fifths) >= 20, fifths


async def test_pods_held_at_start_get_phases_over_the_whole_period_after_slow_discovery() -> None:
    """A big node's discovery can take longer than a period: the workers of pods that were
    there at the prober's start, started 25 s after it, draw their first step and their phase
    from a whole period from then, as the kubelet's (which hold those pods at their start) do:
    not at once (thousands of first steps in a burst) and not on the instants discovery reached
    them (which bunched the node's probes into bursts every period)."""
    firsts, phases = [], []
    for seed in range(200):
        h = Harness(
            ProbeKind.LIVENESS,
            Timing(period_seconds=10),
            prober_started_at=WALL0 - 25,
            rng=random.Random(seed),
            held_at_start=True,
        )
        await _run_until(h, 2)
        rng = random.Random(seed)
        first, phase = rng.uniform(0, 10), rng.uniform(0, 10)
        assert h.probe_times[0] == pytest.approx(first)
        assert h.probe_times[1] == pytest.approx(
            phase + (math.floor((first - phase) / 10) + 1) * 10
        )
        firsts.append(h.probe_times[0])
        phases.append(h.probe_times[1] % 10)
    for drawn in (firsts, phases):
        fifths = [sum(1 for p in drawn if k * 2 <= p < (k + 1) * 2) for k in range(5)]
        assert min(fifths) >= 20, fifths
    # Without it (a pod that came later, or rules reloaded), the grid starts with the worker.
    h = Harness(ProbeKind.LIVENESS, Timing(period_seconds=10), prober_started_at=WALL0 - 25)
    await _run_until(h, 2)
    assert h.probe_times == [0.0, 10.0]


@pytest.mark.parametrize("since_start", [0.0, 4.0, 9.9])
async def test_first_step_within_one_period_of_prober_start(since_start: float) -> None:
    """However late discovery starts a worker inside the first period, its first step comes
    before the prober's first period ends (the kubelet's workers start with it)."""
    for seed in range(20):
        h = Harness(
            ProbeKind.LIVENESS,
            Timing(period_seconds=10),
            prober_started_at=WALL0 - since_start,
            rng=random.Random(seed),
        )
        await _run_until(h, 1)
        assert 0 <= h.probe_times[0] <= 10 - since_start


async def test_manual_trigger_runs_now_and_resets_ticker() -> None:
    """(5) A trigger probes at once and the next tick comes a full period after it."""
    h = Harness(ProbeKind.READINESS, Timing(period_seconds=10))

    async def runner(_view: ContainerView) -> ProbeOutcome:
        h.probe_times.append(h.clock.now)
        if len(h.probe_times) == 1:
            h.clock.now = 4.0  # time passes; then somebody triggers the worker
            h.worker.trigger()
            h.worker.trigger()  # extra triggers coalesce
        elif len(h.probe_times) == 3:
            h.worker.stop()
        return OK

    h.runner = runner
    await asyncio.wait_for(h.worker.run(), HANG_GUARD)
    assert h.probe_times == [0.0, 4.0, 14.0]


async def test_slow_probe_drops_missed_ticks_but_keeps_phase() -> None:
    """(8) A probe longer than the period runs the pending tick at once, then stays on grid."""
    h = Harness(ProbeKind.LIVENESS, Timing(period_seconds=10))

    async def runner(_view: ContainerView) -> ProbeOutcome:
        h.probe_times.append(h.clock.now)
        if len(h.probe_times) == 1:
            h.clock.now = 25.0  # the first probe took 2.5 periods
        elif len(h.probe_times) == 3:
            h.worker.stop()
        return OK

    h.runner = runner
    await asyncio.wait_for(h.worker.run(), HANG_GUARD)
    assert h.probe_times == [0.0, 25.0, 30.0]
    # Each record says it: the second served the tick of 20 s, 5 s late, the one of 10 s
    # dropped before it (issue 25: late or lost, every attempt explains itself).
    assert [(r.late, r.dropped) for r in h.worker.history] == [(0.0, 0), (5.0, 1), (0.0, 0)]


async def test_stop_is_idempotent_and_cleans_up() -> None:
    """(6)/(7) stop() may be called many times; on exit the published result is removed."""
    h = Harness(ProbeKind.READINESS, Timing(period_seconds=10))
    task = asyncio.create_task(h.worker.run())
    await asyncio.sleep(0)
    for _ in range(10):
        h.worker.stop()
    await asyncio.wait_for(task, HANG_GUARD)
    assert h.results.get("c1", ProbeKind.READINESS) is None
    assert len(h.results) == 0
    assert h.worker.stopped


async def test_worker_exits_when_container_is_gone_for_good() -> None:
    """A step returning False ends run() and removes the result."""
    h = Harness(ProbeKind.LIVENESS)
    assert h.view is not None
    h.view = replace(h.view, running=False, terminated=True, will_restart=False)
    await asyncio.wait_for(h.worker.run(), HANG_GUARD)
    assert len(h.results) == 0


async def test_crashing_step_is_logged_and_worker_keeps_going() -> None:
    """Like the kubelet's panic recovery, an unexpected exception does not end the worker."""
    h = Harness(ProbeKind.LIVENESS, Timing(period_seconds=10))
    calls = 0

    async def runner(_view: ContainerView) -> ProbeOutcome:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("boom")
        h.worker.stop()
        return OK

    h.runner = runner
    await asyncio.wait_for(h.worker.run(), HANG_GUARD)
    assert calls == 2


async def test_trigger_does_not_cut_jitter_short_but_runs_after_first_step() -> None:
    """(2)/(4) Like the kubelet's sleep, the jitter ignores a manual trigger, which then runs
    right after the first step. The kubelet's trigger there resets its ticker to its first step,
    its drawn phase; ours keeps the phase drawn from the whole period (resetting it put every
    readiness worker on the instant its first step came, crowded into what was left)."""
    h = Harness(ProbeKind.READINESS, Timing(period_seconds=10), prober_started_at=WALL0 - 3)
    rng = random.Random(7)
    expected = rng.uniform(0, 7)  # what is left of the prober's first period
    phase = -3 + rng.uniform(0, 10)  # the ticker's, from the prober's start
    tick = phase + (math.floor((expected - phase) / 10) + 1) * 10

    async def runner(_view: ContainerView) -> ProbeOutcome:
        h.probe_times.append(h.clock.now)
        if len(h.probe_times) == 3:
            h.worker.stop()
        return OK

    h.runner = runner
    task = asyncio.create_task(h.worker.run())
    await asyncio.sleep(0)
    h.worker.trigger()
    await asyncio.wait_for(task, HANG_GUARD)
    assert h.probe_times == pytest.approx([expected, expected, tick])
    assert tick != pytest.approx(expected + 10)  # not reset by the trigger


async def test_probe_now_ends_the_jitter() -> None:
    """probe_now() (a person's TriggerProbe) probes at once even during the jitter."""
    h = Harness(ProbeKind.READINESS, Timing(period_seconds=10), prober_started_at=WALL0 - 3)

    async def runner(_view: ContainerView) -> ProbeOutcome:
        h.probe_times.append(h.clock.now)
        h.worker.stop()
        return OK

    h.runner = runner
    task = asyncio.create_task(h.worker.run())
    await asyncio.sleep(0)
    h.worker.probe_now()
    await asyncio.wait_for(task, HANG_GUARD)
    assert h.probe_times == [0.0]


# -- issue #12: D4 tick grid, D17 adoption flag, D10 inheritance, D18 failed container ----------


@pytest.mark.parametrize(
    ("admitted_ago", "first_probe"),
    [(3.0, 7.0), (13.0, 7.0), (10.0, 10.0), (0.5, 9.5)],
)
async def test_d4_first_probe_on_the_pod_admission_grid(
    admitted_ago: float, first_probe: float
) -> None:
    """D4: the kubelet's worker started ticking at pod admission (its immediate step found no
    container); ours joins that grid at the next tick instead of probing at discovery."""
    h = Harness(ProbeKind.LIVENESS, Timing(period_seconds=10), grid_anchor=WALL0 - admitted_ago)
    await _run_until(h, 2)
    assert h.probe_times == pytest.approx([first_probe, first_probe + 10])


async def test_d4_unanchored_worker_probes_at_once() -> None:
    """Without an anchor (our own start or reloaded rules) the first step runs at once."""
    h = Harness(ProbeKind.LIVENESS, Timing(period_seconds=10))
    await _run_until(h, 1)
    assert h.probe_times == [0.0]


async def test_d4_trigger_before_the_first_grid_tick_runs_at_once() -> None:
    """A readiness trigger (the pod sync at container start) does not wait for the grid."""
    h = Harness(ProbeKind.READINESS, Timing(period_seconds=10), grid_anchor=WALL0 - 2)
    h.worker.trigger()
    await _run_until(h, 2)
    assert h.probe_times == [0.0, 10.0]


async def test_d17_adoption_flag_is_per_container() -> None:
    """D17: 'keep the previous state' belongs to the adopted container, not its replacement."""
    h = Harness(ProbeKind.READINESS, Timing(initial_delay_seconds=1000), prober_started_at=WALL0)
    assert await h.worker.step()
    assert h.worker.preserves("c1")
    assert not h.worker.preserves("c2")  # the replacement the worker has not stepped for yet


async def test_d10_inherit_keeps_counters_history_and_run() -> None:
    """D10: a worker that replaces one of the same slot carries on its counters and history."""
    old = Harness(ProbeKind.READINESS, Timing(failure_threshold=3))
    await old.steps(BAD, BAD)
    new = Harness(ProbeKind.READINESS, Timing(failure_threshold=3))
    new.worker.inherit(old.worker)
    assert new.worker.probes_run == 2
    assert [r.result for r in new.worker.history] == ["failure", "failure"]
    assert (new.worker.last_result, new.worker.result_run) == (Published.FAILURE, 2)
    # The run continues: one more failure reaches the threshold of 3.
    assert await new.steps(BAD) == [Published.FAILURE]
    assert new.worker.result_run == 3


async def test_d18_failed_container_is_the_one_whose_failure_was_published() -> None:
    """D18: the worker names the container its own attempts failed (not step 7's 'not
    running'), so a stop acts on that container whatever replaced it since."""
    h = Harness(ProbeKind.LIVENESS, Timing(failure_threshold=1))
    assert h.view is not None
    h.view = replace(h.view, running=False)
    assert await h.worker.step()
    assert h.published is Published.FAILURE
    assert h.worker.failed_container is None  # not running: no attempt failed
    h.view = replace(h.view, id="c2", running=True)
    await h.steps(BAD)
    assert h.worker.failed_container == "c2"


async def test_probing_since_is_set_only_during_an_attempt() -> None:
    """The API shows an attempt in progress (e.g. an exec waiting for its I/O to drain)."""
    h = Harness(ProbeKind.LIVENESS)
    seen: list[float | None] = []

    async def runner(_view: ContainerView) -> ProbeOutcome:
        seen.append(h.worker.probing_since)
        return ProbeOutcome(ProbeResult.SUCCESS, "ok", note="answered after its timeout")

    h.runner = runner
    assert await h.worker.step()
    assert seen == [WALL0]
    assert h.worker.probing_since is None
    assert h.worker.last_record is not None
    assert h.worker.last_record.note == "answered after its timeout"


def test_real_clock_never_ticks_early_on_uvloop() -> None:
    """uvloop rounds timers to milliseconds and fires some early; a tick must not come before
    its grid point (a start seen before the tick would count against the previous one)."""

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        clock = LoopClock()
        rng = random.Random(3)
        early = []
        for _ in range(200):
            deadline = loop.time() + rng.uniform(0.0005, 0.005)
            wakeup: asyncio.Future[Wake] = loop.create_future()
            clock.wake_at(deadline, wakeup)
            assert await wakeup is Wake.TICK
            early.append(deadline - loop.time())
        return early

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        early = runner.run(main())
    assert max(early) <= 0


def test_one_timer_wakes_every_waiting_worker_in_deadline_order() -> None:
    """Wake-ups added in any order resolve in the order of their deadlines (equal ones in the
    order they came), each at or after its own, under one timer handle; one resolved first (a
    trigger) is left alone and dropped when it comes due."""

    async def main() -> tuple[list[int], list[float], int, int]:
        loop = asyncio.get_running_loop()
        timers = TickTimers(loop)
        rng = random.Random(5)
        base = loop.time() + 0.002
        deadlines = [base + rng.choice([0.0, 0.001, 0.003, 0.004]) for _ in range(40)]
        fired: list[int] = []
        early: list[int] = []
        wakeups: list[asyncio.Future[Wake]] = []
        for index, deadline in enumerate(deadlines):
            wakeup: asyncio.Future[Wake] = loop.create_future()

            def seen(future: asyncio.Future[Wake], index: int = index) -> None:
                fired.append(index)
                if future.result() is Wake.TICK and loop.time() < deadlines[index]:
                    early.append(index)

            wakeup.add_done_callback(seen)
            timers.add(deadline, wakeup)
            wakeups.append(wakeup)
        wakeups[7].set_result(Wake.TRIGGER)
        scheduled = loop._scheduled  # type: ignore[attr-defined]
        handles = sum(1 for handle in scheduled if not handle.cancelled())
        results = await asyncio.gather(*wakeups)
        assert early == []
        assert results[7] is Wake.TRIGGER
        assert all(r is Wake.TICK for i, r in enumerate(results) if i != 7)
        return fired, deadlines, handles, len(timers)

    with asyncio.Runner() as runner:  # asyncio's loop: its scheduled handles can be counted
        fired, deadlines, handles, left = runner.run(main())
    assert fired[0] == 7
    assert fired[1:] == sorted((i for i in range(40) if i != 7), key=lambda i: (deadlines[i], i))
    assert handles == 1
    assert left == 0


def test_one_clock_keeps_each_loops_timers_apart() -> None:
    """Every worker shares one real clock; loops in two threads at once each get their own
    timers, and every wake-up of each resolves on its own loop."""
    clock = LoopClock()
    ready = threading.Barrier(2)

    def run_loop(out: list[bool]) -> None:
        async def main() -> None:
            loop = asyncio.get_running_loop()
            ready.wait()
            for _ in range(100):
                wakeup: asyncio.Future[Wake] = loop.create_future()
                clock.wake_at(loop.time() + 0.0005, wakeup)
                out.append(await wakeup is Wake.TICK)

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main())

    outs: list[list[bool]] = [[], []]
    threads = [threading.Thread(target=run_loop, args=(out,)) for out in outs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outs == [[True] * 100, [True] * 100]


# -- the one reporting channel -------------------------------------------------------------------


async def test_a_change_is_reported_with_the_attempt_that_made_it_and_its_run() -> None:
    """The observer hears each change with the attempt behind it: nothing reads the worker back."""
    h = Harness(ProbeKind.READINESS, Timing(success_threshold=2))
    await h.steps(OK, OK)
    initial, passed = h.reports.updates
    assert (initial.previous, initial.result) == (None, Published.FAILURE)
    assert (initial.record, initial.consecutive) == (None, 0)  # no attempt made the initial value
    assert (passed.previous, passed.result) == (Published.FAILURE, Published.SUCCESS)
    assert passed.consecutive == 2
    assert passed.record is h.reports.attempts[-1]
    assert passed.record.output == "ok"


async def test_a_container_that_stops_reports_its_failure_without_the_last_attempt() -> None:
    """Step (7)'s failure is not an attempt: it carries neither the last success's output nor
    its run (it used to say ``consecutive 6, output "alive"``)."""
    h = Harness(ProbeKind.LIVENESS, Timing(failure_threshold=1))
    await h.steps(OK, OK, OK)
    assert h.view is not None
    h.view = replace(h.view, running=False, terminated=True)
    assert await h.worker.step()
    failed = h.reports.updates[-1]
    assert (failed.previous, failed.result) == (Published.SUCCESS, Published.FAILURE)
    assert (failed.record, failed.consecutive) == (None, 0)
    assert len(h.reports.attempts) == 3  # no attempt was recorded for it


async def test_an_attempt_keeps_its_note_in_the_record() -> None:
    """The record keeps the outcome's note (e.g. an exec answer that came after its timeout)."""
    h = Harness(ProbeKind.LIVENESS)
    late = ProbeOutcome(ProbeResult.FAILURE, "", timed_out=True, note="the answer came 2.1s late")
    await h.steps(late)
    [record] = h.reports.attempts
    assert (record.result, record.timed_out) == ("failure", True)
    assert record.note == "the answer came 2.1s late"


async def test_lines_logged_in_a_workers_task_name_its_container_and_probe() -> None:
    """structlog context bound per worker: its lines (and its probes') carry the container, the
    probe and the container ID without passing them, in every step (the ID is bound once, when
    the worker first sees it), and nothing leaks to the caller."""
    reports = WorkerReports()
    calls = 0

    async def cannot_run(_view: ContainerView) -> ProbeOutcome:
        nonlocal calls
        calls += 1
        # A new text each time, so that each attempt's error is logged (repeats are not).
        raise ProbeError(f"the runtime is unreachable ({calls})")

    worker = ProbeWorker(
        ProbeKind.READINESS,
        Timing(),
        status=lambda: ContainerView(id="c0ffee" * 4, running=True, started_at=1, started=True),
        run_probe=cannot_run,
        results=ResultsStore(),
        prober_started_at=WALL0 - 3600,
        clock=WorkerClock(),
        observer=reports,
        log_context={"container": "shop/web-0/app"},
    )
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        task = asyncio.create_task(worker.run(), context=contextvars.Context())
        while len({r.started_at for r in reports.attempts}) < 3:
            reports.changed.clear()
            await reports.changed.wait()
        worker.stop()
        await task
        log.info("after_the_worker")
    errored = [e for e in logs if e["event"] == "probe_errored"]
    assert len({e["error"] for e in errored}) >= 3  # lines of three steps
    for line in errored:
        assert line["container"] == "shop/web-0/app"
        assert line["probe"] == "readiness"
        assert line["container_id"] == ("c0ffee" * 4)[:13]
    [after] = [e for e in logs if e["event"] == "after_the_worker"]
    assert "container" not in after
    assert "probe" not in after


async def test_a_worker_that_logs_nothing_binds_no_log_context() -> None:
    """The log context is bound once the worker logs (issue 36): a binding is two blocks of
    the task's context per worker, and a steady probe logs nothing. Its first line binds all of
    it, the container ID too, and the next container's ID follows."""
    reports = WorkerReports()
    views = iter(["c0ffee" * 4] * 3 + ["beef" * 6] * 100)
    failing = False

    async def probe(_view: ContainerView) -> ProbeOutcome:
        if failing:
            raise ProbeError("the runtime is unreachable")
        return ProbeOutcome(ProbeResult.SUCCESS, "")

    worker = ProbeWorker(
        ProbeKind.READINESS,
        Timing(),
        status=lambda: ContainerView(id=next(views), running=True, started_at=1, started=True),
        run_probe=probe,
        results=ResultsStore(),
        prober_started_at=WALL0 - 3600,
        clock=WorkerClock(),
        observer=reports,
        log_context={"container": "shop/web-0/app"},
    )

    def bound(context: contextvars.Context) -> dict[str, object]:
        return context.run(structlog.contextvars.get_contextvars)

    async def attempts(count: int) -> None:
        while len({r.started_at for r in reports.attempts}) < count:
            reports.changed.clear()
            await reports.changed.wait()

    context = contextvars.Context()
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        task = asyncio.create_task(worker.run(), context=context)
        await attempts(2)
        assert bound(context) == {}
        failing = True
        await attempts(3)
        assert bound(context) == {
            "probe": "readiness",
            "container": "shop/web-0/app",
            "container_id": ("c0ffee" * 4)[:13],
        }
        failing = False
        await attempts(5)
        worker.stop()
        await task
    assert bound(context)["container_id"] == ("beef" * 6)[:13]
    [line] = [e for e in logs if e["event"] == "probe_errored"]
    assert line["container_id"] == ("c0ffee" * 4)[:13]


@pytest.mark.parametrize("ended_first", [True, False], ids=["ended", "still-stepping"])
async def test_take_over_keeps_the_hold_and_the_published_result(ended_first: bool) -> None:
    """Issue 34 item 3: a worker started again for the container its predecessor was stopped on
    carries on: same container, hold and published Failure, whether the predecessor's cleanup
    (which removes the result, the kubelet's Remove) ran before or after the take-over."""
    h = Harness(ProbeKind.LIVENESS, Timing(failure_threshold=1))
    assert await h.steps(BAD) == [Published.FAILURE]
    assert h.worker.on_hold
    h.worker.stop()
    if ended_first:
        await h.worker.run()
        assert h.published is None
    successor = ProbeWorker(
        ProbeKind.LIVENESS,
        Timing(failure_threshold=1),
        status=lambda: h.view,
        run_probe=lambda view: h.runner(view),
        results=h.results,
        prober_started_at=WALL0 - 3600,
        clock=h.clock,
        observer=h.reports,
    )
    successor.take_over(h.worker)
    if not ended_first:
        await h.worker.run()  # its cleanup leaves the result to the successor
    assert h.published is Published.FAILURE
    assert successor.container_id == "c1"
    assert successor.on_hold
    assert successor.held_after == 1
    assert successor.probes_run == 1
    updates = len(h.updates)
    assert await successor.step()
    assert h.probe_calls == 1  # held: nothing probed
    assert len(h.updates) == updates  # and nothing published
    assert h.published is Published.FAILURE
