"""Pod lists and watch events decoded into only the fields cri-prober uses, never the whole
document: typed msgspec decoding skips everything else (env values, statuses, managed fields)
in C without building it, so memory follows what is kept, not what a source sends.

A decoded pod is reduced to a small "slim" object (the same shape as a core/v1 Pod, with only
the used fields, and of each container's env only the variables its exec probes refer to),
keyed and digested so that an unchanged pod is not parsed again.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from cri_prober.podspecs.model import (
    CONFIG_SEEN_ANNOTATION,
    CONFIG_SOURCE_ANNOTATION,
    DEFAULT_NAMESPACE,
    MIRROR_ANNOTATION,
    pod_key,
)

__all__ = [
    "MAX_PODS",
    "DecodedPod",
    "PodListError",
    "WatchEvent",
    "decode_pod",
    "decode_pod_list",
    "decode_watch_event",
    "slim_pods",
]

# The most pods one listing may hold. A node runs 110 by default (the kubelet's --max-pods),
# rarely more than a few hundred; anything near this is not one node's pods. It bounds what a
# source keeps (a parsed spec per pod) whatever the source sends.
MAX_PODS: Final = 10_000

_PROBE_FIELDS: Final = ("livenessProbe", "readinessProbe", "startupProbe")
# $(NAME) in an exec probe's command: the env variables worth keeping for its expansion.
_REFERENCE: Final = re.compile(r"\$\(([^()]*)\)")
# The annotations kept (the mirror pod's static UID, the kubelet's first sight of the pod and the
# config source it came from); their keys are searched in the raw annotations (a buffer, not
# copied) before decoding them.
_KEPT_ANNOTATIONS: Final = (MIRROR_ANNOTATION, CONFIG_SEEN_ANNOTATION, CONFIG_SOURCE_ANNOTATION)
_KEPT_KEYS: Final = re.compile(b"|".join(re.escape(key.encode()) for key in _KEPT_ANNOTATIONS))


class PodListError(ValueError):
    """A listing or event cri-prober cannot read; the message says what is wrong, on one line.

    ``malformed`` is True when the bytes are not JSON at all (else they are JSON of the wrong
    shape, nested too deeply, or too many pods).
    """

    def __init__(self, message: str, *, malformed: bool = False) -> None:
        super().__init__(message)
        self.malformed = malformed


# -- the typed view of what is read: unknown fields are skipped without being built ----------
# Scalars are Any so that the pod parser reports a wrong type with its field path, per pod; what
# can be large (env, annotations) stays raw bytes until it is needed.


class _Metadata(msgspec.Struct, gc=False, omit_defaults=True):
    name: Any = None
    namespace: Any = None
    uid: Any = None
    resourceVersion: Any = None  # noqa: N815 - the API's field names
    deletionTimestamp: Any = None  # noqa: N815
    deletionGracePeriodSeconds: Any = None  # noqa: N815
    annotations: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)


class _Container(msgspec.Struct, gc=False, omit_defaults=True):
    # Probes and ports stay raw too: decoded (small) only for a pod that changed, so an
    # unchanged listing builds no Python containers at all, and leaves the collector alone.
    name: Any = None
    restartPolicy: Any = None  # noqa: N815
    livenessProbe: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # noqa: N815
    readinessProbe: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # noqa: N815
    startupProbe: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # noqa: N815
    ports: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    # KEP-5307: which exits restart the container (the pod parser bounds and checks it).
    restartPolicyRules: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # noqa: N815
    env: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)


class _Spec(msgspec.Struct, gc=False, omit_defaults=True):
    containers: list[_Container] | None = None
    initContainers: list[_Container] | None = None  # noqa: N815
    restartPolicy: Any = None  # noqa: N815
    terminationGracePeriodSeconds: Any = None  # noqa: N815


class _Status(msgspec.Struct, gc=False, omit_defaults=True):
    phase: Any = None


class _Pod(msgspec.Struct, gc=False, omit_defaults=True):
    # Required: a listing of `{}` items fails at its first item instead of building millions.
    metadata: _Metadata
    kind: Any = None
    spec: _Spec | None = None
    status: _Status | None = None


# serve --mirror: the kubelet's ready and started of each container, read from the pod status
# only when asked (decode_pod_list(statuses=True)): otherwise every readiness flip would change
# a pod's digest and have it parsed again.


class _ContainerStatus(msgspec.Struct, gc=False, omit_defaults=True):
    name: Any = None
    containerID: Any = None  # noqa: N815
    ready: Any = None
    started: Any = None


class _StatusWithContainers(msgspec.Struct, gc=False, omit_defaults=True):
    phase: Any = None
    containerStatuses: list[_ContainerStatus] | None = None  # noqa: N815
    initContainerStatuses: list[_ContainerStatus] | None = None  # noqa: N815


class _PodWithStatus(msgspec.Struct, gc=False, omit_defaults=True):
    metadata: _Metadata
    kind: Any = None
    spec: _Spec | None = None
    status: _StatusWithContainers | None = None


class _ListMeta(msgspec.Struct, gc=False):
    resourceVersion: str | None = None  # noqa: N815
    # "continue" is a Python keyword: renamed.
    continue_: str | None = msgspec.field(default=None, name="continue")


class _PodList(msgspec.Struct, gc=False):
    kind: Any = None
    metadata: _ListMeta | None = None
    items: list[_Pod] | None = None


class _PodListWithStatus(msgspec.Struct, gc=False):
    kind: Any = None
    metadata: _ListMeta | None = None
    items: list[_PodWithStatus] | None = None


class _EnvVar(msgspec.Struct, gc=False):
    name: Any = None
    value: Any = None


class _Event(msgspec.Struct, gc=False):
    type: Any = None
    object: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)


class _ObjectHead(msgspec.Struct, gc=False):
    kind: Any = None
    metadata: _Metadata | None = None


_LIST_DECODER: Final = msgspec.json.Decoder(_PodList)
_STATUS_LIST_DECODER: Final = msgspec.json.Decoder(_PodListWithStatus)
_POD_DECODER: Final = msgspec.json.Decoder(_Pod)
_STATUS_POD_DECODER: Final = msgspec.json.Decoder(_PodWithStatus)
_EVENT_DECODER: Final = msgspec.json.Decoder(_Event)
_HEAD_DECODER: Final = msgspec.json.Decoder(_ObjectHead)
_ENV_DECODER: Final = msgspec.json.Decoder(list[_EnvVar])
_ANNOTATIONS_DECODER: Final = msgspec.json.Decoder(dict[str, Any])
_ANY_DECODER: Final = msgspec.json.Decoder()
_ENCODER: Final = msgspec.json.Encoder()


class DecodedPod:
    """One pod as read, before parsing: its key, a digest of everything read, and the slim
    object the pod parser takes, made only when asked for (a pod whose digest did not change
    is never reduced).

    Until then it holds the typed pod, whose raw fields point into the listing's buffer: the
    buffer lives as long as the listing's decoded pods.
    """

    __slots__ = ("_obj", "_pod", "digest", "key")

    def __init__(
        self,
        key: str | None,
        digest: bytes,
        obj: dict[str, Any] | None = None,
        *,
        pod: _Pod | _PodWithStatus | None = None,
    ) -> None:
        self.key = key
        self.digest = digest
        self._obj = obj
        self._pod = pod

    @property
    def obj(self) -> dict[str, Any]:
        """The slim pod object: a core/v1 Pod with only the fields cri-prober uses."""
        if self._obj is None:
            self._obj = _slim(self._pod) if self._pod is not None else {}
            self._pod = None
        return self._obj

    def __repr__(self) -> str:
        return f"DecodedPod(key={self.key!r}, digest={self.digest.hex()})"


@dataclass(frozen=True, slots=True)
class PodList:
    """A decoded listing (or one page of it)."""

    kind: object
    pods: list[DecodedPod]
    resource_version: str | None
    continue_token: str | None


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One watch event: its type, and the pod (ADDED/MODIFIED/DELETED), the object's
    resourceVersion (every type) or the Status (ERROR)."""

    type: str
    pod: DecodedPod | None
    resource_version: str | None
    status: dict[str, Any] | None


