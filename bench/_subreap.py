"""Run a command as a child subreaper and report the CPU of every process it led to.

``python -m bench._subreap CMD...`` marks itself PR_SET_CHILD_SUBREAPER, runs CMD, then reaps
every descendant that was re-parented to it (podman's conmon daemonizes), and prints one JSON line
``{"rc": CMD's exit status, "cpu": user+system seconds of all reaped descendants}``.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import subprocess
import sys

PR_SET_CHILD_SUBREAPER = 36


def main() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, check=False).returncode
    while True:
        try:
            os.wait()
        except ChildProcessError:
            break
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    sys.stdout.write(json.dumps({"rc": rc, "cpu": usage.ru_utime + usage.ru_stime}) + "\n")


if __name__ == "__main__":
    main()
