"""Fixtures for the analysis tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from controlplane.analysis.cli import register

# The shared Azure trace, read in place (CI has it; never copied, never skipped).
AZURE_TRACE = (
    Path(__file__).resolve().parents[3].parent
    / "shared"
    / "traces"
    / "AzureLLMInferenceTrace_conv.csv"
)


@pytest.fixture(scope="session")
def azure_trace() -> Path:
    assert AZURE_TRACE.is_file(), f"shared trace missing at {AZURE_TRACE}"
    return AZURE_TRACE


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    """The analysis commands on an app of their own."""
    application = typer.Typer()
    register(application)
    return application


def run(app: typer.Typer, *args: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of one CLI run."""
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr
