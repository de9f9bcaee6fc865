"""A local fake of the API server's pod list/watch protocol (``/api/v1/pods``), for the
apiserver pod source.

It keeps pods of several nodes with a resourceVersion counter and an event history, like etcd
behind the watch cache:

- LIST (``GET /api/v1/pods``) answers a ``PodList`` with ``metadata.resourceVersion``, filtered
  by ``fieldSelector=spec.nodeName=<node>`` (any other selector is refused with 400 and noted in
  ``protocol_errors``).
- WATCH (``watch=1``/``true``) streams newline-delimited JSON events with chunked transfer
  encoding: the history after the request's ``resourceVersion``, then live changes. A version
  older than ``compact()``'s answers 410, as an ERROR event (``gone_as="event"``, what current
  servers do) or as HTTP 410 (``gone_as="http"``).
- Lists follow the watch cache's rules as kube-apiserver 1.28 showed them
  (``tests/fixtures/kube-apiserver-1.28.7/README.md``): ``resourceVersion=0`` is served by the
  cache, at ``cache_version``, whole (``limit`` ignored); no resourceVersion is a quorum read,
  paged by ``limit``/``continue``; another version is served whole if it is not newer than
  the store (else 504 "Too large resource version"), or, with a ``limit``, read exactly
  (410 once compacted).
- A streaming list (``sendInitialEvents=true``) is refused with the recorded 422 unless
  ``watch_list`` (the WatchList gate) is on; then the node's pods come as ADDED events and a
  BOOKMARK annotated ``k8s.io/initial-events-end`` (unless ``initial_events_end`` is off).
- With ``watch_time_scale`` set, a watch ends by itself after ``timeoutSeconds`` × the scale
  (the server's timeout, on a compressed clock), with no bookmark on the way.
- Tests inject BOOKMARK and ERROR events, normal ends (the server's timeout), abrupt
  disconnects, and scripted HTTP answers (``fail_next``: 403, 410, 500...).
- ``replay_next`` answers the next request with a recording of the real server (``Recording``):
  its status, headers, body and chunk framing, with its timing scaled.

Every request is recorded (``requests``: the verb, the raw query string, the parsed query and
the headers) and can be awaited (``wait_requests``), as can the number of watch streams opened
(``wait_streams``).

``/api/v1/events`` (serve --mirror's Unhealthy events) is served minimally: ``add_event`` keeps a
core/v1 Event and streams it to open watches; a LIST answers them all; ``events_forbidden``
answers 403; the field selector must be ``involvedObject.kind=Pod,reason=Unhealthy``.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import pytest
from aiohttp import web

from cri_prober.podspecs.source import PodSource

# Responses of a real kube-apiserver 1.28.7, raw (see the README there).
RECORDINGS = Path(__file__).resolve().parents[1] / "fixtures" / "kube-apiserver-1.28.7"
INITIAL_EVENTS_END = "k8s.io/initial-events-end"
# How long a wait for requests or streams may take before the test fails instead of hanging:
# a guard, never a bound (5 s ran out on a busy machine).
HANG_GUARD = 120.0

Json = dict[str, Any]
Verb = Literal["list", "watch"]


@dataclass(frozen=True)
class RecordedRequest:
    """One request the fake answered."""

    verb: Verb
    query: Mapping[str, str]
    authorization: str | None
    query_string: str = ""  # as sent, %-encoded
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def resource_version(self) -> str | None:
        return self.query.get("resourceVersion")

    @property
    def streaming_list(self) -> bool:
        return self.verb == "watch" and self.query.get("sendInitialEvents") == "true"


@dataclass(frozen=True)
class Recording:
    """One recorded response (``NAME.http`` and its ``NAME.http.times.json``): status, headers,
    and the body as the chunks the server sent, each with the second it arrived at."""

    name: str
    status: int
    reason: str
    headers: tuple[tuple[str, str], ...]
    chunks: tuple[tuple[float, bytes], ...]  # (seconds since the request, data)
    chunked: bool
    complete: bool  # the body ended properly (the final chunk); else the connection broke
    request_line: str

    @classmethod
    def load(cls, name: str) -> Recording:
        raw = (RECORDINGS / f"{name}.http").read_bytes()
        times = json.loads((RECORDINGS / f"{name}.http.times.json").read_text())
        head, _, body = raw.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        _, code, reason = status_line.split(" ", 2)
        headers = tuple(
            (key, value.strip()) for key, _, value in (line.partition(":") for line in header_lines)
        )
        chunked = any(
            key.lower() == "transfer-encoding" and value == "chunked" for key, value in headers
        )
        recvs: list[list[float]] = times["recvs"]

        def arrived(end: int) -> float:  # when byte ``end`` of the file had come in
            return next((t for t, offset, size in recvs if offset + size >= end), recvs[-1][0])

        chunks: list[tuple[float, bytes]] = []
        complete = not chunked
        if chunked:
            position = len(head) + 4
            rest = body
            while rest:
                size_line, _, rest = rest.partition(b"\r\n")
                size = int(size_line, 16)
                position += len(size_line) + 2
                if size == 0:
                    complete = True
                    chunks.append((arrived(position + 2), b""))
                    break
                chunks.append((arrived(position + size + 2), rest[:size]))
                rest = rest[size + 2 :]
                position += size + 2
        else:
            chunks.append((arrived(len(raw)), body))
        return cls(
            name,
            int(code),
            reason,
            headers,
            tuple(chunks),
            chunked,
            complete,
            times["request_line"],
        )

    @property
    def body(self) -> bytes:
        return b"".join(data for _, data in self.chunks)

    def json(self) -> Json:
        """The body as JSON (a list, or an error's Status)."""
        document = json.loads(self.body)
        assert isinstance(document, dict)
        return document

    def events(self) -> list[Json]:
        """A watch body's events, in order."""
        return [json.loads(line) for line in self.body.splitlines() if line.strip()]


@dataclass(eq=False)
class _Watcher:
    node: str
    queue: asyncio.Queue[Json | str] = field(default_factory=asyncio.Queue)


def status(code: int, reason: str, message: str) -> Json:
    """A meta/v1 Status object, as the API server sends for errors."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


GONE = status(410, "Expired", "too old resource version: 1 (5)")
LIST_EXPIRED = status(410, "Expired", "The resourceVersion for the provided list is too old.")
TOO_LARGE = status(504, "Timeout", "Too large resource version: 200, current: 101") | {
    "details": {"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large"}]}
}
FORBIDDEN = status(
    403,
    "Forbidden",
    'pods is forbidden: User "system:serviceaccount:kube-system:cri-prober" cannot list '
    'resource "pods" in API group "" at the cluster scope',
)


# The scripted "status" of ``refuse_next``: no answer, the connection closed.
REFUSE: Final = 0


class FakeApiServer:
    """Serve ``/api/v1/pods`` on 127.0.0.1; ``url`` once started (``async with``)."""

    def __init__(
        self,
        *,
        node_name: str,
        gone_as: Literal["event", "http"] = "event",
        watch_list: bool = False,
    ) -> None:
        self.node_name = node_name
        self.gone_as = gone_as
        self.watch_list = watch_list  # the WatchList gate: streaming lists are served
        self.initial_events_end = True  # a streaming list ends its initial events with a bookmark
        self.cache_version: int | None = None  # what a resourceVersion=0 list says; None: current
        self.watch_time_scale: float | None = None  # watches end after timeoutSeconds × this
        self.version = 100
        self.compacted = 0  # watches from an older resourceVersion get 410
        self.pods: dict[str, Json] = {}  # by uid
        self.history: list[tuple[int, str, Json]] = []  # (version, type, object)
        self.requests: list[RecordedRequest] = []
        self.protocol_errors: list[str] = []
        self._scripted: dict[Verb, list[tuple[int, Json | str] | tuple[Recording, float]]] = {
            "list": [],
            "watch": [],
        }
        self._watchers: list[_Watcher] = []
        self.streams = 0  # watch streams opened so far
        self._paged_at = 0  # the version a paged list's pages are a snapshot of
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self.url = ""
        # GET /api/v1/nodes/NAME: the Node objects by name; node_forbidden answers 403 (no RBAC
        # for nodes), as a ClusterRole without "get nodes" does.
        self.nodes: dict[str, Json] = {}
        self.node_forbidden = False
        # GET /api/v1/events: the Events kept, the open watches' queues, the requests' queries.
        self.events: list[Json] = []
        self.events_forbidden = False
        self.event_requests: list[dict[str, str]] = []
        self._event_watches: list[asyncio.Queue[Json | None]] = []

    # -- lifecycle --------------------------------------------------------------------------------

    async def __aenter__(self) -> FakeApiServer:
        app = web.Application()
        app.router.add_get("/api/v1/pods", self._pods)
        app.router.add_get("/api/v1/nodes/{name}", self._node)
        app.router.add_get("/api/v1/events", self._events)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.end_watches()
        for queue in self._event_watches:
            queue.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()

    # -- the store ----------------------------------------------------------------------------

    def _bump(self) -> str:
        self.version += 1
        return str(self.version)

    def _record(self, kind: str, pod: Json) -> None:
        self.history.append((self.version, kind, copy.deepcopy(pod)))
        for watcher in self._watchers:
            if _node(pod) == watcher.node:
                watcher.queue.put_nowait({"type": kind, "object": copy.deepcopy(pod)})

    def put(self, pod: Json) -> Json:
        """Add or modify a pod (ADDED or MODIFIED to watchers); returns the stored copy."""
        pod = copy.deepcopy(pod)
        uid = pod["metadata"]["uid"]
        kind = "MODIFIED" if uid in self.pods else "ADDED"
        pod["metadata"]["resourceVersion"] = self._bump()
        self.pods[uid] = pod
        self._record(kind, pod)
        return pod

    def delete(self, uid: str) -> None:
        """Delete a pod (DELETED to watchers)."""
        pod = self.pods.pop(uid)
        pod["metadata"]["resourceVersion"] = self._bump()
        self._record("DELETED", pod)

    def forget(self, uid: str) -> None:
        """Delete a pod without an event (one a watch missed, as across a compaction)."""
        del self.pods[uid]
        self._bump()

    def advance(self, steps: int = 1) -> str:
        """Changes elsewhere in the cluster: the resourceVersion moves, no event for this node."""
        for _ in range(steps):
            self._bump()
        return str(self.version)

    def compact(self) -> None:
        """Forget the history: watches from any version before now get 410 Gone."""
        self.compacted = self.version
        self.history.clear()

    # -- what open watches see ----------------------------------------------------------------

    def bookmark(self) -> str:
        """Send every open watch a BOOKMARK at the current resourceVersion; returns it."""
        version = str(self.version)
        for watcher in self._watchers:
            watcher.queue.put_nowait(_bookmark(version, end="false"))
        return version

    def send_error(self, error: Json) -> None:
        """Send every open watch an ERROR event with this Status; the server then ends it."""
        for watcher in self._watchers:
            watcher.queue.put_nowait({"type": "ERROR", "object": error})
            watcher.queue.put_nowait("end")

    def send_raw(self, line: str) -> None:
        """Send every open watch one raw line (a broken event)."""
        for watcher in self._watchers:
            watcher.queue.put_nowait(line)

    def end_watches(self) -> None:
        """End every open watch normally (the server's timeoutSeconds ran out)."""
        for watcher in self._watchers:
            watcher.queue.put_nowait("end")

    def drop_watches(self) -> None:
        """Cut every open watch's connection mid-stream (no final chunk)."""
        for watcher in self._watchers:
            watcher.queue.put_nowait("drop")

    def fail_next(self, verb: Verb, code: int, body: Json | str, *, times: int = 1) -> None:
        """Answer the next ``times`` requests of ``verb`` with this HTTP status and body."""
        self._scripted[verb].extend([(code, body)] * times)

    def refuse_next(self, verb: Verb, *, times: int = 1) -> None:
        """Close the connection of the next ``times`` requests of ``verb`` without an answer
        (a server going down): the client cannot reach the server."""
        self._scripted[verb].extend([(REFUSE, "")] * times)

    def replay_next(
        self, verb: Verb, recording: Recording | str, *, time_scale: float = 0.0, times: int = 1
    ) -> Recording:
        """Answer the next ``times`` requests of ``verb`` with a recorded response, its waits
        between chunks multiplied by ``time_scale`` (0: at once)."""
        if isinstance(recording, str):
            recording = Recording.load(recording)
        self._scripted[verb].extend([(recording, time_scale)] * times)
        return recording

    def fail_always(self, verb: Verb, code: int, body: Json | str) -> None:
        self.fail_next(verb, code, body, times=10**6)

    def stop_failing(self) -> None:
        for scripted in self._scripted.values():
            scripted.clear()

    # -- waiting ------------------------------------------------------------------------------

    def count(self, verb: Verb) -> int:
        return sum(1 for request in self.requests if request.verb == verb)

    @property
    def watching(self) -> int:
        """Watch streams open now."""
        return len(self._watchers)

    async def wait_requests(self, verb: Verb, count: int, timeout: float = HANG_GUARD) -> None:
        """Until ``count`` requests of ``verb`` have come in."""
        await self._wait(lambda: self.count(verb) >= count, timeout)

    async def wait_streams(self, count: int, timeout: float = HANG_GUARD) -> None:
        """Until ``count`` watch streams were opened (backlog sent, live events flowing)."""
        await self._wait(lambda: self.streams >= count, timeout)

    async def _wait(self, predicate: Callable[[], bool], timeout: float) -> None:
        # ``timeout`` is a hang guard, not a bound: tests assert what came, not how fast.
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(predicate)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # -- events (serve --mirror) ------------------------------------------------------------

    def add_event(self, event: Json) -> None:
        """Keep a core/v1 Event (its resourceVersion set) and send it to every open watch."""
        event = copy.deepcopy(event)
        event.setdefault("metadata", {})["resourceVersion"] = self._bump()
        self.events.append(event)
        for queue in self._event_watches:
            queue.put_nowait({"type": "ADDED", "object": copy.deepcopy(event)})

    async def _events(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.event_requests.append(query)
        await self._notify()
        selector = query.get("fieldSelector", "")
        if selector != "involvedObject.kind=Pod,reason=Unhealthy":
            self.protocol_errors.append(f"events: fieldSelector {selector!r}")
            return _json(400, status(400, "BadRequest", f"unexpected selector {selector!r}"))
        if self.events_forbidden:
            message = (
                'events is forbidden: User "system:serviceaccount:x:cri-prober" cannot list '
                'resource "events" in API group "" at the cluster scope'
            )
            return _json(403, status(403, "Forbidden", message))
        if query.get("watch") not in ("1", "true"):
            return _json(
                200,
                {
                    "kind": "EventList",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": self.events,
                },
            )
        since = int(query.get("resourceVersion") or "0")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        queue: asyncio.Queue[Json | None] = asyncio.Queue()
        for event in self.events:
            if int(event["metadata"]["resourceVersion"]) > since:
                queue.put_nowait({"type": "ADDED", "object": copy.deepcopy(event)})
        self._event_watches.append(queue)
        await self._notify()
        try:
            while (item := await queue.get()) is not None:
                await response.write(_line(item))
            await response.write_eof()
        except ConnectionResetError:
            pass
        finally:
            self._event_watches.remove(queue)
        return response

    async def wait_event_watches(self, count: int, timeout: float = HANG_GUARD) -> None:
        """Until ``count`` watches of events are open (their backlog queued)."""
        await self._wait(lambda: len(self._event_watches) >= count, timeout)

    # -- the handler --------------------------------------------------------------------------

    async def _node(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if self.node_forbidden:
            message = (
                f'nodes "{name}" is forbidden: User "system:serviceaccount:x:cri-prober" '
                'cannot get resource "nodes" in API group "" at the cluster scope'
            )
            return web.json_response(status(403, "Forbidden", message), status=403)
        node = self.nodes.get(name)
        if node is None:
            return web.json_response(
                status(404, "NotFound", f'nodes "{name}" not found'), status=404
            )
        return web.json_response(node)

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        verb: Verb = "watch" if query.get("watch") in ("1", "true") else "list"
        self.requests.append(
            RecordedRequest(
                verb,
                query,
                request.headers.get("Authorization"),
                request.query_string,
                dict(request.headers),
            )
        )
        await self._notify()
        selector = query.get("fieldSelector", "")
        expected = f"spec.nodeName={self.node_name}"
        if selector != expected:
            self.protocol_errors.append(f"{verb}: fieldSelector {selector!r}, not {expected!r}")
            return _json(400, status(400, "BadRequest", f"unexpected selector {selector!r}"))
        if self._scripted[verb]:
            scripted = self._scripted[verb].pop(0)
            if isinstance(scripted[0], Recording):
                return await self._replay(request, scripted[0], scripted[1])
            code, body = scripted
            assert isinstance(body, (dict, str))
            if code == REFUSE:
                assert request.transport is not None
                request.transport.abort()
                return web.Response()  # never sent: the connection is gone
            return _json(code, body)
        node = selector.removeprefix("spec.nodeName=")
        if verb == "list":
            return self._list(node, query)
        if query.get("sendInitialEvents") == "true" and not self.watch_list:
            return await self._replay(request, Recording.load("watchlist-sendinitialevents"), 0)
        return await self._watch(request, node, query)

    def _list(self, node: str, query: Mapping[str, str]) -> web.Response:
        items = [pod for pod in self.pods.values() if _node(pod) == node]
        version = str(self.version)
        asked = query.get("resourceVersion")
        limit = int(query.get("limit", "0"))
        metadata: Json = {}
        if asked == "0":  # the watch cache: whole, at its own version
            version = str(self.cache_version or self.version)
        elif asked and int(asked) > self.version:
            return _json(504, TOO_LARGE)
        elif asked and limit and int(asked) < self.compacted:  # an exact read from etcd
            return _json(410, LIST_EXPIRED)
        elif not asked and limit:  # a quorum read, in pages
            start = int(query.get("continue") or "0")
            if start:
                version = str(self._paged_at)
            else:
                self._paged_at = self.version
            if start + limit < len(items):
                metadata["continue"] = str(start + limit)
            items = items[start : start + limit]
        return _json(
            200,
            {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": version, **metadata},
                "items": items,
            },
        )

    async def _replay(
        self, request: web.Request, recording: Recording, time_scale: float
    ) -> web.StreamResponse:
        skip = {"transfer-encoding", "content-length", "date", "connection"}
        headers = {key: value for key, value in recording.headers if key.lower() not in skip}
        if not recording.chunked:
            return web.Response(
                status=recording.status,
                reason=recording.reason,
                body=recording.body,
                headers=headers,
            )
        response = web.StreamResponse(
            status=recording.status, reason=recording.reason, headers=headers
        )
        response.enable_chunked_encoding()
        await response.prepare(request)
        if request.query.get("watch") in ("1", "true") and recording.status == 200:
            self.streams += 1
            await self._notify()
        elapsed = 0.0
        try:
            for at, data in recording.chunks:
                if at > elapsed and time_scale:
                    await asyncio.sleep((at - elapsed) * time_scale)
                elapsed = max(elapsed, at)
                if data:
                    await response.write(data)
            if recording.complete:
                await response.write_eof()
            else:  # the recording broke off: so does the connection
                assert request.transport is not None
                request.transport.abort()
        except ConnectionResetError:
            pass
        return response

    async def _watch(
        self, request: web.Request, node: str, query: Mapping[str, str]
    ) -> web.StreamResponse:
        since = query.get("resourceVersion")
        backlog: list[Json] = []
        if query.get("sendInitialEvents") == "true":  # the state now, then a bookmark
            backlog.extend(
                {"type": "ADDED", "object": copy.deepcopy(pod)}
                for pod in self.pods.values()
                if _node(pod) == node
            )
            if self.initial_events_end:
                backlog.append(_bookmark(str(self.version), end="true"))
        elif since and int(since) < self.compacted:
            if self.gone_as == "http":
                return _json(410, GONE)
            backlog.append({"type": "ERROR", "object": GONE})
        elif since:
            backlog.extend(
                {"type": kind, "object": copy.deepcopy(pod)}
                for version, kind, pod in self.history
                if version > int(since) and _node(pod) == node
            )
        else:  # no version: the current state as ADDED events
            backlog.extend(
                {"type": "ADDED", "object": copy.deepcopy(pod)}
                for pod in self.pods.values()
                if _node(pod) == node
            )
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        watcher = _Watcher(node)
        try:
            for event in backlog:
                await response.write(_line(event))
            if backlog and backlog[0]["type"] == "ERROR":
                await response.write_eof()
                return response
            self._watchers.append(watcher)
            self.streams += 1
            await self._notify()
            ends = None
            if self.watch_time_scale is not None:
                ends = asyncio.get_running_loop().time() + self.watch_time_scale * int(
                    query.get("timeoutSeconds", "0")
                )
            while True:
                try:
                    async with asyncio.timeout_at(ends):
                        item = await watcher.queue.get()
                except TimeoutError:  # the server's timeoutSeconds: the final chunk
                    item = "end"
                if item == "end":
                    await response.write_eof()
                    return response
                if item == "drop":
                    assert request.transport is not None
                    request.transport.abort()
                    return response
                if isinstance(item, str):
                    await response.write(item.encode() + b"\n")
                else:
                    await response.write(_line(item))
        except ConnectionResetError:  # the client went away first
            return response
        finally:
            if watcher in self._watchers:
                self._watchers.remove(watcher)
                await self._notify()


def _node(pod: Mapping[str, Any]) -> str:
    node = pod.get("spec", {}).get("nodeName", "")
    return node if isinstance(node, str) else ""


def _bookmark(version: str, *, end: str) -> Json:
    return {
        "type": "BOOKMARK",
        "object": {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": version, "annotations": {INITIAL_EVENTS_END: end}},
        },
    }


def _line(event: Json) -> bytes:
    return json.dumps(event, separators=(",", ":")).encode() + b"\n"


def _json(code: int, body: Json | str) -> web.Response:
    text = body if isinstance(body, str) else json.dumps(body)
    content_type = "text/plain" if isinstance(body, str) else "application/json"
    # The API server's exact Content-Type ("application/json", no charset).
    return web.Response(status=code, body=text.encode(), headers={"Content-Type": content_type})


class Changes:
    """A pod source's ``changed`` callback: counts calls, and can be awaited."""

    def __init__(self) -> None:
        self.calls = 0
        self._event = asyncio.Event()

    def __call__(self) -> None:
        self.calls += 1
        self._event.set()

    async def wait(self, calls: int, timeout: float = HANG_GUARD) -> None:
        async with asyncio.timeout(timeout):
            while self.calls < calls:
                self._event.clear()
                await self._event.wait()


@asynccontextmanager
async def running(source: PodSource) -> AsyncIterator[Changes]:
    """Run ``source`` in a task for the block; cancel and close it after."""
    changes = Changes()
    task = asyncio.create_task(source.run(changes))
    try:
        yield changes
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await source.close()
