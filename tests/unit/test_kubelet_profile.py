"""KubeletProfile: the release and feature gates cri-prober follows, and clear errors for flags."""

from __future__ import annotations

import pytest

from cri_prober.errors import ConfigError
from cri_prober.probing.kubelet_profile import GATES, KubeletProfile


@pytest.mark.parametrize(
    ("text", "minor"),
    [("1.28", 28), ("v1.33.2", 33), ("v1.33.2-eks-1", 33), ("1.37.0+k3s1", 37), (None, 37)],
)
def test_versions_parse_to_their_minor(text: str | None, minor: int) -> None:
    assert KubeletProfile.parse(text).minor == minor


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("1.27", "1.28 to 1.37"),
        ("1.38", "1.28 to 1.37"),
        ("2.1", "not a Kubernetes version"),
        ("latest", "not a Kubernetes version"),
    ],
)
def test_unsupported_versions_are_clear_errors(text: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        KubeletProfile.parse(text)


def test_gates_default_by_release_and_follow_the_operator_unless_locked() -> None:
    assert not KubeletProfile.parse("1.28").gate("SidecarContainers")
    assert KubeletProfile.parse("1.29").gate("SidecarContainers")
    assert not KubeletProfile.parse("1.36").gate("GRPCContainerProbeTLS")  # not there yet
    assert not KubeletProfile.parse("1.37").gate("GRPCContainerProbeTLS")  # alpha: off
    on = KubeletProfile.parse("1.37", "GRPCContainerProbeTLS=true, H2CContainerProbe=false")
    assert on.gate("GRPCContainerProbeTLS")
    assert not on.gate("H2CContainerProbe")
    assert on.describe() == "1.37 (GRPCContainerProbeTLS=true,H2CContainerProbe=false)"
    assert KubeletProfile.parse("1.34", "ExecProbeTimeout=false").gate("ExecProbeTimeout") is False
    assert KubeletProfile.parse("1.35").gate("ExecProbeTimeout")


@pytest.mark.parametrize(
    ("version", "gates", "error"),
    [
        ("1.37", "Nope=true", "not a gate that changes probing"),
        ("1.37", "GRPCContainerProbeTLS", "expected Name=true"),
        ("1.37", "GRPCContainerProbeTLS=yes", "expected Name=true"),
        ("1.36", "GRPCContainerProbeTLS=true", "has no such gate"),
        ("1.35", "ExecProbeTimeout=false", "locked to true"),
    ],
)
def test_bad_gates_are_clear_errors(version: str, gates: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        KubeletProfile.parse(version, gates)


def test_the_release_of_each_row() -> None:
    """docs/kubelet-fidelity.md, "Kubelet releases": the release each behaviour changed in."""
    rows = {
        "trigger_resets_ticker": 32,  # PR #119089
        "startup_holds_on_success": 32,  # PR #121206
        "keeps_status_on_restart": 35,  # KEP-4781, PR #134746
        "kept_status_needs_same_container": 37,  # PR #141487
    }
    for row, since in rows.items():
        for minor in range(28, 38):
            profile = KubeletProfile.parse(f"1.{minor}")
            assert getattr(profile, row) is (minor >= since), (row, minor)


def test_kep_4781_gate_restores_the_old_rule() -> None:
    profile = KubeletProfile.parse("1.37", "ChangeContainerStatusOnKubeletRestart=true")
    assert not profile.keeps_status_on_restart
    assert not profile.kept_status_needs_same_container
    with pytest.raises(ConfigError, match=r"kubelet 1\.34 has no such gate"):
        KubeletProfile.parse("1.34", "ChangeContainerStatusOnKubeletRestart=true")


def test_restart_rule_gates_by_release() -> None:
    assert not KubeletProfile.parse("1.34").gate("ContainerRestartRules")
    assert KubeletProfile.parse("1.35").gate("ContainerRestartRules")
    assert not KubeletProfile.parse("1.35").gate("RestartAllContainersOnContainerExits")
    assert KubeletProfile.parse("1.36").gate("RestartAllContainersOnContainerExits")


def test_effective_gates_lists_what_the_release_has() -> None:
    gates = KubeletProfile.parse("1.28").effective_gates()
    assert gates == {"ExecProbeTimeout": True, "SidecarContainers": False}
    newest = KubeletProfile.parse("1.37", "H2CContainerProbe=true").effective_gates()
    assert newest["H2CContainerProbe"] is True
    assert newest["ExecProbeTimeout"] is True
    assert set(newest) == set(GATES)
