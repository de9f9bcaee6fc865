"""The three probe kinds, in a module without dependencies so every layer can name them."""

from __future__ import annotations

import enum


class ProbeKind(enum.Enum):
    """The three probe types a container can have."""

    LIVENESS = "liveness"
    READINESS = "readiness"
    STARTUP = "startup"

    @property
    def field_name(self) -> str:
        """The key of this probe in a container spec, e.g. ``livenessProbe``."""
        return f"{self.value}Probe"


KINDS = {kind.value: kind for kind in ProbeKind}


def parse_kind(text: str) -> ProbeKind:
    """``liveness``, ``readiness`` or ``startup``; raises ``ValueError`` naming the choices."""
    kind = KINDS.get(text)
    if kind is None:
        raise ValueError(f"unknown probe kind {text!r}: expected one of {', '.join(KINDS)}")
    return kind


__all__ = ["KINDS", "ProbeKind", "parse_kind"]
