"""A bounded YAML loader: reads the rules file (and any YAML the daemon is given) within limits on
size, alias expansion and nesting, resolving scalars by a narrowed YAML 1.2 core schema, from
the parser's events alone rather than PyYAML's composer and constructors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, Protocol

from cri_prober.files import UnsafeFile, read_regular_file
from cri_prober.probing import outcome
from cri_prober.probing.spec.common import _SHOWN_CHARS, SpecError, _show

if TYPE_CHECKING:
    # Imported where YAML is read (a rules file, static pod manifests): a serve that reads none
    # does not hold PyYAML (bench/idle_rss.py).
    import yaml

__all__ = [
    "RULES_FILE_MAX_BYTES",
    "YAML_ALIAS_BUDGET",
    "YAML_MAX_DEPTH",
    "load_yaml",
    "read_rules_file",
]

# -- reading and parsing within bounds -------------------------------------------------------
#
# The rules file and the annotations are input cri-prober does not control (a ConfigMap that
# anyone with edit rights fills, any pod author's annotations), read by one process that probes
# the whole node. Each limit keeps such input to a moment of one core and a few MiB: without
# them a 5 MB rules file took 18 s and 521 MB to load, and 419 bytes of chained YAML merge keys
# took seconds and hundreds of MB, doubling with each line added. (The annotation's limit,
# ANNOTATION_MAX_BYTES, is in rules.py beside parse_annotation.)

# The rules file. Real ones are a few KiB; 1 MiB parses in well under a second with libyaml.
RULES_FILE_MAX_BYTES: Final = 1024 * 1024
# Nodes that aliases (`*name`) and merge keys (`<<: *name`) may add to a rules file, each alias
# counted as a full copy of its anchor. Sharing a probe among hundreds of rules stays far below
# it; an alias bomb (each level doubling the one before) exceeds it within a dozen levels, and
# is rejected then, because the count comes from sizes recorded per anchor, never by expanding.
YAML_ALIAS_BUDGET: Final = 10_000
# The schema nests 6 deep (probes[0].livenessProbe.httpGet.httpHeaders[0].name); deeper is junk.
YAML_MAX_DEPTH: Final = 64

_YAML_TAG: Final = "tag:yaml.org,2002:"
# Plain scalars resolve as in the YAML 1.2 core schema, narrowed where YAML 1.1 (PyYAML's
# SafeLoader) reads surprising values: `1:30` (sexagesimal 90), `0x10`, `0o10`, `010` (octal 8
# in 1.1, 10 in 1.2), `1_000`, `yes`/`no`/`on`/`off` and dates all stay strings. An integer
# field given one then fails validation naming the field, and `command: [test, -f, on]` keeps
# its "on". An int is plain decimal without leading zeros, which every YAML version reads alike.
_YAML_NULLS: Final = frozenset({"", "~", "null", "Null", "NULL"})
_YAML_BOOLS: Final = {
    **dict.fromkeys(("true", "True", "TRUE"), True),
    **dict.fromkeys(("false", "False", "FALSE"), False),
}
_YAML_INT: Final = re.compile(r"[-+]?(?:0|[1-9][0-9]*)")
# A float needs a point or an exponent (so `010` is no float either), or is .inf or .nan.
_YAML_FLOAT: Final = re.compile(
    r"[-+]?(?:(?:\.[0-9]+|[0-9]+\.[0-9]*)(?:[eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+)"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)"
)
_YAML_SCALAR_TAGS: Final = frozenset({"null", "bool", "int", "float"})
# libyaml's parser (PyYAML's wheels bundle it) is ~10x faster than the pure-Python one, which
# gives the same events; only the events are used, never PyYAML's composer or constructors.
# Set on first use (tests set the pure-Python one).
_YAML_PARSER: type[yaml.BaseLoader] | type[yaml.CBaseLoader] | None = None


def _parser_class() -> type[yaml.BaseLoader] | type[yaml.CBaseLoader]:
    global _YAML_PARSER  # found once, on first use
    if _YAML_PARSER is None:
        import yaml

        _YAML_PARSER = getattr(yaml, "CBaseLoader", yaml.BaseLoader)
    return _YAML_PARSER


def _too_large(limit: int, size: int | None = None) -> str:
    found = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return f"too large: {found}, the limit is {limit} bytes"


def read_rules_file(path: Path, *, limit: int = RULES_FILE_MAX_BYTES) -> bytes:
    """Read the rules file at *path*: a regular file of at most *limit* bytes.

    It is opened non-blocking and checked before any read, so a FIFO put where the file was is an
    error at once instead of an open() that waits for a writer forever; at most ``limit + 1``
    bytes are read, so a file that grows meanwhile (or lies about its size) is still bounded.
    Blocking otherwise (a regular file on a slow disk): the daemon calls it in a worker thread.

    Raises:
        SpecError: the file cannot be opened or read, is no regular file, or is too large.
    """
    source = str(path)
    try:
        return read_regular_file(path, max_bytes=limit, what="rules file")
    except UnsafeFile as exc:
        if exc.too_large:
            raise SpecError([_too_large(limit, exc.size)], source=source) from None
        raise SpecError([exc.reason], source=source) from None
    except OSError as exc:
        raise SpecError([f"cannot read: {exc.strerror}"], source=source) from None


def _rules_text(text: str | bytes, source: str) -> str:
    """Check a rules file's size and encoding; its text, decoded."""
    if isinstance(text, bytes):
        size: int | None = len(text)
    elif len(text) > RULES_FILE_MAX_BYTES:  # a character is at least a byte: no need to encode
        size = None
    else:
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise SpecError(
                [f"not valid Unicode: a lone surrogate at character {exc.start}"], source=source
            ) from None
    if size is None or size > RULES_FILE_MAX_BYTES:
        raise SpecError([_too_large(RULES_FILE_MAX_BYTES, size)], source=source)
    if isinstance(text, str):
        return text
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = text.count(b"\n", 0, exc.start) + 1
        raise SpecError(
            [f"not valid UTF-8: byte {exc.start} (line {line}): {exc.reason}"], source=source
        ) from None


