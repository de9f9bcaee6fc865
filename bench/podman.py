"""Versus Podman: node CPU per exec health check, ``podman healthcheck run`` vs cri-prober.

    python -m bench.podman [--quick] [--rate R] [--rounds N]

Sets up R busybox containers under podman 4.3 (private --root/--runroot in a temp dir, cgroupfs,
``--health-cmd true``; the image is a ``podman import`` of a busybox rootfs tarball built here)
and R pods on a private containerd 1.6. Then alternates three windows per round:

- idle: nothing probes (the baseline of everything else running on the node);
- podman: ``podman healthcheck run`` once per container per second (R checks/s, launched on a
  fixed schedule from this process, as podman's systemd timers would, minus systemd);
- cri-prober: the daemon in-process with an exec liveness probe ``true`` every 1 s on each of
  the R containers (R probes/s through containerd's ExecSync).

"Attributed" CPU counts only the contender's own processes: for podman, every process a
``podman healthcheck run`` led to (the CLI, conmon, runc, the command), collected by running it
under a child-subreaper wrapper (bench._subreap) that reaps them all and reads RUSAGE_CHILDREN;
for cri-prober, this process (the daemon) plus containerd and its shims including what they reaped
(runc, the exec'd command), minus containerd's and the shims' own idle-window rate. Node CPU (busy
time of all CPUs from /proc/stat, gross and net of the idle window) is reported too, but on a
shared machine other work swamps it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench._common import (
    CLK_TCK,
    Collector,
    containerd,
    fmt,
    machine,
    median,
    node_jiffies,
    quiet_logs,
    rules_file,
    say,
    table,
    tables_first,
)
from tests.support.daemon import running_daemon
from tests.support.testbed import ContainerSpec

REPO = Path(__file__).resolve().parent.parent
IMAGE = "localhost/cri-prober-bench/busybox:latest"
APPLETS = ("sh", "sleep", "true", "cat", "kill", "ls")
# runc here cannot raise RLIMIT_NOFILE/NPROC to podman's defaults ("error setting rlimit type 7:
# operation not permitted"), so both are pinned below this machine's hard limits.
ULIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096")
RULES = """
probes:
  - match: {namespace: bench, pod: "vs-podman-*", container: app}
    livenessProbe:
      exec: {command: ["true"]}
      periodSeconds: 1
      timeoutSeconds: 5
"""


def rootfs_tar() -> bytes:
    """A busybox root filesystem as a plain tar, like scripts/testbed.py's image layer."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in ("bin", "tmp", "proc", "sys", "dev", "etc"):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        data = Path("/usr/bin/busybox").read_bytes()
        info = tarfile.TarInfo("bin/busybox")
        info.size, info.mode = len(data), 0o755
        tar.addfile(info, io.BytesIO(data))
        for applet in APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
    return buffer.getvalue()


class Podman:
    """podman with private storage under ``root``; removes everything it made on close."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.base = [
            "podman",
            "--root", str(root / "storage"),
            "--runroot", str(root / "run"),
            "--cgroup-manager", "cgroupfs",
            "--events-backend", "file",
            "--tmpdir", str(root / "tmp"),
        ]  # fmt: skip

    def run(self, *args: str, timeout: float = 120) -> str:
        proc = subprocess.run(
            [*self.base, *args], capture_output=True, text=True, timeout=timeout, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"podman {' '.join(args)} exited {proc.returncode}: {proc.stderr}")
        return proc.stdout

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.run("rm", "--force", "--all", "--time", "0")
        with contextlib.suppress(Exception):
            self.run("rmi", "--force", "--all")
        # Storage leaves its overlay mount behind; unmount everything under the root, deepest first.
        mounts = [
            line.split()[4]
            for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if line.split()[4].startswith(str(self.root))
        ]
        for mount in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", mount], check=False, capture_output=True)


@contextlib.asynccontextmanager
async def podman_containers(count: int) -> AsyncIterator[tuple[Podman, list[str]]]:
    if shutil.which("podman") is None:
        raise RuntimeError("podman is not installed (apt-get install -y podman)")
    root = Path(tempfile.mkdtemp(prefix="cprb-podman-"))
    (root / "tmp").mkdir()
    podman = Podman(root)
    try:
        tar_path = root / "rootfs.tar"
        tar_path.write_bytes(rootfs_tar())
        say(f"podman {podman.run('--version').split()[-1]}: importing image, {count} containers")
        await asyncio.to_thread(podman.run, "import", str(tar_path), IMAGE)
        names = []
        for i in range(count):
            name = f"cprb-bench-hc-{i}"
            await asyncio.to_thread(
                podman.run, "run", "--detach", "--name", name, "--network", "host", *ULIMITS,
                "--health-cmd", "true", "--health-interval", "disable", IMAGE, "sleep", "3600",
            )  # fmt: skip
            names.append(name)
        yield podman, names
    finally:
        await asyncio.to_thread(podman.close)
        shutil.rmtree(root, ignore_errors=True)


def tree_cpu(pid: int) -> float:
    """utime+stime of a process plus that of its reaped children (cutime+cstime), seconds."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    rest = text[text.rindex(")") + 2 :].split()
    return sum(int(x) for x in rest[11:15]) / CLK_TCK


