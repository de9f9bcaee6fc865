"""The async CRI client: the only module that speaks gRPC to the runtime.

It returns the runtime's model (``model``'s frozen dataclasses, built by ``convert``; never
protobuf messages), maps gRPC failures onto ``cri_prober.errors``, retries idempotent reads on
UNAVAILABLE with tenacity, and caps how many ExecSync calls are in flight node-wide, because
containerd collapses under unbounded exec fan-out. The exec slots are shared fairly
(``exec_slots.ExecSlots``: one per container at a time, turns in order, containers whose execs
overran served last) and held only while an exec starts when others wait, and for a bounded
time in any case: an exec past it gives its slot back while the call goes on waiting for the
runtime's answer, the way the kubelet waits for it. Every call also reports to ``liveness``
(``liveness.RuntimeLiveness``), which tells a silent runtime from a failing container.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
import structlog
import tenacity

from cri_prober._gen.runtime.v1 import api_pb2, api_pb2_grpc
from cri_prober.errors import (
    CriContainerGone,
    CriContainerNotRunning,
    CriDeadlineExceeded,
    CriError,
    CriNotFound,
    CriUnavailable,
    cri_error,
)
from cri_prober.runtime.convert import (
    LeanContainerList,
    LeanSandboxList,
    container_from_item,
    container_status_from_pb,
    reuse_listed,
    sandbox_from_item,
    sandbox_status_from_pb,
)
from cri_prober.runtime.exec_slots import ExecSlots
from cri_prober.runtime.liveness import RuntimeLiveness
from cri_prober.runtime.model import (
    MAX_EXEC_OUTPUT_BYTES,
    Container,
    ContainerEvent,
    ContainerEventType,
    ContainerState,
    ContainerStatus,
    CriCall,
    ExecResult,
    PodSandbox,
    RuntimeCondition,
    RuntimeVersion,
    SandboxStatus,
)
from cri_prober.topic import Topic

log = structlog.get_logger(__name__)

# The kubelet's CRI client accepts replies of at most 16 MiB on every call (its connection's
# default receive limit; sends keep gRPC's default). A bigger reply, e.g. an ExecSync with more
# output, is RESOURCE_EXHAUSTED there: an error, so the probe attempt is discarded, not judged.
MAX_RECEIVE_MESSAGE_BYTES = 16 * 1024 * 1024
# Measured on 2-core nodes: 4-16 concurrent ExecSync calls reach containerd's ceiling and 64
# collapse it to ~1/s. In paired benchmark runs (docs/benchmarks.md) caps 4, 8 and 16 all reached
# the ceiling. 16 since issue 25: beside a kubelet whose exec probes load the runtime, execs take
# 0.3-0.5 s and 8 slots ran 84 % of cri-prober's ticks where 16 ran 99 % (the kubelet's stand-in
# 100 % in both; `bench/run process_cpu --together`). Hanging execs no longer hold slots past
# their start hold (issue 21), and a saturated runtime gets a quarter of the cap (exec_slots).
#
# What the cap bounds (issue 21): every ExecSync call holds a slot from before it is sent until
# it is answered, or until it is past its start hold (DEFAULT_EXEC_START_HOLD) and another call
# waits, or past its hold (below); so at most this many execs younger than the start hold, the
# ones the runtime is still starting (runc exec, 20-50 ms of CPU each), are in flight at once.
# All calls in flight, slot or not, are at most one per exec probe worker (a worker runs one
# attempt at a time, its retries one after another; a worker told to stop finishes its attempt,
# so workers being replaced count too) plus one per preStop hook being run (one per container
# being stopped). No call outlives its deadline, timeout + runtime_request_timeout (the request
# timeout alone for timeout 0): gRPC then cancels it, and containerd, whose context ends, kills
# the exec's process; what may stay behind is a background child the command started, holding
# its output open (containerd#9568), which costs the runtime a waiting goroutine, not CPU.
DEFAULT_MAX_CONCURRENT_EXECS = 16
# How long an exec keeps its slot when another call waits for one: about the time containerd
# takes to start an exec on a busy 2-core node (~0.2 s at the exec ceiling with 8 in flight),
# with room. Past it the call runs on without a slot, as calls past their hold always did, and
# the container counts as overrunning (exec_slots.Standing.OVERRAN) until one of its execs
# finishes within it. It bounds what a container whose execs hang can delay another's exec.
DEFAULT_EXEC_START_HOLD = 0.5
# The kubelet's --runtime-request-timeout default. Its ExecSync deadline is the probe's timeout
# plus this, so the runtime enforces the probe's timeout and the client only backs it up.
DEFAULT_RUNTIME_REQUEST_TIMEOUT = 120.0
# How long past its timeout an exec keeps its node-wide slot. containerd answers a command it
# killed at the timeout within ~0.1 s; one still waiting after this is waiting for the exec's
# output to drain (a background child holding stdout, drain_exec_sync_io_timeout = 0), which
# costs the runtime nothing, so the slot goes to the next exec while the call waits on.
DEFAULT_EXEC_SLOT_MARGIN = 1.0
# The longest an exec holds a slot before its margin, whatever its timeout (a rule or a pod's
# annotation may ask for timeoutSeconds: 3600), even when nobody waits for one. Past it the call
# waits on without a slot (it counts as overdue).
DEFAULT_EXEC_SLOT_HOLD_MAX = 10.0
# How many slots one container may hold at once. One: a container's own probes take turns (a
# hanging liveness exec delays its readiness exec by at most a start hold), and no container, or
# group of containers smaller than the cap, can hold every slot.
EXEC_SLOTS_PER_CONTAINER = 1
DEFAULT_CALL_TIMEOUT = 10.0

_T = TypeVar("_T")


class CriRuntimeStalled(CriDeadlineExceeded):
    """An ExecSync timed out while the runtime answered nothing at all (frozen or hung).

    A runtime that stops (SIGSTOP, a wedged thread) and comes back may answer an exec that was in
    flight with its own timeout error: its timer fired while it could not see the command exit.
    The kubelet cannot tell and counts such a timeout as the probe's failure; cri-prober can
    (``RuntimeLiveness.stalled_during``) and reports an error, so the attempt is discarded and
    run again, as for a runtime that is down.
    """


# What the runtime says to an ExecSync on a container that stopped, or is stopping, while the
# call was on its way (plain errors, so code UNKNOWN; cri-facts.md, section 2.1): containerd's CRI
# check ("container is in CONTAINER_EXITED state"), its shim's task states, and runc's checks
# (old and new wording). A container or task already removed is NOT_FOUND ("failed to find
# container ... in store: not found", "failed to load task: no running task found").
NOT_RUNNING_TEXTS = (
    "container is in CONTAINER_",
    "cannot exec in a stopped state",
    "cannot exec in a deleted state",
    "cannot exec in a stopped container",
    "cannot exec a container that has stopped",
)


def container_not_running(exc: CriError) -> bool:
    """Whether an ExecSync error says the container is not running (any more), as when the call
    raced its container's stop or removal, rather than that the exec itself failed."""
    if exc.code is grpc.StatusCode.NOT_FOUND:
        return True
    return exc.code is grpc.StatusCode.UNKNOWN and any(
        text in exc.details for text in NOT_RUNNING_TEXTS
    )


