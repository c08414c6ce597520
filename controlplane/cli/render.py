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
is bold and wide tables fold to the terminal's width; into a pipe nothing is
wrapped or cut.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

import typer
from rich import box
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
    if sys.stdout.isatty():
        return Console(highlight=False)
    # A pipe or a file: no colour and no width limit (rich would wrap at 80).
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
            overflow="fold",
            no_wrap=not console.is_terminal,
        )
    for r in cells:
        grid.add_row(*r)
    with console.capture() as captured:
        console.print(grid)
    return "\n".join(line.rstrip() for line in captured.get().splitlines() if line.strip())


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
