"""``$(VAR)`` expansion in exec probe commands follows the kubelet's rules."""

from __future__ import annotations

import pytest

from cri_prober.probing.handlers.exec import expand_command

ENV = {"NAME": "world", "EMPTY": "", "PORT": "8080"}


@pytest.mark.parametrize(
    ("arg", "expanded"),
    [
        ("$(NAME)", "world"),
        ("hello $(NAME)!", "hello world!"),
        ("$(NAME)$(PORT)", "world8080"),
        ("$(EMPTY)x", "x"),
        ("$(MISSING)", "$(MISSING)"),
        ("$$(NAME)", "$(NAME)"),
        ("$$$(NAME)", "$world"),
        ("$$", "$"),
        ("$NAME", "$NAME"),
        ("cost: 5$", "cost: 5$"),
        ("$(NAME", "$(NAME"),
        ("$()", "$()"),
        ("no refs", "no refs"),
        ("", ""),
    ],
)
def test_expansion_rules(arg: str, expanded: str) -> None:
    """Defined names expand, undefined stay verbatim, $$ escapes, malformed stays literal."""
    assert expand_command([arg], ENV) == [expanded]


def test_every_argument_is_expanded_separately() -> None:
    """Each argv element is expanded on its own; no shell splitting happens."""
    assert expand_command(["sh", "-c", "echo $(NAME) > /tmp/$(PORT)"], ENV) == [
        "sh",
        "-c",
        "echo world > /tmp/8080",
    ]
