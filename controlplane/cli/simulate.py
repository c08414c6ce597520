"""``burstgate simulate``: replay a trace through admission policies in front
of modelled vLLM engines, with simulated time (controlplane/sim)."""

from __future__ import annotations

import shlex
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from controlplane.analysis.extras import plotting_missing
from controlplane.cli.common import fail
from controlplane.cli.render import table
from controlplane.domain.errors import excerpt
from controlplane.sim.harness import ClientKind
from controlplane.sim.profiles import DEFAULT_PROFILE, PROFILES
from controlplane.sim.run import BUILTIN_POLICIES, PolicyName
from controlplane.sim.scaling import AutoscaleMode

DEFAULT_TRACE_HELP = (
    "A trace file: Azure CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or JSON Lines (map "
    "the columns with --time-col/--prompt-col/--output-col and give --time-unit; rows with "
    "hash_ids, as Mooncake's, drive the prefix cache); or synthetic:heavy-burst / "
    "long-prompt / diurnal / chat-sessions (multi-turn, with prefix reuse), optionally "
    ":SEED[:DURATION_S]."
)


class TimeUnit(StrEnum):
    AUTO = "auto"
    S = "s"
    MS = "ms"
    US = "us"
    NS = "ns"
    DATETIME = "datetime"


class RetryClient(StrEnum):
    OPENAI = ClientKind.OPENAI.value
    SLO_AWARE = ClientKind.SLO_AWARE.value


def _burst(text: str | None) -> tuple[str, float, float, float] | None:
    if text is None:
        return None
    parts = text.split(":")
    try:
        if len(parts) != 4:
            raise ValueError
        return parts[0], float(parts[1]), float(parts[2]), float(parts[3])
    except ValueError:
        fail(f"--burst: expected TENANT:FACTOR:START_S:DURATION_S (e.g. standard:5:600:60), "
             f"got {excerpt(text)}")  # fmt: skip


def _slowdowns(values: list[str] | None) -> tuple[float, ...]:
    """``--prefill-slowdown 1 --prefill-slowdown 2``, or ``1,2``."""
    out: list[float] = []
    for text in values or ["1"]:
        for part in text.split(","):
            try:
                x = float(part)
            except ValueError:
                fail(f"--prefill-slowdown: expected a number (e.g. 2), got {excerpt(part)}")
            if not (x > 0 and x < float("inf")):
                fail(f"--prefill-slowdown: must be a positive number, got {excerpt(part)}")
            out.append(x)
    return tuple(dict.fromkeys(out))


