#!/usr/bin/env python3
"""Start and stop private, real containerd instances (1.6, 1.7, 2.1) for cri-prober tests and demos.

The command-line entry point (see --help); the code lives in the testbed_lib package next to it.
`install` and `env` need only the system python; run `start` (which needs grpcio) and `stop`
(which removes pods over CRI with it) with the project's virtualenv:

    python3 scripts/testbed.py install [--version 1.6|1.7|2.1 ...]
    .venv/bin/python scripts/testbed.py start --dir DIR [--version 1.6] [--subnet-index N|auto]
    .venv/bin/python scripts/testbed.py env --dir DIR
    .venv/bin/python scripts/testbed.py stop --dir DIR [--keep-dir]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Python puts this directory on sys.path itself, except in isolated or safe-path mode (-I, -P).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from testbed_lib.cli import main

if __name__ == "__main__":
    sys.exit(main())
