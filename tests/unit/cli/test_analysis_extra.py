"""The tools' HTML reports need the ``analysis`` extra (matplotlib): without
it each command says so before it starts its run, and writes nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from controlplane.cli import app

TRACE = Path(__file__).resolve().parents[3].parent / "shared" / "traces"


@pytest.mark.parametrize(
    "args",
    [
        ["simulate", "synthetic:diurnal"],
        ["analyze", str(TRACE / "AzureLLMInferenceTrace_conv.csv")],
        ["loadtest", "--target", "127.0.0.1:1"],
    ],
    ids=["simulate", "analyze", "loadtest"],
)
def test_html_without_matplotlib_is_refused_up_front(
    args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    report = tmp_path / "report.html"
    r = CliRunner().invoke(app, [*args, "--html", str(report)], env={"COLUMNS": "250"})
    assert r.exit_code == 2, r.output
    flat = " ".join(r.output.split())
    assert "--html draws with matplotlib, which is not installed" in flat
    assert "burstgate[analysis]" in flat
    assert not report.exists()


def test_html_with_matplotlib_passes_the_check() -> None:
    from controlplane.analysis.extras import plotting_missing

    assert plotting_missing("--html") is None