def _is_unavailable(exc: BaseException) -> bool:
    return isinstance(exc, CriUnavailable)


def _log_retry(state: tenacity.RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    log.debug("cri_retry", attempt=state.attempt_number, error=str(exc))


class ExecCall:
    """One container's ExecSync, built once by ``CriClient.exec_call``: the request message, the
    call's deadline and its slot's holds. Each call is one exec (``CriClient.exec_sync``)."""

    __slots__ = ("_client", "container_id", "deadline", "hold", "request", "soft_at", "timeout")

    def __init__(self, client: CriClient, container_id: str, cmd: Sequence[str], timeout: int):
        self._client = client
        self.container_id = container_id
        self.timeout = timeout
        self.request = api_pb2.ExecSyncRequest(
            container_id=container_id, cmd=list(cmd), timeout=timeout
        )
        # Read from the client once: its settings are fixed when it is made.
        self.deadline = (
            timeout + client.runtime_request_timeout
            if timeout > 0
            else client.runtime_request_timeout
        )
        hold = min(timeout if timeout > 0 else client.call_timeout, client.exec_slot_hold_max)
        self.hold = hold + client.exec_slot_margin
        self.soft_at = min(client.exec_start_hold, self.hold)

    def __call__(self) -> Awaitable[ExecResult]:
        return self._client._exec(self)


class CriClient:
    """An async client of ``runtime.v1.RuntimeService`` over one gRPC channel.

    Create it with :meth:`connect` (or pass a channel, e.g. in tests), use it from one event loop,
    and ``await close()`` it (or use ``async with``).
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        max_concurrent_execs: int = DEFAULT_MAX_CONCURRENT_EXECS,
        runtime_request_timeout: float = DEFAULT_RUNTIME_REQUEST_TIMEOUT,
        exec_slot_margin: float = DEFAULT_EXEC_SLOT_MARGIN,
        exec_slot_hold_max: float = DEFAULT_EXEC_SLOT_HOLD_MAX,
        exec_start_hold: float = DEFAULT_EXEC_START_HOLD,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
        read_retries: int = 3,
        retry_wait_max: float = 2.0,
        liveness: RuntimeLiveness | None = None,
    ) -> None:
        if max_concurrent_execs < 1:
            raise ValueError("max_concurrent_execs must be >= 1")
        if runtime_request_timeout <= 0:
            raise ValueError("runtime_request_timeout must be > 0")
        if exec_slot_margin < 0:
            raise ValueError("exec_slot_margin must be >= 0")
        if exec_slot_hold_max <= 0:
            raise ValueError("exec_slot_hold_max must be > 0")
        if exec_start_hold <= 0:
            raise ValueError("exec_start_hold must be > 0")
        self._channel = channel
        self._stub = api_pb2_grpc.RuntimeServiceStub(channel)
        # Execs answered past the start hold on median: a runtime saturated for everyone.
        self._exec_slots = ExecSlots(
            max_concurrent_execs, per_key=EXEC_SLOTS_PER_CONTAINER, slow_after=exec_start_hold
        )
        self._execs_overdue = 0
        self._execs_outstanding = 0
        self._exec_slot_wait_seconds = 0.0
        self.max_concurrent_execs = max_concurrent_execs
        self.runtime_request_timeout = runtime_request_timeout
        self.exec_slot_margin = exec_slot_margin
        self.exec_slot_hold_max = exec_slot_hold_max
        self.exec_start_hold = exec_start_hold
        self.call_timeout = call_timeout
        # Whether the runtime answers at all: the health service's "" follows it, and exec
        # timeouts that fall into a silence are errors, not the container's failures.
        self.liveness = liveness if liveness is not None else RuntimeLiveness()
        # The one runtime check (Version) an overdue exec asks for, if any is running.
        self._runtime_check: asyncio.Task[None] | None = None
        # Retry policy for idempotent reads: UNAVAILABLE only (the runtime restarting or not
        # initialised yet), a few attempts with capped, jittered exponential backoff.
        self._retry_if = tenacity.retry_if_exception(_is_unavailable)
        self._retry_stop = tenacity.stop_after_attempt(read_retries)
        self._retry_wait = tenacity.wait_exponential_jitter(
            multiplier=0.1, jitter=0.1, max=retry_wait_max
        )
        # Every call made, as it finishes: metrics and tests subscribe here.
        self.calls: Topic[CriCall] = Topic("cri-calls")
        # The objects the last full listings returned, by ID, for the next listing to reuse.
        self._listed_sandboxes: dict[bytes, PodSandbox] = {}
        self._listed_containers: dict[bytes, Container] = {}
        self._list_sandboxes = channel.unary_unary(
            "/runtime.v1.RuntimeService/ListPodSandbox",
            request_serializer=api_pb2.ListPodSandboxRequest.SerializeToString,
            response_deserializer=LeanSandboxList.FromString,
        )
        self._list_containers = channel.unary_unary(
            "/runtime.v1.RuntimeService/ListContainers",
            request_serializer=api_pb2.ListContainersRequest.SerializeToString,
            response_deserializer=LeanContainerList.FromString,
        )

    @classmethod
    def connect(cls, target: str, **kwargs: Any) -> CriClient:
        """Open a (lazy) channel to a gRPC target such as ``unix:///run/containerd/containerd.sock``."""
        channel = grpc.aio.insecure_channel(
            target,
            options=[
                ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
                ("grpc.enable_http_proxy", 0),
                # containerd enforces grpc-go's ping policy; client keepalive pings would earn
                # GOAWAY too_many_pings, so none are configured.
            ],
        )
        return cls(channel, **kwargs)

    async def close(self) -> None:
        """Close the channel; in-flight calls are cancelled."""
        if self._runtime_check is not None:
            self._runtime_check.cancel()
        self._exec_slots.close()
        self.liveness.close()
        await self._channel.close()

    async def __aenter__(self) -> CriClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def execs_in_flight(self) -> int:
        """How many ExecSync calls hold one of the ``max_concurrent_execs`` slots right now."""
        return self._exec_slots.in_use

    @property
    def execs_waiting(self) -> int:
        """How many ExecSync calls wait for a slot right now."""
        return self._exec_slots.waiting

    @property
    def execs_overdue(self) -> int:
        """How many ExecSync calls gave their slot back after timeout + slot margin and wait on."""
        return self._execs_overdue

    @property
    def execs_outstanding(self) -> int:
        """How many ExecSync calls the runtime is working on right now, with a slot or without."""
        return self._execs_outstanding

    @property
    def exec_slot_wait_seconds(self) -> float:
        """Seconds ExecSync calls spent waiting for a slot, in all (a counter)."""
        return self._exec_slot_wait_seconds

    @property
    def exec_slot_preemptions(self) -> int:
        """Slots taken from execs past their start hold for a waiting call (a counter)."""
        return self._exec_slots.preemptions

    @property
    def exec_pace(self) -> float | None:
        """The median seconds from slot to answer of the last answered execs (None: too few)."""
        return self._exec_slots.runtime_pace

    @property
    def exec_runtime_slow(self) -> bool:
        """The runtime answers everyone's execs slowly (past the start hold on median): a start
        hold then judges no container, and fewer execs start at a time (exec_slots)."""
        return self._exec_slots.runtime_slow

    @property
    def exec_overruns(self) -> int:
        """Execs still running at the end of their start hold (a counter)."""
        return self._exec_slots.overruns

    # -- plumbing -------------------------------------------------------------------------------

    async def _call(self, method: str, call: Callable[[], Awaitable[_T]]) -> _T:
        """Run one RPC and translate a gRPC error into a ``CriError``."""
        started = time.monotonic()
        code = "OK"
        answered = "CANCELLED"  # what liveness hears unless the call ends with a status
        token = self.liveness.call_started(method)
        try:
            result = await call()
            answered = code
            return result
        except grpc.aio.AioRpcError as exc:
            code = answered = exc.code().name
            raise cri_error(method, exc.code(), exc.details() or "") from exc
        finally:
            self.liveness.call_ended(token, method, answered)
            if self.calls:
                self.calls.publish(CriCall(method, code, time.monotonic() - started))

    async def _read(self, method: str, call: Callable[[], Awaitable[_T]]) -> _T:
        """Run an idempotent read, retrying UNAVAILABLE with capped exponential backoff."""
        # A fresh controller per call: tenacity keeps per-run state on it, and calls overlap.
        retrying = tenacity.AsyncRetrying(
            retry=self._retry_if,
            stop=self._retry_stop,
            wait=self._retry_wait,
            before_sleep=_log_retry,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self._call(method, call)
        raise AssertionError("unreachable: tenacity reraises the last error")  # pragma: no cover

    # -- runtime --------------------------------------------------------------------------------

    async def version(self) -> RuntimeVersion:
        """CRI Version."""
        resp = await self._read(
            "Version",
            lambda: self._stub.Version(
                api_pb2.VersionRequest(version="v1"), timeout=self.call_timeout
            ),
        )
        return RuntimeVersion(
            version=resp.version,
            runtime_name=resp.runtime_name,
            runtime_version=resp.runtime_version,
            runtime_api_version=resp.runtime_api_version,
        )

    async def status(self) -> tuple[RuntimeCondition, ...]:
        """CRI Status: the runtime's conditions."""
        resp = await self._read(
            "Status", lambda: self._stub.Status(api_pb2.StatusRequest(), timeout=self.call_timeout)
        )
        return tuple(
            RuntimeCondition(c.type, c.status, c.reason, c.message) for c in resp.status.conditions
        )

    # -- sandboxes ------------------------------------------------------------------------------

    async def list_pod_sandboxes(self) -> list[PodSandbox]:
        """Every sandbox the runtime knows, in any state (no filter)."""
        resp: Any = await self._read(
            "ListPodSandbox",
            lambda: self._list_sandboxes(
                api_pb2.ListPodSandboxRequest(), timeout=self.call_timeout
            ),
        )
        listed, self._listed_sandboxes = reuse_listed(
            resp.items, self._listed_sandboxes, sandbox_from_item
        )
        return listed

    async def pod_sandbox_status(self, sandbox_id: str) -> SandboxStatus:
        """PodSandboxStatus: raises ``CriNotFound`` for an unknown sandbox."""
        resp = await self._read(
            "PodSandboxStatus",
            lambda: self._stub.PodSandboxStatus(
                api_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id),
                timeout=self.call_timeout,
            ),
        )
        return sandbox_status_from_pb(resp.status, self._listed_sandboxes.get(sandbox_id.encode()))

    # -- containers -----------------------------------------------------------------------------

    async def list_containers(
        self, *, pod_sandbox_id: str = "", state: ContainerState | None = None
    ) -> list[Container]:
        """Containers in any state unless filtered (server-side filters only)."""
        request = api_pb2.ListContainersRequest(
            filter=api_pb2.ContainerFilter(pod_sandbox_id=pod_sandbox_id)
        )
        if state is not None:
            # Setting the wrapper marks the filter present even for CONTAINER_CREATED (= 0).
            request.filter.state.state = int(state)  # type: ignore[assignment]
        resp: Any = await self._read(
            "ListContainers",
            lambda: self._list_containers(request, timeout=self.call_timeout),
        )
        listed, seen = reuse_listed(resp.items, self._listed_containers, container_from_item)
        if not pod_sandbox_id and state is None:
            # Only a full listing says what is gone; a filtered one keeps the others known.
            self._listed_containers = seen
        return listed

    async def container_status(
        self, container_id: str, *, verbose: bool = False
    ) -> ContainerStatus:
        """ContainerStatus; ``verbose`` adds the configured env and PID if the runtime has them."""
        resp = await self._read(
            "ContainerStatus",
            lambda: self._stub.ContainerStatus(
                api_pb2.ContainerStatusRequest(container_id=container_id, verbose=verbose),
                timeout=self.call_timeout,
            ),
        )
        return container_status_from_pb(
            resp.status,
            resp.info if verbose else None,
            self._listed_containers.get(container_id.encode()),
        )

    async def stop_container(self, container_id: str, *, grace_seconds: int) -> None:
        """StopContainer with a grace period; an already-gone container counts as stopped."""
        try:
            await self._call(
                "StopContainer",
                lambda: self._stub.StopContainer(
                    api_pb2.StopContainerRequest(container_id=container_id, timeout=grace_seconds),
                    # The call returns only after the container exited, i.e. up to the grace.
                    timeout=grace_seconds + self.call_timeout,
                ),
            )
        except CriNotFound:
            # containerd before 1.6.35/1.7.21 answers NOT_FOUND for an unknown ID; later ones OK.
            return

    # -- exec -----------------------------------------------------------------------------------

    async def exec_sync(self, container_id: str, cmd: Sequence[str], *, timeout: int) -> ExecResult:
        """Run ``cmd`` (argv, no shell) in the container and wait for it.

        ``timeout`` (whole seconds, as CRI takes it; 0 means none) is enforced by the runtime.
        As in the kubelet, the client deadline is ``timeout + runtime_request_timeout``: containerd
        answers once the exec's output has drained, which a background child can delay well past
        the timeout, and that late answer is the verdict. With ``timeout`` 0 the kubelet sets no
        deadline at all; here ``runtime_request_timeout`` bounds the call.

        The call first waits for one of the node-wide exec slots, taking turns with the other
        containers (one slot per container at a time; containers whose last exec overran its
        start hold after the others), and holds it until it is past ``exec_start_hold`` and
        another call waits, and at most until ``min(timeout, exec_slot_hold_max) +
        exec_slot_margin`` (``call_timeout`` stands in for a 0 timeout); then it gives the slot
        back and waits on. Waiting for a slot does not count against the deadline. Both bounds
        hold by the clock, even when a starved loop runs their timers late (the next call asking
        for a slot checks them), and the slot goes back as soon as grpc delivers the answer.
        The result's ``elapsed`` and the runtime's pace are the call's own time, from when it
        went out to that delivery: a starved loop's delays around it are not the runtime's.

        Never retried: a command may have side effects. A reply over ``MAX_RECEIVE_MESSAGE_BYTES``
        raises ``CriError`` (RESOURCE_EXHAUSTED), as it is an error for the kubelet. A timeout
        while the runtime answered nothing at all raises ``CriRuntimeStalled``: it says nothing
        about the command. A container that is not running, or gone, raises
        ``CriContainerNotRunning``: the call raced its stop or removal.
        """
        return await self.exec_call(container_id, cmd, timeout=timeout)()

    def exec_call(self, container_id: str, cmd: Sequence[str], *, timeout: int) -> ExecCall:
        """``exec_sync(container_id, cmd, timeout=timeout)`` built once: each call of the
        returned ``ExecCall`` is one such exec. A probe that runs the same command every period
        keeps one (issue 36), so the request message, its deadline and its slot hold are not
        rebuilt per attempt; a changed container, command or timeout needs a new one."""
        return ExecCall(self, container_id, cmd, timeout)

    async def _exec(self, prepared: ExecCall) -> ExecResult:
        """One exec of ``prepared`` (see ``exec_sync`` for what it does)."""
        container_id = prepared.container_id
        request = prepared.request
        timeout = prepared.timeout
        deadline = prepared.deadline
        hold = prepared.hold
        loop = asyncio.get_running_loop()
        asked = loop.time()
        slot = await self._exec_slots.acquire(container_id)
        started = loop.time()
        self._exec_slot_wait_seconds += started - asked
        # From here on the slot goes back exactly once (release() and finish() are idempotent):
        # to a waiting call once past the start hold, by the timer when the call outlives its
        # hold, otherwise in the finally clause (also on cancellation).
        overdue = False
        answered = False
        paced = False  # answered with an exit status within the timeout: news of the runtime
        sent_at = started  # when the call went out (the loop may get to it late)
        answered_at: float | None = None  # when grpc delivered the answer to the loop

        def give_back_slot() -> None:
            nonlocal overdue
            if overdue:
                return  # its timer and a caller checking the bounds may both get here
            overdue = True
            self._execs_overdue += 1
            slot.soften()  # in case both timers fell due in one loop iteration
            slot.release()
            # Still no answer: if nothing else is asking the runtime right now, ask it something
            # quick, so that a runtime that went silent is noticed even on a quiet node.
            self._check_runtime()

        def delivered(_call: object) -> None:
            # grpc ran the call's done callbacks: the answer is here, and the slot goes back
            # now, an iteration or more before the awaiting coroutine resumes on a busy loop.
            nonlocal answered_at
            answered_at = loop.time()
            slot.unbind()  # answered: never overdue from now on
            slot.release()  # judged by finish() below, with the runtime's own time

        def send() -> Awaitable[api_pb2.ExecSyncResponse]:
            nonlocal sent_at
            sent_at = loop.time()
            call = self._stub.ExecSync(request, timeout=deadline)
            call.add_done_callback(delivered)
            return call

        soft_at = prepared.soft_at
        slot.bound(soft_at=started + soft_at, due=started + hold, on_due=give_back_slot)
        self._exec_slots.watch_bounds()  # one timer for every slot's bounds (issue 36)
        self._execs_outstanding += 1
        try:
            try:
                resp = await self._call("ExecSync", send)
            except CriError as exc:
                answered = True
                if container_not_running(exc):
                    gone = exc.code is grpc.StatusCode.NOT_FOUND
                    error = CriContainerGone if gone else CriContainerNotRunning
                    raise error(exc.method, exc.code, exc.details) from exc
                raise
            answered = True
            paced = timeout <= 0 or (answered_at or loop.time()) - sent_at <= timeout
        except CriDeadlineExceeded as exc:
            # The call's own time: a starved loop's delays before it went out and after grpc
            # delivered its answer are not the command's (issue 36).
            ended = answered_at or loop.time()
            elapsed = ended - sent_at
            # A frozen runtime fakes a timeout only if it was silent when its timer fired, which
            # is no earlier than ``timeout`` after the call went out (the runtime starts the
            # clock when it gets to the request): a silence long before that says nothing.
            if self.liveness.stalled_during(sent_at + timeout, ended):
                raise CriRuntimeStalled(
                    "ExecSync",
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{exc.details} (after {elapsed:.1f}s, while the runtime answered nothing "
                    f"for {self.liveness.stall_seconds:g}s or more: not the command's timeout)",
                ) from exc
            # An answer before our deadline is the runtime's own timeout error; one later than
            # the slot margin after the timeout means it first waited for the killed exec's
            # output to drain.
            drained = timeout > 0 and timeout + self.exec_slot_margin < elapsed < deadline
            return ExecResult(
                exit_code=None,
                stdout=b"",
                stderr=b"",
                timed_out=True,
                message=exc.details,
                elapsed=elapsed,
                drained_after_timeout=drained,
            )
        finally:
            self._execs_outstanding -= 1
            if overdue:
                self._execs_overdue -= 1
            # An answer judges the container (in good standing again if it came within the
            # start hold); a cancelled call says nothing about it.
            if answered:
                # The runtime's pace is the call's own time: from when it went out to when grpc
                # delivered the answer, without the loop's delays before and after (issue 36).
                slot.finish(paced=paced, took=(answered_at or loop.time()) - sent_at)
            else:
                slot.unbind()
                slot.release()
        elapsed = (answered_at or loop.time()) - sent_at  # as above: the call's own time
        stdout = resp.stdout[:MAX_EXEC_OUTPUT_BYTES]
        stderr = resp.stderr[: MAX_EXEC_OUTPUT_BYTES - len(stdout)]
        return ExecResult(
            exit_code=resp.exit_code,
            stdout=stdout,
            stderr=stderr,
            elapsed=elapsed,
            # The runtime kills a command still running at its timeout, so an exit status that
            # arrives later is one whose output took that long to close.
            drained_after_timeout=timeout > 0 and elapsed > timeout,
        )

    def _check_runtime(self) -> None:
        """Ask the runtime for its Version unless a check or another read is already out.

        The answer itself is of no interest: the call reports to ``liveness`` like any other,
        and a check left unanswered opens a silence there, which is what tells a frozen runtime
        from an exec that is slow on its own.
        """
        if self.liveness.asking() or (
            self._runtime_check is not None and not self._runtime_check.done()
        ):
            return
        self._runtime_check = asyncio.get_running_loop().create_task(
            self._ask_version(), name="cri-runtime-check"
        )

    async def _ask_version(self) -> None:
        try:
            await self._call(
                "Version",
                lambda: self._stub.Version(
                    api_pb2.VersionRequest(version="v1"), timeout=self.call_timeout
                ),
            )
        except (CriError, grpc.aio.UsageError) as exc:  # UsageError: the channel closed first
            log.debug("runtime_check_failed", error=str(exc))

    # -- events ---------------------------------------------------------------------------------

    async def container_events(self) -> AsyncIterator[ContainerEvent]:
        """Stream GetContainerEvents until cancelled; errors surface as ``CriError``.

        The caller must keep reading: on containerd 2.x a stalled reader blocks the runtime.
        """
        call = self._stub.GetContainerEvents(api_pb2.GetEventsRequest())
        try:
            async for pb in call:
                yield ContainerEvent(
                    container_id=pb.container_id,
                    type=ContainerEventType(pb.container_event_type),
                    created_at=pb.created_at,
                    sandbox=(
                        sandbox_status_from_pb(
                            pb.pod_sandbox_status,
                            self._listed_sandboxes.get(pb.pod_sandbox_status.id.encode()),
                        )
                        if pb.HasField("pod_sandbox_status")
                        else None
                    ),
                    containers=tuple(
                        container_status_from_pb(
                            s, listed=self._listed_containers.get(s.id.encode())
                        )
                        for s in pb.containers_statuses
                    ),
                )
        except grpc.aio.AioRpcError as exc:
            raise cri_error("GetContainerEvents", exc.code(), exc.details() or "") from exc
        finally:
            call.cancel()


__all__ = [
    "DEFAULT_CALL_TIMEOUT",
    "DEFAULT_EXEC_SLOT_HOLD_MAX",
    "DEFAULT_EXEC_SLOT_MARGIN",
    "DEFAULT_EXEC_START_HOLD",
    "DEFAULT_MAX_CONCURRENT_EXECS",
    "DEFAULT_RUNTIME_REQUEST_TIMEOUT",
    "EXEC_SLOTS_PER_CONTAINER",
    "MAX_RECEIVE_MESSAGE_BYTES",
    "CriClient",
    "CriRuntimeStalled",
    "ExecCall",
]