def decode_pod_list(
    body: bytes | bytearray | memoryview, *, max_pods: int = MAX_PODS, statuses: bool = False
) -> PodList:
    """Decode a PodList's used fields and reduce each pod to its slim, digested form.

    ``statuses``: keep each container's ready, started and container ID from the pod status
    (serve --mirror).

    Blocking (about 1 ms per MB of input, more for pods that changed): sources run it in a
    worker thread. The result holds no reference to ``body``.

    Raises:
        PodListError: not JSON, not shaped like a PodList, too deeply nested, or more than
            ``max_pods`` pods.
    """
    try:
        listing: _PodList | _PodListWithStatus = (
            _STATUS_LIST_DECODER if statuses else _LIST_DECODER
        ).decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise _error(exc) from None
    items = listing.items or []
    if len(items) > max_pods:
        raise PodListError(f"it lists {len(items)} pods, more than the {max_pods} one node can run")
    metadata = listing.metadata or _ListMeta()
    pods = [_decoded(pod) for pod in items]
    return PodList(listing.kind, pods, metadata.resourceVersion, metadata.continue_)


def decode_pod(data: bytes | bytearray | memoryview) -> DecodedPod:
    """One Pod object (a manifest as JSON, a watch event's object).

    Raises:
        PodListError: not JSON, or not shaped like a Pod.
    """
    try:
        return _decoded(_POD_DECODER.decode(data))
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise _error(exc) from None


