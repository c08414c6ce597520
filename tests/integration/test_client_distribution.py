"""The client wing as its own distribution (clients/python, burstgate-client):
what `pip install ./clients/python` installs and what importing it loads.

Built for real: a wheel of clients/python (offline: setuptools from this
venv, no build isolation), whose files and declared requirements are read
back. The requirements' closure is walked through the metadata of the
versions this repository runs (the lock, installed here): what pip would
pull for them. Then the client's modules are imported in a fresh process,
which must load nothing of the server, its database stack or its tools.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "clients" / "python"
# What runs beside an engine must not bring these (the list).
FORBIDDEN = {
    "sqlalchemy", "alembic", "psycopg", "psycopg-binary", "matplotlib", "pyarrow", "cython",
}  # fmt: skip
# Top-level modules the same list provides, plus the server's own packages.
FORBIDDEN_MODULES = {
    "sqlalchemy", "alembic", "psycopg", "matplotlib", "pyarrow", "Cython",
    "controlplane", "fastpath",
}  # fmt: skip
# Everything an application or an engine's host imports (the LiteLLM hook
# is checked by the layer test alone: importing litellm reaches for the network).
CLIENT_MODULES = (
    "burstgate_client",
    "burstgate_client.sdk",
    "burstgate_client.sidecar",
    "burstgate_client.cli",
    "burstgate_client.protoclient",
    "burstgate_client.admin",
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # built from a copy: setuptools writes build/ and *.egg-info beside the sources
    source = out / "source"
    shutil.copytree(CLIENT, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(out), str(source)],
        check=True, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    (built,) = out.glob("burstgate_client-*.whl")
    return built


def requires(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        text = z.read(name).decode()
    return [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines()
            if line.startswith("Requires-Dist:")]  # fmt: skip


def closure(roots: list[Requirement]) -> set[str]:
    """Every distribution the requirements pull in (no extras asked), on this
    machine, as the installed metadata declares them."""
    env: dict[str, str] = {k: str(v) for k, v in default_environment().items()}
    seen: set[str] = set()
    todo = [r for r in roots if r.marker is None or r.marker.evaluate({**env, "extra": ""})]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        wanted = req.extras or {""}
        for spec in metadata.requires(req.name) or []:
            sub = Requirement(spec)
            if sub.marker is None or any(
                sub.marker.evaluate({**env, "extra": extra}) for extra in wanted
            ):
                todo.append(sub)
    return seen


def test_the_wheel_holds_only_the_client(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        tops = {n.split("/")[0] for n in z.namelist()}
        names = z.namelist()
    assert {t for t in tops if not t.endswith(".dist-info")} == {"burstgate_client"}
    # the generated stubs and their type stubs travel with it
    assert "burstgate_client/_proto/burstgate/v1/admission_pb2.py" in names
    assert "burstgate_client/_proto/burstgate/v1/admission_pb2.pyi" in names
    assert "burstgate_client/py.typed" in names


def test_installing_it_pulls_none_of_the_servers_stack(wheel: Path) -> None:
    pulled = closure(requires(wheel))
    assert "grpcio" in pulled and "protobuf" in pulled  # the walk does walk
    assert pulled & FORBIDDEN == set()


def test_its_extras_are_declared(wheel: Path) -> None:
    extras = {str(r.marker) for r in requires(wheel) if r.marker and "extra" in str(r.marker)}
    assert any("litellm" in m for m in extras) and any("tokenizer" in m for m in extras)


def test_importing_it_loads_nothing_of_the_server() -> None:
    code = (
        "import importlib, json, sys\n"
        f"for m in {CLIENT_MODULES!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120,
        cwd=CLIENT,  # not the repository root: nothing of the server on sys.path by accident
    )  # fmt: skip
    loaded = set(json.loads(out.stdout))
    assert "burstgate_client" in loaded and "grpc" in loaded
    assert loaded & FORBIDDEN_MODULES == set()
