"""The suite always reports: a failure pytest cannot format is still a named failure, and
CPython 3.11's ``ast`` race (gh-106905) cannot reach pytest's formatter at all."""

from __future__ import annotations

import ast
import gc
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.support import report_guard

REPO = Path(__file__).resolve().parents[2]

PLANTED = textwrap.dedent(
    """
    import ast

    def test_planted_failure(monkeypatch):
        def racing_parse(*args, **kwargs):
            # What CPython 3.11 raises when another thread builds a syntax tree at the same time.
            raise SystemError("AST constructor recursion depth mismatch (before=18, after=-15)")

        monkeypatch.setattr(ast, "parse", racing_parse)
        assert 1 == 2, "planted"

    def test_after_it():
        pass
    """
)


def run_planted(tmp_path: Path, *plugin_args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_planted.py").write_text(PLANTED)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-ra", *plugin_args],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only
        check=False,
    )


def test_without_the_guard_a_failure_pytest_cannot_format_crashes_the_run(tmp_path: Path) -> None:
    """The failure mode itself, so that the next test shows the guard is what removes it."""
    result = run_planted(tmp_path)
    assert "INTERNALERROR" in result.stdout + result.stderr
    assert "test_after_it" not in result.stdout


def test_a_failure_pytest_cannot_format_is_named_and_the_run_goes_on(tmp_path: Path) -> None:
    result = run_planted(tmp_path, "-p", "tests.support.report_guard")
    output = result.stdout + result.stderr
    assert "INTERNALERROR" not in output
    assert result.returncode == 1
    assert "FAILED test_planted.py::test_planted_failure" in result.stdout
    assert "AssertionError: planted" in result.stdout
    assert "1 failed, 1 passed" in result.stdout


def test_spurious_mismatches_are_retried_and_a_persistent_one_is_a_syntax_error() -> None:
    calls: list[int] = []

    def flaky(source: str) -> str:
        calls.append(1)
        if len(calls) < 3:
            raise SystemError("AST constructor recursion depth mismatch (before=1, after=2)")
        return source

    assert report_guard._retrying(flaky)("x") == "x"
    assert len(calls) == 3

    def always(source: str) -> str:
        raise SystemError("AST constructor recursion depth mismatch (before=1, after=2)")

    with pytest.raises(SyntaxError, match="recursion depth mismatch"):
        report_guard._retrying(always)("x")

    def other(source: str) -> str:
        raise SystemError("something else")

    with pytest.raises(SystemError, match="something else"):
        report_guard._retrying(other)("x")


class _ReleasesTheGil:
    """Cyclic garbage whose finalizer lets another thread run in the middle of a parse."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        time.sleep(0)


def test_the_guarded_parse_survives_threads_racing_it() -> None:
    """The race that crashed the run, with the guard in place: no thread sees a SystemError (at
    worst, a mismatch that persists is the SyntaxError the formatters handle)."""
    assert report_guard.installed()
    source = ("x = (" + "a+" * 30 + "a)\n") * 10
    errors: list[str] = []

    def parse_with_garbage() -> None:
        for _ in range(500):
            for _ in range(5):
                _ReleasesTheGil()
            try:
                ast.parse(source)
            except SyntaxError:
                pass
            except SystemError as error:
                errors.append(str(error))
                return

    thresholds = gc.get_threshold()
    gc.set_threshold(50, 1, 1)
    try:
        threads = [threading.Thread(target=parse_with_garbage) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        gc.set_threshold(*thresholds)
    assert errors == []
