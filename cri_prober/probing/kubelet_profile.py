"""The kubelet release (1.28 to 1.37) and feature gates whose probe behaviour cri-prober follows.

Every place where probing differs between kubelet releases asks a `KubeletProfile`: `at_least`
for a change that came with a release, `gate` for one behind a feature gate (its default at that
release, or the operator's setting unless the gate is locked there). docs/kubelet-fidelity.md
lists each difference with the release it changed in.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from cri_prober.errors import ConfigError

OLDEST_MINOR = 28
NEWEST_MINOR = 37
DEFAULT_MINOR = NEWEST_MINOR


@dataclasses.dataclass(frozen=True, slots=True)
class Gate:
    """A kubelet feature gate that changes probing: the minor release it first exists in, the
    one from which it is on by default (None: off in every supported release), and the one from
    which it is locked to its default (None: never locked in a supported release)."""

    since: int
    default_on_from: int | None = None
    locked_from: int | None = None


# The gates that change how a probe is run or counted. Only these may be set with
# --kubelet-feature-gates; any other name is refused, so a typo is never silently ignored.
GATES: Mapping[str, Gate] = {
    # exec probes honour timeoutSeconds (GA in 1.20, locked on from 1.35).
    "ExecProbeTimeout": Gate(since=20, default_on_from=20, locked_from=35),
    # restartPolicy: Always init containers (sidecars): beta, on by default, in 1.29; GA in 1.33.
    "SidecarContainers": Gate(since=28, default_on_from=29, locked_from=33),
    # grpc.mode: TLS (KEP-4939), alpha in 1.37.
    "GRPCContainerProbeTLS": Gate(since=37),
    # httpGet.protocol: HTTP2, h2c with prior knowledge (KEP-5999), alpha in 1.37.
    "H2CContainerProbe": Gate(since=37),
    # KEP-4781 (PR #134746, 1.35): deprecated and off by default, so a kubelet restart keeps its
    # pods' status; on, it goes back to publishing every probe's initial value after a restart.
    "ChangeContainerStatusOnKubeletRestart": Gate(since=35),
    # KEP-5307 (container restartPolicy and restartPolicyRules): alpha 1.34 (PR #132642), beta
    # and on by default in 1.35 (PR #134631, which also ends a worker whose container will not
    # be restarted by its own rules).
    "ContainerRestartRules": Gate(since=34, default_on_from=35),
    # KEP-5532 (the RestartAllContainers action): alpha 1.35 (PR #134345), beta in 1.36.
    "RestartAllContainersOnContainerExits": Gate(since=35, default_on_from=36),
}

# The releases in which probing changed without a gate (docs/kubelet-fidelity.md, "Kubelet
# releases"). PR #119089: a manual trigger resets the worker's ticker (worker.go, release-1.32).
TRIGGER_RESETS_TICKER_FROM = 32
# PR #121206: a startup result of either kind puts the startup worker on hold (worker.go,
# release-1.32); before, only a failure did.
STARTUP_HOLDS_ON_SUCCESS_FROM = 32
# KEP-4781, PR #134746: a container running since before the kubelet's start (less 10 s) keeps
# its state instead of getting its probes' initial values (worker.go, release-1.35).
KEEPS_STATUS_ON_RESTART_FROM = 35
# Kubernetes #140881: from #130487 (1.35) the probe workers ran on the pod sync's context, which
# the pod worker cancels at teardown, so every exec readiness probe errored (context canceled)
# during the grace period; 1.36.0 made a fresh context each sync, #140882 (1.37) detached the
# workers' context. Only the minor release counts: 1.36.3's regression (#140066, a cherry-pick
# of #139850) is not followed, as that change first shipped in 1.37, where it is fixed.
READINESS_EXEC_CANCELED_AT_TEARDOWN_IN = frozenset({35})
# PR #141487 (kubernetes #141473): only the container the previous status names keeps its state;
# a replacement made while the kubelet was away starts from the initial values (master, 1.37).
KEPT_STATUS_NEEDS_SAME_CONTAINER_FROM = 37

_VERSION = re.compile(r"^v?1\.(\d+)(?:\.\d+)?(?:[-+].*)?$")


@dataclasses.dataclass(frozen=True, slots=True)
class KubeletProfile:
    """A kubelet release by its minor version (1.``minor``) and the gates set explicitly."""

    minor: int = DEFAULT_MINOR
    gates: Mapping[str, bool] = dataclasses.field(default_factory=dict)

    def at_least(self, minor: int) -> bool:
        """Whether this kubelet is 1.``minor`` or newer."""
        return self.minor >= minor

    def gate(self, name: str) -> bool:
        """Whether gate ``name`` is on in this kubelet: off before the release that brought it,
        its default where it is locked, else the operator's setting or its default."""
        spec = GATES[name]
        if self.minor < spec.since:
            return False
        default = spec.default_on_from is not None and self.minor >= spec.default_on_from
        if spec.locked_from is not None and self.minor >= spec.locked_from:
            return default
        return self.gates.get(name, default)

    # -- the behaviours that changed between releases (docs/kubelet-fidelity.md) --------------

    @property
    def trigger_resets_ticker(self) -> bool:
        """A manual trigger (the readiness sync at a container's start) restarts the ticker
        from the triggered run (PR #119089, 1.32); before, the ticks kept their phase."""
        return self.at_least(TRIGGER_RESETS_TICKER_FROM)

    @property
    def startup_holds_on_success(self) -> bool:
        """A published startup success holds the startup worker (and zeroes its run), as a
        failure does (PR #121206, 1.32)."""
        return self.at_least(STARTUP_HOLDS_ON_SUCCESS_FROM)

    @property
    def keeps_status_on_restart(self) -> bool:
        """KEP-4781: a container that predates the kubelet's start keeps its started/ready
        (1.35, unless ChangeContainerStatusOnKubeletRestart is set)."""
        return self.at_least(KEEPS_STATUS_ON_RESTART_FROM) and not self.gate(
            "ChangeContainerStatusOnKubeletRestart"
        )

    @property
    def kept_status_needs_same_container(self) -> bool:
        """PR #141487: the state is kept only for the container the previous status named."""
        return self.keeps_status_on_restart and self.at_least(KEPT_STATUS_NEEDS_SAME_CONTAINER_FROM)

    @property
    def readiness_exec_canceled_at_teardown(self) -> bool:
        """Kubernetes #140881 (1.35): an exec readiness probe of a pod being torn down errors
        with ``context canceled`` and is not counted, so readiness keeps its last value."""
        return self.minor in READINESS_EXEC_CANCELED_AT_TEARDOWN_IN

    def effective_gates(self) -> dict[str, bool]:
        """Every gate of ``GATES`` this release has, with its value here."""
        return {name: self.gate(name) for name, spec in GATES.items() if self.minor >= spec.since}

    @property
    def version(self) -> str:
        return f"1.{self.minor}"

    @property
    def user_agent(self) -> str:
        """The probes' User-Agent: ``kube-probe/<major>.<minor>`` of the kubelet's own version
        (``pkg/probe/http/request.go`` ``userAgent``, every release; gRPC leads with it)."""
        return f"kube-probe/{self.version}"

    def describe(self) -> str:
        """``1.37`` and the gates set explicitly, for ``version``, ``inspect`` and the logs."""
        if not self.gates:
            return self.version
        settings = ",".join(f"{name}={str(on).lower()}" for name, on in sorted(self.gates.items()))
        return f"{self.version} ({settings})"

    @classmethod
    def parse(cls, version: str | None, gates: str | None = None) -> KubeletProfile:
        """A profile from ``--kubelet-version`` (``1.33``, ``v1.33.2``, ``v1.33.2-eks-1``; None:
        the newest supported) and ``--kubelet-feature-gates`` (``Name=true,Other=false``).
        ConfigError names the flag and the rule broken."""
        minor = DEFAULT_MINOR if version is None else parse_minor(version)
        return cls(minor=minor, gates=parse_gates(gates or "", minor))


