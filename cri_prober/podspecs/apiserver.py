"""Pod specs from the API server: list, then watch, the pods bound to this node
(``fieldSelector=spec.nodeName=<node>``), as the kubelet's own pod informer (client-go's
reflector) does.

The client config is lightkube's: it reads the config (in-cluster service account,
``$KUBECONFIG`` or an explicit kubeconfig file) and authenticates (tokens, rotated
service-account token files, exec plugins, client certificates) through an httpx2 client built
by its ``client_adapter``. Lists and watches are read here over that client rather than through
lightkube's models: its list builds every pod whole as Python objects (a tenant's 1.5 MB env
list included), and its ``watch`` cannot ask for bookmarks, has no cap on a line, and on 410 Gone
either raises or silently re-watches from "now", which never reports the pods deleted during
the gap. Pages and events are decoded into only the fields cri-prober uses (``decode.py``).

The protocol, as client-go's reflector follows it (``tools/cache/reflector.go``):

- A streaming list first, where the server offers one: a watch with ``sendInitialEvents=true``
  (``resourceVersionMatch=NotOlderThan``), whose ADDED events up to the bookmark annotated
  ``k8s.io/initial-events-end`` are the listing, served by the watch cache. A server without it
  (the WatchList gate is off by default up to 1.31) answers 422; that, or no end bookmark within
  ``initial_events_timeout`` (a 1.28 cache sends none after a restart until a pod is written),
  turns it off for the process's life: LIST from then on.
- LIST → ``replace_all``. The first with ``resourceVersion=0``, a relist with the last
  resourceVersion seen and no ``limit`` (the reflector's ``relistResourceVersion`` and its
  unpaged relist): both are served by the watch cache, which ignores ``limit`` and never goes back
  in time behind what was seen; neither reads etcd. Only if the cache cannot answer at that
  version (HTTP 410, or 504 "Too large resource version") does the list read etcd (no
  resourceVersion, paged by ``limit``/``continue``), at once, as the reflector does. Paged etcd
  lists are kept for life when the cache is off (a ``resourceVersion=0`` answer came paged) or
  one unpaged answer passed ``max_page_bytes`` (a node of huge pods: pages bound each answer).
- WATCH from the listing's resourceVersion with ``allowWatchBookmarks=true`` and a server
  ``timeoutSeconds`` of 5-10 min (the reflector's ``minWatchTimeout`` × 1-2): ADDED/MODIFIED →
  ``upsert``, DELETED → ``remove``, BOOKMARK → only the resourceVersion moves.
- Liveness of a stream does not count on bookmarks: the real server sends none with the watch
  cache off, none after a restart until a pod is written, none on short timeouts. A healthy
  stream, however quiet, ends by the server's ``timeoutSeconds`` (an empty final chunk) and is
  resumed from the last resourceVersion without a relist; the client's read timeout is that
  plus ``WATCH_READ_MARGIN``, which only a dead connection reaches.
- 410 Gone (on a watch an HTTP 200 with an ERROR event holding a 410 Status; an HTTP 410 too):
  relist, which replaces the whole view, so pods deleted meanwhile disappear. An API server
  restart answers it to every older resourceVersion, so every node relists: each relist waits a
  jittered back-off first (the reflector's backoff manager: 0.8 s doubling to 30 s, × 1-2,
  reset after 2 min without one), spreading a fleet's lists; the first list at start is at once.
- Any other error (HTTP 401/403/5xx, an ERROR event, the server unreachable): ``failed`` (one
  rate-limited log line, the last good view kept), then retry after a capped, jittered
  exponential back-off. As the reflector does, a watch that the server refused or ended with
  an error (an ERROR event, a line that is not an event, a status other than 429) is followed
  by a relist at the last resourceVersion (from the watch cache, not etcd), so nothing the
  failed stream may have skipped is kept; only an unreachable server, a 429 and a stream that
  broke or ended are resumed by a watch. (The reflector also relists after a watch that ended
  within a second having sent nothing; here such a watch is retried after the back-off.)
  A watch that ends normally is resumed at once, as the reflector does; but from the third in a
  row that the server ended within a second of opening it, the next one waits until a second
  after the last one opened (``watch_churn.py``), with one rate-limited warning: a server that
  ends every stream after one event would otherwise get about 120 watches a second.
  A 403 before the first good read is a warning without the RBAC advice
  for ``forbidden_grace`` (an API server that is starting refuses requests until its RBAC cache
  is loaded); after that, the error with the advice. After a good read, a 401, 403, 5xx or an
  unreachable server is what a restarting API server answers: each gets the same grace, from
  its first time since the last good read, before it is an error. Within a grace the back-off
  stays at its first ``GRACE_RETRY_STEPS`` steps, so the relist after the restart is not pushed
  out by it. A 429 (the server asks to slow down) is always a warning, and backs off as usual.

Staleness: an open watch stream counts as a good read however silent it is. The view becomes
stale only once no stream has been open, and no list has gone through, for ``stale_after``
(default 60 s: an API server restart or a couple of back-off rounds).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Final

import httpx2
import structlog
from lightkube.config import client_adapter

from cri_prober.errors import ConfigError
from cri_prober.files import describe_size
from cri_prober.logs import Logged, is_repeat
from cri_prober.podspecs.apiserver_client import (
    INITIAL_EVENTS_END,
    ConfigArg,
    LineTooLong,
    ReadFailure,
    TokenFileAuth,
    decode_event,
    describe_status,
    ends_initial_events,
    http_failure,
    load_config,
    read_head,
    read_lines,
    status_text,
    version_unavailable,
)
from cri_prober.podspecs.decode import MAX_PODS, DecodedPod, PodListError, decode_pod_list
from cri_prober.podspecs.source import ERROR_LOG_CHARS, Changed, PodSource
from cri_prober.podspecs.watch_churn import WatchChurn

__all__ = ["DEFAULT_STALE_AFTER", "ApiServerSource"]

# How long without an open watch stream or a good list before the view counts as stale.
DEFAULT_STALE_AFTER: Final = 60.0
# The server's timeoutSeconds for one watch is this times 1 to 2 (client-go's reflector: 5-10
# min), so the watches of many nodes do not all end together.
WATCH_TIMEOUT: Final = 300.0
# The client's read timeout on a watch is its timeoutSeconds plus this: the server ends a
# healthy stream first, however quiet; only a dead connection lasts past it.
WATCH_READ_MARGIN: Final = 30.0
# Connect, write and pool timeouts of every request, and the read timeout of a list.
REQUEST_TIMEOUT: Final = 30.0
# Pods per page of a paged (etcd) list: ~110 pods on a full node take four pages; 32 pods of
# the API server's largest (~1.5 MiB each) fit in MAX_PAGE_BYTES.
PAGE_SIZE: Final = 32
# The most one list answer (a page, or a whole unpaged list) may take, in bytes, and in seconds
# whatever the server trickles.
MAX_PAGE_BYTES: Final = 64 * 1024 * 1024
PAGE_TIMEOUT: Final = 60.0
# The longest watch line (one event) read. An object is at most ~1.5 MiB in etcd; as JSON, Go
# may write some characters as six-byte \u escapes, so an event can be a few times that.
MAX_EVENT_BYTES: Final = 16 * 1024 * 1024
# Backoff between failed attempts: initial * 2**(n-1), capped, with "equal jitter" (½ to 1×).
RETRY_INITIAL: Final = 0.5
RETRY_MAX: Final = 30.0
# The wait before a relist: client-go's reflector backoffManager,
# NewExponentialBackoffManager(800ms, 30s, 2min, 2.0, 1.0): 0.8 s doubling up to 30 s, each
# drawn from [d, 2d), back to 0.8 s after 2 min without a relist.
RELIST_INITIAL: Final = 0.8
RELIST_MAX: Final = 30.0
RELIST_RESET: Final = 120.0
# A streaming list that has not sent its initial-events-end bookmark by then is given up.
INITIAL_EVENTS_TIMEOUT: Final = 10.0
# A 403 before the first good read is taken for an API server still loading its RBAC for this
# long (and at least FORBIDDEN_GRACE_ATTEMPTS attempts): a warning, not the RBAC error. After a
# good read the same grace covers a reconnect to a restarting API server: 401, 403, 5xx and an
# unreachable server, each kind from its first time since the last good read.
FORBIDDEN_GRACE: Final = 30.0
FORBIDDEN_GRACE_ATTEMPTS: Final = 3
# Within a grace the failure back-off stays at its first steps (0.25-1 s by default), so the
# relist after a restart comes about a second after the server is back, not 15-25 s later.
GRACE_RETRY_STEPS: Final = 2
# A stream that delivered an event, or stayed open this long, resets the backoff.
HEALTHY_STREAM_SECONDS: Final = 5.0

# Reading the Node object for its kubelet version: its size cap (a Node lists its images) and
# how long the read may take before serve goes on with --kubelet-version or the default.
MAX_NODE_BYTES: Final = 8 * 1024 * 1024
NODE_TIMEOUT: Final = 10.0

Sleep = Callable[[float], Awaitable[None]]


def _kubelet_version(body: bytes) -> str | None:
    """``status.nodeInfo.kubeletVersion`` of a Node's JSON, or None (bounded to 64 chars)."""
    try:
        node = json.loads(body)
        version = node["status"]["nodeInfo"]["kubeletVersion"]
    except (ValueError, KeyError, TypeError):
        return None
    return version[:64] if isinstance(version, str) and version else None


