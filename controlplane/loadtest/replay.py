"""A recorded trace as a load plan (``burstgate replay``): every row one
request at its own time, divided by ``speed``, with its real prompt and
output lengths (the output as the request's ``max_tokens``).

Tenants and lanes (``assign``):

- ``hash`` (default): each row gets one of the ``--tenant`` specs by a hash
  of its row number, in proportion to their weights, as ``simulate`` assigns
  its tenants: the same trace gets the same assignment every time. A row
  goes only to a tenant whose ``max_request_tokens`` (known for the default
  tenants, demofit.py) it fits: the trace's lengths are kept, and a long
  request is not refused for a cap the real tenant would not have met;
- ``column``: the log's tenant column names the tenant (and its lane column,
  when it has one, the lane); the tenants must exist on the server.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from itertools import accumulate

import numpy as np

from controlplane.analysis.logdata import RequestLog
from controlplane.loadtest.profile import MAX_TOTAL_S, Arrival, Phase, Tenant

US_PER_S = 1_000_000


def _bucket(row: int, seed: int) -> float:
    digest = hashlib.blake2b(f"{seed}:{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def _fitting(tenants: list[Tenant], tokens: int) -> list[Tenant]:
    """The tenants whose per-request cap a request of ``tokens`` fits (all
    of them when none does: it is sent, and refused, as recorded)."""
    fit = [t for t in tenants if not t.max_request_tokens or tokens <= t.max_request_tokens]
    return fit or tenants


def _pick(tenants: list[Tenant], bucket: float) -> Tenant:
    """The tenant of a row's hash bucket (0..1), in proportion to weights."""
    bounds = list(accumulate(t.weight for t in tenants))
    return tenants[min(len(tenants) - 1, bisect_right(bounds, bucket * bounds[-1]))]


def plan(
    log: RequestLog,
    *,
    speed: float,
    tenants: list[Tenant],
    assign: str = "hash",
    limit: int | None = None,
    seed: int = 0,
) -> tuple[list[Phase], list[Arrival]]:
    """The replay's one phase ("replay") and its arrivals in time order."""
    if not speed > 0:
        raise ValueError(f"--speed: must be > 0, got {speed:g}")
    if len(log) == 0:
        raise ValueError("the trace has no requests")
    if not log.has_tokens:
        raise ValueError("the trace has no token columns: map them with --prompt-col/--output-col")
    if assign == "column" and not log.has_tenants:
        raise ValueError("--assign column: the trace has no tenant column (--tenant-col)")
    order = np.argsort(log.ts_us, kind="stable")
    if limit is not None:
        order = order[:limit]
    t0 = int(log.ts_us[order[0]])
    span_s = (int(log.ts_us[order[-1]]) - t0) / US_PER_S / speed
    if span_s > MAX_TOTAL_S:
        raise ValueError(
            f"the replay would last {span_s:,.0f} s at --speed {speed:g} (at most "
            f"{MAX_TOTAL_S:,.0f} s): raise --speed or use --limit"
        )
    arrivals: list[Arrival] = []
    for row in order.tolist():
        prompt, output = int(log.prompt_tokens[row]), max(1, int(log.output_tokens[row]))
        if assign == "column":
            lane = log.lane_names[log.lane_codes[row]] if "lane" in log.columns else ""
            tenant = Tenant(log.tenant_names[log.tenant_codes[row]], lane)
        else:
            tenant = _pick(_fitting(tenants, prompt + output), _bucket(row, seed))
        at = (int(log.ts_us[row]) - t0) / US_PER_S / speed
        arrivals.append(Arrival(at, "replay", tenant, prompt, output))
    end = max(span_s, 1e-3)
    return [Phase("replay", 0.0, end, len(arrivals) / end)], arrivals
