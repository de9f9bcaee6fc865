"""Exec probes that hang past their timeout stay bounded and do not delay anyone else's probes.

Two ways an exec probe outlives ``timeoutSeconds`` on real containerd:

- ``sleep 60``: the runtime kills it at the timeout and answers DEADLINE_EXCEEDED (~1.05 s).
- ``sh -c 'sleep 60 &'``: the shell exits at once, but the background ``sleep`` keeps the exec's
  stdout open, and containerd waits for it instead of answering (containerd#9568): only the
  client's own deadline (timeout + ``exec_deadline_margin``) ends the call.

Execs share a node-wide cap (``max_concurrent_execs``), so hanging ones also occupy slots that
healthy probes need: the tests measure how late a healthy container's probes get meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from cri_prober.probing.handlers.exec import probe_exec
from cri_prober.probing.outcome import ProbeResult
from cri_prober.probing.results import ProbeRecord
from cri_prober.probing.spec import ProbeKind, RulesFile
from cri_prober.runtime.client import (
    DEFAULT_EXEC_DEADLINE_MARGIN,
    DEFAULT_MAX_CONCURRENT_EXECS,
    CriCall,
    CriClient,
)
from tests.reliability.support import percentile, probe_task_names, slots_by_pod
from tests.support.daemon import running_daemon
from tests.support.testbed import ContainerSpec, PodFactory, Testbed

TIMEOUT = 1
# What a hanging exec may take: the client deadline, plus scheduling slack on a busy 2-core box.
EXEC_BOUND = TIMEOUT + DEFAULT_EXEC_DEADLINE_MARGIN + 0.5
CAP = DEFAULT_MAX_CONCURRENT_EXECS
BACKGROUND = ["sh", "-c", "sleep 60 &"]  # containerd#9568: holds stdout, the runtime waits
FOREGROUND = ["sleep", "60"]  # the runtime kills it at the timeout

RULES = f"""
probes:
  - match: {{namespace: default, pod: "hang-bg-*", container: app}}
    readinessProbe:
      exec: {{command: [sh, -c, "sleep 60 &"]}}
      timeoutSeconds: {TIMEOUT}
      periodSeconds: 1
  - match: {{namespace: default, pod: "hang-fg-*", container: app}}
    readinessProbe:
      exec: {{command: [sleep, "60"]}}
      timeoutSeconds: {TIMEOUT}
      periodSeconds: 1
  - match: {{namespace: default, pod: "steady-*", container: app}}
    readinessProbe:
      exec: {{command: ["true"]}}
      periodSeconds: 1
    livenessProbe:
      tcpSocket: {{port: 8080}}
      periodSeconds: 1
