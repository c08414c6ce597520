"""What an operator runs the sidecar with (issue 35): the completion spool
on by default and surviving a restart, the JSON access log, the capped
max_tokens and rate-limit headers on real requests, a fresh sidecar's
/metrics page, the dashboard's Sidecars row and the sidecar alerts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.protoclient import ProtoClient
from burstgate_client.sidecar.metrics import (
    LOAD_REPORTS,
    OUTCOMES,
    REASONS,
    SETTLEMENTS,
    UPSTREAM_STATUSES,
)
from prometheus_client.parser import text_string_to_metric_families

from controlplane.domain.policy import Policy
from tests.integration.metrics.promql import metric_names
from tests.integration.metrics.test_deploy_files import RULES, dashboard, exposed, row_panels
from tests.integration.sdk.conftest import tenant
from tests.integration.sidecar.conftest import MODEL, Stack, rows
from tests.integration.sidecar.fresh import fresh_metrics_page
from tests.support import free_port, wait_until

RUNBOOK = "https://github.com/burstgate/burstgate/blob/main/docs/runbook.md#"


def chat(stack: Stack, key: str = "sk-acme", **kw: Any) -> Any:
    kw.setdefault("messages", [{"role": "user", "content": "Tell me about bursts."}])
    kw.setdefault("model", MODEL)
    return stack.client(key).chat.completions.with_raw_response.create(**kw)


def pending_in(spool: Path) -> dict[str, dict[str, Any]]:
    """The spool file's pending Completes by request id (adds without a done)."""
    adds: dict[str, dict[str, Any]] = {}
    for line in spool.read_text().splitlines():
        event = json.loads(line)
        if "add" in event:
            adds[event["add"]["request_id"]] = event["add"]
        else:
            adds.pop(event["done"][1], None)
    return adds


# ------------------------------------------------------------ the spool


@pytest.mark.postgres
def test_a_complete_undelivered_at_shutdown_is_delivered_by_the_next_sidecar(
    pg_plane: Any, make_stack: Any, tmp_path: Path
) -> None:
    spool = tmp_path / "state" / "spool.jsonl"
    plane = pg_plane()
    first = make_stack(plane, spool_path=spool)
    plane.stop()  # the control plane's port closed: the premium lane fails open
    served = chat(first, max_tokens=4, extra_headers={"x-burstgate-lane": "premium",
                                                      "x-request-id": "kept"})  # fmt: skip
    assert served.headers["x-burstgate-offline"] == "true"
    wait_until(lambda: first.pending() == 1, message="the offline Complete buffered")
    first.stop()  # shut down with it undelivered
    minted = served.headers["x-burstgate-request-id"]
    (kept,) = pending_in(spool).values()
    assert (kept["request_id"], kept["correlation_id"]) == (minted, "kept")
    assert kept["generated_tokens"] == "4" and kept["offline"]["lane"] == "premium"
    plane.start()  # the same port
    second = make_stack(plane, spool_path=spool)  # a new sidecar on the same spool
    (row,) = rows(plane, 1)
    assert (row.correlation_id, row.output_tokens, row.lane) == ("kept", 4, "premium")
    wait_until(lambda: second.pending() == 0, message="the spool emptied")
    assert second.metrics()["burstgate_sidecar_pending_completions"] == 0
    wait_until(lambda: not pending_in(spool) or None, message="its done line written")


