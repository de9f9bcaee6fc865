"""Pod syncs: the kubelet's pod workers, as far as probe results go (§3.8, §5.2).

A sync is requested after a result changes or a discovery event touches a pod, and runs once,
soon, coalesced; every pod is also synced again ``POD_RESYNC_SECONDS`` (jittered) after its last
sync, or after a back-off when its sync failed. The clock that runs due resyncs is a supervised
task that exists only while pods do.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import random
import time
from collections.abc import Callable
from typing import Protocol

from cri_prober.aio import Supervisor

# The kubelet's pod workers sync every pod again this long after its last sync, stretched by up
# to half (pod_workers.go resyncInterval and its jitter), and retry a failed sync (such as a kill
# that failed) after the back-off period, stretched the same way. §3.8, §5.2.
POD_RESYNC_SECONDS = 60.0
SYNC_BACKOFF_SECONDS = 10.0
SYNC_JITTER = 0.5
# How often the resync clock checks for pods due (the kubelet's syncCh ticks every second).
RESYNC_TICK_SECONDS = 1.0
RESYNC_TASK = "pod-resync"  # the supervised task's name


class PodIndex(Protocol):
    """Which pods have a probed container (``SlotTable`` answers it)."""

    def __len__(self) -> int: ...
    def has_pod(self, pod_uid: str) -> bool: ...
    def pods(self) -> list[str]: ...


class PodSyncs:
    """Runs ``sync_pod`` for pods that asked for it, and for every pod once a resync is due."""

    def __init__(
        self,
        sync_pod: Callable[[str], None],
        slots: PodIndex,
        *,
        supervisor: Supervisor,
        rng: random.Random,
    ) -> None:
        self._sync_pod = sync_pod
        self._slots = slots
        self._supervisor = supervisor
        self._rng = rng
        self._requested: set[str] = set()
        self._next_resync: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []
        self.closed = False  # shut down: the clock does not start again

    def request(self, pod_uid: str) -> None:
        """Sync the pod soon (coalesced), as the kubelet's pod worker would after an update."""
        if not self._slots.has_pod(pod_uid):
            return
        if not self._requested:
            # In a fresh context: not in that of the worker (or source) that asked first, whose
            # log bindings would label every pod's sync.
            asyncio.get_running_loop().call_soon(self._run_requested, context=contextvars.Context())
        self._requested.add(pod_uid)

    def sync(self, pod_uid: str) -> None:
        """Sync the pod now, and schedule its next resync."""
        if not self._slots.has_pod(pod_uid):
            return
        self._sync_pod(pod_uid)
        self.schedule(pod_uid)

    def schedule(self, pod_uid: str, delay: float | None = None) -> None:
        """Resync the pod after ``delay`` (default: the regular resync period), jittered."""
        if delay is None:
            delay = POD_RESYNC_SECONDS
        due = time.monotonic() + delay * (1 + self._rng.random() * SYNC_JITTER)
        self._next_resync[pod_uid] = due
        heapq.heappush(self._heap, (due, pod_uid))
        if not self.closed and not self._supervisor.running(RESYNC_TASK):
            # It ends when the node has no pods left (returning is its normal end), and the
            # next pod starts it again.
            self._supervisor.start(RESYNC_TASK, self._resync_loop, policy="restart", forever=False)

    def retry_later(self, pod_uid: str) -> None:
        """The pod's sync failed (a stop that failed): sync it again after the back-off."""
        self.schedule(pod_uid, SYNC_BACKOFF_SECONDS)

    def forget(self, pod_uid: str) -> None:
        """The pod has no probed container left: no more resyncs for it."""
        self._next_resync.pop(pod_uid, None)

    async def _resync_loop(self) -> None:
        """Sync every pod again when its resync (or back-off after a failed stop) is due."""
        self._rearm()
        while len(self._slots):
            await asyncio.sleep(RESYNC_TICK_SECONDS)
            now = time.monotonic()
            heap = self._heap
            while heap and heap[0][0] <= now:
                due, pod_uid = heapq.heappop(heap)
                if self._next_resync.get(pod_uid) == due:
                    self.sync(pod_uid)
        # No pods left: end, and let the next pod start the clock again.
        self._heap.clear()

    def _rearm(self) -> None:
        """(Re)starting: a pod whose resync was due, or was being run when the loop failed, gets
        the next regular one, so one pod's failing sync cannot hold up the others'."""
        now = time.monotonic()
        for pod_uid in self._slots.pods():
            due = self._next_resync.get(pod_uid)
            if due is None or due <= now:
                self.schedule(pod_uid)

    def _run_requested(self) -> None:
        pods, self._requested = self._requested, set()
        for pod_uid in pods:
            self.sync(pod_uid)
