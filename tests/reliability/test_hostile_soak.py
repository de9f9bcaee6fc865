"""A CI-sized soak (issue 15, item 9): hostile pods and API requests churn while a canary probes.

On a real containerd 1.6, pods come and go every cycle carrying what a hostile pod author can
set — an annotation that is not JSON and 200 KB long with no rule matching the pod, an exec
probe whose `$(BIG)` references would amplify a 100 KB variable, an httpGet probe aimed at the
node's loopback with custom headers — while API clients send a filter regex that backtracks
catastrophically, oversized targets and watch resumes from another incarnation. A canary pod's
tcp probe (period 1) must keep its period (never more than 1 s late) and, once the churn pods
are gone, fds, tasks and RSS must be back near the baseline taken before the churn.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import Awaitable
from pathlib import Path

import grpc

from cri_prober._gen.criprober.v1 import query_pb2, query_pb2_grpc
from cri_prober.manager.events import AttemptFinished, ManagerEvent
from cri_prober.probing.kinds import ProbeKind
from tests.reliability.support import api_client, open_fds, rss_bytes, task_count
from tests.support.daemon import running_daemon
from tests.support.testbed import ContainerSpec, Pod, PodFactory, Testbed

CHURN_SECONDS = 60.0
LIVE_CHURN_PODS = 4
RSS_SLACK = 32 * 1024 * 1024
COUNT_SLACK = 8
LATE_BOUND = 1.0

RULES = """
probes:
  - match: {namespace: default, pod: "canary-*", container: app}
    livenessProbe:
      tcpSocket: {port: 8080}
      periodSeconds: 1
"""
CANARY = ContainerSpec(
    "app", command=["sh", "-c", "echo ok > /tmp/index.html && exec httpd -f -p 8080 -h /tmp"]
)
BIG = "x" * 100_000


def hostile_annotations(index: int) -> dict[str, str]:
    """What a pod author may write, in turn: junk, an amplifier, a loopback request."""
    kind = index % 3
    if kind == 0:
        return {"probes.cri-prober.io/other": "{" + "a" * 200_000}
    if kind == 1:
        command = ["sh", "-c", "echo " + " ".join(["$(BIG)"] * 1000)]
        spec = {"livenessProbe": {"exec": {"command": command}, "periodSeconds": 1}}
        return {"probes.cri-prober.io/app": json.dumps(spec)}
    spec = {
        "livenessProbe": {
            "httpGet": {
                "host": "127.0.0.1",
                "port": 10250,
                "path": "/pods",
                "httpHeaders": [{"name": "Authorization", "value": "Bearer stolen"}],
            },
            "periodSeconds": 1,
        }
    }
    return {"probes.cri-prober.io/app": json.dumps(spec)}


async def hostile_requests(query: query_pb2_grpc.CriProberAsyncStub) -> None:
    """One round of API requests a careless or hostile client may send; all must be refused or
    answered quickly, never freeze the daemon."""
    requests: list[Awaitable[object]] = [
        query.ListContainers(
            query_pb2.ListContainersRequest(
                filter=query_pb2.ContainerFilter(pod=r"^([a-z0-9-]+)+\.svc$"), all=True
            ),
            timeout=5,
        ),
        query.GetContainer(query_pb2.GetContainerRequest(target="x" * 1_000_000), timeout=5),
    ]
    for call in requests:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await call


async def test_hostile_churn_keeps_the_canary_on_time_and_resources_flat(
    testbed_16: Testbed, pods_16: PodFactory, tmp_path: Path
) -> None:
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(RULES)
    canary_times: list[float] = []

    def on_event(event: ManagerEvent) -> None:
        if (
            isinstance(event, AttemptFinished)
            and event.kind is ProbeKind.LIVENESS
            and event.container.pod.name.startswith("canary-")
        ):
            canary_times.append(time.monotonic())

    async with running_daemon(
        testbed_16.endpoint, rules_file, relist_period=0.5, listeners=[on_event]
    ) as (daemon, watcher):
        await pods_16.create_pod("canary-0", containers=[CANARY])
        await watcher.until(lambda: len(canary_times) >= 3, timeout=30)
        base_rss, base_fds, base_tasks = rss_bytes(), open_fds(), task_count()

        async with api_client(daemon) as api:
            churn: list[Pod] = []
            index = 0
            started = time.monotonic()
            canary_from = len(canary_times)
            while time.monotonic() - started < CHURN_SECONDS:
                pod = await pods_16.create_pod(
                    f"soak-{index}",
                    annotations=hostile_annotations(index),
                    containers=[ContainerSpec("app", env={"BIG": BIG})],
                )
                churn.append(pod)
                if len(churn) > LIVE_CHURN_PODS:
                    await pods_16.remove_pod(churn.pop(0))
                await hostile_requests(api.query)
                index += 1
            canary_during = canary_times[canary_from:]
            for pod in churn:
                await pods_16.remove_pod(pod)

        await watcher.until(
            lambda: all(s.pod.name.startswith("canary-") for s in daemon.manager.slots()),
            timeout=30,
        )
        # Let the loop settle so transient sockets and tasks are gone.
        await watcher.events(5)
        gaps = [b - a for a, b in itertools.pairwise(canary_during)]
        print(
            f"hostile soak: {index} churn pods, canary attempts {len(canary_during)}, "
            f"largest gap {max(gaps):.2f}s, rss {(rss_bytes() - base_rss) / 2**20:+.1f} MiB, "
            f"fds {open_fds() - base_fds:+d}, tasks {task_count() - base_tasks:+d}"
        )
        assert len(canary_during) >= CHURN_SECONDS * 0.8, len(canary_during)
        assert max(gaps) <= 1.0 + LATE_BOUND, max(gaps)
        assert rss_bytes() - base_rss <= RSS_SLACK, (rss_bytes() - base_rss) / 2**20
        assert open_fds() - base_fds <= COUNT_SLACK
        assert task_count() - base_tasks <= COUNT_SLACK
