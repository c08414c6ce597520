"""Key scopes, expiry, durations and the bearer metadata: no I/O."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from controlplane.domain.errors import InvalidArgument, PermissionDenied, Unauthenticated
from controlplane.domain.keys import (
    KeyVerifier,
    Principal,
    Role,
    bearer_token,
    check_expiry,
    key_scope,
    new_key,
    parse_duration,
    split_key,
)
from controlplane.domain.scope import MATCH_CACHE_LIMIT, KeyScope, NameScope, quote
from controlplane.rpc.errors import error_status


def test_name_scope_matches_exact_names_and_globs() -> None:
    s = NameScope(["acme", "team-*", "eu-?", "shard[0-3]", "lit[*]"])
    for name in ("acme", "team-", "team-x", "eu-1", "shard2", "lit*"):
        assert name in s, name
    for name in ("acm", "Acme", "TEAM-x", "xteam-y", "eu-10", "shard4", "litx", ""):
        assert name not in s, name
    assert not s.all
    assert "anything" in NameScope(["*"]) and NameScope(["acme", "*"]).all
    assert "x" not in NameScope([])  # a scope with nothing in it allows nothing


def test_name_scope_caches_pattern_verdicts_within_a_bound() -> None:
    s = NameScope(["team-*"])
    for i in range(MATCH_CACHE_LIMIT + 10):
        assert f"team-{i}" in s
        assert f"other-{i}" not in s
    assert len(s._cache) <= MATCH_CACHE_LIMIT
    assert NameScope(["acme"])._regex is None  # exact names only: a set, no regex


def test_key_scope_checks_name_the_field() -> None:
    scope = KeyScope(["acme", "team-*"], ["pool-a"])
    scope.check_tenant("tenant_id", "team-b")
    scope.check_tenants("tenant_id", ["acme", "team-x", "acme"])
    scope.check_pool("pool", "pool-a")
    scope.check_pool("pool", "")  # no pool: nothing of a pool is used
    with pytest.raises(PermissionDenied) as err:
        scope.check_tenants("tenant_id", ["acme", "team-x", "beta", "beta"])
    assert str(err.value) == "tenant_id[2]: tenant 'beta' is outside this key's tenants"
    assert err.value.field == "tenant_id[2]"
    with pytest.raises(PermissionDenied, match=r"^pool: pool 'pool-b' is outside"):
        scope.check_pool("pool", "pool-b")
    status = error_status(PermissionDenied("no", field="pool"))
    assert status.details == "pool: no"
    assert not scope.unrestricted and KeyScope(["*"], ["*"]).unrestricted
    assert KeyScope(["a"], ["*"]) == KeyScope(["a"], ["*"]) != KeyScope(["b"], ["*"])


def test_quote_keeps_messages_short() -> None:
    assert quote("acme") == "'acme'"
    long = quote("x" * 10_000)
    assert len(long) < 80 and "(10000 characters)" in long


def test_only_sidecar_keys_are_scoped_and_they_must_say_so() -> None:
    assert key_scope(Role.SIDECAR, ["acme", "team-*", "acme"], ["p"]) == (
        ("acme", "team-*"),
        ("p",),
    )
    assert key_scope(Role.SIDECAR, ["acme", "*"], ["*"]) == (("*",), ("*",))
    assert key_scope(Role.ADMIN, [], []) == ((), ())
    bad = [
        (Role.SIDECAR, [], ["*"], "tenants"),
        (Role.SIDECAR, ["*"], [], "pools"),
        (Role.VIEWER, ["acme"], [], "tenants"),
        (Role.ADMIN, [], ["p"], "pools"),
        (Role.SIDECAR, ["ok", " padded"], ["*"], "tenants[1]"),
        (Role.SIDECAR, ["t\x00"], ["*"], "tenants[0]"),
        (Role.SIDECAR, ["*"], ["p" * 129], "pools[0]"),
        (Role.SIDECAR, [str(i) for i in range(65)], ["*"], "tenants"),
    ]
    for role, tenants, pools, field in bad:
        with pytest.raises(InvalidArgument) as err:
            key_scope(role, tenants, pools)
        assert err.value.field == field, (tenants, pools)


def test_durations_and_expiry() -> None:
    assert parse_duration("--expires-in", "30d") == timedelta(days=30)
    assert parse_duration("--expires-in", " 90s ") == timedelta(seconds=90)
    assert parse_duration("--expires-in", "2w") == timedelta(weeks=2)
    for bad in ("", "30", "d", "1.5h", "-1d", "0s", "30 days", "9999999d"):
        with pytest.raises(InvalidArgument, match=r"^--expires-in: "):
            parse_duration("--expires-in", bad)
    now = datetime.now(UTC)
    check_expiry("expire_time", None, now)
    check_expiry("expire_time", now + timedelta(days=3650), now)
    for when in (now, now - timedelta(seconds=1), now + timedelta(days=3651)):
        with pytest.raises(InvalidArgument, match=r"^expire_time: "):
            check_expiry("expire_time", when, now)


def test_an_expired_key_is_refused_after_its_secret_is_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key, key_id, salt, digest = new_key()
    secret = split_key(key)[1]
    principal = Principal(key_id, "edge", Role.SIDECAR)
    v = KeyVerifier(bytes.fromhex(salt), digest, principal, revoked=False, expires_s=1000.0)
    monkeypatch.setattr("controlplane.domain.keys.time", SimpleNamespace(time=lambda: 999.0))
    assert v.check(secret) is principal
    monkeypatch.setattr("controlplane.domain.keys.time", SimpleNamespace(time=lambda: 1000.0))
    with pytest.raises(Unauthenticated, match=r"^expired API key$"):
        v.check(secret)
    # a wrong secret learns nothing about the expiry
    with pytest.raises(Unauthenticated, match="invalid or revoked"):
        v.check(secret + "x")


def test_differing_authorization_entries_are_ambiguous() -> None:
    assert bearer_token((("authorization", "Bearer a"), ("x-a", "b"))) == "a"
    # the same entry twice is not ambiguous
    assert bearer_token((("authorization", "Bearer a"), ("authorization", "Bearer a"))) == "a"
    for md in (
        (("authorization", "Bearer a"), ("authorization", "Bearer b")),
        (("authorization", "Bearer a"), ("authorization", "Bearer a"), ("authorization", "x")),
        (("authorization", "Bearer a"), ("authorization", b"")),
    ):
        with pytest.raises(Unauthenticated, match=r"^ambiguous credentials: differing"):
            bearer_token(md)
