"""Stops a testbed, idempotently: pods through CRI (ctr as the fallback), containerd, leftover
shims and container processes, mounts, the network and the directory.

Works without grpcio too (e.g. from the system python), with a warning and ctr doing the cleanup.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
from pathlib import Path

from . import cri
from .common import TestbedError, log, run
from .network import CNI_CACHE_DIR, release_subnet, remove_network
from .procs import cmdline, containerd_pid, parent_pids, processes, wait_gone


def testbed_shims(directory: Path) -> list[int]:
    """Shim processes started by this testbed's containerd (their -address points into DIR)."""
    shims = []
    for pid in processes():
        argv = cmdline(pid)
        if not argv or not Path(argv[0]).name.startswith("containerd-shim"):
            continue
        for flag, value in itertools.pairwise(argv):
            if flag in ("-address", "--address") and value.startswith(f"{directory}/"):
                shims.append(pid)
    return shims


def kill_shims(directory: Path) -> None:
    """SIGKILL leftover shims together with the container processes below them."""
    shims = testbed_shims(directory)
    if not shims:
        return
    parents = parent_pids()
    victims: list[int] = []
    frontier = list(shims)
    while frontier:  # every descendant, so no container process is left behind to init
        victims += frontier
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
    log(f"killing leftover shims {shims} and their {len(victims) - len(shims)} descendants")
    for pid in reversed(victims):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if alive := wait_gone(victims, 5):
        log(f"WARNING: processes still alive after SIGKILL: {alive}")


def sweep_orphaned_tasks(directory: Path) -> None:
    """Clean up after tasks containerd did not delete (it crashed or was killed).

    Their runc state and cgroups, shims, shim sockets (outside DIR) and CRI's loopback CNI cache
    entries would otherwise outlive the testbed. A no-op after a clean teardown.
    """
    task_dirs = sorted((directory / "state" / "io.containerd.runtime.v2.task").glob("*/*"))
    runc = shutil.which("runc", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")
    for task_dir in task_dirs:
        namespace, task = task_dir.parent.name, task_dir.name
        if runc is not None:  # kills what is left of the container, removes its cgroups and state
            run([runc, "--root", f"/run/containerd/runc/{namespace}", "delete", "--force", task],
                check=False)  # fmt: skip
    kill_shims(directory)
    for task_dir in task_dirs:
        address = ""
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if (task_dir / "bootstrap.json").exists():  # 2.x
                address = json.loads((task_dir / "bootstrap.json").read_text())["address"]
            else:
                address = (task_dir / "address").read_text().strip()
        if address.startswith("unix:///run/containerd/s/"):
            Path(address.removeprefix("unix://")).unlink(missing_ok=True)
        (CNI_CACHE_DIR / f"cni-loopback-{task_dir.name}-lo").unlink(missing_ok=True)
    if task_dirs:
        log(f"swept {len(task_dirs)} orphaned tasks")


def teardown_containers(directory: Path, pid: int) -> None:
    """Remove pods through CRI (which also tears down their network), then sweep with ctr."""
    sock = directory / "containerd.sock"
    if not sock.exists():  # containerd never got as far as serving
        return
    try:
        for sandbox in cri.sandbox_ids(sock):
            log(f"removing pod sandbox {sandbox[:13]}")
            for method in ("StopPodSandbox", "RemovePodSandbox"):
                if not cri.sandbox_call(sock, method, sandbox, timeout=60):
                    log(f"WARNING: {method} {sandbox[:13]} failed")
    except (OSError, TestbedError) as error:
        log(f"WARNING: CRI teardown failed ({error}); falling back to ctr")
    try:
        ctr_binary = str(Path(os.readlink(f"/proc/{pid}/exe")).parent / "ctr")
    except OSError:
        return
    ctr = [ctr_binary, "-a", str(sock), "-n", "k8s.io"]
    tasks = run([*ctr, "tasks", "ls", "-q"], check=False, timeout=30).stdout.split()
    for task in tasks:
        run([*ctr, "tasks", "kill", "-s", "SIGKILL", task], check=False, timeout=30)
        run([*ctr, "tasks", "delete", "-f", task], check=False, timeout=30)
    containers = run([*ctr, "containers", "ls", "-q"], check=False, timeout=30).stdout.split()
    for container in containers:
        run([*ctr, "containers", "delete", container], check=False, timeout=30)
    if tasks or containers:
        log(f"ctr removed {len(tasks)} tasks and {len(containers)} containers")


def stop_containerd(directory: Path, pid: int) -> None:
    os.kill(pid, signal.SIGTERM)
    if wait_gone([pid], 10):
        log(f"containerd {pid} ignored SIGTERM for 10s; sending SIGKILL")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        wait_gone([pid], 5)
    log(f"containerd {pid} stopped")


def _unescape_mountinfo(path: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), path)


def mounts_under(directory: Path) -> list[str]:
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mount_point = _unescape_mountinfo(line.split()[4])
        if mount_point == str(directory) or mount_point.startswith(f"{directory}/"):
            mounts.append(mount_point)
    return mounts


def unmount_all(directory: Path) -> None:
    """Lazily unmount everything below DIR, deepest first (rootfs overlays, netns, shm)."""
    for _ in range(5):  # a mount point can be stacked several times
        mounts = mounts_under(directory)
        if not mounts:
            return
        for mount_point in sorted(set(mounts), key=lambda p: p.count("/"), reverse=True):
            run(["umount", "-l", mount_point], check=False)
    if remaining := mounts_under(directory):
        raise TestbedError(f"still mounted under {directory}: {remaining}")


def stop_testbed(directory: Path, *, keep_dir: bool) -> None:
    """Idempotent: tears down whatever part of a testbed exists."""
    pid = containerd_pid(directory)
    if pid is not None:
        teardown_containers(directory, pid)
        stop_containerd(directory, pid)
    sweep_orphaned_tasks(directory)
    unmount_all(directory)
    remove_network(directory)
    release_subnet(directory)
    if not keep_dir and directory.exists():
        shutil.rmtree(directory)
        log(f"removed {directory}")