class _Outcome(enum.Enum):
    ENDED = "ended"  # the stream ended or broke: resume from the last resourceVersion
    GONE = "gone"  # 410: the resourceVersion is too old, relist
    NO_STREAMING = "no-streaming"  # the streaming list is refused or unfinished: list instead


class _VersionUnavailable(ReadFailure):
    """A list at a resourceVersion the watch cache cannot serve (410, or too large)."""


class _Unreachable(ReadFailure):
    """No answer from the API server (refused, reset, timed out): retried as it was."""


class _AnswerTooLarge(ReadFailure):
    """One list answer passed max_page_bytes."""


class ApiServerSource(PodSource):
    """The pods bound to ``node_name``, listed and watched from the API server.

    Config: ``config`` (a lightkube ``KubeConfig`` or ``SingleConfig``) if given, else the
    ``kubeconfig`` file, else lightkube's ``KubeConfig.from_env()``: the in-cluster service
    account, then ``$KUBECONFIG``, then ``~/.kube/config``. ``read_timeout`` (tests) replaces
    the watch's read timeout, else timeoutSeconds + WATCH_READ_MARGIN.

    Raises:
        ConfigError: ``node_name`` is empty, or no usable client config was found.
    """

    watches: int = 0  # watch requests sent (the source's own count, in the metrics)

    def __init__(
        self,
        *,
        node_name: str,
        kubeconfig: Path | None = None,
        config: ConfigArg = None,
        stale_after: float = DEFAULT_STALE_AFTER,
        clock: Callable[[], float] = time.monotonic,
        watch_timeout: float = WATCH_TIMEOUT,
        read_timeout: float | None = None,
        request_timeout: float = REQUEST_TIMEOUT,
        page_size: int = PAGE_SIZE,
        retry_initial: float = RETRY_INITIAL,
        retry_max: float = RETRY_MAX,
        relist_initial: float = RELIST_INITIAL,
        relist_max: float = RELIST_MAX,
        streaming_list: bool = True,
        initial_events_timeout: float = INITIAL_EVENTS_TIMEOUT,
        forbidden_grace: float = FORBIDDEN_GRACE,
        rng: random.Random | None = None,
        sleep: Sleep = asyncio.sleep,
        max_page_bytes: int = MAX_PAGE_BYTES,
        max_event_bytes: int = MAX_EVENT_BYTES,
        max_pods: int = MAX_PODS,
        keep_statuses: bool = False,
    ) -> None:
        if not node_name:
            raise ConfigError(
                "--probes-from apiserver needs the node's name (serve --node-name or NODE_NAME)"
            )
        super().__init__("apiserver", stale_after=stale_after, node_name=node_name, clock=clock)
        # This module's lines, with the source's name bound (the base class's: ``self.logger``).
        self.own_logger = structlog.get_logger(__name__, source=self.name)
        self._config = load_config(kubeconfig, config)
        self.server = str(self._config.cluster.server)
        self._watch_timeout = watch_timeout
        self._read_timeout = read_timeout
        self._page_size = page_size
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self._relist_initial = relist_initial
        self._relist_max = relist_max
        self._initial_events_timeout = initial_events_timeout
        self._forbidden_grace = forbidden_grace
        self._rng = rng or random.Random()
        self._sleep = sleep
        timeout = httpx2.Timeout(request_timeout)
        self._max_page_bytes = max_page_bytes
        self._max_event_bytes = max_event_bytes
        self._max_pods = max_pods
        # serve --mirror: keep each container's ready/started (PodSpec.statuses). Each status
        # change then changes the pod's digest and has it parsed again: only when asked.
        self.keep_statuses = keep_statuses
        try:
            self._http = client_adapter.AsyncClient(
                self._config, client_adapter.ConnectionParams(timeout=timeout)
            )
        except Exception as exc:  # CA or client certificate files missing or unreadable
            raise ConfigError(
                f"--probes-from apiserver: cannot set up the client for {self.server}: {exc}"
            ) from exc
        if isinstance(self._http.auth, client_adapter.BearerTokenFileAuth):
            # lightkube reads a (rotated) service-account token file with a plain open() on the
            # event loop, which a FIFO put there would block for ever.
            self._http.auth = TokenFileAuth(Path(self._http.auth._token_file))
        self._resource_version: str | None = None  # where the watch resumes; None: list first
        self._last_version: str | None = None  # the newest resourceVersion seen (a relist's)
        self._streaming = streaming_list  # try a streaming list (until the server refuses it)
        self._from_etcd = False  # the next list reads etcd: the cache cannot serve our version
        self._paged = False  # every list reads etcd in pages (cache off, or huge answers)
        self._relist_step = 0  # relists within RELIST_RESET of each other: the back-off's step
        self._relisted_at: float | None = None
        self._relist_wait = 0.0  # the wait before the next relist, once a 410 asked for one
        self._ever_read = False  # a list or stream went through since start
        # Per kind of failure a restart gives ("403", "503", "unreachable"...): its first time
        # since the last good read, and how many since; cleared by a good read.
        self._grace: dict[str, tuple[float, int]] = {}
        self._warned: Logged | None = None  # the last grace or 429 warning, for its rate limit
        self._failing = 0  # failed attempts since the last good read
        self._watching = False  # a watch stream is open (answered 200, not ended yet)
        self._closed = False
        self.relists = 0  # lists after the first (410 Gone)
        self._churn = WatchChurn(clock, self.own_logger)  # watches the server ends at once

    @property
    def client(self) -> httpx2.AsyncClient:
        """The authenticated client (serve --mirror's Unhealthy events watch shares it)."""
        return self._http

    # -- the view's freshness ------------------------------------------------------------------

    def stale(self) -> bool:
        """An open watch is a good read however silent; else no good read for stale_after."""
        if self._watching:
            return False
        return super().stale()

    # -- running -------------------------------------------------------------------------------

    async def run(self, changed: Changed) -> None:
        attempt = 0  # failed or unhealthy attempts in a row: the backoff's exponent
        while True:
            pace = 0.0  # the wait a churning server's watches get (watch_churn.py)
            try:
                if self._resource_version is None and not self._streaming:
                    await self._list(changed)
                opened = time.monotonic()
                opened_at = self._clock()
                outcome, healthy = await self._watch(changed)
                healthy = healthy or time.monotonic() - opened >= HEALTHY_STREAM_SECONDS
                # A 410 or a refused streaming list is an answer, not a failure: the server is
                # up; the relist's own back-off (or none) applies.
                attempt = 0 if healthy or outcome is not _Outcome.ENDED else attempt + 1
                if outcome is _Outcome.ENDED:
                    pace = self._churn.ended(opened_at)
                else:
                    self._churn.reset()
            except asyncio.CancelledError:
                raise
            except ReadFailure as exc:
                # Within a grace (a restarting server), retry at the first steps' quick pace.
                graced = self._failure(exc)
                attempt = min(attempt + 1, GRACE_RETRY_STEPS) if graced else attempt + 1
                if exc.status != 429 and not isinstance(exc, _Unreachable):
                    # The reflector's rule: after a watch that failed, relist (at the last
                    # resourceVersion: the watch cache) rather than trust a resumed stream.
                    self._resource_version = None
                if isinstance(exc, LineTooLong):
                    await self.give_back(self._max_event_bytes)  # the line read so far
            except Exception as exc:  # a bug, or an error no branch foresaw: keep going
                message = f"unexpected error: {type(exc).__name__}: {exc}"
                if message != self.last_error:  # the traceback once, not every retry
                    self.own_logger.exception("pod_source_error")
                self.failed(message)
                attempt += 1
            delay, self._relist_wait = self._relist_wait, 0.0
            if attempt:
                delay = max(delay, self._backoff(attempt))
            delay = max(delay, pace)
            if delay:
                await self._sleep(delay)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._http.aclose()

    def _backoff(self, attempt: int) -> float:
        delay = min(self._retry_max, self._retry_initial * 2.0 ** min(attempt - 1, 30))
        return delay / 2 + self._rng.random() * delay / 2

    def _relist_delay(self) -> float:
        """The reflector's backoff manager: d = 0.8 s × 2^step up to 30 s, waited d × [1, 2)."""
        now = self._clock()
        if self._relisted_at is None or now - self._relisted_at > RELIST_RESET:
            self._relist_step = 0
        delay = min(self._relist_max, self._relist_initial * 2.0**self._relist_step)
        self._relist_step = min(self._relist_step + 1, 30)
        self._relisted_at = now
        return delay * (1 + self._rng.random())

    def _failure(self, exc: ReadFailure) -> bool:
        """``failed``, but a warning within a grace (and for a 429); True within a grace.

        A 403 before the first good read, and after one a 401, 403, 5xx or an unreachable
        server, is what an API server that is (re)starting answers: each kind is a warning for
        ``forbidden_grace`` from its first time since the last good read, and at least
        FORBIDDEN_GRACE_ATTEMPTS attempts, before it is the error (with the RBAC advice for a
        403). A 429 asks to slow down: never an error.
        """
        self._failing += 1
        if exc.status == 429:
            self._warn(
                "pod_source_retrying",
                exc.brief,
                self._failing,
                "the API server asks to slow down (429); retrying after the back-off",
            )
            return False
        kind = self._restart_kind(exc)
        if kind is not None:
            now = self._clock()
            since, count = self._grace.get(kind, (now, 0))
            self._grace[kind] = (since, count + 1)
            if count < FORBIDDEN_GRACE_ATTEMPTS or now - since < self._forbidden_grace:
                if exc.status == 403:
                    self._warn(
                        "pod_source_forbidden",
                        exc.brief,
                        count + 1,
                        "the API server refused; retrying (one that is starting refuses "
                        "requests until its authorization cache is loaded)",
                    )
                else:
                    self._warn(
                        "pod_source_retrying",
                        exc.brief,
                        count + 1,
                        "the API server may be restarting; retrying",
                    )
                return True
        self.failed(str(exc))
        return False

    def _restart_kind(self, exc: ReadFailure) -> str | None:
        """The kind of failure, if a (re)starting API server gives it; None if not."""
        if exc.status == 403:
            return "403"
        if not self._ever_read:
            return None  # at start, only a 403: a wrong address or token is an error at once
        if isinstance(exc, _Unreachable):
            return "unreachable"
        if exc.status is not None and (exc.status == 401 or exc.status >= 500):
            return str(exc.status)
        return None

    def _warn(self, event: str, error: str, attempt: int, detail: str) -> None:
        """A warning instead of ``failed``: the read still counts as failed. Logged for the
        first FORBIDDEN_GRACE_ATTEMPTS attempts, then when its text changes or once per
        REPEAT_LOG_SECONDS (quick retries would log one line each)."""
        self.reads += 1
        self.read_errors += 1
        self.last_error = error[:ERROR_LOG_CHARS]
        now, text = self._clock(), f"{event}: {self.last_error}"
        if attempt > FORBIDDEN_GRACE_ATTEMPTS and is_repeat(self._warned, text, now):
            return
        self._warned = (text, now)
        self.own_logger.warning(event, error=self.last_error, attempt=attempt, detail=detail)

    def _read_ok(self) -> None:
        self._ever_read = True
        self._grace.clear()
        self._failing = 0
        self.succeeded()

    # -- list ----------------------------------------------------------------------------------

    def _list_version(self) -> tuple[str | None, bool]:
        """The resourceVersion a list asks for (None: etcd's latest), and whether it pages."""
        if self._paged or self._from_etcd:
            return None, True
        if self._last_version is None:
            # The watch cache; it ignores limit, which pages only where the cache is off.
            return "0", True
        # The cache again, at least as new as what we saw; a limit would send it to etcd.
        return self._last_version, False

    async def _list(self, changed: Changed) -> None:
        version, paged = self._list_version()
        try:
            pods, resource_version, read_bytes = await self._read_list(version, paged)
        except _VersionUnavailable as exc:
            # The reflector retries at once from etcd: the cache has not (or no longer) got it.
            self._from_etcd = True
            self.own_logger.info(
                "pod_list_fallback",
                resource_version=version,
                detail=str(exc),
                action="listing from etcd",
            )
            version, paged = self._list_version()
            pods, resource_version, read_bytes = await self._read_list(version, paged)
        except _AnswerTooLarge:
            if version is not None:  # the cache answers whole, limit or not
                self._paged = True  # etcd's pages bound each answer
            raise
        count = len(pods)
        try:
            view_changed = await self.apply_listing(pods)
        finally:
            await self.give_back(read_bytes)
        self._from_etcd = False
        self._resource_version = resource_version or ""  # "": watch from "now", ADDED for all
        self._last_version = resource_version or self._last_version
        self._read_ok()
        self.own_logger.debug(
            "pod_source_listed",
            pods=count,
            resource_version=resource_version,
            asked=version if version is not None else "",
        )
        if view_changed:
            changed()

    async def _read_list(
        self, version: str | None, paged: bool
    ) -> tuple[list[DecodedPod], str | None, int]:
        pods: list[DecodedPod] = []
        resource_version: str | None = None
        token: str | None = None
        read_bytes = 0
        while True:
            params = {"fieldSelector": f"spec.nodeName={self.node_name}"}
            if paged:
                params["limit"] = str(self._page_size)
            if token:
                params["continue"] = token  # a continued list may not name a version
            elif version is not None:
                params["resourceVersion"] = version
            body = await self._read_page(params, version)
            read_bytes += len(body)
            try:
                page = await asyncio.to_thread(
                    decode_pod_list, body, max_pods=self._max_pods, statuses=self.keep_statuses
                )
            except PodListError as exc:
                raise ReadFailure(
                    f"list pods: the API server's answer is not a usable PodList: {exc}"
                ) from None
            finally:
                with contextlib.suppress(BufferError):  # a cancelled decoder still reads it
                    del body[:]
            pods.extend(page.pods)
            if len(pods) > self._max_pods:
                raise ReadFailure(
                    f"list pods: more than {self._max_pods} pods on node {self.node_name}: "
                    "not one node's pods"
                )
            resource_version = page.resource_version
            token = page.continue_token
            if token and version == "0":
                self._paged = True  # the reflector's paginatedResult: the cache is off
            if not token:
                return pods, resource_version, read_bytes

    async def _read_page(self, params: Mapping[str, str], version: str | None) -> bytearray:
        """One list answer's body, at most ``max_page_bytes``, within PAGE_TIMEOUT."""
        try:
            async with asyncio.timeout(PAGE_TIMEOUT):
                async with self._http.stream("GET", "api/v1/pods", params=params) as resp:
                    if resp.status_code != 200:
                        head = await read_head(resp)
                        if version not in (None, "0") and version_unavailable(
                            resp.status_code, head
                        ):
                            raise _VersionUnavailable(
                                f"list pods at resourceVersion {version}: "
                                + status_text(resp.status_code, head),
                                status=resp.status_code,
                            )
                        raise http_failure("list", resp.status_code, head)
                    body = bytearray()
                    async for chunk in resp.aiter_bytes():
                        body += chunk
                        if len(body) > self._max_page_bytes:
                            raise _AnswerTooLarge(
                                "list pods: an answer of the API server is larger than "
                                f"{describe_size(self._max_page_bytes)}: stopped reading"
                                + ("" if version is None else "; lists read pages from now on")
                            )
                    return body
        except TimeoutError:
            raise ReadFailure(
                f"list pods: the API server at {self.server} did not answer a page within "
                f"{PAGE_TIMEOUT:g}s"
            ) from None
        except httpx2.TransportError as exc:
            raise _Unreachable(self._unreachable("list", exc)) from exc

    # -- the node's kubelet version ------------------------------------------------------------

    async def kubelet_version(self, timeout: float = NODE_TIMEOUT) -> str:
        """This node's ``status.nodeInfo.kubeletVersion`` (``v1.33.2``), read from its Node
        object (RBAC: get on nodes). ReadFailure says why it could not be read."""
        verb = f"get node {self.node_name}"
        try:
            async with asyncio.timeout(timeout):
                path = f"api/v1/nodes/{self.node_name}"
                async with self._http.stream("GET", path) as resp:
                    if resp.status_code != 200:
                        head = await read_head(resp)
                        raise ReadFailure(
                            f"{verb}: {status_text(resp.status_code, head)}",
                            status=resp.status_code,
                        )
                    body = bytearray()
                    async for chunk in resp.aiter_bytes():
                        body += chunk
                        if len(body) > MAX_NODE_BYTES:
                            raise ReadFailure(
                                f"{verb}: larger than {describe_size(MAX_NODE_BYTES)}"
                            )
        except TimeoutError:
            raise ReadFailure(f"{verb}: no answer within {timeout:g}s") from None
        except httpx2.TransportError as exc:
            text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise ReadFailure(
                f"{verb}: cannot reach the API server at {self.server}: {text}"
            ) from exc
        # A Node lists its images: parsed off the event loop.
        version = await asyncio.to_thread(_kubelet_version, bytes(body))
        if version is None:
            raise ReadFailure(f"{verb}: no status.nodeInfo.kubeletVersion in the answer")
        return version

    # -- watch ---------------------------------------------------------------------------------

    async def _watch(self, changed: Changed) -> tuple[_Outcome, bool]:
        """One watch request (a streaming list when there is no version to resume from);
        returns how it ended and whether it delivered anything."""
        initial = self._resource_version is None
        verb = "list" if initial else "watch"  # what the operator reads: a list failed
        timeout_seconds = int(self._watch_timeout * (1 + self._rng.random()))
        params = {
            "watch": "true",
            "fieldSelector": f"spec.nodeName={self.node_name}",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_seconds),
        }
        if initial:
            params["sendInitialEvents"] = "true"
            params["resourceVersionMatch"] = "NotOlderThan"
        resume_from = self._last_version if initial else self._resource_version
        if resume_from:
            params["resourceVersion"] = resume_from
        read = self._read_timeout or timeout_seconds + WATCH_READ_MARGIN
        timeout = httpx2.Timeout(
            self._http.timeout.connect,
            read=read,
            write=self._http.timeout.write,
            pool=self._http.timeout.pool,
        )
        self.watches += 1
        opened = delivered = False
        try:
            async with self._http.stream(
                "GET", "api/v1/pods", params=params, timeout=timeout
            ) as resp:
                if resp.status_code != 200:
                    body = await read_head(resp)
                    if initial and resp.status_code in (400, 422):
                        self._no_streaming(status_text(resp.status_code, body))
                        return _Outcome.NO_STREAMING, False
                    if resp.status_code == 410:
                        self._gone(status_text(resp.status_code, body))
                        return _Outcome.GONE, False
                    raise http_failure(verb, resp.status_code, body)
                opened = True
                if not initial:  # a streaming list is a good read once it is complete
                    self._watching = True
                    self._read_ok()
                self.own_logger.debug(
                    "pod_watch_opened",
                    resume_from=resume_from,
                    timeout_seconds=timeout_seconds,
                    initial_events=initial,
                )
                listing: dict[str, DecodedPod] | None = {} if initial else None
                try:
                    async with asyncio.timeout(
                        self._initial_events_timeout if initial else None
                    ) as deadline:
                        async for line in read_lines(resp, self._max_event_bytes):
                            if not line.strip():
                                continue
                            delivered = True
                            if listing is not None:
                                if await self._initial_event(line, listing, changed):
                                    listing = None
                                    deadline.reschedule(None)
                                continue
                            outcome = self._event(line, changed)
                            if outcome is not None:
                                return outcome, delivered
                except TimeoutError:
                    pass  # no initial-events-end in time: handled below as an unfinished list
                finally:
                    self._stream_closed()
                if listing is not None:
                    self._no_streaming(
                        f"no {INITIAL_EVENTS_END} bookmark after {len(listing)} initial events"
                    )
                    return _Outcome.NO_STREAMING, delivered
                self.own_logger.debug(
                    "pod_watch_ended", resume_from=self._resource_version, detail="server ended it"
                )
        except httpx2.ReadTimeout as exc:
            if not opened:
                raise _Unreachable(self._unreachable(verb, exc)) from exc
            self.own_logger.info(
                "pod_watch_idle",
                seconds=read,
                detail="nothing, not even the end of the server's timeoutSeconds: resuming",
                resume_from=self._resource_version,
            )
        except (httpx2.RemoteProtocolError, httpx2.ReadError) as exc:
            if not opened:
                raise _Unreachable(self._unreachable(verb, exc)) from exc
            # A break mid-stream (the server restarting, a proxy closing): resume, no failure.
            self.own_logger.info(
                "pod_watch_interrupted",
                error=f"{type(exc).__name__}: {exc}",
                resume_from=self._resource_version,
            )
        except httpx2.TransportError as exc:
            raise _Unreachable(self._unreachable(verb, exc)) from exc
        return _Outcome.ENDED, delivered

    def _stream_closed(self) -> None:
        if self._watching:
            self._watching = False
            # The stream was a good read up to now: staleness counts from here.
            self.last_success = self._clock()

    async def _initial_event(
        self, line: bytes, listing: dict[str, DecodedPod], changed: Changed
    ) -> bool:
        """One event of a streaming list; True once it was the initial-events-end bookmark
        and the listing has replaced the view."""
        event = decode_event(line, statuses=self.keep_statuses)
        if event.type == "ERROR":
            status = event.status or {}
            code = status.get("code")
            raise ReadFailure(
                "watch pods: the API server sent an error: "
                + describe_status(code if isinstance(code, int) else 0, status)
            )
        if event.pod is not None:
            key = event.pod.key if event.pod.key is not None else f"?{len(listing)}"
            if event.type == "DELETED":
                listing.pop(key, None)
            else:
                listing[key] = event.pod
            if len(listing) > self._max_pods:
                raise ReadFailure(
                    f"watch pods: more than {self._max_pods} pods on node {self.node_name}: "
                    "not one node's pods"
                )
            return False
        if event.type != "BOOKMARK" or not ends_initial_events(line):
            return False
        view_changed = await self.apply_listing(list(listing.values()))
        self._resource_version = self._last_version = event.resource_version or ""
        self._watching = True
        self._read_ok()
        self.own_logger.debug(
            "pod_source_listed",
            pods=len(listing),
            resource_version=event.resource_version,
            asked="sendInitialEvents",
        )
        if view_changed:
            changed()
        return True

    def _event(self, line: bytes, changed: Changed) -> _Outcome | None:
        """Apply one watch event; returns an outcome if it ends the watch."""
        event = decode_event(line, statuses=self.keep_statuses)
        if event.type == "ERROR":
            status = event.status or {}
            if status.get("code") == 410 or status.get("reason") in ("Expired", "Gone"):
                self._gone(describe_status(410, status))
                return _Outcome.GONE
            code = status.get("code")
            raise ReadFailure(
                "watch pods: the API server sent an error: "
                + describe_status(code if isinstance(code, int) else 0, status)
            )
        view_changed = False
        if event.pod is not None and event.type in ("ADDED", "MODIFIED"):
            view_changed = self.upsert(event.pod)
        elif event.pod is not None and event.type == "DELETED":
            view_changed = self.remove(event.pod)
        elif event.type == "BOOKMARK":
            # At most one a minute per stream (and ~2 s before its timeoutSeconds).
            self.own_logger.debug("pod_watch_bookmark", resource_version=event.resource_version)
        else:
            self.own_logger.debug("pod_watch_event_ignored", type=event.type)
        if event.resource_version:
            self._resource_version = self._last_version = event.resource_version
        self.succeeded()
        if view_changed:
            changed()
        return None

    def _gone(self, detail: str) -> None:
        """410: relist after the relist back-off."""
        self._relist_wait = self._relist_delay()
        self.relists += 1
        self.own_logger.info(
            "pod_watch_expired",
            resource_version=self._resource_version,
            detail=detail,
            action=f"relisting in {self._relist_wait:.1f}s",
            delay=round(self._relist_wait, 3),
        )
        self._resource_version = None

    def _no_streaming(self, detail: str) -> None:
        """The server refused a streaming list, or did not finish one: LIST from now on."""
        self._streaming = False
        self.own_logger.info(
            "pod_list_fallback",
            resource_version=self._last_version,
            detail=detail,
            action="listing from the watch cache from now on, not streaming",
        )

    def _unreachable(self, verb: str, exc: Exception) -> str:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return f"{verb} pods: cannot reach the API server at {self.server}: {text}"
