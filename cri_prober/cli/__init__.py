"""The ``cri-prober`` command line: a click group whose commands each run one asyncio program.

Every command is registered here, explicitly, by the module that defines it; a command's module
is imported only when that command runs (or help lists it), so ``serve`` does not hold the
client commands' tables and YAML output, nor ``ps`` the daemon. User mistakes end with one clear
message and a documented exit status, never a traceback.
"""

from __future__ import annotations

import importlib

import click

from cri_prober import __version__, logs

# Command name -> the module that defines it (as a click command of the same name). Help lists
# them sorted, as click's own group does.
COMMANDS: dict[str, str] = {
    "version": "cri_prober.cli.version",
    "serve": "cri_prober.cli.serve",
    "ps": "cri_prober.cli.client",
    "inspect": "cri_prober.cli.client",
    "watch": "cri_prober.cli.client",
    "health": "cri_prober.cli.client",
    "check": "cri_prober.cli.check",
}


class LazyGroup(click.Group):
    """A group that imports a command's module the first time the command is looked up."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMANDS, *super().list_commands(ctx)})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            command = getattr(importlib.import_module(COMMANDS[cmd_name]), cmd_name)
            assert isinstance(command, click.Command), cmd_name
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-v", prog_name="cri-prober")
def main() -> None:
    """Kubelet-exact liveness, readiness and startup probes over CRI."""
    # Client commands speak through their output and exit status; only warnings are logged.
    logs.configure(level="warning")


__all__ = ["COMMANDS", "main"]
