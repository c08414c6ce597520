"""Fixtures for the analysis tests."""

from __future__ import annotations

from pathlib import Path

import pytest

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
