"""A pod template's security contexts as a container runtime applies them: the user, group and
capabilities each container of the shipped DaemonSets runs with, and the API socket's directory
as the kubelet creates it. tests/unit/test_deploy.py reasons with them; the root-only
tests/containerd/test_daemonset_api_dir.py runs them on the kernel with setpriv.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A hostPath of type DirectoryOrCreate that does not exist is made by the kubelet (root, umask
# 0022) with os.MkdirAll(path, 0755) (its hostPath volume plugin): root:root 0755, writable by
# root alone. Seen on a kubelet v1.28.7 node (issue 35).
KUBELET_DIR_UID = 0
KUBELET_DIR_GID = 0
KUBELET_DIR_MODE = 0o755


@dataclass(frozen=True)
class Security:
    """One container's effective security context (its own over the pod's)."""

    uid: int | None  # None: the image's USER
    gid: int | None
    run_as_non_root: bool
    no_new_privs: bool
    read_only_root: bool
    drop: tuple[str, ...]
    add: tuple[str, ...]

    def capabilities(self) -> set[str]:
        """The capabilities the process holds (upper case, without CAP_): a root process holds
        the runtime's default set unless ALL is dropped; a non-root one holds none."""
        if self.uid != 0:
            return set()
        assert "ALL" in self.drop, "only a context that drops ALL is modelled"
        return set(self.add)

    def setpriv(self) -> list[str]:
        """The util-linux setpriv command line that runs a process like the runtime would: the
        user and group, no supplementary groups, the bounding set (what a root process keeps
        across exec) cut to the added capabilities, no_new_privs."""
        setpriv = shutil.which("setpriv")
        assert setpriv is not None, "setpriv (util-linux) is needed"
        assert self.uid is not None, "set runAsUser"
        assert self.gid is not None, "set runAsGroup"
        caps = "".join(f",+{cap.lower()}" for cap in self.add)
        argv = [
            setpriv,
            f"--reuid={self.uid}",
            f"--regid={self.gid}",
            "--clear-groups",
            f"--bounding-set=-all{caps}",
            "--inh-caps=-all",
        ]
        if self.no_new_privs:
            argv.append("--no-new-privs")
        return [*argv, "--"]


def effective_security(pod_spec: dict[str, Any], container: dict[str, Any]) -> Security:
    """``container``'s security context over the pod's, as the kubelet merges them."""
    pod = pod_spec.get("securityContext", {})
    own = container.get("securityContext", {})

    def pick(key: str) -> Any:
        return own[key] if key in own else pod.get(key)

    capabilities = own.get("capabilities", {})
    return Security(
        uid=pick("runAsUser"),
        gid=pick("runAsGroup"),
        run_as_non_root=bool(pick("runAsNonRoot")),
        # Kubernetes sets no_new_privs unless allowPrivilegeEscalation is true (or privileged).
        no_new_privs=own.get("allowPrivilegeEscalation") is False,
        read_only_root=bool(own.get("readOnlyRootFilesystem")),
        drop=tuple(capabilities.get("drop", ())),
        add=tuple(capabilities.get("add", ())),
    )


def mount_of(container: dict[str, Any], volume: str) -> str | None:
    """Where ``container`` mounts ``volume`` (None: it does not)."""
    for mount in container.get("volumeMounts", []):
        if mount["name"] == volume:
            path: str = mount["mountPath"]
            return path
    return None


def rehome(argv: list[str], mount_path: str, host_dir: Path) -> list[str]:
    """A container's command with its mount path replaced by the host directory behind it."""
    return [
        str(host_dir) + arg[len(mount_path) :]
        if arg == mount_path or arg.startswith(mount_path + "/")
        else arg
        for arg in argv
    ]


__all__ = [
    "KUBELET_DIR_GID",
    "KUBELET_DIR_MODE",
    "KUBELET_DIR_UID",
    "Security",
    "effective_security",
    "mount_of",
    "rehome",
]
