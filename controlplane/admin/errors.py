"""Auth failures as domain errors; ``controlplane.rpc.errors`` maps them to
``UNAUTHENTICATED`` / ``PERMISSION_DENIED`` with every other domain error."""

from __future__ import annotations

from controlplane.errors import DomainError


class Unauthenticated(DomainError):
    """No credentials, or credentials that do not identify an active key."""


class PermissionDenied(DomainError):
    """A valid key whose role may not call this method."""
