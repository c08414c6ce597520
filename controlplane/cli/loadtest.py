"""``burstgate loadtest``: open-loop pulse load against a running control
plane over gRPC, with a per-phase report (controlplane/loadtest,
docs/loadtest.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from controlplane.analysis.extras import plotting_missing
from controlplane.cli.common import EXIT_UNREACHABLE, fail, unreachable
from controlplane.cli.render import table

# Options `loadtest` and `replay` share.
TargetOpt = Annotated[
    str, typer.Option(envvar="BURSTGATE_TARGET", help="host:port of the control plane.")
]
SidecarKeyOpt = Annotated[
    str | None,
    typer.Option(envvar="BURSTGATE_API_KEY", help="A sidecar key, when admission auth is on."),
]
ServiceScaleOpt = Annotated[
    float, typer.Option(min=0, help="Scale of the simulated service time before Complete.")
]
LocalOpt = Annotated[
    bool, typer.Option(help="Start a demo control plane and a fake engine; stop them after.")
]
ReportJsonOpt = Annotated[bool, typer.Option("--json", help="Print the report as JSON.")]
HtmlOpt = Annotated[Path | None, typer.Option(help="Also write an HTML report to this file.")]
NoProgressOpt = Annotated[bool, typer.Option("--no-progress", help="No progress bar.")]


class ProfileName(StrEnum):
    PULSE = "pulse"
    STEP = "step"
    CONSTANT = "constant"


def parse_tenants(specs: list[str]) -> list[Any]:
    from controlplane.loadtest.profile import Tenant

    out = []
    for spec in specs:
        parts = spec.split(":")
        try:
            if not parts[0] or len(parts) > 3:
                raise ValueError
            weight = float(parts[2]) if len(parts) == 3 else 1.0
            if not weight > 0:
                raise ValueError
        except ValueError:
            fail(f"--tenant: expected TENANT[:LANE[:WEIGHT]] with a weight > 0, got {spec!r}")
        out.append(Tenant(parts[0], parts[1] if len(parts) > 1 else "", weight))
    return out


def loadtest(
    target: TargetOpt = "127.0.0.1:50051",
    api_key: SidecarKeyOpt = None,
    profile: Annotated[ProfileName, typer.Option(help="The shape of the load.")] = (
        ProfileName.PULSE
    ),
    base: Annotated[
        float | None,
        typer.Option(help="Base rate, requests/s (default: 20; --local: half of what its "
                     "engine sustains on the run's lengths)."),
    ] = None,
    peak: Annotated[
        float | None,
        typer.Option(help="Rate in a pulse or burst, requests/s (default: 80; --local: twice "
                     "what its engine sustains)."),
    ] = None,
    pulse_s: Annotated[
        float | None, typer.Option(help="pulse: length of a pulse, s (default: 30; --local 10).")
    ] = None,
    cycle_s: Annotated[
        float | None,
        typer.Option(help="pulse: a pulse every this many s (default: 90; --local 30)."),
    ] = None,
    recovery_s: Annotated[
        float | None,
        typer.Option(help="Recovery phase after a pulse or burst, s (pulse: its length)."),
    ] = None,
    warmup_s: Annotated[float, typer.Option(help="step: warm-up at the base rate, s.")] = 30.0,
    burst_s: Annotated[float, typer.Option(help="step: the burst at the peak rate, s.")] = 30.0,
    total_s: Annotated[
        float | None,
        typer.Option(help="pulse, constant: length of the run, s (default: 300; --local 60)."),
    ] = None,
    tenant: Annotated[
        list[str] | None,
        typer.Option(
            help="TENANT[:LANE[:WEIGHT]], repeat; default: the demo's three, one per "
            "lane, weighted by their token rates and within their per-request caps."
        ),
    ] = None,
    long_prompt_share: Annotated[float, typer.Option(min=0, max=1)] = 0.2,
    long_output_share: Annotated[float, typer.Option(min=0, max=1)] = 0.2,
    uniform: Annotated[
        bool, typer.Option(help="Evenly spaced arrivals instead of Poisson.")
    ] = False,
    seed: Annotated[int, typer.Option(help="Seed of arrivals, tenants and lengths.")] = 0,
    service_scale: ServiceScaleOpt = 1.0,
    max_in_flight: Annotated[
        int, typer.Option(min=1, help="Most Admit calls open at once.")
    ] = 10_000,
    retries: Annotated[
        bool,
        typer.Option(
            help="Clients retry retryable refusals (backoff, full jitter, within the SLO)."
        ),
    ] = False,
    stream: Annotated[
        bool,
        typer.Option(help="Micro-batch the Admits onto one AdmitStream (as a busy sidecar)."),
    ] = False,
    batch_window_ms: Annotated[
        float, typer.Option(min=0.01, help="--stream: how long a batch collects Admits.")
    ] = 0.5,
    batch_max: Annotated[int, typer.Option(min=1, help="--stream: most Admits a batch.")] = 100,
    via_sidecar: Annotated[
        bool,
        typer.Option(help="Send the load as OpenAI HTTP requests through a sidecar: with "
                     "--local one started in front of the fake engine, else --sidecar-url."),
    ] = False,
    sidecar_url: Annotated[
        str, typer.Option(help="--via-sidecar: the sidecar (with tenant_header set).")
    ] = "http://127.0.0.1:8080",
    model: Annotated[str, typer.Option(help="--via-sidecar: the model asked for.")] = (
        "fake-llama"
    ),
    engine_speed: Annotated[
        float, typer.Option(min=0.001, help="--local: the fake engine's speed (model/wall).")
    ] = 1.0,
    local: LocalOpt = False,
    as_json: ReportJsonOpt = False,
    html: HtmlOpt = None,
    no_progress: NoProgressOpt = False,
) -> None:
    """Open-loop load (pulse, step or constant) against a control plane, then a
    report per phase: decision latency, decisions by outcome and reason,
    server-side queue waits, refusals and errors.

    Every admitted request is Completed after a simulated service time, so
    reservations are refunded as in production. Loopback targets only; the
    run stops by itself after its profile.

    --via-sidecar sends HTTP through a burstgate sidecar instead (latency =
    time to the answer's headers; docs/sidecar.md)."""
    from controlplane.loadtest import profile as prof
    from controlplane.loadtest.demofit import (
        default_rates,
        demo_tenants,
        describe,
        local_capacity_rps,
    )
    from controlplane.loadtest.run import RetryPolicy
    from controlplane.sim.harness import DEFAULT_SLO_S

    # SPEC section 6's pulse (30 s every 90 s, 5 minutes) by default; a
    # third of it with --local, so that the one-command demo takes a minute.
    short = local and pulse_s is None and cycle_s is None and total_s is None
    pulse_s = pulse_s if pulse_s is not None else (10.0 if short else 30.0)
    cycle_s = cycle_s if cycle_s is not None else (30.0 if short else 90.0)
    total_s = total_s if total_s is not None else (60.0 if short else 300.0)
    try:
        mix = prof.Mix(long_prompt_share, long_output_share)
        tenants = parse_tenants(tenant) if tenant else demo_tenants()
        capacity = None
        if local and (base is None or peak is None):
            capacity = local_capacity_rps(tenants, mix, engine_speed, seed)
        base, peak = default_rates(base, peak, local, capacity)
        if capacity is not None:
            typer.echo(f"the local fake engine sustains about {capacity:.1f} requests/s of "
                       f"these lengths: base {base:g}/s, peak {peak:g}/s (--base, --peak "
                       "choose)", err=True)  # fmt: skip
        if profile is ProfileName.PULSE:
            phases = prof.pulse(base, peak, pulse_s, cycle_s, total_s, recovery_s)
        elif profile is ProfileName.STEP:
            rec = burst_s if recovery_s is None else recovery_s
            phases = prof.step(base, peak, warmup_s, burst_s, rec)
        else:
            phases = prof.constant(base, total_s)
        plan = prof.arrivals(phases, tenants, mix, seed=seed, uniform=uniform)
    except ValueError as exc:
        fail(str(exc))
    if via_sidecar and (stream or retries):
        fail("--via-sidecar: the sidecar admits; --stream and --retries are for gRPC load")
    options = {"profile": profile.value, "base": base, "peak": peak, "pulse_s": pulse_s,
               "cycle_s": cycle_s, "total_s": phases[-1].end_s, "seed": seed,
               "uniform": uniform, "service_scale": service_scale, "retries": retries,
               "mode": "http via sidecar" if via_sidecar
               else f"stream (window {batch_window_ms:g} ms, max {batch_max})" if stream
               else "unary"}  # fmt: skip
    sidecar = {"url": sidecar_url, "model": model} if via_sidecar else None
    execute(
        target, phases, plan, options, local=local, as_json=as_json, html=html,
        no_progress=no_progress, headline=f"loadtest: {len(plan):,} requests over "
        f"{phases[-1].end_s:g} s ({profile.value}; tenants {describe(tenants)})",
        api_key=api_key, service_scale=service_scale, max_in_flight=max_in_flight,
        batch_window_s=batch_window_ms / 1000 if stream else None, batch_max=batch_max,
        retry=RetryPolicy(dict(DEFAULT_SLO_S), seed=seed) if retries else None,
        sidecar=sidecar, engine_speed=engine_speed,
    )  # fmt: skip


def execute(
    target: str,
    phases: list[Any],
    plan: list[Any],
    options: dict[str, Any],
    *,
    local: bool,
    as_json: bool,
    html: Path | None,
    no_progress: bool,
    headline: str,
    **run_kw: Any,
) -> None:
    """What `loadtest` and `replay` share once they have a plan: the local
    servers, the loopback check, the run with its progress bar, the report."""
    import asyncio

    from controlplane.loadtest.report import summarize, to_json
    from controlplane.loadtest.run import check_loopback

    if html is not None and (why := plotting_missing("--html")):
        fail(why)
    if html is not None and not html.parent.is_dir():
        fail(f"--html: directory {html.parent} does not exist")
    server = start_local() if local else None
    if server is not None:
        target = server[1]
    try:
        remote_sidecar = run_kw.get("sidecar") is not None and not local
        try:
            if remote_sidecar:  # the sidecar has its own control plane
                check_sidecar_url(run_kw["sidecar"]["url"])
                target = run_kw["sidecar"]["url"]
            else:
                check_loopback(target)
        except ValueError as exc:
            fail(str(exc))
        if not remote_sidecar:
            check_reachable(target)
        typer.echo(f"{headline} against {target}", err=True)
        end = phases[-1].end_s
        with progress_bar(end, len(plan), not no_progress and sys.stderr.isatty()) as tick:
            result = asyncio.run(drive(target, plan, local, on_tick=tick, **run_kw))
    finally:
        if server is not None:
            stop_local(server[0])
    doc = to_json(target, options, phases, result)
    if run_kw.get("sidecar") is not None and (hint := sidecar_401_hint(doc)):
        typer.echo(hint, err=True)
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        print_report(doc, summarize(phases, result))
    if html is not None:
        from controlplane.loadtest.html import render

        html.write_text(render(doc), encoding="utf-8")
        typer.echo(f"report written to {html}", err=True)


# How long a load run waits for the control plane to accept a connection
# before it says none is running (a loopback server accepts at once; nothing
# listening is refused at once).
CONNECT_TIMEOUT_S = 3.0


def check_reachable(target: str) -> None:
    """Something accepts TCP connections at ``target`` (a loopback address:
    check_loopback): otherwise every Admit of the run would be an
    UNAVAILABLE error; say so once, as the admin commands do
    (common.unreachable), and exit before the run."""
    import socket

    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S):
            pass
    except (OSError, ValueError):
        fail(unreachable(target), EXIT_UNREACHABLE)


