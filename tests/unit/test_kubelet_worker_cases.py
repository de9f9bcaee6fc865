"""The kubelet's prober ``worker_test.go``, row by row, against ``ProbeWorker``.

Every test names the upstream test (and table row) it mirrors; /tmp/kubelet-cases.md §1 is the
spec. ``ProbeWorker.step()`` stands for ``doProbe`` and ``run()`` for ``run``; time is a fake
clock, so nothing sleeps.

Kubelet inputs become ``ContainerView`` fields:

* no pod status, or no status for this container name → the status source returns ``None``;
* pod phase Failed (a terminal or vanished pod) → the sandbox is down, which the manager's
  ``_view`` shows as ``running=False, terminated=True, will_restart=False, deleting=True``;
* ``DeletionTimestamp`` → ``deleting=True`` (the manager sets it when the sandbox is not ready);
* ``restartPolicy: Never`` and a terminated container → ``will_restart=False``. CRI cannot show
  a restartPolicy: through the manager this happens only once the sandbox is down;
* ``ContainerStatus.Started`` → ``started``.

Every case runs for each kubelet release in ``RELEASES`` (1.28, and each release where a row of
docs/kubelet-fidelity.md "Kubelet releases" changes what the worker does): a row whose outcome
differs between releases says so, with the release and the kubelet PR.

Fixtures follow ``common_test.go``: container ID ``test://cOnTaInEr_Id``, the exec prober
answers Success unless told otherwise, a probe with zero fields gets Period, Timeout and both
thresholds of 1 (``setTestProbe``), and statuses start ``StartedAt = now``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace

import pytest

from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.kubelet_profile import KubeletProfile
from cri_prober.probing.outcome import ProbeOutcome, ProbeResult
from cri_prober.probing.results import ProbeRecord, Published, ResultsStore, ResultUpdate
from cri_prober.probing.worker import RESTART_GRACE_SECONDS, ContainerView, ProbeWorker
from tests.support.clock import WALL0, WorkerClock
from tests.support.waiting import HANG_GUARD

CONTAINER_ID = "test://cOnTaInEr_Id"
NEW_CONTAINER_ID = "test://newCont_ID"
KINDS = [ProbeKind.LIVENESS, ProbeKind.READINESS, ProbeKind.STARTUP]
KIND_IDS = [k.value for k in KINDS]
INITIAL = {
    ProbeKind.LIVENESS: Published.SUCCESS,
    ProbeKind.READINESS: Published.FAILURE,
    ProbeKind.STARTUP: Published.UNKNOWN,
}


# The reference (1.28) and each release where a row changes: 1.32 (PR #119089, PR #121206),
# 1.35 (KEP-4781), 1.37 (PR #141487).
RELEASES = [KubeletProfile.parse(v) for v in ("1.28", "1.32", "1.35", "1.37")]


@dataclass(frozen=True)
class Timing:
    """``setTestProbe``: zero Period and thresholds become 1."""

    initial_delay_seconds: int = 0
    period_seconds: int = 1
    success_threshold: int = 1
    failure_threshold: int = 1


class KubeletWorker:
    """``newTestManager`` + ``newTestWorker``: one worker, its status entry and a fake exec."""

    # The release the workers follow: the ``kubelet`` fixture sets it for each test.
    kubelet = KubeletProfile()

    def __init__(
        self,
        kind: ProbeKind,
        timing: Timing | None = None,
        *,
        hold_failures: bool = True,
        prober_started_at: float = WALL0 - 3600,
    ) -> None:
        self.kind = kind
        self.clock = WorkerClock()
        # fakeExecProber{Success}; tests change it as the kubelet's do (m.prober.exec = ...).
        self.exec_result = ProbeResult.SUCCESS
        self.exec_calls = 0
        # What the worker's probes run: the fake exec, unless a test puts another runner here.
        self.runner: Callable[[ContainerView], Awaitable[ProbeOutcome]] = self._exec
        self.view: ContainerView | None = None  # no pod status until SetPodStatus
        self.results = ResultsStore()
        self.updates: list[ResultUpdate] = []
        self.removed_workers: list[ProbeWorker] = []  # m.removeWorker
        self.changed = asyncio.Event()
        self.worker = ProbeWorker(
            kind,
            timing or Timing(),
            status=lambda: self.view,
            run_probe=lambda view: self.runner(view),
            results=self.results,
            # By default the manager is old: no start-up jitter.
            prober_started_at=prober_started_at,
            clock=self.clock,
            rng=random.Random(0),
            observer=self,
            hold_failures=hold_failures,
            kubelet=self.kubelet,
        )

    # WorkerObserver
    def attempt_finished(self, worker: ProbeWorker, record: ProbeRecord) -> None:
        self.changed.set()

    def result_changed(self, worker: ProbeWorker, update: ResultUpdate) -> None:
        self.updates.append(update)

    def worker_stopped(self, worker: ProbeWorker) -> None:
        self.removed_workers.append(worker)

    async def _exec(self, _view: ContainerView) -> ProbeOutcome:
        self.exec_calls += 1
        return ProbeOutcome(self.exec_result, self.exec_result.value)

    def running_status(self, *, started: bool | None = None) -> ContainerView:
        """``getTestRunningStatusWithStarted(started)``; by default started = type != startup."""
        if started is None:
            started = self.kind is not ProbeKind.STARTUP
        return ContainerView(
            id=CONTAINER_ID, running=True, started_at=self.clock.wall(), started=started
        )

    def get(self, container_id: str = CONTAINER_ID) -> Published | None:
        """``resultsManager(m, type).Get(id)``: None when not set."""
        return self.results.get(container_id, self.kind)

    async def do_probe(self) -> bool:
        return await self.worker.step()

    async def expect(self, result: Published | None, msg: str) -> None:
        """``expectContinue(doProbe())`` then ``expectResult(result)``."""
        assert await self.do_probe(), f"{msg}: expected to continue"
        assert self.get() is result, f"{msg}: expected {result}, got {self.get()}"


@pytest.fixture(autouse=True, params=RELEASES, ids=[r.version for r in RELEASES])
def kubelet(request: pytest.FixtureRequest) -> Iterator[KubeletProfile]:
    """Every case, for each release in RELEASES."""
    profile: KubeletProfile = request.param
    KubeletWorker.kubelet = profile
    yield profile
    KubeletWorker.kubelet = KubeletProfile()


# -- TestDoProbe -----------------------------------------------------------------------------------


def _status(h: KubeletWorker, row: str) -> ContainerView | None:
    """The pod status of each TestDoProbe row, every status built with started = type != startup."""
    started = h.kind is not ProbeKind.STARTUP
    running = h.running_status(started=started)
    if row == "no_status":
        return None
    if row == "pod_failed":
        # failedStatus: Phase Failed. CRI has no phase: a finished pod is a sandbox that is down
        # with its containers exited (manager _view sets pod_finished).
        return replace(
            running,
            running=False,
            terminated=True,
            will_restart=False,
            deleting=True,
            pod_finished=True,
        )
    if row == "pod_deletion":
        # DeletionTimestamp set; the manager's _view marks a not-ready sandbox as deleting (and
        # not restarting), while the container can still be running.
        return replace(running, deleting=True, will_restart=False)
    if row == "no_container_status":
        return None  # otherStatus: only a container with another name; the source finds none
    if row == "container_waiting":
        return replace(running, running=False)  # pendingStatus: Running nil, Terminated nil
    if row == "container_terminated":
        # terminatedStatus in a restartPolicy: Never pod. CRI cannot show restartPolicy; the
        # worker is told directly that nothing will restart the container.
        return replace(running, running=False, terminated=True, will_restart=False)
    return running


# (row, extra, expectContinue L/R/S, expectSet, expectedResult) as in worker_test.go.
DO_PROBE_ROWS: list[tuple[str, dict[ProbeKind, bool], bool, Published | None]] = [
    ("no_status", dict.fromkeys(KINDS, True), False, None),
    ("pod_failed", dict.fromkeys(KINDS, False), False, None),
    (
        "pod_deletion",
        {ProbeKind.LIVENESS: False, ProbeKind.READINESS: True, ProbeKind.STARTUP: False},
        True,
        Published.SUCCESS,
    ),
    ("no_container_status", dict.fromkeys(KINDS, True), False, None),
    ("container_waiting", dict.fromkeys(KINDS, True), True, Published.FAILURE),
    ("container_terminated", dict.fromkeys(KINDS, False), True, Published.FAILURE),
    ("probe_successful", dict.fromkeys(KINDS, True), True, Published.SUCCESS),
    ("initial_delay_passed", dict.fromkeys(KINDS, True), True, Published.SUCCESS),
]


def _do_probe_params() -> list[object]:
    params: list[object] = []
    for index, (row, cont, expect_set, expected) in enumerate(DO_PROBE_ROWS):
        for kind in KINDS:
            params.append(
                pytest.param(
                    index,
                    row,
                    kind,
                    cont[kind],
                    expect_set,
                    expected,
                    id=f"{index}-{row}-{kind.value}",
                )
            )
    return params


@pytest.mark.parametrize(
    ("index", "row", "kind", "expect_continue", "expect_set", "expected"), _do_probe_params()
)
async def test_do_probe(
    index: int,
    row: str,
    kind: ProbeKind,
    expect_continue: bool,
    expect_set: bool,
    expected: Published | None,
) -> None:
    """worker_test.go TestDoProbe, one table row for one probe type.

    Rows: 0 No status; 1 Pod failed; 2 Pod deletion; 3 No container status; 4 Container
    waiting; 5 Container terminated (pod Never: CRI cannot show restartPolicy, so the view says
    will_restart=False); 6 Probe successful; 7 Initial delay passed (InitialDelaySeconds -100).
    """
    timing = Timing(initial_delay_seconds=-100) if row == "initial_delay_passed" else Timing()
    h = KubeletWorker(kind, timing)
    h.view = _status(h, row)
    assert await h.do_probe() is expect_continue, f"row {index} {row}: continue"
    result = h.get()
    assert (result is not None) is expect_set, f"row {index} {row}: set? got {result}"
    assert result is expected, f"row {index} {row}: result"


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
async def test_do_probe_pod_failed_worker_ends_without_a_result(kind: ProbeKind) -> None:
    """worker_test.go TestDoProbe row 1 "Pod failed", end state through run(): the worker exits
    on its first step and no result is left for the container (as after the kubelet's exit)."""
    h = KubeletWorker(kind)
    h.view = _status(h, "pod_failed")
    await asyncio.wait_for(h.worker.run(), HANG_GUARD)
    assert h.get() is None
    assert len(h.results) == 0
    assert h.removed_workers == [h.worker]
    assert h.exec_calls == 0


# -- TestInitialDelay ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
async def test_initial_delay(kind: ProbeKind) -> None:
    """worker_test.go TestInitialDelay: InitialDelaySeconds 10, StartedAt now → initial value;
    StartedAt now-100s → Success."""
    h = KubeletWorker(kind, Timing(initial_delay_seconds=10))
    h.view = h.running_status()
    await h.expect(INITIAL[kind], "during initial delay")
    assert h.exec_calls == 0
    h.view = replace(h.view, started_at=h.clock.wall() - 100)
    await h.expect(Published.SUCCESS, "after initial delay")
    assert h.exec_calls == 1


# -- TestFailureThreshold / TestSuccessThreshold ---------------------------------------------------


async def test_failure_threshold() -> None:
    """worker_test.go TestFailureThreshold: readiness S=1 F=3; twice: 3 successes → Success,
    2 failures → still Success, 3 more → Failure."""
    h = KubeletWorker(ProbeKind.READINESS, Timing(success_threshold=1, failure_threshold=3))
    h.view = h.running_status()
    for i in range(2):
        h.exec_result = ProbeResult.SUCCESS
        for j in range(3):
            await h.expect(Published.SUCCESS, f"{j + 1} success ({i})")
        h.exec_result = ProbeResult.FAILURE
        for j in range(2):
            await h.expect(Published.SUCCESS, f"{j + 1} failing ({i})")
        for j in range(3):
            await h.expect(Published.FAILURE, f"{j + 3} failure ({i})")
    assert not h.worker.on_hold  # readiness never holds


async def test_success_threshold() -> None:
    """worker_test.go TestSuccessThreshold: readiness S=3 F=1, Failure set beforehand; twice:
    2 successes → Failure, 3 more → Success, 1 failure → Failure."""
    h = KubeletWorker(ProbeKind.READINESS, Timing(success_threshold=3, failure_threshold=1))
    h.view = h.running_status()
    h.results.set(CONTAINER_ID, ProbeKind.READINESS, Published.FAILURE)
    for i in range(2):
        for j in range(2):
            await h.expect(Published.FAILURE, f"{j + 1} success ({i})")
        for j in range(3):
            await h.expect(Published.SUCCESS, f"{j + 3} success ({i})")
        h.exec_result = ProbeResult.FAILURE
        await h.expect(Published.FAILURE, f"1 failure ({i})")
        h.exec_result = ProbeResult.SUCCESS


# -- TestStartupProbeSuccessThreshold / TestStartupProbeFailureThreshold ---------------------------


async def test_startup_probe_success_threshold(kubelet: KubeletProfile) -> None:
    """worker_test.go TestStartupProbeSuccessThreshold (added by PR #121206, release-1.32):
    startup S=1 F=3, not started: one success → Success; then on hold with resultRun 0. Before
    1.32 (worker.go release-1.28: only ``(liveness || startup) && Failure`` holds) the worker
    is not held and keeps its run of 1; it idles once the status says started (step 10)."""
    h = KubeletWorker(ProbeKind.STARTUP, Timing(success_threshold=1, failure_threshold=3))
    h.view = h.running_status(started=False)
    assert not h.worker.on_hold
    await h.expect(Published.SUCCESS, "1 success")
    if kubelet.at_least(32):
        assert h.worker.on_hold
        assert h.worker.result_run == 0
    else:
        assert not h.worker.on_hold
        assert h.worker.result_run == 1
        h.view = replace(h.view, started=True)
        await h.expect(Published.SUCCESS, "started: the startup worker idles")
        assert h.exec_calls == 1


async def test_startup_probe_failure_threshold() -> None:
    """worker_test.go TestStartupProbeFailureThreshold: startup S=1 F=3, exec Failure:
    Unknown/1, Unknown/2, Failure/0, then on hold with resultRun 0."""
    h = KubeletWorker(ProbeKind.STARTUP, Timing(success_threshold=1, failure_threshold=3))
    h.view = h.running_status(started=False)
    h.exec_result = ProbeResult.FAILURE
    for i, (result, run) in enumerate(
        [(Published.UNKNOWN, 1), (Published.UNKNOWN, 2), (Published.FAILURE, 0)]
    ):
        assert not h.worker.on_hold, f"{i + 1} failure: not on hold yet"
        await h.expect(result, f"{i + 1} failure")
        assert h.worker.result_run == run, f"{i + 1} failure: resultRun"
    assert h.worker.on_hold
    assert h.worker.result_run == 0


# -- TestCleanUp / TestHandleCrash (run) -----------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
async def test_clean_up(kind: ProbeKind) -> None:
    """worker_test.go TestCleanUp: run() until Success, stop() 10 times, wait for exit; the
    result is removed and the worker unregistered (m.workers[key] gone)."""
    h = KubeletWorker(kind)
    h.view = h.running_status()
    task = asyncio.create_task(h.worker.run())
    async with asyncio.timeout(HANG_GUARD):
        while not (h.worker.probes_run >= 1 and h.get() is Published.SUCCESS):
            h.changed.clear()
            await h.changed.wait()
    for _ in range(10):
        h.worker.stop()  # callable many times without consequence
    await asyncio.wait_for(task, HANG_GUARD)
    assert h.get() is None, "expected result to be cleared"
    assert h.removed_workers == [h.worker], "expected worker to be cleared"


async def test_handle_crash() -> None:
    """worker_test.go TestHandleCrash (k/k ~1.6; doProbe still recovers in 1.35): readiness
    Success, then the prober crashes: the worker keeps going and the result stays Success.

    Our step() lets the exception out; run() is the layer that recovers (as doProbe's deferred
    recover), so the row is driven through run().
    """
    h = KubeletWorker(ProbeKind.READINESS)
    h.view = h.running_status()
    seen: list[Published | None] = []

    async def crashing_after_first(_view: ContainerView) -> ProbeOutcome:
        h.exec_calls += 1
        seen.append(h.get())
        if h.exec_calls == 2:
            raise RuntimeError("crashingExecProber")
        if h.exec_calls == 3:
            h.worker.stop()
        return ProbeOutcome(ProbeResult.SUCCESS, "ok")

    h.runner = crashing_after_first
    await asyncio.wait_for(h.worker.run(), HANG_GUARD)
    # Call 3 happened: the worker kept going after the crash; before it the result was Success.
    assert h.exec_calls == 3
    assert seen == [Published.FAILURE, Published.SUCCESS, Published.SUCCESS]
    assert [u.result for u in h.updates] == [Published.FAILURE, Published.SUCCESS]


# -- TestOnHoldOnLivenessOrStartupCheckFailure (and the old TestOnHoldOnLivenessCheckFailure) -----


@pytest.mark.parametrize(
    "kind", [ProbeKind.LIVENESS, ProbeKind.STARTUP], ids=["liveness", "startup"]
)
async def test_on_hold_on_liveness_or_startup_check_failure(
    kind: ProbeKind, kubelet: KubeletProfile
) -> None:
    """worker_test.go TestOnHoldOnLivenessOrStartupCheckFailure (liveness also
    TestOnHoldOnLivenessCheckFailure): S=F=1. Failure → on hold; Success while on hold → still
    Failure; new container ID → Success, hold lifted for liveness; for startup kept from 1.32
    (PR #121206: a startup success holds too), lifted before (release-1.28's test: "Prober
    should not be on hold anymore")."""
    h = KubeletWorker(kind, Timing(success_threshold=1, failure_threshold=1))
    h.view = h.running_status()
    h.exec_result = ProbeResult.FAILURE
    await h.expect(Published.FAILURE, "first probe")
    assert h.worker.on_hold
    h.exec_result = ProbeResult.SUCCESS
    await h.expect(Published.FAILURE, "while on hold")
    assert h.worker.on_hold
    assert h.exec_calls == 1
    h.view = replace(h.view, id=NEW_CONTAINER_ID)
    assert await h.do_probe()
    assert h.get(NEW_CONTAINER_ID) is Published.SUCCESS, "hold lifted"
    assert h.worker.on_hold is (kind is ProbeKind.STARTUP and kubelet.at_least(32))


# -- TestResultRunOnLivenessCheckFailure / TestResultRunOnStartupCheckFailure ----------------------


async def test_result_run_on_liveness_check_failure() -> None:
    """worker_test.go TestResultRunOnLivenessCheckFailure: liveness S=1 F=3: Success/1,
    Failure → Success/1, Failure → Success/2, Failure → Failure/0."""
    h = KubeletWorker(ProbeKind.LIVENESS, Timing(success_threshold=1, failure_threshold=3))
    h.view = h.running_status()
    steps = [
        (ProbeResult.SUCCESS, Published.SUCCESS, 1),
        (ProbeResult.FAILURE, Published.SUCCESS, 1),
        (ProbeResult.FAILURE, Published.SUCCESS, 2),
        (ProbeResult.FAILURE, Published.FAILURE, 0),
    ]
    for i, (exec_result, published, run) in enumerate(steps):
        h.exec_result = exec_result
        await h.expect(published, f"probe {i + 1}")
        assert h.worker.result_run == run, f"probe {i + 1}: resultRun"


async def test_result_run_on_startup_check_failure() -> None:
    """worker_test.go TestResultRunOnStartupCheckFailure: startup S=1 F=3, not started, exec
    Failure ×3: Unknown/1, Unknown/2, Failure/0."""
    h = KubeletWorker(ProbeKind.STARTUP, Timing(success_threshold=1, failure_threshold=3))
    h.view = h.running_status(started=False)
    h.exec_result = ProbeResult.FAILURE
    for i, (published, run) in enumerate(
        [(Published.UNKNOWN, 1), (Published.UNKNOWN, 2), (Published.FAILURE, 0)]
    ):
        await h.expect(published, f"probe {i + 1}")
        assert h.worker.result_run == run, f"probe {i + 1}: resultRun"


@pytest.mark.parametrize("hold_failures", [True, False], ids=["held", "report-mode"])
async def test_result_run_starts_at_zero_for_a_new_container(hold_failures: bool) -> None:
    """worker.go (v1.28) doProbe: a published liveness Failure sets ``onHold = true`` and
    ``resultRun = 0``; a new container ID then only clears ``onHold``. So the replacement's run
    starts at 0 and needs the whole failureThreshold again. cri-prober's report mode (no hold,
    issue 34 item 4) keeps probing the failed container, and used to carry that run (3, 4, 5)
    over: the new container's first failure was published at once."""
    h = KubeletWorker(
        ProbeKind.LIVENESS,
        Timing(success_threshold=1, failure_threshold=3),
        hold_failures=hold_failures,
    )
    h.view = h.running_status()
    h.exec_result = ProbeResult.FAILURE
    for i, published in enumerate([Published.SUCCESS, Published.SUCCESS, Published.FAILURE]):
        await h.expect(published, f"probe {i + 1}")
    await h.expect(Published.FAILURE, "a 4th failure (probed only without the hold)")
    assert h.worker.on_hold is hold_failures
    h.view = replace(h.view, id=NEW_CONTAINER_ID)
    for i, published in enumerate([Published.SUCCESS, Published.SUCCESS, Published.FAILURE]):
        assert await h.do_probe()
        assert h.get(NEW_CONTAINER_ID) is published, f"new container, failure {i + 1}"
        assert h.worker.result_run == (0 if i == 2 and hold_failures else i + 1)


@pytest.mark.parametrize("hold_failures", [True, False], ids=["held", "report-mode"])
async def test_startup_result_run_starts_at_zero_for_a_new_container(hold_failures: bool) -> None:
    """worker.go (v1.28): a published startup Failure holds and zeroes ``resultRun`` too; the
    next container needs failureThreshold failures again, held or not."""
    h = KubeletWorker(
        ProbeKind.STARTUP,
        Timing(success_threshold=1, failure_threshold=2),
        hold_failures=hold_failures,
    )
    h.view = h.running_status(started=False)
    h.exec_result = ProbeResult.FAILURE
    for i, published in enumerate([Published.UNKNOWN, Published.FAILURE, Published.FAILURE]):
        await h.expect(published, f"probe {i + 1}")
    h.view = replace(h.view, id=NEW_CONTAINER_ID)
    assert await h.do_probe()
    assert h.get(NEW_CONTAINER_ID) is Published.UNKNOWN, "one failure of the new container"
    assert h.worker.result_run == 1


async def test_readiness_run_still_survives_a_new_container() -> None:
    """worker.go (v1.28): readiness never holds, so its run survives a new container ID (the
    §3.4 quirk) in report mode as in the kubelet: only a run a hold zeroed starts over."""
    h = KubeletWorker(
        ProbeKind.READINESS, Timing(success_threshold=1, failure_threshold=3), hold_failures=False
    )
    h.view = h.running_status()
    h.exec_result = ProbeResult.FAILURE
    for i, published in enumerate([Published.FAILURE] * 3):
        await h.expect(published, f"probe {i + 1}")
    h.view = replace(h.view, id=NEW_CONTAINER_ID)
    assert await h.do_probe()
    assert h.worker.result_run == 4


# -- TestLivenessProbeDisabledByStarted / TestStartupProbeDisabledByStarted ------------------------


async def test_liveness_probe_disabled_by_started() -> None:
    """worker_test.go TestLivenessProbeDisabledByStarted: liveness S=F=1, not started: a failing
    exec leaves Success (gated); after SetContainerStartup(true) it publishes Failure."""
    h = KubeletWorker(ProbeKind.LIVENESS, Timing(success_threshold=1, failure_threshold=1))
    h.view = h.running_status(started=False)
    h.exec_result = ProbeResult.FAILURE
    await h.expect(Published.SUCCESS, "not started: liveness gated")
    assert h.exec_calls == 0
    h.view = replace(h.view, started=True)
    await h.expect(Published.FAILURE, "started: liveness probes")


async def test_startup_probe_disabled_by_started() -> None:
    """worker_test.go TestStartupProbeDisabledByStarted: startup S=1 F=2, not started:
    Failure → Unknown; Success → Success; after SetContainerStartup(true) Failure → Success."""
    h = KubeletWorker(ProbeKind.STARTUP, Timing(success_threshold=1, failure_threshold=2))
    h.view = h.running_status(started=False)
    h.exec_result = ProbeResult.FAILURE
    await h.expect(Published.UNKNOWN, "one failure")
    h.exec_result = ProbeResult.SUCCESS
    await h.expect(Published.SUCCESS, "success")
    h.view = replace(h.view, started=True)
    h.exec_result = ProbeResult.FAILURE
    await h.expect(Published.SUCCESS, "started: startup no longer probes")
    assert h.exec_calls == 2


# -- Rows that changed between kubelet releases (docs/kubelet-fidelity.md, "Kubelet releases") ---


async def test_manual_trigger_and_the_ticker(kubelet: KubeletProfile) -> None:
    """worker.go run(): a manual trigger (the pod sync's readiness trigger at a container's
    start, or TriggerProbe) runs a step at once. From 1.32 (PR #119089: ``probeTicker.Reset``
    in the ``manualTriggerCh`` case) the next tick comes a full period after it; release-1.28's
    select only continues, so the ticks keep the grid they had."""
    h = KubeletWorker(ProbeKind.READINESS, Timing(period_seconds=10))
    h.view = h.running_status()
    times: list[float] = []

    async def runner(_view: ContainerView) -> ProbeOutcome:
        times.append(h.clock.now)
        if len(times) == 1:
            h.clock.now = 4.0
            h.worker.trigger()
        elif len(times) == 3:
            h.worker.stop()
        return ProbeOutcome(ProbeResult.SUCCESS, "ok")

    h.runner = runner
    await asyncio.wait_for(h.worker.run(), timeout=60)
    assert times == [0.0, 4.0, 14.0 if kubelet.at_least(32) else 10.0]


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
async def test_a_container_that_predates_the_kubelet_keeps_its_state(
    kind: ProbeKind, kubelet: KubeletProfile
) -> None:
    """worker.go doProbe, new container ID: from 1.35 (KEP-4781, PR #134746, with
    ChangeContainerStatusOnKubeletRestart off, its default) a running container that started
    more than 10 s before the kubelet gets no initial value (isRestart); release-1.28 sets the
    initial value for every new container ID, so after a restart readiness is Failure until
    its first probe."""
    h = KubeletWorker(kind, Timing(initial_delay_seconds=3600), prober_started_at=WALL0)
    view = h.running_status()
    h.view = replace(view, started_at=WALL0 - RESTART_GRACE_SECONDS - 50)
    assert await h.do_probe()
    assert h.get() is (None if kubelet.at_least(35) else INITIAL[kind])
    assert h.exec_calls == 0  # still in its initial delay
    # A container started since (within the grace) always gets it.
    h.view = replace(view, id=NEW_CONTAINER_ID, started_at=WALL0 - 5)
    assert await h.do_probe()
    assert h.get(NEW_CONTAINER_ID) is INITIAL[kind]


async def test_change_container_status_on_kubelet_restart_restores_the_initial_value() -> None:
    """KEP-4781's deprecated gate ChangeContainerStatusOnKubeletRestart (1.35, off by default):
    on, the kubelet publishes the initial value after its restart again, as before 1.35."""
    profile = KubeletProfile.parse("1.35", "ChangeContainerStatusOnKubeletRestart=true")
    KubeletWorker.kubelet = profile
    h = KubeletWorker(
        ProbeKind.READINESS, Timing(initial_delay_seconds=3600), prober_started_at=WALL0
    )
    h.view = replace(h.running_status(), started_at=WALL0 - 60)
    assert await h.do_probe()
    assert h.get() is Published.FAILURE
