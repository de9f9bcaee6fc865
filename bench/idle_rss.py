"""Idle RSS: ``cri-prober serve`` with nothing to probe, and what each of its parts costs.

    python -m bench.idle_rss [--quick] [--rounds N] [--settle SECONDS] [--before DIR]
                             [-- SERVE FLAGS...]

Starts the fake CRI runtime (bench.fake_cri, no containers) and, in a fresh process, ``cri-prober
serve`` against it with its defaults otherwise: no rules file, no --probes-from, metrics off,
annotations on, the event loop ``auto`` (uvloop). The serve process holds the modules a plain
install gives it (``bench._plain_install``). The benchmark waits for serve's readiness (READY=1 on
a ``NOTIFY_SOCKET`` of its own: sent once the runtime answered a relist and the API is bound),
then reads VmRSS from /proc/PID/status once a second for --settle seconds, and stops it. Each
round starts a new serve; the report gives the median of the rounds' last readings and the
highest VmHWM (peak RSS).

Then each part's cost: fresh interpreters import the parts one after another, in the order
serve needs them, and each row is the RSS its part adds to the ones above (the median of
--rounds readings); so the rows add up, and a part's modules shared with an earlier one count
there. "held" says whether the idle serve had the part in its ``sys.modules`` when it exited.
Last, the idle serve's RSS is split in two: its modules (a fresh interpreter importing exactly
the modules it held) and the rest, its running state (threads, gRPC channel and servers, the
loop, the heap's slack).

Extra arguments after ``--`` go to serve (``-- --config rules.yaml`` measures serve with a rules
file). ``--before DIR`` also measures the serve of another copy of the code (a checkout of an
earlier commit, e.g. ``git archive main | tar -x -C DIR``) in the same run, its rounds
alternating with this code's, and reports both and their difference. Needs no root.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench._common import Child, fmt, load_average, machine, median, rss_mib, say, table

ROOT = Path(__file__).resolve().parent.parent
GOAL_MIB = 45.0  # issue 36, goal 3

# How the serve child starts: the console script's ``main()`` behind bench._plain_install, and
# at exit it writes the top-level packages it held to $IDLE_RSS_MODULES (which parts it held).
SERVE_CODE = """
import bench._plain_install
import atexit, os, sys

def _held():
    with open(os.environ["IDLE_RSS_MODULES"], "w") as out:
        out.write("\\n".join(sorted(name for name, module in sys.modules.items() if module)))

atexit.register(_held)
from cri_prober.cli import main
main(prog_name="cri-prober")
"""

# One reading of a part's cost: a bare interpreter (bench._plain_install only), then the part.
READ_CODE = """
import bench._plain_install
{imports}
for line in open("/proc/self/status"):
    if line.startswith("VmRSS:"):
        print(int(line.split()[1]))
"""


@dataclass(frozen=True)
class Part:
    """A group of modules serve may load: how to load it, and the packages that mark it held."""

    name: str
    code: str  # the statements that load it (a loop for uvloop: importing it alone is cheap)
    marks: tuple[str, ...]  # held by serve when any of these modules is in its sys.modules


STDLIB = (
    "import asyncio, ssl, json, dataclasses, typing, logging, re, signal, socket, pathlib, "
    "contextlib, enum, collections, concurrent.futures, threading, ipaddress, urllib.parse, "
    "email.utils"
)
PARTS = (
    Part("the standard library's (asyncio, ssl, logging, ...)", STDLIB, ("asyncio",)),
    Part("click", "import click", ("click",)),
    Part("structlog", "import structlog", ("structlog",)),
    Part(
        "grpc, protobuf, health and reflection services",
        "import grpc, grpc.aio, google.protobuf, grpc_health.v1.health, "
        "grpc_reflection.v1alpha.reflection",
        ("grpc",),
    ),
    Part("uvloop (and its loop)", "import uvloop\nloop = uvloop.new_event_loop()", ("uvloop",)),
    Part("tenacity", "import tenacity", ("tenacity",)),
    Part("httptools", "import httptools", ("httptools",)),
    Part("msgspec (the state file; pod lists)", "import msgspec", ("msgspec",)),
    Part("h2 (h2c and gRPC-over-TLS probes)", "import h2.connection", ("h2",)),
    Part("google-re2", "import re2", ("re2",)),
    Part("pydantic", "import pydantic", ("pydantic",)),
    Part("PyYAML", "import yaml", ("yaml",)),
    Part("prometheus_client", "import prometheus_client", ("prometheus_client",)),
    Part("httpx2 (the kubelet source's client)", "import httpx2", ("httpx2",)),
    Part("lightkube", "import lightkube.config.kubeconfig", ("lightkube",)),
    Part(
        "cri-prober's own modules (every command's, the daemon's)",
        "import cri_prober.cli, cri_prober.daemon\n"
        # (getattr: a revision before the lazy group imported them all with the group)
        "for name in set(getattr(cri_prober.cli, 'COMMANDS', {}).values()):\n"
        "    __import__(name)",
        ("cri_prober",),
    ),
)
# Imports each module named on stdin's lines that it can (the idle serve's sys.modules).
HELD_CODE = """
import importlib, sys
for name in sys.stdin.read().split():
    if name != "__main__" and name not in sys.modules:
        try:
            importlib.import_module(name)
        except Exception:
            pass
