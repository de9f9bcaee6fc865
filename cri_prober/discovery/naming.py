"""How users name containers, and how a name is resolved to exactly one container.

A container is named by its full ID, a unique ID prefix, or ``<namespace>/<pod>/<container>``
(the newest attempt of that container in the newest pod sandbox of that name). The API server
resolves names over discovery's view and ``cri-prober check`` over CRI list calls; both use these
functions, so a name means the same container everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cri_prober.discovery.model import ContainerInfo
from cri_prober.errors import CriProberError

# How many matching IDs an ambiguity message lists before eliding the rest.
_AMBIGUOUS_SHOWN = 5
# The longest name that can name a container: a full ID is 64 characters, and the Kubernetes
# limits (namespace 63, pod 253, container 63) make namespace/pod/container at most 381. Anything
# longer is refused before it is compared with every container.
MAX_TARGET_CHARS = 512
# How much of a user's value a message quotes. Messages travel back to clients as gRPC status
# details (a header with a 16 KiB hard limit, percent-encoded), and logs keep them.
SHOWN_CHARS = 128
# The most a TargetError message may hold, in UTF-8 bytes, whoever built it.
MAX_MESSAGE_BYTES = 1024


@dataclass(frozen=True, slots=True)
class ContainerRef:
    """What naming needs to know about one container (any attempt, any state)."""

    id: str
    name: str
    attempt: int
    created_at: int  # ns since the epoch
    pod_name: str
    pod_namespace: str
    pod_uid: str
    pod_sandbox_id: str
    pod_created_at: int  # ns since the epoch

    @property
    def label(self) -> str:
        """``namespace/pod/container``."""
        return f"{self.pod_namespace}/{self.pod_name}/{self.name}"

    @classmethod
    def of(cls, info: ContainerInfo) -> ContainerRef:
        """The reference to a container discovery knows."""
        return cls(
            id=info.id,
            name=info.name,
            attempt=info.attempt,
            created_at=info.created_at,
            pod_name=info.pod.name,
            pod_namespace=info.pod.namespace,
            pod_uid=info.pod.uid,
            pod_sandbox_id=info.pod_sandbox_id,
            pod_created_at=info.pod.created_at,
        )


def shown(value: str, limit: int = SHOWN_CHARS) -> str:
    """``value`` quoted for a message, cut after ``limit`` chars: ``'ab'… (9000 characters)``."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}… ({len(value)} characters)"


def clip(message: str, max_bytes: int) -> str:
    """``message`` cut to at most ``max_bytes`` UTF-8 bytes (plus an ellipsis when cut)."""
    encoded = message.encode("utf-8", "surrogatepass")
    if len(encoded) <= max_bytes:
        return message
    return encoded[:max_bytes].decode("utf-8", "ignore") + "…"


class TargetError(CriProberError):
    """A name that does not pick exactly one container; the message says why.

    The message is clipped to ``MAX_MESSAGE_BYTES``: it quotes what a client sent, and goes back
    to it as a status detail (the health service's included).
    """

    def __init__(self, message: str) -> None:
        super().__init__(clip(message, MAX_MESSAGE_BYTES))


class TargetNotFound(TargetError):
    """Nothing has that name."""


class AmbiguousTarget(TargetError):
    """An ID prefix that matches several containers."""


class InvalidTarget(TargetError):
    """Not a container name at all (empty, or the wrong number of ``/``-separated parts)."""


def newest_attempts(refs: Iterable[ContainerRef]) -> list[ContainerRef]:
    """The newest attempt of every container, keyed as the probe manager keys its slots."""
    newest: dict[tuple[str, str], ContainerRef] = {}
    for ref in refs:
        key = (ref.pod_uid or ref.pod_sandbox_id, ref.name)
        current = newest.get(key)
        if current is None or (ref.attempt, ref.created_at) > (current.attempt, current.created_at):
            newest[key] = ref
    return list(newest.values())


def find_container(target: str, refs: Iterable[ContainerRef]) -> ContainerRef:
    """The one container ``target`` names among ``refs``.

    Raises:
        TargetError: one of its subclasses, with a message fit for the user.
    """
    if not target:
        raise InvalidTarget(
            "no container named: give an ID, an ID prefix or namespace/pod/container"
        )
    if len(target) > MAX_TARGET_CHARS:
        raise InvalidTarget(
            f"{shown(target)} is not a container name: longer than {MAX_TARGET_CHARS} characters"
        )
    if "/" in target:
        parts = target.split("/")
        if len(parts) != 3 or not all(parts):
            raise InvalidTarget(
                f"{shown(target)} is not a container name: "
                "expected namespace/pod/container or an ID"
            )
        namespace, pod, name = parts
        named = [
            ref
            for ref in refs
            if ref.pod_namespace == namespace and ref.pod_name == pod and ref.name == name
        ]
        if not named:
            raise TargetNotFound(f"no container {target}")
        return max(named, key=lambda ref: (ref.pod_created_at, ref.attempt, ref.created_at))
    by_id = {ref.id: ref for ref in refs}
    if target in by_id:
        return by_id[target]
    matches = sorted(container_id for container_id in by_id if container_id.startswith(target))
    if not matches:
        raise TargetNotFound(f"no container with ID or ID prefix {shown(target)}")
    if len(matches) > 1:
        listed = ", ".join(f"{m[:13]} ({by_id[m].label})" for m in matches[:_AMBIGUOUS_SHOWN])
        more = (
            f" and {len(matches) - _AMBIGUOUS_SHOWN} more"
            if len(matches) > _AMBIGUOUS_SHOWN
            else ""
        )
        raise AmbiguousTarget(
            f"ID prefix {shown(target)} is ambiguous: it matches {len(matches)} containers: "
            f"{listed}{more}; give more characters"
        )
    return by_id[matches[0]]


__all__ = [
    "MAX_MESSAGE_BYTES",
    "MAX_TARGET_CHARS",
    "SHOWN_CHARS",
    "AmbiguousTarget",
    "ContainerRef",
    "InvalidTarget",
    "TargetError",
    "TargetNotFound",
    "clip",
    "find_container",
    "newest_attempts",
    "shown",
]
