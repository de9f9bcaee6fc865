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
    # web's readiness flips once ready.html appears; slow-starter passes its startup probe
    # (watch writes results in ps's words, each with its reason).
    assert re.search(r"readiness +fail -> ok +ok 1/1", text), text
    assert re.search(r"startup +\? -> ok +ok 1/1", text), text
    # New containers' initial values are marked as such, not shown as flaps.
    assert re.search(r"readiness +\(initial\) fail +initial", text), text
    assert re.search(r"CONTAINER +POD +NAME +ATTEMPT +STATE +READY +HEALTHY +PROBES +AGE", text)
    # shop's probes come from its static pod manifest (--probes-from manifests:...).
    ps_rows = [
        line.split()
        for line in text.splitlines()
        if re.match(r"[0-9a-f]{13} +demo/shop-demo-node ", line)
    ]
    assert len(ps_rows) == 2, text  # the first and the last `ps`
    # By the last `ps` it is ready: READY and HEALTHY true, liveness and readiness ok.
    assert ps_rows[-1][5:9] == ["true", "true", "L:ok", "R:ok"], ps_rows
    # The worker fails liveness: the demo ends on inspect of it, which says why.
    assert "Liveness probe: exec [cat /tmp/alive]" in text
    assert "  Reason: exit-code (failure " in text
    # Cleaned up: the testbed directory and the serve process are gone.
    assert not (demo_dir / "containerd").exists()
    assert not (demo_dir / "serve.pid").exists()
