"""Every query of the shipped Grafana dashboard (deploy/monitoring/dashboard.json) answers, on a
real Prometheus scraping a real ``serve`` on a real containerd.

Prometheus (Debian's ``prometheus`` package) runs with a temporary data directory, scrapes every
second on a free port, and is stopped at the end. Pods are created once it scrapes, so their
attempts, timeouts and first successes land in its data.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.monitoring import dashboard_queries, prometheus_tool
from tests.support.serve import Serve, _wait_serving, free_port, launch, touch_ready, unique
from tests.support.testbed import ContainerSpec, PodFactory, Testbed

RULES = """
probes:
  - match: {namespace: default, pod: "dash-*", container: app}
    startupProbe: {exec: {command: ["true"]}, periodSeconds: 1}
    readinessProbe: {exec: {command: [cat, /tmp/ready]}, periodSeconds: 1, timeoutSeconds: 10}
    livenessProbe: {exec: {command: ["true"]}, periodSeconds: 1, timeoutSeconds: 10}
  - match: {namespace: default, pod: "dashslow-*", container: app}
    # Times out on every attempt; the high threshold keeps the worker probing.
    livenessProbe:
      exec: {command: [sleep, "5"]}
      periodSeconds: 1
      timeoutSeconds: 1
      failureThreshold: 1000
"""
DEADLINE = 90.0  # seconds for every query to answer


@pytest.fixture(scope="module", name="serve")
def _serve(testbed_16: Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    """serve with metrics, and an empty static-pod directory as a pod source (so the pod source
    panels have series)."""
    directory = tmp_path_factory.mktemp("dashboard")
    manifests = directory / "manifests"
    manifests.mkdir()
    port = free_port()
    serve = launch(
        testbed_16.endpoint,
        directory,
        RULES,
        "--probes-from",
        f"manifests:{manifests}",
        metrics_address=f"127.0.0.1:{port}",
    )
    serve.metrics_port = port
    try:
        _wait_serving(serve)
        yield serve
    finally:
        code = serve.terminate()
        assert code == 0, f"serve exited {code}:\n{serve.log()}"


def start_prometheus(directory: Path, target: str, port: int) -> subprocess.Popen[bytes]:
    """Prometheus on 127.0.0.1:``port`` scraping ``target`` every second, its data and log in
    ``directory``."""
    config = directory / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: cri-prober\n"
        f"    static_configs: [{{targets: ['{target}']}}]\n"
    )
    with (directory / "prometheus.log").open("wb") as log:
        return subprocess.Popen(
            [
                prometheus_tool("prometheus"),
                f"--config.file={config}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=directory,
        )


@contextlib.asynccontextmanager
async def prometheus(directory: Path, target: str) -> AsyncIterator[httpx.AsyncClient]:
    """A Prometheus scraping ``target`` every second; a client of its HTTP API."""
    port = free_port()
    process = start_prometheus(directory, target, port)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get("/-/ready")).status_code == 200:
                        break
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"prometheus did not start:\n{(directory / 'prometheus.log').read_text()}"
                    )
                await asyncio.sleep(0.2)
            yield client
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def query(client: httpx.AsyncClient, expr: str) -> list[Any]:
    response = await client.get("/api/v1/query", params={"query": expr})
    body = response.json()
    assert body["status"] == "success", (expr, body)
    result: list[Any] = body["data"]["result"]
    return result


async def test_every_dashboard_query_answers(
    serve: Serve, testbed_16: Testbed, pods_16: PodFactory, tmp_path: Path
) -> None:
    async with prometheus(tmp_path, f"127.0.0.1:{serve.metrics_port}") as client:
        deadline = time.monotonic() + 30
        while not await query(client, 'up{job="cri-prober"} == 1'):
            assert time.monotonic() < deadline, "prometheus never scraped serve"
            await asyncio.sleep(0.5)
        ready = await pods_16.create_pod(unique("dash"), containers=[ContainerSpec("app")])
        await pods_16.create_pod(unique("dashslow"), containers=[ContainerSpec("app")])
        await touch_ready(testbed_16, ready.containers["app"].id)

        pending = dashboard_queries()
        assert pending
        deadline = time.monotonic() + DEADLINE
        while pending:
            answers = [await query(client, expr) for _title, expr in pending]
            pending = [q for q, answer in zip(pending, answers, strict=True) if not answer]
            if pending and time.monotonic() > deadline:
                empty = "\n".join(f"{title}: {expr}" for title, expr in pending)
                pytest.fail(f"dashboard queries with no answer after {DEADLINE} s:\n{empty}")
            await asyncio.sleep(1)
        # The pod created for it is ready, and the timing-out one counts its failures.
        ready_now = await query(client, f'cri_prober_container_ready{{pod="{ready.name}"}}')
        assert [sample["value"][1] for sample in ready_now] == ["1"]
        failing = await query(
            client, 'cri_prober_probe_consecutive_failures{pod=~"dashslow-.*"} > 0'
        )
        assert failing
