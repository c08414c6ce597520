"""The CLI's first-hour paths that need no server (issue 35): help without
Python type names, tables at 80 columns, YAML errors that name the file and
line with "did you mean", int64 as JSON numbers, the loadtest/replay
defaults fitted to the demo's tenants, and the pricing cost ratio."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main
import typer.testing
from burstgate_client._proto.burstgate.v1 import admin_pb2 as apb
from typer.testing import CliRunner

from controlplane.analysis.reader import read_log
from controlplane.cli import app, render
from controlplane.cli.common import EXIT_UNREACHABLE, to_dict
from controlplane.cli.loadtest import sidecar_401_hint
from controlplane.cli.pricing import cost_ratio
from controlplane.cli.render import render_table
from controlplane.cli.root import metavar
from controlplane.loadtest import profile as prof
from controlplane.loadtest.demofit import demo_tenants
from controlplane.loadtest.replay import plan
from tests.integration.loadtest.test_replay import azure_csv


def _commands(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    yield path
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_every_commands_help_shows_no_python_types_and_no_double_negation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = CliRunner()
    root = typer.main.get_command(app)
    # The tree built once (CliRunner builds it again for every invoke).
    monkeypatch.setattr(typer.testing, "_get_command", lambda _app: root)
    paths = list(_commands(root))
    assert ("tenant", "list") in paths and ("loadtest",) in paths and len(paths) > 40
    for path in paths:
        r = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert r.exit_code == 0, (path, r.output)
        for bad in ("<list[", "<bool>", "--no-no-", "<str>", "<int>", "<float>", "<path>"):
            assert bad not in r.output, (path, bad)
    shown = runner.invoke(app, ["loadtest", "--help"], env={"COLUMNS": "200"}).output
    assert "--no-progress " in shown and "(default: 30; --local 10)" in shown


def test_metavars_are_an_operators_words() -> None:
    assert [metavar(x) for x in ("<list[str]>", "<int range>", "<float>", "<a|b>", "<path>")] == [
        "TEXT", "INTEGER", "NUMBER", "[a|b]", "PATH",
    ]  # fmt: skip


WIDE = {"phase": "recovery", "requests": 12345, "per_s": "80.1", "admitted": 9000,
        "refused": 3345, "errors": 0, "p50_ms": 1.234, "p95_ms": 11253.921,
        "p99_ms": 11259.839, "max_ms": 11259.839, "held": 47, "wait_p99_ms": 11257.0,
        "retries": 12, "served_after_refusal": 3, "gave_up": 1}  # fmt: skip


def test_a_table_too_wide_for_columns_becomes_plain_records(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(render, "_is_terminal", lambda: True)
    monkeypatch.setenv("COLUMNS", "80")
    out = render_table([WIDE, WIDE | {"phase": "all"}], list(WIDE), footer={"requests": 2})
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80
    blocks = out.split("\n\n")
    assert len(blocks) == 3 and blocks[0].splitlines()[0].split() == ["phase", "recovery"]
    assert blocks[1].splitlines()[-1].split() == ["gave_up", "1"]
    assert blocks[2].split() == ["total", "requests", "2"]
    narrow = render_table([{"a": "x", "n": 1}], ("a", "n"))  # fits: still a table
    assert narrow.splitlines() == ["a  n", "x  1"]
    monkeypatch.setattr(render, "_is_terminal", lambda: False)
    # into a pipe: no width, one line per row, whatever $COLUMNS says
    assert len(render_table([WIDE], list(WIDE)).splitlines()) == 2


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    return path


def test_config_apply_names_the_file_and_line_of_broken_yaml(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "tenants:\n  - tenant_id: a\n    token_rate: [1\n")
    r = CliRunner().invoke(app, ["config", "apply", "--dry-run", str(path),
                                 "--database-url", f"sqlite:///{tmp_path}/none.db"])  # fmt: skip
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith(f"error: {path}:4:1: not valid YAML"), r.stderr
    assert "Traceback" not in r.output


def test_config_apply_suggests_the_field_meant(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "lanes: []\ntenants:\n  - tenant_id: a\n    token_rte: 5\n"
                           "    burst_tokens: 10\n")  # fmt: skip
    r = CliRunner().invoke(app, ["config", "apply", "--dry-run", str(path)])
    assert r.exit_code == 2
    assert r.stderr.strip() == (f"error: {path}:4: tenants[0].token_rte: unknown field; "
                                "did you mean token_rate?")  # fmt: skip
    # nothing close: the fields it could be
    path.write_text("tenants: []\npolicy_overrides: {}\n")
    r = CliRunner().invoke(app, ["config", "apply", "--dry-run", str(path)])
    assert r.exit_code == 2 and f"{path}:2: policy_overrides: unknown field" in r.stderr
    assert "expected one of lanes, tenants, policy" in r.stderr


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed when the block ends


@pytest.mark.parametrize("args", [
    ("tenant", "list", "--target", "{t}", "--api-key", "k"),  # after the command
    ("tenant", "--target", "{t}", "--api-key", "k", "list"),  # before it
    ("admin", "state", "--target", "{t}", "--api-key", "k", "--timeout", "3"),
    ("pricing", "show", "--target", "{t}", "--api-key", "k"),
    ("loadtest", "--target", "{t}", "--profile", "constant", "--total-s", "1"),
])  # fmt: skip
def test_no_server_at_the_target_says_so(args: tuple[str, ...]) -> None:
    target = _closed_port()
    r = CliRunner().invoke(app, [a.format(t=target) for a in args])
    assert r.exit_code == EXIT_UNREACHABLE, (r.output, r.exception)
    assert f"no burstgate server answered at {target}" in r.stderr
    assert "is `burstgate serve` running" in r.stderr and "UNAVAILABLE" not in r.stderr
    assert "Traceback" not in r.output


def test_audit_filter_is_object_and_a_filter_given_as_target_is_caught() -> None:
    r = CliRunner().invoke(app, ["admin", "audit", "list", "--target", "tenant:acme",
                                 "--api-key", "k"])  # fmt: skip
    assert r.exit_code == 2 and "use --object tenant:acme" in r.stderr
    r = CliRunner().invoke(app, ["tenant", "list", "--target", "nohost", "--api-key", "k"])
    assert r.exit_code == 2 and "--target: expected HOST:PORT" in r.stderr


def test_int64_fields_are_json_numbers() -> None:
    t = apb.Tenant(tenant_id="a", burst_tokens=400, hourly_quota=2**40, max_concurrency=5)
    d = to_dict(t)
    assert d["burst_tokens"] == 400 and d["hourly_quota"] == 2**40 and d["max_concurrency"] == 5
    # inside repeated messages too
    listed = json.loads(json.dumps(to_dict(apb.ListTenantsResponse(tenants=[t, t]))))
    assert [x["burst_tokens"] for x in listed["tenants"]] == [400, 400]


def test_default_load_fits_the_demo_tenants() -> None:
    tenants = demo_tenants()
    by_id = {t.tenant_id: t for t in tenants}
    assert [(t.tenant_id, t.lane) for t in tenants] == [
        ("acme", "premium"), ("agentco", "standard"), ("free-tier", "batch"),
    ]  # fmt: skip
    # weights: the demo's token rates (20000, 5000, 200); caps: max_tokens_per_request
    assert [t.weight for t in tenants] == [20000, 5000, 200]
    assert by_id["free-tier"].max_request_tokens == 2048
    arrivals = prof.arrivals(prof.constant(50, 60), tenants, prof.Mix(), seed=2)
    for a in arrivals:
        cap = by_id[a.tenant.tenant_id].max_request_tokens
        assert cap is not None and a.prompt_tokens + a.max_tokens <= cap
    free = [a for a in arrivals if a.tenant.tenant_id == "free-tier"]
    # its share of requests is its share of the rates (~0.8 %), and its
    # long requests are as long as its cap allows
    assert 0 < len(free) < 0.02 * len(arrivals)
    assert max(a.prompt_tokens for a in arrivals if a.tenant.tenant_id == "acme") > 4000


def test_replay_gives_a_row_only_to_a_tenant_whose_cap_it_fits(tmp_path: Path) -> None:
    rows = [(i * 0.01, 3000 if i % 2 else 100, 50) for i in range(1000)]
    path = azure_csv(tmp_path / "t.csv", rows)
    tenants = [prof.Tenant("big", "premium", 1), prof.Tenant("small", "batch", 1, 2048)]
    _, arrivals = plan(read_log(path), speed=1, tenants=tenants)
    small = [a for a in arrivals if a.tenant.tenant_id == "small"]
    assert small and all(a.prompt_tokens + a.max_tokens <= 2048 for a in small)
    # the short half is shared by weight; the long half all goes to "big"
    assert 200 < len(small) < 300
    assert [(a.prompt_tokens, a.max_tokens) for a in arrivals] == [(p, o) for _, p, o in rows]


def test_cost_ratio_is_cost_over_charge() -> None:
    assert cost_ratio("1.30", "1.00") == "1.300"
    assert cost_ratio("0.000002", "0.000003") == "0.667"
    assert cost_ratio("1", "0") is None


def test_a_401_from_the_sidecar_hints_at_tenant_header() -> None:
    doc = {"requests": 10, "phases": [{"phase": "all", "errors": {"http_401": 10}}]}
    hint = sidecar_401_hint(doc)
    assert hint is not None and "tenant_header: x-burstgate-tenant" in hint
    assert "10 of 10" in hint
    assert sidecar_401_hint({"requests": 1, "phases": [{"phase": "all", "errors": {}}]}) is None
