"""Probe specs, the rules file and the override annotation follow the Kubernetes API's rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from cri_prober.probing.outcome import ProbeError
from cri_prober.probing.spec import (
    ANNOTATION_MAX_BYTES,
    RULES_FILE_MAX_BYTES,
    ContainerOverride,
    ExecAction,
    HTTPGetAction,
    Probe,
    ProbeKind,
    ResolvedProbe,
    Rule,
    RulesFile,
    SharedRuleProbes,
    SpecError,
    TCPSocketAction,
    load_rules,
    parse_annotation,
    parse_probe,
    read_rules_file,
    resolve_port,
    select_probes,
    yaml_loader,
)

LIVENESS, READINESS, STARTUP = ProbeKind.LIVENESS, ProbeKind.READINESS, ProbeKind.STARTUP
EXEC = {"exec": {"command": ["true"]}}


def messages_for(data: object, kind: ProbeKind) -> list[str]:
    """Parse *data* as a probe that must be rejected and return its messages."""
    with pytest.raises(SpecError) as caught:
        parse_probe(data, kind=kind, path=kind.field_name)
    return caught.value.messages


def http(port: object, **fields: object) -> dict[str, Any]:
    """An httpGet probe on *port* with extra httpGet fields."""
    return {"httpGet": {"port": port, **fields}}


# One row per validation rule of docs/kubelet-semantics.md §1: (kind, probe, the exact message).
REJECTED = [
    pytest.param(
        LIVENESS,
        {**EXEC, "initialDelaySeconds": -1},
        "livenessProbe.initialDelaySeconds: must be >= 0",
        id="initialDelaySeconds-negative",
    ),
    pytest.param(
        LIVENESS,
        {**EXEC, "timeoutSeconds": -1},
        "livenessProbe.timeoutSeconds: must be >= 0",
        id="timeoutSeconds-negative",
    ),
    pytest.param(
        READINESS,
        {**EXEC, "periodSeconds": -1},
        "readinessProbe.periodSeconds: must be >= 0",
        id="periodSeconds-negative",
    ),
    pytest.param(
        READINESS,
        {**EXEC, "successThreshold": -1},
        "readinessProbe.successThreshold: must be >= 0",
        id="successThreshold-negative",
    ),
    pytest.param(
        READINESS,
        {**EXEC, "failureThreshold": -1},
        "readinessProbe.failureThreshold: must be >= 0",
        id="failureThreshold-negative",
    ),
    pytest.param(
        READINESS,
        {**EXEC, "periodSeconds": 2**31},
        "readinessProbe.periodSeconds: must be <= 2147483647",
        id="int32-overflow",
    ),
    pytest.param(
        READINESS,
        {**EXEC, "periodSeconds": "10"},
        "readinessProbe.periodSeconds: must be an integer",
        id="int-field-given-a-string",
    ),
    pytest.param(
        READINESS,
        {**EXEC, "failureThreshold": True},
        "readinessProbe.failureThreshold: must be an integer",
        id="int-field-given-a-bool",
    ),
    pytest.param(
        LIVENESS,
        {**EXEC, "successThreshold": 2},
        "livenessProbe.successThreshold: must be 1",
        id="liveness-successThreshold-not-1",
    ),
    pytest.param(
        STARTUP,
        {**EXEC, "successThreshold": 3},
        "startupProbe.successThreshold: must be 1",
        id="startup-successThreshold-not-1",
    ),
    pytest.param(
        LIVENESS,
        {**EXEC, "terminationGracePeriodSeconds": 0},
        "livenessProbe.terminationGracePeriodSeconds: must be greater than 0",
        id="terminationGracePeriodSeconds-zero",
    ),
    pytest.param(
        STARTUP,
        {**EXEC, "terminationGracePeriodSeconds": -5},
        "startupProbe.terminationGracePeriodSeconds: must be greater than 0",
        id="terminationGracePeriodSeconds-negative",
    ),
    pytest.param(
        READINESS,
        {**EXEC, "terminationGracePeriodSeconds": 5},
        "readinessProbe.terminationGracePeriodSeconds: must not be set for readinessProbes",
        id="terminationGracePeriodSeconds-on-readiness",
    ),
    pytest.param(
        LIVENESS,
        {"periodSeconds": 5},
        "livenessProbe: must specify a handler type",
        id="no-handler",
    ),
    pytest.param(
        LIVENESS,
        {**EXEC, "tcpSocket": {"port": 80}},
        "livenessProbe.tcpSocket: may not specify more than 1 handler type",
        id="two-handlers",
    ),
    pytest.param(
        LIVENESS,
        {"exec": {"command": []}},
        "livenessProbe.exec.command: must not be empty",
        id="exec-command-empty",
    ),
    pytest.param(
        LIVENESS,
        {"exec": {}},
        "livenessProbe.exec.command: required",
        id="exec-command-missing",
    ),
    pytest.param(
        READINESS,
        http(80, scheme="http"),
        'readinessProbe.httpGet.scheme: must be one of "HTTP", "HTTPS" (got "http")',
        id="scheme-is-case-sensitive",
    ),
    pytest.param(
        READINESS,
        http(80, scheme="FTP"),
        'readinessProbe.httpGet.scheme: must be one of "HTTP", "HTTPS" (got "FTP")',
        id="scheme-unsupported",
    ),
    pytest.param(
        READINESS,
        http(0),
        "readinessProbe.httpGet.port: must be a valid port name or number 1-65535 (got 0)",
        id="port-number-zero",
    ),
    pytest.param(
        READINESS,
        http(65536),
        "readinessProbe.httpGet.port: must be a valid port name or number 1-65535 (got 65536)",
        id="port-number-too-big",
    ),
    pytest.param(
        READINESS,
        http("Http_80"),
        'readinessProbe.httpGet.port: must be a valid port name or number 1-65535 (got "Http_80")',
        id="port-name-bad-characters",
    ),
    pytest.param(
        READINESS,
        http("8080"),
        'readinessProbe.httpGet.port: must be a valid port name or number 1-65535 (got "8080")',
        id="port-name-without-a-letter",
    ),
    pytest.param(
        READINESS,
        http("abcdefghijklmnop"),
        "readinessProbe.httpGet.port: must be a valid port name or number 1-65535 "
        '(got "abcdefghijklmnop")',
        id="port-name-longer-than-15",
    ),
    pytest.param(
        READINESS,
        http("-http"),
        'readinessProbe.httpGet.port: must be a valid port name or number 1-65535 (got "-http")',
        id="port-name-leading-dash",
    ),
    pytest.param(
        READINESS,
        http("http-"),
        'readinessProbe.httpGet.port: must be a valid port name or number 1-65535 (got "http-")',
        id="port-name-trailing-dash",
    ),
    pytest.param(
        READINESS,
        http("my--http"),
        'readinessProbe.httpGet.port: must be a valid port name or number 1-65535 (got "my--http")',
        id="port-name-double-dash",
    ),
    pytest.param(
        READINESS,
        http(""),
        'readinessProbe.httpGet.port: must be a valid port name or number 1-65535 (got "")',
        id="port-name-empty",
    ),
    pytest.param(
        READINESS,
        {"httpGet": {"path": "/"}},
        "readinessProbe.httpGet.port: required",
        id="port-missing",
    ),
    pytest.param(
        READINESS,
        http(80, httpHeaders=[{"name": "X-Ok", "value": "1"}, {"name": "X_Bad", "value": "1"}]),
        "readinessProbe.httpGet.httpHeaders[1].name: must be a valid HTTP header name: "
        "letters, digits and '-' (got \"X_Bad\")",
        id="header-name-not-a-token",
    ),
    pytest.param(
        READINESS,
        http(80, httpHeaders=[{"name": "", "value": "1"}]),
        "readinessProbe.httpGet.httpHeaders[0].name: must be a valid HTTP header name: "
        "letters, digits and '-' (got \"\")",
        id="header-name-empty",
    ),
    pytest.param(
        STARTUP,
        {"tcpSocket": {"port": "HTTP"}},
        'startupProbe.tcpSocket.port: must be a valid port name or number 1-65535 (got "HTTP")',
        id="tcp-port-name-uppercase",
    ),
    pytest.param(
        LIVENESS,
        {"grpc": {"port": "grpc"}},
        "livenessProbe.grpc.port: must be a port number; gRPC probes take no port names "
        '(got "grpc")',
        id="grpc-port-name",
    ),
    pytest.param(
        LIVENESS,
        {"grpc": {"port": 0}},
        "livenessProbe.grpc.port: must be a port number 1-65535 (got 0)",
        id="grpc-port-zero",
    ),
]


@pytest.mark.parametrize(("kind", "data", "message"), REJECTED)
def test_each_validation_rule_rejects_with_path_and_rule(
    kind: ProbeKind, data: dict[str, Any], message: str
) -> None:
    """Each broken rule is one message naming the full field path and the rule."""
    assert messages_for(data, kind) == [message]


@pytest.mark.parametrize(
    ("kind", "data"),
    [
        pytest.param(LIVENESS, http(1), id="port-1"),
        pytest.param(LIVENESS, http(65535), id="port-65535"),
        pytest.param(LIVENESS, http("h2c-web1"), id="port-name"),
        pytest.param(LIVENESS, http("abcdefghijklmno"), id="port-name-15-chars"),
        pytest.param(LIVENESS, http(80, scheme="HTTPS"), id="scheme-HTTPS"),
        pytest.param(LIVENESS, http(80, httpHeaders=[{"name": "X-Trace-1"}]), id="header-token"),
        pytest.param(LIVENESS, {**EXEC, "terminationGracePeriodSeconds": 1}, id="tgps-liveness"),
        pytest.param(STARTUP, {**EXEC, "terminationGracePeriodSeconds": 2**40}, id="tgps-int64"),
        pytest.param(READINESS, {**EXEC, "successThreshold": 3}, id="readiness-success-3"),
        pytest.param(LIVENESS, {**EXEC, "timeoutSeconds": 30, "periodSeconds": 5}, id="t>p"),
        pytest.param(LIVENESS, {**EXEC, "periodSeconds": 2**31 - 1}, id="int32-max"),
        pytest.param(LIVENESS, {"grpc": {"port": 9090, "service": "x"}}, id="grpc"),
    ],
)
def test_boundary_values_are_accepted(kind: ProbeKind, data: dict[str, Any]) -> None:
    """Values at the edge of each rule are valid."""
    assert isinstance(parse_probe(data, kind=kind, path=kind.field_name), Probe)


def test_every_broken_rule_is_reported_at_once() -> None:
    """Several problems in one probe give one message each, not just the first."""
    data = {"periodSeconds": -1, "successThreshold": 2, "periodSecond": 3}
    assert sorted(messages_for(data, LIVENESS)) == [
        "livenessProbe.periodSecond: unknown field",
        "livenessProbe.periodSeconds: must be >= 0",
        "livenessProbe.successThreshold: must be 1",
        "livenessProbe: must specify a handler type",
    ]


def test_extra_handlers_are_reported_but_not_validated() -> None:
    """Like the API server, only the first handler (exec, httpGet, tcpSocket, grpc) is checked."""
    data = {"grpc": {"port": "bad"}, "httpGet": {"port": "Bad_Name"}, "exec": {"command": []}}
    assert messages_for(data, READINESS) == [
        "readinessProbe.exec.command: must not be empty",
        "readinessProbe.httpGet: may not specify more than 1 handler type",
        "readinessProbe.grpc: may not specify more than 1 handler type",
    ]


def test_kind_rules_apply_to_a_ready_made_probe() -> None:
    """A Probe built in Python is checked again for the type it is used as."""
    probe = Probe(exec=ExecAction(command=("true",)), successThreshold=2)
    assert parse_probe(probe, kind=READINESS, path="readinessProbe") == probe
    with pytest.raises(SpecError, match=r"livenessProbe\.successThreshold: must be 1"):
        parse_probe(probe, kind=LIVENESS, path="livenessProbe")
    with pytest.raises(ValidationError, match="must be 1"):
        Rule(startupProbe=probe)


def test_omitted_fields_get_the_api_defaults() -> None:
    """An unset field takes the API default of §1.1/§1.2."""
    probe = parse_probe(http(8080), kind=READINESS, path="readinessProbe")
    assert probe.http_get == HTTPGetAction(port=8080, path="/", scheme="HTTP", host="")
    assert (
        probe.initial_delay_seconds,
        probe.timeout_seconds,
        probe.period_seconds,
        probe.success_threshold,
        probe.failure_threshold,
        probe.termination_grace_period_seconds,
    ) == (0, 1, 10, 1, 3, None)


def test_zero_means_default() -> None:
    """An explicit 0 or "" is replaced by the default, never rejected."""
    data = {
        "httpGet": {"port": 80, "path": "", "scheme": ""},
        "initialDelaySeconds": 0,
        "timeoutSeconds": 0,
        "periodSeconds": 0,
        "successThreshold": 0,
        "failureThreshold": 0,
    }
    probe = parse_probe(data, kind=LIVENESS, path="livenessProbe")
    assert probe.http_get is not None
    assert (probe.http_get.path, probe.http_get.scheme) == ("/", "HTTP")
    assert (
        probe.initial_delay_seconds,
        probe.timeout_seconds,
        probe.period_seconds,
        probe.success_threshold,
        probe.failure_threshold,
    ) == (0, 1, 10, 1, 3)


def test_grpc_service_defaults_to_empty_and_null_means_unset() -> None:
    """A null is the same as leaving the key out, as in the API's JSON decoding."""
    probe = parse_probe(
        {"grpc": {"port": 9090, "service": None}, "httpGet": None, "periodSeconds": None},
        kind=LIVENESS,
        path="livenessProbe",
    )
    assert probe.grpc is not None
    assert (probe.grpc.service, probe.http_get, probe.period_seconds) == ("", None, 10)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(
            {**EXEC, "periodSecond": 10}, "livenessProbe.periodSecond: unknown field", id="typo"
        ),
        pytest.param(
            {**EXEC, "period_seconds": 10},
            "livenessProbe.period_seconds: unknown field",
            id="snake-case",
        ),
        pytest.param(
            {"httpGet": {"port": 80, "headers": []}},
            "livenessProbe.httpGet.headers: unknown field",
            id="nested",
        ),
        pytest.param(
            {**EXEC, "sleep": {"seconds": 1}},
            "livenessProbe.sleep: unknown field",
            id="lifecycle-only-handler",
        ),
    ],
)
def test_unknown_keys_are_errors(data: dict[str, Any], message: str) -> None:
    """A key the Probe does not have is reported by name instead of being ignored."""
    assert messages_for(data, LIVENESS) == [message]


