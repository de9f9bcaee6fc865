"""PreStop hooks: what the kubelet runs before it stops a container whose liveness or startup
probe failed. This module parses the hook from the container's annotation, runs it within the
grace period, and computes the grace period left for CRI StopContainer.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from cri_prober.errors import CriError
from cri_prober.probing.handlers.exec import ExecRunner
from cri_prober.probing.handlers.http import USER_AGENT, BodyReadError, build_url, probe_http
from cri_prober.probing.outcome import ProbeError, truncate_output
from cri_prober.probing.prober import ProbeTarget
from cri_prober.probing.spec import resolve_port

if TYPE_CHECKING:
    from cri_prober.probing.spec.lifecycle import SleepAction
    from cri_prober.probing.spec.model import ExecAction, HTTPGetAction

__all__ = [
    "LIFECYCLE_USER_AGENT",
    "MIN_GRACE_SECONDS",
    "PRE_STOP_ANNOTATION",
    "HookOutcome",
    "HookRun",
    "InvalidPreStop",
    "PreStopHook",
    "parse_pre_stop",
    "pre_stop_hook",
    "remaining_grace",
    "run_pre_stop",
]

# The kubelet writes the container's PreStop handler here as JSON when it creates the container.
PRE_STOP_ANNOTATION: Final = "io.kubernetes.container.preStopHandler"

# The kubelet never gives StopContainer less than this, whatever the hook used up.
MIN_GRACE_SECONDS: Final = 2

# The kubelet's hook requests say kube-lifecycle/<major>.<minor> where probes say kube-probe/.
LIFECYCLE_USER_AGENT: Final = "kube-lifecycle/" + USER_AGENT.removeprefix("kube-probe/")

# How much longer than the grace period the runtime lets an exec hook run: our own deadline
# ends the hook at the grace period; this only makes sure the runtime ends it too if the
# cancelled ExecSync call somehow is not.
_EXEC_BACKSTOP_SECONDS: Final = 1


@dataclass(frozen=True, slots=True)
class PreStopHook:
    """A hook the kubelet would run: one exec, httpGet or sleep action."""

    action: ExecAction | HTTPGetAction | SleepAction

    @property
    def kind(self) -> str:
        """The handler's API field name: ``exec``, ``httpGet`` or ``sleep``."""
        # (A hook exists only once parse_pre_stop loaded the models.)
        from cri_prober.probing.spec.model import ExecAction, HTTPGetAction

        if isinstance(self.action, ExecAction):
            return "exec"
        if isinstance(self.action, HTTPGetAction):
            return "httpGet"
        return "sleep"


@dataclass(frozen=True, slots=True)
class InvalidPreStop:
    """An annotation that names no hook we can run; ``message`` says why.

    The kubelet fails such a hook at once and stops the container with the full grace period,
    so a caller logs this and does the same.
    """

    message: str

    def __str__(self) -> str:
        return self.message


class HookOutcome(enum.Enum):
    """How a PreStop hook ended."""

    COMPLETED = "completed"  # ran to its end without error
    FAILED = "failed"  # could not run or reported an error; the kubelet logs it and goes on
    CUT = "cut"  # still running when the grace period ran out
    SKIPPED = "skipped"  # a grace period of 0 leaves the kubelet no time to run a hook


@dataclass(frozen=True, slots=True)
class HookRun:
    """What happened when a PreStop hook was run before stopping a container."""

    kind: str  # exec, httpGet or sleep
    outcome: HookOutcome
    elapsed_seconds: int  # whole seconds, as the kubelet subtracts them
    seconds: float  # measured, for logs
    grace_seconds: int  # the grace period the hook was given
    message: str = ""  # why it failed or was cut; "" when it completed

    @property
    def remaining_grace(self) -> int:
        """The grace period to pass to StopContainer after this hook."""
        return remaining_grace(self.grace_seconds, self.elapsed_seconds)


