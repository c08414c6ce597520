"""`burstgate pools status` and GetServerState's pool demand over a real
server and database (issue 32, docs/autoscaling.md "Signals")."""

from __future__ import annotations

import pytest
from burstgate_client._proto.burstgate.v1 import admission_pb2 as pb
from burstgate_client.admin import apb

from tests.integration.admin.conftest import Env
from tests.integration.admin.test_cli_admin import Cli, server_logs_elsewhere

__all__ = ["server_logs_elsewhere"]  # the autouse fixture, shared


def test_pool_demand_over_the_admin_api_and_the_cli(env: Env) -> None:
    # asked of the default pool: acme's 100 and 200 prompt tokens, beta's
    # 3,000; beta's second 3,000 finds its bucket (5,000 tokens, 1 a
    # second) short: its own limit, not demand
    assert env.admit("acme", "a1", prompt=100).decision == 1
    assert env.admit("acme", "a2", prompt=200).decision == 1
    assert env.admit("beta", "b1", prompt=3_000).decision == 1
    assert env.admit("beta", "b2", prompt=3_000).reason == pb.REASON_TOKEN_RATE
    state = env.viewer.call("GetServerState", apb.GetServerStateRequest())
    pools = {p.pool: p for p in state.pools}
    assert "default" in pools  # declared: listed before any engine reports
    p = pools["default"]
    assert p.demand_requests_per_second > 0
    # the mean prompt of what was asked, 3,300 / 3: beta's refusal is not
    # in it (the ratio does not depend on how long the window has run)
    assert p.demand_tokens_per_second / p.demand_requests_per_second == pytest.approx(1_100)
    # no engine reports and no pace: one engine, to serve what is asked
    assert p.engines_reporting == 0
    assert (p.desired_engines, p.desired_engines_predicted) == (1, 1)
    assert not p.HasField("work_rate_tokens_per_second_per_engine")
    assert [b.lane for b in p.lanes] == ["premium", "standard", "batch"]
    assert all(b.requests == 0 and b.predicted_wait_seconds == 0 for b in p.lanes)

    cli = Cli(env, env.keys.viewer)
    (shown,) = cli.json("pools", "status", "--pool", "default")
    assert shown["pool"] == "default" and shown["desired_engines"] == 1
    assert shown["demand_tokens_per_second"] / shown["demand_requests_per_second"] == (
        pytest.approx(1_100)
    )
    out = cli("pools", "status").stdout
    for column in ("engines", "demand_tok_s", "demand_req_s", "desired", "predicted",
                   "held_tokens", "wait_s", "not learned"):  # fmt: skip
        assert column in out
    missing = cli("pools", "status", "--pool", "nope", code=2)
    assert "no pool 'nope'" in missing.stderr and "default" in missing.stderr


def test_pools_status_shows_the_miss_rate_and_the_eviction_advice(env: Env) -> None:
    """Issue 37: what the engines report of their prefix caches, and the
    advice their load reports are answered with, in GetServerState and the CLI."""
    cli = Cli(env, env.keys.viewer)
    (before,) = cli.json("pools", "status", "--pool", "default")
    assert "kv_cache_miss_rate" not in before  # nothing reported: unset, not 0
    assert "not measured" in cli("pools", "status", "--pool", "default").stdout
    stub = env.admission()
    ack = stub.ReportLoad(pb.LoadReport(
        pool="default", engine_id="e0", max_batch_tokens=4096, batch_tokens=4096,
        queue_depth=512, queue_capacity=256, kv_cache_miss_rate=0.375,
    ), timeout=10)  # fmt: skip
    # load 0.81 (a full batch, its queue over capacity, a few misses): the
    # advice's middle step (docs/sidecar.md, "Eviction advice")
    assert 0.5 < ack.load <= 0.85 and ack.evict_below_reuse_per_s == 0.15
    state = env.viewer.call("GetServerState", apb.GetServerStateRequest())
    (p,) = [p for p in state.pools if p.pool == "default"]
    assert p.kv_cache_miss_rate == 0.375
    assert p.evict_below_reuse_per_s == ack.evict_below_reuse_per_s
    (shown,) = cli.json("pools", "status", "--pool", "default")
    assert shown["kv_cache_miss_rate"] == 0.375 and shown["evict_below_reuse_per_s"] == 0.15
    header, row = cli("pools", "status", "--pool", "default").stdout.splitlines()[:2]
    # the last two columns ("tok_s_per_engine" before them says "not learned")
    assert header.split()[-2:] == ["miss_rate", "evict_below_reuse_s"]
    assert row.split()[-2:] == ["0.375", "0.15"]
