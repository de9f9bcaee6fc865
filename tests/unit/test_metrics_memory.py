"""What the per-worker series keep (issue 36, goal 4): at 5,000 containers the series were about
a KiB per probe worker, 9.7 MiB in all (tracemalloc). A steady probe's series keeps what its
exposition needs and no second copy of it; the exposition itself is tested in test_metrics."""

from __future__ import annotations

import tracemalloc

from cri_prober.discovery.model import ContainerInfo
from cri_prober.manager.events import AttemptFinished, ResultChanged
from cri_prober.manager.state import Health
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.results import ProbeRecord, Published
from cri_prober.serving.metrics import Metrics
from cri_prober.serving.metrics_series import LE_VALUES, HistogramSeries
from tests.unit.slots import make_slot

WORKERS = 1_000
HEALTH = Health(running=True, started=True, ready=True, live=True)


def _steady(metrics: Metrics, container: ContainerInfo, kind: ProbeKind) -> None:
    """A probe's first published success and twenty attempts like it, a few ms each."""
    metrics.manager_event(ResultChanged(container, kind, None, Published.SUCCESS, 1, "", HEALTH))
    for attempt in range(20):
        record = ProbeRecord(container.id, 10.0 * attempt, 0.003, "success", "")
        metrics.manager_event(AttemptFinished(container, kind, record))


def test_a_steady_probes_series_is_small() -> None:
    containers = [make_slot(f"app-{index}").container for index in range(WORKERS)]
    metrics = Metrics()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for container in containers:
            _steady(metrics, container, ProbeKind.READINESS)
            _steady(metrics, container, ProbeKind.LIVENESS)
        per_worker = (tracemalloc.get_traced_memory()[0] - before) / (2 * WORKERS)
    finally:
        tracemalloc.stop()
    print(f"{per_worker:.0f} bytes per worker")
    assert per_worker < 1_000  # 1,234 before (Python 3.11), 911 after


def test_a_histogram_keeps_the_buckets_it_used_and_reads_whole() -> None:
    histogram = HistogramSeries()
    assert histogram.counts == [0] * len(LE_VALUES)
    histogram.observe(0.003)
    histogram.observe(0.004)
    assert histogram.counts == [2] + [0] * (len(LE_VALUES) - 1)
    histogram.observe(0.3)  # the 0.5 bucket
    histogram.observe(99.0)  # +Inf
    counts = histogram.counts
    assert counts[0] == 2
    assert counts[LE_VALUES.index("0.5")] == 1
    assert counts[-1] == 1
    assert sum(counts) == 4
    assert len(counts) == len(LE_VALUES)
    assert histogram.total == 0.003 + 0.004 + 0.3 + 99.0
