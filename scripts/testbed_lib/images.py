"""Builds the test images locally, as there is no registry to pull from.

One OCI image layout tarball holds a static busybox image and a "pause" sandbox image sharing one
reproducible layer; the testbed loads it with `ctr images import`.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import platform
import tarfile
from pathlib import Path
from typing import Any

BUSYBOX_IMAGE = "localhost/cri-prober/busybox:test"
PAUSE_IMAGE = "localhost/cri-prober/pause:test"
BUSYBOX_APPLETS = (
    "sh", "sleep", "cat", "true", "false", "httpd", "nc", "echo", "ls", "rm", "touch", "mkdir",
    "env", "test", "kill", "ps", "wget", "printf", "seq", "yes", "head", "date",
)  # fmt: skip
# A sandbox "pause" process that sleeps forever and exits on SIGTERM (a bare `sleep` as PID 1
# would ignore SIGTERM, since PID 1 gets no default signal handlers).
PAUSE_ENTRYPOINT = ["/bin/sh", "-c", 'trap "exit 0" TERM INT; while :; do sleep 3600 & wait; done']


def _tar_add(tar: tarfile.TarFile, name: str, kind: bytes, *, data: bytes = b"", mode: int = 0o755,
             link: str = "") -> None:  # fmt: skip
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.mtime = 0  # reproducible layer, hence a stable image digest across runs
    info.linkname = link
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data) if data else None)


def busybox_layer() -> bytes:
    """The uncompressed root filesystem tar: static busybox, its applet links and a few dirs."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory in ("bin", "dev", "etc", "proc", "root", "sys", "www"):
            _tar_add(tar, directory, tarfile.DIRTYPE)
        _tar_add(tar, "tmp", tarfile.DIRTYPE, mode=0o1777)
        _tar_add(tar, "bin/busybox", tarfile.REGTYPE, data=Path("/usr/bin/busybox").read_bytes())
        for applet in BUSYBOX_APPLETS:
            _tar_add(tar, f"bin/{applet}", tarfile.SYMTYPE, mode=0o777, link="busybox")
        _tar_add(tar, "etc/passwd", tarfile.REGTYPE, data=b"root:x:0:0:root:/root:/bin/sh\n",
                 mode=0o644)  # fmt: skip
        _tar_add(tar, "etc/group", tarfile.REGTYPE, data=b"root:x:0:\n", mode=0o644)
    return buffer.getvalue()


def _digest(blob: bytes) -> str:
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def _oci_arch() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def build_image_archive(path: Path) -> None:
    """Write an OCI image layout tarball holding the busybox and the pause image (one layer)."""
    layer = busybox_layer()
    layer_gz = gzip.compress(layer, mtime=0)
    blobs: dict[str, bytes] = {_digest(layer_gz): layer_gz}
    arch = _oci_arch()

    def add_json(document: dict[str, Any]) -> dict[str, Any]:
        blob = json.dumps(document, sort_keys=True).encode()
        blobs[_digest(blob)] = blob
        return {"digest": _digest(blob), "size": len(blob)}

    manifests = []
    for name, process in (
        (BUSYBOX_IMAGE, {"Cmd": ["sh"]}),
        (PAUSE_IMAGE, {"Entrypoint": PAUSE_ENTRYPOINT}),
    ):
        config = add_json({
            "architecture": arch,
            "os": "linux",
            "config": {"Env": ["PATH=/bin"], "WorkingDir": "/", **process},
            "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]},
        })  # fmt: skip
        manifest = add_json({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config},
            "layers": [{
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                "digest": _digest(layer_gz),
                "size": len(layer_gz),
            }],
        })  # fmt: skip
        manifests.append({
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            **manifest,
            "platform": {"architecture": arch, "os": "linux"},
            "annotations": {
                "io.containerd.image.name": name,
                "org.opencontainers.image.ref.name": name,
            },
        })  # fmt: skip
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": manifests,
    }
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        _tar_add(tar, "oci-layout", tarfile.REGTYPE, data=b'{"imageLayoutVersion":"1.0.0"}',
                 mode=0o644)  # fmt: skip
        _tar_add(tar, "index.json", tarfile.REGTYPE, data=json.dumps(index).encode(), mode=0o644)
        _tar_add(tar, "blobs", tarfile.DIRTYPE)
        _tar_add(tar, "blobs/sha256", tarfile.DIRTYPE)
        for digest, blob in blobs.items():
            _tar_add(tar, f"blobs/sha256/{digest[7:]}", tarfile.REGTYPE, data=blob, mode=0o644)
