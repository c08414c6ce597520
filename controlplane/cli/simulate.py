"""``burstgate simulate``: replay a trace through admission policies in front
of modelled vLLM engines, with simulated time (controlplane/sim)."""

from __future__ import annotations

import shlex
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from controlplane.cli.common import fail
from controlplane.cli.render import table
from controlplane.domain.errors import excerpt
from controlplane.sim.run import BUILTIN_POLICIES, PolicyName

DEFAULT_TRACE_HELP = (
    "Trace file: Azure CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or JSON Lines "
    "(map the columns with --time-col/--prompt-col/--output-col and give --time-unit)."
)


class TimeUnit(StrEnum):
    AUTO = "auto"
    S = "s"
    MS = "ms"
    US = "us"
    NS = "ns"
    DATETIME = "datetime"


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


def simulate(
    trace: Annotated[Path, typer.Argument(help=DEFAULT_TRACE_HELP)],
    policy: Annotated[
        list[PolicyName] | None,
        typer.Option(
            "--policy",
            help="Repeat to compare several; default: fifo, rate-limit and burstgate. "
            "burstgate-ungated is burstgate with the pool gate off.",
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
    engines: Annotated[int, typer.Option(min=1, help="Engines in the pool.")] = 1,
    engine_config: Annotated[
        Path | None, typer.Option(help="YAML with an 'engine:' section (default: the 8B/H100 one).")
    ] = None,
    retries: Annotated[
        bool, typer.Option(help="Clients retry refusals (retry_after, backoff with jitter).")
    ] = False,
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
    input. Reports SLO attainment, goodput, TTFT and waits per lane."""
    from controlplane.sim.engine import EngineParams
    from controlplane.sim.report import sections, to_json, to_table
    from controlplane.sim.run import Burst, SimSpec
    from controlplane.sim.run import simulate as run_simulation
    from controlplane.sim.trace import ColumnMap, TraceError

    policies = tuple(str(p) for p in policy) if policy else (() if config else BUILTIN_POLICIES)
    b = _burst(burst)
    if html is not None and not html.parent.is_dir():  # before a run that may take minutes
        fail(f"--html: directory {html.parent} does not exist (create it first)")
    if html is not None and html.is_dir():
        fail(f"--html: {html} is a directory; give a file name")
    try:
        params = EngineParams.load(engine_config) if engine_config else EngineParams()
        spec = SimSpec(
            trace=trace,
            columns=ColumnMap(
                time=time_col, prompt=prompt_col, output=output_col, time_unit=str(time_unit)
            ),
            policies=policies,
            configs=tuple(config or ()),
            loads=tuple(load or (1.0,)),
            engines=engines,
            params=params,
            retries=retries,
            burst=Burst(*b) if b else None,
            seed=seed,
            limit=limit,
        )
        runs = run_simulation(spec)
    except (TraceError, ValueError, OSError) as exc:
        fail(str(exc))
    if as_json:
        typer.echo(to_json(runs))
    else:
        first = runs[0]
        typer.echo(
            f"{trace.name}: {first.overall.requests:,} requests, {engines} engine(s), "
            f"capacity {first.capacity_rps:,.1f} requests/s (measured on this trace's mix)\n"
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

        page = render_html(
            runs, title=f"burstgate simulate: {trace.name}", command=shlex.join(sys.argv)
        )
        try:
            html.write_text(page, encoding="utf-8")
        except OSError as exc:
            fail(f"--html: cannot write {html}: {exc.strerror or exc}")
        typer.echo(f"report written to {html}", err=as_json)  # stdout stays valid JSON