def test_specs_differing_only_by_explicit_defaults_are_equal() -> None:
    """periodSeconds 0, 10 and omitted give equal, equally hashed probes."""
    probes = [
        parse_probe({**EXEC, **extra}, kind=LIVENESS, path="livenessProbe")
        for extra in ({"periodSeconds": 0}, {"periodSeconds": 10}, {})
    ]
    assert probes[0] == probes[1] == probes[2]
    assert len({*probes}) == 1
    changed = parse_probe({**EXEC, "periodSeconds": 11}, kind=LIVENESS, path="livenessProbe")
    assert changed != probes[0]
    assert changed not in {*probes}


def test_probes_are_immutable() -> None:
    """A parsed probe cannot be changed in place."""
    probe = parse_probe(EXEC, kind=LIVENESS, path="livenessProbe")
    with pytest.raises(ValidationError):
        probe.period_seconds = 5


def test_handler_is_the_one_set() -> None:
    """Probe.handler returns the single handler of the probe."""
    probe = parse_probe({"tcpSocket": {"port": "db"}}, kind=STARTUP, path="startupProbe")
    assert probe.handler == TCPSocketAction(port="db")


def test_messages_without_path_and_source() -> None:
    """With no path the message is just the field or the rule; the source leads every line."""
    with pytest.raises(SpecError) as caught:
        parse_probe({"periodSeconds": -1}, kind=LIVENESS, path="", source="probe.json")
    assert caught.value.messages == ["periodSeconds: must be >= 0", "must specify a handler type"]
    assert str(caught.value) == (
        "probe.json: periodSeconds: must be >= 0\nprobe.json: must specify a handler type"
    )


