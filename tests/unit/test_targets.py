"""Container names (ID, prefix, namespace/pod/container) and one-off probe specs."""

from __future__ import annotations

import pytest

from cri_prober.discovery.naming import (
    AmbiguousTarget,
    ContainerRef,
    InvalidTarget,
    TargetNotFound,
    find_container,
    newest_attempts,
)
from cri_prober.probing.kinds import ProbeKind, parse_kind
from cri_prober.probing.spec import SpecError, parse_probe_json


def ref(
    container_id: str,
    *,
    name: str = "app",
    pod: str = "web-0",
    uid: str = "uid-1",
    attempt: int = 0,
    created_at: int = 1,
    pod_created_at: int = 1,
) -> ContainerRef:
    return ContainerRef(
        id=container_id,
        name=name,
        attempt=attempt,
        created_at=created_at,
        pod_name=pod,
        pod_namespace="default",
        pod_uid=uid,
        pod_sandbox_id=f"sandbox-{uid}",
        pod_created_at=pod_created_at,
    )


REFS = [
    ref("abc111", attempt=0, created_at=1),
    ref("abc222", attempt=1, created_at=2),  # the restarted app of web-0
    ref("def333", name="sidecar"),
    ref("fed444", uid="uid-2", pod_created_at=5),  # web-0 recreated: a newer pod, same name
]


class TestFindContainer:
    def test_full_id_wins_over_prefixes(self) -> None:
        """An exact ID picks that container even when it prefixes another."""
        refs = [ref("abc"), ref("abcd", name="other")]
        assert find_container("abc", refs).id == "abc"

    def test_unique_prefix(self) -> None:
        """A prefix of exactly one ID picks that container."""
        assert find_container("def", REFS).id == "def333"

    def test_ambiguous_prefix_names_the_candidates(self) -> None:
        """A prefix of several IDs is ambiguous, and the message lists them."""
        with pytest.raises(AmbiguousTarget, match=r"matches 2 containers: abc111 .*abc222"):
            find_container("abc", REFS)

    def test_name_picks_newest_pod_then_newest_attempt(self) -> None:
        """namespace/pod/container is the newest attempt in the newest pod of that name."""
        assert find_container("default/web-0/app", REFS).id == "fed444"
        older_pod_only = REFS[:3]
        assert find_container("default/web-0/app", older_pod_only).id == "abc222"

    @pytest.mark.parametrize("target", ["nope", "default/web-0/db", "kube-system/web-0/app"])
    def test_not_found(self, target: str) -> None:
        """Names that match nothing are not found."""
        with pytest.raises(TargetNotFound):
            find_container(target, REFS)

    @pytest.mark.parametrize("target", ["", "default/web-0", "a/b/c/d", "default//app"])
    def test_invalid(self, target: str) -> None:
        """Empty names and the wrong number of parts are not container names."""
        with pytest.raises(InvalidTarget):
            find_container(target, REFS)


def test_newest_attempts_follow_the_manager_keys() -> None:
    """One container per (pod UID, name): the highest attempt."""
    assert sorted(r.id for r in newest_attempts(REFS)) == ["abc222", "def333", "fed444"]


class TestProbeJson:
    def test_valid_probe_gets_defaults(self) -> None:
        """A bare core/v1 Probe is validated and defaulted like a configured one."""
        probe = parse_probe_json('{"exec": {"command": ["true"]}}', ProbeKind.LIVENESS, source="x")
        assert (probe.period_seconds, probe.timeout_seconds, probe.failure_threshold) == (10, 1, 3)

    def test_errors_name_the_field_path(self) -> None:
        """Every broken rule is reported with its path inside the object."""
        with pytest.raises(SpecError) as error:
            parse_probe_json(
                '{"httpGet": {"port": 0}, "successThreshold": 2}',
                ProbeKind.LIVENESS,
                source="--probe",
            )
        assert error.value.lines == [
            "--probe: httpGet.port: must be a valid port name or number 1-65535 (got 0)",
            "--probe: successThreshold: must be 1",
        ]

    def test_kind_decides_the_rules(self) -> None:
        """A readiness probe may need several successes; a liveness probe may not."""
        text = '{"exec": {"command": ["true"]}, "successThreshold": 2}'
        assert parse_probe_json(text, ProbeKind.READINESS, source="x").success_threshold == 2

    def test_not_json(self) -> None:
        """Text that is not JSON says where it breaks."""
        with pytest.raises(SpecError, match="not valid JSON: line 1, column 2"):
            parse_probe_json("{nope", ProbeKind.LIVENESS, source="x")


def test_parse_kind() -> None:
    """Kinds are the lowercase names; anything else lists the choices."""
    assert parse_kind("startup") is ProbeKind.STARTUP
    with pytest.raises(ValueError, match="liveness, readiness, startup"):
        parse_kind("Liveness")
