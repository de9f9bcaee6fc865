#!/usr/bin/env python3
"""Start and stop private, real containerd instances (1.6, 1.7, 2.1) for cri-prober tests and demos.

Each testbed lives in its own directory (config, root, state, socket, CNI network, log) and never
touches a system containerd. Standard library only: it runs before cri-prober is installed.

    testbed.py install [--version 1.6|1.7|2.1 ...]
    testbed.py start --dir DIR [--version 1.6] [--subnet-index N|auto]   # prints the testbed JSON
    testbed.py env --dir DIR
    testbed.py stop --dir DIR [--keep-dir]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import hashlib
import io
import itertools
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

VERSIONS = ("1.6", "1.7", "2.1")
# 1.6 is bookworm's own containerd (installed system-wide); newer ones come from these suites.
PRIVATE_SUITES = {"1.7": "trixie", "2.1": "sid"}
APT_PACKAGES = ("containerd", "runc", "containernetworking-plugins", "busybox-static", "iproute2")
DEBIAN_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
DEFAULT_CACHE = "/var/cache/cri-prober-testbed"

BUSYBOX_IMAGE = "localhost/cri-prober/busybox:test"
PAUSE_IMAGE = "localhost/cri-prober/pause:test"
BUSYBOX_APPLETS = (
    "sh", "sleep", "cat", "true", "false", "httpd", "nc", "echo", "ls", "rm", "touch", "mkdir",
    "env", "test", "kill", "ps", "wget", "printf", "seq", "yes", "head", "date",
)  # fmt: skip
# A sandbox "pause" process that sleeps forever and exits on SIGTERM (a bare `sleep` as PID 1
# would ignore SIGTERM, since PID 1 gets no default signal handlers).
PAUSE_ENTRYPOINT = ["/bin/sh", "-c", 'trap "exit 0" TERM INT; while :; do sleep 3600 & wait; done']

# Subnet claims live on tmpfs: they vanish at reboot, as the bridges do.
CLAIMS_DIR = Path("/run/cri-prober-testbed")
MAX_SUBNET_INDEX = 99  # 10.88.100.0/24 .. 10.88.199.0/24

MAX_SOCKET_PATH = 104  # containerd refuses longer unix socket paths

CNI_BIN_DIR = "/usr/lib/cni"
CNI_CACHE_DIR = Path("/var/lib/cni/results")  # libcni's default, not configurable through CRI


class TestbedError(Exception):
    """A failure the user should read; printed without a traceback."""


def log(message: str) -> None:
    """Progress for humans on stderr; stdout is reserved for JSON."""
    print(f"testbed: {message}", file=sys.stderr, flush=True)


def run(
    argv: Sequence[str],
    *,
    check: bool = True,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command, capturing its output; on failure with check=True, raise with that output."""
    proc = subprocess.run(
        list(argv), capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, check=False
    )
    if check and proc.returncode != 0:
        raise TestbedError(
            f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}".rstrip()
        )
    return proc


# --------------------------------------------------------------------------------------------
# install


def missing_debian_packages() -> list[str]:
    """The APT_PACKAGES that dpkg does not report as installed."""
    missing = []
    for package in APT_PACKAGES:
        proc = run(["dpkg-query", "-W", "-f=${Status}", package], check=False)
        if proc.returncode != 0 or not proc.stdout.endswith(" installed"):
            missing.append(package)
    return missing


def install_debian_packages() -> None:
    """apt-get install whatever is missing, refreshing the package lists only when needed."""
    missing = missing_debian_packages()
    if not missing:
        log(f"Debian packages already installed: {' '.join(APT_PACKAGES)}")
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    log("apt-get update")
    run(["apt-get", "-q", "update"], env=env)
    log(f"apt-get install {' '.join(missing)}")
    run(
        [
            "apt-get",
            "-q",
            "-y",
            "--no-install-recommends",
            "-oDPkg::Lock::Timeout=300",
            "install",
            *missing,
        ],
        env=env,
    )


def _os_codename() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("VERSION_CODENAME="):
                return line.partition("=")[2].strip().strip('"')
    return ""


