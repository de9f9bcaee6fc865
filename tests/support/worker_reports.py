"""A ``WorkerObserver`` that keeps everything a probe worker reports, for tests of workers."""

from __future__ import annotations

import asyncio

from cri_prober.probing.results import ProbeRecord, ResultUpdate
from cri_prober.probing.worker import ProbeWorker


class WorkerReports:
    """Every attempt, result change and stop a worker reported, in order; ``changed`` is set on
    each report (clear it before awaiting the next)."""

    def __init__(self) -> None:
        self.attempts: list[ProbeRecord] = []
        self.updates: list[ResultUpdate] = []
        self.stopped: list[ProbeWorker] = []
        self.changed = asyncio.Event()

    def attempt_finished(self, worker: ProbeWorker, record: ProbeRecord) -> None:
        self.attempts.append(record)
        self.changed.set()

    def result_changed(self, worker: ProbeWorker, update: ResultUpdate) -> None:
        self.updates.append(update)
        self.changed.set()

    def worker_stopped(self, worker: ProbeWorker) -> None:
        self.stopped.append(worker)
        self.changed.set()
