"""Domain errors. The RPC adapters map them to gRPC status codes in one
place (controlplane/rpc/errors.py); nothing below the adapters knows gRPC."""

from __future__ import annotations

# The most of a user-supplied value an error message quotes (docs/api.md,
# "Errors"): enough to recognise a typo, never the whole of a hostile value
# (a status message travels in a header; grpc ends a call whose headers pass
# its metadata limit with RESOURCE_EXHAUSTED "Stream removed").
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


class DomainError(Exception):
    """Base class: the call itself failed (as opposed to a denial, which is data)."""


class InvalidArgument(DomainError):
    """Bad input; ``field`` names the offending request field, ``description``
    says what is wrong with it (the message is ``"field: description"``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.description = message


class NotFound(DomainError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.description = message


class FailedPrecondition(DomainError):
    pass


class AlreadyExists(DomainError):
    pass


# Auth failures; ``controlplane.rpc.errors`` maps them to ``UNAUTHENTICATED``
# / ``PERMISSION_DENIED`` with every other domain error.
class Unauthenticated(DomainError):
    """No credentials, or credentials that do not identify an active key."""


class PermissionDenied(DomainError):
    """A valid key whose role may not call this method, or a sidecar key
    acting for a tenant or pool outside its scope (``field`` names the
    request field then; the message is ``"field: description"``)."""

    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


# Metering's domain error.
class LedgerUnavailable(DomainError):
    """The ledger cannot make a record durable (database unreachable and the
    spool full) or cannot be consulted; nothing was changed, retry later.
    Mapped to gRPC UNAVAILABLE."""


class Overloaded(DomainError):
    """The server holds its maximum of something (open reservations) and
    cannot take this call now; nothing was changed, retry later. Mapped to
    gRPC UNAVAILABLE."""


class DatabaseUnavailable(DomainError):
    """The database did not answer an operator call in time, or refused the
    connection. The message is generic on purpose (the caller may hold no
    valid key; host, port and driver text stay in the server log). Mapped to
    gRPC UNAVAILABLE with a RetryInfo."""

    def __init__(self) -> None:
        super().__init__("database unavailable; retry later")
