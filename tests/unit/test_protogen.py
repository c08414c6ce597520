"""The committed generated code matches what the .proto files generate."""

from __future__ import annotations

from pathlib import Path

from controlplane import protogen


def test_regenerating_protobuf_code_changes_nothing(tmp_path: Path) -> None:
    written = protogen.generate(tmp_path)
    fresh = {p.relative_to(tmp_path): p.read_text() for p in written}
    committed = {
        p.relative_to(protogen.OUT_DIR): p.read_text()
        for p in protogen.OUT_DIR.rglob("*")
        if p.suffix in {".py", ".pyi"}
    }
    assert sorted(fresh) == sorted(committed)
    stale = [str(name) for name, text in fresh.items() if committed[name] != text]
    assert stale == [], f"run `python -m controlplane.protogen`; stale: {stale}"
