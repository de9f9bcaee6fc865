"""The runtime goes away under load and comes back: serve keeps what it knows and recovers cleanly.

These tests kill, freeze and restart containerd, so the module runs its own private testbed
(never the session's shared one). The daemon runs in-process on the test's loop, so the test
sees its manager, results and resources directly.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from cri_prober._gen.criprober.v1 import query_pb2
from cri_prober.daemon import Daemon
from cri_prober.manager.state import ProbedContainer
from cri_prober.probing.results import Published
from cri_prober.probing.spec import ProbeKind
from cri_prober.runtime.model import CriCall
from tests.reliability.support import (
    Api,
    Sample,
    Workers,
    api_client,
    probe_task_names,
    probed_by_pod,
    sample_resources,
    wait_for_exit,
)
from tests.support.daemon import running_daemon
from tests.support.testbed import ContainerSpec, Pod, PodFactory, Testbed
from tests.support.waiting import HANG_GUARD
from tests.support.watchers import ManagerWatcher

pytestmark = pytest.mark.containerd

CONTAINERS = 30
# Readiness runs ExecSync (it needs the runtime); liveness dials the pod (it does not).
LOAD_RULES = """
probes:
  - match: {namespace: default, pod: "fault-*", container: app}
    readinessProbe:
      exec: {command: ["true"]}
      periodSeconds: 2
    livenessProbe:
      tcpSocket: {port: 8080}
      periodSeconds: 1
"""
HTTPD = ContainerSpec("app", command=["httpd", "-f", "-p", "8080", "-h", "/"])
EXEC_RULES = """
probes:
  - match: {namespace: default, pod: "sock-*", container: app}
    readinessProbe:
      exec: {command: ["true"]}
      periodSeconds: 1
"""
SLEEPER = ContainerSpec("app")

# Bounds. gRPC reconnects with backoff (1 s, x1.6), so the first call that can succeed after a
# restart comes a few seconds later; 60 s is far beyond that, even on a busy machine, and below
# gRPC's default backoff cap (120 s), which a client that did not bound it could wait.
RECOVERY_TIMEOUT = 60.0
# Probes open sockets and run gRPC calls as short-lived tasks, so counts wobble by a few even in
# a steady state; a leak per probe or per reconnect would exceed these after thousands of probes.
FD_SLACK = 6
TASK_SLACK = 6


@dataclass
class Bed:
    """The module's private containerd; ``testbed`` changes whenever a test restarts it."""

    directory: Path
    testbed: Testbed

    async def kill(self, sig: signal.Signals) -> None:
        """Send ``sig`` to containerd and wait until it has exited."""
        os.kill(self.testbed.pid, sig)
        await wait_for_exit(self.testbed.pid, 20)

    async def restart(self) -> None:
        """Start containerd again in the same directory (pods and shims survive a restart)."""
        self.testbed = await asyncio.to_thread(
            Testbed.start, self.directory, version="1.6", install=False
        )


@pytest.fixture(scope="module", name="bed")
def _bed() -> Iterator[Bed]:
    if os.geteuid() != 0:
        pytest.skip("needs root to run a real containerd")
    parent = Path(tempfile.mkdtemp(prefix="cprb-faults-"))
    directory = parent / "tb"
    try:
        testbed = Testbed.start(directory, version="1.6")
        yield Bed(directory, testbed)
    finally:
        Testbed.stop_dir(directory)
        shutil.rmtree(parent, ignore_errors=True)


async def create_pods(
    pods: PodFactory, prefix: str, count: int, spec: ContainerSpec, *, host_network: bool
) -> list[Pod]:
    """Create ``count`` one-container pods, ten at a time."""
    created: list[Pod] = []
    for start in range(0, count, 10):
        created += await asyncio.gather(
            *(
                pods.create_pod(f"{prefix}-{i}", host_network=host_network, containers=[spec])
                for i in range(start, min(start + 10, count))
            )
        )
    return created