def _apt_source_entries() -> Iterator[tuple[str, list[str]]]:
    """(URI, suites) of every enabled `deb` entry in the system's apt sources, in apt's order."""
    files = [Path("/etc/apt/sources.list")]
    parts = Path("/etc/apt/sources.list.d")
    if parts.is_dir():
        files += sorted(parts.iterdir())
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if path.suffix == ".list" or path.name == "sources.list":
            for line in text.splitlines():
                # deb [options] URI suite components...
                words = re.sub(r"\[[^\]]*\]", " ", line.split("#", 1)[0]).split()
                if len(words) >= 3 and words[0] == "deb":
                    yield words[1], [words[2]]
        elif path.suffix == ".sources":
            for stanza in re.split(r"\n\s*\n", text):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if line.startswith("#") or ":" not in line or line[:1].isspace():
                        continue
                    key, _, value = line.partition(":")
                    fields[key.strip().lower()] = value.strip()
                if fields.get("enabled", "yes").lower() == "no":
                    continue
                if "deb" not in fields.get("types", "").split():
                    continue
                suites = fields.get("suites", "").split()
                for uri in fields.get("uris", "").split():
                    yield uri, suites


def debian_mirror() -> str:
    """The Debian mirror this machine's apt already uses (the one carrying its release suite)."""
    entries = list(_apt_source_entries())
    codename = _os_codename()
    for uri, suites in entries:
        if codename and codename in suites:
            return uri.rstrip("/")
    for uri, _ in entries:
        if uri.rstrip("/").endswith("/debian"):
            return uri.rstrip("/")
    raise TestbedError("cannot find a Debian mirror in /etc/apt/sources.list(.d)")


def cache_root() -> Path:
    return Path(os.environ.get("CRI_PROBER_TESTBED_CACHE", DEFAULT_CACHE))


def private_root(version: str) -> Path:
    """Where the .deb of a private containerd version is extracted (its binaries: usr/bin)."""
    return cache_root() / f"containerd-{version}" / "root"


def containerd_bin_dir(version: str) -> Path:
    return Path("/usr/bin") if version == "1.6" else private_root(version) / "usr" / "bin"


def binaries_present(version: str) -> bool:
    bin_dir = containerd_bin_dir(version)
    return all((bin_dir / name).exists() for name in ("containerd", "ctr"))


def containerd_version_string(version: str) -> str:
    return run([str(containerd_bin_dir(version) / "containerd"), "--version"]).stdout.strip()


def check_containerd_version(version: str) -> None:
    """Warn (not fail) when the suite no longer carries the minor version we asked for."""
    reported = containerd_version_string(version)
    if re.search(rf"\s{re.escape(version)}\.", reported):
        log(f"containerd {version}: {reported}")
    else:
        log(f"WARNING: asked for containerd {version}, but the binary says: {reported}")


