"""The ``fastpath`` selector: compiled by default, reference on request, never silently."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import cast

import pytest

import fastpath
from fastpath import _buckets_py, _reqlog_py, _sched_py

INIT = Path(fastpath.__file__)
# What the selector exports from each pair of builds: (module suffix, names).
SELECTED = (
    ("_buckets", ("TokenBucketTable",)),
    ("_sched", ("FairQueue", "backpressure_score_ppm", "backpressure_retry_ns",
                "shed_threshold_ppm")),
    ("_reqlog", ("RequestTable",)),
)  # fmt: skip


def _assert_selected(selector: ModuleType, suffix: str) -> None:
    """Every name the selector exports comes from the ``suffix`` ("_py"/"_c") modules."""
    for base, names in SELECTED:
        source = importlib.import_module(f"fastpath.{base}{suffix}")
        for name in names:
            assert cast(object, getattr(selector, name)) is getattr(source, name), name


def _load_selector(monkeypatch: pytest.MonkeyPatch, env: str | None) -> ModuleType:
    """Execute fastpath/__init__.py afresh under another name, with ``env`` set."""
    if env is None:
        monkeypatch.delenv("BURSTGATE_FASTPATH", raising=False)
    else:
        monkeypatch.setenv("BURSTGATE_FASTPATH", env)
    spec = importlib.util.spec_from_file_location("fastpath_selector_probe", INIT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compiled_is_live() -> None:
    """Fails if CI silently ran the pure-Python reference."""
    if os.environ.get("BURSTGATE_FASTPATH") == "python":
        assert fastpath.IMPLEMENTATION == "python"
        _assert_selected(fastpath, "_py")
    else:
        assert fastpath.IMPLEMENTATION == "cython"
        _assert_selected(fastpath, "_c")


def test_env_python_selects_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _load_selector(monkeypatch, "python")
    assert module.IMPLEMENTATION == "python"
    _assert_selected(module, "_py")
    assert module.TokenBucketTable is _buckets_py.TokenBucketTable
    assert module.FairQueue is _sched_py.FairQueue
    assert module.RequestTable is _reqlog_py.RequestTable


@pytest.mark.parametrize("env", [None, "", "cython"])
def test_default_selects_the_compiled_modules(
    monkeypatch: pytest.MonkeyPatch,
    both: tuple[ModuleType, ModuleType],
    sched_both: tuple[ModuleType, ModuleType],
    reqlog_both: tuple[ModuleType, ModuleType],
    env: str | None,
) -> None:
    module = _load_selector(monkeypatch, env)
    assert module.IMPLEMENTATION == "cython"
    _assert_selected(module, "_c")
    assert module.TokenBucketTable is both[1].TokenBucketTable
    assert module.FairQueue is sched_both[1].FairQueue
    assert module.RequestTable is reqlog_both[1].RequestTable


@pytest.mark.parametrize(
    "missing", ["fastpath._buckets_c", "fastpath._sched_c", "fastpath._reqlog_c"]
)
def test_missing_build_is_a_loud_import_error(
    monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    """Either compiled module missing fails the import: no half-compiled fastpath."""
    monkeypatch.setitem(sys.modules, missing, None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pip install -e \.") as info:
        _load_selector(monkeypatch, None)
    assert "BURSTGATE_FASTPATH=python" in str(info.value)
    assert missing in str(info.value)


def test_env_python_needs_no_compiled_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fastpath._buckets_c", None)
    monkeypatch.setitem(sys.modules, "fastpath._sched_c", None)
    monkeypatch.setitem(sys.modules, "fastpath._reqlog_c", None)
    assert _load_selector(monkeypatch, "python").IMPLEMENTATION == "python"


@pytest.mark.parametrize("env", ["Python", "c", "pure", "1"])
def test_other_env_values_are_rejected_by_name(monkeypatch: pytest.MonkeyPatch, env: str) -> None:
    with pytest.raises(ValueError, match="BURSTGATE_FASTPATH"):
        _load_selector(monkeypatch, env)
