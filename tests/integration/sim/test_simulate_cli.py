"""``burstgate simulate`` end to end on a slice of the shared Azure trace
(read in place, never shipped), and its errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from controlplane.cli import app

# ../shared/ beside the repository (read-only input on every machine and CI)
AZURE = Path(__file__).resolve().parents[4] / "shared/traces/AzureLLMInferenceTrace_conv.csv"
runner = CliRunner()


def test_simulate_compares_the_policies_on_the_same_input() -> None:
    result = runner.invoke(
        app,
        ["simulate", str(AZURE), "--limit", "400", "--load", "0.6", "--load", "1.4", "--json"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    runs = json.loads(result.output)["runs"]
    assert [(r["load"], r["policy"]) for r in runs] == [
        (load, p) for load in (0.6, 1.4) for p in ("fifo", "rate-limit", "burstgate")
    ]
    for r in runs:
        o = r["overall"]
        assert o["requests"] == 400
        assert o["served"] + o["refused"] == 400
        assert set(r["lanes"]) == {"premium", "standard", "batch"}
        assert sum(g["requests"] for g in r["tenants"].values()) == 400
    fifo_light, fifo_heavy = runs[0], runs[3]
    # with room FIFO meets nearly every SLO; past capacity it cannot
    assert fifo_light["overall"]["attainment"] > 0.95
    assert fifo_heavy["overall"]["attainment"] < fifo_light["overall"]["attainment"]
    # past capacity burstgate's default holds the burst and serves premium
    # first: the ranking, not a wall time
    heavy = {r["policy"]: r for r in runs[3:]}
    gate = heavy["burstgate"]
    for other in (heavy["fifo"], heavy["rate-limit"]):
        assert (
            gate["lanes"]["premium"]["attainment"] > other["lanes"]["premium"]["attainment"] + 0.3
        )
        assert gate["overall"]["goodput_tps"] > other["overall"]["goodput_tps"]
        assert gate["engine_queue_max"] < other["engine_queue_max"]


def test_simulate_table_output_and_config_policy(tmp_path: Path) -> None:
    cfg = tmp_path / "gate.yaml"
    cfg.write_text(
        "tenants:\n"
        + "".join(
            f"  - {{tenant_id: {t}, token_rate: 100000, burst_tokens: 1000000, "
            f"default_lane: {t}}}\n"
            for t in ("premium", "standard", "batch")
        )
    )
    result = runner.invoke(
        app,
        ["simulate", str(AZURE), "--limit", "200", "--policy", "fifo", "--config", str(cfg)],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    assert "capacity" in result.output
    # the CLI's table renderer: a header line, then one line per run and lane
    lines = result.output.splitlines()
    assert lines[2].split()[:3] == ["load", "policy", "lane"]
    rows = [line.split()[:3] for line in lines[3:11]]
    assert rows == [["1x", p, lane] for p in ("fifo", "config:gate.yaml")
                    for lane in ("batch", "premium", "standard", "all")]  # fmt: skip
    # --markdown: the same figures as Markdown tables, for docs
    md = runner.invoke(
        app,
        ["simulate", str(AZURE), "--limit", "200", "--policy", "fifo", "--config", str(cfg),
         "--markdown"],
        catch_exceptions=False,
    ).output  # fmt: skip
    assert "| 1x | fifo | premium |" in md
    assert "| 1x | config:gate.yaml | premium |" in md
    assert [line.split()[:3] for line in lines[3:11]] == [
        [c.strip() for c in row.strip("|").split("|")][:3]
        for row in md.splitlines()
        if row.startswith("| 1x |")
    ][:8]


def test_simulate_refuses_bad_input_clearly(tmp_path: Path) -> None:
    jsonl = tmp_path / "mooncake.jsonl"
    jsonl.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5}\n' * 3)
    cases = [
        # a choice option: click names the option and lists the known policies
        (["--policy", "round-robin"], "'round-robin' is not one of 'fifo', 'rate-limit'"),
        (["--burst", "standard:5"], "--burst: expected TENANT:FACTOR:START_S:DURATION_S"),
    ]
    for extra, message in cases:
        r = runner.invoke(app, ["simulate", str(AZURE), "--limit", "50", *extra])
        flat = " ".join(r.output.replace("│", " ").split())  # click's error box wraps
        assert r.exit_code == 2 and message in flat, r.output
    # numeric times without a unit are refused, never guessed
    r = runner.invoke(
        app,
        ["simulate", str(jsonl), "--time-col", "timestamp", "--prompt-col", "input_length",
         "--output-col", "output_length"],
    )  # fmt: skip
    assert r.exit_code == 2 and "time_unit" in r.output, r.output
    r = runner.invoke(app, ["simulate", str(tmp_path / "missing.csv")])
    assert r.exit_code == 2 and "missing.csv" in r.output, r.output


def test_default_engine_parameters_file_loads() -> None:
    from controlplane.sim.engine import EngineParams

    assert EngineParams.load() == EngineParams()  # engine.yaml matches the defaults


def test_simulate_reports_the_burst_window_apart() -> None:
    result = runner.invoke(
        app,
        ["simulate", str(AZURE), "--limit", "400", "--policy", "fifo", "--json",
         "--burst", "standard:5:5:10"],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    run = json.loads(result.output)["runs"][0]
    window = run["burst_window"]
    assert set(window) == {"premium", "standard", "batch"}
    # 5x the standard tenant inside the window: it dominates the window's arrivals
    assert window["standard"]["requests"] > 2 * (
        window["premium"]["requests"] + window["batch"]["requests"]
    )
    assert run["overall"]["requests"] > 400  # the burst's copies were added
