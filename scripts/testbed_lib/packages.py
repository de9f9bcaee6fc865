"""Installs what testbeds need and says where each containerd version lives.

Debian packages come from the system's apt; containerd 1.7 and 2.1 are .debs of newer suites,
downloaded with private apt state and extracted into a cache per version. Standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from .common import TestbedError, log, run

VERSIONS = ("1.6", "1.7", "2.1")
# 1.6 is bookworm's own containerd (installed system-wide); newer ones come from these suites.
PRIVATE_SUITES = {"1.7": "trixie", "2.1": "sid"}
# prometheus: promtool for the alert rules' tests, and a real Prometheus for the dashboard's
# (tests/unit/test_monitoring.py, tests/containerd/test_dashboard.py).
APT_PACKAGES = (
    "containerd",
    "runc",
    "containernetworking-plugins",
    "busybox-static",
    "iproute2",
    "prometheus",
)
# Packages whose install starts a service the tests never want running (they start their own).
NO_SERVICE = ("prometheus",)
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
DEBIAN_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
DEFAULT_CACHE = "/var/cache/cri-prober-testbed"


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
    with _no_service_starts():
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
    if Path("/run/systemd/system").is_dir():
        # Under systemd the unit is enabled anyway (policy-rc.d only stops the start): the
        # tests' Prometheus runs on its own, a node-wide one on :9090 would only be in the way.
        for service in NO_SERVICE:
            if service in missing:
                run(["systemctl", "disable", "--now", f"{service}.service"], check=False)


@contextlib.contextmanager
def _no_service_starts() -> Iterator[None]:
    """Deny every service start during an install (invoke-rc.d and deb-systemd-invoke ask
    policy-rc.d; exit 101 is "forbidden"), unless the machine has its own policy already, as
    Docker's Debian images do."""
    if POLICY_RC_D.exists():
        yield
        return
    POLICY_RC_D.write_text(
        "#!/bin/sh\n# cri-prober testbed: no service starts during install\nexit 101\n"
    )
    POLICY_RC_D.chmod(0o755)
    try:
        yield
    finally:
        POLICY_RC_D.unlink(missing_ok=True)


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


def install(versions: Iterable[str]) -> None:
    """The Debian packages, then each containerd version (1.6 is the system's: only checked)."""
    started = time.monotonic()
    install_debian_packages()
    for version in versions:
        if version == "1.6":
            check_containerd_version(version)
        else:
            fetch_private_containerd(version)
    log(f"install done in {time.monotonic() - started:.1f}s")