"""


def read_rss_kib(imports: str, stdin: str = "") -> int:
    """The VmRSS (KiB) of a fresh interpreter once it ran *imports*."""
    out = subprocess.run(
        [sys.executable, "-c", READ_CODE.format(imports=imports)],
        input=stdin,
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return int(out.stdout.split()[-1])


@contextlib.contextmanager
def notify_socket(directory: Path) -> Iterator[socket.socket]:
    """A unix datagram socket standing in for systemd's, which serve tells when it is ready."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(str(directory / "notify"))
        yield sock
    finally:
        sock.close()


def wait_ready(sock: socket.socket, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait for READY=1 from serve; fail when it exits first or the hang guard runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode} before it was ready")
        sock.settimeout(1.0)  # only to notice an early exit; readiness ends the wait at once
        try:
            message = sock.recv(4096).decode()
        except TimeoutError:
            continue
        if "READY=1" in message.split("\n"):
            return
    raise RuntimeError(f"serve was not ready within {timeout:g} s")


@dataclass(frozen=True)
class Round:
    rss: float  # MiB, the last reading
    readings: tuple[float, ...]
    hwm: float  # MiB, VmHWM
    held: frozenset[str]  # the modules in serve's sys.modules at exit


def vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def serve_round(target: str, settle: float, serve_args: Sequence[str], root: Path = ROOT) -> Round:
    """Start serve idle, wait until it is ready, read its RSS for *settle* seconds, stop it.

    *root* holds the code serve runs (``cri_prober``; ``bench._plain_install`` is this one's).
    """
    with tempfile.TemporaryDirectory(prefix="idle-rss-") as tmp:
        directory = Path(tmp)
        modules = directory / "modules"
        env = os.environ | {
            "NOTIFY_SOCKET": str(directory / "notify"),
            "IDLE_RSS_MODULES": str(modules),
            "PYTHONPATH": os.pathsep.join(dict.fromkeys((str(root), str(ROOT)))),
        }
        env.pop("WATCHDOG_USEC", None)
        args = [
            sys.executable,
            "-c",
            SERVE_CODE,
            "serve",
            "--runtime-endpoint",
            target,
            "--listen",
            f"unix://{directory}/api.sock",
            "--state-file",
            "none",
            "--log-level",
            "warning",
            *serve_args,
        ]
        with notify_socket(directory) as sock:
            proc = subprocess.Popen(args, cwd=root, env=env, stdout=subprocess.DEVNULL)
            try:
                wait_ready(sock, proc, timeout=120.0)
                readings = [rss_mib(proc.pid)]
                end = time.monotonic() + settle
                while time.monotonic() < end:
                    time.sleep(1.0)  # sampling the idle process's RSS over time, not a wait
                    readings.append(rss_mib(proc.pid))
                hwm = vm_hwm_mib(proc.pid)
            finally:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if proc.returncode != 0:
            raise RuntimeError(f"serve exited with {proc.returncode}")
        held = frozenset(modules.read_text().split()) if modules.exists() else frozenset()
    return Round(rss=readings[-1], readings=tuple(readings), hwm=hwm, held=held)


def part_costs(rounds: int) -> tuple[float, list[tuple[Part, float]]]:
    """(bare interpreter MiB, each part's MiB over the parts before it)."""
    bare = median([read_rss_kib("") for _ in range(rounds)]) / 1024
    costs = []
    code, before = "", bare
    for part in PARTS:
        code += part.code + "\n"
        total = median([read_rss_kib(code) for _ in range(rounds)]) / 1024
        costs.append((part, total - before))
        before = total
    return bare, costs


def held_modules_mib(held: frozenset[str], rounds: int) -> float:
    """The RSS of a fresh interpreter that imports the modules the idle serve held."""
    listed = "\n".join(sorted(held))
    return median([read_rss_kib(HELD_CODE, listed) for _ in range(rounds)]) / 1024


