"""Create or remove the demo's pods on a testbed containerd, and serve its gRPC health target.

demo_pods.py create TESTBED_DIR     create the demo pods (idempotent per testbed)
demo_pods.py grpc-target PORT       serve grpc.health.v1 on 127.0.0.1:PORT, flipping between
                                    SERVING and NOT_SERVING every 15 s, until SIGTERM
"""

from __future__ import annotations

import asyncio
import signal
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.support.testbed import ContainerSpec, Testbed

PODS: list[tuple[str, bool, list[ContainerSpec]]] = [
    (
        "web",
        False,
        [
            ContainerSpec(
                "httpd",
                command=[
                    "sh",
                    "-c",
                    "echo ok > /www/index.html; (sleep 8; echo ready > /www/ready.html) & "
                    "exec httpd -f -p 8080 -h /www",
                ],
            )
        ],
    ),
    (
        "worker",
        True,
        [
            ContainerSpec(
                "main",
                command=["sh", "-c", "touch /tmp/alive; sleep 25; rm /tmp/alive; sleep 3600"],
            )
        ],
    ),
    (
        "slow-starter",
        True,
        [ContainerSpec("main", command=["sh", "-c", "sleep 14; touch /tmp/started; sleep 3600"])],
    ),
    ("tcp-echo", False, [ContainerSpec("nc", command=["nc", "-ll", "-p", "9000", "-e", "cat"])]),
    ("grpc-api", True, [ContainerSpec("api", command=["sleep", "3600"])]),
    # The static pod of examples/demo/manifests/shop.yaml as the kubelet would run it on node
    # demo-node: its probes come from that spec (serve --probes-from manifests:...).
    (
        "shop-demo-node",
        False,
        [
            ContainerSpec(
                "app",
                command=[
                    "sh",
                    "-c",
                    "touch /tmp/alive; (sleep 6; echo ok > /www/healthz) & "
                    "exec httpd -f -p 8081 -h /www",
                ],
            )
        ],
    ),
]


async def create(testbed_dir: str) -> None:
    testbed = Testbed.load(testbed_dir)
    pods = testbed.pods()
    try:
        for name, host_network, containers in PODS:
            pod = await pods.create_pod(
                name, namespace="demo", host_network=host_network, containers=containers
            )
            where = pod.ip or "host network"
            print(f"  pod demo/{name:<13} {where:<15} containers: {', '.join(pod.containers)}")
    finally:
        # The pods stay for the demo; stopping the testbed removes them.
        await pods.close()


async def grpc_target(port: int) -> None:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    status = serving
    while not stop.is_set():
        await servicer.set("", status)
        try:
            await asyncio.wait_for(stop.wait(), 15)
        except TimeoutError:
            status = not_serving if status == serving else serving
    await server.stop(1)


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] not in ("create", "grpc-target"):
        sys.exit(__doc__)
    if sys.argv[1] == "create":
        asyncio.run(create(sys.argv[2]))
    else:
        asyncio.run(grpc_target(int(sys.argv[2])))


if __name__ == "__main__":
    main()
