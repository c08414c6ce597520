"""``burstgate pricing show|windows``: dynamic pricing of a running server,
over its gRPC API (``LedgerService``), with the connection options of
``burstgate admin`` (an admin or viewer key).

Everything shown comes from the API, nothing from the database: the
multiplier in force and the current window's measurements live in the
server's memory (stored only every 2 s), so the server is the one to ask.

- ``GetPricing``: window length, step table, margin warning ratio, and per
  (pool, model) the multiplier in force with the previous window's rate.
- ``ListPricingWindows``: stored windows; the server saves its open windows
  first, so the current window is there as it stands (``next_multiplier``
  of an open window is what its rate *so far* would set).
- ``ListMarginWarnings``: the warnings recorded per tenant and window.

The API has no "server time": the current window is the newest open one the
server listed (windows are aligned to the epoch, so with no traffic at all
it is computed from this machine's clock).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Annotated, Any

import typer

from controlplane.cli.common import (
    JsonOpt,
    admin_client,
    connect_options,
    echo_json,
    fail,
)
from controlplane.cli.render import kv, table
from controlplane.domain.errors import InvalidArgument
from controlplane.domain.units import NS_PER_MS, NS_PER_S

PRICING_HELP = """Dynamic pricing of a running server: multipliers, windows, margin warnings.

The multiplier in force and the next one per pool, the pricing windows with
their measured KV-cache miss rate, and margin warnings, over the API (an
admin or viewer key).

Connection: --target / BURSTGATE_ADMIN_TARGET, --api-key / BURSTGATE_API_KEY, as
for `burstgate admin`. Margins over any period: `burstgate margin`."""

pricing_app = typer.Typer(help=PRICING_HELP, no_args_is_help=True)
PoolOpt = Annotated[str | None, typer.Option(help="Only this engine pool.", show_default=False)]
# Windows listed by `show`: the current one and the one before, with room
# for a clock a window away from the server's.
LOOKBACK_WINDOWS = 3
WARNINGS_LOOKBACK_NS = 24 * 3600 * NS_PER_S
WINDOWS_LOOKBACK_NS = 3600 * NS_PER_S
POOL_COLUMNS = ("pool", "model", "multiplier", "next_multiplier", "miss_rate",
                "previous_miss_rate", "completions", "load_reports")  # fmt: skip
WINDOW_COLUMNS = ("window_start", "window_end", "pool", "model", "completions", "load_reports",
                  "miss_rate", "multiplier", "next_multiplier", "closed")  # fmt: skip
WARNING_COLUMNS = ("window_start", "tenant_id", "currency", "requests", "user_charge",
                   "actual_cost", "cost_ratio", "threshold")  # fmt: skip


pricing_app.callback()(connect_options)


# ----------------------------------------------------------------- helpers


def _when(option: str, value: str | None, default_ns: int) -> int:
    from controlplane.domain.exportspec import parse_when

    if value is None:
        return default_ns
    try:
        return parse_when(option, value)
    except InvalidArgument as exc:
        raise typer.BadParameter(exc.description, param_hint=f"'{option}'") from None


def _time(unix_s: int) -> datetime:
    return datetime.fromtimestamp(unix_s, UTC)


def _iso(unix_s: int) -> str:
    return _time(unix_s).strftime("%Y-%m-%dT%H:%M:%SZ")


def _rate(text: str) -> str | None:
    return text or None  # the API's "" = nothing measured


def window_json(w: Any) -> dict[str, Any]:
    """A PricingWindow as ``--json`` prints it (every field, times as Unix s
    and ISO 8601)."""
    end = w.window_start + w.window_ms // 1000
    return {
        "pool": w.pool,
        "model": w.model,
        "window_start": w.window_start,
        "window_start_time": _iso(w.window_start),
        "window_end_time": _iso(end),
        "window_ms": w.window_ms,
        "completions": w.completions,
        "load_reports": w.load_reports,
        "miss_rate": _rate(w.miss_rate),
        "multiplier": w.multiplier,
        "next_multiplier": w.next_multiplier,
        "closed": w.closed,
    }


def cost_ratio(actual_cost: str, user_charge: str) -> str | None:
    """actual cost / user charge of a warning's window, to 3 decimals (the
    warning fired because it is above the threshold); None when nothing was
    charged (any cost is then above every threshold)."""
    from decimal import ROUND_HALF_UP, Decimal, InvalidOperation

    try:
        cost, charge = Decimal(actual_cost), Decimal(user_charge)
    except InvalidOperation:
        return None
    if charge <= 0:
        return None
    return str((cost / charge).quantize(Decimal("0.001"), rounding=ROUND_HALF_UP))


def warning_json(w: Any) -> dict[str, Any]:
    """A MarginWarning: ``threshold`` is the ratio the server applied (the
    API's ``ratio``: a warning is recorded when actual_cost > threshold x
    user_charge), ``cost_ratio`` the window's actual cost / user charge."""
    return {
        "tenant_id": w.tenant_id,
        "window_start": w.window_start,
        "window_start_time": _iso(w.window_start),
        "window_ms": w.window_ms,
        "currency": w.currency,
        "requests": w.requests,
        "user_charge": w.user_charge,
        "actual_cost": w.actual_cost,
        "cost_ratio": cost_ratio(w.actual_cost, w.user_charge),
        "threshold": w.ratio,
    }


