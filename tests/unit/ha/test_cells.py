"""Cells of pools (controlplane/domain/cells.py)."""

from __future__ import annotations

import pytest

from controlplane.domain.cells import CellMap


def test_default_is_one_cell_per_pool() -> None:
    m = CellMap()
    assert m.cell_of("gpu-a") == "gpu-a"
    assert m.cells(["b", "a", "b"]) == ["a", "b"]
    assert m.pools_of("a") == ("a",)


def test_explicit_cells_group_pools_and_others_stay_alone() -> None:
    m = CellMap({"eu": ["eu-1", "eu-2"], "us": ["us-1"]})
    assert m.cell_of("eu-2") == "eu"
    assert m.cell_of("us-1") == "us"
    assert m.cell_of("ap-1") == "ap-1"
    assert m.cells(["eu-1", "ap-1"]) == ["ap-1", "eu", "us"]
    assert m.pools_of("eu") == ("eu-1", "eu-2")


def test_a_pool_in_two_cells_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"pool 'p2' is listed in cells 'a' and 'b'"):
        CellMap({"a": ["p1", "p2"], "b": ["p2"]})
    with pytest.raises(ValueError, match=r"pool 'p1' is listed in cell 'a'"):
        CellMap({"a": ["p1", "p1"]})


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"": ["p"]}, "a cell id must be non-empty"),
        ({"a": []}, r"cells\.a: a list of one or more pools"),
        ({"a": "p1"}, r"cells\.a: a list of one or more pools"),
        ({"a": ["p", " "]}, r"cells\.a: a pool must be non-empty"),
    ],
)
def test_bad_mappings_name_the_field(mapping: dict[str, list[str]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CellMap(mapping)


def test_an_unlisted_pool_named_like_a_cell_is_refused() -> None:
    m = CellMap({"eu": ["eu-1"]})
    with pytest.raises(ValueError, match="pool 'eu' is in no cell"):
        m.cell_of("eu")
