"""The one renderer of every CLI listing: tables and key/value blocks.

Built on rich (typer's own dependency). Every command shows values with the
same vocabulary, :func:`cell`:

- unset / not applicable: ``-``
- booleans: ``yes`` / ``no``
- times: ``YYYY-MM-DD HH:MM:SS`` in UTC
- a limit that is not set: ``unlimited`` (the caller passes the word; see
  :data:`UNLIMITED_WORD`)

The layout stays plain (no box, a header line, then one line per row, no
trailing spaces) so that ``| awk``/``| grep`` keep working; ``--json`` is the
machine interface. Numeric columns are right-aligned. On a terminal the header
is bold; into a pipe nothing is wrapped or cut.

**Width.** A table wider than the terminal (its width, or ``$COLUMNS``
when set) is not folded
cell by cell, which made wide tables unreadable at 80 columns: it is printed
as plain text instead, one ``column  value`` block per row, blocks separated
by a blank line (as ``psql``'s expanded display). Into a pipe there is no
width and a row stays one line for ``awk``.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

import typer
from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table

UNLIMITED_WORD = "unlimited"
# Times in tables: UTC, to the second (JSON output keeps RFC 3339).
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
_NUMBER = re.compile(r"^[-+]?(\d[\d,_]*)(\.\d+)?%?$")


def cell(value: Any) -> str:
    """A value as every table shows it."""
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, datetime):
        return value.strftime(TIME_FORMAT)
    return str(value)


def _console() -> Console:
    # Laid out with no width limit (rich would fold at its width): a table
    # that does not fit is shown as records instead (render_table).
    if sys.stdout.isatty():
        return Console(highlight=False, width=1_000_000)
    return Console(highlight=False, no_color=True, width=1_000_000, force_terminal=False)


def _numeric(values: Sequence[str]) -> bool:
    shown = [v for v in values if v not in ("-", UNLIMITED_WORD)]
    return bool(shown) and all(_NUMBER.match(v) for v in shown)


def render_table(
    rows: Sequence[Mapping[str, Any]],
    cols: Sequence[str],
    *,
    footer: Mapping[str, Any] | None = None,
) -> str:
    """``rows`` as a table of ``cols`` (a missing key shows ``-``), with an
    optional ``footer`` row (e.g. totals) under a rule."""
    cells = [[cell(r.get(c)) for c in cols] for r in rows]
    foot = [cell(footer.get(c)) for c in cols] if footer is not None else None
    console = _console()
    grid = Table(
        box=box.SIMPLE if foot is not None else None,
        show_header=True,
        show_edge=False,
        show_footer=foot is not None,
        header_style="bold" if console.is_terminal else "",
        footer_style="bold" if console.is_terminal else "",
        pad_edge=False,
        padding=(0, 2, 0, 0),
    )
    for i, name in enumerate(cols):
        column = [r[i] for r in cells] + ([foot[i]] if foot is not None else [])
        grid.add_column(
            name,
            footer=foot[i] if foot is not None else "",
            justify="right" if _numeric(column) else "left",
            no_wrap=True,  # fits: checked above
        )
    for r in cells:
        grid.add_row(*r)
    with console.capture() as captured:
        console.print(grid)
    lines = [line.rstrip() for line in captured.get().splitlines() if line.strip()]
    limit = screen_width()
    if limit is not None and max((cell_len(line) for line in lines), default=0) > limit:
        return _records(cols, cells, foot)
    return "\n".join(lines)


def screen_width() -> int | None:
    """Columns a line may take on a terminal (``$COLUMNS`` when set, as
    every terminal program reads it, else the terminal's); None into a pipe
    or a file, whatever ``$COLUMNS`` says: test runners and CI export
    ``COLUMNS=80`` while piping, and a pipe's rows stay one line for awk."""
    if not _is_terminal():
        return None
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    return Console().width


def _is_terminal() -> bool:
    return sys.stdout.isatty()


def _records(
    cols: Sequence[str], cells: Sequence[Sequence[str]], foot: Sequence[str] | None
) -> str:
    """The plain-text form of a table too wide for the screen: a ``column
    value`` block per row (the footer last, its label ``total``)."""
    width = max(len(c) for c in cols)
    blocks = ["\n".join(f"{c.ljust(width)}  {v}".rstrip() for c, v in zip(cols, r, strict=True))
              for r in cells]  # fmt: skip
    if foot is not None:
        shown = [(c, v) for c, v in zip(cols, foot, strict=True) if v != "-"]
        blocks.append("\n".join(f"{'total' if i == 0 else ''}".ljust(width) + f"  {c} {v}"
                                for i, (c, v) in enumerate(shown)).rstrip())  # fmt: skip
    return "\n\n".join(blocks)


def table(
    rows: Sequence[Mapping[str, Any]],
    cols: Sequence[str],
    *,
    footer: Mapping[str, Any] | None = None,
) -> None:
    """Print :func:`render_table`."""
    typer.echo(render_table(rows, cols, footer=footer))


def kv(d: Mapping[str, Any]) -> None:
    """A block of ``key  value`` lines, keys aligned."""
    width = max((len(k) for k in d), default=0)
    for k, v in d.items():
        typer.echo(f"{k.ljust(width)}  {cell(v)}")