def test_non_object_probe_is_rejected() -> None:
    """A probe must be a mapping."""
    assert messages_for(["exec"], READINESS) == ["readinessProbe: must be an object"]


def test_probe_kind_field_names() -> None:
    """Each kind knows its key in a container spec."""
    assert [kind.field_name for kind in ProbeKind] == [
        "livenessProbe",
        "readinessProbe",
        "startupProbe",
    ]


# --- rules file -----------------------------------------------------------------------------

RULES = """\
probes:
  - match: {namespace: prod, pod: "web-*", container: app}
    ports: [{name: http, containerPort: 8080}]
    livenessProbe: {httpGet: {path: /healthz, port: http}}
  - match: {namespace: prod}
    ports: [{name: http, containerPort: 9090}]
    livenessProbe: {tcpSocket: {port: http}}
    readinessProbe: {httpGet: {path: /ready, port: http}}
  - startupProbe: {exec: {command: [cat, /tmp/started]}}
"""


def rejected_rules(text: str) -> SpecError:
    """Load *text* as a rules file that must be rejected."""
    with pytest.raises(SpecError) as caught:
        load_rules(text, source="rules.yaml")
    assert caught.value.source == "rules.yaml"
    return caught.value


def test_rules_file_loads() -> None:
    """A valid file gives its rules in order, with match defaults filled in."""
    rules = load_rules(RULES, source="rules.yaml")
    assert len(rules.probes) == 3
    assert rules.probes[0].named_ports == {"http": 8080}
    last = rules.probes[2].match
    assert (last.namespace, last.pod, last.container, last.labels) == ("*", "*", "*", {})


def test_empty_rule_list_is_valid() -> None:
    """`probes: []` is a file with no rules."""
    assert load_rules("probes: []\n", source="rules.yaml") == RulesFile(probes=())


def test_empty_file_is_rejected() -> None:
    """An empty document is not silently taken as "no probes"."""
    assert rejected_rules("").messages == ["must be an object"]


