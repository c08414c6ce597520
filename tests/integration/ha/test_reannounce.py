"""Open reservations re-announced to a new owner (docs/ha.md,
"Re-announcing open reservations"), on real PostgreSQL and real gRPC: two
in-process replicas, TTL 1 s, no engine load reports (the pool gate in its
fallback mode, at most ``FALLBACK`` requests in flight).

Replica A admits ``OPEN`` requests through the SDK at a pricing multiplier
of 1.2 and crashes (coordinator cancelled, nothing released). The SDK's next
Admits for the pool fail over to B; before sending them it re-announces its
open reservations there. B takes the cell over, holds the pool's gate until
they are counted, then releases only ``FALLBACK - OPEN`` new requests; each
Complete is refunded and billed once at the multiplier locked on A."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import grpc
import pytest
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client._proto.burstgate.v1 import admission_pb2_grpc as pb_grpc
from burstgate_client.sdk import Admission, AsyncAdmissionClient

from controlplane.domain.policy import Policy
from controlplane.domain.rendezvous import owner_of
from controlplane.store.db import upgrade
from tests.conftest import fresh_pg_database
from tests.integration.ledger.conftest import ledger_rows
from tests.integration.sdk.conftest import SLOW_OK, Plane, tenant
from tests.support import add_tenants, wait_until

pytestmark = pytest.mark.slow

FALLBACK = 40  # the pool gate's in-flight limit without load reports
OPEN = 30  # reservations open on A when it crashes
NEW = 20  # Admits sent to the pool after the crash, at once
PROMPT, MAX_TOKENS, USED = 10, 10, 4
TTL = 1.0
SETTINGS = {
    "ha_lease_ttl_s": TTL, "ha_margin_s": 0.25, "pricing_window_s": 2,
    "policy": Policy(gate_fallback_inflight=FALLBACK),
}  # fmt: skip


@pytest.fixture
def pair(pg_admin_dsn: str, tmp_path: Path) -> Iterator[tuple[Plane, Plane, str]]:
    """Replicas A (r0) and B (r1), and a pool whose cell A owns by HRW."""
    pool = next(f"px{i}" for i in range(100) if owner_of(f"px{i}", ["r0", "r1"]) == "r0")
    for url in fresh_pg_database(pg_admin_dsn):
        upgrade(url)
        add_tenants(url, tenant("acme"))
        declared = {"policy": Policy(gate_fallback_inflight=FALLBACK, known_pools=[pool])}
        planes = [Plane(url, {**SETTINGS, **declared, "ha_member_id": f"r{i}"},
                        tmp_path / f"s{i}") for i in range(2)]  # fmt: skip
        for p in planes:
            p.start()
        try:
            yield planes[0], planes[1], pool
        finally:
            for p in planes:
                p.stop()
                if p.proxy is not None:
                    p.proxy.close()


def entry(rid: str, pool: str, **kw: object) -> pb.OpenReservation:
    fields: dict[str, object] = {
        "tenant_id": "acme", "request_id": rid, "pool": pool, "prompt_tokens": PROMPT,
        "max_tokens": MAX_TOKENS, "reserved_tokens": PROMPT + MAX_TOKENS,
        "granted_max_tokens": MAX_TOKENS, "pricing_multiplier": "1.200000",
    }  # fmt: skip
    return pb.OpenReservation(**(fields | kw))  # type: ignore[arg-type]


async def keep_admitting(
    sdk: AsyncAdmissionClient, pool: str, prefix: str, n: int
) -> list[Admission]:
    """Admit ``n`` requests at once, resending those no replica decided
    (the old owner's lease still runs): the SDK's offline answer, or
    NOT_OWNER once its redirects are spent."""

    async def one(rid: str) -> Admission:
        while True:
            a = await sdk.admit("acme", rid, prompt_tokens=PROMPT, max_tokens=MAX_TOKENS,
                                pool=pool)  # fmt: skip
            if not a.offline and a.reason != "not_owner":
                return a
            await asyncio.sleep(0.05)

    return list(await asyncio.gather(*(one(f"{prefix}-{i}") for i in range(n))))


def until_leases_are_short(url: str) -> None:
    """Until every cell lease and tenant share runs out within two TTLs: a
    replica that started alone took them for ``ha_lone_ttl_s`` (30 s,
    docs/ha.md "Database outages") and shortens them at its first renew after
    B joined; a crash before that would leave its cells to B only after half
    a minute, and B's share of the tenant's rate near zero until then."""
    import psycopg

    def short() -> bool:
        with psycopg.connect(url) as conn:
            row = conn.execute(
                "SELECT (SELECT max(EXTRACT(EPOCH FROM expires_at - clock_timestamp()))"
                " FROM ha_cell_leases WHERE owner IS NOT NULL),"
                " (SELECT coalesce(max(EXTRACT(EPOCH FROM expires_at - clock_timestamp())), 0)"
                " FROM ha_tenant_rates)"
            ).fetchone()
        return row is not None and row[0] is not None and max(row) < 2 * TTL

    wait_until(short, message="the leases to be renewed at the TTL of two members")


def reannounce(p: Plane, *entries: pb.OpenReservation) -> pb.ReannounceResponse:
    with grpc.insecure_channel(p.direct) as ch:
        res: pb.ReannounceResponse = pb_grpc.AdmissionServiceStub(ch).Reannounce(
            pb.ReannounceRequest(reservations=entries), timeout=10
        )
        return res


def test_open_reservations_move_to_the_new_owner_and_the_gate_never_exceeds_its_limit(
    pair: tuple[Plane, Plane, str],
) -> None:
    a, b, pool = pair
    assert a.srv is not None and b.srv is not None
    bsrv = b.srv
    # Before the crash, B is not the owner: it takes nothing and names A.
    res = reannounce(b, entry("probe", pool))
    assert list(res.outcome) == [pb.REANNOUNCE_OUTCOME_NOT_OWNER] and res.not_owner == 1
    assert list(res.owner) == [a.direct]

    held: dict[str, Admission] = {}

    async def run() -> tuple[int, list[str], float]:
        async with AsyncAdmissionClient(
            f"{a.direct},{b.direct}", deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK
        ) as sdk:
            # a 0.9 cache-miss rate in one pricing window: 1.2 in the next
            warm = await sdk.admit("acme", "warm", prompt_tokens=1, max_tokens=1, pool=pool)
            assert warm.admitted and warm.pricing_multiplier == "1.000000"
            await sdk.complete("acme", "warm", prompt_tokens=1, generated_tokens=1,
                               kv_cache_miss_rate=0.9)  # fmt: skip
            asrv = a.srv
            assert asrv is not None
            asvc = asrv.plane.service

            def next_window() -> bool:
                quote = asrv.on_loop(lambda: asvc.pricing.quote(pool, "", asvc.clock()))
                return bool(quote.multiplier == 1.2)

            await asyncio.to_thread(wait_until, next_window, message="the next pricing window")
            opened = [
                await sdk.admit(
                    "acme", f"open-{i}", prompt_tokens=PROMPT, max_tokens=MAX_TOKENS, pool=pool
                )
                for i in range(OPEN)
            ]
            assert all(o.admitted and not o.offline for o in opened)
            locked = {o.pricing_multiplier for o in opened}
            assert locked == {"1.200000"}, locked
            # A crashes: nothing released, its leases run out on the clock
            await asyncio.to_thread(until_leases_are_short, a.url)
            asrv._run(asrv.plane.ownership.crash())
            await asyncio.to_thread(a.stop)
            # The pool's traffic goes on: this sidecar's and another one's
            # (which holds nothing open: only the gate's hold protects its
            # Admits from being released before the re-announce is counted).
            async with AsyncAdmissionClient(
                b.direct, deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK
            ) as other:
                mine = keep_admitting(sdk, pool, "mine", 5)
                theirs = keep_admitting(other, pool, "theirs", NEW)
                news = [*await mine, *await theirs]
            admitted_new = [n for n in news if n.admitted]
            held.update({a.request_id: a for a in [*opened, *news]})
            restored = sdk.counters.reannounce_restored
            mine_open = sum(n.request_id.startswith("mine") for n in admitted_new)
            assert sdk.open_admissions == OPEN + mine_open
            for i in range(OPEN):
                done = await sdk.complete("acme", f"open-{i}", prompt_tokens=PROMPT,
                                          generated_tokens=USED)  # fmt: skip
                assert done.delivered and not done.duplicate, done
                assert done.pricing_multiplier == "1.200000", done
            answers.update(f"{n.reason or 'admitted'}{' (offline)' if n.offline else ''}"
                           for n in news)  # fmt: skip
            return len(admitted_new), sorted(locked), restored / OPEN

    answers: Counter[str] = Counter()
    admitted_new, _, fraction = asyncio.run(run())
    print(f"\nre-announced and restored: {fraction:.1%} of {OPEN} open reservations; "
          f"B released {admitted_new} new (limit {FALLBACK} - {OPEN} restored)")  # fmt: skip
    assert fraction >= 0.99
    # B counted the restored ones before releasing: the fallback limit held
    assert admitted_new == FALLBACK - OPEN, answers
    svc = bsrv.plane.service
    assert bsrv.on_loop(lambda: svc.stats.restored_total) == OPEN
    # the restored reservations were settled (refunded): only the new ones remain
    assert bsrv.on_loop(lambda: svc.views.gate_inflight(pool)) == admitted_new
    assert bsrv.on_loop(lambda: svc.views.tenant_state("acme")["inflight"]) == admitted_new
    rows = ledger_rows(b.url, "request_id LIKE 'open-%'")
    assert len(rows) == OPEN  # each billed exactly once
    for r in rows:
        assert r.pricing_multiplier == Decimal("1.200000")  # locked on A
        assert r.reserved_tokens == PROMPT + MAX_TOKENS  # its reservation, not an offline booking
        assert r.output_tokens == USED

    # Idempotent: re-announcing settled (and open) ones again changes nothing.
    # Their tokens as the SDK got them: open-0's signed by A, theirs-0's by B
    # (the deployment's one key, in the database).
    before = bsrv.on_loop(lambda: svc.views.tenant_state("acme"))

    def signed(rid: str) -> pb.OpenReservation:
        a = held[rid]
        return entry(rid, pool, reservation_id=a.reservation_id, pricing_multiplier="",
                     admission_token=a.admission_token)  # fmt: skip

    again = reannounce(b, signed("open-0"), signed("theirs-0"))
    assert (again.restored, again.already_known, again.refused) == (0, 2, 0), again
    # Not signed: refused, whatever this replica holds.
    forged = reannounce(b, entry("open-1", pool), entry("forged", pool))
    assert list(forged.outcome) == [pb.REANNOUNCE_OUTCOME_REFUSED] * 2, forged
    assert bsrv.on_loop(lambda: svc.views.tenant_state("acme"))["inflight"] == before["inflight"]
    # Bad input names the entry and its field, and takes nothing.
    with pytest.raises(grpc.RpcError) as err:
        reannounce(b, entry("bad-0", pool), entry("bad-1", pool, reserved_tokens=7))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("reservations[1].reserved_tokens: ")
    assert bsrv.on_loop(lambda: svc.views.record("acme", "bad-0")) is None


def test_a_complete_that_overtakes_the_hand_over_is_refunded_at_the_locked_multiplier(
    pair: tuple[Plane, Plane, str],
) -> None:
    """No Admit for the pool after the crash, so nothing re-announced the
    open reservation before its Complete reached the new owner, which
    answers NOT_FOUND: the SDK hands that reservation over and sends the
    Complete again, refunded at A's 1.2, not booked as offline at B's 1.0."""
    a, b, pool = pair
    assert a.srv is not None and b.srv is not None
    asrv, bsrv = a.srv, b.srv

    async def run() -> None:
        async with AsyncAdmissionClient(
            f"{a.direct},{b.direct}", deadline_s=SLOW_OK, connect_timeout_s=SLOW_OK
        ) as sdk:
            warm = await sdk.admit("acme", "warm", prompt_tokens=1, max_tokens=1, pool=pool)
            assert warm.admitted
            await sdk.complete("acme", "warm", prompt_tokens=1, generated_tokens=1,
                               kv_cache_miss_rate=0.9)  # fmt: skip
            asvc = asrv.plane.service

            def next_window() -> bool:
                quote = asrv.on_loop(lambda: asvc.pricing.quote(pool, "", asvc.clock()))
                return bool(quote.multiplier == 1.2)

            await asyncio.to_thread(wait_until, next_window, message="the next pricing window")
            held = await sdk.admit("acme", "held", prompt_tokens=PROMPT, max_tokens=MAX_TOKENS,
                                   pool=pool)  # fmt: skip
            assert held.admitted and held.pricing_multiplier == "1.200000"
            await asyncio.to_thread(until_leases_are_short, a.url)
            asrv._run(asrv.plane.ownership.crash())
            await asyncio.to_thread(a.stop)
            # B claims the cell once A's lease has run out (as an Admit would)
            await asyncio.to_thread(
                wait_until, lambda: bsrv._run(bsrv.plane.ownership.route(pool)) is None,
                message="B to take the pool's cell over",
            )  # fmt: skip
            assert sdk.counters.reannounced == 0
            done = await sdk.complete("acme", "held", prompt_tokens=PROMPT, generated_tokens=USED)
            assert done.delivered and not done.duplicate, done
            assert done.pricing_multiplier == "1.200000", done
            assert sdk.counters.reannounce_restored == 1
            assert sdk.open_admissions == 0

    asyncio.run(run())
    svc = bsrv.plane.service
    assert bsrv.on_loop(lambda: svc.stats.restored_total) == 1
    assert bsrv.on_loop(lambda: svc.views.gate_inflight(pool)) == 0
    [row] = ledger_rows(b.url, "request_id = 'held'")
    assert row.pricing_multiplier == Decimal("1.200000")
    assert row.reserved_tokens == PROMPT + MAX_TOKENS  # its reservation, not an offline booking
    assert row.output_tokens == USED
