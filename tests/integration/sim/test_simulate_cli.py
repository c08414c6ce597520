"""``burstgate simulate`` end to end on a slice of the shared Azure trace
(read in place, never shipped), and its errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    names = ("fifo", "rate-limit", "drop-late", "burstgate", "premium-only")
    assert [(r["load"], r["policy"]) for r in runs] == [
        (load, p) for load in (0.6, 1.4) for p in names
    ]
    for r in runs:
        o = r["overall"]
        assert o["served"] + o["refused"] + o["aborted"] == o["requests"]
        if r["bound"]:  # the premium tenant's requests alone
            assert set(r["lanes"]) == {"premium"}
            assert o["requests"] == runs[0]["lanes"]["premium"]["requests"]
            continue
        assert o["requests"] == 400
        assert set(r["lanes"]) == {"premium", "standard", "batch"}
        assert sum(g["requests"] for g in r["tenants"].values()) == 400
        assert (r["profile"], r["client"], r["prefill_slowdown"]) == ("h100-8b", "none", 1.0)
    fifo_light, fifo_heavy = runs[0], runs[5]
    # with room FIFO meets nearly every SLO; past capacity it cannot
    assert fifo_light["overall"]["attainment"] > 0.95
    assert fifo_heavy["overall"]["attainment"] < fifo_light["overall"]["attainment"]
    # past capacity burstgate's default holds the burst and serves premium
    # first: the ranking, not a wall time
    heavy = {r["policy"]: r for r in runs[5:]}
    gate = heavy["burstgate"]
    assert gate["goodput_vs_best"] == 1.0  # the best policy at 1.4x on this slice
    # FIFO serves late answers; burstgate refuses what cannot be served in time
    assert gate["wasted_share"] < 0.05 < 0.15 < heavy["fifo"]["wasted_share"]
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
    at = lines.index("Per run and lane:")
    assert lines[at + 1].split()[:3] == ["load", "policy", "lane"]
    rows = [line.split()[:3] for line in lines[at + 2 : at + 10]]
    assert rows == [["1x", p, lane] for p in ("fifo", "config:gate.yaml")
                    for lane in ("batch", "premium", "standard", "all")]  # fmt: skip
    # --markdown: the same figures as Markdown tables, for docs
    md_out = runner.invoke(
        app,
        ["simulate", str(AZURE), "--limit", "200", "--policy", "fifo", "--config", str(cfg),
         "--markdown"],
        catch_exceptions=False,
    ).output  # fmt: skip
    md = md_out[md_out.index("Per run and lane:") :]
    assert "| 1x | fifo | premium |" in md
    assert "| 1x | config:gate.yaml | premium |" in md
    assert [line.split()[:3] for line in lines[at + 2 : at + 10]] == [
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
        (["--prefill-slowdown", "0"], "--prefill-slowdown: must be a positive number, got '0'"),
        (["--prefill-slowdown", "1,fast"], "--prefill-slowdown: expected a number"),
        (
            ["--engine-profile", "a100"],
            "--engine-profile: unknown profile 'a100'; known: h100-8b, h100-8b-peak, h100x4-70b",
        ),
        (
            ["--engine-profile", "h100-8b", "--engine-config", "e.yaml"],
            "--engine-profile and --engine-config: give one or the other",
        ),
        (["--retry-client", "curl"], "'curl' is not one of 'openai', 'slo-aware'"),
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
    r = runner.invoke(app, ["simulate", "synthetic:flood"])
    assert r.exit_code == 2 and "unknown synthetic trace 'flood'" in r.output, r.output


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


def _json(*args: str) -> list[dict[str, Any]]:
    result = runner.invoke(app, ["simulate", *args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    runs: list[dict[str, Any]] = json.loads(result.output)["runs"]
    return runs


def test_prefill_slowdown_runs_the_same_table_on_slower_prefill() -> None:
    runs = _json(str(AZURE), "--limit", "300", "--policy", "fifo", "--load", "1.2",
                 "--prefill-slowdown", "1,2", "--prefill-slowdown", "3")  # fmt: skip
    assert [(r["load"], r["prefill_slowdown"]) for r in runs] == [(1.2, 1), (1.2, 2), (1.2, 3)]
    capacity = [r["capacity_rps"] for r in runs]
    # capacity is measured again on the slower engines: 1.2x is always 1.2x of it
    assert capacity[0] > capacity[1] > capacity[2]
    assert capacity[2] > capacity[0] / 3  # decode and step costs did not slow down


def test_engine_profiles_and_files() -> None:
    base = ["--limit", "300", "--policy", "fifo", "--load", "0.5"]
    (default,) = _json(str(AZURE), *base)
    (peak,) = _json(str(AZURE), *base, "--engine-profile", "h100-8b-peak")
    (big,) = _json(str(AZURE), *base, "--engine-profile", "h100x4-70b")
    assert peak["capacity_rps"] > 1.3 * default["capacity_rps"]
    assert default["capacity_rps"] > 1.5 * big["capacity_rps"]
    assert (default["profile"], peak["profile"]) == ("h100-8b", "h100-8b-peak")
    yaml = Path(__file__).resolve().parents[3] / "controlplane/sim/engine.yaml"
    (from_file,) = _json(str(AZURE), *base, "--engine-config", str(yaml))
    assert from_file["profile"] == "file:engine.yaml"
    assert from_file["capacity_rps"] == default["capacity_rps"]  # engine.yaml is h100-8b


def test_retrying_clients_are_the_openai_client_unless_asked(tmp_path: Path) -> None:
    # burstgate with the gate off: no deadlines, so its refusals may be
    # retried (with the gate on, they say when a retry cannot help)
    args = [str(AZURE), "--limit", "400", "--load", "3", "--policy", "burstgate-ungated",
            "--retries"]  # fmt: skip
    (openai,) = _json(*args)
    (slo_aware,) = _json(*args, "--retry-client", "slo-aware")
    assert (openai["client"], slo_aware["client"]) == ("openai", "slo-aware")
    # the openai client comes back whatever its SLO: more of it is served
    # after a refusal than of a client that gives up once its SLO is lost
    assert openai["overall"]["served_after_refusal"] > slo_aware["overall"]["served_after_refusal"]


def test_synthetic_traces_run_and_write_as_azure_csv(tmp_path: Path) -> None:
    out = tmp_path / "hb.csv"
    r = runner.invoke(app, ["simulate", "synthetic:heavy-burst:2:300", "--write-trace", str(out)])
    assert r.exit_code == 0, r.output
    assert f"written to {out}" in r.output and "CV" in r.output
    assert out.read_text().startswith("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    from_file = _json(str(out), "--policy", "fifo", "--engines", "2")
    generated = _json("synthetic:heavy-burst:2:300", "--policy", "fifo", "--engines", "2")
    assert from_file == generated  # the file is the trace, exactly
    (run,) = generated
    assert run["arrivals_cv"] > 2 and run["arrivals_peak_to_mean"] > 10
