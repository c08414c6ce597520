"""The layout's rules that are not about imports (tests/unit/test_layers.py
has those), checked on the source: module size, where SQL lives, and
comments that explain the code rather than its history."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Hand-written Python of the three wings (generated stubs excluded).
SOURCES = (ROOT / "controlplane", ROOT / "clients" / "python" / "burstgate_client")
# A module may pass SOFT_LIMIT lines only with a reason in its first lines
# ("Long because: ..."), and never HARD_LIMIT: past that it is two modules.
SOFT_LIMIT = 500
HARD_LIMIT = 600
REASON = "Long because:"
FACADE = ROOT / "controlplane" / "service" / "admission.py"
FACADE_LIMIT = 300


def hand_written() -> Iterator[Path]:
    for base in SOURCES:
        for path in sorted(base.rglob("*.py")):
            if "_proto" in path.parts or "_migrations" in path.parts:
                continue
            yield path


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_module_is_too_long() -> None:
    over = []
    for path in hand_written():
        n = lines(path)
        head = "\n".join(path.read_text().splitlines()[:15])
        if n > HARD_LIMIT or (n > SOFT_LIMIT and REASON not in head):
            over.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert over == [], (
        f"modules over {SOFT_LIMIT} lines without '{REASON}' near the top, or over {HARD_LIMIT}:\n"
        + "\n".join(over)
    )


def test_the_admission_facade_stays_a_facade() -> None:
    assert lines(FACADE) <= FACADE_LIMIT


def _sql_calls(path: Path) -> Iterator[int]:
    """Lines where sqlalchemy's ``text`` (or a DML/DDL builder) is imported."""
    tree = ast.parse(path.read_text(), filename=str(path))
    builders = {"text", "select", "insert", "update", "delete"}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("sqlalchemy")
            and any(alias.name in builders for alias in node.names)
        ):
            yield node.lineno


def test_sql_lives_in_the_store() -> None:
    store = ROOT / "controlplane" / "store"
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in hand_written()
        if store not in path.parents
        for line in _sql_calls(path)
    ]
    assert found == [], "SQL built outside controlplane/store/:\n" + "\n".join(found)


# "issue 12", "(issue", "step 2": the history of a line belongs in git and
# CHANGELOG.md; a comment says why the code is as it is.
HISTORY = re.compile(r"\bissue\s+\d+|\(issue\b|\bstep\s+\d+\b", re.IGNORECASE)


def _comments_and_docstrings(path: Path) -> Iterator[tuple[int, str]]:
    source = path.read_text()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    tree = ast.parse(source, filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield getattr(node, "lineno", 1), doc


def test_no_comment_tells_the_history() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {HISTORY.search(text).group(0)!r}"  # type: ignore[union-attr]
        for path in hand_written()
        for line, text in _comments_and_docstrings(path)
        if HISTORY.search(text)
    ]
    assert found == [], "comments that cite an issue or a step:\n" + "\n".join(found)
