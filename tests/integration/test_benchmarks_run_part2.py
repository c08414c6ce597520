"""The second half of test_benchmarks_run.py's list of benchmarks (``part``
2), in a module of its own so that ``pytest -n 2 --dist loadfile`` runs it
on the other worker. What is run and asserted: test_benchmarks_run.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_benchmarks_run import Bench, params, run

pytestmark = pytest.mark.bench_smoke


@pytest.mark.parametrize("bench", params(2))
def test_benchmark_runs_tiny(bench: Bench, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    run(bench, tmp_path, request)
