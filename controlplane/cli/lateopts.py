"""Connection options after the command: ``burstgate tenant list --target
H:P`` as well as ``burstgate tenant --target H:P list``.

Click parses a group's options before its subcommand's name, so
``--target`` / ``--api-key`` / ``--tls-*`` / ``--timeout`` were accepted
only right after ``tenant``, ``admin``, ``pricing`` or ``pools``, and
``burstgate tenant list --target H:P`` said "No such option". Like kubectl's
global flags, they are now accepted anywhere after their group too:
:func:`accept_after_commands` copies a group's connection options onto
every command below it, where they replace the group's value by name in
``ctx.obj`` (common.connection keeps them under their parameter names).

Given in both places, **the later one wins** (the one after the command),
as a repeated option does in click and as an explicit option beats its
environment variable: there is one value per run and no order to remember.
The copies read no environment variable (the group's option does), so an
unset copy never overrides anything.
"""

from __future__ import annotations

import copy
from typing import Any

import typer
from typer.core import TyperGroup, TyperOption

from controlplane.cli.common import fail

# The group options that may also follow the command.
CONNECTION = ("target", "api_key", "tls_ca", "tls_cert", "tls_key", "tls_server_name", "timeout")
PANEL = "Connection (also accepted before the command)"


def _override(name: str) -> Any:
    def store(ctx: typer.Context, _param: Any, value: Any) -> Any:
        if value is None:
            return None
        obj = ctx.obj if isinstance(ctx.obj, dict) else None
        if obj is None:  # pragma: no cover - a group callback always sets it
            return value
        if name == "target" and obj.get("database_url"):
            # tenant's routes: the same check as its group callback's
            fail("give --target (through a server) or --database-url (direct), not both")
        obj[name] = value
        return value

    return store


def _copy(option: TyperOption) -> TyperOption:
    late = copy.copy(option)  # type, help, flags; the rest below
    late.envvar = None  # the group's option reads it: an unset copy changes nothing
    late.show_envvar = False
    late.default = None
    late.show_default = False
    late.required = False
    late.expose_value = False  # the command's function does not take it
    late.callback = _override(str(option.name))
    late.rich_help_panel = PANEL
    return late


def _leaves(group: TyperGroup) -> list[Any]:
    out: list[Any] = []
    for sub in group.commands.values():
        if isinstance(sub, TyperGroup):
            out.extend(_leaves(sub))
        else:
            out.append(sub)
    return out


def accept_after_commands(root: TyperGroup) -> None:
    """Give every command below a group with connection options a copy of
    them (a command with an option of the same name or flag keeps its own)."""
    for sub in root.commands.values():
        if not isinstance(sub, TyperGroup):
            continue
        options = [p for p in sub.params
                   if isinstance(p, TyperOption) and p.name in CONNECTION]  # fmt: skip
        if not options:
            accept_after_commands(sub)
            continue
        for leaf in _leaves(sub):
            names = {p.name for p in leaf.params}
            flags = {o for p in leaf.params for o in getattr(p, "opts", [])}
            for option in options:
                if option.name in names or flags.intersection(option.opts):
                    continue
                leaf.params.append(_copy(option))