"""
SLEEPER = ContainerSpec("app")
HTTPD = ContainerSpec("app", command=["httpd", "-f", "-p", "8080", "-h", "/"])


class InFlight:
    """Tracks the highest ``execs_in_flight`` a client reached, sampled every 5 ms."""

    def __init__(self, cri: CriClient) -> None:
        self.cri = cri
        self.highest = 0
        self._task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        while True:
            self.highest = max(self.highest, self.cri.execs_in_flight)
            await asyncio.sleep(0.005)

    async def __aenter__(self) -> InFlight:
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def timed_probe(cri: CriClient, container_id: str, command: list[str]) -> tuple[float, bool]:
    """Run one exec probe; return how long it took and whether it was a timeout failure."""
    started = time.monotonic()
    outcome = await probe_exec(cri, container_id, command, timeout=TIMEOUT)
    return time.monotonic() - started, (outcome.result is ProbeResult.FAILURE and outcome.timed_out)


async def test_hanging_execs_are_bounded_and_never_pile_up(
    testbed_16: Testbed, pods_16: PodFactory
) -> None:
    """Rounds of hanging exec probes: each ends within timeout + margin, the slot count holds.

    Round 1 runs as many hanging probes as there are exec slots, round 2 twice as many (half of
    them must queue for a slot, so the round takes two deadlines, and each exec call inside its
    slot still ends in one). Between rounds nothing is left in flight, and a healthy exec still
    runs at normal speed afterwards.
    """
    pod = await pods_16.create_pod("hang-direct", containers=[SLEEPER])
    cid = pod.container_ids["app"]
    calls: list[tuple[str, str, float]] = []

    def on_call(call: CriCall) -> None:
        calls.append((call.method, call.code, call.seconds))

    async with CriClient.connect(testbed_16.endpoint) as cri:
        cri.calls.subscribe(on_call)
        await cri.version()
        tasks_before = len(asyncio.all_tasks())
        for round_size in (CAP, 2 * CAP):
            calls.clear()
            commands = [BACKGROUND if i % 2 else FOREGROUND for i in range(round_size)]
            started = time.monotonic()
            async with InFlight(cri) as in_flight:
                results = await asyncio.gather(*(timed_probe(cri, cid, c) for c in commands))
            elapsed = time.monotonic() - started
            assert all(timed_out for _, timed_out in results), results
            queued_rounds = -(-round_size // CAP)  # ceil: rounds of slots this many need
            assert max(d for d, _ in results) <= queued_rounds * EXEC_BOUND, results
            assert elapsed <= queued_rounds * EXEC_BOUND
            # Inside its slot, every single ExecSync ended within the deadline.
            exec_calls = [c for c in calls if c[0] == "ExecSync"]
            assert len(exec_calls) == round_size
            assert all(code == "DEADLINE_EXCEEDED" for _, code, _ in exec_calls), exec_calls
            assert max(seconds for _, _, seconds in exec_calls) <= EXEC_BOUND, exec_calls
            # The background ones hung past the runtime's timeout: only our deadline ended them.
            assert sum(seconds > TIMEOUT + 1 for _, _, seconds in exec_calls) >= round_size // 2
            assert in_flight.highest <= CAP
            assert in_flight.highest == min(round_size, CAP)
            assert cri.execs_in_flight == 0
            assert len(asyncio.all_tasks()) == tasks_before

        started = time.monotonic()
        healthy = await probe_exec(cri, cid, ["true"], timeout=TIMEOUT)
        assert healthy.result is ProbeResult.SUCCESS
        assert time.monotonic() - started < 1.0


def lateness(records: list[ProbeRecord], period: float) -> tuple[list[float], int]:
    """How late each attempt's verdict came relative to its tick, and how many ticks were skipped.

    The worker's ticks lie on a grid anchored at its first attempt; an attempt is late by how far
    its start strayed from its grid point plus how long it took (a queued exec shows up there).
    """
    first = records[0].started_at
    lates: list[float] = []
    ticks: list[int] = []
    for record in records:
        tick = round((record.started_at - first) / period)
        ticks.append(tick)
        lates.append(max(0.0, record.started_at - (first + tick * period)) + record.duration)
    skipped = (ticks[-1] - ticks[0] + 1) - len(set(ticks))
    return lates, skipped


async def test_healthy_probes_stay_on_schedule_while_eight_execs_hang(
    testbed_16: Testbed, pods_16: PodFactory, tmp_path: Path
) -> None:
    """8 containers whose exec probes hang (4 of each kind) beside one healthy container.

    The healthy container's exec probe competes with the hanging ones for the 8 exec slots: its
    verdicts may queue but stay within 1.5 s of their tick (p99), and its tcp probe, which needs
    no slot, stays within 0.5 s. Every hanging exec ends within timeout + margin inside its slot,
    execs in flight never exceed the cap, and when the probes go away nothing is left in flight.
    """
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(RULES)
    hanging = [f"hang-bg-{i}" for i in range(4)] + [f"hang-fg-{i}" for i in range(4)]
    await asyncio.gather(*(pods_16.create_pod(name, containers=[SLEEPER]) for name in hanging))
    await pods_16.create_pod("steady-0", host_network=False, containers=[HTTPD])

    exec_calls: list[float] = []
    highest = 0

    async with running_daemon(testbed_16.endpoint, rules_file, relist_period=0.5) as (
        daemon,
        watcher,
    ):

        def on_call(call: CriCall) -> None:
            nonlocal highest
            if call.method == "ExecSync":
                exec_calls.append(call.seconds)
            highest = max(highest, daemon.cri.execs_in_flight)

        def on_probe(*_args: object) -> None:
            nonlocal highest
            highest = max(highest, daemon.cri.execs_in_flight)

        daemon.cri.calls.subscribe(on_call)
        watcher.on_probe.append(on_probe)

        def steady_records(kind: ProbeKind) -> list[ProbeRecord]:
            slot = slots_by_pod(daemon, "steady-").get("steady-0")
            worker = slot.workers.get(kind) if slot is not None else None
            return list(worker.history) if worker is not None else []

        def hanging_attempts() -> int:
            slots = slots_by_pod(daemon, "hang-")
            if len(slots) < len(hanging):
                return 0
            return min(s.workers[ProbeKind.READINESS].probes_run for s in slots.values())

        # Wait until every hanging worker is in its stride, then measure over 12 healthy ticks.
        await watcher.until(lambda: hanging_attempts() >= 1, timeout=30)
        since = time.time()
        await watcher.until(
            lambda: sum(r.started_at >= since for r in steady_records(ProbeKind.READINESS)) >= 12,
            timeout=40,
        )
        readiness = [r for r in steady_records(ProbeKind.READINESS) if r.started_at >= since]
        liveness = [r for r in steady_records(ProbeKind.LIVENESS) if r.started_at >= since]
        exec_lates, exec_skipped = lateness(readiness, 1.0)
        tcp_lates, tcp_skipped = lateness(liveness, 1.0)
        hang_records = [
            record
            for slot in slots_by_pod(daemon, "hang-").values()
            for record in slot.workers[ProbeKind.READINESS].history
        ]
        print(
            f"steady exec: p50 {percentile(exec_lates, 0.5):.3f}s "
            f"p99 {percentile(exec_lates, 0.99):.3f}s skipped {exec_skipped}; "
            f"tcp: p99 {percentile(tcp_lates, 0.99):.3f}s skipped {tcp_skipped}; "
            f"hanging attempts {len(hang_records)}, longest ExecSync {max(exec_calls):.2f}s, "
            f"most in flight {highest}"
        )
        assert all(r.result == "success" for r in readiness + liveness)
        assert percentile(exec_lates, 0.99) < 1.5, exec_lates
        assert percentile(tcp_lates, 0.99) < 0.5, tcp_lates
        assert tcp_skipped == 0
        # The hanging probes did hang, and each was ended as a timeout failure, not an error.
        assert hang_records
        assert all(r.result == "failure" and r.timed_out for r in hang_records), hang_records
        assert max(exec_calls) <= EXEC_BOUND
        assert max(exec_calls) > TIMEOUT + 1  # the background kind outlived the runtime's timeout
        assert CAP - 2 <= highest <= CAP  # the slots were contended, and the cap held

        # Remove every probe: workers finish their current step and nothing stays in flight.
        workers = [t for t in asyncio.all_tasks() if t.get_name().startswith("probe:")]
        assert len(workers) == len(hanging) + 2
        daemon.manager.set_rules(RulesFile(probes=()), daemon.discovery.containers().values())
        _done, pending = await asyncio.wait(workers, timeout=EXEC_BOUND + 0.5)
        assert not pending
        assert not probe_task_names()
        assert daemon.cri.execs_in_flight == 0
