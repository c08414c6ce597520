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

from controlplane.cli.lateopts import accept_after_commands
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


# Typer (0.29) shows each option's Python type, `<bool>`, `<list[str]>`,
# `<float>`: an operator's help shows what to type instead, click's words.
# A flag takes no value and shows none.
_METAVARS = {"str": "TEXT", "int": "INTEGER", "float": "NUMBER", "Decimal": "NUMBER",
             "Path": "PATH", "path": "PATH", "file": "FILE", "directory": "DIR",
             "datetime": "DATETIME"}  # fmt: skip


def metavar(shown: str) -> str:
    """Typer's ``<type>`` label as an operator's word: ``<list[str]>`` ->
    TEXT (the option's help says it repeats), ``<int range>`` -> INTEGER,
    ``<a|b>`` -> [a|b]."""
    inner = shown.removeprefix("<").removesuffix(">")
    if inner.startswith("list[") and inner.endswith("]"):
        inner = inner[5:-1]
    inner = inner.removesuffix(" range")
    if "|" in inner:
        return f"[{inner}]"
    return _METAVARS.get(inner, inner.upper())


def _option_metavar(command: Any, param: Any) -> None:
    kind = getattr(param, "param_type_name", "")
    if kind == "argument":
        # An argument's metavar is its name (TRACE); its type column has
        # no metavar to set, so this one parameter's is replaced.
        word = metavar(param.display_type(typer.Context(command)))
        param.display_type_rich = lambda ctx: word
        return
    if kind != "option" or param.metavar is not None:
        return
    if getattr(param, "is_flag", False):
        param.metavar = ""  # a flag takes no value
        return
    param.metavar = metavar(param.display_type(typer.Context(command)))


def _reflow_tree(command: Any) -> None:
    command.help = reflow(command.help)
    command.short_help = reflow(getattr(command, "short_help", None))
    for param in command.params:
        if getattr(param, "help", None):
            param.help = reflow(param.help)
        _option_metavar(command, param)
    # --help is made on first use and kept (click caches it): make it now.
    help_option = command.get_help_option(typer.Context(command))
    if help_option is not None:
        _option_metavar(command, help_option)
    for sub in getattr(command, "commands", {}).values():
        _reflow_tree(sub)


class RootGroup(TyperGroup):
    """The root group: accepts connection options after the command too,
    reflows the help of the whole command tree once, and turns domain errors
    into ``error: ...`` and exit code 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        accept_after_commands(self)  # --target H:P after the command too (cli/lateopts.py)
        _reflow_tree(self)

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except DomainError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
