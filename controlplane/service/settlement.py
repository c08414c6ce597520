"""Settlement: a reservation ends with real usage, by expiry, or because its
caller went away. Each returns the reservation it ended (or None), and the
façade frees its capacity and dispatches; nothing here starts a dispatch."""

from __future__ import annotations

from controlplane.domain import Settlement
from controlplane.domain.errors import FailedPrecondition, InvalidArgument, NotFound, excerpt
from controlplane.domain.validate import check_fraction, check_id, check_tokens
from controlplane.service import records as R
from controlplane.service.records import Key, Record, RequestLog
from fastpath import Reason, TokenBucketTable
from fastpath.codes import MAX_REQUEST_TOKENS

# Usage above ratio x what was admitted, plus this slack, is refused as a
# sidecar bug rather than billed (a tokenizer mismatch stays well under).
OVERRUN_SLACK_TOKENS = 1024


def check_usage(
    tenant_id: str,
    request_id: str,
    prompt_tokens: int,
    generated_tokens: int,
    cached_prompt_tokens: int,
    kv_cache_miss_rate: float,
) -> None:
    """A Complete's own fields, before anything is looked up."""
    check_id("tenant_id", tenant_id)
    check_id("request_id", request_id)
    check_tokens("prompt_tokens", prompt_tokens)
    check_tokens("generated_tokens", generated_tokens)
    check_tokens("cached_prompt_tokens", cached_prompt_tokens)
    if cached_prompt_tokens > prompt_tokens:
        raise InvalidArgument(
            "cached_prompt_tokens",
            f"{cached_prompt_tokens} exceeds prompt_tokens {prompt_tokens}",
        )
    check_fraction("kv_cache_miss_rate", kv_cache_miss_rate)
    if prompt_tokens + generated_tokens > MAX_REQUEST_TOKENS:
        # the fast path's bound on one request: a larger usage could be
        # charged (an offline booking, Envoy's response path) and then not
        # settled; refused here, before anything changes, on every door
        raise InvalidArgument(
            "generated_tokens",
            f"prompt_tokens + generated_tokens = {prompt_tokens + generated_tokens:,} exceeds "
            f"{MAX_REQUEST_TOKENS:,}, the most one request may use",
        )


class Settler:
    def __init__(self, table: TokenBucketTable, log: RequestLog, max_overrun_ratio: float) -> None:
        self._table = table
        self._log = log
        self._ratio = max_overrun_ratio

    @property
    def max_overrun_ratio(self) -> float:
        return self._ratio

    def prepare(
        self,
        tenant_id: str,
        request_id: str,
        reservation_id: int,
        prompt_tokens: int,
        generated_tokens: int,
        cached_prompt_tokens: int,
        kv_cache_miss_rate: float,
    ) -> Settlement | Record:
        """Validate a Complete against memory without changing anything:
        the settlement (``duplicate=True``) when already settled, else the
        open record to settle."""
        check_usage(
            tenant_id, request_id, prompt_tokens, generated_tokens, cached_prompt_tokens,
            kv_cache_miss_rate,
        )  # fmt: skip
        rec = self._log.get((tenant_id, request_id))
        if rec is None:
            raise NotFound(
                "request_id",
                f"no reservation for tenant {excerpt(tenant_id)} request {excerpt(request_id)} "
                "(never admitted, or expired after reservation_ttl_s)",
            )
        if rec[R.STATE] == R.REJECTED:
            raise FailedPrecondition(
                f"request_id: request {excerpt(request_id)} was refused "
                f"({Reason(rec[R.REASON]).name}); there is nothing to settle"
            )
        if reservation_id and reservation_id != rec[R.RID]:
            raise InvalidArgument(
                "reservation_id",
                f"{reservation_id} is not the reservation of tenant {excerpt(tenant_id)} "
                f"request {excerpt(request_id)}",
            )
        reserved = rec[R.RESERVED]
        if rec[R.STATE] == R.SETTLED:
            return Settlement(request_id, reserved, rec[R.ACTUAL], rec[R.REFUNDED], duplicate=True)
        granted = rec[R.GRANTED]
        for name, used, admitted in (
            ("generated_tokens", generated_tokens, granted),
            ("prompt_tokens", prompt_tokens, reserved - granted),
        ):
            if used > admitted * self._ratio + OVERRUN_SLACK_TOKENS:
                raise InvalidArgument(
                    name,
                    f"{used:,} is more than {self._ratio:g}x the {admitted:,} admitted "
                    f"(+{OVERRUN_SLACK_TOKENS:,}); refused as a client error, nothing was settled",
                )
        return rec

    def apply(
        self, key: Key, rec: Record, actual: int, now: int
    ) -> tuple[Settlement, Record | None]:
        """Settle the record ``prepare`` returned: refund the unused
        reservation. Returns the settlement and the reservation it ended;
        if the reservation expired meanwhile (released without a refund)
        only the answer is built and nothing is freed."""
        reserved = rec[R.RESERVED]
        current = self._log.get(key)
        if current is None or current[R.STATE] != R.OPEN or current[R.RID] != rec[R.RID]:
            return Settlement(key[1], reserved, actual, 0), None
        refunded = self._table.settle(rec[R.SLOT], now, reserved, actual, rec[R.DECIDED_NS])
        self._log.settle(key, current, actual, refunded, now)
        return Settlement(key[1], reserved, actual, refunded), current

    def release_unseen(self, key: Key, now: int) -> Record | None:
        """An admission its caller never learned of (it went away in the same
        moment): nobody will run or settle it, so release it without a
        charge. Returns the reservation ended, None when settled or expired
        meanwhile."""
        rec = self._log.drop_open(key)
        if rec is None:
            return None
        self._table.release(rec[R.SLOT], now, rec[R.RESERVED])
        return rec

    def expire(self, now: int) -> list[Record]:
        """Release reservations older than the TTL (no refund: the tenant
        keeps paying for what it reserved) and forget old refusals; returns
        the reservations ended."""
        return self.end(self._log.expire(now), now)

    def end(self, records: list[Record], now: int) -> list[Record]:
        """End open reservations without a Complete (expired, or their pool
        moved to another replica): no refund, the tenant keeps paying for
        what it reserved; their slots are no longer in flight."""
        for rec in records:
            self._table.release(rec[R.SLOT], now, rec[R.RESERVED])
        return records
