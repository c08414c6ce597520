"""The commands the production guide and the runbook tell an operator to
type exist: every ``burstgate ...`` / ``burstgate-sidecar ...`` in them (in
code blocks and in inline code) names a real subcommand, and every ``--flag``
it passes is an option of that command or of a group on its way. Checked
against the CLI's own command tree, so a renamed command or flag fails here
rather than on an operator's terminal at night."""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer.main

from controlplane.cli import app

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "docs" / "production.md", ROOT / "docs" / "runbook.md"]
INLINE = re.compile(r"`((?:burstgate|burstgate-sidecar) [^`]*)`")


def commands(page: Path) -> list[str]:
    """Each command line of ``page``: shell/console blocks (``$ `` prompts,
    ``\\`` continuations joined) and inline code spans."""
    found: list[str] = []
    text = page.read_text()
    for kind, block in re.findall(r"```(sh|console|bash)\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            if kind == "console" and not line.startswith("$ "):
                continue  # output, not a command
            line = line.removeprefix("$ ").strip()
            # leading VAR=value assignments, as a shell reads them
            while re.match(r"[A-Z_]+=\S*\s", line):
                line = line.split(None, 1)[1]
            if re.match(r"burstgate(-sidecar)?\s", line):
                found.append(line)
    inline = INLINE.findall(re.sub(r"```.*?```", "", text, flags=re.S))
    # "burstgate listening on ..." is the server's start line, quoted as such
    found += [c for c in inline if not c.startswith("burstgate listening on ")]
    return found


@functools.cache
def cli() -> Any:
    return typer.main.get_command(app)


def cases() -> list[tuple[str, str]]:
    return [(p.name, c) for p in PAGES for c in commands(p)]


def test_the_pages_show_commands() -> None:
    by_page = {p.name: len(commands(p)) for p in PAGES}
    assert by_page["production.md"] >= 15 and by_page["runbook.md"] >= 10, by_page


@pytest.mark.parametrize(("page", "line"), cases(), ids=lambda v: str(v)[:60])
def test_command_exists_with_its_flags(page: str, line: str) -> None:
    try:
        words = shlex.split(line.split(" #")[0], comments=True)
    except ValueError:  # an unbalanced quote inside a PromQL example: words are enough
        words = line.split()
    root = cli()
    # (typer's command classes are duck-typed here: a group has .commands)
    cmd: Any = root.commands["sidecar"] if words[0] == "burstgate-sidecar" else root
    path = [cmd]
    rest = words[1:]
    while hasattr(cmd, "commands") and rest and not rest[0].startswith("-"):
        if rest[0] in ("...", "…"):
            break
        assert rest[0] in cmd.commands, f"{page}: `{line}`: no command {rest[0]!r}"
        cmd = cmd.commands[rest[0]]
        path.append(cmd)
        rest = rest[1:]
    known = {opt for c in path for p in c.params for opt in p.opts + p.secondary_opts}
    for word in rest:
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            assert flag in known, f"{page}: `{line}`: no option {flag} (has {sorted(known)})"
