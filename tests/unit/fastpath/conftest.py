"""Fixtures that run every fastpath test against both builds.

``impl`` (token buckets), ``sched`` (scheduling primitives) and ``reqlog`` (the request
table) are parametrised over the pure-Python reference and the compiled module, imported
directly (not through the ``fastpath`` selector).  The compiled modules must be importable unless
``BURSTGATE_FASTPATH=python`` is set, in which case their half of the tests is skipped
(a pure-Python CI job); anywhere else a missing build is a failure.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

from fastpath import _buckets_py, _reqlog_py, _sched_py


def compiled(name: str) -> ModuleType:
    """``fastpath.<name>``, the compiled module; skips or fails when it is not built."""
    try:
        return importlib.import_module(f"fastpath.{name}")
    except ImportError as exc:
        if os.environ.get("BURSTGATE_FASTPATH") == "python":
            pytest.skip(f"compiled fastpath not built and BURSTGATE_FASTPATH=python: {exc}")
        pytest.fail(f"compiled fastpath (fastpath.{name}) is not importable: {exc}")


@pytest.fixture(params=["python", "cython"])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    """The module under test: ``fastpath._buckets_py`` or ``fastpath._buckets_c``."""
    if request.param == "python":
        return _buckets_py
    return compiled("_buckets_c")


@pytest.fixture
def both() -> tuple[ModuleType, ModuleType]:
    """(reference, compiled) token-bucket modules, for differential tests."""
    return _buckets_py, compiled("_buckets_c")


@pytest.fixture(params=["python", "cython"])
def sched(request: pytest.FixtureRequest) -> ModuleType:
    """The module under test: ``fastpath._sched_py`` or ``fastpath._sched_c``."""
    if request.param == "python":
        return _sched_py
    return compiled("_sched_c")


@pytest.fixture
def sched_both() -> tuple[ModuleType, ModuleType]:
    """(reference, compiled) scheduling modules, for differential tests."""
    return _sched_py, compiled("_sched_c")


@pytest.fixture(params=["python", "cython"])
def reqlog(request: pytest.FixtureRequest) -> ModuleType:
    """The module under test: ``fastpath._reqlog_py`` or ``fastpath._reqlog_c``."""
    if request.param == "python":
        return _reqlog_py
    return compiled("_reqlog_c")


@pytest.fixture
def reqlog_both() -> tuple[ModuleType, ModuleType]:
    """(reference, compiled) request-table modules, for differential tests."""
    return _reqlog_py, compiled("_reqlog_c")
