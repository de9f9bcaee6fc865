"""The current-state metrics alerts read: containers ready and started, a probe's failures in a
row, and the time from a container's start to its probe's first success (issue 24)."""

from __future__ import annotations

import dataclasses

import pytest

from cri_prober.discovery.model import ContainerInfo
from cri_prober.manager.events import AttemptFinished, ContainerGone, ResultChanged, WorkerStopped
from cri_prober.manager.state import Health
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.results import ProbeRecord, Published
from cri_prober.serving.metrics import Metrics
from tests.unit.slots import make_slot

CONTAINER = {"container": "app", "pod": "web-0", "namespace": "shop", "pod_uid": "uid-1"}
LIVENESS = {"probe_type": "Liveness", "container": "app", "pod": "web-0", "namespace": "shop"}
NOW = 1_000_000.0  # the metrics' wall clock, seconds


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


@pytest.fixture(name="clock")
def _clock() -> Clock:
    return Clock()


@pytest.fixture(name="metrics")
def _metrics(clock: Clock) -> Metrics:
    return Metrics(wall=clock)


def started(seconds: float, *, container_id: str = "id-app") -> ContainerInfo:
    """The container ``shop/web-0/app``, started at ``seconds`` on the metrics' clock."""
    return dataclasses.replace(
        make_slot().container, id=container_id, started_at=int(seconds * 1e9)
    )


def attempt(metrics: Metrics, container: ContainerInfo, kind: ProbeKind, result: str) -> None:
    record = ProbeRecord(container.id, 0.0, 0.1, result, "")
    metrics.manager_event(AttemptFinished(container, kind, record))


def changed(
    metrics: Metrics,
    container: ContainerInfo,
    kind: ProbeKind,
    result: Published,
    *,
    health: Health,
    consecutive: int = 1,
) -> None:
    metrics.manager_event(ResultChanged(container, kind, None, result, consecutive, "", health))


def sample(metrics: Metrics, name: str, labels: dict[str, str]) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


READY = Health(running=True, started=True, ready=True, live=True)
STARTING = Health(running=True, started=False, ready=False, live=True)


class TestContainerGauges:
    def test_ready_and_started_follow_the_published_health(self, metrics: Metrics) -> None:
        container = started(NOW)
        changed(metrics, container, ProbeKind.STARTUP, Published.UNKNOWN, health=STARTING)
        assert sample(metrics, "cri_prober_container_ready", CONTAINER) == 0.0
        assert sample(metrics, "cri_prober_container_started", CONTAINER) == 0.0
        changed(metrics, container, ProbeKind.READINESS, Published.SUCCESS, health=READY)
        assert sample(metrics, "cri_prober_container_ready", CONTAINER) == 1.0
        assert sample(metrics, "cri_prober_container_started", CONTAINER) == 1.0

    def test_a_restated_result_moves_only_the_gauges(self, metrics: Metrics) -> None:
        """Issue 34 (9): an exit no probe publishes comes as its held result restated (previous
        = result): the gauges follow, no transition is counted, the probe stays held."""
        container = started(NOW)
        held = ResultChanged(
            container,
            ProbeKind.LIVENESS,
            Published.SUCCESS,
            Published.FAILURE,
            1,
            "",
            READY,
            held=True,
        )
        metrics.manager_event(held)
        exited = Health(running=False, started=False, ready=False, live=False)
        metrics.manager_event(
            ResultChanged(
                container,
                ProbeKind.LIVENESS,
                Published.FAILURE,
                Published.FAILURE,
                0,
                "",
                exited,
                reason="not-running",
            )
        )
        assert sample(metrics, "cri_prober_container_ready", CONTAINER) == 0.0
        assert sample(metrics, "cri_prober_container_started", CONTAINER) == 0.0
        failures = {**LIVENESS, "result": "failure"}
        assert sample(metrics, "cri_prober_probe_transitions_total", failures) == 1.0
        assert sample(metrics, "cri_prober_probe_on_hold", LIVENESS) == 1.0

    def test_the_series_go_with_the_container(self, metrics: Metrics) -> None:
        container = started(NOW)
        changed(metrics, container, ProbeKind.READINESS, Published.SUCCESS, health=READY)
        metrics.manager_event(ContainerGone(container))
        assert sample(metrics, "cri_prober_container_ready", CONTAINER) is None
        assert sample(metrics, "cri_prober_container_started", CONTAINER) is None

    def test_a_restart_replaces_the_containers_values(self, metrics: Metrics) -> None:
        """The gauges are per container slot (pod, name): a restarted container's attempt takes
        the series over."""
        changed(metrics, started(NOW), ProbeKind.READINESS, Published.SUCCESS, health=READY)
        restarted = started(NOW + 60, container_id="id-app-2")
        changed(metrics, restarted, ProbeKind.READINESS, Published.FAILURE, health=STARTING)
        assert sample(metrics, "cri_prober_container_ready", CONTAINER) == 0.0
        text = metrics.exposition().decode()
        assert text.count("cri_prober_container_ready{") == 1


