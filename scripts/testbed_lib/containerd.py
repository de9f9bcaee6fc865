"""Starts a testbed: writes containerd's config, launches containerd in its own session, and waits
until CRI serves (checked through grpcio, see cri) and sees the imported test images.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from . import cri
from .common import TestbedError, log, run
from .images import BUSYBOX_IMAGE, PAUSE_IMAGE, build_image_archive
from .network import CNI_BIN_DIR, bridge_for, claim_subnet, subnet_for, write_cni_config
from .packages import binaries_present, containerd_bin_dir, containerd_version_string
from .procs import containerd_pid

T = TypeVar("T")

MAX_SOCKET_PATH = 104  # containerd refuses longer unix socket paths


def _toml(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def write_containerd_config(directory: Path) -> None:
    """Version-2 config: 1.6 and 1.7 read it as is, 2.x migrates it in memory (with a warning)."""
    cri = '[plugins."io.containerd.grpc.v1.cri"]'
    (directory / "config.toml").write_text(f"""\
version = 2
root = {_toml(str(directory / "root"))}
state = {_toml(str(directory / "state"))}
# Snapshotters that cannot work here only add startup noise. The opt plugin would create
# /opt/containerd and NRI (enabled by default in 2.x) would bind the machine-wide
# /var/run/nri/nri.sock, which would make parallel testbeds collide.
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.internal.v1.opt",
  "io.containerd.nri.v1.nri",
]

[grpc]
  address = {_toml(str(directory / "containerd.sock"))}

[ttrpc]
  address = {_toml(str(directory / "containerd.sock.ttrpc"))}

{cri}
  # Without it every RunPodSandbox fails: the sandbox's oom_score_adj -998 is refused here.
  restrict_oom_score_adj = true
  # There is no registry: the sandbox image is one we import ourselves.
  sandbox_image = {_toml(PAUSE_IMAGE)}
  # Network namespaces are mounted under the state dir instead of the shared /var/run/netns.
  netns_mounts_under_state_dir = true

{cri[:-1]}.cni]
  bin_dir = {_toml(CNI_BIN_DIR)}
  conf_dir = {_toml(str(directory / "cni" / "net.d"))}
""")


def log_tail(directory: Path, lines: int = 40) -> str:
    try:
        text = (directory / "containerd.log").read_text(errors="replace")
    except OSError:
        return "(no containerd.log)"
    return "\n".join(text.splitlines()[-lines:]) or "(containerd.log is empty)"


def launch_containerd(directory: Path, bin_dir: Path) -> subprocess.Popen[bytes]:
    """Start containerd in its own session, logging to DIR/containerd.log; record its PID."""
    # containerd finds containerd-shim-runc-v2 (and the shim finds runc) through PATH.
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}:/usr/sbin:/usr/bin:/sbin:/bin",
    }
    with open(directory / "containerd.log", "ab") as log_file:
        process = subprocess.Popen(
            [str(bin_dir / "containerd"), "--config", str(directory / "config.toml")],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # setsid: the testbed outlives this script and its terminal
        )
    (directory / "containerd.pid").write_text(f"{process.pid}\n")
    return process


def wait_until_ready(
    directory: Path, process: subprocess.Popen[bytes], bin_dir: Path, deadline: float
) -> str:
    """Wait for the CRI server, import the images and wait until CRI sees them.

    Returns the CRI runtime_version. Raises TestbedError with the log tail on exit or timeout.
    """
    sock = directory / "containerd.sock"

    def wait_until(what: str, ready: Callable[[], T | None]) -> T:
        while True:
            if process.poll() is not None:
                raise TestbedError(
                    f"containerd exited with {process.returncode} while waiting for {what};"
                    f" log tail:\n{log_tail(directory)}"
                )
            result = ready()
            if result:
                return result
            if time.monotonic() > deadline:
                raise TestbedError(
                    f"timed out waiting for {what}; log tail:\n{log_tail(directory)}"
                )
            time.sleep(0.1)

    runtime_version = wait_until(
        "the CRI server", lambda: cri.runtime_version(sock) if sock.exists() else None
    )
    log(f"CRI ready (runtime_version {runtime_version})")

    # The CRI plugin sees namespace k8s.io only. 1.7 and 2.x import through the transfer
    # service (1.6 in the client); all name the images from the index annotation and unpack them.
    ctr = [str(bin_dir / "ctr"), "-a", str(sock), "-n", "k8s.io"]

    def import_images() -> bool | None:
        proc = run(
            [*ctr, "images", "import", str(directory / "images.tar")], check=False, timeout=60
        )
        if proc.returncode != 0:
            log(f"image import failed, retrying: {proc.stderr.strip()}")
        return proc.returncode == 0 or None

    wait_until("the image import", import_images)
    images = (BUSYBOX_IMAGE, PAUSE_IMAGE)
    wait_until(
        "the CRI image cache", lambda: all(cri.image_present(sock, i) for i in images) or None
    )
    return runtime_version


def start_testbed(
    directory: Path, version: str, wanted_index: int | None, timeout: float
) -> dict[str, Any]:
    """Configure, launch and wait for a containerd; return the testbed description."""
    cri.require_grpc()
    if not binaries_present(version):
        raise TestbedError(
            f"containerd {version} is not installed: run `testbed.py install --version {version}`"
        )
    for tool in ("runc", "ip", "busybox"):
        if shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None:
            raise TestbedError(f"{tool} is missing: run `testbed.py install`")
    if containerd_pid(directory) is not None:
        raise TestbedError(f"a testbed is already running in {directory} (see `env --dir`)")
    if len(str(directory / "containerd.sock.ttrpc")) > MAX_SOCKET_PATH:
        raise TestbedError(f"{directory} is too long a path for containerd's unix sockets")
    started = time.monotonic()
    directory.mkdir(parents=True, exist_ok=True)
    index = claim_subnet(directory, wanted_index)
    write_cni_config(directory, index)
    write_containerd_config(directory)
    build_image_archive(directory / "images.tar")

    bin_dir = containerd_bin_dir(version)
    process = launch_containerd(directory, bin_dir)
    log(f"containerd {version} started, pid {process.pid}, log {directory / 'containerd.log'}")
    try:
        runtime_version = wait_until_ready(directory, process, bin_dir, started + timeout)
    except BaseException:
        # Stopped through the handle, which also reaps it (no zombie); the caller does the rest.
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        raise
    sock = directory / "containerd.sock"
    info = {
        "version": version,
        "endpoint": f"unix://{sock}",
        "socket": str(sock),
        "pid": process.pid,
        "dir": str(directory),
        "busybox_image": BUSYBOX_IMAGE,
        "pause_image": PAUSE_IMAGE,
        "subnet": subnet_for(index),
        "bridge": bridge_for(index),
        "subnet_index": index,
        "containerd_version": containerd_version_string(version),
        "runtime_version": runtime_version,
        "ctr": str(bin_dir / "ctr"),
        "log": str(directory / "containerd.log"),
    }
    (directory / "testbed.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"testbed ready in {time.monotonic() - started:.1f}s")
    return info