def decode_watch_event(
    line: bytes | bytearray | memoryview, *, statuses: bool = False
) -> WatchEvent:
    """One line of a watch stream (``statuses`` as for ``decode_pod_list``).

    Raises:
        PodListError: not JSON, or not shaped like a watch event of pods.
    """
    try:
        event = _EVENT_DECODER.decode(line)
        kind = event.type
        if not isinstance(kind, str):
            raise PodListError(f"an event has no type: {bytes(line[:200])!r}")
        if not event.object:
            raise PodListError(f"a {kind} event has no object: {bytes(line[:200])!r}")
        if kind == "ERROR":
            status = msgspec.json.decode(event.object)
            if not isinstance(status, dict):
                status = {}
            return WatchEvent(kind, None, None, status)
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            pod: _Pod | _PodWithStatus = (_STATUS_POD_DECODER if statuses else _POD_DECODER).decode(
                event.object
            )
            version = pod.metadata.resourceVersion
            return WatchEvent(kind, _decoded(pod), _text_or_none(version), None)
        head = _HEAD_DECODER.decode(event.object)  # BOOKMARK, or a type we do not know
        version = head.metadata.resourceVersion if head.metadata is not None else None
        return WatchEvent(kind, None, _text_or_none(version), None)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise _error(exc) from None


def slim_pods(objects: Iterable[object]) -> Iterator[DecodedPod]:
    """Already decoded pod objects (a manifest's YAML, a test's dict), reduced like a listing's.

    An object that is not shaped like a Pod comes back with key None (and is reported as such).
    """
    for obj in objects:
        try:
            yield decode_pod(_ENCODER.encode(obj))
        except (PodListError, TypeError):
            # Not shaped like a Pod: the pod parser gets the object whole, to say which field
            # is wrong (it is already in memory, and small: a manifest or a test's pod).
            text = json.dumps(obj, sort_keys=True, default=str).encode("utf-8", "surrogatepass")
            digest = hashlib.blake2b(text, digest_size=16).digest()
            yield DecodedPod(pod_key(obj), digest, obj if isinstance(obj, dict) else {})


# -- reduction --------------------------------------------------------------------------------


def _decoded(pod: _Pod | _PodWithStatus) -> DecodedPod:
    # The digest covers every field read (env and annotations whole, as sent), so any change
    # that could matter changes it; encoding the typed pod costs a copy at C speed.
    digest = hashlib.blake2b(_ENCODER.encode(pod), digest_size=16).digest()
    return DecodedPod(_key(pod.metadata), digest, pod=pod)


def _key(metadata: _Metadata) -> str | None:
    """``pod_key`` of the typed metadata: the UID, else namespace/name."""
    uid, name, namespace = metadata.uid, metadata.name, metadata.namespace
    if isinstance(uid, str) and uid:
        return uid
    if not isinstance(name, str) or not name:
        return None
    return f"{namespace if isinstance(namespace, str) and namespace else DEFAULT_NAMESPACE}/{name}"


