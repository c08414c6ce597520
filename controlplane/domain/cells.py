"""Cells: the unit of ownership, one or more engine pools.

A pool's capacity gate, lanes, fair queues, open reservations and pricing
windows must be decided in one place, so a pool belongs to exactly one cell
and a cell to one owner at a time. By default every pool is a cell of its
own, named after it; an explicit mapping groups pools (say, the pools of one
region behind one owner). A pool listed in two cells is refused: it would
have two owners.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


class CellMap:
    """Pool -> cell. ``mapping``: cell id -> its pools; pools not listed are
    each a cell of their own, named after the pool."""

    def __init__(self, mapping: Mapping[str, Sequence[str]] | None = None) -> None:
        self._cells: dict[str, tuple[str, ...]] = {}
        self._pool_cell: dict[str, str] = {}
        for cell, pools in (mapping or {}).items():
            if not isinstance(cell, str) or not cell.strip():
                raise ValueError(f"cells: a cell id must be non-empty text, got {cell!r}")
            if isinstance(pools, str) or not pools:
                raise ValueError(f"cells.{cell}: a list of one or more pools is required")
            for pool in pools:
                if not isinstance(pool, str) or not pool.strip():
                    raise ValueError(f"cells.{cell}: a pool must be non-empty text, got {pool!r}")
                other = self._pool_cell.get(pool)
                if other is not None:
                    where = f"cells {other!r} and {cell!r}" if other != cell else f"cell {cell!r}"
                    raise ValueError(
                        f"cells.{cell}: pool {pool!r} is listed in {where}; "
                        "a pool belongs to exactly one cell"
                    )
                self._pool_cell[pool] = cell
            self._cells[cell] = tuple(pools)

    def cell_of(self, pool: str) -> str:
        """The cell ``pool`` belongs to. A pool outside the mapping is its own
        cell, unless its name is taken by a cell of the mapping (ValueError:
        two different things would share one lease)."""
        cell = self._pool_cell.get(pool)
        if cell is not None:
            return cell
        if pool in self._cells:
            raise ValueError(
                f"pool {pool!r} is in no cell, and its default cell {pool!r} is a cell of "
                f"the mapping (pools {', '.join(self._cells[pool])}): list it in a cell"
            )
        return pool

    def cells(self, pools: Iterable[str]) -> list[str]:
        """The cells of ``pools`` (with every explicit cell), sorted, once each."""
        return sorted({*self._cells, *(self.cell_of(p) for p in pools)})

    def pools_of(self, cell: str) -> tuple[str, ...]:
        """The pools of an explicit cell; a default cell is its own pool."""
        return self._cells.get(cell, (cell,))
