"""The shipped image and docker-compose.yml, built and run for real with podman (image-test).

tests/unit/test_deploy.py parses the Dockerfiles and the compose file; this runs them: both images
built with podman from local mmdebstrap bases (no registry), the compose file up under
podman-compose with a health-gated start, the image's HEALTHCHECK and `cri-prober health` from
the host. Root only (rootful podman, a privileged containerd): as another user it is skipped,
loudly, like every test in tests/containerd.

CRI_PROBER_IMAGE_TEST chooses how much runs: ``full`` (the default, as in CI: also a pod probed
through the compose stack, /metrics, and a containerd container restart that cri-prober rides out
in the node service's network namespace), ``quick`` (build, start, health), or ``skip``. A cold
machine needs ~45 s for the base and ~75 s for the builds; later runs reuse both from podman's
storage.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "image-test"
MODE = os.environ.get("CRI_PROBER_IMAGE_TEST", "full")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.mark.timeout(1200)
def test_image_and_compose_run_for_real(tmp_path: Path) -> None:
    """scripts/image-test passes and reports the facts the image and compose file promise."""
    if MODE == "skip":
        pytest.skip("CRI_PROBER_IMAGE_TEST=skip")
    assert MODE in ("quick", "full"), f"CRI_PROBER_IMAGE_TEST={MODE!r}: quick, full or skip"
    report = tmp_path / "report.json"
    env = {
        **os.environ,
        "PYTHON": sys.executable,  # the host side: this interpreter's cri-prober and grpcio
        # Its own project and metrics port: clear of a compose stack already running here.
        "IMAGE_TEST_PROJECT": f"cri-prober-test-{os.getpid()}",
        "IMAGE_TEST_METRICS_PORT": str(_free_port()),
    }
    args = [str(SCRIPT), "--report", str(report)] + (["--quick"] if MODE == "quick" else [])
    proc = subprocess.run(
        args, cwd=REPO, env=env, capture_output=True, text=True, timeout=1100, check=False
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    facts = json.loads(report.read_text())

    # The image: the documented non-root user, the wheel with the generated code, its HEALTHCHECK.
    assert facts["image_user"] == "65532:0"
    assert facts["run_uid"] == 65532
    assert "/site-packages/cri_prober/_gen/runtime/v1/api_pb2.py" in facts["generated_code"]
    assert facts["image_version"].startswith("cri-prober, version ")
    assert facts["image_healthcheck"] == "CMD-SHELL cri-prober health || exit 1"
    # The DaemonSets' API directory: the kubelet's root:root 0755, given to 65532:0 by the init
    # container (CAP_CHOWN alone), then serve's socket in it (uid 65532, read-only root).
    assert facts["hostpath_before"] == "755 0:0"
    assert facts["hostpath_after_init"] == "755 65532:0"
    assert facts["hostpath_socket"] == "600 65532"
    # The compose stack: health-gated start, healthy by podman's own check and by the host's CLI.
    assert facts["podman_healthcheck_run"] == "healthy"
    assert facts["podman_health_status"] == "healthy"
    assert facts["api_health"] == "status: SERVING"
    assert facts["api_socket_mode"] == "600 root"
    assert facts["nofile_in_container"] == facts["nofile"]
    # The node service holds the network namespace, unprivileged; the other two joined it.
    assert facts["node_privileged"] is False
    assert facts["node_read_only"] is True
    assert facts["node_cap_eff"] == 0
    assert facts["node_command"] == "sleep infinity"
    assert facts["containerd_privileged"] is True
    assert facts["netns_shared"] is True
    if MODE == "quick":
        return

    # A pod created over the containerd container's CRI socket, probed from the node's network.
    assert facts["readiness_web1"].startswith("success")
    assert facts["metrics_web1"] is True
    # containerd restarted: a new socket in the shared directory, and cri-prober (not restarted)
    # still in the node's network namespace: /metrics answering, the old pod seen exited (it
    # dies with the containerd container), a pod created after it discovered and probed ready.
    assert facts["socket_replaced"] is True
    assert facts["netns_stale_after_containerd_restart"] is False
    assert facts["metrics_after_restart"] is True
    assert facts["cri_prober_restarts"] == 0
    assert facts["cri_prober_started_once"] is True
    assert facts["web1_state_after_restart"] == "CONTAINER_EXITED"
    assert facts["web2_discovered_s"] < 60
    assert facts["readiness_web2"].startswith("success")
    assert facts["metrics_web2"] is True
