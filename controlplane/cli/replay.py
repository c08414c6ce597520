"""``burstgate replay TRACE``: a recorded trace against a running control
plane, at a time scale, with clients that retry (controlplane/loadtest,
docs/loadtest.md)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from controlplane.analysis.cli import (
    FormatOpt,
    LaneColOpt,
    OnBadRow,
    OutputColOpt,
    PromptColOpt,
    TenantColOpt,
    TimeColOpt,
    TimeUnitOpt,
    input_options,
    load_log,
)
from controlplane.analysis.presets import LogFormat
from controlplane.analysis.progress import Phases
from controlplane.cli.common import fail
from controlplane.cli.loadtest import (
    HtmlOpt,
    LocalOpt,
    NoProgressOpt,
    ReportJsonOpt,
    ServiceScaleOpt,
    SidecarKeyOpt,
    TargetOpt,
    execute,
    parse_tenants,
)


class Assign(StrEnum):
    HASH = "hash"
    COLUMN = "column"


def replay(
    trace: Annotated[
        Path, typer.Argument(help="Request log: CSV, JSON Lines or Parquet; - = stdin.")
    ],
    target: TargetOpt = "127.0.0.1:50051",
    api_key: SidecarKeyOpt = None,
    speed: Annotated[float, typer.Option(help="Time scale: 10 = ten times faster.")] = 1.0,
    assign: Annotated[
        Assign, typer.Option(help="Tenants by a hash of the row (--tenant) or the trace's column.")
    ] = Assign.HASH,
    tenant: Annotated[
        list[str] | None,
        typer.Option(help="TENANT[:LANE[:WEIGHT]], repeat (default: the demo's three, one "
                     "per lane, weighted by token rate, each row to a tenant whose cap it fits)."),
    ] = None,
    retries: Annotated[
        bool, typer.Option(help="Retry retryable refusals (backoff, full jitter, within the SLO).")
    ] = True,
    limit: Annotated[int | None, typer.Option(min=1, help="Replay the first N requests.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the assignment and the client jitter.")] = 0,
    service_scale: ServiceScaleOpt = 1.0,
    local: LocalOpt = False,
    log_format: FormatOpt = LogFormat.auto,
    time_unit: TimeUnitOpt = None,
    time_col: TimeColOpt = None,
    prompt_col: PromptColOpt = None,
    output_col: OutputColOpt = None,
    tenant_col: TenantColOpt = None,
    lane_col: LaneColOpt = None,
    as_json: ReportJsonOpt = False,
    html: HtmlOpt = None,
    no_progress: NoProgressOpt = False,
) -> None:
    """Replay a recorded trace (Azure, Mooncake, an OpenAI log, a ledger export ...)
    against a control plane at --speed, each row one Admit at its time with its
    real lengths; refused clients retry after max(retry_after, backoff with full
    jitter) while their lane's TTFT SLO can still be met. Reports like
    `loadtest`, plus how many were served after a refusal."""
    from controlplane.loadtest.demofit import demo_tenants
    from controlplane.loadtest.replay import plan
    from controlplane.loadtest.run import RetryPolicy
    from controlplane.sim.harness import DEFAULT_SLO_S

    options = input_options(
        log_format, time_unit, (time_col, prompt_col, output_col, tenant_col, lane_col)
    )
    with Phases(False) as phases:
        log = load_log(trace, OnBadRow.skip, options, False, phases)
    try:
        phase_list, arrivals = plan(
            log, speed=speed, tenants=parse_tenants(tenant) if tenant else demo_tenants(),
            assign=assign.value, limit=limit, seed=seed,
        )  # fmt: skip
    except ValueError as exc:
        fail(str(exc))
    retry = RetryPolicy(dict(DEFAULT_SLO_S), seed=seed) if retries else None
    profile = {"profile": "replay", "trace": str(trace), "speed": speed, "seed": seed,
               "assign": assign.value, "retries": retries,
               "service_scale": service_scale}  # fmt: skip
    end = phase_list[-1].end_s
    execute(
        target, phase_list, arrivals, profile, local=local, as_json=as_json, html=html,
        no_progress=no_progress, headline=f"replay: {len(arrivals):,} requests over "
        f"{end:,.1f} s (--speed {speed:g})",
        api_key=api_key, service_scale=service_scale, retry=retry,
    )  # fmt: skip
