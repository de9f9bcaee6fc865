"""``ManifestsSource`` on temporary static pod directories holding the recorded web.yaml and
batch.yaml: the kubelet's naming, what is skipped, broken and duplicate files, re-reading only
changed files, and a directory that cannot be read."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import AsyncIterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from cri_prober.errors import ConfigError
from cri_prober.logs import REPEAT_LOG_SECONDS
from cri_prober.podspecs.manifests import ManifestsSource
from cri_prober.podspecs.model import PodOrigin
from cri_prober.probing.kinds import ProbeKind
from cri_prober.probing.spec import RULES_FILE_MAX_BYTES
from tests.support.clock import ManualClock

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kubelet-1.28.7"
# An mtime well in the past: a file this old is trusted unchanged while its stat is unchanged.
OLD = time.time_ns() - 3600 * 10**9

SOLO = """\
apiVersion: v1
kind: Pod
metadata: {name: solo}
spec:
  containers:
  - name: c
    image: busybox
    livenessProbe: {tcpSocket: {port: 80}}
"""


@pytest.fixture(name="clock")
def _clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(name="manifests")
def _manifests(tmp_path: Path) -> Path:
    directory = tmp_path / "manifests"
    directory.mkdir()
    for name in ("web.yaml", "batch.yaml"):
        shutil.copyfile(FIXTURES / name, directory / name)
        os.utime(directory / name, ns=(OLD, OLD))
    return directory


@pytest.fixture(name="source")
async def _source(manifests: Path, clock: ManualClock) -> AsyncIterator[ManifestsSource]:
    source = ManifestsSource(manifests, node_name="kd-node", interval=1.0, clock=clock)
    yield source
    await source.close()


def _write(path: Path, text: str, *, mtime_ns: int = OLD) -> None:
    path.write_text(text)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def _labels(source: ManifestsSource) -> dict[str, str]:
    return {key: spec.label for key, spec in source.pods.items()}


def _events(logs: list[MutableMapping[str, Any]], event: str) -> list[MutableMapping[str, Any]]:
    return [entry for entry in logs if entry["event"] == event]


async def test_static_pods_are_named_with_the_node_name(source: ManifestsSource) -> None:
    """web.yaml and batch.yaml become shop/web-kd-node and jobs/batch-kd-node, filed by name."""
    assert await source.poll() is True
    assert _labels(source) == {"shop/web": "shop/web-kd-node", "jobs/batch": "jobs/batch-kd-node"}
    web = source.pods["shop/web"]
    assert (web.uid, web.origin, web.source, web.phase) == ("", PodOrigin.MANIFEST, "manifests", "")
    assert web.containers["app"].ports == {"http": 8080}
    readiness = source.pods["jobs/batch"].containers["main"].probe(ProbeKind.READINESS)
    assert readiness is not None
    assert readiness.success_threshold == 2
    assert source.pods["jobs/batch"].init_containers == {"setup"}
    assert not source.stale()


async def test_namespace_defaults_and_json_manifests_are_read(
    source: ManifestsSource, manifests: Path
) -> None:
    """A manifest without a namespace lands in `default`; a JSON manifest reads like YAML."""
    _write(manifests / "solo.yaml", SOLO)
    _write(
        manifests / "other.json",
        '{"kind": "Pod", "metadata": {"name": "other", "namespace": "ops", "uid": "u-1"},'
        ' "spec": {"containers": [{"name": "c"}]}}',
    )
    assert await source.poll() is True
    labels = _labels(source)
    assert labels["default/solo"] == "default/solo-kd-node"
    assert labels["u-1"] == "ops/other-kd-node"  # a manifest's own uid is its key
    assert len(labels) == 4


async def test_removing_a_file_drops_its_pod(source: ManifestsSource, manifests: Path) -> None:
    """The next poll after web.yaml is deleted has no web pod."""
    assert await source.poll() is True
    (manifests / "web.yaml").unlink()
    assert await source.poll() is True
    assert _labels(source) == {"jobs/batch": "jobs/batch-kd-node"}


async def test_dotfiles_directories_and_dangling_links_are_skipped(
    source: ManifestsSource, manifests: Path, tmp_path: Path
) -> None:
    """As in the kubelet: no dotfiles, no recursion, links followed to regular files only."""
    _write(manifests / ".solo.yaml.swp", SOLO)
    (manifests / "..data").mkdir()
    _write(manifests / "..data" / "solo.yaml", SOLO)
    (manifests / "nested").mkdir()
    _write(manifests / "nested" / "solo.yaml", SOLO)
    (manifests / "gone.yaml").symlink_to(tmp_path / "nowhere.yaml")
    outside = tmp_path / "linked.yaml"
    _write(outside, SOLO.replace("name: solo", "name: linked"))
    (manifests / "linked.yaml").symlink_to(outside)
    with capture_logs() as logs:
        assert await source.poll() is True
    assert set(_labels(source).values()) == {
        "shop/web-kd-node",
        "jobs/batch-kd-node",
        "default/linked-kd-node",
    }
    assert logs == []


async def test_a_broken_file_is_logged_with_file_and_line_and_others_stay(
    source: ManifestsSource, manifests: Path, clock: ManualClock
) -> None:
    """A YAML error names the file, line and column; the other files' pods are read as usual."""
    broken = manifests / "broken.yaml"
    _write(broken, "kind: Pod\nmetadata:\n  name: x\n  name: y\n")
    with capture_logs() as logs:
        assert await source.poll() is True
        assert await source.poll() is False  # the same problem: not logged again so soon
    assert _events(logs, "pod_manifest_invalid") == [
        {
            "event": "pod_manifest_invalid",
            "log_level": "error",
            "source": "manifests",
            "file": str(broken),
            "error": f"{broken}: line 4, column 3: found duplicate key 'name'",
            "kept": "none",
        }
    ]
    assert set(_labels(source)) == {"shop/web", "jobs/batch"}
    assert source.last_error is None
    assert not source.stale()

    clock.now += REPEAT_LOG_SECONDS
    with capture_logs() as logs:
        await source.poll()
    assert len(_events(logs, "pod_manifest_invalid")) == 1  # still broken: said again, rarely


