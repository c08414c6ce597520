"""`burstgate pools status`: what each engine pool of a running server is
asked and needs, for an operator or an autoscaler's owner
(docs/autoscaling.md "Signals"), over the admin API (GetServerState)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from controlplane.cli.common import (
    JsonOpt,
    admin_client,
    connect_options,
    echo_json,
    fail,
    to_dict,
)
from controlplane.cli.render import table

POOLS_HELP = """Engine pools of a running server: demand, backlog, desired engines.

Per pool: the engines reporting, what users ask of it (prompt tokens and
requests per second over the last 10 s: admitted, held, refused for
capacity), the engines it needs now and an engine start-up from now, the
prefix-cache miss rate its engines report and the KV-cache eviction advice
its load reports are answered with (docs/sidecar.md, "Eviction advice"); per
lane, the requests and prompt tokens burstgate holds for it and how long a
new one would wait. The same numbers as /metrics (docs/autoscaling.md).

Connection: --target / BURSTGATE_ADMIN_TARGET, --api-key / BURSTGATE_API_KEY, as
for `burstgate admin`."""

pools_app = typer.Typer(help=POOLS_HELP, no_args_is_help=True)
pools_app.callback()(connect_options)

POOL_COLUMNS = ("pool", "engines", "demand_tok_s", "demand_req_s", "desired", "predicted",
                "tok_s_per_engine", "miss_rate", "evict_below_reuse_s")  # fmt: skip
LANE_COLUMNS = ("pool", "lane", "held", "held_tokens", "wait_s")


def _num(value: float, places: int = 1) -> str:
    return f"{value:,.{places}f}"


def pool_rows(pools: Any) -> list[dict[str, Any]]:
    return [
        {
            "pool": p.pool,
            "engines": p.engines_reporting,
            "demand_tok_s": _num(p.demand_tokens_per_second),
            "demand_req_s": _num(p.demand_requests_per_second, 2),
            "desired": p.desired_engines,
            "predicted": p.desired_engines_predicted,
            "tok_s_per_engine": _num(p.work_rate_tokens_per_second_per_engine)
            if p.HasField("work_rate_tokens_per_second_per_engine")
            else "not learned",
            "miss_rate": _num(p.kv_cache_miss_rate, 3)
            if p.HasField("kv_cache_miss_rate")
            else "not measured",
            "evict_below_reuse_s": _num(p.evict_below_reuse_per_s, 2),
        }
        for p in pools
    ]


def lane_rows(pools: Any) -> list[dict[str, Any]]:
    return [
        {
            "pool": p.pool,
            "lane": b.lane,
            "held": b.requests,
            "held_tokens": b.tokens,
            "wait_s": _num(b.predicted_wait_seconds, 3)
            if b.HasField("predicted_wait_seconds")
            else "unknown",
        }
        for p in pools
        for b in p.lanes
    ]


@pools_app.command("status")
def pools_status(
    ctx: typer.Context,
    pool: Annotated[
        str | None, typer.Option(help="Only this engine pool.", show_default=False)
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Demand, backlog and desired engines per pool (and per lane).

    "predicted" is the engines needed an engine start-up from now
    (BURSTGATE_AUTOSCALE_ENGINE_STARTUP_S) from the demand forecast;
    "tok_s_per_engine" the work rate per engine the pool gate learned
    ("not learned" before it paced a backlog: desired is then the engines
    reporting); "miss_rate" the prefix-cache miss rate of the engines' fresh
    reports ("not measured" when none sends it); "evict_below_reuse_s" the
    eviction advice: evict cached blocks reused less often than this many
    times a second; "wait_s" how long a new request of the lane would wait
    before release ("unknown" while work is held and the pace is not known)."""
    from burstgate_client.admin import apb

    with admin_client(ctx) as c:
        state = c.call("GetServerState", apb.GetServerStateRequest())
    pools = [p for p in state.pools if pool is None or p.pool == pool]
    if pool is not None and not pools:
        known = ", ".join(p.pool for p in state.pools) or "none"
        fail(f"no pool {pool!r} on this server (pools: {known})")
    if as_json:
        echo_json([to_dict(p) for p in pools])
        return
    table(pool_rows(pools), POOL_COLUMNS)
    lanes = lane_rows(pools)
    if lanes:
        typer.echo("")
        table(lanes, LANE_COLUMNS)