def sidecar_401_hint(doc: dict[str, Any]) -> str | None:
    """A sidecar answers 401 with no refusal reason when it found no tenant
    (no key it knows, no tenant header it reads, no default tenant): the
    load generator names each request's tenant in a header, which a sidecar
    reads only with ``tenant_header`` in its config."""
    from controlplane.loadtest.http import TENANT_HEADER

    total = next((p for p in doc["phases"] if p["phase"] == "all"), None)
    n = (total or {}).get("errors", {}).get("http_401", 0)
    if not n:
        return None
    return (f"hint: the sidecar answered 401 (no tenant) to {n:,} of {doc['requests']:,} "
            f"requests: the load names each request's tenant in the {TENANT_HEADER} header, "
            f"which a sidecar reads only with `tenant_header: {TENANT_HEADER}` in its config "
            "(--config, docs/sidecar.md), or use --local --via-sidecar")  # fmt: skip


def check_sidecar_url(url: str) -> None:
    """The sidecar is on this machine too (ValueError naming the option)."""
    from urllib.parse import urlsplit

    from controlplane.loadtest.run import check_loopback

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--sidecar-url: expected http://host:port, got {url!r}")
    try:
        check_loopback(parts.hostname)
    except ValueError as exc:
        raise ValueError(str(exc).replace("--target", "--sidecar-url")) from None