def test_yaml_syntax_error_names_line_and_column() -> None:
    """A YAML error gives the 1-based line and column and the source name."""
    error = rejected_rules("probes:\n  - livenessProbe: {exec: {command: [true]}\n  - x: [\n")
    assert len(error.messages) == 1
    assert error.messages[0].startswith("line 3, column 3: ")
    assert str(error).startswith("rules.yaml: line 3, column 3: ")


def test_duplicate_yaml_keys_are_rejected() -> None:
    """A repeated key is an error with its position, not a silent overwrite."""
    error = rejected_rules(
        "probes:\n  - livenessProbe:\n      exec: {command: [a]}\n      exec: {command: [b]}\n"
    )
    assert error.messages == ["line 4, column 7: found duplicate key 'exec'"]


def test_yaml_merge_keys_may_be_overridden() -> None:
    """Overriding a key brought in by `<<:` is not a duplicate."""
    text = (
        "base: &base {exec: {command: [a]}, periodSeconds: 5}\n"
        "probes: [{livenessProbe: {<<: *base, periodSeconds: 7}}]\n"
    )
    assert rejected_rules(text).messages == ["base: unknown field"]


def test_bad_nested_field_names_rule_index_and_path() -> None:
    """Errors deep in a rule carry probes[i] and the camelCase path."""
    error = rejected_rules(
        "probes:\n"
        "  - livenessProbe: {exec: {command: [a]}}\n"
        "  - readinessProbe: {httpGet: {port: Http_80}}\n"
        "    livenessProbe: {exec: {command: [a]}, periodSeconds: -1}\n"
    )
    assert error.lines == [
        "rules.yaml: probes[1].livenessProbe.periodSeconds: must be >= 0",
        "rules.yaml: probes[1].readinessProbe.httpGet.port: must be a valid port name or number"
        ' 1-65535 (got "Http_80")',
    ]


def test_rule_without_probes_is_rejected() -> None:
    """A rule must define at least one probe type."""
    error = rejected_rules("probes:\n  - livenessProbe: {exec: {command: [a]}}\n  - match: {}\n")
    assert error.messages == [
        "probes[1]: must define at least one of livenessProbe, readinessProbe, startupProbe"
    ]


@pytest.mark.parametrize(
    ("ports", "message"),
    [
        pytest.param(
            "[{name: http, containerPort: 80}, {name: http, containerPort: 81}]",
            'probes[0].ports[1].name: duplicate value "http"',
            id="duplicate-name",
        ),
        pytest.param(
            "[{name: HTTP, containerPort: 80}]",
            "probes[0].ports[0].name: must be a valid port name: 1-15 of [-a-z0-9], at least one"
            " letter, no leading, trailing or double '-' (got \"HTTP\")",
            id="bad-name",
        ),
        pytest.param(
            "[{name: http, containerPort: 0}]",
            "probes[0].ports[0].containerPort: must be a port number 1-65535 (got 0)",
            id="port-zero",
        ),
        pytest.param(
            "[{name: http, containerPort: 80, protocol: tcp}]",
            'probes[0].ports[0].protocol: must be one of "TCP", "UDP", "SCTP" (got "tcp")',
            id="bad-protocol",
        ),
        pytest.param(
            "[{name: http}]", "probes[0].ports[0].containerPort: required", id="missing-port"
        ),
    ],
)
def test_port_entries_are_validated(ports: str, message: str) -> None:
    """Named ports follow the container spec's rules and names are unique."""
    text = f"probes:\n  - ports: {ports}\n    livenessProbe: {{exec: {{command: [a]}}}}\n"
    assert rejected_rules(text).messages == [message]


def test_label_keys_with_dots_are_bracketed() -> None:
    """Map keys appear in brackets, as Kubernetes writes them."""
    text = (
        "probes:\n"
        "  - match: {labels: {app.kubernetes.io/name: 1}}\n"
        "    startupProbe: {grpc: {port: 1}}\n"
    )
    assert rejected_rules(text).messages == [
        "probes[0].match.labels[app.kubernetes.io/name]: must be a string"
    ]


def select(
    rules: RulesFile,
    *,
    namespace: str = "prod",
    pod: str = "web-1",
    container: str = "app",
    labels: dict[str, str] | None = None,
    pod_labels: dict[str, str] | None = None,
    override: ContainerOverride | None = None,
) -> dict[ProbeKind, ResolvedProbe]:
    """select_probes with defaults for the arguments a test does not care about."""
    return select_probes(
        rules,
        namespace=namespace,
        pod=pod,
        container=container,
        labels=labels or {},
        pod_labels=pod_labels or {},
        override=override,
    )


def test_containers_a_rule_matches_share_its_resolved_probes() -> None:
    """Thousands of containers matched by one rule keep one resolved probe (and one ports map)
    between them, not a copy each; an override is never taken for the rule's, and probes of
    reloaded rules are not taken for the old ones."""
    rules = load_rules(RULES, source="rules.yaml")
    shared: SharedRuleProbes = {}

    def pick(
        rules: RulesFile, pod: str, override: ContainerOverride | None = None
    ) -> dict[ProbeKind, ResolvedProbe]:
        return select_probes(
            rules, namespace="prod", pod=pod, container="app", labels={}, pod_labels={},
            override=override, shared=shared,
        )  # fmt: skip

    first, second = pick(rules, "web-1"), pick(rules, "web-2")
    assert first[LIVENESS] is second[LIVENESS]
    assert first[LIVENESS].ports is second[LIVENESS].ports
    assert first == select(rules, pod="web-1")
    override = ContainerOverride.model_validate({"livenessProbe": {"tcpSocket": {"port": 9}}})
    overridden = pick(rules, "web-3", override)
    assert overridden[LIVENESS].origin == "annotation"
    assert overridden[READINESS] is first[READINESS]
    reloaded = load_rules(RULES, source="rules.yaml")
    assert pick(reloaded, "web-1")[LIVENESS] is not first[LIVENESS]
    assert pick(reloaded, "web-1")[LIVENESS] == first[LIVENESS]