class _Mark(Protocol):
    """Where an event starts: PyYAML's Mark, or libyaml's, which is another class."""

    line: int
    column: int


def _yaml_error(problem: str, mark: _Mark | None) -> yaml.MarkedYAMLError:
    import yaml

    # A marked error, so load_rules reports it with line and column like a syntax error.
    where = yaml.Mark("", 0, mark.line, mark.column, None, 0) if mark is not None else None
    return yaml.constructor.ConstructorError(None, None, problem, where)


def _tag_name(tag: str) -> str:
    return "!!" + tag.removeprefix(_YAML_TAG) if tag.startswith(_YAML_TAG) else tag


def _yaml_number(kind: str, value: str, mark: _Mark | None) -> int | float:
    if kind == "float":
        # Python spells YAML's .inf and .nan without the point.
        special = value.lower().lstrip("+-") in (".inf", ".nan")
        return float(value.replace(".", "") if special else value)
    try:
        return int(value)
    except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
        raise _yaml_error(f"integer too long: {len(value)} digits", mark) from None


def _yaml_scalar(event: yaml.ScalarEvent) -> object:
    """The value of a scalar: plain untagged ones resolved as described at _YAML_NULLS."""
    value, tag, mark = event.value, event.tag, event.start_mark
    if tag is None and event.implicit[0]:
        if value in _YAML_NULLS:
            return None
        if value in _YAML_BOOLS:
            return _YAML_BOOLS[value]
        if _YAML_INT.fullmatch(value):
            return _yaml_number("int", value, mark)
        if _YAML_FLOAT.fullmatch(value):
            return _yaml_number("float", value, mark)
        return value
    if tag is None or tag in ("!", _YAML_TAG + "str"):  # quoted, block, or the `!` tag
        return value
    kind = tag.removeprefix(_YAML_TAG)
    if kind not in _YAML_SCALAR_TAGS or not tag.startswith(_YAML_TAG):
        raise _yaml_error(f"unsupported tag {_tag_name(tag)}", mark)
    if kind == "null" and value in _YAML_NULLS:
        return None
    if kind == "bool" and value in _YAML_BOOLS:
        return _YAML_BOOLS[value]
    if kind == "int" and _YAML_INT.fullmatch(value):
        return _yaml_number("int", value, mark)
    if kind == "float" and (_YAML_FLOAT.fullmatch(value) or _YAML_INT.fullmatch(value)):
        return _yaml_number("float", value, mark)
    shown = _show(outcome.shorten(value, _SHOWN_CHARS))
    raise _yaml_error(f"not a valid {_tag_name(tag)}: {shown}", mark)


