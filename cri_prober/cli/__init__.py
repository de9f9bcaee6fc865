"""The ``cri-prober`` command line: a click group whose commands each run one asyncio program.

Every command is registered here, explicitly; user mistakes end with one clear message and a
documented exit status, never a traceback.
"""

from __future__ import annotations

import click

from cri_prober import __version__, logs
from cri_prober.cli.check import check
from cri_prober.cli.client import health, inspect, ps, watch
from cri_prober.cli.serve import serve
from cri_prober.cli.version import version


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-v", prog_name="cri-prober")
def main() -> None:
    """Kubelet-exact liveness, readiness and startup probes over CRI."""
    # Client commands speak through their output and exit status; only warnings are logged.
    logs.configure(level="warning")


for _command in (version, serve, ps, inspect, watch, health, check):
    main.add_command(_command)

__all__ = ["main"]