class TestConsecutiveFailures:
    NAME = "cri_prober_probe_consecutive_failures"

    def test_counts_failures_in_a_row_and_resets_on_success(self, metrics: Metrics) -> None:
        container = started(NOW)
        for result in ("failure", "unknown", "error"):  # an errored attempt counts for nothing
            attempt(metrics, container, ProbeKind.LIVENESS, result)
        assert sample(metrics, self.NAME, LIVENESS) == 2.0
        attempt(metrics, container, ProbeKind.LIVENESS, "warning")
        assert sample(metrics, self.NAME, LIVENESS) == 0.0

    def test_a_held_liveness_probe_keeps_its_count(self, metrics: Metrics) -> None:
        """The worker resets its run when it goes on hold; the gauge keeps the failures that put
        it there, as long as no attempt and no new container says otherwise."""
        container = started(NOW)
        for _ in range(3):
            attempt(metrics, container, ProbeKind.LIVENESS, "failure")
        failing = dataclasses.replace(READY, live=False)
        changed(metrics, container, ProbeKind.LIVENESS, Published.FAILURE, health=failing)
        assert sample(metrics, self.NAME, LIVENESS) == 3.0

    def test_a_restarted_container_starts_at_zero(self, metrics: Metrics) -> None:
        container = started(NOW)
        for _ in range(3):
            attempt(metrics, container, ProbeKind.LIVENESS, "failure")
        restarted = started(NOW + 30, container_id="id-app-2")
        # The worker publishes the new container's initial value (no attempt published it).
        changed(
            metrics, restarted, ProbeKind.LIVENESS, Published.SUCCESS, health=READY, consecutive=0
        )
        assert sample(metrics, self.NAME, LIVENESS) == 0.0
        attempt(metrics, restarted, ProbeKind.LIVENESS, "failure")
        assert sample(metrics, self.NAME, LIVENESS) == 1.0

    def test_the_series_goes_with_the_worker(self, metrics: Metrics) -> None:
        container = started(NOW)
        attempt(metrics, container, ProbeKind.LIVENESS, "failure")
        metrics.manager_event(WorkerStopped(container, ProbeKind.LIVENESS, replaced=False))
        assert sample(metrics, self.NAME, LIVENESS) is None


