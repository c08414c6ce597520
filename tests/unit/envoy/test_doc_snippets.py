"""The Envoy page's quick-start snippets are part of the files the Envoy
tests run (deploy/envoy/), so what a reader copies is what CI ran."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SECTION = "## Quick start"


def yaml_blocks() -> list[list[str]]:
    text = (ROOT / "docs" / "envoy.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.S)
    return [b.rstrip("\n").splitlines() for b in blocks]


def contains(lines: list[str], block: list[str]) -> bool:
    """``block`` appears in ``lines``, in order, each line indented alike."""
    body = [b for b in block if not b.startswith("# deploy/")]
    for i, line in enumerate(lines):
        if not line.endswith(body[0]):
            continue
        pad = line[: len(line) - len(body[0])]
        if pad.strip() == "" and lines[i : i + len(body)] == [pad + b for b in body]:
            return True
    return False


def test_every_readme_snippet_is_in_the_tested_files() -> None:
    blocks = yaml_blocks()
    assert len(blocks) == 2
    files = [(ROOT / "deploy" / "envoy" / n).read_text().splitlines()
             for n in ("burstgate-envoy.yaml", "envoy.yaml")]  # fmt: skip
    for block in blocks:
        assert any(contains(f, block) for f in files), block[:3]
