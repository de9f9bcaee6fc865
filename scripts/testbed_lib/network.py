"""The testbed's pod network: a subnet and bridge claimed per testbed, and its CNI config.

Claims keep concurrent testbeds (other pytest sessions too) off each other's bridge; teardown
deletes the bridge and the CNI results libcni cached for it. Standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

from .common import TestbedError, log, run
from .procs import containerd_pid

# Subnet claims live on tmpfs: they vanish at reboot, as the bridges do.
CLAIMS_DIR = Path("/run/cri-prober-testbed")
MAX_SUBNET_INDEX = 99  # 10.88.100.0/24 .. 10.88.199.0/24

CNI_BIN_DIR = "/usr/lib/cni"
CNI_CACHE_DIR = Path("/var/lib/cni/results")  # libcni's default, not configurable through CRI


def subnet_for(index: int) -> str:
    return f"10.88.{100 + index}.0/24"


def bridge_for(index: int) -> str:
    return f"cprb{index}"


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


def network_of(directory: Path) -> tuple[str, str] | None:
    """(CNI network name, bridge name) from the testbed's conflist."""
    for conflist in (directory / "cni" / "net.d").glob("*.conflist"):
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            config = json.loads(conflist.read_text())
            return str(config["name"]), str(config["plugins"][0]["bridge"])
    return None


def remove_network(directory: Path) -> None:
    """Delete the testbed's bridge and the CNI results cached for its network."""
    network = network_of(directory)
    if network is not None:
        name, bridge = network
        if Path(f"/sys/class/net/{bridge}").exists():
            run(["ip", "link", "del", bridge], check=False)
            log(f"deleted bridge {bridge}")
        # Results of pods whose CNI DEL never ran (the network name is this testbed's alone).
        for cached in CNI_CACHE_DIR.glob(f"{name}-*"):
            cached.unlink(missing_ok=True)