def simulate(
    trace: Annotated[str, typer.Argument(help=DEFAULT_TRACE_HELP, show_default=False)],
    policy: Annotated[
        list[PolicyName] | None,
        typer.Option(
            "--policy",
            help="Repeat to compare several; default: fifo, rate-limit, drop-late, burstgate "
            "and the premium-only bound. burstgate-ungated is burstgate with the pool gate off.",
        ),
    ] = None,
    config: Annotated[
        list[Path] | None,
        typer.Option(help="A burstgate config file (lanes, tenants) to compare too (repeat)."),
    ] = None,
    load: Annotated[
        list[float] | None,
        typer.Option(help="Load as a multiple of the pool's capacity (repeat; default 1.0)."),
    ] = None,
    engines: Annotated[
        int,
        typer.Option(min=1, help="Engines in the pool (with an autoscaler: its maximum)."),
    ] = 1,
    autoscale: Annotated[
        list[AutoscaleMode] | None,
        typer.Option(
            help="Autoscaler in the loop (repeat to compare): off (a fixed pool of --engines), "
            "reactive (burstgate's desired_engines), predictive (and its forecast), "
            "queue-length (the usual recipe: the engines' waiting requests, 5 per engine). "
            "Default: off.",
            show_default=False,
        ),
    ] = None,
    min_engines: Annotated[
        int, typer.Option(min=1, help="Autoscalers start here (warm) and never go below.")
    ] = 1,
    engine_startup_s: Annotated[
        float,
        typer.Option(min=0, help="Seconds from an autoscaler's scale-up to the engine serving."),
    ] = 120.0,
    scale_down_delay_s: Annotated[
        float,
        typer.Option(
            min=0,
            help="Scale-down stabilisation: engines go down to the highest count asked in "
            "this many seconds (the recipes' 300, the HPA's default).",
        ),
    ] = 300.0,
    engine_profile: Annotated[
        str | None,
        typer.Option(
            help=f"Engine calibration: {', '.join(PROFILES)} (default {DEFAULT_PROFILE}; "
            "docs/simulate.md gives their sources).",
            show_default=False,
        ),
    ] = None,
    engine_config: Annotated[
        Path | None,
        typer.Option(help="YAML with an 'engine:' section, instead of --engine-profile."),
    ] = None,
    prefill_slowdown: Annotated[
        list[str] | None,
        typer.Option(
            help="Sensitivity: x the profile's prefill cost, decode unchanged (repeat, or "
            "1,2,3; default 1). Capacity is measured again for each.",
            show_default=False,
        ),
    ] = None,
    retries: Annotated[
        bool, typer.Option(help="Refused clients retry (see --retry-client).")
    ] = False,
    retry_client: Annotated[
        RetryClient,
        typer.Option(
            help="With --retries: openai (the official Python client: 2 retries, retry-after, "
            "backoff; it does not know its SLO) or slo-aware (retries only while its SLO can "
            "still be met)."
        ),
    ] = RetryClient.OPENAI,
    retry_keys: Annotated[
        bool,
        typer.Option(
            help="Retries carry a retry key, as burstgate's sidecar and SDK send (judged "
            "against the first attempt's deadline); --no-retry-keys: each attempt looks new."
        ),
    ] = True,
    first_tokens: Annotated[
        bool,
        typer.Option(
            help="Completes report each request's first-token time, as burstgate's sidecar "
            "does (the gate learns how soon a release gets its first token); "
            "--no-first-tokens: they do not."
        ),
    ] = True,
    burst: Annotated[
        str | None,
        typer.Option(help="Inject a burst: TENANT:FACTOR:START_S:DURATION_S (scaled time)."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed: tenant assignment, bursts, client jitter.")] = 0,
    limit: Annotated[int | None, typer.Option(min=2, help="Use the first N requests.")] = None,
    time_col: Annotated[str, typer.Option(help="Trace column: arrival time.")] = "TIMESTAMP",
    prompt_col: Annotated[str, typer.Option(help="Trace column: prompt tokens.")] = "ContextTokens",
    output_col: Annotated[
        str, typer.Option(help="Trace column: output tokens.")
    ] = "GeneratedTokens",
    time_unit: Annotated[
        TimeUnit, typer.Option(help="Unit of the time column; auto reads datetimes only.")
    ] = TimeUnit.AUTO,
    blocks_col: Annotated[
        str,
        typer.Option(help="Trace column of prompt block ids (read when the first row has it)."),
    ] = "hash_ids",
    block_tokens: Annotated[
        int | None,
        typer.Option(
            help="Tokens per block id: a trace file's (default 512, Mooncake's), or the size "
            "synthetic:chat-sessions makes them (default 64). A multiple of the engine's "
            "block_size.",
            show_default=False,
        ),
    ] = None,
    prefix_cache: Annotated[
        bool,
        typer.Option(
            help="Model each engine's prefix cache (when the trace has block ids); "
            "--no-prefix-cache: every prompt token is computed."
        ),
    ] = True,
    pricing_window_s: Annotated[
        int | None,
        typer.Option(
            help="Pricing window, seconds of simulated time (default: the plane's "
            "BURSTGATE_PRICING_WINDOW_S default, 300).",
            show_default=False,
        ),
    ] = None,
    pricing_steps: Annotated[
        str | None,
        typer.Option(
            help="Pricing steps MISS_RATE:MULTIPLIER,... (e.g. 0.3:1.2,0.6:1.5; default: the "
            "plane's BURSTGATE_PRICING_STEPS default).",
            show_default=False,
        ),
    ] = None,
    price: Annotated[
        str | None,
        typer.Option(
            help="The price both ledgers use, KEY=VALUE,... over the default (input, "
            "cached_input, output, gpu_prefill, gpu_decode per million tokens; gpu_overhead "
            "per request; currency). Default: input=0.5,cached_input=0.5,output=1.5,"
            "gpu_prefill=0.2,gpu_decode=0.8,gpu_overhead=0.00002,currency=USD.",
            show_default=False,
        ),
    ] = None,
    write_trace: Annotated[
        Path | None,
        typer.Option(
            help="Write the trace (e.g. a synthetic one) to this file as an Azure CSV, and exit.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    markdown: Annotated[
        bool, typer.Option("--markdown", help="Print the tables as Markdown (for docs).")
    ] = False,
    html: Annotated[
        Path | None,
        typer.Option("--html", help="Also write an HTML report with plots to this file."),
    ] = None,
) -> None:
    """Compare admission policies on a trace, in simulated time.

    Each trace request is assigned a tenant (premium 20%, standard 50%,
    batch 30%, by a hash of its row), the trace is time-scaled to each
    --load x the pool's measured capacity, and every policy sees the same
    input. Reports SLO attainment, goodput, wasted work, TTFT and waits per
    lane, with the drop-late baseline and the premium-only bound. When the
    trace has block ids (hash_ids; synthetic:chat-sessions) each engine has
    a prefix cache, and the report adds its hit rate per lane and pricing
    window and the billing drift under fixed and dynamic prices."""
    from controlplane.sim.engine import EngineParams
    from controlplane.sim.profiles import engine_profile as profile_of
    from controlplane.sim.report import to_json
    from controlplane.sim.reuse import DEFAULT_PRICE, parse_price, parse_steps
    from controlplane.sim.run import PLANE_STEPS, PLANE_WINDOW_S, Burst, SimSpec, prepare_trace
    from controlplane.sim.run import simulate as run_simulation
    from controlplane.sim.synthetic import per_second_stats, write_azure_csv
    from controlplane.sim.tables import sections, to_table
    from controlplane.sim.trace import ColumnMap, TraceError

    policies = tuple(str(p) for p in policy) if policy else (() if config else BUILTIN_POLICIES)
    b = _burst(burst)
    slowdowns = _slowdowns(prefill_slowdown)
    if engine_profile is not None and engine_config is not None:
        fail("--engine-profile and --engine-config: give one or the other")
    if block_tokens is not None and block_tokens < 1:
        fail(f"--block-tokens: must be >= 1, got {block_tokens}")
    if pricing_window_s is not None and pricing_window_s < 1:
        fail(f"--pricing-window-s: must be >= 1, got {pricing_window_s}")
    if html is not None and (why := plotting_missing("--html")):
        fail(why)
    for target, flag in ((html, "--html"), (write_trace, "--write-trace")):
        if target is not None and not target.parent.is_dir():  # before a run that takes minutes
            fail(f"{flag}: directory {target.parent} does not exist (create it first)")
        if target is not None and target.is_dir():
            fail(f"{flag}: {target} is a directory; give a file name")
    try:
        if engine_config is not None:
            params, profile = EngineParams.load(engine_config), f"file:{engine_config.name}"
        else:
            profile = engine_profile or DEFAULT_PROFILE
            params = profile_of(profile).params
        client = ClientKind(str(retry_client)) if retries else ClientKind.NONE
        spec = SimSpec(
            trace=trace,
            columns=ColumnMap(
                time=time_col,
                prompt=prompt_col,
                output=output_col,
                time_unit=str(time_unit),
                blocks=blocks_col,
            ),
            policies=policies,
            configs=tuple(config or ()),
            loads=tuple(load or (1.0,)),
            engines=engines,
            params=params,
            profile=profile,
            prefill_slowdowns=slowdowns,
            client=client,
            retry_keys=retry_keys,
            first_tokens=first_tokens,
            burst=Burst(*b) if b else None,
            seed=seed,
            limit=limit,
            autoscale=tuple(dict.fromkeys(str(m) for m in autoscale or [AutoscaleMode.OFF])),
            min_engines=min_engines,
            engine_startup_s=engine_startup_s,
            scale_down_delay_s=scale_down_delay_s,
            prefix_cache=prefix_cache,
            block_tokens=block_tokens,
            pricing_window_s=pricing_window_s or PLANE_WINDOW_S,
            pricing_steps=parse_steps(pricing_steps) if pricing_steps else list(PLANE_STEPS),
            price=parse_price(price) if price else DEFAULT_PRICE,
        )
        requests = prepare_trace(spec)
        if write_trace is not None:
            write_azure_csv(requests, write_trace)
            shape = per_second_stats(requests)
            typer.echo(
                f"{len(requests):,} requests over {shape.seconds:,} s written to {write_trace} "
                f"(per-second arrivals: mean {shape.mean_rps:,.1f}, CV {shape.cv:.2f}, "
                f"peak/mean {shape.peak_to_mean:.1f})"
            )
            return
        runs = run_simulation(spec, requests)
    except (TraceError, ValueError, OSError) as exc:
        fail(str(exc))
    name = trace if trace.startswith("synthetic:") else Path(trace).name
    if as_json:
        typer.echo(to_json(runs))
    else:
        shape = per_second_stats(requests)
        from controlplane.sim.run import prefix_unit

        unit = prefix_unit(spec, requests)
        cache = (
            f"prefix cache: {unit}-token blocks" if unit is not None
            else "prefix cache: off" if not prefix_cache and any(r.blocks for r in requests)
            else "prefix cache: none (no block ids in the trace)"
        )  # fmt: skip
        typer.echo(
            f"{name}: {len(requests):,} requests (per-second arrivals CV {shape.cv:.2f}, "
            f"peak/mean {shape.peak_to_mean:.1f}), {engines} engine(s) of {profile}, "
            f"clients: {client}, {cache}\n"
        )
        if markdown:
            typer.echo(to_table(runs))
        else:
            for i, (title, head, rows) in enumerate(sections(runs)):
                if i:
                    typer.echo("")
                if title:
                    typer.echo(title)
                table([dict(zip(head, cells, strict=True)) for cells in rows], head)
    if html is not None:
        # Imported here: matplotlib costs ~0.5 s that a table run does not need.
        from controlplane.sim.html import render_html

        page = render_html(runs, title=f"burstgate simulate: {name}", command=shlex.join(sys.argv))
        try:
            html.write_text(page, encoding="utf-8")
        except OSError as exc:
            fail(f"--html: cannot write {html}: {exc.strerror or exc}")
        typer.echo(f"report written to {html}", err=as_json)  # stdout stays valid JSON