def pricing_view(
    state: Any, windows: Sequence[Any], warnings: Sequence[Any], now_ns: int, pool: str | None
) -> dict[str, Any]:
    """What ``pricing show`` prints, from the three API answers."""
    window_s = max(state.window_ms // 1000, 1)
    open_starts = [w.window_start for w in windows if not w.closed]
    current = max(open_starts) if open_starts else now_ns // NS_PER_S // window_s * window_s
    by_key = {(w.pool, w.model, w.window_start): w for w in windows}
    in_force = {(f.pool, f.model): f for f in state.in_force if not pool or f.pool == pool}
    keys = sorted({(w.pool, w.model) for w in windows if w.window_start == current} | set(in_force))
    pools = []
    for p, m in keys:
        cur = by_key.get((p, m, current))
        prev = by_key.get((p, m, current - window_s))
        f = in_force.get((p, m))
        previous_rate = _rate(f.previous_window_miss_rate) if f is not None else None
        if previous_rate is None and prev is not None:
            previous_rate = _rate(prev.miss_rate)
        if cur is not None:
            now_figures = {
                "multiplier": cur.multiplier,  # in force during the current window
                "next_multiplier": cur.next_multiplier,  # what its rate so far sets
                "miss_rate": _rate(cur.miss_rate),  # measured so far
            }
            counts = {"completions": cur.completions, "load_reports": cur.load_reports}
        else:  # not stored (yet): the server's series
            assert f is not None
            now_figures = {"multiplier": f.multiplier, "next_multiplier": None, "miss_rate": None}
            counts = {"completions": 0, "load_reports": 0}
        row = {"pool": p, "model": m, **now_figures, "previous_miss_rate": previous_rate, **counts}
        pools.append(row)
    return {
        "window_ms": state.window_ms,
        "current_window_start": current,
        "current_window_start_time": _iso(current),
        "next_window_start": current + window_s,
        "next_window_start_time": _iso(current + window_s),
        "steps": [
            {"above_miss_rate": s.above_miss_rate, "multiplier": s.multiplier} for s in state.steps
        ],
        "margin_warning_ratio": state.margin_warning_ratio,
        "pools": pools,
        "margin_warnings": [warning_json(w) for w in warnings],
    }


def _ledger(c: Any) -> Any:
    from burstgate_client._proto.burstgate.v1 import ledger_pb2_grpc as lpb_grpc

    return lpb_grpc.LedgerServiceStub(c.channel)


NO_LEDGER = (
    "the server runs without the ledger (BURSTGATE_LEDGER_ENABLED=false): no dynamic "
    "pricing, every multiplier is 1"
)


@contextmanager
def _ledger_calls() -> Iterator[None]:
    """A server without the ledger has no LedgerService (UNIMPLEMENTED): say
    what that means; other RPC errors are admin_client's to report."""
    import grpc

    try:
        yield
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            fail(NO_LEDGER)
        raise


# ----------------------------------------------------------------- commands


@pricing_app.command("show")
def pricing_show(
    ctx: typer.Context,
    pool: PoolOpt = None,
    warnings_from: Annotated[
        str | None,
        typer.Option(
            "--warnings-from",
            help="Margin warnings of windows from this time (ISO 8601 or Unix s); "
            "default: the last 24 hours.",
            show_default=False,
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """The multiplier in force and the next one per pool, and margin warnings.

    Per pool and model: the multiplier in force, the next one (what the
    current window's KV-cache miss rate so far sets), the current and the
    previous window's measured miss rate; when the next window starts; the
    margin warnings recorded since --warnings-from, each with its window's
    cost_ratio (actual GPU cost / what the tenant was charged: above 1, the
    window lost money) and the threshold it crossed (BURSTGATE_MARGIN_WARNING_RATIO:
    a warning is recorded when cost_ratio > threshold)."""
    from burstgate_client._proto.burstgate.v1 import ledger_pb2 as lpb

    now = time.time_ns()
    since = _when("--warnings-from", warnings_from, now - WARNINGS_LOOKBACK_NS)
    with admin_client(ctx) as c, _ledger_calls():
        ledger = _ledger(c)
        window_ns = ledger.GetPricing(lpb.GetPricingRequest(), **c.call_kw).window_ms * NS_PER_MS
        start = max(0, now - LOOKBACK_WINDOWS * window_ns)
        # Listing saves the server's open windows first (and rolls them to
        # the current window): GetPricing after it is up to date.
        windows = ledger.ListPricingWindows(
            lpb.ListPricingWindowsRequest(pool=pool or "", start_unix_ns=start), **c.call_kw
        ).windows
        state = ledger.GetPricing(lpb.GetPricingRequest(), **c.call_kw)
        warnings = ledger.ListMarginWarnings(
            lpb.ListMarginWarningsRequest(start_unix_ns=since), **c.call_kw
        ).warnings
    view = pricing_view(state, windows, warnings, now, pool)
    if as_json:
        echo_json(view)
        return
    _print_show(view, now)


def _print_show(view: dict[str, Any], now_ns: int) -> None:
    nxt = view["next_window_start"]
    wait = nxt - now_ns // NS_PER_S
    steps = ", ".join(
        f"miss rate > {s['above_miss_rate']}: x{s['multiplier']}" for s in view["steps"]
    )
    kv({
        "window": f"{view['window_ms'] // 1000} s",
        "current_window": _time(view["current_window_start"]),
        "next_window": f"{_time(nxt).strftime('%Y-%m-%d %H:%M:%S')}"
                       + (f" (in {wait} s)" if wait > 0 else ""),
        "steps": steps or "none (multiplier 1)",
        "margin_warning_ratio": view["margin_warning_ratio"],
    })  # fmt: skip
    typer.echo("")
    if view["pools"]:
        table(view["pools"], POOL_COLUMNS)
    else:
        typer.echo("no pricing windows yet: every pool is at multiplier 1")
    typer.echo("")
    warnings = view["margin_warnings"]
    if not warnings:
        typer.echo("margin warnings: none")
        return
    typer.echo(f"margin warnings: {len(warnings)}")
    table([w | {"window_start": _time(w["window_start"])} for w in warnings], WARNING_COLUMNS)


@pricing_app.command("windows")
def pricing_windows(
    ctx: typer.Context,
    start: Annotated[
        str | None,
        typer.Option(
            "--from",
            help="Windows starting from (ISO 8601 or Unix s); default: an hour ago.",
            show_default=False,
        ),
    ] = None,
    end: Annotated[
        str | None,
        typer.Option("--to", help="Windows starting before; default: now.", show_default=False),
    ] = None,
    pool: PoolOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The pricing windows of a period with their miss rate and multiplier.

    Per window, pool and model: the completions and load reports measured,
    the KV-cache miss rate, the multiplier in force during the window and
    the one it sets for the next."""
    from burstgate_client._proto.burstgate.v1 import ledger_pb2 as lpb

    now = time.time_ns()
    s = _when("--from", start, now - WINDOWS_LOOKBACK_NS)
    e = _when("--to", end, 0)  # 0: the server's now
    if e and e <= s:
        raise typer.BadParameter("must be after --from", param_hint="'--to'")
    with admin_client(ctx) as c, _ledger_calls():
        found = (
            _ledger(c)
            .ListPricingWindows(
                lpb.ListPricingWindowsRequest(pool=pool or "", start_unix_ns=s, end_unix_ns=e),
                **c.call_kw,
            )
            .windows
        )
    rows = [window_json(w) for w in found]
    if as_json:
        echo_json(rows)
        return
    table(
        [r | {"window_start": _time(r["window_start"]),
              "window_end": _time(r["window_start"] + r["window_ms"] // 1000)} for r in rows],
        WINDOW_COLUMNS,
    )  # fmt: skip
