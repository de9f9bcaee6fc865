"""The PreStop hook's spec: a core/v1 LifecycleHandler as the kubelet serialises it into the
container's annotation, as pydantic models (its exec and httpGet actions are the probe's).

Imported by ``probing.hooks`` when a container's annotation is parsed, so that a serve that
stops no container with a hook does not load pydantic (issue 36, idle RSS).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from cri_prober.probing.spec.model import ExecAction, HTTPGetAction, TCPSocketAction

__all__ = ["LifecycleHandler", "SleepAction"]


class SleepAction(BaseModel):
    """The ``sleep`` lifecycle handler: wait this many seconds (no probe has it)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    seconds: StrictInt


class LifecycleHandler(BaseModel):
    """A core/v1 LifecycleHandler as the kubelet serialises it into the annotation.

    Unknown keys are ignored, as Go's JSON decoding ignores them; the action models are the
    probe ones, since the API validates both alike.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    exec: ExecAction | None = None
    http_get: HTTPGetAction | None = Field(default=None, alias="httpGet")
    tcp_socket: TCPSocketAction | None = Field(default=None, alias="tcpSocket")
    sleep: SleepAction | None = None