async def test_a_file_broken_after_a_good_read_keeps_its_pod_until_fixed(
    source: ManifestsSource, manifests: Path
) -> None:
    """A bad save keeps the last good manifest's pod; the fix is read and logged."""
    assert await source.poll() is True
    web = manifests / "web.yaml"
    good = web.read_text()
    _write(web, good.replace("periodSeconds: 5", "periodSeconds: [5"), mtime_ns=OLD + 1)
    with capture_logs() as logs:
        assert await source.poll() is False
    [invalid] = _events(logs, "pod_manifest_invalid")
    assert invalid["file"] == str(web)
    assert invalid["error"].startswith(f"{web}: line ")
    assert invalid["kept"] == "the last good manifest"
    assert "shop/web" in source.pods

    _write(web, good.replace("periodSeconds: 5", "periodSeconds: 6"), mtime_ns=OLD + 2)
    with capture_logs() as logs:
        assert await source.poll() is True
    assert [e["event"] for e in logs] == ["pod_manifest_valid_again"]
    liveness = source.pods["shop/web"].containers["app"].probe(ProbeKind.LIVENESS)
    assert liveness is not None
    assert liveness.period_seconds == 6


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("- a\n- b\n", "must be a Pod object"),
        (
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n",
            "kind: must be Pod, not 'Deployment' (one Pod per file)",
        ),
        ("kind: Pod\nmetadata: {namespace: x}\nspec: {}\n", "metadata.name: required"),
        ("x" * (RULES_FILE_MAX_BYTES + 1), "too large"),
    ],
    ids=["list", "deployment", "no-name", "too-large"],
)
async def test_a_file_that_is_not_a_pod_is_reported(
    source: ManifestsSource, manifests: Path, text: str, problem: str
) -> None:
    """Not an object, another kind, no name, or over the size limit: logged, naming the file."""
    odd = manifests / "odd.yaml"
    _write(odd, text)
    with capture_logs() as logs:
        assert await source.poll() is True
    [invalid] = _events(logs, "pod_manifest_invalid")
    assert invalid["file"] == str(odd)
    assert invalid["error"].startswith(f"{odd}: ")
    assert problem in invalid["error"]
    assert set(source.pods) == {"shop/web", "jobs/batch"}


async def test_a_pod_whose_probe_breaks_a_rule_is_left_out(
    source: ManifestsSource, manifests: Path
) -> None:
    """A well-formed manifest with an invalid probe is reported with its field path."""
    _write(manifests / "solo.yaml", SOLO.replace("port: 80", "port: 70000"))
    with capture_logs() as logs:
        assert await source.poll() is True
    [invalid] = _events(logs, "pod_spec_invalid")
    assert invalid["pod"] == "default/solo-kd-node"
    assert "spec.containers[0].livenessProbe.tcpSocket.port" in invalid["error"]
    assert set(source.pods) == {"shop/web", "jobs/batch"}
    assert source.invalid_pods == 1


async def test_two_files_for_one_pod_the_first_wins(
    source: ManifestsSource, manifests: Path
) -> None:
    """A second file declaring the same pod is ignored and reported once, as the kubelet does."""
    _write(manifests / "zweb.yaml", (manifests / "web.yaml").read_text().replace("20", "25"))
    with capture_logs() as logs:
        assert await source.poll() is True
        assert await source.poll() is False  # stable: the duplicate does not flap the view
    [duplicate] = _events(logs, "pod_manifest_duplicate")
    assert duplicate["file"] == str(manifests / "zweb.yaml")
    assert "same pod (shop/web) as web.yaml" in duplicate["error"]
    assert source.pods["shop/web"].termination_grace_seconds == 20