def test_first_matching_rule_wins_per_probe_type() -> None:
    """Each probe type comes from the first matching rule that defines it."""
    rules = load_rules(RULES, source="rules.yaml")
    selected = select(rules)
    assert (selected[LIVENESS].probe, selected[LIVENESS].ports) == (
        rules.probes[0].liveness_probe,
        {"http": 8080},
    )
    assert (selected[READINESS].probe, selected[READINESS].ports) == (
        rules.probes[1].readiness_probe,
        {"http": 9090},
    )
    assert (selected[STARTUP].probe, selected[STARTUP].ports) == (
        rules.probes[2].startup_probe,
        {},
    )


@pytest.mark.parametrize(
    ("pod", "container", "liveness_from"),
    [
        pytest.param("db-0", "app", 1, id="pod-glob-misses"),
        pytest.param("web-1", "sidecar", 1, id="container-misses"),
        pytest.param("WEB-1", "app", 1, id="globs-are-case-sensitive"),
        pytest.param("web-", "app", 0, id="star-matches-empty"),
    ],
)
def test_non_matching_rules_are_skipped(pod: str, container: str, liveness_from: int) -> None:
    """A rule whose globs do not match is passed over for the next one."""
    rules = load_rules(RULES, source="rules.yaml")
    selected = select(rules, pod=pod, container=container)
    assert selected[LIVENESS].probe == rules.probes[liveness_from].liveness_probe


def test_no_matching_rule_gives_no_probes() -> None:
    """A container in another namespace only gets the catch-all startup probe."""
    rules = load_rules(RULES, source="rules.yaml")
    assert set(select(rules, namespace="dev")) == {STARTUP}


LABEL_RULES = load_rules(
    "probes:\n"
    "  - match: {labels: {tier: web, team: a}}\n"
    "    readinessProbe: {tcpSocket: {port: 80}}\n",
    source="rules.yaml",
)


@pytest.mark.parametrize(
    ("labels", "pod_labels", "matched"),
    [
        pytest.param({"tier": "web", "team": "a"}, {}, True, id="container-labels"),
        pytest.param({}, {"tier": "web", "team": "a"}, True, id="pod-labels"),
        pytest.param({"tier": "web"}, {"team": "a"}, True, id="split-across-both"),
        pytest.param({"tier": "db", "team": "a"}, {"tier": "web"}, True, id="pod-value-equal"),
        pytest.param({"tier": "web"}, {}, False, id="one-pair-missing"),
        pytest.param({"tier": "web", "team": "b"}, {"team": "c"}, False, id="value-differs"),
    ],
)
def test_labels_match_container_or_pod_labels(
    labels: dict[str, str], pod_labels: dict[str, str], matched: bool
) -> None:
    """Every label pair must equal a container label or a pod label."""
    selected = select(LABEL_RULES, labels=labels, pod_labels=pod_labels)
    assert (READINESS in selected) is matched


def test_annotation_override_wins_per_probe_type() -> None:
    """The override replaces the file's probe for the types it defines, with its own ports."""
    rules = load_rules(RULES, source="rules.yaml")
    override = parse_annotation(
        '{"readinessProbe": {"tcpSocket": {"port": "admin"}},'
        ' "ports": [{"name": "admin", "containerPort": 7000}]}',
        source="pod prod/web-1 annotation probes.cri-prober.io/app",
    )
    selected = select(rules, override=override)
    assert selected[READINESS] == ResolvedProbe(
        probe=Probe(tcpSocket=TCPSocketAction(port="admin")), ports={"admin": 7000}
    )
    assert selected[LIVENESS].ports == {"http": 8080}
    assert selected[STARTUP].probe == rules.probes[2].startup_probe


def test_resolved_probes_compare_and_hash_by_value() -> None:
    """Equal probes with equal ports are one key; other ports make another."""
    probe = parse_probe(http("http"), kind=READINESS, path="readinessProbe")
    same = {ResolvedProbe(probe=probe, ports={"http": 80}), ResolvedProbe(probe, {"http": 80})}
    assert len(same) == 1
    assert ResolvedProbe(probe=probe, ports={"http": 81}) not in same


def test_override_applies_without_any_matching_rule() -> None:
    """An override works for a container no rule matches."""
    override = ContainerOverride(livenessProbe=Probe(exec=ExecAction(command=("true",))))
    assert set(select(RulesFile(probes=()), override=override)) == {LIVENESS}


def test_annotation_json_error_names_line_and_column() -> None:
    """Invalid JSON in the annotation is a SpecError with its position."""
    with pytest.raises(SpecError) as caught:
        parse_annotation('{\n  "livenessProbe": }', source="annotation")
    assert caught.value.lines == ["annotation: line 2, column 20: Expecting value"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        pytest.param("[]", "must be an object", id="not-an-object"),
        pytest.param(
            '{"ports": []}',
            "must define at least one of livenessProbe, readinessProbe, startupProbe",
            id="no-probe",
        ),
        pytest.param(
            '{"livenessProbe": {"exec": {"command": ["a"]}}, "livenessProbe": {}}',
            'duplicate key "livenessProbe"',
            id="duplicate-key",
        ),
        pytest.param(
            '{"livenessProbe": {"exec": {"command": ["a"]}, "successThreshold": 2}}',
            "livenessProbe.successThreshold: must be 1",
            id="kind-rule",
        ),
        pytest.param(
            '{"livenesProbe": {"exec": {"command": ["a"]}}, "startupProbe": {"grpc": {"port": 1}}}',
            "livenesProbe: unknown field",
            id="unknown-key",
        ),
    ],
)
def test_bad_annotation_values(value: str, message: str) -> None:
    """The annotation gets the same validation as a rule."""
    with pytest.raises(SpecError) as caught:
        parse_annotation(value, source="annotation")
    assert caught.value.messages == [message]


# --- bounded, YAML 1.2-style loading (issue 15) --------------------------------------------

PERIOD_RULE = "probes:\n  - livenessProbe:\n      exec: {command: [a]}\n      periodSeconds: %s\n"


