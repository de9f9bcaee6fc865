"""A pytest plugin that keeps a failing test from crashing the run: every failure is reported.

CPython 3.11 keeps ``ast``'s recursion counter in state shared by all threads (CPython
gh-106905): when two threads build syntax trees at once (pytest formatting a failure on the main
thread; a worker thread formatting a traceback, which 3.11 parses for its ``^^^`` marks; a
finalizer releasing the GIL mid-build), one of them gets ``SystemError: AST constructor recursion
depth mismatch``. pytest's traceback formatter does not expect it, so the first failing test on a
busy machine ended the whole run with INTERNALERROR and no summary. Two guards remove that path:

- a spurious mismatch in ``ast.parse`` is retried, and one that persists becomes the
  ``SyntaxError`` that pytest's and ``traceback``'s formatters already handle (they then show less
  source, never crash). Not a lock: threads that parse in a loop starved the main thread of it,
  and a run that hangs reports no more than one that crashes;
- should building a test's report fail all the same, the report is rebuilt with a plain-text
  traceback, so the test is still failed, named in ``-ra``'s summary and the run goes on.
"""

from __future__ import annotations

import ast
import functools
import traceback
from collections.abc import Callable, Generator
from typing import Any

import pytest

_MISMATCH = "recursion depth mismatch"
_RETRIES = 5


def _retrying(parse: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(parse)
    def guarded_parse(*args: Any, **kwargs: Any) -> Any:
        for _ in range(_RETRIES):
            try:
                return parse(*args, **kwargs)
            except SystemError as error:
                if _MISMATCH not in str(error):
                    raise
                last = error
        raise SyntaxError(f"ast.parse failed {_RETRIES} times: {last}") from last

    return guarded_parse


_guarded_parse: Callable[..., Any] | None = None


def installed() -> bool:
    """Whether ``ast.parse`` is the guarded one."""
    return _guarded_parse is not None and ast.parse is _guarded_parse


def install() -> None:
    """Guard ``ast.parse`` in this process (idempotent)."""
    global _guarded_parse
    if not installed():
        _guarded_parse = _retrying(ast.parse)
        ast.parse = _guarded_parse


install()


def _plain_longrepr(call: pytest.CallInfo[None], failure: BaseException) -> str:
    """The test's own exception as plain text, without the formatters that just failed."""
    lines = [f"(pytest could not format this failure: {failure!r}; the plain traceback follows)"]
    if call.excinfo is not None:
        try:
            lines.extend(traceback.format_exception(call.excinfo.value))
        except Exception:  # the plain formatter parses source too: keep at least the message
            lines.append(f"{call.excinfo.typename}: {call.excinfo.value}")
    return "\n".join(lines)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    try:
        return (yield)
    except Exception as failure:
        report = pytest.TestReport(
            nodeid=item.nodeid,
            location=item.location,
            keywords=dict.fromkeys(item.keywords, 1),
            outcome="failed",
            longrepr=_plain_longrepr(call, failure),
            when=call.when,  # type: ignore[arg-type]  # makereport never sees "collect"
            sections=[
                (f"Captured {key} {when}", text) for when, key, text in item._report_sections
            ],
            duration=call.duration,
            start=call.start,
            stop=call.stop,
            user_properties=item.user_properties,
        )
        return report
