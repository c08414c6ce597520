"""``burstgate simulate --autoscale``: an autoscaler in the loop, each mode a
column beside the fixed pool, with engine-seconds and the most engines
beside the SLOs; and its errors (issue 32)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from controlplane.cli import app

runner = CliRunner()
# Five minutes of the diurnal trace on at most two engines, engines up in
# 30 s and down after a minute: minutes of load swing, seconds to run.
BASE = [
    "simulate", "synthetic:diurnal:3:300", "--engines", "2", "--load", "0.45",
    "--engine-startup-s", "30", "--scale-down-delay-s", "60",
]  # fmt: skip


def _run(*extra: str) -> list[dict[str, Any]]:
    result = runner.invoke(app, [*BASE, *extra, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    runs: list[dict[str, Any]] = json.loads(result.output)["runs"]
    return runs


def test_each_autoscaler_is_a_run_with_its_cost_beside_its_service() -> None:
    runs = _run(
        "--policy", "burstgate", "--policy", "fifo",
        "--autoscale", "off", "--autoscale", "reactive", "--autoscale", "predictive",
        "--autoscale", "queue-length",
    )  # fmt: skip
    got = [(r["policy"], r["autoscale"]) for r in runs]
    # reactive and predictive follow burstgate's signal: no fifo row for them
    assert got == [
        ("burstgate", "off"), ("fifo", "off"), ("burstgate", "reactive"),
        ("burstgate", "predictive"), ("burstgate", "queue-length"), ("fifo", "queue-length"),
    ]  # fmt: skip
    by = {(r["policy"], r["autoscale"]): r for r in runs}
    for r in runs:
        assert r["overall"]["requests"] == by["fifo", "off"]["overall"]["requests"]
        assert 1 <= r["engines_max"] <= 2
    fixed = by["burstgate", "off"]
    # a fixed pool: its engines all the time
    assert fixed["engines_max"] == 2 and fixed["scaling"] == {}
    assert fixed["engine_seconds"] == pytest.approx(2 * fixed["duration_s"])
    reactive = by["burstgate", "reactive"]
    assert reactive["scaling"]["mode"] == "reactive"
    # it starts at one engine: cheaper than the peak's pool
    assert reactive["engine_seconds"] < fixed["engine_seconds"]
    assert reactive["engine_seconds"] >= reactive["duration_s"]  # one engine at least
    predictive = by["burstgate", "predictive"]
    assert {"alarms", "false_alarms", "false_alarm_rate", "lead_time_median_s",
            "fell_back_at_s"} <= set(predictive["scaling"])  # fmt: skip
    # The usual recipe reads the engines' queues: FIFO fills them and is
    # scaled out; burstgate holds the burst in its own queues, so the same
    # recipe sees less and scales out less.
    fifo_q, gate_q = by["fifo", "queue-length"], by["burstgate", "queue-length"]
    assert fifo_q["scaling"]["scale_ups"] >= 1
    assert gate_q["engine_seconds"] < fifo_q["engine_seconds"]


def test_the_table_has_the_autoscaling_section() -> None:
    short = [a.replace(":300", ":120") for a in BASE]  # the table's text, not its figures
    result = runner.invoke(
        app, [*short, "--policy", "burstgate", "--autoscale", "off", "--autoscale", "reactive"],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "burstgate +reactive" in result.output
    assert "engine-seconds / engines max" in result.output
    assert "Autoscaling (vs off" in result.output


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--policy", "fifo", "--autoscale", "reactive"], "--autoscale reactive/predictive"),
        (["--policy", "burstgate", "--autoscale", "reactive", "--min-engines", "3"],
         "--min-engines"),
        (["--autoscale", "sideways"], "sideways"),
    ],
)  # fmt: skip
def test_bad_autoscale_options_are_refused_by_name(extra: list[str], message: str) -> None:
    result = runner.invoke(app, [*BASE, *extra])
    assert result.exit_code != 0
    assert message in result.output