class TestTimeToFirstSuccess:
    NAME = "cri_prober_probe_time_to_first_success_seconds"

    def count(self, metrics: Metrics, probe_type: str, le: str = "+Inf") -> float | None:
        labels = {"probe_type": probe_type, "le": le}
        return sample(metrics, f"{self.NAME}_bucket", labels)

    def test_readiness_from_start_to_its_first_published_success(
        self, metrics: Metrics, clock: Clock
    ) -> None:
        container = started(NOW + 10)
        clock.now = NOW + 10
        # The initial value (no attempt) and a failure are not a success.
        changed(metrics, container, ProbeKind.READINESS, Published.FAILURE, health=STARTING)
        clock.now = NOW + 17
        changed(metrics, container, ProbeKind.READINESS, Published.SUCCESS, health=READY)
        clock.now = NOW + 100
        changed(metrics, container, ProbeKind.READINESS, Published.SUCCESS, health=READY)
        assert self.count(metrics, "Readiness") == 1.0
        assert self.count(metrics, "Readiness", "5.0") == 0.0
        assert self.count(metrics, "Readiness", "10.0") == 1.0
        assert sample(metrics, f"{self.NAME}_sum", {"probe_type": "Readiness"}) == 7.0

    def test_liveness_at_its_first_successful_attempt(self, metrics: Metrics, clock: Clock) -> None:
        """Liveness starts out published as success: its first successful attempt counts."""
        container = started(NOW)
        changed(
            metrics, container, ProbeKind.LIVENESS, Published.SUCCESS, health=READY, consecutive=0
        )
        clock.now = NOW + 2
        attempt(metrics, container, ProbeKind.LIVENESS, "failure")
        clock.now = NOW + 3
        attempt(metrics, container, ProbeKind.LIVENESS, "success")
        attempt(metrics, container, ProbeKind.LIVENESS, "success")
        assert self.count(metrics, "Liveness") == 1.0
        assert sample(metrics, f"{self.NAME}_sum", {"probe_type": "Liveness"}) == 3.0

    def test_each_container_once_and_none_that_predate_cri_prober(
        self, metrics: Metrics, clock: Clock
    ) -> None:
        clock.now = NOW + 5
        old = started(NOW - 3600)  # adopted at startup: its first success was long ago
        changed(metrics, old, ProbeKind.READINESS, Published.SUCCESS, health=READY)
        assert self.count(metrics, "Readiness") in (None, 0.0)
        restarted = started(NOW + 1, container_id="id-app-2")
        changed(metrics, restarted, ProbeKind.READINESS, Published.SUCCESS, health=READY)
        assert self.count(metrics, "Readiness") == 1.0


def test_attempts_by_reason_count_the_nodes_attempts_without_container_labels(
    metrics: Metrics,
) -> None:
    """Issue 24: why this node's probes fail, in a handful of series."""
    app, other = started(NOW - 10), started(NOW - 10, container_id="id-other")
    for container, reason in ((app, "timeout"), (other, "timeout"), (app, "ok")):
        record = ProbeRecord(container.id, 0.0, 0.1, "failure", "", reason=reason)
        metrics.manager_event(AttemptFinished(container, ProbeKind.READINESS, record))
    timeouts = metrics.registry.get_sample_value(
        "cri_prober_probe_attempts_by_reason_total",
        {"probe_type": "Readiness", "reason": "timeout"},
    )
    assert timeouts == 2.0
    ok = metrics.registry.get_sample_value(
        "cri_prober_probe_attempts_by_reason_total", {"probe_type": "Readiness", "reason": "ok"}
    )
    assert ok == 1.0


def test_on_hold_is_present_only_while_held(metrics: Metrics) -> None:
    """Issue 24: on hold until the container restarts shows in /metrics too."""
    container = started(NOW - 10)
    failing = Health(running=True, started=True, ready=True, live=False)
    metrics.manager_event(
        ResultChanged(
            container, ProbeKind.LIVENESS, Published.SUCCESS, Published.FAILURE, 3, "", failing,
            reason="exit-code", threshold=3, held=True,
        )
    )  # fmt: skip
    assert sample(metrics, "cri_prober_probe_on_hold", LIVENESS) == 1.0
    assert b"cri_prober_probe_on_hold{" in metrics.exposition()
    restarted = dataclasses.replace(container, id="id-app-2")
    changed(metrics, restarted, ProbeKind.LIVENESS, Published.SUCCESS, health=READY, consecutive=0)
    assert sample(metrics, "cri_prober_probe_on_hold", LIVENESS) is None