async def drive(target: str, plan: list[Any], with_engine: bool, **kw: Any) -> Any:
    """``run`` the plan; ``with_engine`` (--local): in front of a fake engine
    started here (admitted requests are served on it, its state reported).
    ``sidecar`` (--via-sidecar): HTTP load through a sidecar instead."""
    from controlplane.fakeengine import FakeEngine
    from controlplane.loadtest.engine import EngineLink
    from controlplane.loadtest.run import run

    sidecar, speed = kw.pop("sidecar", None), kw.pop("engine_speed", 1.0)
    if sidecar is not None:
        return await drive_sidecar(target, plan, with_engine, sidecar, speed, **kw)
    if not with_engine:
        return await run(target, plan, **kw)
    engine = FakeEngine(port=0, speed=speed)
    await engine.start()
    typer.echo(f"started a fake engine on {engine.base_url} (its load reported to the "
               "control plane every 100 ms)", err=True)  # fmt: skip
    try:
        async with EngineLink(engine) as link:
            return await run(target, plan, engine=link, **kw)
    finally:
        await engine.stop()
        typer.echo("stopped the fake engine", err=True)


async def drive_sidecar(
    target: str, plan: list[Any], with_engine: bool, sidecar: dict[str, str], speed: float,
    **kw: Any,
) -> Any:  # fmt: skip
    """HTTP load through the sidecar at ``sidecar["url"]``, or (--local) one
    started here in front of a fake engine, admitting with ``target``."""
    from controlplane.loadtest.http import run_http, through_local_sidecar

    http_kw = {k: kw[k] for k in ("run_id", "max_in_flight", "on_tick") if k in kw}
    if not with_engine:
        return await run_http(sidecar["url"], plan, model=sidecar["model"], **http_kw)
    def say(line: str) -> None:
        typer.echo(line, err=True)

    return await through_local_sidecar(target, plan, speed=speed, api_key=kw.get("api_key"),
                                       say=say, **http_kw)  # fmt: skip


