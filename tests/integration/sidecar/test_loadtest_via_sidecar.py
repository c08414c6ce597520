"""`burstgate loadtest --via-sidecar`: the load generator's requests as an
application sends them, through the sidecar; what it reports agrees with
the ledger."""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal
from typing import Any

import pytest
from typer.testing import CliRunner

from controlplane.cli import app
from controlplane.loadtest import profile as prof
from controlplane.loadtest.http import run_http
from tests.integration.sdk.conftest import tenant
from tests.integration.sidecar.conftest import rows

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def test_http_load_is_served_and_billed_with_the_plans_lengths(
    pg_plane: Any, make_stack: Any
) -> None:
    plane = pg_plane(tenant("gold"), tenant("tiny", token_rate=Decimal(1), burst_tokens=50))
    stack = make_stack(plane, speed=50.0, tenant_header="x-burstgate-tenant")
    phases = prof.constant(20, 1.5)
    tenants = [prof.Tenant("gold", "premium"), prof.Tenant("tiny", "standard")]
    plan = prof.arrivals(phases, tenants, prof.Mix(), uniform=True, seed=1)
    result = asyncio.run(run_http(stack.url, plan, run_id="h1"))
    gold = [o for o in result.outcomes if o.arrival.tenant.tenant_id == "gold"]
    tiny = [o for o in result.outcomes if o.arrival.tenant.tenant_id == "tiny"]
    assert gold and all(o.decision == "admit" and o.completed for o in gold)
    # a 50-token bucket cannot hold a single planned request: every one refused
    assert tiny and all(o.decision == "reject" for o in tiny)
    assert {o.reason for o in tiny} <= {"token_rate", "max_tokens"}
    assert not any(o.error for o in result.outcomes) and result.engine_errors == 0
    billed = rows(plane, len(gold))
    assert sorted((r.correlation_id, r.prompt_tokens, r.output_tokens) for r in billed) == sorted(
        (o.request_id, o.arrival.prompt_tokens, o.arrival.max_tokens) for o in gold
    )


def test_the_command_starts_its_own_sidecar_with_local() -> None:
    r = CliRunner().invoke(app, [
        "loadtest", "--local", "--via-sidecar", "--profile", "constant", "--base", "5",
        "--total-s", "2", "--uniform", "--tenant", "acme:premium", "--engine-speed", "50",
        "--json", "--no-progress",
    ])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "and a sidecar in front of it on http://127.0.0.1:" in r.stderr
    assert "stopped the sidecar and the fake engine" in r.stderr
    doc = json.loads(r.stdout)
    assert doc["profile"]["mode"] == "http via sidecar"
    assert doc["requests"] == 9 and doc["phases"][-1]["admitted"] == 9 and doc["completed"] == 9


def test_options_that_do_not_apply_through_a_sidecar_are_refused() -> None:
    r = CliRunner().invoke(app, ["loadtest", "--via-sidecar", "--stream", "--no-progress"])
    assert r.exit_code == 2 and "--via-sidecar" in r.output
    r = CliRunner().invoke(app, ["loadtest", "--via-sidecar", "--sidecar-url",
                                 "http://192.0.2.1:8080", "--no-progress"])  # fmt: skip
    assert r.exit_code == 2 and "--sidecar-url" in r.output and "loopback" in r.output


def test_a_sidecar_without_tenant_header_answers_401_and_the_run_says_why(
    pg_plane: Any, make_stack: Any
) -> None:
    """The load names each request's tenant in a header; a sidecar set up
    without ``tenant_header`` (and no key or default tenant for them)
    answers 401 to all of it, and the run ends with the hint."""
    plane = pg_plane(tenant("gold"))
    stack = make_stack(plane, speed=50.0)  # no tenant_header
    r = CliRunner().invoke(app, [
        "loadtest", "--via-sidecar", "--sidecar-url", stack.url, "--profile", "constant",
        "--base", "5", "--total-s", "1", "--uniform", "--tenant", "gold:premium", "--json",
        "--no-progress",
    ])  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["phases"][-1]["errors"] == {"http_401": doc["requests"]} and doc["requests"] > 0
    assert "hint: the sidecar answered 401 (no tenant)" in r.stderr
    assert "`tenant_header: x-burstgate-tenant`" in r.stderr
