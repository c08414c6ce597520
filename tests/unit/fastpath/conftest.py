"""Fixtures that run every fastpath test against both builds.

``impl`` is parametrised over the pure-Python reference and the compiled module,
imported directly (not through the ``fastpath`` selector).  The compiled module must be
importable unless ``BURSTGATE_FASTPATH=python`` is set, in which case its half of the
tests is skipped (a pure-Python CI job); anywhere else a missing build is a failure.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

from fastpath import _buckets_py


def _compiled() -> ModuleType:
    try:
        return importlib.import_module("fastpath._buckets_c")
    except ImportError as exc:
        if os.environ.get("BURSTGATE_FASTPATH") == "python":
            pytest.skip(f"compiled fastpath not built and BURSTGATE_FASTPATH=python: {exc}")
        pytest.fail(f"compiled fastpath (fastpath._buckets_c) is not importable: {exc}")


@pytest.fixture(params=["python", "cython"])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    """The module under test: ``fastpath._buckets_py`` or ``fastpath._buckets_c``."""
    if request.param == "python":
        return _buckets_py
    return _compiled()


@pytest.fixture
def both() -> tuple[ModuleType, ModuleType]:
    """(reference, compiled) for differential tests."""
    return _buckets_py, _compiled()