def records_since(probed: ProbedContainer, kind: ProbeKind, since: float, result: str) -> int:
    """How many attempts of the container's ``kind`` worker started after ``since`` with
    ``result``."""
    state = probed.probe(kind)
    if state is None or not state.has_worker:
        return 0
    return sum(1 for r in state.history if r.started_at > since and r.result == result)


def all_have(
    daemon: Daemon, prefix: str, count: int, kinds: Sequence[ProbeKind], since: float, result: str
) -> bool:
    """Every one of ``count`` containers has an attempt of each kind with ``result`` after
    ``since``."""
    probed = probed_by_pod(daemon, prefix)
    return len(probed) == count and all(
        records_since(p, kind, since, result) > 0 for p in probed.values() for kind in kinds
    )


def assert_results_kept(
    daemon: Daemon, probed: dict[str, ProbedContainer], kinds: Sequence[ProbeKind]
) -> None:
    """Published results and derived health are what they were with the runtime up, for the
    very same containers (still the newest attempt of each)."""
    for name, before in probed.items():
        now = daemon.manager.probed_container(before.container.id)
        assert now is not None, name
        for kind in kinds:
            assert daemon.manager.results.get(now.container.id, kind) is Published.SUCCESS, (
                name,
                kind,
            )
        assert daemon.manager.container_health(now.container).serving, name
    known = daemon.discovery.containers()
    assert all(p.container.id in known for p in probed.values())


def assert_same_workers(
    daemon: Daemon, watcher: ManagerWatcher, prefix: str, before: Workers
) -> None:
    """No worker was replaced, added or dropped (a relist that lost containers would do that),
    and every one still runs."""
    probed = probed_by_pod(daemon, prefix)
    before.assert_kept(probed.values(), watcher)
    assert all(s.active for p in probed.values() for s in p.probes)


async def assert_api_answers(
    api: Api, probed: dict[str, ProbedContainer], *, node: bool = True
) -> None:
    """The API answers from what the daemon knows: every container SERVING, all listed.

    ``node`` False leaves out ``""``, which follows the runtime (NOT_SERVING once it has been
    silent for 10 s) rather than the containers.
    """
    serving = health_pb2.HealthCheckResponse.SERVING
    for service in ["", *(p.label for p in probed.values())][0 if node else 1 :]:
        response = await api.health.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=HANG_GUARD
        )
        assert response.status == serving, service
    listed = await api.query.ListContainers(
        query_pb2.ListContainersRequest(filter=query_pb2.ContainerFilter(pod="^fault-")),
        timeout=HANG_GUARD,
    )
    assert {c.id for c in listed.containers} == {p.container.id for p in probed.values()}
    assert all(c.healthy for c in listed.containers)


def assert_near(before: Sample, after: Sample) -> None:
    """A leak lifts the floor (the minimum); the median also moves with in-flight probes."""
    assert after.fds_min <= before.fds_min + FD_SLACK, (before, after)
    assert abs(after.fds_median - before.fds_median) <= 2 * FD_SLACK, (before, after)
    assert after.tasks_min <= before.tasks_min + TASK_SLACK, (before, after)
    assert abs(after.tasks_median - before.tasks_median) <= 2 * TASK_SLACK, (before, after)


