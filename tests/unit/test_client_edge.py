"""The client distribution's edge rules (burstgate_client/edge.py and
errors.py) are the server's (controlplane/domain/validate.py and errors.py):
the client has its own copy so that it imports nothing of the server's, and
this test is what keeps the two copies one rule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from burstgate_client import edge
from burstgate_client import errors as client_errors
from hypothesis import given
from hypothesis import strategies as st

from controlplane import domain
from controlplane.domain import errors as server_errors
from controlplane.domain import validate


def test_the_bounds_are_the_servers() -> None:
    assert edge.MAX_ID_LEN == domain.MAX_ID_LEN
    assert edge.MAX_MODEL_LEN == domain.MAX_MODEL_LEN
    assert edge.MAX_TOKENS_PER_FIELD == domain.MAX_TOKENS_PER_FIELD
    assert edge.MAX_LANE_NAME == validate.MAX_LANE_NAME
    assert edge.MAX_POOL_LEN == validate.MAX_POOL_LEN
    assert client_errors.MAX_ECHO_CHARS == server_errors.MAX_ECHO_CHARS


def outcome(check: Callable[..., None], *args: Any, **kw: Any) -> str | None:
    """The message a check refuses with, or None when it passes."""
    try:
        check(*args, **kw)
    except (client_errors.InvalidArgument, server_errors.InvalidArgument) as exc:
        return str(exc)
    return None


# Texts near the bounds, with control characters and non-ASCII among them.
texts = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=300
) | st.sampled_from(["", "a" * 128, "a" * 129, "b" * 256, "c" * 257, "x\ny", "é" * 40])
ints = st.integers(min_value=-5, max_value=10_000_005) | st.sampled_from(
    [0, 10_000_000, 10_000_001, -1, 2**63]
)
fractions = st.floats(allow_nan=True, allow_infinity=True, min_value=None, max_value=None)


@given(value=texts, max_len=st.sampled_from([32, 128, 256]))
def test_ids_and_names(value: str, max_len: int) -> None:
    assert outcome(edge.check_id, "f", value, max_len=max_len) == outcome(
        validate.check_id, "f", value, max_len=max_len
    )
    assert outcome(edge.check_optional_name, "f", value, max_len=max_len) == outcome(
        validate.check_optional_name, "f", value, max_len=max_len
    )


@given(value=ints)
def test_tokens(value: int) -> None:
    assert outcome(edge.check_tokens, "f", value) == outcome(validate.check_tokens, "f", value)


@given(value=fractions)
def test_fractions(value: float) -> None:
    assert outcome(edge.check_fraction, "f", value) == outcome(
        validate.check_fraction, "f", value
    )


@given(value=texts | ints | st.binary(max_size=80))
def test_quoting(value: object) -> None:
    assert client_errors.excerpt(value) == server_errors.excerpt(value)


@pytest.mark.parametrize("value", ["", "a" * 129])
def test_a_refusal_names_the_field_as_the_server_does(value: str) -> None:
    with pytest.raises(client_errors.InvalidArgument) as client:
        edge.check_id("tenant_id", value)
    with pytest.raises(server_errors.InvalidArgument) as server:
        validate.check_id("tenant_id", value)
    assert (client.value.field, client.value.description) == (
        server.value.field,
        server.value.description,
    )
    assert isinstance(client.value, ValueError)  # what SDK callers catch
