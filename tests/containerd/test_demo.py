"""The README's first command, scripts/demo.sh, really shows live probe transitions."""

from __future__ import annotations

import asyncio
import os
import re
import socket
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_demo_shows_transitions_and_cleans_up(tmp_path: Path) -> None:
    """The demo runs end to end, prints ps and transitions, and leaves nothing running."""
    demo_dir = tmp_path / "demo"
    env = {
        **os.environ,
        "CRI_PROBER_DEMO_DIR": str(demo_dir),
        "CRI_PROBER_DEMO_METRICS": f"127.0.0.1:{_free_port()}",
    }
    proc = await asyncio.create_subprocess_exec(
        "bash", str(REPO / "scripts" / "demo.sh"), "--seconds", "16",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 240)
    text = out.decode()
    assert proc.returncode == 0, text
    assert "cri-prober itself: status: SERVING" in text
    # web's readiness flips once ready.html appears; slow-starter passes its startup probe.
    assert "readiness  failure -> success" in text
    assert "startup    unknown -> success" in text
    assert "CONTAINER       POD" in text
    # shop's probes come from its static pod manifest (--probes-from manifests:...).
    ps_rows = [
        line.split()
        for line in text.splitlines()
        if re.match(r"[0-9a-f]{13} +shop-demo-node ", line)
    ]
    assert len(ps_rows) == 2, text  # the first and the last `ps`
    assert {row[-1] for row in ps_rows} == {"pod-spec"}
    # By the last `ps` it is ready: READY true, liveness and readiness success.
    assert ps_rows[-1][6:11] == ["true", "true", "true", "success", "success"], ps_rows
    # Cleaned up: the testbed directory and the serve process are gone.
    assert not (demo_dir / "containerd").exists()
    assert not (demo_dir / "serve.pid").exists()
