"""Tenant text made safe for a terminal: the one sanitizer every human-readable renderer (the
client's tables and summaries, its stderr, the console log renderer) applies to what it prints,
and the escaping that keeps ``-o json`` exact while printing no control character either.

Probe output and pod-spec strings are data: a terminal must never act on them (kubectl escapes
them since 1.26, CVE-2021-25743). What the renderers show instead is visible and says which
character it was; machine output keeps the exact text as JSON escapes.
"""

from __future__ import annotations

import re
from typing import Final

# Characters a terminal may act on or that reorder what it shows, none of which may reach it raw:
# C0 controls (ESC starts every escape sequence, BEL ends an OSC, CR overwrites a line), DEL,
# C1 controls (U+009B is CSI in terminals that take C1 in UTF-8), the bidirectional embeddings,
# overrides and isolates of Trojan Source (CVE-2021-42574), and lone surrogates (from a JSON
# escape or surrogateescape: they cannot even be written as UTF-8).
UNSAFE: Final = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
# What json.dumps leaves raw of them (it escapes C0 controls itself, and the newlines of its
# indentation stand outside strings, where an escape is not allowed).
_JSON_UNSAFE: Final = re.compile("[\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
# What each kind of human output keeps of the C0 controls: multi-line text (a probe's output as
# ``check`` prints it, an error message) keeps newlines and tabs; one line of a summary
# (``inspect``, ``health``'s reasons) keeps tabs, so a name cannot start a forged line; a table
# cell keeps neither, as either would break the table's columns or rows.
MULTI_LINE: Final = "\n\t"
ONE_LINE: Final = "\t"
CELL: Final = ""


def _visible(char: str) -> str:
    """One unsafe character as it is shown: caret notation for C0 and DEL (``^[`` for ESC,
    ``^G`` BEL, ``^@`` NUL, ``^?`` DEL, as ``cat -v`` and terminals' own echo show them),
    Python's escapes above (``\\x9b`` for a C1 control, ``\\u202e`` for a bidi override or a
    lone surrogate)."""
    code = ord(char)
    if code < 0x20 or code == 0x7F:
        return "^" + chr(code ^ 0x40)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}"


def sanitize(text: str, keep: str = MULTI_LINE) -> str:
    """``text`` with every `UNSAFE` character but those in ``keep`` (`MULTI_LINE`, `ONE_LINE`
    or `CELL`) shown visibly: only printable characters (and ``keep``) remain.

    Literal ``^`` and ``\\`` are left as written, as kubectl leaves them: ``^[`` may have been
    typed, and a reader who must tell uses ``-o json``, which has the exact text. The result is
    sanitized already, so applying this twice changes nothing.
    """
    if not UNSAFE.search(text):
        return text
    return UNSAFE.sub(lambda m: m.group() if m.group() in keep else _visible(m.group()), text)


def _json_escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def json_escaped(document: str) -> str:
    """JSON text (``json.dumps(..., ensure_ascii=False)``, which escapes only C0 controls) with
    DEL, C1 controls, bidi overrides and lone surrogates written as ``\\uXXXX`` escapes too: it
    parses to exactly the same values and prints no control character. These characters can
    only stand inside JSON strings, where an escape means the character itself."""
    return _JSON_UNSAFE.sub(_json_escape, document)


__all__ = ["CELL", "MULTI_LINE", "ONE_LINE", "UNSAFE", "json_escaped", "sanitize"]
