"""Per-tenant and per-lane metric families, under a bounded tenant label.

The service counts per tenant *slot* (controlplane/service/stats.py); here,
at scrape time, each slot becomes a ``tenant`` label value:

- the first ``BURSTGATE_METRICS_TENANT_LABEL_LIMIT`` tenants to show up in
  the counters (or all of them, while the configured tenants fit) get their
  own value, and keep it for the life of the process: a counter series
  never moves between values, so ``rate()`` stays right;
- every later tenant is counted under ``__other__``;
- an Admit whose tenant id is not configured (refused ``unknown_tenant``;
  its id is whatever the client sent) is counted under ``__unknown__``.

The two reserved values start and end with two underscores so that a real
tenant is unlikely to be named the same; if one is, their series merge.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from controlplane.domain import Decision
from controlplane.service import AdmissionService
from fastpath import Reason

OTHER = "__other__"
UNKNOWN = "__unknown__"
NANOS = 1_000_000_000  # money is kept in nanos of the currency unit

_OK = int(Reason.OK)
_REASON = {int(r): r.name.lower() for r in Reason}
_ADMIT = Decision.ADMIT.name.lower()
_REJECT = Decision.REJECT.name.lower()


class TenantLabels:
    """Which tenants have a ``tenant`` label value of their own; the rest
    share ``__other__``. Called from scrape threads (several may scrape at
    once, hence the lock; the event loop never calls it)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._own: set[str] = set()
        self._lock = threading.Lock()

    def label(self, tenant_id: str, *, assign: bool = True) -> str:
        """``tenant_id``'s label value; with ``assign``, a tenant seen for
        the first time gets its own value while there is room."""
        own = self._own
        if tenant_id in own:
            return tenant_id
        if not assign:
            return OTHER
        with self._lock:
            if tenant_id in own:
                return tenant_id
            if len(own) < self.limit:
                own.add(tenant_id)
                return tenant_id
        return OTHER

    def assign_all(self, tenant_ids: Iterable[str]) -> None:
        """Give every one of ``tenant_ids`` its own value if all of them fit
        in what is left (while the configured tenants fit, all have one)."""
        with self._lock:
            new = set(tenant_ids) - self._own
            if len(self._own) + len(new) <= self.limit:
                self._own |= new


def tenant_families(service: AdmissionService, labels: TenantLabels) -> Iterator[Metric]:
    """Decisions, tokens and spend by tenant and lane, from ``service.stats``."""
    st = service.stats
    # Copies first (the event loop keeps counting), then the slot names: a
    # slot in the copies is always named (slots are appended, never reused).
    outcomes = [((slot, lane, reason), (n, t)) for slot, lane, reason, n, t in st.outcome_cells()]
    settled = [(k, (c[0], c[1])) for k, c in st.settled.copy().items()]
    spend = [(k, (c[0], c[1])) for k, c in st.spend.copy().items()]
    shadow = st.shadow.copy()
    names = service.views.tenant_ids_by_slot()
    label_of: dict[int, str] = {-1: UNKNOWN}
    active = {k[0] for k, _ in outcomes} | {k[0] for k, _ in settled} | {k[0] for k, _ in spend}
    active |= {k[0] for k in shadow}
    for slot in sorted(active - {-1}):  # in slot order: deterministic within a scrape
        label_of[slot] = labels.label(names[slot])

    decisions = CounterMetricFamily(
        "burstgate_decisions",
        "Admission decisions by tenant, lane, outcome and reason",
        labels=["tenant", "lane", "decision", "reason"],
    )
    admitted = CounterMetricFamily(
        "burstgate_tenant_admitted_tokens",
        "Tokens reserved by admitted requests (prompt + granted max_tokens), by tenant and lane",
        labels=["tenant", "lane"],
    )
    by_decision: dict[tuple[str, str, int], int] = {}
    by_admitted: dict[tuple[str, str], int] = {}
    for (slot, lane, reason), (n, tokens) in outcomes:
        tenant = label_of[slot]
        dk = (tenant, lane, reason)
        by_decision[dk] = by_decision.get(dk, 0) + n
        if reason == _OK:
            by_admitted[(tenant, lane)] = by_admitted.get((tenant, lane), 0) + tokens
    for (tenant, lane, reason), n in sorted(by_decision.items()):
        decision = _ADMIT if reason == _OK else _REJECT
        decisions.add_metric([tenant, lane, decision, _REASON.get(reason, str(reason))], n)
    for pair, tokens in sorted(by_admitted.items()):
        admitted.add_metric(list(pair), tokens)
    yield decisions
    yield admitted

    completes = CounterMetricFamily(
        "burstgate_tenant_settled_requests",
        "Completes settled, by tenant and lane",
        labels=["tenant", "lane"],
    )
    used = CounterMetricFamily(
        "burstgate_tenant_settled_tokens",
        "Tokens used (prompt + generated) as reported by Complete, by tenant and lane",
        labels=["tenant", "lane"],
    )
    for skey, (n, tokens) in _regroup(settled, lambda k: (label_of[k[0]], k[1])):
        completes.add_metric(list(skey), n)
        used.add_metric(list(skey), tokens)
    yield completes
    yield used

    charge = CounterMetricFamily(
        "burstgate_tenant_user_charge",
        "User ledger: what the tenants were charged, in units of the currency",
        labels=["tenant", "lane", "currency"],
    )
    cost = CounterMetricFamily(
        "burstgate_tenant_actual_cost",
        "Cost ledger: what serving the tenants cost, in units of the currency",
        labels=["tenant", "lane", "currency"],
    )
    for mkey, (user_nanos, cost_nanos) in _regroup(spend, lambda k: (label_of[k[0]], *k[1:])):
        charge.add_metric(list(mkey), user_nanos / NANOS)
        cost.add_metric(list(mkey), cost_nanos / NANOS)
    yield charge
    yield cost

    would = CounterMetricFamily(
        "burstgate_shadow_refusals",
        "Shadow mode: requests admitted that would have been refused, by tenant and reason",
        labels=["tenant", "reason"],
    )
    by_would: dict[tuple[str, int], int] = {}
    for (slot, reason), n in shadow.items():
        wk = (label_of[slot], reason)
        by_would[wk] = by_would.get(wk, 0) + n
    for (tenant, reason), n in sorted(by_would.items()):
        would.add_metric([tenant, _REASON.get(reason, str(reason))], n)
    yield would


def _regroup(
    rows: list[tuple[Any, tuple[int, int]]], relabel: Callable[[Any], tuple[str, ...]]
) -> list[tuple[tuple[str, ...], tuple[int, int]]]:
    """Pairs of counts summed under new keys (tenants past the cap merge)."""
    out: dict[tuple[str, ...], tuple[int, int]] = {}
    for key, (a, b) in rows:
        new = relabel(key)
        pa, pb = out.get(new, (0, 0))
        out[new] = (pa + a, pb + b)
    return sorted(out.items())
