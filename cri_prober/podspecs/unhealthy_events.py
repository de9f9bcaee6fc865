"""serve --mirror with --probes-from apiserver: the kubelet's ``Unhealthy`` events (list, then
watch, core/v1 Events), kept as the newest failure text per probe of this node's pods, so that a
mirrored failure shows what the kubelet's probe answered (the counters carry no text).

The kubelet writes them in ``prober.runProbe`` (pkg/kubelet/prober/prober.go, release-1.28):
``"%s probe failed: %s"`` (the probe's output) or ``"%s probe errored: %v"``, with the probe type
``Liveness``/``Readiness``/``Startup``, on the container's reference (``involvedObject.fieldPath``
``spec.containers{NAME}``, the pod's UID). Its event recorder rate-limits them (25 per object,
then about one per 5 minutes), so a text may be older than the failure it is shown with.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final

import httpx2
import structlog

from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.mirror import FailureText

if TYPE_CHECKING:
    from cri_prober.podspecs.apiserver import ApiServerSource

__all__ = [
    "MAX_TEXT_CHARS",
    "UnhealthyEvent",
    "UnhealthyEvents",
    "UnhealthyTexts",
    "parse_event",
]

log = structlog.get_logger(__name__)

# The text kept of one event's message (the kubelet's probe output is up to 10 KiB).
MAX_TEXT_CHARS: Final = 1024
# The most entries kept: one per probe of a pod on the node (3 kinds × containers × pods).
MAX_ENTRIES: Final = 4096
# One event line (an Event object) and one list answer, in bytes.
MAX_EVENT_BYTES: Final = 256 * 1024
MAX_LIST_BYTES: Final = 32 * 1024 * 1024
# The field selector the API server supports on events (source is not selectable by host).
FIELD_SELECTOR: Final = "involvedObject.kind=Pod,reason=Unhealthy"
# Back-off between failed attempts: 1 s doubling to 60 s, × 0.5-1.
RETRY_INITIAL: Final = 1.0
RETRY_MAX: Final = 60.0
WATCH_TIMEOUT: Final = 300.0

_FIELD_PATH = re.compile(r"^spec\.(?:containers|initContainers)\{([^}]{1,253})\}$")
_KINDS = {
    "Liveness": ProbeKind.LIVENESS,
    "Readiness": ProbeKind.READINESS,
    "Startup": ProbeKind.STARTUP,
}
_MESSAGE = re.compile(r"^(Liveness|Readiness|Startup) probe (failed|errored): ?", re.DOTALL)


@dataclass(frozen=True, slots=True)
class UnhealthyEvent:
    """One kubelet ``Unhealthy`` event: whose probe, its text (cut), when (epoch seconds)."""

    pod_uid: str
    container: str
    kind: ProbeKind
    text: str
    at: float
    count: int = 1


def _time(value: object) -> float | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def parse_event(obj: object, node_name: str) -> UnhealthyEvent | None:
    """A core/v1 Event as the kubelet of ``node_name`` wrote it for a failed probe, or None
    (another reason, kind, node or message; a malformed object)."""
    if not isinstance(obj, Mapping) or obj.get("reason") != "Unhealthy":
        return None
    involved = obj.get("involvedObject")
    source = obj.get("source")
    if not isinstance(involved, Mapping) or involved.get("kind") != "Pod":
        return None
    host = source.get("host") if isinstance(source, Mapping) else None
    if host != node_name and obj.get("reportingInstance") != node_name:
        return None
    uid, path, message = involved.get("uid"), involved.get("fieldPath"), obj.get("message")
    if not isinstance(uid, str) or not uid or not isinstance(path, str):
        return None
    if not isinstance(message, str) or (field := _FIELD_PATH.match(path)) is None:
        return None
    if (head := _MESSAGE.match(message)) is None:
        return None
    series = obj.get("series")
    at = (
        _time(obj.get("lastTimestamp"))
        or (_time(series.get("lastObservedTime")) if isinstance(series, Mapping) else None)
        or _time(obj.get("eventTime"))
        or _time(obj.get("firstTimestamp"))
    )
    if at is None:
        return None
    count = obj.get("count")
    text = message[head.end() :] if head.group(2) == "failed" else message
    return UnhealthyEvent(
        uid,
        field.group(1),
        _KINDS[head.group(1)],
        text[:MAX_TEXT_CHARS],
        at,
        count if isinstance(count, int) and count > 0 else 1,
    )


class UnhealthyTexts:
    """The newest kubelet failure text per (pod UID, container, probe kind), for the pods
    ``live`` says are on the node; at most ``max_entries``. Implements ``FailureTexts``."""

    def __init__(
        self,
        live: Callable[[], Mapping[str, object]] | None = None,
        *,
        max_entries: int = MAX_ENTRIES,
    ) -> None:
        self._live = live
        self._max = max_entries
        self._texts: dict[tuple[str, str, ProbeKind], UnhealthyEvent] = {}

    def __len__(self) -> int:
        return len(self._texts)

    def put(self, event: UnhealthyEvent) -> bool:
        """Keep ``event`` if it is newer than the probe's kept one; False if dropped."""
        live = self._live() if self._live is not None else None
        if live is not None and event.pod_uid not in live:
            return False  # not a pod of this node (or gone)
        key = (event.pod_uid, event.container, event.kind)
        kept = self._texts.get(key)
        if kept is not None and kept.at > event.at:
            return False
        if kept is None and len(self._texts) >= self._max:
            self.prune()
            if len(self._texts) >= self._max:  # still full: the oldest text goes
                oldest = min(self._texts, key=lambda k: self._texts[k].at)
                del self._texts[oldest]
        self._texts[key] = event
        return True

    def prune(self) -> None:
        """Drop the texts of pods no longer on the node."""
        if self._live is None:
            return
        live = self._live()
        for key in [k for k in self._texts if k[0] not in live]:
            del self._texts[key]

    def get(self, pod_uid: str, container: str, kind: ProbeKind) -> FailureText | None:
        event = self._texts.get((pod_uid, container, kind))
        return None if event is None else FailureText(event.text, event.at)


