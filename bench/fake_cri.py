"""The in-process fake CRI runtime (tests.support.fake_runtime) with N simulated pods, in its own
process, so the benchmark measures the prober's CPU alone.

``python -m bench.fake_cri --socket PATH --containers N --http-ports P,... --tcp-ports P,...``
creates N host-network sandboxes with one running container ``app`` each, whose kubelet ports
annotation names an ``http`` and a ``tcp`` port (spread over the given listener ports), prints
one JSON line ``{"target": ...}`` once serving, and serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from tests.support.fake_runtime import FakeRuntime, FakeRuntimeServer

PORTS_ANNOTATION = "io.kubernetes.container.ports"


async def serve(socket: str, containers: int, http_ports: list[int], tcp_ports: list[int]) -> None:
    runtime = FakeRuntime()
    runtime.runtime_name = "containerd"
    runtime.runtime_version = "1.6.20"  # so "auto" discovery relists, as on a real 1.6 node
    for i in range(containers):
        sandbox = runtime.add_sandbox(f"scale-{i:05d}", namespace="bench", host_network=True)
        ports = [
            {"name": "http", "containerPort": http_ports[i % len(http_ports)], "protocol": "TCP"},
            {"name": "tcp", "containerPort": tcp_ports[i % len(tcp_ports)], "protocol": "TCP"},
        ]
        runtime.add_container(sandbox, "app", annotations={PORTS_ANNOTATION: json.dumps(ports)})
    server = FakeRuntimeServer(socket, runtime)
    await server.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    sys.stdout.write(json.dumps({"target": server.target, "containers": containers}) + "\n")
    sys.stdout.flush()
    await stop.wait()
    await server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--containers", type=int, required=True)
    parser.add_argument("--http-ports", required=True)
    parser.add_argument("--tcp-ports", required=True)
    args = parser.parse_args()
    asyncio.run(
        serve(
            args.socket,
            args.containers,
            [int(p) for p in args.http_ports.split(",")],
            [int(p) for p in args.tcp_ports.split(",")],
        )
    )


if __name__ == "__main__":
    main()
