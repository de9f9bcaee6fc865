"""Pod specs from the API server: list, then watch, the pods bound to this node
(``fieldSelector=spec.nodeName=<node>``), as the kubelet's own pod informer does.

The client config is lightkube's: it reads the config (in-cluster service account,
``$KUBECONFIG`` or an explicit kubeconfig file) and authenticates (tokens, rotated
service-account token files, exec plugins, client certificates) through an httpx2 client built
by its ``client_adapter``. Lists and watches are read here over that client rather than through
lightkube's models: its list builds every pod whole as Python objects (a tenant's 1.5 MB env
list included), and its ``watch`` cannot ask for bookmarks (``allowWatchBookmarks``), has no
idle limit, no cap on a line, and on 410 Gone either raises or silently re-watches from "now",
which never reports the pods deleted during the gap. Pages and events are decoded into only the
fields cri-prober uses (``decode.py``), in a worker thread for pages.

The protocol, as client-go's reflector follows it:

- LIST → ``replace_all``; remember the list's ``metadata.resourceVersion``.
- WATCH from it with ``allowWatchBookmarks=true`` and a server ``timeoutSeconds`` of 5–10 min:
  ADDED/MODIFIED → ``upsert``, DELETED → ``remove``, BOOKMARK → only the resourceVersion moves.
- A watch that ends (the server's timeout, a dropped connection, no line for ``idle_timeout``)
  is resumed from the last resourceVersion, without a relist.
- A watch line longer than ``max_event_bytes`` (no event is: an object is at most ~1.5 MiB) is
  a failure: the connection is dropped, and the watch resumes after the backoff.
- 410 Gone (an HTTP 410, or an ERROR event carrying a 410 Status): the resourceVersion was
  compacted away; relist, which replaces the whole view, so pods deleted meanwhile disappear.
- Any other error (HTTP 401/403/5xx, an ERROR event, the server unreachable): ``failed`` (one
  rate-limited log line, the last good view kept), then retry after a capped, jittered
  exponential backoff.

Staleness: an open watch stream counts as a good read however silent it is (the server sends
bookmarks about once a minute; a dead connection is closed after ``idle_timeout`` without a
line). The view becomes stale only once no stream has been open, and no list has gone through,
for ``stale_after`` (default 60 s: an API server restart or a couple of backoff rounds).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Generator, Mapping
from pathlib import Path
from typing import Any, Final

import httpx2
import structlog
from lightkube import KubeConfig, SingleConfig
from lightkube.config import client_adapter
from lightkube.config.models import User

from cri_prober.errors import ConfigError
from cri_prober.files import UnsafeFile, describe_size, read_regular_file
from cri_prober.podspecs.decode import (
    MAX_PODS,
    DecodedPod,
    PodListError,
    WatchEvent,
    decode_pod_list,
    decode_watch_event,
)
from cri_prober.podspecs.source import Changed, PodSource

__all__ = ["DEFAULT_STALE_AFTER", "ApiServerSource"]

# How long without an open watch stream or a good list before the view counts as stale.
DEFAULT_STALE_AFTER: Final = 60.0
# The server's timeoutSeconds for one watch is this times 1 to 2 (client-go's reflector: 5-10
# min), so the watches of many nodes do not all end together.
WATCH_TIMEOUT: Final = 300.0
# No line (event or bookmark) for this long: the connection is taken for dead and the watch is
# resumed. Bookmarks come about once a minute; a resume costs one request.
IDLE_TIMEOUT: Final = 150.0
# Connect, write and pool timeouts of every request, and the read timeout of a list.
REQUEST_TIMEOUT: Final = 30.0
# Pods per list page: ~110 pods on a full node take four pages; 32 pods of the API server's
# largest (~1.5 MiB each) fit in MAX_PAGE_BYTES.
PAGE_SIZE: Final = 32
# The most one list page may take, in bytes, and in seconds whatever the server trickles.
MAX_PAGE_BYTES: Final = 64 * 1024 * 1024
PAGE_TIMEOUT: Final = 60.0
# The longest watch line (one event) read. An object is at most ~1.5 MiB in etcd; as JSON, Go
# may write some characters as six-byte \u escapes, so an event can be a few times that.
MAX_EVENT_BYTES: Final = 16 * 1024 * 1024
# Backoff between failed attempts: initial * 2**(n-1), capped, with "equal jitter" (½ to 1×).
RETRY_INITIAL: Final = 0.5
RETRY_MAX: Final = 30.0
# A stream that delivered an event, or stayed open this long, resets the backoff.
HEALTHY_STREAM_SECONDS: Final = 5.0
# How much of an error body a failure message quotes.
BODY_CHARS: Final = 512

ConfigArg = KubeConfig | SingleConfig | None


class _Outcome(enum.Enum):
    ENDED = "ended"  # the stream ended or broke: resume from the last resourceVersion
    GONE = "gone"  # 410: the resourceVersion is too old, relist


class _ReadFailure(Exception):
    """A list or watch failed; the message is what ``failed`` logs."""


class ApiServerSource(PodSource):
    """The pods bound to ``node_name``, listed and watched from the API server.

    Config: ``config`` (a lightkube ``KubeConfig`` or ``SingleConfig``) if given, else the
    ``kubeconfig`` file, else lightkube's ``KubeConfig.from_env()``: the in-cluster service
    account, then ``$KUBECONFIG``, then ``~/.kube/config``.

    Raises:
        ConfigError: ``node_name`` is empty, or no usable client config was found.
    """

    def __init__(
        self,
        *,
        node_name: str,
        kubeconfig: Path | None = None,
        config: ConfigArg = None,
        stale_after: float = DEFAULT_STALE_AFTER,
        clock: Callable[[], float] = time.monotonic,
        watch_timeout: float = WATCH_TIMEOUT,
        idle_timeout: float = IDLE_TIMEOUT,
        request_timeout: float = REQUEST_TIMEOUT,
        page_size: int = PAGE_SIZE,
        retry_initial: float = RETRY_INITIAL,
        retry_max: float = RETRY_MAX,
        rng: random.Random | None = None,
        max_page_bytes: int = MAX_PAGE_BYTES,
        max_event_bytes: int = MAX_EVENT_BYTES,
        max_pods: int = MAX_PODS,
    ) -> None:
        if not node_name:
            raise ConfigError(
                "--probes-from apiserver needs the node's name (serve --node-name or NODE_NAME)"
            )
        super().__init__("apiserver", stale_after=stale_after, node_name=node_name, clock=clock)
        # This module's lines, with the source's name bound (the base class's: ``self.logger``).
        self.own_logger = structlog.get_logger(__name__, source=self.name)
        self._config = _load_config(kubeconfig, config)
        self.server = str(self._config.cluster.server)
        self._watch_timeout = watch_timeout
        self._idle_timeout = idle_timeout
        self._page_size = page_size
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self._rng = rng or random.Random()
        timeout = httpx2.Timeout(request_timeout)
        self._max_page_bytes = max_page_bytes
        self._max_event_bytes = max_event_bytes
        self._max_pods = max_pods
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
            self._http.auth = _TokenFileAuth(Path(self._http.auth._token_file))
        self._resource_version: str | None = None  # None: list before watching
        self._watching = False  # a watch stream is open (answered 200, not ended yet)
        self._closed = False
        self.relists = 0  # lists after the first (410 Gone)
        self.watches = 0  # watch requests sent

    # -- the view's freshness ------------------------------------------------------------------

    def stale(self) -> bool:
        """An open watch is a good read however silent; else no good read for stale_after."""
        if self._watching:
            return False
        return super().stale()

    # -- running -------------------------------------------------------------------------------

    async def run(self, changed: Changed) -> None:
        attempt = 0  # failed or unhealthy attempts in a row: the backoff's exponent
        lists = 0
        while True:
            try:
                if self._resource_version is None:
                    if lists:
                        self.relists += 1
                    lists += 1
                    await self._list(changed)
                opened = time.monotonic()
                outcome, healthy = await self._watch(changed)
                healthy = healthy or time.monotonic() - opened >= HEALTHY_STREAM_SECONDS
                if outcome is _Outcome.GONE:
                    self._resource_version = None
                attempt = 0 if healthy else attempt + 1
            except asyncio.CancelledError:
                raise
            except _ReadFailure as exc:
                self.failed(str(exc))
                attempt += 1
                if isinstance(exc, _LineTooLong):
                    await self.give_back(self._max_event_bytes)  # the line read so far
            except Exception as exc:  # a bug, or an error no branch foresaw: keep going
                message = f"unexpected error: {type(exc).__name__}: {exc}"
                if message != self.last_error:  # the traceback once, not every retry
                    self.own_logger.exception("pod_source_error")
                self.failed(message)
                attempt += 1
            if attempt:
                await asyncio.sleep(self._backoff(attempt))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._http.aclose()

    def _backoff(self, attempt: int) -> float:
        delay = min(self._retry_max, self._retry_initial * 2.0 ** min(attempt - 1, 30))
        return delay / 2 + self._rng.random() * delay / 2

    # -- list ----------------------------------------------------------------------------------

    async def _list(self, changed: Changed) -> None:
        pods: list[DecodedPod] = []
        resource_version: str | None = None
        token: str | None = None
        read_bytes = 0
        while True:
            params = {
                "fieldSelector": f"spec.nodeName={self.node_name}",
                "limit": str(self._page_size),
            }
            if token:
                params["continue"] = token
            body = await self._read_page(params)
            read_bytes += len(body)
            try:
                page = await asyncio.to_thread(decode_pod_list, body, max_pods=self._max_pods)
            except PodListError as exc:
                raise _ReadFailure(
                    f"list pods: the API server's answer is not a usable PodList: {exc}"
                ) from None
            finally:
                with contextlib.suppress(BufferError):  # a cancelled decoder still reads it
                    del body[:]
            pods.extend(page.pods)
            if len(pods) > self._max_pods:
                raise _ReadFailure(
                    f"list pods: more than {self._max_pods} pods on node {self.node_name}: "
                    "not one node's pods"
                )
            resource_version = page.resource_version
            token = page.continue_token
            if not token:
                break
        count = len(pods)
        try:
            view_changed = await self.apply_listing(pods)
        finally:
            await self.give_back(read_bytes)
        self._resource_version = resource_version or ""  # "": watch from "now" with ADDED for all
        self.succeeded()
        self.own_logger.debug(
            "pod_source_listed",
            pods=count,
            resource_version=resource_version,
        )
        if view_changed:
            changed()

    async def _read_page(self, params: Mapping[str, str]) -> bytearray:
        """One list page's body, at most ``max_page_bytes``, within PAGE_TIMEOUT."""
        try:
            async with asyncio.timeout(PAGE_TIMEOUT):
                async with self._http.stream("GET", "api/v1/pods", params=params) as resp:
                    if resp.status_code != 200:
                        head = await _head(resp)
                        raise _ReadFailure(_http_failure("list", resp.status_code, head))
                    body = bytearray()
                    async for chunk in resp.aiter_bytes():
                        body += chunk
                        if len(body) > self._max_page_bytes:
                            raise _ReadFailure(
                                "list pods: a page of the API server's answer is larger than "
                                f"{describe_size(self._max_page_bytes)}: stopped reading"
                            )
                    return body
        except TimeoutError:
            raise _ReadFailure(
                f"list pods: the API server at {self.server} did not answer a page within "
                f"{PAGE_TIMEOUT:g}s"
            ) from None
        except httpx2.TransportError as exc:
            raise _ReadFailure(self._unreachable("list", exc)) from exc

    # -- watch ---------------------------------------------------------------------------------

    async def _watch(self, changed: Changed) -> tuple[_Outcome, bool]:
        """One watch request; returns how it ended and whether it delivered anything."""
        params = {
            "watch": "true",
            "fieldSelector": f"spec.nodeName={self.node_name}",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(int(self._watch_timeout * (1 + self._rng.random()))),
        }
        if self._resource_version:
            params["resourceVersion"] = self._resource_version
        timeout = httpx2.Timeout(
            self._http.timeout.connect,
            read=self._idle_timeout,
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
                    body = await _head(resp)
                    if resp.status_code == 410:
                        self._log_gone(_status_text(resp.status_code, body))
                        return _Outcome.GONE, False
                    raise _ReadFailure(_http_failure("watch", resp.status_code, body))
                opened = self._watching = True
                self.succeeded()
                try:
                    async for line in _lines(resp, self._max_event_bytes):
                        if not line.strip():
                            continue
                        outcome = self._event(line, changed)
                        delivered = True
                        if outcome is not None:
                            return outcome, delivered
                finally:
                    self._stream_closed()
        except httpx2.ReadTimeout as exc:
            if not opened:
                raise _ReadFailure(self._unreachable("watch", exc)) from exc
            self.own_logger.info(
                "pod_watch_idle",
                seconds=self._idle_timeout,
                detail="no event or bookmark: resuming the watch",
                resume_from=self._resource_version,
            )
        except (httpx2.RemoteProtocolError, httpx2.ReadError) as exc:
            if not opened:
                raise _ReadFailure(self._unreachable("watch", exc)) from exc
            # A break mid-stream (the server restarting, a proxy closing): resume, no failure.
            self.own_logger.info(
                "pod_watch_interrupted",
                error=f"{type(exc).__name__}: {exc}",
                resume_from=self._resource_version,
            )
        except httpx2.TransportError as exc:
            raise _ReadFailure(self._unreachable("watch", exc)) from exc
        return _Outcome.ENDED, delivered

    def _stream_closed(self) -> None:
        if self._watching:
            self._watching = False
            # The stream was a good read up to now: staleness counts from here.
            self.last_success = self._clock()

    def _event(self, line: bytes, changed: Changed) -> _Outcome | None:
        """Apply one watch event; returns an outcome if it ends the watch."""
        try:
            event: WatchEvent = decode_watch_event(line)
        except PodListError as exc:
            what = "not JSON" if exc.malformed else "not a watch event of pods"
            raise _ReadFailure(
                f"watch pods: a line is {what}: {exc}: {bytes(line[:200])!r}"
            ) from None
        if event.type == "ERROR":
            status = event.status or {}
            if status.get("code") == 410 or status.get("reason") in ("Expired", "Gone"):
                self._log_gone(_describe_status(410, status))
                return _Outcome.GONE
            code = status.get("code")
            raise _ReadFailure(
                "watch pods: the API server sent an error: "
                + _describe_status(code if isinstance(code, int) else 0, status)
            )
        view_changed = False
        if event.pod is not None and event.type in ("ADDED", "MODIFIED"):
            view_changed = self.upsert(event.pod)
        elif event.pod is not None and event.type == "DELETED":
            view_changed = self.remove(event.pod)
        elif event.type != "BOOKMARK":
            self.own_logger.debug("pod_watch_event_ignored", type=event.type)
        if event.resource_version:
            self._resource_version = event.resource_version
        self.succeeded()
        if view_changed:
            changed()
        return None

    def _log_gone(self, detail: str) -> None:
        self.own_logger.info(
            "pod_watch_expired",
            resource_version=self._resource_version,
            detail=detail,
            action="relisting",
        )

    def _unreachable(self, verb: str, exc: Exception) -> str:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return f"{verb} pods: cannot reach the API server at {self.server}: {text}"


# -- config -----------------------------------------------------------------------------------


def _load_config(kubeconfig: Path | None, config: ConfigArg) -> SingleConfig:
    if config is not None:
        where = "the given config"
    elif kubeconfig is not None:
        where = f"kubeconfig {kubeconfig}"
    else:
        env = os.environ.get("KUBECONFIG")
        where = "the in-cluster service account, " + (
            f"or KUBECONFIG={env}" if env else "or KUBECONFIG / ~/.kube/config (both unset)"
        )
    try:
        if config is None:
            if kubeconfig is not None:
                config = KubeConfig.from_file(kubeconfig)
            else:
                config = KubeConfig.from_env()
        single = config.get() if isinstance(config, KubeConfig) else config
    except Exception as exc:  # lightkube's ConfigError, KeyError, YAML and msgspec errors
        detail = str(exc) or type(exc).__name__
        raise ConfigError(
            f"--probes-from apiserver: no usable Kubernetes client config from {where}: {detail}"
        ) from exc
    if single is None:
        raise ConfigError(f"--probes-from apiserver: {where} selects no context")
    if single.user is None:  # a context without a user (kubectl proxy): no credentials
        single = single._replace(user=User())
    return single


# -- reading ----------------------------------------------------------------------------------


class _TokenFileAuth(httpx2.Auth):
    """A bearer token read from a file, and read again after a 401 (a rotated service-account
    token), as lightkube's own does, but only from a regular file of at most 64 KiB."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._bearer: str | None = None

    def _read(self) -> str:
        try:
            data = read_regular_file(self._path, max_bytes=64 * 1024, what="token file")
        except UnsafeFile as exc:
            raise _ReadFailure(f"cannot read the token file {self._path}: {exc.reason}") from None
        except OSError as exc:
            raise _ReadFailure(
                f"cannot read the token file {self._path}: {exc.strerror or exc}"
            ) from None
        return f"Bearer {data.decode('utf-8', 'replace').strip()}"

    def auth_flow(
        self, request: httpx2.Request
    ) -> Generator[httpx2.Request, httpx2.Response, None]:
        if self._bearer is None:
            self._bearer = self._read()
        request.headers["Authorization"] = self._bearer
        response = yield request
        if response.status_code == 401:
            self._bearer = self._read()
            request.headers["Authorization"] = self._bearer
            yield request


class _LineTooLong(_ReadFailure):
    """A watch line longer than any event can be."""


async def _lines(response: httpx2.Response, limit: int) -> AsyncIterator[bytes]:
    """The response's lines (without the newline), none longer than ``limit`` bytes.

    httpx2's ``aiter_lines`` keeps a line growing for as long as the server sends no newline;
    here the line is refused as soon as it passes the limit, and the connection is dropped.
    """
    pending = bytearray()
    async for chunk in response.aiter_bytes():
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            if len(pending) + end - start > limit:
                raise _LineTooLong(_too_long(limit))
            if pending:
                pending += chunk[start:end]
                yield bytes(pending)
                pending.clear()
            else:
                yield chunk[start:end]
            start = end + 1
        pending += chunk[start:]
        if len(pending) > limit:
            raise _LineTooLong(_too_long(limit))
    if pending:
        yield bytes(pending)


def _too_long(limit: int) -> str:
    return (
        f"watch pods: a line of the stream is longer than {describe_size(limit)}, which no event "
        "can be: dropped the connection"
    )


async def _head(response: httpx2.Response) -> bytes:
    """The start of an error answer's body (the rest is not read)."""
    data = bytearray()
    async for chunk in response.aiter_bytes():
        data += chunk
        if len(data) >= BODY_CHARS * 8:
            break
    return bytes(data[: BODY_CHARS * 8])


# -- error messages ---------------------------------------------------------------------------


def _parse_status(body: bytes) -> Mapping[str, Any]:
    try:
        status = json.loads(body)
    except ValueError:
        return {}
    return status if isinstance(status, Mapping) else {}


def _describe_status(code: int, status: Mapping[str, Any]) -> str:
    reason = status.get("reason")
    message = status.get("message")
    text = f"{code}" + (f" {reason}" if isinstance(reason, str) and reason else "")
    if isinstance(message, str) and message:
        text += f": {message}"
    return text


def _status_text(code: int, body: bytes) -> str:
    status = _parse_status(body)
    if status:
        return _describe_status(code, status)
    text = body[:BODY_CHARS].decode("utf-8", "replace").strip()
    return f"{code}: {text}" if text else f"{code}"


def _http_failure(verb: str, code: int, body: bytes) -> str:
    """A failed list or watch, with what the operator should do about it where that is clear."""
    detail = _status_text(code, body)
    if code == 401:
        return (
            f"{verb} pods: 401 Unauthorized: the API server rejected the credentials "
            f"(an expired or revoked token, or the wrong cluster?): {detail}"
        )
    if code == 403:
        return (
            f"{verb} pods: 403 Forbidden: the service account needs get/list/watch on pods "
            f"(a ClusterRole bound to it): {detail}"
        )
    return f"{verb} pods: HTTP {detail}"
