"""What the probe spec's models and its pydantic-free core share: the error a broken spec raises,
the bounds of what cri-prober reads, and how a bad value is shown in a message. Imports nothing
of the spec package, so every module of it can use this one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from cri_prober.errors import CriProberError

__all__ = [
    "ANNOTATION_MAX_BYTES",
    "GRPC_MODES",
    "HTTP_PROTOCOLS",
    "SpecError",
    "Unsupported",
]

_MAX_PORT: Final = 65535
# What a message shows of a bad value at most.
_SHOWN_CHARS: Final = 64

# One override annotation's value. Kubernetes allows 256 KiB for all of an object's annotations
# together; an override is a few hundred bytes. (Why input is bounded at all: see yaml_loader.)
ANNOTATION_MAX_BYTES: Final = 64 * 1024

# The values of the 1.37 fields that cri-prober knows; any other is not run (see Unsupported).
HTTP_PROTOCOLS: Final = ("HTTP1", "HTTP2")
GRPC_MODES: Final = ("Plaintext", "TLS")


class SpecError(CriProberError):
    """A probe spec, rules file or override annotation broke the rules: one message per problem."""

    def __init__(self, messages: Sequence[str], *, source: str | None = None) -> None:
        self.messages = list(messages)
        self.source = source
        super().__init__("\n".join(self.lines))

    @property
    def lines(self) -> list[str]:
        """The messages, each led by the source when known (``rules.yaml: probes[1]...``)."""
        prefix = f"{self.source}: " if self.source else ""
        return [prefix + message for message in self.messages]


def _show(value: int | str) -> str:
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class Unsupported:
    """A field of a pod spec's probe handler that cri-prober cannot send as the spec asks.

    ``field`` names it for people (``grpc.foo``, ``httpGet.protocol "HTTP3"``). ``gate`` is the
    kubelet feature gate the field belongs to, when it is one cri-prober knows whose value it
    does not: a kubelet without that gate ignores the field, and so does the prober there.
    None: a field cri-prober does not know at all, never run whatever the kubelet.
    """

    field: str
    gate: str | None = None
