"""The API contract in proto/: `buf lint` and `buf breaking` against the
committed v1 baseline, and code generation for other languages (Java and C#
with protoc's built-in generators, Go with protoc-gen-go and
protoc-gen-go-grpc, built with the Go toolchain).

Every tool comes from `make install-test` (buf from clients/node's lock
file, the rest from the OS packages); nothing is downloaded here. A missing
tool fails the test: these checks must run wherever the suite runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto"
PROTO_FILES = sorted(
    str(p.relative_to(PROTO)) for p in (PROTO / "burstgate" / "v1").glob("*.proto")
)
BASELINE = PROTO / "v1-baseline.binpb"
BUF = ROOT / "clients" / "node" / "node_modules" / ".bin" / "buf"
GO_MODULE = "github.com/burstgate/burstgate/gen/go"
# Debian's golang-*-dev packages install Go sources here (GOPATH layout).
DEBIAN_GOPATH = Path("/usr/share/gocode")


def tool(name: str) -> str:
    path = str(BUF) if name == "buf" and BUF.exists() else shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: run `make install-test`")
    return path


def run(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> str:
    """Run a command; fail the test with its output when it fails."""
    p = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    if p.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p.stdout + p.stderr


def copy_module(tmp: Path) -> Path:
    """A scratch copy of buf.yaml and proto/ to change without touching the repo."""
    shutil.copy(ROOT / "buf.yaml", tmp / "buf.yaml")
    shutil.copytree(PROTO, tmp / "proto")
    return tmp


def test_buf_lint_passes() -> None:
    assert run(tool("buf"), "lint") == ""


def test_buf_lint_is_live(tmp_path: Path) -> None:
    # The configuration really applies STANDARD: an enum without the type
    # prefix and a zero value without _UNSPECIFIED is refused.
    root = copy_module(tmp_path)
    f = root / "proto" / "burstgate" / "v1" / "admission.proto"
    f.write_text(f.read_text() + "\nenum Color {\n  RED = 0;\n}\n")
    p = subprocess.run([tool("buf"), "lint"], cwd=root, capture_output=True, text=True,
                       timeout=120, check=False)  # fmt: skip
    assert p.returncode != 0
    assert 'Enum value name "RED" should be prefixed with "COLOR_"' in p.stdout
    assert 'Enum zero value name "RED" should be suffixed with "_UNSPECIFIED"' in p.stdout


def test_buf_breaking_against_the_v1_baseline() -> None:
    assert run(tool("buf"), "breaking", "--against", str(BASELINE)) == ""


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        # a renumbered field breaks every client on the wire (to a number
        # far from the used ones, so that an added field never collides)
        ("int64 retry_after_ms = 22;", "int64 retry_after_ms = 99;",
         'present field "22" with name "retry_after_ms" on message "AdmitResponse" was deleted'),
        # a changed type too
        ("string pricing_multiplier = 24;", "double pricing_multiplier = 24;",
         'Field "24" with name "pricing_multiplier" on message "AdmitResponse" changed type'),
        # and reusing a reserved number is the silent kind
        ("reserved 4, 12, 20;", "reserved 12, 20;",
         'reserved range "[4]" on message "AdmitResponse" is missing values: [4] were removed'),
    ],
)  # fmt: skip
def test_buf_breaking_refuses_a_break(tmp_path: Path, old: str, new: str, message: str) -> None:
    root = copy_module(tmp_path)
    f = root / "proto" / "burstgate" / "v1" / "admission.proto"
    text = f.read_text()
    assert text.count(old) == 1
    f.write_text(text.replace(old, new))
    p = subprocess.run([tool("buf"), "breaking", "--against", str(BASELINE)], cwd=root,
                       capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert p.returncode != 0
    assert message in p.stdout


def test_baseline_is_the_v1_api_after_the_contract_changes() -> None:
    # A buf image is a FileDescriptorSet on the wire: the baseline must hold
    # the three API files as made consistent (issue 18), not an older shape.
    image = descriptor_pb2.FileDescriptorSet.FromString(BASELINE.read_bytes())
    files = {f.name: f for f in image.file}
    assert {f"burstgate/v1/{n}.proto" for n in ("admission", "admin", "ledger")} <= set(files)
    admission = files["burstgate/v1/admission.proto"]
    fields = {
        f.name: (f.number, f.type)
        for m in admission.message_type
        if m.name == "AdmitResponse"
        for f in m.field
    }
    t = descriptor_pb2.FieldDescriptorProto
    assert fields["retry_after_ms"] == (22, t.TYPE_INT64)
    assert fields["pricing_multiplier"] == (24, t.TYPE_STRING)
    assert "retry_after" not in fields
    assert admission.options.go_package.startswith(GO_MODULE)


def test_protoc_generates_java_and_csharp(tmp_path: Path) -> None:
    java, cs = tmp_path / "java", tmp_path / "cs"
    java.mkdir()
    cs.mkdir()
    run(tool("protoc"), f"-I{PROTO}", f"--java_out={java}", f"--csharp_out={cs}", *PROTO_FILES)
    # java_package and java_multiple_files: one class per message, in com.burstgate.v1
    pkg = java / "com" / "burstgate" / "v1"
    # (services need the grpc-java plugin; protoc's java_out makes the messages)
    for name in ("AdmitRequest", "AdmitResponse", "LoadReport", "Tenant", "LedgerRecord"):
        assert (pkg / f"{name}.java").read_text().startswith("// Generated by the protocol")
    assert "package com.burstgate.v1;" in (pkg / "AdmitResponse.java").read_text()
    assert (pkg / "AdmissionProto.java").exists() and (pkg / "LedgerProto.java").exists()
    # csharp_namespace
    for name in ("Admission", "Admin", "Ledger"):
        assert "namespace Burstgate.V1 {" in (cs / f"{name}.cs").read_text()


GO_MAIN = """\
package main

