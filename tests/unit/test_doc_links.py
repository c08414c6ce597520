"""Every relative link in README.md and docs/*.md points at a file that
exists, and every link to a heading of one of those pages names a heading
that is there (GitHub's anchors), so a moved or renamed page or section
cannot leave a dead link behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+)$", re.M)


def prose(page: Path) -> str:
    """The page without its code blocks (a link inside one is an example)."""
    kept, fenced = [], False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            kept.append(line)
    return "\n".join(kept)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped,
    spaces to hyphens."""
    text = re.sub(r"`|\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = prose(page)
    return {anchor(h) for h in HEADING.findall(text)} | set(re.findall(r'<a id="([^"]+)">', text))


def links() -> list[tuple[Path, str]]:
    found = []
    for page in PAGES:
        for target in LINK.findall(prose(page)):
            if not re.match(r"[a-z]+:", target):
                found.append((page, target))
    return found


@pytest.mark.parametrize(("page", "target"), links(), ids=lambda v: str(v))
def test_link_resolves(page: Path, target: str) -> None:
    path, _, fragment = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    assert dest.exists(), f"{page.relative_to(ROOT)}: {target} does not exist"
    if fragment and dest in PAGES:
        assert fragment in anchors(dest), f"{page.relative_to(ROOT)}: no heading #{fragment}"


def test_every_page_is_on_the_index() -> None:
    index = (ROOT / "docs" / "index.md").read_text()
    for page in PAGES[1:]:
        if page.name != "index.md":
            assert f"({page.name}" in index, f"docs/index.md does not link {page.name}"