def print_report(doc: dict[str, Any], stats: list[Any]) -> None:
    """The text report (also `burstgate replay`'s)."""
    retried = any(s.retries for s in stats)
    typer.echo(
        f"{doc['requests']:,} requests in {doc['duration_s']:.1f} s; "
        f"{doc['completed']:,} completed (reservations settled)"
    )
    rows = []
    for s in stats:
        lat, wait = s.latency_ms, s.queue_wait_ms
        rows.append({"phase": s.name, "requests": s.requests,
                     "per_s": f"{s.requests / s.seconds:.1f}" if s.seconds else "-",
                     "admitted": s.admitted, "refused": s.refused,
                     "errors": sum(s.errors.values()),
                     "p50_ms": lat["p50"], "p95_ms": lat["p95"], "p99_ms": lat["p99"],
                     "max_ms": lat["max"], "held": s.held, "wait_p99_ms": wait["p99"]})  # fmt: skip
        if retried:
            rows[-1] |= {"retries": s.retries, "served_after_refusal": s.served_after_refusal,
                         "gave_up": s.gave_up}  # fmt: skip
    table(rows, list(rows[0]))
    lanes = [{"lane": ln["lane"], "requests": ln["requests"], "admitted": ln["admitted"],
              "refused": ln["refused"], "p50_ms": ln["latency_ms"]["p50"],
              "p99_ms": ln["latency_ms"]["p99"], "held": ln["held"],
              "wait_p99_ms": ln["queue_wait_ms"]["p99"]} for ln in doc["lanes"]]  # fmt: skip
    if lanes:
        typer.echo("\nby lane (the whole run)")
        table(lanes, list(lanes[0]))
    reasons = [{"phase": s.name, "reason": r, "count": n}
               for s in stats if s.name != "all" for r, n in sorted(s.reasons.items())]  # fmt: skip
    errors = [{"phase": s.name, "error": e, "count": n}
              for s in stats if s.name != "all" for e, n in sorted(s.errors.items())]  # fmt: skip
    if reasons:
        typer.echo("\nrefusals by reason")
        table(reasons, ("phase", "reason", "count"))
    if errors:
        typer.echo("\nerrors")
        table(errors, ("phase", "error", "count"))


class _Progress:
    def __init__(self, seconds: float, total: int, show: bool) -> None:
        self.seconds, self.total, self.show = seconds, total, show
        self._bar: Any = None

    def __enter__(self) -> Any:
        if not self.show:
            return None
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(TextColumn("loadtest"), BarColumn(), TextColumn("{task.description}"),
                             TimeRemainingColumn(), transient=True)  # fmt: skip
        self._bar.start()
        task = self._bar.add_task("", total=self.seconds)

        def tick(t: float, sent: int) -> None:
            self._bar.update(task, completed=min(t, self.seconds),
                             description=f"{sent:,}/{self.total:,} sent")  # fmt: skip

        return tick

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()


def progress_bar(seconds: float, total: int, show: bool) -> _Progress:
    return _Progress(seconds, total, show)


def start_local() -> tuple[subprocess.Popen[str], str]:
    """`burstgate demo` on a temporary SQLite database and a free port."""
    tmp = tempfile.mkdtemp(prefix="burstgate-loadtest-")
    env = {**os.environ, "BURSTGATE_DATABASE_URL": f"sqlite:///{tmp}/burstgate.db",
           "BURSTGATE_LOG_LEVEL": "warning"}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "controlplane", "demo", "--port", "0", "--metrics-port", "-1"],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("burstgate listening on "):
            target = line.split()[3]
            typer.echo(f"started a demo control plane on {target} (database {tmp})", err=True)
            return proc, target
    proc.wait()
    fail(f"--local: the demo control plane did not start (exit code {proc.returncode})")


def stop_local(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    if proc.stdout is not None:
        proc.stdout.close()
    typer.echo("stopped the demo control plane", err=True)
