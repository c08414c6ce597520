"""The root command's class: help text that reflows, and domain errors as
one line.

Domain errors: a command that raises ``DomainError`` (bad input found below
the CLI layer, e.g. a config file's field) ends with ``error: <field>:
<reason>`` on stderr and exit code 2, never a traceback, however the app is
invoked (the ``burstgate`` script or a test's CliRunner).

Help text that reflows to the terminal's width:

Typer (in its default rich mode) keeps the single line breaks of a
docstring's second and later paragraphs, so ``--help`` showed our source
code's line breaks: ragged on a wide terminal, doubly wrapped on a narrow one.
:class:`ReflowGroup`, the root command's class, joins the lines of every
paragraph of every command's and option's help before anything is shown.
Blank lines still separate paragraphs, and lines that start a list item
(``- ``) or are indented keep their own line.
"""

from __future__ import annotations

import inspect
from typing import Any

import typer
from typer.core import TyperGroup

from controlplane.domain.errors import DomainError


def reflow(text: str | None) -> str | None:
    if not text:
        return text
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(_paragraph(p) for p in paragraphs)


def _paragraph(paragraph: str) -> str:
    out: list[str] = []
    for line in paragraph.splitlines():
        starts_own_line = line.startswith(("- ", "* ", " ", "\b")) or not out
        if starts_own_line:
            out.append(line)
        else:
            out[-1] = f"{out[-1]} {line.strip()}"
    return "\n".join(out)


def _reflow_tree(command: Any) -> None:
    command.help = reflow(command.help)
    command.short_help = reflow(getattr(command, "short_help", None))
    for param in command.params:
        if getattr(param, "help", None):
            param.help = reflow(param.help)
    for sub in getattr(command, "commands", {}).values():
        _reflow_tree(sub)


class RootGroup(TyperGroup):
    """The root group: reflows the help of the whole command tree once, and
    turns domain errors into ``error: ...`` and exit code 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _reflow_tree(self)

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except DomainError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
