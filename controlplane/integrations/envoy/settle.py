"""The response-path call (Envoy's ``apply_on_stream_done`` rate limit, with
the real token count): settle the request's reservation with it.

- an open reservation: Complete (refund what was not used, or the overrun);
- nothing known here (the request path only checked, or the reservation
  expired, or this server restarted): the usage is booked as an admission
  made elsewhere (``service/offline.py``, the sidecar's offline booking:
  charged its real usage whatever the bucket holds) and settled, so it is
  charged once; unless the ledger already has the request (a repeated
  delivery), then nothing;
- already settled: a duplicate, nothing changes;
- no usage and nothing open: nothing to do (e.g. the request was refused
  and Envoy's stream-done call reports the local 429 reply);
- ``usage: missing`` (a successful answer that carried no usage): settled
  at the reservation, or at the usage counted when more, never at zero.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from controlplane.domain.scope import KeyScope
from controlplane.integrations.envoy.mapping import Ask
from controlplane.service import AdmissionService
from controlplane.service.waiting import WaitingRoom

if TYPE_CHECKING:
    from controlplane.ledger.metering import Metering


@dataclass(frozen=True, slots=True)
class Settled:
    outcome: str  # settled | booked | duplicate | nothing
    reserved: int = 0
    actual: int = 0
    refunded: int = 0


def usage(ask: Ask) -> tuple[int, int]:
    """(prompt, generated): the entries' split, else all of hits_addend as
    generated tokens (Envoy's one number)."""
    if ask.prompt_tokens is not None and ask.completion_tokens is not None:
        return ask.prompt_tokens, ask.completion_tokens
    return 0, ask.tokens


async def settle(
    svc: AdmissionService,
    waiting: WaitingRoom,
    metering: Metering | None,
    ask: Ask,
    scope: KeyScope | None,
) -> Settled:
    """Raises the service's errors (InvalidArgument for an overrun beyond
    ``complete_max_overrun_ratio``, NotFound for an unknown tenant, ...)."""
    prompt, generated = usage(ask)
    rid = ask.request_id or uuid.uuid4().hex  # no id: a usage report of its own
    key = (ask.tenant, rid)
    rec = svc.views.record(*key)
    if ask.usage_missing and rec is not None and rec.is_open:
        # a successful answer without its usage is billed its reservation
        # (or what was counted, when more): never the zero it reported
        generated = max(generated, rec.reserved - prompt)
    booked = False
    if rec is None or rec.is_refused:
        if prompt + generated == 0:
            return Settled("nothing")
        svc.offline.check(ask.tenant, rid, ask.lane, ask.model, ask.pool, prompt, generated)
        if metering is not None and rec is None and await metering.find(key) is not None:
            return Settled("duplicate")  # billed by an earlier delivery
        booked = svc.offline.book(
            ask.tenant, rid, ask.lane, ask.model, ask.pool, prompt, generated,
            now=svc.clock(), scope=scope,
        )  # fmt: skip
    elif scope is not None:
        scope.check_pool("pool", rec.pool, "the reservation's pool")
    if metering is None:
        s = svc.complete(ask.tenant, rid, 0, prompt, generated)
        duplicate = s.duplicate
    else:
        r = await metering.complete(ask.tenant, rid, 0, prompt, generated)
        s, duplicate = r.settlement, r.duplicate
    if not duplicate:
        waiting.reschedule()  # a settlement may let waiters in
    outcome = "duplicate" if duplicate else ("booked" if booked else "settled")
    return Settled(outcome, s.reserved_tokens, s.actual_tokens, s.refunded_tokens)