def parse_minor(version: str) -> int:
    """The minor release of a kubelet version string; ConfigError outside 1.28 to 1.37."""
    match = _VERSION.match(version.strip())
    if match is None:
        raise ConfigError(
            f"--kubelet-version {version!r}: not a Kubernetes version "
            "(expected e.g. 1.33 or v1.33.2)"
        )
    minor = int(match.group(1))
    if not OLDEST_MINOR <= minor <= NEWEST_MINOR:
        raise ConfigError(
            f"--kubelet-version {version!r}: cri-prober follows kubelet 1.{OLDEST_MINOR} to "
            f"1.{NEWEST_MINOR}"
        )
    return minor


def parse_gates(text: str, minor: int) -> dict[str, bool]:
    """``Name=true,Other=false`` as a mapping; ConfigError for an unknown gate, a bad value, a
    gate that kubelet 1.``minor`` does not have, or one it has locked to another value."""
    gates: dict[str, bool] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or value.strip().lower() not in ("true", "false"):
            raise ConfigError(f"--kubelet-feature-gates {item!r}: expected Name=true or Name=false")
        if name not in GATES:
            known = ", ".join(sorted(GATES))
            raise ConfigError(
                f"--kubelet-feature-gates {name!r}: not a gate that changes probing "
                f"(known: {known})"
            )
        on = value.strip().lower() == "true"
        spec = GATES[name]
        if minor < spec.since:
            raise ConfigError(
                f"--kubelet-feature-gates {name}: kubelet 1.{minor} has no such gate "
                f"(it came in 1.{spec.since})"
            )
        if spec.locked_from is not None and minor >= spec.locked_from:
            locked = spec.default_on_from is not None and minor >= spec.default_on_from
            if on != locked:
                raise ConfigError(
                    f"--kubelet-feature-gates {name}={str(on).lower()}: locked to "
                    f"{str(locked).lower()} in kubelet 1.{minor}"
                )
        gates[name] = on
    return gates


__all__ = [
    "DEFAULT_MINOR",
    "GATES",
    "KEEPS_STATUS_ON_RESTART_FROM",
    "KEPT_STATUS_NEEDS_SAME_CONTAINER_FROM",
    "NEWEST_MINOR",
    "OLDEST_MINOR",
    "READINESS_EXEC_CANCELED_AT_TEARDOWN_IN",
    "STARTUP_HOLDS_ON_SUCCESS_FROM",
    "TRIGGER_RESETS_TICKER_FROM",
    "Gate",
    "KubeletProfile",
    "parse_gates",
    "parse_minor",
]