def is_held(part: Part, held: frozenset[str]) -> bool:
    return any(mark in held for mark in part.marks)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1 round, 2 s settle")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--settle", type=float, default=10.0, metavar="SECONDS")
    parser.add_argument(
        "--before",
        type=Path,
        metavar="DIR",
        help="also measure the serve of the code in DIR, rounds alternating with this code's",
    )
    parser.add_argument("serve_args", nargs="*", help="after --: more serve flags")
    args = parser.parse_args()
    if args.before is not None and not (args.before / "cri_prober").is_dir():
        parser.error(f"--before {args.before}: no cri_prober package there")
    if args.quick:
        args.rounds, args.settle = 1, 2.0
    say(f"load average before: {load_average()}")
    with tempfile.TemporaryDirectory(prefix="idle-rss-cri-") as tmp:
        runtime = Child(
            [
                "-m",
                "bench.fake_cri",
                "--socket",
                f"{tmp}/cri.sock",
                "--containers",
                "0",
                "--http-ports",
                "1",
                "--tcp-ports",
                "1",
            ]
        )
        with runtime:
            target = str(runtime.info["target"])
            results: list[Round] = []
            before: list[Round] = []
            for i in range(args.rounds):
                # Alternating (ABBA) so that a drift of the machine weighs on both alike.
                order = [None, args.before] if i % 2 == 0 else [args.before, None]
                for root in order:
                    if root is None:
                        say(f"round {i + 1}/{args.rounds}: serve {' '.join(args.serve_args)}")
                        results.append(serve_round(target, args.settle, args.serve_args))
                    elif args.before is not None:
                        say(f"round {i + 1}/{args.rounds}: the serve of {root}")
                        before.append(serve_round(target, args.settle, args.serve_args, root))
    load = load_average()
    say("part costs, each in fresh interpreters")
    bare, costs = part_costs(args.rounds)
    held = results[-1].held
    modules = held_modules_mib(held, args.rounds)
    rss = median([r.rss for r in results])
    flags = " ".join(args.serve_args) or "(none)"
    print(
        f"## idle serve: RSS {rss:.1f} MiB (goal {GOAL_MIB:.0f} MiB: "
        f"{'met' if rss <= GOAL_MIB else f'{rss - GOAL_MIB:.1f} MiB over'})\n"
    )
    print(f"machine: {machine()}; load average after the serve rounds: {load}")
    print(f"command: python -m bench.idle_rss {' '.join(sys.argv[1:])}; extra serve flags: {flags}")
    print(
        f"rounds {args.rounds}, each read for {args.settle:g} s after READY=1; "
        f"readings (MiB) per round: "
        + "; ".join(" ".join(fmt(x, 1) for x in r.readings) for r in results)
        + f"; peak VmHWM {max(r.hwm for r in results):.1f} MiB\n"
    )
    if before:
        rss_before = median([r.rss for r in before])
        print(
            f"the serve of {args.before}, in the same run: RSS {rss_before:.1f} MiB; "
            f"readings (MiB) per round: "
            + "; ".join(" ".join(fmt(x, 1) for x in r.readings) for r in before)
            + f"\nthis code - that code: {rss - rss_before:+.1f} MiB\n"
        )
    held_before = before[-1].held if before else None
    yes_no = {True: "yes", False: "no"}
    rows: list[list[object]] = [["bare interpreter", fmt(bare, 1), "yes"]]
    for part, cost in costs:
        row: list[object] = [part.name, fmt(cost, 1), yes_no[is_held(part, held)]]
        if held_before is not None:
            row.append(yes_no[is_held(part, held_before)])
        rows.append(row)
    rows.append(["all of the above", fmt(bare + sum(cost for _, cost in costs), 1), ""])
    headers = ["part (imported in this order)", "MiB added", "held by idle serve"]
    if held_before is not None:
        headers.append("held by the --before serve")
        rows[0].append("yes")
        rows[-1].append("")
    print(table(headers, rows))
    own_held = [name for name in held if name.startswith("cri_prober.")]
    print(
        f"\nthe idle serve's {rss:.1f} MiB: the modules it held ({len(held)}, of them"
        f" {len(own_held)} cri-prober's) {modules:.1f} MiB in a fresh interpreter; its running"
        f" state (threads, channel, servers, loop, heap slack) the other {rss - modules:.1f} MiB"
    )
    if held_before is not None:
        own_before = [name for name in held_before if name.startswith("cri_prober.")]
        print(
            f"the --before serve held {len(held_before)} modules, of them {len(own_before)}"
            " cri-prober's"
        )
    say(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