def remaining_grace(grace_seconds: int, elapsed_seconds: int) -> int:
    """The StopContainer grace period after a hook that took ``elapsed_seconds`` (0 for none).

    As in the kubelet's killContainer: the grace period less the hook's whole seconds, raised
    to ``MIN_GRACE_SECONDS``.
    """
    return max(grace_seconds - elapsed_seconds, MIN_GRACE_SECONDS)


def parse_pre_stop(value: str) -> PreStopHook | InvalidPreStop:
    """Parse the JSON of a PreStop annotation into the hook the kubelet would run.

    Like the kubelet, the first of exec, httpGet and sleep that is set is the hook. tcpSocket
    (accepted by the API only for compatibility) and an object naming no known handler give an
    ``InvalidPreStop``, as do malformed JSON and invalid actions; nothing is raised.
    """
    try:
        data = json.loads(value)
    except json.JSONDecodeError as exc:
        return InvalidPreStop(f"not valid JSON: line {exc.lineno}, column {exc.colno}: {exc.msg}")
    except RecursionError:
        return InvalidPreStop("not valid JSON: nested too deeply")
    except ValueError as exc:  # e.g. an integer past Python's int-conversion limit
        return InvalidPreStop(f"not valid JSON: {exc}")
    if not isinstance(data, dict):
        return InvalidPreStop("must be a JSON object (a LifecycleHandler)")
    # Imported here: serve loads pydantic only once something is to be validated (issue 36).
    from pydantic import ValidationError

    from cri_prober.probing.spec.lifecycle import LifecycleHandler
    from cri_prober.probing.spec.model import format_errors

    try:
        handler = LifecycleHandler.model_validate(data)
    except ValidationError as exc:
        return InvalidPreStop("; ".join(format_errors(exc)))
    action = handler.exec or handler.http_get or handler.sleep
    if action is not None:
        return PreStopHook(action)
    if handler.tcp_socket is not None:
        return InvalidPreStop("tcpSocket is not supported as a lifecycle handler")
    return InvalidPreStop("names no handler type (exec, httpGet or sleep)")


def pre_stop_hook(annotations: Mapping[str, str]) -> PreStopHook | InvalidPreStop | None:
    """The container's PreStop hook from its CRI annotations; None when it has none."""
    value = annotations.get(PRE_STOP_ANNOTATION)
    return None if value is None else parse_pre_stop(value)


async def run_pre_stop(
    hook: PreStopHook,
    target: ProbeTarget,
    *,
    grace_seconds: int,
    exec_runner: ExecRunner,
) -> HookRun:
    """Run ``hook`` against ``target`` for at most ``grace_seconds``; never raises for the hook.

    ``grace_seconds`` is the kill's grace period before the kubelet's 2 s floor is applied: at
    0 or less no hook runs. A hook still running at the grace period is cancelled (the kubelet
    stops waiting for it instead); its elapsed time is then the whole grace period. httpGet
    resolves a port name in the container's ports (``target.ports_annotation``) only, and
    connects to ``target.pod_ip`` when the action names no host.
    """
    if grace_seconds <= 0:
        return HookRun(hook.kind, HookOutcome.SKIPPED, 0, 0.0, grace_seconds)
    started = time.monotonic()
    try:
        async with asyncio.timeout(grace_seconds) as scope:
            error = await _run(hook.action, target, exec_runner, grace_seconds)
    except Exception as exc:
        if isinstance(exc, TimeoutError) and scope.expired():
            seconds = time.monotonic() - started
            # The event loop may wake a hair before the deadline; the kubelet's wait always
            # lasts the whole grace period.
            elapsed = max(int(seconds), grace_seconds)
            message = f"still running after the grace period of {grace_seconds}s"
            return HookRun(hook.kind, HookOutcome.CUT, elapsed, seconds, grace_seconds, message)
        # The kubelet recovers from a crashing hook and stops the container anyway; an
        # unexpected error here must not keep the caller from stopping it either.
        error = f"unexpected error: {type(exc).__name__}: {exc}"
    seconds = time.monotonic() - started
    outcome = HookOutcome.COMPLETED if error is None else HookOutcome.FAILED
    return HookRun(hook.kind, outcome, int(seconds), seconds, grace_seconds, error or "")