def merge_bomb(levels: int) -> str:
    """Chained merge keys, each level four copies of the one before: 419 bytes at 11 levels."""
    lines = ["a0: &a0 {k: v}"]
    for level in range(1, levels + 1):
        refs = ", ".join([f"*a{level - 1}"] * 4)
        lines.append(f"a{level}: &a{level} {{<<: [{refs}]}}")
    return "\n".join([*lines, "probes: []", ""])


@pytest.mark.parametrize(
    "value", ["1:30", "0x10", "0o10", "0b10", "010", "1_000", "yes", "on", "Off", "2024-02-30"]
)
def test_yaml_1_1_numbers_and_booleans_are_strings_an_int_field_rejects(value: str) -> None:
    """What YAML 1.1 read as 90, 16, 8 or true is a string, named with its field and value."""
    assert rejected_rules(PERIOD_RULE % value).messages == [
        f'probes[0].livenessProbe.periodSeconds: must be an integer (got "{value}")'
    ]


@pytest.mark.parametrize(("value", "number"), [("30", 30), ("+30", 30), ("!!int 30", 30)])
def test_plain_decimal_integers_are_integers(value: str, number: int) -> None:
    """Decimal without leading zeros reads the same in every YAML version, tagged or not."""
    probe = load_rules(PERIOD_RULE % value, source="rules.yaml").probes[0].liveness_probe
    assert probe is not None
    assert probe.period_seconds == number


def test_words_yaml_1_1_read_as_booleans_or_dates_stay_strings() -> None:
    """`on`, `yes`, `off` in a command and a date-like pod glob keep their text."""
    rules = load_rules(
        "probes:\n"
        "  - match: {pod: 2024-02-30, container: on}\n"
        "    livenessProbe: {exec: {command: [test, -f, yes, no, off, 1:30, 0x10]}}\n",
        source="rules.yaml",
    )
    rule = rules.probes[0]
    assert (rule.match.pod, rule.match.container) == ("2024-02-30", "on")
    assert rule.liveness_probe is not None
    assert rule.liveness_probe.handler == ExecAction(
        command=("test", "-f", "yes", "no", "off", "1:30", "0x10")
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(
            "probes: !!python/object/apply:os.system [true]",
            "line 1, column 9: unsupported tag !!python/object/apply:os.system",
            id="python-object",
        ),
        pytest.param(
            "probes: [!!timestamp 2024-01-01]",
            "line 1, column 10: unsupported tag !!timestamp",
            id="timestamp",
        ),
        pytest.param("probes: !!int 0x10", 'line 1, column 9: not a valid !!int: "0x10"', id="int"),
        pytest.param(
            "probes: []\n---\nprobes: []\n",
            "line 2, column 1: expected a single document in the stream",
            id="two-documents",
        ),
        pytest.param(
            "probes: &a [*a]",
            "line 1, column 13: alias *a refers to a node that contains it",
            id="recursive-alias",
        ),
        pytest.param(
            "probes: " + "[" * 100,
            "line 1, column 72: nested too deeply (more than 64 levels)",
            id="deep",
        ),
        pytest.param(
            "a: {<<: [x]}\nprobes: []\n",
            "line 1, column 9: a merge key (<<) takes a mapping or a list of mappings",
            id="merge-a-scalar",
        ),
        pytest.param(
            "a: &a {x: 1}\nb: {<<: *a, <<: *a}\nprobes: []\n",
            "line 2, column 13: found duplicate key '<<'",
            id="two-merge-keys",
        ),
        pytest.param("a: {[x]: 1}", "line 1, column 5: a mapping key must be a scalar", id="key"),
    ],
)
def test_yaml_the_loader_refuses(text: str, message: str) -> None:
    """Each is one message with its line and column."""
    assert rejected_rules(text).messages == [message]


def test_anchors_and_merge_keys_within_the_budget_load() -> None:
    """A probe shared by 300 rules through an alias and a merge key costs ~6,000 nodes: fine."""
    rules = ["shared: &probe {exec: {command: [cat, /tmp/ready]}, periodSeconds: 5}", "probes:"]
    rules += [
        f"  - match: {{pod: web-{i}}}\n    readinessProbe: {{<<: *probe, periodSeconds: 7}}\n"
        f"    livenessProbe: *probe"
        for i in range(300)
    ]
    error = rejected_rules("\n".join(rules) + "\n")
    assert error.messages == ["shared: unknown field"]  # every rule itself was fine


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(merge_bomb(11), id="merge-keys"),
        pytest.param(
            "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n"
            + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9))
            + "probes: *a8\n",
            id="billion-laughs",
        ),
    ],
)
def test_alias_bombs_are_refused_at_the_alias_over_the_budget(text: str) -> None:
    """Aliases are charged their anchor's size as they come, and never expanded to count."""
    [message] = rejected_rules(text).messages
    assert message.endswith(
        ": aliases expand to more than 10000 nodes (each alias counts as a copy of its anchor)"
    )


# Peak RSS from VmHWM: ru_maxrss would include the parent's RSS (Linux keeps it across exec).
# Time is the process's CPU time, the work done: wall-clock time would also count whatever else
# the machine runs meanwhile.
BOMB_COST = """
import json, os, sys, time
from cri_prober.probing.spec import SpecError, load_rules

def rss(field="VmRSS"):
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024

data = open(sys.argv[1], "rb").read()
before, started = rss(), time.process_time()
try:
    load_rules(data, source="bomb.yaml")
    outcome = "loaded"
except SpecError as exc:
    outcome = str(exc)
cpu_seconds = time.process_time() - started
print(json.dumps({"outcome": outcome, "cpu_seconds": cpu_seconds, "growth": rss("VmHWM") - before}))
"""


