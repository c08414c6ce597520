"""`burstgate replay`: a trace becomes the plan it says (times / speed, real
lengths, a stable tenant assignment), and refused clients retry within their
SLO, so some are served after a refusal; the ledger holds what was served."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from controlplane.analysis.reader import read_log
from controlplane.cli import app
from controlplane.domain import TenantConfig
from controlplane.loadtest.profile import Tenant
from controlplane.loadtest.replay import plan
from controlplane.store.db import upgrade
from tests.integration.ledger.conftest import ledger_rows_once
from tests.support import add_tenants

T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)

# A server thread of the test logs; the command's --json output must stay JSON.
pytestmark = pytest.mark.usefixtures("server_logs_elsewhere")


def azure_csv(
    path: Path, rows: list[tuple[float, int, int]], tenants: list[str] | None = None
) -> Path:
    head = "TIMESTAMP,ContextTokens,GeneratedTokens" + (",tenant" if tenants else "")
    lines = [head]
    for i, (t, p, o) in enumerate(rows):
        stamp = (T0 + timedelta(seconds=t)).strftime("%Y-%m-%d %H:%M:%S.%f")
        lines.append(f"{stamp},{p},{o}" + (f",{tenants[i]}" if tenants else ""))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_plan_is_the_trace_scaled(tmp_path: Path) -> None:
    rows = [(i * 0.5, 100 + i, 10 + i) for i in range(400)]
    log = read_log(azure_csv(tmp_path / "t.csv", rows))
    tenants = [Tenant("a", "premium", 1), Tenant("b", "batch", 3)]
    [phase], arrivals = plan(log, speed=10, tenants=tenants)
    assert phase.name == "replay" and phase.end_s == pytest.approx(199.5 / 10)
    assert [a.at_s for a in arrivals] == pytest.approx([i * 0.05 for i in range(400)])
    assert [(a.prompt_tokens, a.max_tokens) for a in arrivals] == [(p, o) for _, p, o in rows]
    share = Counter(a.tenant.tenant_id for a in arrivals)
    assert abs(share["b"] - 300) <= 4 * (400 * 0.75 * 0.25) ** 0.5  # weights 1:3
    again = plan(log, speed=10, tenants=tenants)[1]
    assert [a.tenant for a in again] == [a.tenant for a in arrivals]  # stable
    assert len(plan(log, speed=10, tenants=tenants, limit=25)[1]) == 25
    with pytest.raises(ValueError, match="--speed"):
        plan(log, speed=0.01, tenants=tenants)  # 5.5 hours: over the bound
    by_column = read_log(azure_csv(tmp_path / "c.csv", rows[:4], ["x", "y", "x", "z"]))
    got = plan(by_column, speed=1, tenants=tenants, assign="column")[1]
    assert [a.tenant.tenant_id for a in got] == ["x", "y", "x", "z"]
    with pytest.raises(ValueError, match="tenant column"):
        plan(log, speed=1, tenants=tenants, assign="column")


def test_replay_retries_within_the_slo_and_settles(
    sqlite_url: str, make_server: Callable[..., Any], tmp_path: Path
) -> None:
    upgrade(sqlite_url)
    # "tight" refills 400 tokens/s into a bucket of 600: of 30 requests of
    # 300 tokens in 1.5 s, most are refused TOKEN_RATE (retryable, with a
    # retry_after); some are served later, within the standard lane's 3 s
    # SLO, and the rest give up once a retry could no longer meet it
    add_tenants(sqlite_url, TenantConfig("tight", Decimal(400), 600, max_wait_ms=0))
    srv = make_server(sqlite_url)
    trace = azure_csv(tmp_path / "t.csv", [(i * 0.1, 200, 100) for i in range(30)])
    r = CliRunner().invoke(app, [
        "replay", str(trace), "--target", srv.target, "--speed", "2", "--tenant",
        "tight:standard", "--service-scale", "0", "--json", "--no-progress",
    ])  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    [replay, total] = doc["phases"]
    assert replay["phase"] == "replay" and replay["requests"] == 30
    assert doc["requests"] == 30 and total["requests"] == 30 and total["errors"] == {}
    assert total["retries"] > 0 and total["served_after_refusal"] > 0 and total["gave_up"] > 0
    assert total["admitted"] == doc["completed"]
    assert total["admitted"] + total["refused"] == 30
    # the ledger holds one record per request served, under the admitted attempt's id
    ids = [row.request_id for row in ledger_rows_once(sqlite_url, total["admitted"])]
    assert len(ids) == len(set(ids)) == total["admitted"]
    assert sum("-r" in i for i in ids) == total["served_after_refusal"]
    # without retries, a refusal is final
    r = CliRunner().invoke(app, [
        "replay", str(trace), "--target", srv.target, "--speed", "2", "--tenant",
        "tight:standard", "--service-scale", "0", "--json", "--no-retries", "--no-progress",
        "--seed", "1",
    ])  # fmt: skip
    [_, total] = json.loads(r.stdout)["phases"]
    assert total["retries"] == 0 and total["served_after_refusal"] == 0
