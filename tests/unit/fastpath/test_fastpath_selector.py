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
from fastpath import _buckets_py

INIT = Path(fastpath.__file__)


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
        assert fastpath.TokenBucketTable is _buckets_py.TokenBucketTable
    else:
        assert fastpath.IMPLEMENTATION == "cython"
        from fastpath import _buckets_c

        assert cast(object, fastpath.TokenBucketTable) is _buckets_c.TokenBucketTable


def test_env_python_selects_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _load_selector(monkeypatch, "python")
    assert module.IMPLEMENTATION == "python"
    assert module.TokenBucketTable is _buckets_py.TokenBucketTable


@pytest.mark.parametrize("env", [None, "", "cython"])
def test_default_selects_the_compiled_module(
    monkeypatch: pytest.MonkeyPatch, both: tuple[ModuleType, ModuleType], env: str | None
) -> None:
    _, compiled = both
    module = _load_selector(monkeypatch, env)
    assert module.IMPLEMENTATION == "cython"
    assert module.TokenBucketTable is compiled.TokenBucketTable


def test_missing_build_is_a_loud_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fastpath._buckets_c", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pip install -e \.") as info:
        _load_selector(monkeypatch, None)
    assert "BURSTGATE_FASTPATH=python" in str(info.value)


@pytest.mark.parametrize("env", ["Python", "c", "pure", "1"])
def test_other_env_values_are_rejected_by_name(monkeypatch: pytest.MonkeyPatch, env: str) -> None:
    with pytest.raises(ValueError, match="BURSTGATE_FASTPATH"):
        _load_selector(monkeypatch, env)