async def test_sigkill_under_load_keeps_results_and_recovers_without_leaks(
    bed: Bed, tmp_path: Path
) -> None:
    """containerd SIGKILLed under 30 exec+tcp probed containers, then restarted.

    While it is down: published results, health (also as the API answers it) and the node view
    stay as they were, exec attempts error (and are discarded), tcp probes keep running. After
    the restart: discovery relists, exec probes succeed again on the very same workers (no
    duplicates, no restarts), and the process's fds and tasks are back where they were.
    """
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(LOAD_RULES)
    kinds = (ProbeKind.READINESS, ProbeKind.LIVENESS)
    async with bed.testbed.pods() as pods:
        await create_pods(pods, "fault", CONTAINERS, HTTPD, host_network=False)
        async with (
            running_daemon(bed.testbed.endpoint, rules_file, relist_period=0.5) as (
                daemon,
                watcher,
            ),
            api_client(daemon) as api,
        ):
            # Steady state: every worker has succeeded at least twice.
            await watcher.until(
                lambda: (
                    all_have(daemon, "fault-", CONTAINERS, kinds, 0, "success")
                    and all(
                        s.attempts >= 2
                        for p in probed_by_pod(daemon, "fault-").values()
                        for s in p.probes
                    )
                ),
                timeout=60,
            )
            probed = probed_by_pod(daemon, "fault-")
            assert_results_kept(daemon, probed, kinds)
            workers = Workers.of(probed.values(), watcher)
            task_names = probe_task_names()
            assert len(task_names) == 2 * CONTAINERS
            assert len(set(task_names)) == len(task_names)
            baseline = await sample_resources(watcher)

            # Result changes from here on (the watcher keeps every ResultChanged event).
            changes_from = len(watcher.transitions)

            killed_at = time.time()
            await bed.kill(signal.SIGKILL)
            # Down: every exec attempt errors, every tcp probe still succeeds.
            execs, dials = [ProbeKind.READINESS], [ProbeKind.LIVENESS]
            await watcher.until(
                lambda: (
                    all_have(daemon, "fault-", CONTAINERS, execs, killed_at, "error")
                    and all_have(daemon, "fault-", CONTAINERS, dials, killed_at, "success")
                ),
                timeout=HANG_GUARD,
            )
            assert_results_kept(daemon, probed, kinds)
            assert_same_workers(daemon, watcher, "fault-", workers)
            # "" reports the runtime, whose silence may by now be past the threshold (10 s).
            await assert_api_answers(api, probed, node=False)
            relisted_while_down = daemon.discovery.last_relist_ok
            # An errored attempt counts towards nothing: the readiness streak is untouched.
            for p in probed_by_pod(daemon, "fault-").values():
                readiness = p.probe(ProbeKind.READINESS)
                assert readiness is not None
                assert readiness.last_result is Published.SUCCESS
                assert not any(r.result == "failure" for r in readiness.history)

            await bed.restart()
            restarted_at = time.time()
            await watcher.until(
                lambda: (
                    all_have(daemon, "fault-", CONTAINERS, kinds, restarted_at, "success")
                    and daemon.discovery.last_relist_ok != relisted_while_down
                ),
                timeout=RECOVERY_TIMEOUT,
            )
            recovered_in = time.time() - restarted_at
            assert_results_kept(daemon, probed, kinds)
            assert_same_workers(daemon, watcher, "fault-", workers)
            assert probe_task_names() == task_names
            await assert_api_answers(api, probed)
            # Nothing was published throughout: no flap to failure, no reset to initial values.
            updates = watcher.transitions[changes_from:]
            assert updates == []
            after = await sample_resources(watcher)
            assert_near(baseline, after)
            print(f"recovered {recovered_in:.1f}s after the restart; {baseline=} {after=}")


async def test_socket_removed_and_recreated(bed: Bed, tmp_path: Path) -> None:
    """containerd stopped, its socket file deleted, then started again on a new socket inode.

    The daemon dials the path, not the inode, so it reconnects; nothing it knew is lost.
    """
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(EXEC_RULES)
    count = 5
    async with bed.testbed.pods() as pods:
        await create_pods(pods, "sock", count, SLEEPER, host_network=True)
        async with running_daemon(bed.testbed.endpoint, rules_file, relist_period=0.5) as (
            daemon,
            watcher,
        ):
            kinds = [ProbeKind.READINESS]
            await watcher.until(lambda: all_have(daemon, "sock-", count, kinds, 0, "success"))
            probed = probed_by_pod(daemon, "sock-")
            workers = Workers.of(probed.values(), watcher)
            socket_path = bed.testbed.socket
            old_inode = socket_path.stat().st_ino

            stopped_at = time.time()
            await bed.kill(signal.SIGTERM)
            # Gone from its path; moved aside rather than unlinked, so the filesystem cannot hand
            # the freed inode number straight to the new socket (if containerd removed it
            # itself, a placeholder takes the freed number first).
            moved_aside = socket_path.with_name(socket_path.name + ".old")
            if socket_path.exists():
                socket_path.rename(moved_aside)
            else:
                moved_aside.touch()
            assert not socket_path.exists()
            await watcher.until(
                lambda: all_have(daemon, "sock-", count, kinds, stopped_at, "error")
            )
            assert_results_kept(daemon, probed, kinds)

            await bed.restart()
            assert socket_path.stat().st_ino != old_inode
            moved_aside.unlink(missing_ok=True)
            restarted_at = time.time()
            await watcher.until(
                lambda: all_have(daemon, "sock-", count, kinds, restarted_at, "success"),
                timeout=RECOVERY_TIMEOUT,
            )
            assert_results_kept(daemon, probed, kinds)
            assert_same_workers(daemon, watcher, "sock-", workers)


