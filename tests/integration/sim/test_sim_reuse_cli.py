"""``burstgate simulate`` with a prefix cache, end to end: a Mooncake-style
trace's block ids, the reuse and billing-drift tables, and bad input."""

from __future__ import annotations

import json
import random
from pathlib import Path

from typer.testing import CliRunner

from controlplane.cli import app

runner = CliRunner()
MOONCAKE = ["--time-col", "timestamp", "--prompt-col", "input_length",
            "--output-col", "output_length", "--time-unit", "ms"]  # fmt: skip


def _mooncake(path: Path, n: int = 300) -> Path:
    """Requests at 20/s, each a shared 4-block prefix of one of three
    "apps" and blocks of its own (512 tokens each)."""
    rng = random.Random(5)
    lines, next_id = [], 1_000
    for i in range(n):
        app_ = rng.randrange(3)
        own = rng.randint(1, 3)
        ids = [app_ * 10 + b for b in range(4)] + list(range(next_id, next_id + own))
        next_id += own
        row = {"timestamp": i * 50, "input_length": 512 * len(ids) - rng.randint(0, 300),
               "output_length": rng.randint(10, 60), "hash_ids": ids}  # fmt: skip
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_trace_with_block_ids_is_simulated_with_a_prefix_cache(tmp_path: Path) -> None:
    trace = str(_mooncake(tmp_path / "m.jsonl"))
    args = ["simulate", trace, *MOONCAKE, "--policy", "fifo", "--load", "0.5",
            "--pricing-window-s", "5", "--json"]  # fmt: skip
    r = runner.invoke(app, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    (run,) = json.loads(r.output)["runs"]
    reuse = run["reuse"]
    assert reuse["block_tokens"] == 512 and reuse["window_s"] == 5
    # four of five to seven blocks are shared: most prompt tokens hit once warm
    assert 0.3 < reuse["hit_rate"] < 0.8
    assert sum(w["settled"] for w in reuse["windows"]) == run["overall"]["served"] == 300
    for w in reuse["windows"]:
        assert {"charge_fixed", "charge_dynamic", "drift_fixed", "drift_dynamic"} <= set(w)
    r = runner.invoke(app, [*args, "--no-prefix-cache"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["runs"][0]["reuse"] is None


def test_the_text_report_has_the_reuse_and_drift_tables(tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    r = runner.invoke(
        app,
        ["simulate", "synthetic:chat-sessions:0:90", "--policy", "fifo", "--load", "0.6",
         "--pricing-window-s", "10", "--pricing-steps", "0.4:1.2", "--burst",
         "standard:4:20:10", "--html", str(page)],
        catch_exceptions=False,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    out = r.output
    assert "prefix cache: 64-token blocks" in out
    for title in ("Prefix cache per run and lane", "Prefix cache over time",
                  "Billing drift (pricing windows of 10 s", "Billing drift, per run"):  # fmt: skip
        assert title in out, title
    assert "drift fixed  drift dynamic" in out
    html = page.read_text()  # the HTML report carries the same tables
    assert "<h2>Prefix cache over time" in html and "<h2>Billing drift, per run" in html


def test_bad_prefix_and_pricing_options_are_named(tmp_path: Path) -> None:
    trace = "synthetic:chat-sessions:0:60"
    cases = [
        (["--block-tokens", "100"], "--block-tokens: must be a multiple of the engine's"),
        (["--block-tokens", "0"], "--block-tokens: must be >= 1"),
        (["--pricing-window-s", "0"], "--pricing-window-s: must be >= 1"),
        (["--pricing-steps", "0.3"], "--pricing-steps: expected MISS_RATE:MULTIPLIER pairs"),
        (["--pricing-steps", "0.6:1.2,0.3:1.5"], "thresholds must be strictly ascending"),
        (["--price", "input=cheap"], "--price: input: expected a number"),
        (["--price", "tokens=1"], "--price: expected KEY=VALUE with KEY one of input"),
        (["--price", "gpu_decode=-1"], "--price: gpu_decode_per_mtok: must be >= 0"),
    ]
    for extra, message in cases:
        r = runner.invoke(app, ["simulate", trace, "--policy", "fifo", *extra])
        flat = " ".join(r.output.split())
        assert r.exit_code == 2 and message in flat and "Traceback" not in flat, (extra, r.output)