_NO_KEY: Final = object()  # a mapping waiting for its next key
_MERGE: Final = object()  # ... or for the value of its merge key `<<`


@dataclass(slots=True)
class _YamlOpen:
    """A sequence or mapping whose end has not been parsed yet."""

    items: list[object] | dict[object, object]
    anchor: str | None
    mark: _Mark | None
    # Nodes in it so far, itself included, each alias counted as a copy of its anchor.
    size: int = 1
    key: object = _NO_KEY
    # Keys brought in by merge keys (an earlier source wins); explicit keys override them.
    merged: dict[object, object] | None = None


class _YamlBuilder:
    """Builds the one document of a YAML stream from parser events, within the limits above.

    PyYAML's composer and constructors follow an alias or merge key each time it is used and
    recurse through nesting: the bombs. This builds each node once, shares an anchored value
    wherever it is aliased (as PyYAML does), keeps each anchor's size to charge aliases against
    YAML_ALIAS_BUDGET, and keeps its own stack, so depth costs no recursion.
    """

    def __init__(self) -> None:
        self.anchors: dict[str, tuple[object, int]] = {}  # value and size of finished anchors
        self.open: list[_YamlOpen] = []
        self.aliased = 0  # nodes aliases have added so far
        self.documents = 0
        self.root: object = None

    def build(self, parser: yaml.BaseLoader | yaml.CBaseLoader) -> object:
        import yaml

        while parser.check_event():
            event = parser.get_event()
            if isinstance(event, yaml.ScalarEvent):
                value = _yaml_scalar(event)
                self._claim_anchor(event.anchor, event)
                if event.anchor is not None:
                    self.anchors[event.anchor] = (value, 1)
                merge_key = event.value == "<<" and event.tag is None and event.implicit[0]
                self._add(value, 1, event.start_mark, merge_key=merge_key)
            elif isinstance(event, yaml.AliasEvent):
                self._alias(event)
            elif isinstance(event, yaml.SequenceStartEvent | yaml.MappingStartEvent):
                self._start(event)
            elif isinstance(event, yaml.SequenceEndEvent | yaml.MappingEndEvent):
                self._end()
            elif isinstance(event, yaml.DocumentStartEvent):
                self.documents += 1
                if self.documents > 1:
                    raise _yaml_error("expected a single document in the stream", event.start_mark)
        return self.root

    def _claim_anchor(self, anchor: str | None, event: yaml.Event) -> None:
        # PyYAML rejected a second anchor of the same name too (YAML lets the later one win).
        if anchor is not None and (anchor in self.anchors or self._building(anchor)):
            raise _yaml_error(f"found duplicate anchor {anchor!r}", event.start_mark)

    def _building(self, anchor: str) -> bool:
        return any(node.anchor == anchor for node in self.open)

    def _alias(self, event: yaml.AliasEvent) -> None:
        anchor = event.anchor or ""
        if anchor not in self.anchors:
            if self._building(anchor):
                problem = f"alias *{anchor} refers to a node that contains it"
            else:
                problem = f"found undefined alias {anchor!r}"
            raise _yaml_error(problem, event.start_mark)
        value, size = self.anchors[anchor]
        self.aliased += size
        if self.aliased > YAML_ALIAS_BUDGET:
            raise _yaml_error(
                f"aliases expand to more than {YAML_ALIAS_BUDGET} nodes"
                " (each alias counts as a copy of its anchor)",
                event.start_mark,
            )
        self._add(value, size, event.start_mark)

    def _start(self, event: yaml.SequenceStartEvent | yaml.MappingStartEvent) -> None:
        import yaml

        sequence = isinstance(event, yaml.SequenceStartEvent)
        tag = event.tag
        if tag not in (None, "!", _YAML_TAG + ("seq" if sequence else "map")):
            raise _yaml_error(f"unsupported tag {_tag_name(tag or '')}", event.start_mark)
        if len(self.open) >= YAML_MAX_DEPTH:
            raise _yaml_error(
                f"nested too deeply (more than {YAML_MAX_DEPTH} levels)", event.start_mark
            )
        self._claim_anchor(event.anchor, event)
        self.open.append(_YamlOpen([] if sequence else {}, event.anchor, event.start_mark))

    def _end(self) -> None:
        node = self.open.pop()
        value: object = node.items
        if node.merged and isinstance(node.items, dict):
            value = {**node.merged, **node.items}
        if node.anchor is not None:
            self.anchors[node.anchor] = (value, node.size)
        self._add(value, node.size, node.mark)

    def _add(
        self, value: object, size: int, mark: _Mark | None, *, merge_key: bool = False
    ) -> None:
        if not self.open:
            self.root = value
            return
        node = self.open[-1]
        node.size += size
        if isinstance(node.items, list):
            node.items.append(value)
        elif node.key is _NO_KEY:
            node.key = self._key(node, value, mark, merge_key=merge_key)
        elif node.key is _MERGE:
            self._merge(node, value, mark)
            node.key = _NO_KEY
        else:
            node.items[node.key] = value
            node.key = _NO_KEY

    def _key(self, node: _YamlOpen, key: object, mark: _Mark | None, *, merge_key: bool) -> object:
        if merge_key and node.merged is None:
            node.merged = {}
            return _MERGE
        if isinstance(key, list | dict):
            raise _yaml_error("a mapping key must be a scalar", mark)
        if key in node.items or merge_key:
            raise _yaml_error(f"found duplicate key {key!r}", mark)
        return key

    def _merge(self, node: _YamlOpen, value: object, mark: _Mark | None) -> None:
        # YAML 1.1's merge key, as PyYAML did it: with a list of mappings an earlier one wins,
        # and the mapping's own keys win over every merged one (see _end).
        assert node.merged is not None, "set when the merge key was seen"
        for source in value if isinstance(value, list) else [value]:
            if not isinstance(source, dict):
                raise _yaml_error("a merge key (<<) takes a mapping or a list of mappings", mark)
            for key, item in source.items():
                node.merged.setdefault(key, item)


def load_yaml(text: str | bytes, *, source: str) -> object:
    """Read one YAML (or JSON) document within bounds: the rules file's reader, for any file.

    At most RULES_FILE_MAX_BYTES of UTF-8, within YAML_ALIAS_BUDGET and YAML_MAX_DEPTH, scalars
    resolved as described at _YAML_NULLS, duplicate keys rejected.

    Raises:
        SpecError: too large, not UTF-8, or a YAML error (with line and column).
    """
    import yaml

    text = _rules_text(text, source)
    parser: yaml.BaseLoader | yaml.CBaseLoader | None = None
    try:
        parser = _parser_class()(text)
        return _YamlBuilder().build(parser)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "invalid YAML"
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise SpecError([f"{where}{problem}"], source=source) from None
    except yaml.YAMLError as exc:
        raise SpecError([" ".join(str(exc).split())], source=source) from None
    finally:
        if parser is not None:
            parser.dispose()
