"""Progress on stderr for the phases of a run: reading, analysing, rendering.

rich (a typer dependency) draws the bars; stdout keeps the report or JSON.
Disabled phases cost one attribute check per update. The CLI enables it
only when stderr is a terminal and ``--no-progress`` is not given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

# A callback ``(description, done, total)`` that analysis code may call.
StepCallback = Callable[[str, int, int], None]


class Phases:
    """One rich Progress shared by the phases of a run (or nothing if disabled)."""

    def __init__(self, enabled: bool, file: IO[str] | None = None) -> None:
        self._progress: Any = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        # force_terminal None (not False) lets rich detect the terminal itself.
        forced = True if file is not None else None
        console = Console(stderr=file is None, file=file, force_terminal=forced)
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )

    @property
    def enabled(self) -> bool:
        return self._progress is not None

    def __enter__(self) -> Phases:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    @contextmanager
    def bytes_task(self, description: str, total: int | None) -> Iterator[Callable[[int], None]]:
        """A task advanced by absolute byte counts (total None: unknown, e.g. a pipe)."""
        if self._progress is None:
            yield lambda _done: None
            return
        from rich.progress import DownloadColumn

        task = self._progress.add_task(description, total=total)
        columns = self._progress.columns
        self._progress.columns = (*columns[:3], DownloadColumn(), columns[-1])
        try:
            yield lambda done: self._progress.update(task, completed=done)
        finally:
            self._progress.columns = columns
            self._progress.remove_task(task)

    @contextmanager
    def steps(self, description: str) -> Iterator[StepCallback]:
        """A task advanced by ``(label, done, total)`` callbacks."""
        if self._progress is None:
            yield lambda _label, _done, _total: None
            return
        task = self._progress.add_task(description, total=None)

        def step(label: str, done: int, total: int) -> None:
            # Few, slow steps: draw each one now rather than at the next tick.
            self._progress.update(
                task,
                description=f"{description}: {label}",
                completed=done,
                total=total,
                refresh=True,
            )

        try:
            yield step
        finally:
            self._progress.remove_task(task)

    @contextmanager
    def spinner(self, description: str) -> Iterator[None]:
        """An indeterminate task (a phase with no countable steps)."""
        if self._progress is None:
            yield
            return
        task = self._progress.add_task(description, total=None)
        self._progress.refresh()
        try:
            yield
        finally:
            self._progress.remove_task(task)
