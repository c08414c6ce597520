"""The client wing's own argument errors and how they quote a value.

The client distribution depends on nothing of the server's, so it has its own
``InvalidArgument`` (a ``ValueError`` naming the field, message
``"field: description"`` as the server's INVALID_ARGUMENT details are) and
its own ``excerpt``; tests/unit/test_client_edge.py keeps both equal to the
server's ``controlplane.domain.errors``.
"""

from __future__ import annotations

# The most of a user-supplied value a message quotes: enough to recognise a
# typo, never the whole of a hostile value.
MAX_ECHO_CHARS = 40


def excerpt(value: object) -> str:
    """``value`` as an error message quotes it: its ``repr`` (control
    characters escaped), cut to :data:`MAX_ECHO_CHARS` with ``...`` and the
    full length when longer. Only the head of a string is rendered, so a
    megabyte value costs no more than a short one."""
    if isinstance(value, str | bytes):
        text = repr(value[: MAX_ECHO_CHARS + 1])
        size = f" ({len(value)} chars)"
    else:
        text = repr(value)
        size = ""
    if len(text) <= MAX_ECHO_CHARS:
        return text
    return text[: MAX_ECHO_CHARS - 3] + "..." + size


class InvalidArgument(ValueError):
    """Bad input; ``field`` names the offending field or flag,
    ``description`` says what is wrong with it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.description = message
