"""The one CLI renderer (controlplane/cli/render.py) and the help reflow."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from importlib.metadata import version

import pytest
import typer.main
from typer.testing import CliRunner

from controlplane.cli import app
from controlplane.cli.render import cell, render_table
from controlplane.cli.root import reflow


def test_vocabulary() -> None:
    assert [cell(v) for v in (None, "", True, False, Decimal("1.50"), 7)] == [
        "-", "-", "yes", "no", "1.50", "7",
    ]  # fmt: skip
    assert cell(datetime(2026, 12, 1, 9, 5, 3)) == "2026-12-01 09:05:03"


def test_table_aligns_numbers_right_and_text_left() -> None:
    rows = [
        {"tenant": "acme", "tokens": 5, "quota": "unlimited", "on": True},
        {"tenant": "b", "tokens": 12345, "quota": 70, "on": False},
    ]
    lines = render_table(rows, ("tenant", "tokens", "quota", "on", "pool")).splitlines()
    assert lines[0].split() == ["tenant", "tokens", "quota", "on", "pool"]
    _, first, second = lines
    # numbers end in the same column; text starts in the same column
    assert first.index("5") + 1 == second.index("12345") + len("12345")
    assert first.startswith("acme") and second.startswith("b ")
    # 'unlimited' does not stop a limit column from being numeric
    assert first.index("unlimited") + len("unlimited") == second.index("70") + 2
    assert first.split()[3:] == ["yes", "-"] and second.split()[3:] == ["no", "-"]
    assert all(line == line.rstrip() for line in lines)


def test_table_footer_and_no_wrapping_into_a_pipe() -> None:
    long = "x" * 300
    out = render_table([{"a": long, "n": 1}, {"a": "y", "n": 2}], ("a", "n"), footer={"n": 3})
    lines = out.splitlines()
    assert any(long in line for line in lines)  # not folded at 80 columns
    assert lines[-1].split() == ["-", "3"]  # the footer row, after a rule
    assert set(lines[-2].strip()) <= {"─", " "}


def test_reflow_joins_paragraph_lines_and_keeps_lists() -> None:
    text = (
        "First line\n    goes on.\n\n    Second paragraph\n    wraps here.\n"
        "    - item one\n    - item two"
    )
    assert reflow(text) == (
        "First line goes on.\n\nSecond paragraph wraps here.\n- item one\n- item two"
    )


def _walk(cmd: object, path: str = "burstgate") -> list[tuple[str, str]]:
    found = [(path, getattr(cmd, "help", None) or "")]
    for name, sub in getattr(cmd, "commands", {}).items():
        found += _walk(sub, f"{path} {name}")
    return found


def test_no_command_help_keeps_source_line_breaks() -> None:
    root = typer.main.get_command(app)
    for path, text in _walk(root):
        for paragraph in text.split("\n\n"):
            for line in paragraph.splitlines()[1:]:
                assert line.startswith(("- ", "* ", " ")), (path, paragraph)


def test_version() -> None:
    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.strip() == f"burstgate {version('burstgate')}"


@pytest.mark.parametrize(
    ("args", "listed"),
    [
        (["keys", "create", "--help"], "admin|viewer|sidecar"),
        (["export", "--help"], "csv|jsonl|parquet"),
        (["export", "--help"], "request|daily"),
        (["simulate", "--help"], "fifo|rate-limit|burstgate|burstgate-ungated"),
    ],
)
def test_choice_options_list_their_choices(args: list[str], listed: str) -> None:
    r = CliRunner().invoke(app, args, env={"COLUMNS": "250"})
    assert r.exit_code == 0 and listed in r.stdout


def test_a_bad_choice_names_the_option() -> None:
    r = CliRunner().invoke(app, ["keys", "create", "--role", "root", "--name", "x"])
    flat = " ".join(r.output.replace("│", " ").split())
    assert r.exit_code == 2 and "'--role'" in flat and "'root' is not one of" in flat