async def test_unchanged_files_are_not_read_again(source: ManifestsSource, manifests: Path) -> None:
    """Only a file whose size, mtime, ctime or inode moved is read on the next poll."""
    assert await source.poll() is True
    assert source.files_read == 2
    assert await source.poll() is False
    assert source.files_read == 2

    web = manifests / "web.yaml"
    _write(web, web.read_text().replace("periodSeconds: 5", "periodSeconds: 7"), mtime_ns=OLD + 1)
    assert await source.poll() is True
    assert source.files_read == 3

    replacement = manifests / "batch.new"
    _write(replacement, (manifests / "batch.yaml").read_text())
    replacement.replace(manifests / "batch.yaml")  # an atomic save: same content, new inode
    assert await source.poll() is False
    assert source.files_read == 4


async def test_a_just_written_file_is_read_until_its_mtime_settles(
    source: ManifestsSource, manifests: Path
) -> None:
    """A file modified moments ago may change again within the mtime's granularity: re-read."""
    now = time.time_ns()
    _write(manifests / "solo.yaml", SOLO, mtime_ns=now)
    assert await source.poll() is True
    assert await source.poll() is False
    assert source.files_read == 4  # web and batch once, solo twice
    os.utime(manifests / "solo.yaml", ns=(OLD, OLD))
    await source.poll()
    await source.poll()
    assert source.files_read == 5


async def test_an_unreadable_directory_is_a_failed_read_that_keeps_the_view(
    source: ManifestsSource, manifests: Path, tmp_path: Path, clock: ManualClock
) -> None:
    """A missing directory (or a file in its place) fails the read; the last view stays."""
    assert await source.poll() is True
    manifests.rename(tmp_path / "elsewhere")
    with capture_logs() as logs:
        assert await source.poll() is False
    assert [e["error"] for e in _events(logs, "pod_source_failed")] == [
        f"cannot read the static pod directory {manifests}: No such file or directory"
    ]
    assert set(source.pods) == {"shop/web", "jobs/batch"}
    clock.now += source.stale_after + 1
    assert source.stale()

    manifests.write_text("not a directory")
    with capture_logs() as logs:
        await source.poll()
    assert [e["error"] for e in _events(logs, "pod_source_failed")] == [
        f"cannot read the static pod directory {manifests}: Not a directory"
    ]

    manifests.unlink()
    (tmp_path / "elsewhere").rename(manifests)
    with capture_logs() as logs:
        assert await source.poll() is False
    assert [e["event"] for e in logs] == ["pod_source_recovered"]
    assert not source.stale()


async def test_a_missing_directory_at_start_is_stale_with_no_pods(
    tmp_path: Path, clock: ManualClock
) -> None:
    """No directory from the start: no pods, the failure logged, the view stale."""
    source = ManifestsSource(tmp_path / "absent", node_name="kd-node", clock=clock)
    with capture_logs() as logs:
        assert await source.poll() is False
    assert len(_events(logs, "pod_source_failed")) == 1
    assert dict(source.pods) == {}
    assert source.staleness() == (
        f"pod source manifests: no good read yet: cannot read the static pod directory "
        f"{tmp_path / 'absent'}: No such file or directory"
    )


class _CountingSource(ManifestsSource):
    """Sets ``polled`` after every poll, so a test can await the loop's progress."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, node_name="kd-node", interval=0.01)
        self.polls = 0
        self.polled = asyncio.Event()

    async def poll(self) -> bool:
        changed = await super().poll()
        self.polls += 1
        self.polled.set()
        return changed

    async def polls_done(self, count: int) -> None:
        while self.polls < count:
            self.polled.clear()
            await self.polled.wait()


async def test_run_calls_changed_only_on_real_changes(manifests: Path) -> None:
    """The loop reports the first view and a removal, not the unchanged polls between."""
    source = _CountingSource(manifests)
    views: list[set[str]] = []
    task = asyncio.create_task(source.run(lambda: views.append(set(source.pods))))
    try:
        await source.polls_done(3)
        assert views == [{"shop/web", "jobs/batch"}]
        (manifests / "web.yaml").unlink()
        await source.polls_done(source.polls + 3)
        assert views == [{"shop/web", "jobs/batch"}, {"jobs/batch"}]
        assert not task.done()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_a_node_name_is_required(tmp_path: Path) -> None:
    """Static pods are named after the node: without its name the source refuses to start."""
    with pytest.raises(ConfigError, match="needs the node's name"):
        ManifestsSource(tmp_path, node_name="")
    assert ManifestsSource(tmp_path, node_name="n", interval=3.0).stale_after == 15.0