def _decode_list(body: bytes, node_name: str) -> tuple[list[UnhealthyEvent], str]:
    data = json.loads(body)
    if not isinstance(data, Mapping) or not isinstance(data.get("items"), list):
        raise ValueError("not an EventList")
    meta = data.get("metadata")
    version = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
    if not isinstance(version, str):
        raise ValueError("an EventList without metadata.resourceVersion")
    events = [e for item in data["items"] if (e := parse_event(item, node_name)) is not None]
    return events, version


class _Failed(Exception):
    def __init__(self, message: str, *, gone: bool = False) -> None:
        super().__init__(message)
        self.gone = gone


class _ListTooLarge(_Failed):
    """The cluster's Unhealthy events passed max_list_bytes in one answer."""


class UnhealthyEvents:
    """Lists, then watches, the ``Unhealthy`` events of pods (``FIELD_SELECTOR``) with the API
    server source's client, keeping those of this node's kubelet in ``texts``. A failure is one
    ``kubelet_events_failed`` line per distinct error (a 403 names the RBAC it needs), then a
    jittered back-off; the texts kept stay."""

    def __init__(
        self,
        source: ApiServerSource,
        *,
        sleep: Callable[[float], Any] = asyncio.sleep,
        rng: random.Random | None = None,
        watch_timeout: float = WATCH_TIMEOUT,
        max_list_bytes: int = MAX_LIST_BYTES,
    ) -> None:
        self._http: httpx2.AsyncClient = source.client
        self.node_name = source.node_name
        self.texts = UnhealthyTexts(lambda: source.pods)
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._watch_timeout = watch_timeout
        self._max_list_bytes = max_list_bytes
        self._version: str | None = None
        self._last_error: str | None = None
        self.lists = 0
        self.watches = 0

    async def run(self) -> None:
        attempt = 0
        while True:
            try:
                if self._version is None:
                    await self._list()
                await self._watch()
                attempt = 0
                self._recovered()
            except asyncio.CancelledError:
                raise
            except _ListTooLarge as exc:
                # Too many to hold in one answer: a watch from "any version" (0) sends the
                # current ones as ADDED events, one bounded line at a time, then the new ones.
                self._failed(f"{exc}: watching from resourceVersion 0 instead")
                self._version = "0"
                continue
            except _Failed as exc:
                if exc.gone:
                    self._version = None  # 410: relist
                    continue
                attempt += 1
                self._failed(str(exc))
            except httpx2.HTTPError as exc:
                attempt += 1
                self._failed(f"cannot reach the API server: {type(exc).__name__}: {exc}")
            if attempt:
                delay = min(RETRY_MAX, RETRY_INITIAL * 2 ** (attempt - 1))
                await self._sleep(delay * (0.5 + self._rng.random() / 2))

    def _failed(self, message: str) -> None:
        if message != self._last_error:
            self._last_error = message
            log.warning("kubelet_events_failed", error=message[:512])

    def _recovered(self) -> None:
        if self._last_error is not None:
            self._last_error = None
            log.info("kubelet_events_recovered")

    def _refused(self, verb: str, code: int, body: bytes) -> _Failed:
        text = body[:300].decode("utf-8", "replace").strip()
        if code == 410:
            return _Failed(f"{verb} events: 410", gone=True)
        if code == 403:
            return _Failed(
                f"{verb} events: 403 Forbidden: the kubelet's failure texts need list and watch "
                f"on events (deploy/kubernetes/rbac-kubelet-mirror.yaml): {text}"
            )
        return _Failed(f"{verb} events: HTTP {code}: {text}")

    async def _list(self) -> None:
        params = {"fieldSelector": FIELD_SELECTOR, "resourceVersion": "0"}
        self.lists += 1
        async with self._http.stream("GET", "api/v1/events", params=params) as resp:
            body = bytearray()
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > self._max_list_bytes and resp.status_code == 200:
                    raise _ListTooLarge(
                        f"list events: the answer passed {self._max_list_bytes} bytes"
                    )
                if len(body) > self._max_list_bytes:
                    break  # an error's answer: its start says enough
            if resp.status_code != 200:
                raise self._refused("list", resp.status_code, bytes(body))
        try:
            # A cluster's events: decoded off the event loop.
            events, version = await asyncio.to_thread(_decode_list, bytes(body), self.node_name)
        except ValueError as exc:
            raise _Failed(f"list events: not an EventList: {exc}") from None
        self.texts.prune()
        for event in events:
            self.texts.put(event)
        self._version = version
        self._recovered()

    async def _watch(self) -> None:
        from cri_prober.podspecs.apiserver_client import LineTooLong, read_lines

        timeout_seconds = int(self._watch_timeout * (1 + self._rng.random()))
        params = {
            "watch": "true",
            "fieldSelector": FIELD_SELECTOR,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_seconds),
            "resourceVersion": self._version or "0",
        }
        timeout = httpx2.Timeout(30.0, read=timeout_seconds + 30.0)
        self.watches += 1
        async with self._http.stream(
            "GET", "api/v1/events", params=params, timeout=timeout
        ) as resp:
            if resp.status_code != 200:
                body = bytearray()
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > 4096:
                        break
                raise self._refused("watch", resp.status_code, bytes(body))
            try:
                async for line in read_lines(resp, MAX_EVENT_BYTES):
                    if line.strip():
                        self._line(line)
            except LineTooLong:
                raise _Failed(f"watch events: a line passed {MAX_EVENT_BYTES} bytes") from None

    def _line(self, line: bytes) -> None:
        try:
            event = json.loads(line)
            kind, obj = event["type"], event["object"]
        except (ValueError, KeyError, TypeError):
            raise _Failed(f"watch events: a line is not a watch event: {line[:200]!r}") from None
        if kind == "ERROR":
            code = obj.get("code") if isinstance(obj, Mapping) else None
            if code == 410:
                raise _Failed("watch events: 410 Gone", gone=True)
            raise _Failed(f"watch events: ERROR {str(obj)[:300]}")
        meta = obj.get("metadata") if isinstance(obj, Mapping) else None
        version = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
        if isinstance(version, str):
            self._version = version
        if kind in ("ADDED", "MODIFIED"):
            parsed = parse_event(obj, self.node_name)
            if parsed is not None:
                self.texts.put(parsed)