def fetch_private_containerd(version: str) -> None:
    """Download and extract the `containerd` .deb of a newer suite without touching apt's state."""
    suite = PRIVATE_SUITES[version]
    work = cache_root() / f"containerd-{version}"
    root = work / "root"
    work.mkdir(parents=True, exist_ok=True)
    # Two sessions may install at once: the second waits, then finds the cache filled.
    with open(work.parent / f"containerd-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if binaries_present(version):
            log(f"containerd {version} already cached in {root}")
        else:
            download_containerd(suite, work)
    check_containerd_version(version)


def download_containerd(suite: str, work: Path) -> None:
    """apt-get download the suite's containerd with private apt state; dpkg -x it to work/root."""
    started = time.monotonic()
    root = work / "root"
    mirror = debian_mirror()
    apt_dir = work / "apt"
    shutil.rmtree(apt_dir, ignore_errors=True)
    (apt_dir / "lists" / "partial").mkdir(parents=True)
    (apt_dir / "cache" / "archives" / "partial").mkdir(parents=True)
    sources = apt_dir / "sources.list"
    sources.write_text(f"deb [signed-by={DEBIAN_KEYRING}] {mirror} {suite} main\n")
    apt_options = [
        f"-oDir::Etc::SourceList={sources}",
        "-oDir::Etc::SourceParts=/dev/null",
        f"-oDir::State::Lists={apt_dir / 'lists'}",
        # Keeps apt's binary package caches (pkgcache.bin) out of /var/cache/apt too.
        f"-oDir::Cache={apt_dir / 'cache'}",
        # The private directory is root's; apt's _apt download sandbox could not write there.
        "-oAPT::Sandbox::User=root",
    ]
    log(f"apt-get update ({mirror} {suite}, private lists in {apt_dir})")
    run(["apt-get", "-q", *apt_options, "update"])
    log(f"apt-get download containerd ({suite})")
    run(["apt-get", "-q", *apt_options, "download", "containerd"], cwd=apt_dir)
    debs = sorted(apt_dir.glob("containerd_*.deb"))
    if not debs:
        raise TestbedError(f"apt-get download left no containerd .deb in {apt_dir}")
    # Extract next to the final place and rename, so a half-extracted tree is never used.
    staging = Path(tempfile.mkdtemp(prefix="root.", dir=work))
    log(f"dpkg -x {debs[0].name} {root}")
    try:
        run(["dpkg", "-x", str(debs[0]), str(staging)])
    except TestbedError:
        shutil.rmtree(staging)
        raise
    shutil.rmtree(root, ignore_errors=True)
    staging.rename(root)
    shutil.rmtree(apt_dir)  # lists and .deb are ~45 MB; the extracted tree is all we need
    log(f"{debs[0].name} fetched and extracted in {time.monotonic() - started:.1f}s")


def cmd_install(args: argparse.Namespace) -> None:
    started = time.monotonic()
    install_debian_packages()
    for version in args.version or ["1.6"]:
        if version == "1.6":
            check_containerd_version(version)
        else:
            fetch_private_containerd(version)
    log(f"install done in {time.monotonic() - started:.1f}s")


# --------------------------------------------------------------------------------------------
# OCI image layout


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


# --------------------------------------------------------------------------------------------
# A minimal gRPC client (HTTP/2 over the unix socket) for the few CRI calls this script makes.
# grpcio is not available before the package is installed, and `ctr` cannot tell whether the CRI
# server has finished initialising (until then every CRI call answers UNAVAILABLE).

_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY, _WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
_END_STREAM = _ACK = 0x1
_END_HEADERS = 0x4
_MAX_WINDOW = 2**31 - 1


def _h2_frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload
    )


def _hpack_length(value: int) -> bytes:
    """An HPACK integer with a 7-bit prefix and the Huffman bit clear (RFC 7541 §5.1)."""
    if value < 127:
        return bytes([value])
    out, value = [127], value - 127
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    return bytes([*out, value])


def _hpack_literal(name: str, value: str) -> bytes:
    """'Literal header field without indexing, new name': needs no HPACK tables on either side."""
    raw_name, raw_value = name.encode(), value.encode()
    return (
        b"\x00"
        + _hpack_length(len(raw_name))
        + raw_name
        + _hpack_length(len(raw_value))
        + raw_value
    )


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise ConnectionError("connection closed by the server")
        chunks += chunk
    return bytes(chunks)


