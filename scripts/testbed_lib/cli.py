"""The testbed.py command line: argument parsing and one function per subcommand.

A TestbedError is printed after `testbed: error:` on stderr, without a traceback; exit status 1.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from . import cri, packages
from .common import TestbedError, log
from .containerd import start_testbed
from .network import MAX_SUBNET_INDEX
from .packages import VERSIONS
from .teardown import stop_testbed

DESCRIPTION = """\
Start and stop private, real containerd instances (1.6, 1.7, 2.1) for cri-prober tests and demos.

Each testbed lives in its own directory (config, root, state, socket, CNI network, log) and never
touches a system containerd. `install` needs only the standard library: it runs before the
project's virtualenv exists. `start` and `stop` speak CRI through grpcio: run them with the
virtualenv's python (.venv/bin/python scripts/testbed.py start ...).

    testbed.py install [--version 1.6|1.7|2.1 ...]
    testbed.py start --dir DIR [--version 1.6] [--subnet-index N|auto]   # prints the testbed JSON
    testbed.py env --dir DIR
    testbed.py stop --dir DIR [--keep-dir]
"""


def cmd_install(args: argparse.Namespace) -> None:
    packages.install(args.version or ["1.6"])


def cmd_start(args: argparse.Namespace) -> None:
    directory: Path = args.dir
    wanted = None if args.subnet_index == "auto" else int(args.subnet_index)
    if wanted is not None and not 0 <= wanted <= MAX_SUBNET_INDEX:
        raise TestbedError(f"--subnet-index must be within 0..{MAX_SUBNET_INDEX}")
    cri.require_grpc()  # before anything is created, so its absence is a single error line
    try:
        info = start_testbed(directory, args.version, wanted, args.timeout)
    except BaseException:
        # Leave nothing running, but keep the directory so containerd.log can be read.
        log("start failed; tearing down (keeping the directory for its log)")
        stop_testbed(directory, keep_dir=True)
        raise
    print(json.dumps(info))


def cmd_stop(args: argparse.Namespace) -> None:
    stop_testbed(args.dir, keep_dir=args.keep_dir)


def cmd_env(args: argparse.Namespace) -> None:
    path: Path = args.dir / "testbed.json"
    if not path.exists():
        raise TestbedError(f"no testbed in {args.dir} ({path} is missing)")
    print(json.dumps(json.loads(path.read_text())))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    install = commands.add_parser("install", help="install the packages and containerd versions")
    install.add_argument(
        "--version", action="append", choices=VERSIONS, help="repeatable; default 1.6"
    )
    install.set_defaults(func=cmd_install)

    def directory(value: str) -> Path:
        return Path(value).resolve()

    start = commands.add_parser("start", help="start a testbed and print its JSON description")
    start.add_argument("--dir", type=directory, required=True)
    start.add_argument("--version", choices=VERSIONS, default="1.6")
    start.add_argument(
        "--subnet-index", default="auto", help=f"0..{MAX_SUBNET_INDEX} or auto (default)"
    )
    start.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for readiness")
    start.set_defaults(func=cmd_start)

    stop = commands.add_parser("stop", help="tear a testbed down (idempotent)")
    stop.add_argument("--dir", type=directory, required=True)
    stop.add_argument(
        "--keep-dir", action="store_true", help="keep DIR (e.g. to read containerd.log)"
    )
    stop.set_defaults(func=cmd_stop)

    env = commands.add_parser("env", help="print the JSON description of a running testbed")
    env.add_argument("--dir", type=directory, required=True)
    env.set_defaults(func=cmd_env)

    args = parser.parse_args(argv)
    try:
        args.func(args)
    except TestbedError as error:
        log(f"error: {error}")
        return 1
    return 0
