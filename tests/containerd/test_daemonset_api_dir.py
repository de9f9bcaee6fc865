"""The shipped DaemonSets' security contexts, run on the kernel against a directory made the
kubelet's way: serve binds its API socket on a fresh node.

tests/unit/test_deploy.py reasons about owners and modes; this runs the pod template's steps with
the users, groups and capabilities a runtime gives them (util-linux setpriv: uid/gid, no
supplementary groups, the bounding set, no_new_privs): the init container's command as root with
CAP_CHOWN alone, then a real ``serve`` as the main container's user with no capability. Issue 35:
on a kubelet v1.28.7 node serve failed here with ``Permission denied`` (exit 2). Not modelled:
the read-only root filesystem and seccomp (neither touches a hostPath). Root only, like every
test in tests/containerd; no containerd is started.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.podsecurity import (
    KUBELET_DIR_GID,
    KUBELET_DIR_MODE,
    KUBELET_DIR_UID,
    effective_security,
    mount_of,
    rehome,
)
from tests.support.waiting import HANG_GUARD

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = [
    REPO / "deploy" / "kubernetes" / "daemonset.yaml",
    REPO / "deploy" / "kubernetes" / "daemonset-podspecs.yaml",
]
CAP_CHOWN_MASK = 1 << 0  # CAP_CHOWN is capability 0


def pod_spec(path: Path) -> dict[str, Any]:
    (daemonset,) = [
        doc for doc in yaml.safe_load_all(path.read_text()) if doc and doc["kind"] == "DaemonSet"
    ]
    spec: dict[str, Any] = daemonset["spec"]["template"]["spec"]
    return spec


@pytest.fixture(name="host_dir")
def _host_dir() -> Iterator[Path]:
    """/run/cri-prober as the kubelet makes it (root, umask 0022, MkdirAll 0755), under a
    parent every user may search (tmp_path's is root's 0700)."""
    base = Path(tempfile.mkdtemp(prefix="cri-prober-hostpath-"))
    try:
        base.chmod(0o755)
        directory = base / "run" / "cri-prober"
        old_umask = os.umask(0o022)
        try:
            directory.mkdir(parents=True, mode=KUBELET_DIR_MODE)
        finally:
            os.umask(old_umask)
        info = directory.stat()
        assert (info.st_uid, info.st_gid) == (KUBELET_DIR_UID, KUBELET_DIR_GID)
        assert stat.S_IMODE(info.st_mode) == KUBELET_DIR_MODE
        yield directory
    finally:
        shutil.rmtree(base)


async def run(argv: list[str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


def serve_argv(spec: dict[str, Any], host_dir: Path) -> list[str]:
    """The main container's serve, its API socket in ``host_dir``, a runtime that is not there
    (the socket is bound before the runtime is asked anything) and no metrics port."""
    (main,) = spec["containers"]
    security = effective_security(spec, main)
    listen = f"unix://{host_dir}/cri-prober.sock"
    return [
        *security.setpriv(),
        sys.executable,
        "-m",
        "cri_prober",
        "serve",
        f"--listen={listen}",
        f"--runtime-endpoint=unix://{host_dir.parent}/no-containerd.sock",
        "--log-format=json",
    ]


async def serve_until_listening(
    argv: list[str], socket: Path
) -> tuple[int | None, str, os.stat_result | None]:
    """Start serve; once it logs ``api_listening``, return (None, log, the socket's stat) and
    stop it (it removes its socket then); if it ends first, its exit code and log."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        async with asyncio.timeout(HANG_GUARD):  # a hang guard: it listens within a second or two
            while line := (await proc.stdout.readline()).decode(errors="replace"):
                lines.append(line)
                if '"event": "api_listening"' in line:
                    return None, "".join(lines), socket.lstat()
            return await proc.wait(), "".join(lines), None
    finally:
        if proc.returncode is None:
            proc.terminate()
            await proc.communicate()


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda path: path.name)
async def test_serve_binds_in_a_directory_the_kubelet_created(
    manifest: Path, host_dir: Path
) -> None:
    """The kubelet's root:root 0755 directory alone refuses serve (the issue's failure); after
    the init containers ran as the pod template says, serve binds its socket there, owned by its
    user, mode 0600."""
    spec = pod_spec(manifest)
    (main,) = spec["containers"]
    volume = next(m["name"] for m in main["volumeMounts"] if m["mountPath"] == "/run/cri-prober")

    # The failure: serve as uid 65532 in the directory as the kubelet left it.
    socket = host_dir / "cri-prober.sock"
    code, log, _ = await serve_until_listening(serve_argv(spec, host_dir), socket)
    assert code == 2, log
    assert "Permission denied" in log, log

    for init in spec.get("initContainers", []):
        path = mount_of(init, volume)
        if path is None:
            continue
        security = effective_security(spec, init)
        # The wrapper gives the process exactly the capabilities the context adds.
        code, status = await run([*security.setpriv(), "cat", "/proc/self/status"])
        assert code == 0, status
        effective = next(line for line in status.splitlines() if line.startswith("CapEff:"))
        assert int(effective.split()[1], 16) == CAP_CHOWN_MASK, effective
        argv = rehome([*init.get("command", []), *init.get("args", [])], path, host_dir)
        code, out = await run([*security.setpriv(), *argv])
        assert code == 0, out

    code, log, bound = await serve_until_listening(serve_argv(spec, host_dir), socket)
    assert code is None, log
    assert bound is not None
    serve = effective_security(spec, main)
    assert stat.S_ISSOCK(bound.st_mode)
    assert (bound.st_uid, stat.S_IMODE(bound.st_mode)) == (serve.uid, 0o600)
    directory = host_dir.stat()
    assert (directory.st_uid, directory.st_gid) == (serve.uid, serve.gid)
    # The pod's next start (a restart, a rollout): the directory is already serve's, and the
    # init step, run again as root with CAP_CHOWN alone, still succeeds.
    for init in spec.get("initContainers", []):
        path = mount_of(init, volume)
        if path is not None:
            security = effective_security(spec, init)
            argv = rehome([*init.get("command", []), *init.get("args", [])], path, host_dir)
            code, out = await run([*security.setpriv(), *argv])
            assert code == 0, out
    code, log, bound = await serve_until_listening(serve_argv(spec, host_dir), socket)
    assert code is None, log