@pytest.mark.slow
def test_the_command_spools_under_state_directory_by_default_and_alone(tmp_path: Path) -> None:
    """The real ``burstgate-sidecar``: the start-up line names the default
    spool under $STATE_DIRECTORY; a second sidecar on the same spool
    refuses to start, naming --spool, without a traceback."""
    state, cwd = tmp_path / "state", tmp_path / "cwd"
    cwd.mkdir()
    env = {**os.environ, "STATE_DIRECTORY": str(state)}
    env.pop("BURSTGATE_SIDECAR_ACCESS_LOG", None)
    script = Path(sys.executable).with_name("burstgate-sidecar")
    args = [str(script), "--upstream", "http://127.0.0.1:9", "--control-plane", "127.0.0.1:1"]
    first = subprocess.Popen([*args, "--port", str(free_port())], cwd=cwd, env=env, text=True,
                             stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        assert first.stderr is not None
        lines: list[str] = []
        while not any(line.startswith("completion spool:") for line in lines):
            line = first.stderr.readline()
            assert line, f"exited {first.wait()}: {''.join(lines)}"
            lines.append(line)
        spool = state / "burstgate-sidecar-spool.jsonl"
        assert lines[-1].startswith(f"completion spool: {spool} ("), lines
        assert spool.exists() and not list(cwd.iterdir())
        second = subprocess.run([*args, "--port", str(free_port())], cwd=cwd, env=env,
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        assert second.returncode == 2, second.stderr
        assert second.stderr.startswith(f"error: --spool: {spool} is in use by another sidecar")
        assert "Traceback" not in second.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        code = first.wait(timeout=30)
        if first.stderr is not None:
            first.stderr.close()
    assert code == 0


# --------------------------------------------- headers and the access log


@pytest.mark.postgres
def test_a_capped_request_says_so_and_every_request_has_its_access_log_line(
    pg_plane: Any, make_stack: Any, tmp_path: Path
) -> None:
    log = tmp_path / "access.log"
    # the pool degrades past 50 % GPU: degradable lanes get 5 tokens at most
    plane = pg_plane(tenant("acme", max_concurrency=4),
                     tenant("beta", hourly_quota=10),
                     policy=Policy(gate_fallback_inflight=100_000, degrade_gpu_util=0.5,
                                   degrade_max_tokens=5))  # fmt: skip
    stack = make_stack(plane, access_log=str(log), metrics={"enabled": False})
    with ProtoClient(plane.direct) as c:  # an engine of the pool, its GPU 90 % busy
        c.report_load(pb.LoadReport(pool="default", engine_id="e1", max_batch_tokens=8192,
                                    gpu_utilization=0.9, requests_running=1, max_num_seqs=256))
    # asked 20, granted the degradation's 5: the engine stops at 5
    capped = chat(stack, max_tokens=20, extra_headers={"x-request-id": "capped"})
    assert capped.parse().usage.completion_tokens == 5
    h = capped.headers
    assert h["x-burstgate-granted-max-tokens"] == "5"
    assert h["x-burstgate-degraded"] == "max_tokens=5"
    # the tenant's first answer carries the whole x-ratelimit-* set, from its
    # limits (GetLimits, beside the Admit) and its admission's bucket level
    assert h["x-ratelimit-limit-requests"] == "4"
    assert 0 <= int(h["x-ratelimit-remaining-requests"]) <= 4
    assert h["x-ratelimit-reset-requests"] == "0ms"
    assert h["x-ratelimit-limit-tokens"] == "100000000"
    assert 0 < int(h["x-ratelimit-remaining-tokens"]) < 100_000_000
    assert h["x-ratelimit-reset-tokens"].endswith(("ms", "s"))
    plain = chat(stack, max_tokens=3, extra_headers={"x-burstgate-lane": "premium"})
    assert "x-burstgate-granted-max-tokens" not in plain.headers  # granted what it asked
    assert plain.parse().usage.completion_tokens == 3
    with pytest.raises(openai.APIStatusError) as refused:
        # over beta's hourly quota (premium: not degraded to fit)
        chat(stack, "sk-beta", max_tokens=300, extra_headers={"x-burstgate-lane": "premium"})
    reason = refused.value.response.headers["x-burstgate-reason"]
    with pytest.raises(openai.AuthenticationError):
        chat(stack, "sk-nobody", max_tokens=1)  # no tenant: 401 from the sidecar
    rows(plane, 2)
    def written() -> list[str] | None:
        got = log.read_text().splitlines()
        return got if len(got) >= 4 else None

    lines = wait_until(written, message="four access-log lines")
    first, second, third, fourth = (json.loads(line) for line in lines)
    assert len(lines) == 4
    assert {k: first[k] for k in ("request_id", "correlation_id", "path", "tenant", "lane",
                                  "model", "stream", "status", "outcome", "reason",
                                  "generated_tokens", "client_disconnected")} == {
        "request_id": h["x-burstgate-request-id"], "correlation_id": "capped",
        "path": "/v1/chat/completions", "tenant": "acme", "lane": None, "model": MODEL,
        "stream": False, "status": 200, "outcome": "admitted", "reason": None,
        "generated_tokens": 5, "client_disconnected": False,
    }  # fmt: skip
    assert first["prompt_tokens"] == capped.parse().usage.prompt_tokens
    assert first["queue_wait_ms"] == 0
    assert 0 < first["upstream_ms"] <= first["total_ms"]
    assert first["ts"].endswith("Z") and first["ts"][:2] == "20"
    assert (second["lane"], second["generated_tokens"], second["status"]) == ("premium", 3, 200)
    assert second["correlation_id"] is None
    assert (third["tenant"], third["outcome"], third["reason"]) == ("beta", "refused", reason)
    assert third["status"] == refused.value.response.status_code and third["upstream_ms"] is None
    assert (fourth["tenant"], fourth["status"], fourth["outcome"]) == (None, 401, "bad_request")


# ------------------------------------------------- metrics, dashboard, alerts


def test_a_fresh_sidecar_exports_every_known_label_at_zero_and_no_created_series() -> None:
    text = fresh_metrics_page()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }  # fmt: skip
    assert not [name for name, _ in samples if name.endswith("_created")]
    for name, label, values in (
        ("burstgate_sidecar_requests_total", "outcome", OUTCOMES),
        ("burstgate_sidecar_refusals_total", "reason", REASONS),
        ("burstgate_sidecar_upstream_responses_total", "status", UPSTREAM_STATUSES),
        ("burstgate_sidecar_settlements_total", "result", SETTLEMENTS),
        ("burstgate_sidecar_load_reports_total", "result", LOAD_REPORTS),
    ):
        for value in values:
            assert samples[name, ((label, value),)] == 0, (name, value)
    # every refusal reason the proto knows, and the SDK's own two
    assert {"token_rate", "hourly_quota", "queue_timeout", "unavailable"} <= set(REASONS)
    assert samples["burstgate_sidecar_pending_completions", ()] == 0
    assert samples["burstgate_sidecar_overhead_seconds_count", ()] == 0
    tool = shutil.which("promtool")
    if tool is not None:  # Prometheus's naming rules (test_deploy_files.py requires it in CI)
        lint = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert lint.returncode == 0, lint.stdout + lint.stderr


def test_the_dashboards_sidecar_row_reads_what_a_sidecar_exports() -> None:
    panels = row_panels(dashboard(), "Sidecars")
    served = exposed(fresh_metrics_page())
    used: set[str] = set()
    for p in panels:
        assert p["type"] == "timeseries" and p["description"], p["title"]
        for t in p["targets"]:
            names = metric_names(t["expr"])
            assert names and all(n.startswith("burstgate_sidecar_") for n in names), t["expr"]
            assert names <= served, f"{p['title']}: {sorted(names - served)}"
            assert 'instance=~"$sidecar"' in t["expr"], t["expr"]
            used |= names
    titles = " | ".join(p["title"] for p in panels).lower()
    for wanted in ("refusals by reason", "5xx", "pending completions", "load reports",
                   "added latency"):  # fmt: skip
        assert wanted in titles, wanted
    assert {"burstgate_sidecar_refusals_total", "burstgate_sidecar_upstream_responses_total",
            "burstgate_sidecar_pending_completions", "burstgate_sidecar_load_reports_total",
            "burstgate_sidecar_overhead_seconds_bucket"} <= used  # fmt: skip
    (var,) = (v for v in dashboard()["templating"]["list"] if v["name"] == "sidecar")
    assert "burstgate_sidecar_requests_total" in var["query"]["query"]


def test_the_sidecar_alerts_are_the_last_group_with_runbook_links() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    assert groups[-1]["name"] == "burstgate-sidecar"
    rules = {r["alert"]: r for r in groups[-1]["rules"]}
    assert set(rules) == {"BurstgateSidecarCompletionsPending", "BurstgateSidecarUpstreamErrors"}
    served = exposed(fresh_metrics_page())
    for name, rule in rules.items():
        assert rule["annotations"]["runbook_url"] == RUNBOOK + name.lower()
        assert metric_names(rule["expr"]) <= served, name