def test_refusing_a_merge_key_bomb_takes_little_time_and_memory(tmp_path: Path) -> None:
    """Measured in a fresh process: its CPU time and peak RSS are what the bomb cost (before:
    7 s, +83 MB)."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(merge_bomb(11))
    assert bomb.stat().st_size == 419
    done = subprocess.run(
        [sys.executable, "-c", BOMB_COST, str(bomb)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    cost = json.loads(done.stdout)
    assert cost["cpu_seconds"] < 1.0, cost
    assert cost["growth"] < 50 * 1024 * 1024, cost
    assert "aliases expand to more than" in cost["outcome"]


@pytest.mark.parametrize(
    "text",
    [
        RULES,
        PERIOD_RULE % "1:30",
        merge_bomb(11),
        "base: &b {exec: {command: [a]}}\nprobes: [{livenessProbe: {<<: *b, periodSeconds: 7}}]",
        "probes: [\n",
        "probes: " + "[" * 100,
        "\ufeffprobes: [{livenessProbe: {exec: {command: [yes, 0x10]}}}]",
    ],
)
def test_without_libyaml_the_loader_reads_alike(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """PyYAML's pure-Python parser (no libyaml in the build) gives the same values and errors."""
    with_libyaml = outcome_of(lambda: load_rules(text, source="rules.yaml"))
    monkeypatch.setattr(yaml_loader, "_YAML_PARSER", yaml.BaseLoader)
    without = outcome_of(lambda: load_rules(text, source="rules.yaml"))
    if isinstance(with_libyaml, SpecError):
        assert isinstance(without, SpecError)
        # The two parsers word some syntax errors differently; the position is the same.
        assert [m.split(": ")[0] for m in without.messages] == [
            m.split(": ")[0] for m in with_libyaml.messages
        ]
    else:
        assert without == with_libyaml


