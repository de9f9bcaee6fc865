"""``ManifestsSource``: static pod specs read from the kubelet's staticPodPath, one Pod per file,
polled; pods are named ``<metadata.name>-<node name>`` as the kubelet names them. Files are read
in a worker thread, and only when their size, mtime, ctime or inode changed since the last read."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from cri_prober.errors import ConfigError
from cri_prober.podspecs.model import PodOrigin, pod_key
from cri_prober.podspecs.source import ERROR_LOG_CHARS, LogOnce, PolledSource
from cri_prober.probing.spec import SpecError, load_yaml, read_rules_file

__all__ = ["ManifestsSource"]

# A file whose mtime was this close to the moment it was read may be written again within the
# filesystem's timestamp granularity (up to 2 s on some) without its (size, mtime) changing: such
# a file is read again on the next poll, until its mtime is safely in the past (git's "racy
# clean" rule).
_RACY_NS: Final = 3_000_000_000

# (size, mtime_ns, ctime_ns, inode): ctime too, so a chmod that makes an unreadable file readable
# gets it read again.
_StatKey = tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class _File:
    """What the last poll knew of one manifest file."""

    key: _StatKey
    settled: bool  # its mtime was old when read: an unchanged key means unchanged content
    obj: object  # the last good decoded pod object; None if the file never decoded
    error: str | None  # why the last read failed; None if it decoded


@dataclass(frozen=True, slots=True)
class _Scan:
    files: dict[str, _File]  # by file name, sorted
    reads: int


class ManifestsSource(PolledSource):
    """Static pods from the manifest files in one directory, polled every ``interval`` seconds.

    Like the kubelet, it does not recurse, skips names starting with ``.`` (editors' swap files,
    a ConfigMap mount's ``..data``) and anything that is not a regular file (symlinks are
    followed), and takes one Pod (YAML or JSON) per file.

    A file that fails to read or decode is logged (rate-limited) with its line and column, and
    its last good decoded object is kept, so the pod keeps its last good probes: an editor's
    half-written save or a typo must not stop the probes of a pod that is still running. A file
    that never decoded contributes no pod. Removing the file removes the pod.

    Two files declaring the same pod: the first by file name wins, as in the kubelet.

    Parameters:
        directory: the staticPodPath.
        node_name: the node's name, which the kubelet appends to each static pod's name.
        name: the source's name in logs, ``ps`` and health.
        interval: seconds between the end of one poll and the start of the next.
        stale_after: seconds without a good listing before the view is stale; default
            ``max(10, 5 * interval)``.
    """

    origin = PodOrigin.MANIFEST

    def __init__(
        self,
        directory: Path,
        *,
        node_name: str,
        name: str = "manifests",
        interval: float = 2.0,
        stale_after: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not node_name:
            raise ConfigError(
                f"static pod directory {directory}: needs the node's name (static pods are "
                "named <name>-<node name>)"
            )
        if interval <= 0:
            raise ConfigError("manifests source: interval must be positive")
        super().__init__(
            name, interval=interval, stale_after=stale_after, node_name=node_name, clock=clock
        )
        # This module's lines, with the source's name bound (the base class's: ``self.logger``).
        self.own_logger = structlog.get_logger(__name__, source=self.name)
        self.directory = directory
        self.files_read = 0  # manifest files read so far (unchanged files are not read again)
        self._files: dict[str, _File] = {}
        # Problems last logged, by file name: (text, clock time). Decoding errors and duplicates
        # apart, so a file that decodes but is a duplicate does not count as recovered.
        self._invalid_logged = LogOnce(self._clock)
        self._duplicate_logged = LogOnce(self._clock)

    async def poll(self) -> bool:
        """List and read the directory once; returns whether the view changed.

        A directory that cannot be listed is reported through ``failed()`` and leaves the view
        as it was. Only cancellation propagates.
        """
        try:
            scan = await asyncio.to_thread(_scan, self.directory, dict(self._files))
        except OSError as exc:
            self.failed(
                f"cannot read the static pod directory {self.directory}: {exc.strerror or exc}"
            )
            return False
        except Exception as exc:  # a bug here must not stop the polling: report it and go on
            self.own_logger.exception("pod_source_bug")
            self.failed(f"unexpected error reading {self.directory}: {exc!r}")
            return False
        self.files_read += scan.reads
        self._files = scan.files
        self._report(scan.files)
        try:
            changed = await self.apply_listing(self._unique_pods(scan.files))
        except Exception as exc:
            self.own_logger.exception("pod_source_bug")
            self.failed(f"unexpected error reading {self.directory}: {exc!r}")
            return False
        self.succeeded()
        return changed

    def _unique_pods(self, files: Mapping[str, _File]) -> list[object]:
        owners: dict[str, str] = {}
        pods: list[object] = []
        duplicates: set[str] = set()
        for file_name, entry in files.items():
            if entry.obj is None:
                continue
            key = pod_key(entry.obj)
            if key is None:  # _scan only keeps objects that have one
                continue
            owner = owners.setdefault(key, file_name)
            if owner != file_name:
                duplicates.add(file_name)
                self._log_file(
                    self._duplicate_logged,
                    file_name,
                    f"{self.directory / file_name}: declares the same pod ({key}) as "
                    f"{owner}, which is used instead",
                    event="pod_manifest_duplicate",
                )
                continue
            pods.append(entry.obj)
        self._duplicate_logged.keep_only(duplicates)
        return pods

    def _report(self, files: Mapping[str, _File]) -> None:
        self._invalid_logged.keep_only(files.keys())
        for file_name, entry in files.items():
            if entry.error is not None:
                self._log_file(
                    self._invalid_logged,
                    file_name,
                    entry.error,
                    event="pod_manifest_invalid",
                    kept="the last good manifest" if entry.obj is not None else "none",
                )
            elif self._invalid_logged.clear(file_name):
                self.own_logger.info(
                    "pod_manifest_valid_again",
                    file=str(self.directory / file_name),
                )

    def _log_file(
        self,
        logged: LogOnce,
        file_name: str,
        text: str,
        *,
        event: str,
        kept: str | None = None,
    ) -> None:
        """Log a file's problem when it appears or changes, then once per REPEAT_LOG_SECONDS."""
        text = text[:ERROR_LOG_CHARS]
        if not logged.should_log(file_name, text):
            return
        fields: dict[str, str] = {"file": str(self.directory / file_name), "error": text}
        if kept is not None:
            fields["kept"] = kept
        self.own_logger.error(event, **fields)