def runtime_pids(containerd_pid: int, socket: Path) -> list[int]:
    """containerd and the shims serving its containers (they reap runc and the exec'd processes)."""
    pids = [containerd_pid]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if b"containerd-shim" in argv[0] and str(socket).encode() in argv:
                    pids.append(int(entry.name))
    return pids


@dataclass
class Window:
    kind: str
    busy: float  # node CPU seconds
    wall: float
    checks: int
    attributed: float  # CPU seconds of the contender's own processes (see module docstring)


async def measure(seconds: float) -> tuple[float, float]:
    busy0, _ = node_jiffies()
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    busy1, _ = node_jiffies()
    return (busy1 - busy0) / CLK_TCK, time.monotonic() - t0


async def podman_window(podman: Podman, names: Sequence[str], seconds: float) -> Window:
    """``podman healthcheck run`` R times a second on a fixed schedule, round-robin."""
    loop = asyncio.get_running_loop()
    interval = 1.0 / len(names)
    counting = False
    done = failed = 0
    attributed = 0.0
    limit = asyncio.Semaphore(4 * len(names))

    async def check(name: str) -> None:
        nonlocal done, failed, attributed
        async with limit:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench._subreap", *podman.base, "healthcheck", "run", name,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
                cwd=REPO,
            )  # fmt: skip
            out, _ = await proc.communicate()
        report = json.loads(out or b'{"rc": -1, "cpu": 0}')
        if counting:
            done += 1
            failed += report["rc"] != 0
            attributed += report["cpu"]

    async def schedule() -> None:
        tasks = set()
        tick = loop.time()
        i = 0
        while True:
            task = asyncio.create_task(check(names[i % len(names)]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
            tick += interval
            await asyncio.sleep(max(0.0, tick - loop.time()))

    scheduler = asyncio.create_task(schedule())
    try:
        await asyncio.sleep(2.0)
        counting = True
        busy, wall = await measure(seconds)
        counting = False
    finally:
        scheduler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await scheduler
    # Let checks still running finish so they do not spill into the next window.
    await asyncio.sleep(2.0)
    if failed:
        say(f"  {failed} of {done} podman checks failed")
    return Window("podman", busy, wall, done, attributed)


async def prober_window(
    endpoint: str, containerd_pid: int, socket: Path, count: int, seconds: float
) -> Window:
    collector = Collector()
    async with (
        rules_file(RULES) as rules,
        running_daemon(
            endpoint,
            rules,
            ready_timeout=60,
            stop_timeout=60,
            listeners=[collector],
            pleg="relist",
        ) as (daemon, watcher),
    ):
        await watcher.until(lambda: daemon.manager.worker_count() >= count, 30)
        # From here only the benchmark's own listener follows the manager (the watcher
        # would keep every event and spend this process's CPU on it).
        watcher.unsubscribe()
        await asyncio.sleep(2.0)
        before = len(collector.attempts)
        pids = runtime_pids(containerd_pid, socket)
        own0, runtime0 = time.process_time(), sum(map(tree_cpu, pids))
        busy, wall = await measure(seconds)
        attributed = time.process_time() - own0 + sum(map(tree_cpu, pids)) - runtime0
        attempts = collector.attempts[before:]
    bad = sum(a.result != "success" for a in attempts)
    if bad:
        say(f"  {bad} of {len(attempts)} cri-prober probes not successful")
    await asyncio.sleep(2.0)
    return Window("cri-prober", busy, wall, len(attempts), attributed)


async def run(args: argparse.Namespace) -> None:
    quiet_logs()
    windows: list[list[Window]] = []
    # The tables of what was measured come first, even when a stop or a later window
    # fails: that failure follows them (issue 35).
    with tables_first(lambda: report(args, windows)):
        async with (
            podman_containers(args.rate) as (podman, names),
            containerd("1.6") as testbed,
            testbed.pods() as pods,
        ):
            for i in range(args.rate):
                await pods.create_pod(
                    f"vs-podman-{i}", namespace="bench", containers=[ContainerSpec("app")]
                )
            for round_no in range(args.rounds):
                say(f"round {round_no + 1}: idle / podman / cri-prober, {args.seconds:g} s each")
                pids = runtime_pids(testbed.pid, testbed.socket)
                runtime0 = sum(map(tree_cpu, pids))
                busy, wall = await measure(args.seconds)
                idle = Window("idle", busy, wall, 0, sum(map(tree_cpu, pids)) - runtime0)
                # Alternate the order so drift does not favour one side.
                if round_no % 2 == 0:
                    pm = await podman_window(podman, names, args.seconds)
                    cp = await prober_window(
                        testbed.endpoint, testbed.pid, testbed.socket, args.rate, args.seconds
                    )
                else:
                    cp = await prober_window(
                        testbed.endpoint, testbed.pid, testbed.socket, args.rate, args.seconds
                    )
                    pm = await podman_window(podman, names, args.seconds)
                windows.append([idle, pm, cp])
                for w in (idle, pm, cp):
                    say(f"  {w.kind}: {w.checks} checks, node busy {w.busy / w.wall:.2f} CPUs")


def report(args: argparse.Namespace, windows: list[list[Window]]) -> None:
    print(f"\n## Versus Podman ({machine()})\n")
    print(
        f"{args.rate} containers each, one exec check per container per second ({args.rate}"
        f" checks/s); {args.rounds} rounds of idle / podman / cri-prober windows of"
        f" {args.seconds:g} s; loadavg at end {os.getloadavg()[0]:.1f}\n"
    )
    per_round: dict[str, list[tuple[float, float, float]]] = {"podman": [], "cri-prober": []}
    for idle, *contenders in windows:
        idle_rate = idle.busy / idle.wall
        idle_attributed = idle.attributed / idle.wall
        for w in contenders:
            checks = max(w.checks, 1)
            gross = 1000 * w.busy / checks
            net = 1000 * (w.busy - idle_rate * w.wall) / checks
            # The runtime's idle cost (containerd + shims) is charged to neither side.
            base = idle_attributed * w.wall if w.kind == "cri-prober" else 0.0
            attributed = 1000 * (w.attributed - base) / checks
            per_round[w.kind].append((attributed, gross, net))
    rows = []
    for kind, runs in per_round.items():
        rows.append(
            [
                kind,
                " / ".join(fmt(a, 1) for a, _, _ in runs),
                fmt(median([a for a, _, _ in runs]), 1),
                " / ".join(fmt(g, 1) for _, g, _ in runs),
                fmt(median([g for _, g, _ in runs]), 1),
                " / ".join(fmt(n, 1) for _, _, n in runs),
                fmt(median([n for _, _, n in runs]), 1),
            ]
        )
    print(
        table(
            ["", "attributed CPU ms/check, per round", "attributed median",
             "node CPU ms/check (gross)", "gross median", "node, net of idle", "net median"],
            rows,
        )
    )  # fmt: skip
    ratios = [
        p[0] / c[0] for p, c in zip(per_round["podman"], per_round["cri-prober"], strict=True)
    ]
    idle_cpus = [ws[0].busy / ws[0].wall for ws in windows]
    print(
        f"\npodman / cri-prober attributed CPU per check, per round:"
        f" {' / '.join(fmt(r, 1) for r in ratios)}, median {fmt(median(ratios), 1)};"
        f" node busy in the idle windows (CPUs): {' / '.join(fmt(x, 2) for x in idle_cpus)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one round of 8 s windows")
    parser.add_argument("--rate", type=int, default=4, help="containers = checks per second")
    parser.add_argument("--rounds", type=int)
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 4)
    args.seconds = 8.0 if args.quick else 20.0
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
