"""Probe specs as users write them: the Kubernetes core/v1 Probe with the API server's defaults and
validation (``model``), the ``--config`` rules file and the per-pod annotation override with the
pure functions that pick a container's probes and resolve named ports (``rules``), and the
bounded YAML loader that reads the rules file (``yaml_loader``).

This package re-exports their public names, so callers import from ``cri_prober.probing.spec``.
"""

from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.spec.model import (
    GRPC_MODES,
    HTTP_PROTOCOLS,
    ContainerPort,
    ExecAction,
    GRPCAction,
    HTTPGetAction,
    HTTPHeader,
    Probe,
    SpecError,
    TCPSocketAction,
    Unsupported,
    format_errors,
    parse_probe,
    parse_probe_json,
)
from cri_prober.probing.spec.rules import (
    ANNOTATION_MAX_BYTES,
    KUBELET_PORTS_ANNOTATION,
    PORTS_FROM,
    ContainerOverride,
    Match,
    ProbeOrigin,
    ProbeProvider,
    ResolvedProbe,
    Rule,
    RulesFile,
    SharedRuleProbes,
    load_rules,
    parse_annotation,
    resolve_port,
    select_probes,
)
from cri_prober.probing.spec.yaml_loader import (
    RULES_FILE_MAX_BYTES,
    YAML_ALIAS_BUDGET,
    YAML_MAX_DEPTH,
    load_yaml,
    read_rules_file,
)

__all__ = [
    "ANNOTATION_MAX_BYTES",
    "GRPC_MODES",
    "HTTP_PROTOCOLS",
    "KUBELET_PORTS_ANNOTATION",
    "PORTS_FROM",
    "RULES_FILE_MAX_BYTES",
    "YAML_ALIAS_BUDGET",
    "YAML_MAX_DEPTH",
    "ContainerOverride",
    "ContainerPort",
    "ExecAction",
    "GRPCAction",
    "HTTPGetAction",
    "HTTPHeader",
    "Match",
    "Probe",
    "ProbeKind",
    "ProbeOrigin",
    "ProbeProvider",
    "ResolvedProbe",
    "Rule",
    "RulesFile",
    "SharedRuleProbes",
    "SpecError",
    "TCPSocketAction",
    "Unsupported",
    "format_errors",
    "load_rules",
    "load_yaml",
    "parse_annotation",
    "parse_probe",
    "parse_probe_json",
    "read_rules_file",
    "resolve_port",
    "select_probes",
]
