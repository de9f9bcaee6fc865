"""The one sanitizer for tenant text on a terminal (issue 34): each class of character it shows
visibly, what each kind of output keeps, and the JSON escaping that keeps the exact text."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cri_prober.text import CELL, MULTI_LINE, ONE_LINE, UNSAFE, json_escaped, sanitize

# The measured payload: sets the window title, then clears the screen.
TITLE_AND_CLEAR = "\x1b]0;TITLE\x07\x1b[2J"
# Every character that must never reach a terminal raw (newline and tab only where kept).
CONTROLS = (
    [chr(c) for c in range(0x20)]
    + ["\x7f"]
    + [chr(c) for c in range(0x80, 0xA0)]
    + [chr(c) for c in range(0x202A, 0x202F)]
    + [chr(c) for c in range(0x2066, 0x206A)]
)


ANY_TEXT = st.text(st.characters(exclude_categories=()))  # surrogates and controls included


def raw_controls(text: str, allowed: str = "") -> list[str]:
    """The characters of ``text`` in the forbidden set, bar ``allowed``: none may be left."""
    return [c for c in text if (c in CONTROLS and c not in allowed) or "\ud800" <= c <= "\udfff"]


@pytest.mark.parametrize(
    ("char", "shown"),
    [
        ("\x00", "^@"),
        ("\x07", "^G"),
        ("\x08", "^H"),
        ("\x0d", "^M"),
        ("\x1b", "^["),
        ("\x1f", "^_"),
        ("\x7f", "^?"),
        ("\x80", "\\x80"),
        ("\x85", "\\x85"),
        ("\x9b", "\\x9b"),
        ("\x9f", "\\x9f"),
        ("\u202a", "\\u202a"),
        ("\u202e", "\\u202e"),
        ("\u2066", "\\u2066"),
        ("\u2069", "\\u2069"),
        ("\udc80", "\\udc80"),
    ],
)
def test_each_class_is_shown_visibly(char: str, shown: str) -> None:
    """C0 and DEL in caret notation, C1, bidi overrides and lone surrogates as escapes."""
    assert sanitize(f"a{char}b") == f"a{shown}b"


def test_the_measured_payload() -> None:
    assert sanitize(TITLE_AND_CLEAR) == "^[]0;TITLE^G^[[2J"


@pytest.mark.parametrize(
    ("keep", "expected"),
    [(MULTI_LINE, "a\nb\tc"), (ONE_LINE, "a^Jb\tc"), (CELL, "a^Jb^Ic")],
)
def test_newline_and_tab_are_kept_only_where_asked(keep: str, expected: str) -> None:
    assert sanitize("a\nb\tc", keep) == expected


def test_printable_text_is_left_as_written() -> None:
    """Everything printable passes unchanged, non-ASCII included; ``^`` and ``\\`` too."""
    text = "naïve café 日本 ✓ ^[ \\x1b \\u202e"
    assert sanitize(text, CELL) is text


def test_every_control_character_is_handled() -> None:
    """The whole forbidden set, one by one: none survives, in any mode."""
    for char in CONTROLS:
        for keep in (CELL, ONE_LINE, MULTI_LINE):
            assert raw_controls(sanitize(char, keep), keep) == [], repr(char)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        ANY_TEXT,
        st.binary().map(lambda b: b.decode("utf-8", "surrogateescape")),
        st.binary().map(lambda b: b.decode("utf-8", "replace")),
        st.binary().map(lambda b: b.decode("latin-1")),
    ),
    st.sampled_from([CELL, ONE_LINE, MULTI_LINE]),
)
def test_no_control_survives_and_twice_is_once(text: str, keep: str) -> None:
    shown = sanitize(text, keep)
    assert raw_controls(shown, keep) == []
    assert sanitize(shown, keep) == shown
    assert not UNSAFE.search(shown.translate({ord(c): None for c in keep}))


@settings(max_examples=200, deadline=None)
@given(st.recursive(ANY_TEXT | st.integers(), lambda inner: st.lists(inner, max_size=3)))
def test_json_keeps_the_exact_text_without_a_raw_control(value: object) -> None:
    for indent in (None, 2):
        document = json_escaped(json.dumps({"v": value}, indent=indent, ensure_ascii=False))
        assert json.loads(document) == {"v": value}
        assert raw_controls(document, "\n") == []


def test_json_escapes_what_json_dumps_leaves_raw() -> None:
    value = "x\x7f\x9b\u202e\udc80y é"
    document = json_escaped(json.dumps(value, ensure_ascii=False))
    assert document == '"x\\u007f\\u009b\\u202e\\udc80y é"'
    assert json.loads(document) == value
