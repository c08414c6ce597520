"""Complete's sidecar timestamps are range-checked against the server's
clock (reliability issue, bug 7): `exec_start_unix_ns=-5`,
`exec_end_unix_ns=-2**63` and `2**63-1` were billed and exported as 1969,
1677 and 2262. Accepted: 0 (unset), or within [now - reservation TTL - 1
day, now + 1 h] (docs/ledger.md; the proto's comment).
Over real gRPC, SQLite and PostgreSQL, with the injected clock."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest
from burstgate_client.protoclient import ProtoClient

from tests.integration.ledger.conftest import NS, Served, complete, ledger_rows, setup_db

HOUR = 3600 * NS
DAY = 24 * HOUR
TTL = 600 * NS  # the default reservation TTL


def _bad_times(now: int) -> list[tuple[dict[str, int], str]]:
    return [
        ({"exec_start_unix_ns": -5}, "exec_start_unix_ns"),
        ({"exec_end_unix_ns": -(2**63)}, "exec_end_unix_ns"),
        ({"exec_end_unix_ns": 2**63 - 1}, "exec_end_unix_ns"),
        ({"exec_start_unix_ns": 2**63 - 1}, "exec_start_unix_ns"),
        ({"exec_start_unix_ns": now - TTL - DAY - 1}, "exec_start_unix_ns"),
        ({"exec_end_unix_ns": now + HOUR + 1}, "exec_end_unix_ns"),
        ({"exec_start_unix_ns": now - 5, "exec_end_unix_ns": now + 2 * HOUR}, "exec_end_unix_ns"),
        ({"exec_start_unix_ns": 1, "exec_end_unix_ns": now}, "exec_start_unix_ns"),
    ]


def test_out_of_window_times_are_refused_and_nothing_is_billed(served: Served, clock: Any) -> None:
    c = served.client
    now = clock()
    c.admit("acme", "r1", prompt_tokens=100, max_tokens=100)
    for times, field in _bad_times(now):
        with pytest.raises(grpc.RpcError) as err:
            complete(c, "acme", "r1", prompt_tokens=100, generated_tokens=10, **times)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, times
        assert err.value.details().startswith(f"{field}: "), (times, err.value.details())
        assert "is outside" in err.value.details(), err.value.details()
    assert ledger_rows(served.url) == []  # nothing billed
    assert served.srv.on_loop(lambda: served.srv.plane.service.views.open_reservations) == 1
    # The window's own edges are accepted, and recorded as sent.
    start, end = now - TTL - DAY, now + HOUR
    ok = complete(c, "acme", "r1", prompt_tokens=100, generated_tokens=10,
                  exec_start_unix_ns=start, exec_end_unix_ns=end)  # fmt: skip
    assert not ok.duplicate
    (row,) = ledger_rows(served.url)
    assert (row.exec_start_ns, row.end_ns) == (start, end)


def test_the_window_follows_the_server_clock(served: Served, clock: Any) -> None:
    c = served.client
    c.admit("acme", "late", prompt_tokens=10, max_tokens=10)
    sent = clock() + HOUR + 10 * NS  # just past the hour ahead: refused now
    with pytest.raises(grpc.RpcError) as err:
        complete(c, "acme", "late", prompt_tokens=10, exec_end_unix_ns=sent)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    clock.advance(20 * NS)  # well within the TTL: the reservation is still open
    complete(c, "acme", "late", prompt_tokens=10, exec_end_unix_ns=sent)
    (row,) = ledger_rows(served.url)
    assert row.end_ns == sent


def test_refused_without_metering_too(
    migrated_url: str, make_server: Callable[..., Any], clock: Any
) -> None:
    """Without the ledger the times are not recorded, but the API is the
    same: a bad one is INVALID_ARGUMENT and the reservation stays open."""
    setup_db(migrated_url, "acme")
    srv = make_server(migrated_url, clock=clock, ledger_enabled=False)
    with ProtoClient(srv.target) as c:
        c.admit("acme", "r", prompt_tokens=10, max_tokens=10)
        with pytest.raises(grpc.RpcError) as err:
            complete(c, "acme", "r", prompt_tokens=10, exec_start_unix_ns=-5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("exec_start_unix_ns: ")
        assert srv.on_loop(lambda: srv.plane.service.views.open_reservations) == 1
        assert not complete(c, "acme", "r", prompt_tokens=10).duplicate
