"""Signed admissions (controlplane/service/signing.py): the token's MAC is
HMAC-SHA256 over the documented canonical bytes, the encoding is
unambiguous, verification never raises whatever the bytes, and every
admitted answer (unary, batch, replay) carries a token that verifies
against the facts a sidecar re-announces."""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from typing import Any

import pytest

from controlplane.domain import Decision
from controlplane.service.signing import (
    MAC_BYTES,
    AdmissionSigner,
    Signed,
    key_id,
)

KEY = bytes(range(32))
FACTS = (
    "acme", "r1", "llama", "standard", "p", 60, 40, 7, 1.2, 1_700_000_100, 1_700_000_000 * 10**9,
)  # fmt: skip


def test_the_mac_is_hmac_sha256_over_the_canonical_bytes() -> None:
    token = AdmissionSigner([KEY]).sign(*FACTS)
    body, mac = token[:-MAC_BYTES], token[-MAC_BYTES:]
    head = struct.pack(">BIqqqH", 1, key_id(KEY), FACTS[10], FACTS[9], 1_200_000, 8)
    assert body == head + b"standard" + struct.pack(">H", 1) + b"p"
    signed = body + struct.pack(">qqQHHH", 60, 40, 7, 4, 2, 5) + b"acme" + b"r1" + b"llama"
    assert mac == hmac.new(KEY, signed, hashlib.sha256).digest()[:MAC_BYTES]
    assert key_id(KEY) == int.from_bytes(
        hashlib.sha256(b"burstgate admission signing key id\x00" + KEY).digest()[:4], "big"
    )


def test_the_encoding_is_unambiguous() -> None:
    s = AdmissionSigner([KEY])
    base = list(FACTS)
    moved = [
        ["ac", "mer1", *base[2:]],  # the tenant/request id boundary
        [*base[:3], "standar", "dp", *base[5:]],  # the lane/pool boundary
        [*base[:2], "llam", "astandard", *base[4:]],
    ]
    tokens = {s.sign(*base)} | {s.sign(*m) for m in moved}  # type: ignore[arg-type]
    assert len(tokens) == 4


def test_verify_gives_back_the_signed_facts() -> None:
    s = AdmissionSigner([KEY])
    token = s.sign(*FACTS)
    got = s.verify(token, "acme", "r1", "llama", 60, 40, 7)
    assert got == Signed("standard", "p", 1_200_000, 1_700_000_100, FACTS[10])
    assert isinstance(got, Signed) and str(got.multiplier) == "1.200000"
    assert s.verify(token, "acme", "r1", "llama", 60, 40, 8) == "signature does not match"
    assert str(s.verify(b"", "acme", "r1", "", 0, 0, 0)).startswith("unsigned")


@pytest.mark.parametrize("seed", range(5))
def test_verify_never_raises(seed: int) -> None:
    s = AdmissionSigner([KEY])
    rng = __import__("random").Random(seed)
    token = s.sign(*FACTS)
    for _ in range(300):
        n = rng.randrange(0, 120)
        junk = bytes(rng.randrange(256) for _ in range(n))
        spliced = token[: rng.randrange(len(token))] + junk
        for t in (junk, spliced, b"\x01" + token[1:5] + junk):
            got = s.verify(t, "acme", "r1", "llama", 60, 40, 7)
            assert isinstance(got, str)
    # values no admission has (never signed): refused, not raised
    assert isinstance(s.verify(token, "a\ud800", "r1", "", -1, 2**70, 2**64), str)


def test_keys_are_32_bytes_or_more_and_two_are_kept() -> None:
    with pytest.raises(ValueError):
        AdmissionSigner([b"short"])
    a, b, c = os.urandom(32), os.urandom(32), os.urandom(32)
    s = AdmissionSigner([a])
    old = s.sign(*FACTS)
    s.install([b, a])
    assert s.key_ids == [key_id(b), key_id(a)]
    assert isinstance(s.verify(old, "acme", "r1", "llama", 60, 40, 7), Signed)
    assert s.sign(*FACTS)[1:5] == key_id(b).to_bytes(4, "big")
    s.install([c, b])
    assert s.verify(old, "acme", "r1", "llama", 60, 40, 7) != "signature does not match"
    assert "does not hold" in str(s.verify(old, "acme", "r1", "llama", 60, 40, 7))


def test_every_admitted_answer_carries_a_token_that_verifies(make_service: Any) -> None:
    svc = make_service()
    d = svc.admit("acme", "u1", "", 10, 20, model="m", pool="p")
    assert d.decision == Decision.ADMIT
    got = svc.signer.verify(d.admission_token, "acme", "u1", "m", 10, 20, d.reservation_id)
    assert isinstance(got, Signed) and (got.lane, got.pool) == ("standard", "p")
    assert svc.admit("acme", "u1", "", 10, 20, model="m", pool="p").admission_token == (
        d.admission_token
    )  # a replay: the same token
    refused = svc.admit("ghost", "u2", "", 10, 20)
    assert refused.decision == Decision.REJECT and refused.admission_token == b""
    r = svc.batches.admit(["acme", "ghost", "acme"], ["b1", "b2", "u1"], [], [1, 1, 10],
                        [2, 2, 20], model="m", pool="p")  # fmt: skip
    assert r.admission_token is not None and r.admission_token[1] == b""
    assert r.admission_token[2] == d.admission_token  # the replay's
    got = svc.signer.verify(r.admission_token[0], "acme", "b1", "m", 1, 2, r.reservation_id[0])
    assert isinstance(got, Signed) and got.pool == "p"
    none = svc.batches.admit(["ghost"], ["b3"], [], [1], [1])
    assert none.admission_token is None
