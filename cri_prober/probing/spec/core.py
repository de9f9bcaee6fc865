"""The probe spec's pydantic-free core: what the manager, the prober, the daemon and the API use
at import time (the spec error, a chosen probe, picking a container's probes, resolving a named
port, the rule set), so that a ``serve`` with nothing to probe never loads pydantic.

The models that validate a probe (``model``, ``rules``) are imported when a rules file, an
annotation, a pod source or a one-off probe needs one; ``cri_prober.probing.spec`` re-exports
both (issue 36, idle RSS: pydantic and the models' classes cost about 10 MiB).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Literal, Protocol

from cri_prober.probing import outcome
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.spec.common import _MAX_PORT, _show
from cri_prober.probing.spec.yaml_loader import load_yaml

if TYPE_CHECKING:
    from cri_prober.probing.spec.model import Probe
    from cri_prober.probing.spec.rules import ContainerOverride, Rule

__all__ = [
    "KUBELET_PORTS_ANNOTATION",
    "PORTS_FROM",
    "ProbeOrigin",
    "ProbeProvider",
    "ResolvedProbe",
    "RulesFile",
    "SharedRuleProbes",
    "load_rules",
    "resolve_port",
    "select_probes",
]

# The container annotation in which the kubelet records the container's `ports` as a JSON array.
KUBELET_PORTS_ANNOTATION: Final = "io.kubernetes.container.ports"


@dataclass(frozen=True, slots=True)
class RulesFile:
    """The ``--config`` file: rules tried in order (``load_rules`` validates one).

    A plain value rather than a model, so that serve without a rules file (``RulesFile(probes=())``)
    does not load the models; its rules are (``rules.Rule``).
    """

    probes: tuple[Rule, ...]


# Who wrote a probe: the rules file (the node's operator; also RunProbe and `check`, whose
# callers are root on the node), a pod annotation (any pod author), or the pod's own spec (the
# probes the kubelet itself runs, so they get the rules file's trust: see serve --probes-from).
ProbeOrigin = Literal["rules", "annotation", "pod-spec"]


class ProbeProvider(Protocol):
    """Anything that may define a container's probes: a rule, an override, a pod spec's
    container."""

    def probe(self, kind: ProbeKind) -> Probe | None: ...

    @property
    def named_ports(self) -> Mapping[str, int]: ...


@dataclass(frozen=True, slots=True)
class ResolvedProbe:
    """A probe chosen for a container, with the named ports of the rule or override it came from.

    ``origin`` says who wrote it: the node's operator (``"rules"``) or the pod's author
    (``"annotation"``); the prober holds annotation probes to a stricter policy (serve
    ``--annotations``, ``--annotation-probe-hosts``). It is not part of equality: the manager
    compares it on its own.
    """

    probe: Probe
    ports: Mapping[str, int]
    origin: ProbeOrigin = field(default="rules", compare=False)
    # For a pod spec's probe: the container's static env, which its $(VAR) expansion uses
    # instead of the runtime's view of the environment.
    env: Mapping[str, str] | None = None
    # Where it came from, for `ps`/`inspect`: the rules file, the annotation's name, the source.
    source: str = field(default="", compare=False)

    def __hash__(self) -> int:
        # Explicit because the ports mapping is not hashable itself.
        return hash((self.probe, frozenset(self.ports.items())))


# Rules' resolved probes by (id of the rule, kind), with the rule itself to tell a reused ID.
SharedRuleProbes = dict[tuple[int, ProbeKind], tuple["ProbeProvider", ResolvedProbe]]


def select_probes(
    rules: RulesFile,
    *,
    namespace: str,
    pod: str,
    container: str,
    labels: Mapping[str, str],
    pod_labels: Mapping[str, str],
    override: ContainerOverride | None,
    pod_spec: ProbeProvider | None = None,
    pod_env: Mapping[str, str] | None = None,
    sources_named: Mapping[ProbeOrigin, str] | None = None,
    shared: SharedRuleProbes | None = None,
) -> dict[ProbeKind, ResolvedProbe]:
    """Pick a container's probes: per type, the override's, else the pod spec's, else the first
    matching rule's.

    ``pod_env`` is the pod spec container's static env (for its probes' $(VAR) expansion);
    ``sources_named`` says where each origin's probes came from, for display. ``shared``: the
    rules' probes resolved so far (for the same ``sources_named``), which every container a rule
    matches shares instead of keeping its own copy and its own ports map.
    """
    sources: list[tuple[ProbeProvider, ProbeOrigin]] = (
        [] if override is None else [(override, "annotation")]
    )
    if pod_spec is not None:
        sources.append((pod_spec, "pod-spec"))
    sources += [
        (rule, "rules")
        for rule in rules.probes
        if rule.match.matches(
            namespace=namespace,
            pod=pod,
            container=container,
            labels=labels,
            pod_labels=pod_labels,
        )
    ]
    selected: dict[ProbeKind, ResolvedProbe] = {}
    for kind in ProbeKind:
        for source, origin in sources:
            probe = source.probe(kind)
            if probe is None:
                continue
            keep = shared if origin == "rules" else None
            kept = None if keep is None else keep.get((id(source), kind))
            if kept is not None and kept[0] is source:
                selected[kind] = kept[1]
                break
            selected[kind] = ResolvedProbe(
                probe=probe,
                ports=source.named_ports,
                origin=origin,
                env=pod_env if origin == "pod-spec" else None,
                source=(sources_named or {}).get(origin, ""),
            )
            if keep is not None:
                keep[(id(source), kind)] = (source, selected[kind])
            break
    return selected


# Where a probe's own named ports came from, by its origin: said when a name is not found.
PORTS_FROM: Final[Mapping[str, str]] = {
    "rules": "the rule's ports",
    "annotation": "the annotation's ports",
    "pod-spec": "the pod spec's container ports",
}


def resolve_port(
    port: int | str,
    ports: Mapping[str, int],
    kubelet_ports_annotation: str | None,
    *,
    ports_from: str = PORTS_FROM["rules"],
) -> int:
    """Turn a probe's port into a number, looking a name up in *ports*, then the kubelet's list.

    *ports_from* says where *ports* came from (``PORTS_FROM``), for the message when the name is
    in neither; "" when the caller has no named ports of its own (a lifecycle hook).

    Raises:
        outcome.ProbeError: the name is nowhere to be found, or the number is out of range. Like
            the kubelet's, the probe attempt then errors (and is discarded); it does not fail.
    """
    number = port if isinstance(port, int) else ports.get(port)
    if number is None:
        number = _kubelet_port(str(port), kubelet_ports_annotation, ports_from)
    if not 1 <= number <= _MAX_PORT:
        raise outcome.ProbeError(f"invalid port number: {number}")
    return number


def _kubelet_port(name: str, annotation: str | None, ports_from: str) -> int:
    entries: object = []
    if annotation is not None:
        try:
            entries = json.loads(annotation)
        except (ValueError, RecursionError) as exc:
            raise outcome.ProbeError(
                f"cannot look up port {_show(name)}: "
                f"annotation {KUBELET_PORTS_ANNOTATION} is not valid JSON: {exc}"
            ) from exc
    for entry in entries if isinstance(entries, list) else []:
        # The kubelet takes the first port of that name (its containerPort, not a hostPort).
        if isinstance(entry, dict) and entry.get("name") == name:
            number = entry.get("containerPort")
            if isinstance(number, int) and not isinstance(number, bool):
                return number
    # Say where the names were looked for: the probe's own ports (a rule's, an annotation's or
    # the pod spec's container's), then the kubelet's list on the CRI container, if it has one.
    kubelet = f"the kubelet's {KUBELET_PORTS_ANNOTATION} annotation"
    if annotation is None:
        kubelet += " (the container has none)"
    where = f"{ports_from} or {kubelet}" if ports_from else kubelet
    raise outcome.ProbeError(f"port {_show(name)} not found in {where}")


def load_rules(text: str | bytes, *, source: str) -> RulesFile:
    """Parse a YAML rules file: *text*, at most RULES_FILE_MAX_BYTES of UTF-8, from *source*.

    *source* names the file in messages. The YAML is read within YAML_ALIAS_BUDGET and
    YAML_MAX_DEPTH, its scalars resolved as described at yaml_loader._YAML_NULLS, duplicate keys
    rejected; the rules are validated by ``rules.parse_rules`` (imported here, and pydantic
    with it: a serve without a rules file never needs them).

    Raises:
        SpecError: too large, not UTF-8, a YAML error (with line and column), or broken rules.
    """
    from cri_prober.probing.spec.rules import parse_rules

    return RulesFile(probes=parse_rules(load_yaml(text, source=source), source=source))
