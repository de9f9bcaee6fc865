"""Imported first by benchmarks that run the daemon in their own process (``bench.scale``), so
that the process holds the modules a plain ``pip install cri-prober`` gives ``serve``.

The project's venv also has the test tools, and import-linter brings rich: structlog imports it
whenever it is installed (for its console tracebacks), 4–5 MiB of RSS that a node running serve
from its own install does not have. Marking rich missing makes structlog do without it, as it
does there.
"""

from __future__ import annotations

import sys

# Where structlog is already imported (a test importing a benchmark's functions), it is too late
# and nothing is done: such a process measures nothing. ``rich_loaded`` tells a benchmark.
if "structlog" not in sys.modules:
    sys.modules.setdefault("rich", None)  # type: ignore[arg-type]


def rich_loaded() -> bool:
    """Whether rich is in this process after all (then its RSS is not a plain install's)."""
    return sys.modules.get("rich") is not None
