"""Keys, the method rules, and the plain-int metrics: no I/O."""

from __future__ import annotations

import hmac

import pytest

from controlplane.domain.errors import InvalidArgument, PermissionDenied, Unauthenticated
from controlplane.domain.keys import (
    KEY_PREFIX,
    KeyVerifier,
    Principal,
    Role,
    bearer_token,
    hash_secret,
    new_key,
    parse_role,
    split_key,
)
from controlplane.rpc.auth import authorize, rule_for
from controlplane.rpc.errors import status_for
from controlplane.telemetry.metrics import LatencyHistogram


def test_new_key_is_prefixed_random_and_stored_only_as_a_salted_hash() -> None:
    key, key_id, salt, digest = new_key()
    prefix, kid, secret = key.split("_", 2)
    assert (prefix, kid) == (KEY_PREFIX, key_id)
    assert len(secret) >= 43  # 32 random bytes, URL-safe base64
    assert secret not in digest and secret not in salt
    assert hash_secret(bytes.fromhex(salt), secret) == digest
    # Same secret, other salt: another hash.
    assert hash_secret(b"\x01" * 16, secret) != digest
    keys = {new_key()[0] for _ in range(50)}
    assert len(keys) == 50


def test_split_key_and_bearer_metadata() -> None:
    assert split_key("bgk_abc123_sec_ret-x") == ("abc123", "sec_ret-x")
    for bad in ("", "bgk_", "bgk_abc", "xyz_abc_def", "bgk__secret"):
        with pytest.raises(Unauthenticated):
            split_key(bad)
    assert bearer_token((("authorization", "Bearer bgk_a_b"),)) == "bgk_a_b"
    assert bearer_token((("x", "y"), ("authorization", b"bearer  bgk_a_b "))) == "bgk_a_b"
    with pytest.raises(Unauthenticated, match="missing credentials"):
        bearer_token(())
    with pytest.raises(Unauthenticated, match="Bearer"):
        bearer_token((("authorization", "Basic dXNlcg=="),))


def test_verifier_compares_in_constant_time_and_refuses_revoked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key, key_id, salt, digest = new_key()
    secret = split_key(key)[1]
    principal = Principal(key_id, "ops", Role.ADMIN)
    calls: list[int] = []
    real = hmac.compare_digest

    def spy(a: str, b: str) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr("controlplane.domain.keys.hmac.compare_digest", spy)
    v = KeyVerifier(bytes.fromhex(salt), digest, principal, revoked=False)
    assert v.check(secret) == principal
    with pytest.raises(Unauthenticated):
        v.check(secret + "x")
    with pytest.raises(Unauthenticated):
        KeyVerifier(bytes.fromhex(salt), digest, principal, revoked=True).check(secret)
    assert len(calls) == 3  # every check went through compare_digest


@pytest.mark.parametrize(
    ("method", "admin", "viewer", "sidecar"),
    [
        ("/burstgate.v1.AdminService/ListTenants", True, True, False),
        ("/burstgate.v1.AdminService/GetTenantState", True, True, False),
        ("/burstgate.v1.AdminService/UpdateTenant", True, False, False),
        ("/burstgate.v1.AdminService/DeleteTenant", True, False, False),
        ("/burstgate.v1.AdminService/ListApiKeys", True, False, False),
        ("/burstgate.v1.AdminService/CreateApiKey", True, False, False),
        ("/burstgate.v1.AdmissionService/Admit", False, False, True),
        ("/burstgate.v1.LedgerService/ExportLedger", True, True, False),
        ("/burstgate.v1.LedgerService/SetPrice", True, False, False),
    ],
)
def test_role_matrix(method: str, admin: bool, viewer: bool, sidecar: bool) -> None:
    rule = rule_for(method)
    for role, allowed in ((Role.ADMIN, admin), (Role.VIEWER, viewer), (Role.SIDECAR, sidecar)):
        p = Principal("k", "n", role)
        if allowed:
            assert authorize(p, rule) is p
        else:
            with pytest.raises(PermissionDenied):
                authorize(p, rule)


def test_auth_errors_map_to_grpc_codes_in_the_one_place() -> None:
    import grpc

    assert status_for(Unauthenticated("x")) == grpc.StatusCode.UNAUTHENTICATED
    assert status_for(PermissionDenied("x")) == grpc.StatusCode.PERMISSION_DENIED
    assert rule_for("/grpc.health.v1.Health/Check").kind == 0  # public


def test_parse_role() -> None:
    assert parse_role("viewer") is Role.VIEWER
    with pytest.raises(InvalidArgument, match="role"):
        parse_role("root")


def test_latency_histogram_is_cumulative_with_sub_millisecond_buckets() -> None:
    h = LatencyHistogram()
    assert h.bounds[0] < 0.001 and h.bounds[:3] == (0.00005, 0.0001, 0.00025)
    for v in (0.00004, 0.0003, 0.0003, 0.002, 99.0):
        h.observe(v)
    buckets, total = h.buckets()
    as_dict = dict(buckets)
    assert as_dict["5e-05"] == 1
    assert as_dict["0.0005"] == 3
    assert as_dict["0.0025"] == 4
    assert as_dict["+Inf"] == 5
    counts = [n for _, n in buckets]
    assert counts == sorted(counts)
    assert total == pytest.approx(99.00264)
