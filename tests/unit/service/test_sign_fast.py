"""The admission-token MACs in both builds (fastpath/_sign_py.py, the
reference, and fastpath/_sign_c.pyx, with the CPU's SHA instructions and
without): HMAC-SHA256 truncated to 16 bytes, checked against Python's hmac
on random keys and messages of every length around SHA-256's block, and a
batch's tokens (sign_rows) against the message the reference documents."""

from __future__ import annotations

import hashlib
import hmac
import importlib
import os
import random
import struct
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from fastpath import _sign_py


def _compiled() -> ModuleType:
    try:
        return importlib.import_module("fastpath._sign_c")
    except ImportError as exc:
        if os.environ.get("BURSTGATE_FASTPATH") == "python":
            pytest.skip(f"compiled fastpath not built and BURSTGATE_FASTPATH=python: {exc}")
        pytest.fail(f"compiled fastpath (fastpath._sign_c) is not importable: {exc}")


@pytest.fixture(params=["python", "cython-sha-ni", "cython-portable"])
def build(request: pytest.FixtureRequest) -> Iterator[ModuleType]:
    if request.param == "python":
        yield _sign_py
        return
    mod = _compiled()
    mod._set_sha_ni(request.param == "cython-sha-ni")
    try:
        yield mod
    finally:
        mod._set_sha_ni(True)  # back to the default: the instructions when the CPU has them


def _hmac16(block: bytes, data: bytes) -> bytes:
    return hmac.new(block, data, hashlib.sha256).digest()[:16]


def test_mac_is_truncated_hmac_sha256_for_every_length(build: ModuleType) -> None:
    rng = random.Random(1)
    for length in [*range(0, 200), 1000, 4096, 4097]:
        block = rng.randbytes(64)
        data = rng.randbytes(length)
        assert build.MacKey(block).mac(data) == _hmac16(block, data), length


def test_a_key_block_has_64_bytes(build: ModuleType) -> None:
    with pytest.raises(ValueError):
        build.MacKey(b"k" * 32)


_FACTS = struct.Struct(">qqQHHH")
_WORDS = ["a", "t1", "tenant-é", "ümlaut-ñ", "x" * 70, "", "中文", "r-" + "9" * 40]


def _batch(rng: random.Random, n: int) -> tuple[Any, list[int], list[str], list[str], list[str]]:
    names = ["", "standard", "premium", "pool-a", "llama", "gpt-ü"]
    admitted = sorted(rng.sample(range(n), rng.randrange(0, n + 1)))
    facts = np.array(
        [
            (
                rng.randrange(len(names)), rng.randrange(len(names)), rng.randrange(len(names)),
                rng.randrange(0, 10**6) + 10**6, rng.randrange(0, 10**6), rng.randrange(0, 2**62),
                rng.choice((0, 4607182418800017408, 4608083138725491507)),
                rng.choice((0, 17, 2**40)), rng.choice((10**18, 10**18 + 5)),
            )
            for _ in admitted
        ],
        dtype=np.int64,
    ).reshape(len(admitted), 9)  # fmt: skip
    tenants = [rng.choice(_WORDS) for _ in range(n)]
    requests = [rng.choice(_WORDS) + str(i) for i in range(n)]
    return facts, admitted, tenants, requests, names


def _body_of(lane: int, pool: int, bits: int, window: int, at: int) -> bytes:
    # any bytes the service builds; here distinct per five, of varied lengths
    return struct.pack(">qqqqq", lane, pool, bits, window, at)[: 20 + (lane + pool) % 21]


def test_sign_rows_matches_the_documented_message(build: ModuleType) -> None:
    rng = random.Random(2)
    for _ in range(60):
        block = rng.randbytes(64)
        n = rng.randrange(1, 60)
        facts, admitted, tenants, requests, names = _batch(rng, n)
        asked: list[tuple[int, ...]] = []

        def body_of(*five: int, asked: list[tuple[int, ...]] = asked) -> bytes:
            asked.append(five)
            return _body_of(*five)

        out = build.MacKey(block).sign_rows(facts, admitted, n, tenants, requests, names, body_of)
        assert len(out) == n
        for i in set(range(n)) - set(admitted):
            assert out[i] == b""
        for j, i in enumerate(admitted):
            lane, pool, model, reserved, granted, rid, bits, window, at = facts[j].tolist()
            body = _body_of(lane, pool, bits, window, at)
            t, r, m = tenants[i].encode(), requests[i].encode(), names[model].encode()
            msg = body + _FACTS.pack(reserved - granted, granted, rid, len(t), len(r), len(m))
            assert out[i] == body + _hmac16(block, msg + t + r + m)
        # each distinct body is asked for (at least) once, never for nothing
        assert set(asked) == {tuple(f[k] for k in (0, 1, 6, 7, 8)) for f in facts.tolist()}


def test_more_distinct_bodies_than_kept_still_sign_right(build: ModuleType) -> None:
    rng = random.Random(3)
    n = 100
    facts, _, tenants, requests, names = _batch(rng, n)
    facts = np.array(
        [(1, 2, 4, 10**6, 10, i, 0, 0, 10**18 + i % 37) for i in range(n)], dtype=np.int64
    )
    block = rng.randbytes(64)
    every = list(range(n))
    out = build.MacKey(block).sign_rows(facts, every, n, tenants, requests, names, _body_of)
    ref = _sign_py.MacKey(block).sign_rows(facts, every, n, tenants, requests, names, _body_of)
    assert out == ref
