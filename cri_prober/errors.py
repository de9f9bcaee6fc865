"""cri-prober's exception hierarchy.

gRPC errors from the runtime are translated into a few behaviour-named classes at the CRI
boundary (``cri_prober.runtime.client``) so nothing else handles ``grpc.aio.AioRpcError``; the
original error is chained as ``__cause__``. Probe verdicts are values, never exceptions (see
``cri_prober.probing.outcome``). Every exception cri-prober raises on purpose derives from
``CriProberError``; the other layers define theirs beside the code that raises them.
"""

from __future__ import annotations

import grpc


class CriProberError(Exception):
    """Base class of every error cri-prober raises on purpose."""


class ConfigError(CriProberError):
    """The user's input (flags, environment, config files) is wrong; the message says where."""


class CriError(CriProberError):
    """The container runtime answered a CRI call with an error."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method}: {code.name}: {details}")
        self.method = method
        self.code = code
        self.details = details


class CriUnavailable(CriError):
    """The runtime could not be reached or is not ready yet (safe to retry idempotent reads)."""


class CriNotFound(CriError):
    """The container or sandbox does not exist (any more)."""


class CriContainerNotRunning(CriError):
    """ExecSync found the container not running, or gone: the call raced its container's stop or
    removal (the runtime's code is NOT_FOUND or UNKNOWN; ``runtime.client`` reads its text)."""


class CriContainerGone(CriNotFound, CriContainerNotRunning):
    """ExecSync found no such container (NOT_FOUND): not running, and still a ``CriNotFound`` for
    callers that ask about the container itself."""


class CriDeadlineExceeded(CriError):
    """The call did not finish within its deadline."""


class CriUnimplemented(CriError):
    """The runtime does not implement this CRI method (or CRI v1 at all)."""


_ERROR_BY_CODE: dict[grpc.StatusCode, type[CriError]] = {
    grpc.StatusCode.UNAVAILABLE: CriUnavailable,
    grpc.StatusCode.NOT_FOUND: CriNotFound,
    grpc.StatusCode.DEADLINE_EXCEEDED: CriDeadlineExceeded,
    grpc.StatusCode.UNIMPLEMENTED: CriUnimplemented,
}


def cri_error(method: str, code: grpc.StatusCode, details: str) -> CriError:
    """Build the most specific ``CriError`` for a gRPC status code."""
    return _ERROR_BY_CODE.get(code, CriError)(method, code, details)