def _slim(pod: _Pod | _PodWithStatus) -> dict[str, Any]:
    metadata = pod.metadata
    slim_metadata: dict[str, Any] = {
        field: value
        for field in ("name", "namespace", "uid", "deletionTimestamp", "deletionGracePeriodSeconds")
        if (value := getattr(metadata, field)) is not None
    }
    kept = _kept_annotations(metadata.annotations)
    if kept:
        slim_metadata["annotations"] = kept
    obj: dict[str, Any] = {"metadata": slim_metadata}
    if pod.kind is not None:
        obj["kind"] = pod.kind
    if pod.spec is not None:
        spec: dict[str, Any] = {}
        for field in ("restartPolicy", "terminationGracePeriodSeconds"):
            if (value := getattr(pod.spec, field)) is not None:
                spec[field] = value
        if pod.spec.containers is not None:
            spec["containers"] = [_slim_container(c) for c in pod.spec.containers]
        if pod.spec.initContainers is not None:
            spec["initContainers"] = [_slim_container(c) for c in pod.spec.initContainers]
        obj["spec"] = spec
    if pod.status is not None:
        status: dict[str, Any] = {}
        if pod.status.phase is not None:
            status["phase"] = pod.status.phase
        if isinstance(pod.status, _StatusWithContainers):
            for field in ("containerStatuses", "initContainerStatuses"):
                entries = getattr(pod.status, field)
                if entries is not None:
                    status[field] = [msgspec.structs.asdict(entry) for entry in entries]
        if status:
            obj["status"] = status
    return obj


def _slim_container(container: _Container) -> dict[str, Any]:
    slim: dict[str, Any] = {}
    for field in ("name", "restartPolicy"):
        if (value := getattr(container, field)) is not None:
            slim[field] = value
    for field in (*_PROBE_FIELDS, "ports", "restartPolicyRules"):
        raw: msgspec.Raw = getattr(container, field)
        if not raw:
            continue
        try:
            value = _ANY_DECODER.decode(raw)
        except RecursionError:
            value = "(nested too deeply)"  # the pod parser refuses it with its field path
        if value is not None:
            slim[field] = value
    names = _referenced_names(slim)
    if names and container.env:
        slim["env"] = _env_entries(container.env, names)
    return slim


def _referenced_names(container: dict[str, Any]) -> set[str]:
    """The env names that the container's exec probe commands refer to as $(NAME)."""
    names: set[str] = set()
    for field in _PROBE_FIELDS:
        probe = container.get(field)
        if not isinstance(probe, dict):
            continue
        action = probe.get("exec")
        command = action.get("command") if isinstance(action, dict) else None
        if isinstance(command, list):
            for argument in command:
                if isinstance(argument, str) and "$(" in argument:
                    names.update(_REFERENCE.findall(argument))
    return names


def _env_entries(raw: msgspec.Raw, names: set[str]) -> list[dict[str, Any]]:
    """The env entries named in ``names``, in order (later entries win when expanded).

    The whole list is decoded here, one pod at a time, and only the named entries are kept.
    """
    try:
        entries = _ENV_DECODER.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return []  # no values to expand with (the API server never sends such an env)
    return [
        {"name": entry.name, "value": entry.value}
        for entry in entries
        if isinstance(entry.name, str) and entry.name in names
    ]


def _kept_annotations(raw: msgspec.Raw) -> dict[str, Any]:
    # Annotations may be large (a tenant's, up to 256 KiB): decoded only when they hold one
    # that cri-prober reads.
    if not raw or _KEPT_KEYS.search(memoryview(raw)) is None:
        return {}
    try:
        annotations = _ANNOTATIONS_DECODER.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return {}
    return {key: annotations[key] for key in _KEPT_ANNOTATIONS if key in annotations}


def _text_or_none(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _error(exc: BaseException) -> PodListError:
    if isinstance(exc, RecursionError):
        return PodListError("it is nested too deeply")
    text = str(exc).removeprefix("JSON is malformed: ")
    # msgspec speaks of "$.items[3].spec": the API's own field paths read better without "$.".
    text = text.replace("`$.", "`").replace("`$`", "the document")
    malformed = not isinstance(exc, msgspec.ValidationError)  # a DecodeError of its own
    return PodListError(text, malformed=malformed)