def _scan(directory: Path, known: Mapping[str, _File]) -> _Scan:
    """List *directory* and read its new or changed manifests (blocking: run in a thread).

    Raises:
        OSError: the directory cannot be listed.
    """
    files: dict[str, _File] = {}
    reads = 0
    for file_name in sorted(os.listdir(directory)):
        if file_name.startswith("."):
            continue
        path = directory / file_name
        now = time.time_ns()
        try:
            status = os.stat(path)
        except OSError:
            continue  # removed since the listing, or a dangling symlink: no pod
        if not stat.S_ISREG(status.st_mode):
            continue
        key = (status.st_size, status.st_mtime_ns, status.st_ctime_ns, status.st_ino)
        previous = known.get(file_name)
        if previous is not None and previous.key == key and previous.settled:
            files[file_name] = previous
            continue
        reads += 1
        settled = now - status.st_mtime_ns >= _RACY_NS
        kept = previous.obj if previous is not None else None
        try:
            obj = _decode(path)
        except SpecError as exc:
            if not path.exists():
                continue  # removed between the stat and the read
            files[file_name] = _File(key, settled, kept, "; ".join(exc.lines))
            continue
        files[file_name] = _File(key, settled, obj, None)
    return _Scan(files, reads)


def _decode(path: Path) -> object:
    """One manifest file as a pod object that has a key.

    Raises:
        SpecError: unreadable, too large, not YAML or JSON, or not a Pod.
    """
    source = str(path)
    obj = load_yaml(read_rules_file(path), source=source)
    if not isinstance(obj, Mapping):
        raise SpecError(["must be a Pod object"], source=source)
    kind = obj.get("kind")
    if kind is not None and kind != "Pod":
        raise SpecError([f"kind: must be Pod, not {kind!r} (one Pod per file)"], source=source)
    if pod_key(obj) is None:
        raise SpecError(["metadata.name: required"], source=source)
    return obj
