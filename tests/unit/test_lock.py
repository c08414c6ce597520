"""The locks this repository runs (requirements/*.txt) agree with
pyproject.toml and requirements/*.in, and the generated code agrees with
the pinned generators and the runtime floors (tools/lockfile.py)."""

from __future__ import annotations

import re
import shutil
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tools import lockfile

ROOT = lockfile.ROOT
PROTO_OUT = ROOT / "controlplane" / "_proto"


def _pyproject() -> dict[str, object]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def _requirement(name: str, specs: list[str]) -> Requirement:
    for spec in specs:
        req = Requirement(spec)
        if canonicalize_name(req.name) == canonicalize_name(name):
            return req
    raise AssertionError(f"{name} is not required")


def _floor(req: Requirement) -> Version:
    floors = [Version(s.version) for s in req.specifier if s.operator in (">=", "==")]
    assert floors, f"{req} has no floor"
    return max(floors)


def _exact(req: Requirement) -> str:
    pins = [s.version for s in req.specifier if s.operator == "=="]
    assert len(pins) == 1, f"{req} is not pinned exactly"
    return pins[0]


def _copy_inputs(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(ROOT / "requirements", tmp_path / "requirements")
    (tmp_path / "clients" / "python").mkdir(parents=True)
    shutil.copy(ROOT / lockfile.CLIENT_PYPROJECT, tmp_path / lockfile.CLIENT_PYPROJECT)
    return tmp_path


def test_the_locks_agree_with_their_inputs() -> None:
    found = lockfile.problems(ROOT)
    assert found == [], "\n".join(found)


def test_a_dependency_added_without_relocking_is_caught(tmp_path: Path) -> None:
    root = _copy_inputs(tmp_path)
    text = (root / "pyproject.toml").read_text()
    text = text.replace('dependencies = [\n', 'dependencies = [\n    "left-pad-nowhere>=1.0",\n', 1)
    (root / "pyproject.toml").write_text(text)
    found = lockfile.problems(root)
    assert any("locked from other inputs" in line for line in found), found
    assert any("left-pad-nowhere>=1.0 is not locked" in line for line in found), found
    assert all("`make lock`" in line for line in found), found


def test_a_range_the_pin_falls_out_of_is_caught(tmp_path: Path) -> None:
    root = _copy_inputs(tmp_path)
    dev = lockfile.pins_for(
        lockfile.parse_lock((root / "requirements" / "dev.txt").read_text()),
        lockfile.TARGETS["linux-x86_64"],
    )
    text = (root / "pyproject.toml").read_text()
    assert '"PyYAML>=6.0",' in text
    above = Version(dev["pyyaml"]).major + 1
    (root / "pyproject.toml").write_text(text.replace('"PyYAML>=6.0",', f'"PyYAML>={above}",'))
    found = lockfile.problems(root)
    assert any(
        f"PyYAML>={above} is locked at {dev['pyyaml']}, outside the range" in line
        for line in found
    ), found


def test_a_comment_in_the_inputs_does_not_count(tmp_path: Path) -> None:
    root = _copy_inputs(tmp_path)
    build_in = root / "requirements" / "build.in"
    build_in.write_text("# a new comment\n\n" + build_in.read_text())
    assert lockfile.fingerprint(root) == lockfile.fingerprint(ROOT)


def test_a_pin_without_hashes_or_a_serve_pin_unlike_dev_is_caught(tmp_path: Path) -> None:
    root = _copy_inputs(tmp_path)
    serve = root / "requirements" / "serve.txt"
    text = serve.read_text()
    m = re.search(r"^pyyaml==(\S+) \\\n((?:    --hash=\S+(?: \\)?\n)+)", text, re.MULTILINE)
    assert m is not None
    serve.write_text(text.replace(m.group(0), "pyyaml==5.4.1\n"))
    found = lockfile.problems(root)
    assert any("pins without hashes: pyyaml" in line for line in found), found
    assert any("serve.txt pins pyyaml==5.4.1 but dev.txt" in line for line in found), found
    assert any("PyYAML>=6.0 is locked at 5.4.1" in line for line in found), found


def test_parse_lock_reads_markers_forks_and_hashes() -> None:
    text = (
        "# header\n"
        "numpy==2.4.6 ; python_full_version < '3.12' \\\n"
        "    --hash=sha256:aa \\\n"
        "    --hash=sha256:bb\n"
        "    # via burstgate\n"
        "numpy==2.5.5 ; python_full_version >= '3.12' \\\n"
        "    --hash=sha256:cc\n"
        "colorama==0.4.6 ; sys_platform == 'win32' \\\n"
        "    --hash=sha256:dd\n"
    )
    pins = lockfile.parse_lock(text)
    assert [(p.name, p.version, len(p.hashes)) for p in pins] == [
        ("numpy", "2.4.6", 2),
        ("numpy", "2.5.5", 1),
        ("colorama", "0.4.6", 1),
    ]
    assert lockfile.pins_for(pins, lockfile.TARGETS["linux-aarch64"]) == {"numpy": "2.4.6"}


def test_generated_code_was_made_by_the_pinned_generator() -> None:
    """The committed *_pb2_grpc.py name the grpcio-tools pinned in the test
    extra, and the runtime floors are no lower than what they require."""
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    runtime = project["dependencies"]
    test_extra = project["optional-dependencies"]["test"]
    grpc_made = {
        m.group(1)
        for path in PROTO_OUT.rglob("*_pb2_grpc.py")
        for m in [re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'", path.read_text(), re.M)]
        if m is not None
    }
    pb_made = {
        m.group(1)
        for path in PROTO_OUT.rglob("*_pb2.py")
        for m in [re.search(r"^# Protobuf Python Version: (\S+)", path.read_text(), re.M)]
        if m is not None
    }
    assert len(grpc_made) == 1 and len(pb_made) == 1, (grpc_made, pb_made)
    (grpc_version,) = grpc_made
    (pb_version,) = pb_made
    assert _exact(_requirement("grpcio-tools", test_extra)) == grpc_version, (
        "controlplane/_proto was generated by another grpcio-tools than pyproject.toml pins: "
        "`make lock && make proto`"
    )
    _exact(_requirement("mypy-protobuf", test_extra))
    assert _floor(_requirement("grpcio", runtime)) >= Version(grpc_version)
    assert _floor(_requirement("protobuf", runtime)) >= Version(pb_version)


def test_the_installed_generators_are_the_pinned_ones() -> None:
    """What test_protogen regenerates with: a venv installed without the lock
    would compare against another generator's output."""
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    test_extra = project["optional-dependencies"]["test"]
    for name in ("grpcio-tools", "mypy-protobuf"):
        assert metadata.version(name) == _exact(_requirement(name, test_extra)), (
            f"{name} {metadata.version(name)} is installed, pyproject.toml pins "
            f"{_exact(_requirement(name, test_extra))}: install from the lock (`make install-test`)"
        )


@pytest.mark.parametrize("tool", ["Cython", "setuptools"])
def test_the_build_tools_pinned_lie_in_the_build_system_range(tool: str) -> None:
    """build.in's exact Cython (what `make` compiles with) and the locked
    setuptools satisfy [build-system] requires (what `pip install .` uses)."""
    wanted = _requirement(tool, lockfile.build_system_requires(ROOT))
    dev = lockfile.pins_for(
        lockfile.parse_lock(lockfile.DEV_LOCK.read_text()), lockfile.TARGETS["linux-x86_64"]
    )
    locked = dev[canonicalize_name(tool)]
    assert wanted.specifier.contains(locked), f"{tool} {locked} is outside {wanted}"
