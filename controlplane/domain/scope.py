"""What a sidecar key may act for: its tenants and its engine pools.

A sidecar key is created with the tenants it serves (exact ids or glob
patterns: ``acme``, ``team-*``; ``*`` = every tenant, said explicitly) and
the pools it serves (the same syntax). Every admission RPC it makes for a
tenant or a pool outside those is refused ``PERMISSION_DENIED``, naming the
field. Admin and viewer keys have no scope (their role decides).

Patterns are :func:`fnmatch.fnmatchcase` globs: ``*`` any run of
characters, ``?`` one, ``[seq]`` / ``[!seq]`` a class; case-sensitive, as
tenant ids are. A tenant id that itself contains ``*``, ``?`` or ``[`` is
named with a class (``[*]``).

The check runs on every admission call (the ``Admit`` hot path is a few
microseconds), so a scope is compiled once, when the key cache is loaded:
exact names in a set, the patterns in one regular expression, and each
name's verdict against the patterns cached (bounded).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence

from controlplane.domain import MAX_ID_LEN
from controlplane.domain.errors import InvalidArgument, PermissionDenied

ALL = "*"
# Patterns one key may hold per field (tenants, pools): the regex stays small.
MAX_PATTERNS = 64
# Names whose verdict against a key's patterns is remembered, per key and field.
MATCH_CACHE_LIMIT = 4096
# How much of a refused name an error message quotes (names come from the caller).
QUOTE_LEN = 40
_GLOB_CHARS = frozenset("*?[")


def quote(name: str) -> str:
    """A caller-supplied name as an error message shows it: quoted, and cut
    to its first QUOTE_LEN characters."""
    if len(name) <= QUOTE_LEN:
        return repr(name)
    return repr(name[:QUOTE_LEN]) + f"... ({len(name)} characters)"


def is_pattern(name: str) -> bool:
    return not _GLOB_CHARS.isdisjoint(name)


class NameScope:
    """A set of names given as exact names and glob patterns."""

    __slots__ = ("_cache", "_exact", "_regex", "all", "patterns")

    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns: tuple[str, ...] = tuple(dict.fromkeys(patterns))
        self.all = ALL in self.patterns
        self._exact = frozenset(p for p in self.patterns if not is_pattern(p))
        globs = [fnmatch.translate(p) for p in self.patterns if is_pattern(p)]
        self._regex = re.compile("|".join(globs)) if globs and not self.all else None
        self._cache: dict[str, bool] = {}

    def __contains__(self, name: str) -> bool:
        if self.all or name in self._exact:
            return True
        if self._regex is None:
            return False
        hit = self._cache.get(name)
        if hit is None:
            hit = self._regex.match(name) is not None
            if len(self._cache) >= MATCH_CACHE_LIMIT:
                self._cache.clear()  # many distinct names: start over
            self._cache[name] = hit
        return hit

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NameScope) and other.patterns == self.patterns

    def __hash__(self) -> int:
        return hash(self.patterns)

    def __repr__(self) -> str:
        return f"NameScope({list(self.patterns)!r})"


class KeyScope:
    """The tenants and pools a sidecar key may act for (compiled)."""

    __slots__ = ("pools", "tenants")

    def __init__(self, tenants: Iterable[str], pools: Iterable[str]) -> None:
        self.tenants = NameScope(tenants)
        self.pools = NameScope(pools)

    @property
    def unrestricted(self) -> bool:
        return self.tenants.all and self.pools.all

    def check_tenant(self, field: str, tenant_id: str) -> None:
        if tenant_id not in self.tenants:
            raise PermissionDenied(
                f"tenant {quote(tenant_id)} is outside this key's tenants", field=field
            )

    def check_tenants(self, field: str, tenant_ids: Sequence[str]) -> None:
        """A batch's tenant column: the first entry outside is named ``field[i]``."""
        if self.tenants.all:
            return
        for tenant_id in dict.fromkeys(tenant_ids):
            if tenant_id not in self.tenants:
                self.check_tenant(f"{field}[{tenant_ids.index(tenant_id)}]", tenant_id)

    def check_pool(self, field: str, pool: str, what: str = "pool") -> None:
        """``pool`` "" (no pool) passes: no pool's capacity is used.
        ``what`` names the pool in the message ("this request's pool")."""
        if pool and pool not in self.pools:
            raise PermissionDenied(f"{what} {quote(pool)} is outside this key's pools", field=field)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, KeyScope)
            and other.tenants == self.tenants
            and other.pools == self.pools
        )

    def __hash__(self) -> int:
        return hash((self.tenants, self.pools))

    def __repr__(self) -> str:
        return f"KeyScope(tenants={list(self.tenants.patterns)}, pools={list(self.pools.patterns)})"


def check_patterns(field: str, patterns: Sequence[str], hint: str) -> tuple[str, ...]:
    """Validate a key's tenant or pool patterns; return them without
    duplicates, in order. ``hint`` tells how to give them (CLI option)."""
    if not patterns:
        raise InvalidArgument(
            field, f"a sidecar key must name the {field} it serves ({hint}; '*' = all)"
        )
    if len(patterns) > MAX_PATTERNS:
        raise InvalidArgument(field, f"at most {MAX_PATTERNS} entries, got {len(patterns)}")
    for i, p in enumerate(patterns):
        if not p or p != p.strip():
            raise InvalidArgument(
                f"{field}[{i}]", "must not be empty or start or end with whitespace"
            )
        if len(p) > MAX_ID_LEN:
            raise InvalidArgument(f"{field}[{i}]", f"longer than {MAX_ID_LEN} characters")
        if not p.isprintable():
            raise InvalidArgument(f"{field}[{i}]", "must not contain control characters")
    unique = tuple(dict.fromkeys(patterns))
    return (ALL,) if ALL in unique else unique
