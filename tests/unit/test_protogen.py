"""The committed generated code matches what the .proto files generate."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane import protogen


@pytest.mark.parametrize("target", protogen.TARGETS, ids=lambda t: t.prefix)
def test_regenerating_protobuf_code_changes_nothing(
    target: protogen.Target, tmp_path: Path
) -> None:
    written = protogen.generate(target, tmp_path)
    fresh = {p.relative_to(tmp_path): p.read_text() for p in written}
    committed = {
        p.relative_to(target.out_dir): p.read_text()
        for p in target.out_dir.rglob("*")
        if p.suffix in {".py", ".pyi"}
    }
    assert sorted(fresh) == sorted(committed)
    stale = [str(name) for name, text in fresh.items() if committed[name] != text]
    assert stale == [], f"run `python -m controlplane.protogen`; stale: {stale}"