async def _run(
    action: ExecAction | HTTPGetAction | SleepAction,
    target: ProbeTarget,
    exec_runner: ExecRunner,
    grace_seconds: int,
) -> str | None:
    """Run one action; return an error message, or None when it succeeded."""
    from cri_prober.probing.spec.model import ExecAction, HTTPGetAction

    if isinstance(action, ExecAction):
        return await _run_exec(action, target, exec_runner, grace_seconds)
    if isinstance(action, HTTPGetAction):
        return await _run_http(action, target, grace_seconds)
    # A negative duration is over at once, as with Go's time.After.
    await asyncio.sleep(max(action.seconds, 0))
    return None


async def _run_exec(
    action: ExecAction, target: ProbeTarget, runner: ExecRunner, grace_seconds: int
) -> str | None:
    # Unlike probe commands, the kubelet runs hook commands without $(VAR) expansion.
    argv = list(action.command)
    shown = " ".join(argv)
    try:
        result = await runner.exec_sync(
            target.container_id, argv, timeout=grace_seconds + _EXEC_BACKSTOP_SECONDS
        )
    except CriError as exc:
        return f"command '{shown}' could not run: {exc}"
    if result.timed_out:
        return f"command '{shown}' timed out"
    if result.exit_code != 0:
        # ExecSync's output, not an HTTP body: the kubelet shows it in its hook error too.
        output = truncate_output(result.stdout + result.stderr)
        return f"command '{shown}' exited with {result.exit_code}: {output}"
    return None


async def _run_http(action: HTTPGetAction, target: ProbeTarget, grace_seconds: int) -> str | None:
    host = action.host or target.pod_ip
    if not host:
        # The kubelet takes the address from the sandbox, which a host-network pod's lacks:
        # it fails such hooks the same way (kubernetes#134285).
        return "failed to find networking container: the pod has no IP address"
    try:
        # The kubelet resolves names in the container's own ports, not in a probe rule's.
        port = resolve_port(action.port, {}, target.ports_annotation, ports_from="")
    except ProbeError as exc:
        return str(exc)
    # The caller's User-Agent, if any, wins: probe_http keeps the first one.
    headers = [(h.name, h.value) for h in action.http_headers]
    headers.append(("User-Agent", LIFECYCLE_USER_AGENT))
    scheme = action.scheme.lower()
    # The kubelet's client has no timeout of its own; the grace period bounds the hook. The
    # extra second leaves that bound to run_pre_stop, which reports it as a cut.
    timeout = grace_seconds + 1
    error = await _get(build_url(scheme, host, port, action.path), headers, timeout)
    if error is not None and scheme == "https" and '": tls: ' in error:
        # The kubelet retries an HTTPS hook over plain HTTP, without Authorization, when the
        # server answered in plain HTTP. A TLS server never takes the plain request as HTTP,
        # so retrying after any TLS failure succeeds exactly where the kubelet's retry does.
        plain = [(name, value) for name, value in headers if name.lower() != "authorization"]
        if await _get(build_url("http", host, port, action.path), plain, timeout) is None:
            return None
    return error


async def _get(url: str, headers: Sequence[tuple[str, str]], timeout: float) -> str | None:
    """GET ``url`` as the kubelet's hook client does; return an error message or None."""
    try:
        outcome = await probe_http(url, headers=headers, timeout=timeout)
    except BodyReadError:
        # The response head arrived: the kubelet's request has succeeded by then, and it
        # discards the body unread.
        return None
    except ProbeError as exc:
        return str(exc)
    # Any response counts, whatever its status: the kubelet never looks at it.
    return None if outcome.http_status is not None else outcome.output
