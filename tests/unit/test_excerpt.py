"""``excerpt``: how an error message quotes a user-supplied value (docs/api.md,
"Errors"): never more than a short prefix, control characters escaped."""

from __future__ import annotations

from controlplane.domain.errors import MAX_ECHO_CHARS, excerpt


def test_short_values_are_quoted_whole() -> None:
    assert excerpt("acme") == "'acme'"
    assert excerpt("x" * (MAX_ECHO_CHARS - 2)) == repr("x" * (MAX_ECHO_CHARS - 2))
    assert excerpt(17) == "17"


def test_long_values_are_cut_with_their_length() -> None:
    shown = excerpt("l" * 10_000)
    assert shown == "'" + "l" * (MAX_ECHO_CHARS - 4) + "... (10000 chars)"
    assert len(shown) <= MAX_ECHO_CHARS + len(" (10000 chars)")
    assert excerpt(b"\x00" * 500).endswith("... (500 chars)")


def test_control_characters_are_escaped() -> None:
    shown = excerpt("a\nb\x1b[31m" * 20)
    assert "\n" not in shown and "\x1b" not in shown
    assert shown.startswith("'a\\nb\\x1b[31m")
