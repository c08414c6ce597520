"""A Complete's settlement in two steps, for a durable ledger write in
between: ``service.settlement``.

The server's metering (controlplane/ledger/metering.py) validates a
Complete against memory (``prepare``), makes its ledger record durable, and
only then refunds and frees the reservation (``apply``). In process,
``AdmissionService.complete`` runs both back to back."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from controlplane.domain import Settlement
from controlplane.service import records as R
from controlplane.service.gate import PoolGate
from controlplane.service.records import Key, Record
from controlplane.service.recordview import RecordView
from controlplane.service.settlement import Settler
from controlplane.service.stats import AdmissionStats


class Completions:
    """Validates and applies Completes; ended reservations go to ``released``."""

    def __init__(
        self, *, clock: Callable[[], int], settler: Settler, gate: PoolGate,
        stats: AdmissionStats, released: Callable[[list[Record], int, Sequence[str]], None],
    ) -> None:  # fmt: skip
        self._clock = clock
        self._settler = settler
        self._gate = gate
        self._stats = stats
        self._released = released

    def prepare(
        self, tenant_id: str, request_id: str, reservation_id: int, prompt_tokens: int,
        generated_tokens: int, cached_prompt_tokens: int = 0, kv_cache_miss_rate: float = 0.0,
    ) -> Settlement | RecordView:  # fmt: skip
        """Validate a Complete against memory without changing anything.

        Returns the settlement with ``duplicate=True`` when the request is
        already settled, else the open record to pass to :meth:`apply`.
        Raises InvalidArgument, NotFound (never admitted, or forgotten after
        the reservation TTL) or FailedPrecondition (refused)."""
        got = self._settler.prepare(
            tenant_id, request_id, reservation_id, prompt_tokens, generated_tokens,
            cached_prompt_tokens, kv_cache_miss_rate,
        )  # fmt: skip
        return got if isinstance(got, Settlement) else RecordView(got)

    def apply(
        self, key: Key, view: RecordView, actual: int, *, first_token_ns: int = 0
    ) -> Settlement:
        """Settle the record :meth:`prepare` returned: refund the unused
        reservation, free the slot. If the reservation expired in the
        meantime (it was released without a refund) only the answer is
        built. ``first_token_ns``: as in ``AdmissionService.complete``."""
        now = self._clock()
        rec = view.raw
        if first_token_ns and rec[R.POOL] and self._gate.enabled:
            released = rec[R.DECIDED_NS]
            if released < first_token_ns <= now:  # a time it could have been
                prompt = rec[R.RESERVED] - rec[R.GRANTED]  # what it was admitted with
                self._gate.observe_ttft(rec[R.POOL], prompt, first_token_ns - released)
        settlement, ended = self._settler.apply(key, rec, actual, now)
        self._stats.count_settled(rec, actual)
        if ended is not None:
            self._released([ended], now, ())
        return settlement