import (
	"fmt"

	"google.golang.org/protobuf/proto"

	bg "github.com/burstgate/burstgate/gen/go/burstgate/v1"
)

// The generated client is there and has the RPCs.
var _ = bg.NewAdmissionServiceClient
var _ bg.LedgerServiceClient = nil

func main() {
	in := &bg.AdmitResponse{
		Decision:          bg.Decision_DECISION_REJECT,
		Reason:            bg.Reason_REASON_TOKEN_RATE,
		RetryAfterMs:      1500,
		PricingMultiplier: "1.200000",
		Pressure:          &bg.Pressure{StalePolicy: bg.StalePolicy_STALE_POLICY_FAIL_CLOSED},
	}
	b, err := proto.Marshal(in)
	if err != nil {
		panic(err)
	}
	out := &bg.AdmitResponse{}
	if err := proto.Unmarshal(b, out); err != nil {
		panic(err)
	}
	fmt.Println(out.GetReason(), out.GetRetryAfterMs(), out.GetPricingMultiplier(),
		out.GetPressure().GetStalePolicy())
}
"""


def test_go_code_generates_vets_and_builds(tmp_path: Path) -> None:
    protoc = tool("protoc")
    go = tool("go")
    for plugin in ("protoc-gen-go", "protoc-gen-go-grpc"):
        tool(plugin)
    if not (DEBIAN_GOPATH / "src" / "google.golang.org" / "grpc").is_dir():
        pytest.fail(f"Go gRPC sources missing from {DEBIAN_GOPATH}: run `make install-test`")
    # go_package names the import path; module= strips its prefix so the
    # files land in a GOPATH tree where that import path resolves.
    src = tmp_path / "gopath" / "src"
    out = src / GO_MODULE
    out.mkdir(parents=True)
    run(protoc, f"-I{PROTO}", f"--go_out={out}", f"--go_opt=module={GO_MODULE}",
        f"--go-grpc_out={out}", f"--go-grpc_opt=module={GO_MODULE}", *PROTO_FILES)  # fmt: skip
    generated = sorted(p.name for p in (out / "burstgate" / "v1").iterdir())
    assert generated == sorted(
        f"{n}{suffix}" for n in ("admin", "admission", "ledger")
        for suffix in (".pb.go", "_grpc.pb.go")
    )  # fmt: skip
    main = src / "bgcheck"
    main.mkdir()
    (main / "main.go").write_text(GO_MAIN)
    # GOPATH mode over Debian's Go sources: no module proxy, no network.
    env = {
        **os.environ,
        "GOPATH": f"{tmp_path / 'gopath'}:{DEBIAN_GOPATH}",
        "GO111MODULE": "off",
        "GOPROXY": "off",
        "GOFLAGS": "",
        "CGO_ENABLED": "0",
    }
    pkg = f"{GO_MODULE}/burstgate/v1"
    run(go, "vet", pkg, "bgcheck", cwd=tmp_path, env=env)
    run(go, "build", "-o", str(tmp_path / "bgcheck.bin"), "bgcheck", cwd=tmp_path, env=env)
    got = run(str(tmp_path / "bgcheck.bin"), cwd=tmp_path).split()
    assert got == ["REASON_TOKEN_RATE", "1500", "1.200000", "STALE_POLICY_FAIL_CLOSED"]