async def test_serve_started_before_the_runtime_waits_for_it(bed: Bed, tmp_path: Path) -> None:
    """A daemon started while the runtime's socket does not exist becomes ready when it appears."""
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(EXEC_RULES)
    async with bed.testbed.pods() as pods:
        await create_pods(pods, "sock", 1, SLEEPER, host_network=True)
        await bed.kill(signal.SIGTERM)
        bed.testbed.socket.unlink(missing_ok=True)
        async with running_daemon(
            bed.testbed.endpoint, rules_file, ready_timeout=0, relist_period=0.5
        ) as (daemon, watcher):
            # Bounded window for something that must not happen: ready without a runtime.
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(daemon.ready.wait(), 1.5)
            assert daemon.manager.worker_count() == 0
            await bed.restart()
            await asyncio.wait_for(daemon.ready.wait(), RECOVERY_TIMEOUT)
            await watcher.until(
                lambda: all_have(daemon, "sock-", 1, [ProbeKind.READINESS], 0, "success")
            )


FREEZE_SECONDS = 15.0
FROZEN_COUNT = 8
# Every container: readiness and liveness exec `true` (the finding's healthy containers). Half
# of them also carry a slow liveness probe (`sleep 2`, timeout 5, failureThreshold 1), so that
# execs are running inside containerd when it freezes: containerd's timer for such an exec fires
# while it cannot see the command exit, and once thawed it may answer with its timeout error
# although the command exited 3 s early. One such answer counted would stop the container.
FREEZE_RULES = """
probes:
  - match: {namespace: default, pod: "frz-fast-*", container: app}
    readinessProbe:
      exec: {command: ["true"]}
      periodSeconds: 1
    livenessProbe:
      exec: {command: ["true"]}
      periodSeconds: 1
  - match: {namespace: default, pod: "frz-slow-*", container: app}
    readinessProbe:
      exec: {command: ["true"]}
      periodSeconds: 1
    livenessProbe:
      exec: {command: [sleep, "2"]}
      timeoutSeconds: 5
      periodSeconds: 1
      failureThreshold: 1
"""