def grpc_unary(
    socket_path: Path, method: str, request: bytes, timeout: float = 10.0
) -> bytes | None:
    """Call one unary gRPC method; return the response message, or None if the call failed.

    Response headers are not decoded (that needs HPACK's Huffman table): a server sends a response
    message only with status OK, and answers errors with trailers alone, so "got a message" is OK.
    Connection-level failures raise OSError.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(socket_path))
        settings = (2).to_bytes(2, "big") + (0).to_bytes(4, "big")  # ENABLE_PUSH = 0
        settings += (4).to_bytes(2, "big") + _MAX_WINDOW.to_bytes(4, "big")  # INITIAL_WINDOW_SIZE
        headers = b"".join(
            _hpack_literal(name, value)
            for name, value in (
                (":method", "POST"),
                (":scheme", "http"),
                (":path", method),
                (":authority", "localhost"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            )
        )
        body = b"\x00" + len(request).to_bytes(4, "big") + request
        sock.sendall(
            _H2_PREFACE
            + _h2_frame(_SETTINGS, 0, 0, settings)
            + _h2_frame(_WINDOW_UPDATE, 0, 0, (_MAX_WINDOW - 65535).to_bytes(4, "big"))
            + _h2_frame(_HEADERS, _END_HEADERS, 1, headers)
            + _h2_frame(_DATA, _END_STREAM, 1, body)
        )
        data = bytearray()
        while True:
            header = _recv_exact(sock, 9)
            kind, flags = header[3], header[4]
            stream = int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
            payload = _recv_exact(sock, int.from_bytes(header[:3], "big"))
            if kind == _SETTINGS and not flags & _ACK:
                sock.sendall(_h2_frame(_SETTINGS, _ACK, 0, b""))
            elif kind == _PING and not flags & _ACK:
                sock.sendall(_h2_frame(_PING, _ACK, 0, payload))
            elif kind == _GOAWAY or (kind == _RST_STREAM and stream == 1):
                return None
            elif stream == 1 and kind in (_DATA, _HEADERS):
                if kind == _DATA:
                    data += payload
                if flags & _END_STREAM:
                    break
    if len(data) < 5:
        return None
    return bytes(data[5 : 5 + int.from_bytes(data[1:5], "big")])


def _pb_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if not value:
            return bytes([*out, byte])
        out.append(byte | 0x80)


def pb_string(field: int, value: str | bytes) -> bytes:
    """A length-delimited protobuf field."""
    raw = value.encode() if isinstance(value, str) else value
    return _pb_varint(field << 3 | 2) + _pb_varint(len(raw)) + raw


def pb_fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of every field of a protobuf message; varints as int, else bytes."""
    pos = 0

    def varint() -> int:
        nonlocal pos
        result = shift = 0
        while True:
            byte = buf[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return result

    while pos < len(buf):
        key = varint()
        wire = key & 7
        if wire == 0:
            yield key >> 3, varint()
        elif wire in (1, 2, 5):
            size = {1: 8, 5: 4}.get(wire) or varint()
            yield key >> 3, buf[pos : pos + size]
            pos += size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")


CRI_RUNTIME = "/runtime.v1.RuntimeService/"
CRI_IMAGES = "/runtime.v1.ImageService/"


def cri_runtime_version(sock: Path) -> str | None:
    """VersionResponse.runtime_version, or None while the CRI server is not ready."""
    try:
        response = grpc_unary(sock, CRI_RUNTIME + "Version", b"", timeout=5)
    except OSError:
        return None
    if response is None:
        return None
    fields = dict(pb_fields(response))
    value = fields.get(3, b"")
    return value.decode() if isinstance(value, bytes) else None


def cri_image_present(sock: Path, image: str) -> bool:
    """ImageStatus: the CRI image cache learns of imported images asynchronously, via events."""
    try:
        response = grpc_unary(sock, CRI_IMAGES + "ImageStatus", pb_string(1, pb_string(1, image)))
    except OSError:
        return False
    return response is not None and any(number == 1 for number, _ in pb_fields(response))


def cri_sandbox_ids(sock: Path) -> list[str]:
    response = grpc_unary(sock, CRI_RUNTIME + "ListPodSandbox", b"")
    if response is None:
        raise TestbedError("ListPodSandbox failed")
    ids = []
    for number, item in pb_fields(response):
        if number == 1 and isinstance(item, bytes):
            ids += [
                value.decode()
                for n, value in pb_fields(item)
                if n == 1 and isinstance(value, bytes)
            ]
    return ids


# --------------------------------------------------------------------------------------------
# start


def subnet_for(index: int) -> str:
    return f"10.88.{100 + index}.0/24"


def bridge_for(index: int) -> str:
    return f"cprb{index}"


def _pid_alive(pid: int) -> bool:
    """True for a live process; a zombie (e.g. our own unreaped containerd child) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The command name in field 2 may contain spaces and parentheses: split after it.
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [arg.decode(errors="replace") for arg in raw.split(b"\0")[:-1]]


def containerd_pid(directory: Path) -> int | None:
    """The PID recorded for this testbed, if that process is alive and is still our containerd."""
    try:
        pid = int((directory / "containerd.pid").read_text())
    except (OSError, ValueError):
        return None
    # Guards against PID reuse: our containerd carries our config path in its argv.
    if _pid_alive(pid) and str(directory / "config.toml") in _cmdline(pid):
        return pid
    return None


def _claim_is_live(claim: Path) -> bool:
    """A claim stays valid while its testbed directory exists and is starting or running."""
    try:
        directory = Path(os.readlink(claim))
    except OSError:
        return False
    if not directory.is_dir():
        return False
    return not (directory / "containerd.pid").exists() or containerd_pid(directory) is not None


def claim_subnet(directory: Path, wanted: int | None) -> int:
    """Reserve a subnet index (bridge cprbN, 10.88.(100+N).0/24) for this testbed.

    A claim is a symlink CLAIMS_DIR/net-N -> testbed dir, made under a lock, so concurrent
    testbeds (other pytest sessions too) never share a bridge; stale claims are taken over.
    """
    CLAIMS_DIR.mkdir(parents=True, exist_ok=True)
    with open(CLAIMS_DIR / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        candidates = [wanted] if wanted is not None else range(MAX_SUBNET_INDEX + 1)
        for index in candidates:
            claim = CLAIMS_DIR / f"net-{index}"
            if claim.is_symlink():
                if Path(os.readlink(claim)) == directory:
                    return index
                if _claim_is_live(claim):
                    continue
                claim.unlink()
            os.symlink(directory, claim)
            return index
    if wanted is not None:
        owner = os.readlink(CLAIMS_DIR / f"net-{wanted}")
        raise TestbedError(f"subnet index {wanted} is in use by the testbed in {owner}")
    raise TestbedError(f"all subnet indexes 0..{MAX_SUBNET_INDEX} are in use ({CLAIMS_DIR})")


def release_subnet(directory: Path) -> None:
    if not CLAIMS_DIR.is_dir():
        return
    with open(CLAIMS_DIR / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for claim in CLAIMS_DIR.glob("net-*"):
            with contextlib.suppress(OSError):
                if Path(os.readlink(claim)) == directory:
                    claim.unlink()


def write_cni_config(directory: Path, index: int) -> None:
    conflist = {
        "cniVersion": "1.0.0",
        "name": f"cri-prober-{index}",
        "plugins": [
            {
                "type": "bridge",
                "bridge": bridge_for(index),
                "isGateway": True,
                "ipMasq": False,  # nothing is routed off this machine
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": subnet_for(index)}]],
                    "dataDir": str(directory / "cni" / "ipam"),
                },
            },
            {"type": "loopback"},
        ],
    }
    conf_dir = directory / "cni" / "net.d"
    conf_dir.mkdir(parents=True, exist_ok=True)
    (conf_dir / "10-cri-prober.conflist").write_text(json.dumps(conflist, indent=2) + "\n")


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
        "the CRI server", lambda: cri_runtime_version(sock) if sock.exists() else None
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
        "the CRI image cache", lambda: all(cri_image_present(sock, i) for i in images) or None
    )
    return runtime_version


def start_testbed(
    directory: Path, version: str, wanted_index: int | None, timeout: float
) -> dict[str, Any]:
    """Configure, launch and wait for a containerd; return the testbed description."""
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


def cmd_start(args: argparse.Namespace) -> None:
    directory: Path = args.dir
    wanted = None if args.subnet_index == "auto" else int(args.subnet_index)
    if wanted is not None and not 0 <= wanted <= MAX_SUBNET_INDEX:
        raise TestbedError(f"--subnet-index must be within 0..{MAX_SUBNET_INDEX}")
    try:
        info = start_testbed(directory, args.version, wanted, args.timeout)
    except BaseException:
        # Leave nothing running, but keep the directory so containerd.log can be read.
        log("start failed; tearing down (keeping the directory for its log)")
        stop_testbed(directory, keep_dir=True)
        raise
    print(json.dumps(info))


# --------------------------------------------------------------------------------------------
# stop


def _processes() -> Iterator[int]:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            yield int(entry.name)


def _parent_pids() -> dict[int, int]:
    parents = {}
    for pid in _processes():
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{pid}/stat").read_text()  # as in _pid_alive
            parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def _wait_gone(pids: Sequence[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in alive if _pid_alive(pid)]
    return alive


def testbed_shims(directory: Path) -> list[int]:
    """Shim processes started by this testbed's containerd (their -address points into DIR)."""
    shims = []
    for pid in _processes():
        argv = _cmdline(pid)
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
    parents = _parent_pids()
    victims: list[int] = []
    frontier = list(shims)
    while frontier:  # every descendant, so no container process is left behind to init
        victims += frontier
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
    log(f"killing leftover shims {shims} and their {len(victims) - len(shims)} descendants")
    for pid in reversed(victims):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if alive := _wait_gone(victims, 5):
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
        for sandbox in cri_sandbox_ids(sock):
            log(f"removing pod sandbox {sandbox[:13]}")
            for method in ("StopPodSandbox", "RemovePodSandbox"):
                if (
                    grpc_unary(sock, CRI_RUNTIME + method, pb_string(1, sandbox), timeout=60)
                    is None
                ):
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
    if _wait_gone([pid], 10):
        log(f"containerd {pid} ignored SIGTERM for 10s; sending SIGKILL")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _wait_gone([pid], 5)
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


def network_of(directory: Path) -> tuple[str, str] | None:
    """(CNI network name, bridge name) from the testbed's conflist."""
    for conflist in (directory / "cni" / "net.d").glob("*.conflist"):
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            config = json.loads(conflist.read_text())
            return str(config["name"]), str(config["plugins"][0]["bridge"])
    return None


def stop_testbed(directory: Path, *, keep_dir: bool) -> None:
    """Idempotent: tears down whatever part of a testbed exists."""
    pid = containerd_pid(directory)
    if pid is not None:
        teardown_containers(directory, pid)
        stop_containerd(directory, pid)
    sweep_orphaned_tasks(directory)
    unmount_all(directory)
    network = network_of(directory)
    if network is not None:
        name, bridge = network
        if Path(f"/sys/class/net/{bridge}").exists():
            run(["ip", "link", "del", bridge], check=False)
            log(f"deleted bridge {bridge}")
        # Results of pods whose CNI DEL never ran (the network name is this testbed's alone).
        for cached in CNI_CACHE_DIR.glob(f"{name}-*"):
            cached.unlink(missing_ok=True)
    release_subnet(directory)
    if not keep_dir and directory.exists():
        shutil.rmtree(directory)
        log(f"removed {directory}")


def cmd_stop(args: argparse.Namespace) -> None:
    stop_testbed(args.dir, keep_dir=args.keep_dir)


def cmd_env(args: argparse.Namespace) -> None:
    path: Path = args.dir / "testbed.json"
    if not path.exists():
        raise TestbedError(f"no testbed in {args.dir} ({path} is missing)")
    print(json.dumps(json.loads(path.read_text())))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    install = commands.add_parser("install", help="install the packages and containerd versions")
    install.add_argument(
        "--version", action="append", choices=VERSIONS, help="repeatable; default 1.6"
    )
    install.set_defaults(func=cmd_install)

    def directory(value: str) -> Path:
        return Path(value).resolve()

    start = commands.add_parser("start", help="start a testbed and print its JSON description")
    start.add_argument("--dir", type=directory, required=True)
    start.add_argument("--version", choices=VERSIONS, default="1.6")
    start.add_argument(
        "--subnet-index", default="auto", help=f"0..{MAX_SUBNET_INDEX} or auto (default)"
    )
    start.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for readiness")
    start.set_defaults(func=cmd_start)

    stop = commands.add_parser("stop", help="tear a testbed down (idempotent)")
    stop.add_argument("--dir", type=directory, required=True)
    stop.add_argument(
        "--keep-dir", action="store_true", help="keep DIR (e.g. to read containerd.log)"
    )
    stop.set_defaults(func=cmd_stop)

    env = commands.add_parser("env", help="print the JSON description of a running testbed")
    env.add_argument("--dir", type=directory, required=True)
    env.set_defaults(func=cmd_env)

    args = parser.parse_args(argv)
    try:
        args.func(args)
    except TestbedError as error:
        log(f"error: {error}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