def test_rules_over_the_size_cap_are_refused_unread() -> None:
    """The cap counts UTF-8 bytes; a file of exactly the cap is fine."""
    at_cap = "probes: []\n" + "#" * (RULES_FILE_MAX_BYTES - 12) + "\n"
    assert load_rules(at_cap.encode(), source="rules.yaml") == RulesFile(probes=())
    with pytest.raises(SpecError) as caught:
        load_rules((at_cap + "\n").encode(), source="rules.yaml")
    assert caught.value.messages == [
        f"too large: {RULES_FILE_MAX_BYTES + 1} bytes, the limit is {RULES_FILE_MAX_BYTES} bytes"
    ]
    # Text longer than the cap is refused without encoding it; "é" is two bytes in UTF-8.
    assert rejected_rules(at_cap + "\n").messages[0].startswith("too large: more than ")
    under_in_characters = "probes: []\n#" + "é" * (RULES_FILE_MAX_BYTES // 2)
    assert rejected_rules(under_in_characters).messages[0].startswith("too large: ")


def test_invalid_utf8_names_the_byte_and_its_line() -> None:
    """One message with the byte offset, as the file is not text at all."""
    data = b"probes:\n  - livenessProbe: {exec: {command: [caf\xe9]}}\n"
    with pytest.raises(SpecError) as caught:
        load_rules(data, source="rules.yaml")
    assert caught.value.lines == [
        f"rules.yaml: not valid UTF-8: byte {data.index(0xE9)} (line 2): invalid continuation byte"
    ]


def test_a_lone_surrogate_is_refused() -> None:
    """Text that cannot be UTF-8 (a lone surrogate) is refused like bytes that are not."""
    assert rejected_rules("probes: [\ud800]").messages == [
        "not valid Unicode: a lone surrogate at character 9"
    ]


def test_read_rules_file_refuses_a_fifo_at_once(tmp_path: Path) -> None:
    """A FIFO is never opened for a blocking read: nobody may ever write to it."""
    fifo = tmp_path / "rules.yaml"
    os.mkfifo(fifo)
    with pytest.raises(SpecError) as caught:
        read_rules_file(fifo)
    assert caught.value.lines == [f"{fifo}: not a regular file (a FIFO)"]


def test_read_rules_file_refuses_what_is_no_file(tmp_path: Path) -> None:
    """A directory or a missing path: one line each."""
    with pytest.raises(SpecError) as caught:
        read_rules_file(tmp_path)
    assert caught.value.messages == ["not a regular file (a directory)"]
    with pytest.raises(SpecError) as caught:
        read_rules_file(tmp_path / "nope.yaml")
    assert caught.value.messages == ["cannot read: No such file or directory"]


def test_read_rules_file_reads_no_more_than_the_limit(tmp_path: Path) -> None:
    """The size comes from fstat when it can; a file whose size says nothing (procfs) is read
    only up to the limit plus one byte."""
    rules = tmp_path / "rules.yaml"
    rules.write_bytes(b"x" * 17)
    assert read_rules_file(rules, limit=17) == b"x" * 17
    with pytest.raises(SpecError) as caught:
        read_rules_file(rules, limit=16)
    assert caught.value.messages == ["too large: 17 bytes, the limit is 16 bytes"]
    proc = Path("/proc/self/status")
    assert proc.stat().st_size == 0
    with pytest.raises(SpecError) as caught:
        read_rules_file(proc, limit=16)
    assert caught.value.messages == ["too large: more than 16 bytes, the limit is 16 bytes"]


def test_annotation_over_the_size_cap_is_refused_before_parsing() -> None:
    """The cap counts UTF-8 bytes, like the API server's limit on annotations."""
    valid = '{"livenessProbe": {"exec": {"command": ["a"]}}}'
    at_cap = valid + " " * (ANNOTATION_MAX_BYTES - len(valid))
    assert parse_annotation(at_cap, source="annotation").liveness_probe is not None
    with pytest.raises(SpecError) as caught:
        parse_annotation(at_cap + " ", source="annotation")
    assert caught.value.lines == [
        f"annotation: too large: more than {ANNOTATION_MAX_BYTES} bytes, the limit is"
        f" {ANNOTATION_MAX_BYTES} bytes"
    ]
    two_byte_characters = valid + " " * 10 + "é" * (ANNOTATION_MAX_BYTES // 2)
    with pytest.raises(SpecError) as caught:
        parse_annotation(two_byte_characters, source="annotation")
    size = len(two_byte_characters.encode())
    assert caught.value.messages == [f"too large: {size} bytes, the limit is 65536 bytes"]


# --- named ports ----------------------------------------------------------------------------

KUBELET_PORTS = json.dumps(
    [
        {"name": "metrics", "containerPort": 9100, "protocol": "TCP"},
        {"name": "http", "hostPort": 80, "containerPort": 8081, "protocol": "TCP"},
        {"name": "http", "containerPort": 8082, "protocol": "UDP"},
    ]
)


def test_numeric_port_is_used_as_is() -> None:
    """A port number needs no lookup."""
    assert resolve_port(8080, {}, None) == 8080


def test_named_port_resolves_from_rule_ports_first() -> None:
    """The rule's ports win over the kubelet's list."""
    assert resolve_port("http", {"http": 8080}, KUBELET_PORTS) == 8080


def test_named_port_resolves_from_kubelet_annotation() -> None:
    """A name not in the rule comes from the first kubelet port of that name (containerPort)."""
    assert resolve_port("http", {"admin": 7000}, KUBELET_PORTS) == 8081


@pytest.mark.parametrize(
    ("annotation", "message"),
    [
        pytest.param(None, 'port "grpc" not found', id="no-annotation"),
        pytest.param(KUBELET_PORTS, 'port "grpc" not found', id="not-in-annotation"),
        pytest.param("{oops", "is not valid JSON", id="malformed-annotation"),
    ],
)
def test_missing_named_port_is_a_probe_error(annotation: str | None, message: str) -> None:
    """An unknown name makes the probe error (discarded attempt), not fail."""
    with pytest.raises(ProbeError, match=message):
        resolve_port("grpc", {"http": 8080}, annotation)


def test_out_of_range_port_from_annotation_is_a_probe_error() -> None:
    """The kubelet checks the resolved number before probing."""
    annotation = json.dumps([{"name": "bad", "containerPort": 70000}])
    with pytest.raises(ProbeError, match="invalid port number: 70000"):
        resolve_port("bad", {}, annotation)


# --- robustness -----------------------------------------------------------------------------

KEYS = [
    "probes",
    "match",
    "labels",
    "ports",
    "name",
    "containerPort",
    "livenessProbe",
    "readinessProbe",
    "startupProbe",
    "exec",
    "command",
    "httpGet",
    "tcpSocket",
    "grpc",
    "port",
    "path",
    "scheme",
    "httpHeaders",
    "periodSeconds",
    "successThreshold",
    "terminationGracePeriodSeconds",
]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.sampled_from(["http", "HTTP", "Http_80", "true"]),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=30,
)


def outcome_of(parse: Callable[[], object]) -> object:
    """Call *parse*, returning a SpecError instead of raising it (anything else propagates)."""
    try:
        return parse()
    except SpecError as exc:
        return exc


@settings(deadline=None)
@given(data=json_values, kind=st.sampled_from(ProbeKind))
def test_parse_probe_raises_only_spec_errors(data: object, kind: ProbeKind) -> None:
    """Whatever the input, parse_probe returns a Probe or raises SpecError with messages."""
    result = outcome_of(lambda: parse_probe(data, kind=kind, path=kind.field_name))
    assert isinstance(result, Probe) or (isinstance(result, SpecError) and result.messages)


@settings(deadline=None)
@given(text=st.text() | json_values.map(lambda value: yaml.safe_dump({"probes": value})))
def test_load_rules_raises_only_spec_errors(text: str) -> None:
    """Whatever the text, load_rules returns a RulesFile or raises SpecError with messages."""
    result = outcome_of(lambda: load_rules(text, source="rules.yaml"))
    assert isinstance(result, RulesFile) or (isinstance(result, SpecError) and result.messages)


@settings(deadline=None)
@given(data=st.binary() | st.text().map(lambda text: text.encode("utf-8", "surrogatepass")))
def test_load_rules_from_bytes_raises_only_spec_errors(data: bytes) -> None:
    """Whatever the bytes (a file as read), load_rules returns a RulesFile or raises SpecError."""
    result = outcome_of(lambda: load_rules(data, source="rules.yaml"))
    assert isinstance(result, RulesFile) or (isinstance(result, SpecError) and result.messages)


@settings(deadline=None)
@given(value=st.text() | json_values.map(json.dumps))
def test_parse_annotation_raises_only_spec_errors(value: str) -> None:
    """Whatever the value, parse_annotation returns an override or raises SpecError."""
    result = outcome_of(lambda: parse_annotation(value, source="annotation"))
    assert isinstance(result, ContainerOverride) or (
        isinstance(result, SpecError) and result.messages
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(
            {"httpGet": {"port": 80, "protocol": "HTTP3"}},
            'livenessProbe.httpGet.protocol: must be one of "HTTP1", "HTTP2" (got "HTTP3")',
            id="protocol-value",
        ),
        pytest.param(
            {"grpc": {"port": 80, "mode": "tls"}},
            'livenessProbe.grpc.mode: must be one of "Plaintext", "TLS" (got "tls")',
            id="mode-value",
        ),
        pytest.param(
            {"httpGet": {"port": 80, "protocol": "HTTP2", "scheme": "HTTPS"}},
            "livenessProbe.httpGet: protocol: HTTP2 cannot be combined with scheme HTTPS",
            id="h2c-is-cleartext",
        ),
        pytest.param(
            {"grpc": {"port": 80, "foo": 1}}, "livenessProbe.grpc.foo: unknown field", id="invented"
        ),
    ],
)
def test_the_1_37_fields_in_rules_take_known_values_only(
    data: dict[str, Any], message: str
) -> None:
    """The rules file is cri-prober's own format: a value or key it does not know is an error
    (only a pod spec's probe is run as unsupported instead)."""
    assert messages_for(data, LIVENESS) == [message]


def test_the_1_37_fields_default_to_unset() -> None:
    http = parse_probe({"httpGet": {"port": 80}}, kind=LIVENESS, path="p").http_get
    grpc_action = parse_probe({"grpc": {"port": 80}}, kind=LIVENESS, path="p").grpc
    assert http is not None
    assert grpc_action is not None
    assert (http.protocol, grpc_action.mode) == (None, None)
    # Left out of a dump, as the API leaves an unset field out.
    assert "protocol" not in http.model_dump(by_alias=True, exclude_none=True)
    both = parse_probe(
        {"httpGet": {"port": 80, "protocol": "HTTP1"}}, kind=LIVENESS, path="p"
    ).http_get
    assert both is not None
    assert both.protocol == "HTTP1"