class HealthWatch:
    """Follows the API's Health/Watch of ``""``: every status, when it came, awaitable."""

    def __init__(self, api: Api) -> None:
        self.seen: list[tuple[float, int]] = []
        self._changed = asyncio.Event()
        self._call = api.health.Watch(health_pb2.HealthCheckRequest(service=""))
        self._task = asyncio.create_task(self._follow())

    async def _follow(self) -> None:
        async for response in self._call:
            self.seen.append((time.time(), response.status))
            self._changed.set()

    async def until(self, status: int, *, after: float, timeout: float) -> float:
        """When ``status`` was first reported at or after ``after``."""
        async with asyncio.timeout(timeout):
            while True:
                for when, seen in self.seen:
                    if seen == status and when >= after:
                        return when
                self._changed.clear()
                await self._changed.wait()

    async def close(self) -> None:
        self._call.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def test_frozen_runtime_is_not_the_containers_failure(bed: Bed, tmp_path: Path) -> None:
    """containerd SIGSTOPped for 15 s under load, with --on-failure stop and exec liveness on
    every container (issue 15: this stopped 6 of 6 healthy containers once the runtime came
    back, and health "" stayed SERVING throughout).

    While frozen: exec attempts wait for the runtime (the kubelet's deadline is timeout + 2 min)
    and count for nothing; "" turns NOT_SERVING once the runtime has answered nothing for 10 s.
    After SIGCONT: no container is stopped, no result is published at all (no false Failure),
    every exec probe succeeds again, "" is SERVING again, and execs that containerd answered
    with a timeout only because it was frozen were errors, not failures.
    """
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(FREEZE_RULES)
    kinds = (ProbeKind.READINESS, ProbeKind.LIVENESS)
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    serving = health_pb2.HealthCheckResponse.SERVING
    async with bed.testbed.pods() as pods:
        half = FROZEN_COUNT // 2
        await create_pods(pods, "frz-fast", half, SLEEPER, host_network=True)
        await create_pods(pods, "frz-slow", half, SLEEPER, host_network=True)
        async with (
            running_daemon(
                bed.testbed.endpoint, rules_file, relist_period=0.5, on_failure="stop"
            ) as (daemon, watcher),
            api_client(daemon) as api,
        ):
            await watcher.until(
                lambda: all_have(daemon, "frz-", FROZEN_COUNT, kinds, 0, "success"),
                timeout=HANG_GUARD,
            )
            probed = probed_by_pod(daemon, "frz-")
            containers = {name: p.container.id for name, p in probed.items()}
            workers = Workers.of(probed.values(), watcher)
            changes_from = len(watcher.transitions)
            calls: list[CriCall] = []
            daemon.cri.calls.subscribe(calls.append)
            health = HealthWatch(api)
            try:
                await health.until(serving, after=0, timeout=HANG_GUARD)
                frozen_at = time.time()
                os.kill(bed.testbed.pid, signal.SIGSTOP)
                try:
                    went_down = await health.until(
                        not_serving, after=frozen_at, timeout=FREEZE_SECONDS
                    )
                    # The freeze is the scenario: it lasts its 15 s whatever happens meanwhile.
                    await asyncio.sleep(max(0.0, frozen_at + FREEZE_SECONDS - time.time()))
                finally:
                    os.kill(bed.testbed.pid, signal.SIGCONT)
                thawed_at = time.time()
                came_back = await health.until(serving, after=thawed_at, timeout=RECOVERY_TIMEOUT)
                await watcher.until(
                    lambda: all_have(daemon, "frz-", FROZEN_COUNT, kinds, thawed_at, "success"),
                    timeout=RECOVERY_TIMEOUT,
                )
            finally:
                await health.close()
            updates = watcher.transitions[changes_from:]
            records = [
                record
                for p in probed_by_pod(daemon, "frz-").values()
                for state in p.probes
                for record in state.history
                if record.started_at + record.duration >= frozen_at
            ]
            # Timeout errors containerd answered once thawed: each one was an error (the worker
            # ran the attempt again at once), none a failure. How many there are is up to
            # containerd's scheduler after SIGCONT (zero to a few per run).
            runtime_timeouts = sum(
                call.method == "ExecSync" and call.code == "DEADLINE_EXCEEDED" for call in calls
            )
            print(
                f'"" NOT_SERVING {went_down - frozen_at:.1f}s into the freeze, SERVING '
                f"{came_back - thawed_at:.1f}s after it; {len(records)} attempts ended since the "
                f"freeze: {sum(r.result == 'success' for r in records)} successes; "
                f"{runtime_timeouts} exec timeouts from the frozen runtime, not counted"
            )
            assert [call for call in calls if call.method == "StopContainer"] == []
            assert updates == []
            assert not [r for r in records if r.result == "failure"]
            # 10 s without an answer, from the first call left unanswered (< 0.5 s in): not
            # before, and while the runtime was still frozen (SERVING again once thawed: the wait
            # above). How soon after is for bench/: on a busy machine seconds say how busy it is.
            assert went_down - frozen_at >= 9.5
            assert went_down < thawed_at
            # The same containers, still running, still probed by the same workers.
            assert {n: p.container.id for n, p in probed_by_pod(daemon, "frz-").items()} == (
                containers
            )
            assert all(p.container.id in daemon.discovery.containers() for p in probed.values())
            assert_same_workers(daemon, watcher, "frz-", workers)
