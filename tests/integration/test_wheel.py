"""What `pip install .` installs serves without the repository beside it.

The wheel is built from a copy of this tree (offline: the venv's setuptools
and Cython, no build isolation) and unpacked into a directory that is put
first on the import path of a `burstgate demo` started elsewhere, so the
package, its Cython extensions, the demo config and the Alembic migrations
all come from the wheel. The dependencies come from the test venv (the
lock); `pip install .` resolving pyproject.toml's ranges is what
`make test-latest` tries (docs/contributing.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from burstgate_client.protoclient import ProtoClient, pb

from tests.integration.test_process import Proc

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _copy_tree(dst: Path) -> None:
    """This checkout's files (tracked and untracked, not ignored: no .venv,
    no compiled extension), symlinks kept, into ``dst``."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout.split(b"\0")  # fmt: skip
    names = b"\0".join(f for f in files if f and os.path.lexists(ROOT / f.decode()))
    archive = subprocess.run(
        ["tar", "--null", "-T", "-", "-cf", "-"], cwd=ROOT, input=names, check=True,
        capture_output=True,
    ).stdout  # fmt: skip
    dst.mkdir()
    subprocess.run(["tar", "-xf", "-", "-C", str(dst)], input=archive, check=True)


def test_the_wheel_carries_everything_the_demo_needs(tmp_path: Path) -> None:
    _copy_tree(tmp_path / "src")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(tmp_path / "dist"), str(tmp_path / "src")],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("burstgate-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "controlplane/_migrations/env.py" in names
    assert any(n.startswith("controlplane/_migrations/versions/") for n in names)
    assert any(n.startswith("fastpath/_buckets_c.") and n.endswith(".so") for n in names)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {
        "PYTHONPATH": str(site),
        "BURSTGATE_DATABASE_URL": f"sqlite:///{run_dir}/demo.db",
        "BURSTGATE_METRICS_PORT": "0",
        "BURSTGATE_LOG_FORMAT": "json",
    }
    where = subprocess.run(
        [sys.executable, "-c", "import controlplane, fastpath; "
         "print(controlplane.__file__); print(fastpath.TokenBucketTable.__module__)"],
        cwd=run_dir, env={**os.environ, **env}, check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    assert where == [str(site / "controlplane" / "__init__.py"), "fastpath._buckets_c"], where
    proc = Proc(["demo", "--port", "0"], env, cwd=run_dir)
    try:
        assert proc.fastpath == "cython"
        with ProtoClient(proc.target) as c:
            d = c.admit("acme", "r1", prompt_tokens=1200, max_tokens=400)
            assert d.decision == pb.DECISION_ADMIT
            s = c.complete("acme", "r1", prompt_tokens=1200, generated_tokens=100)
            assert s.user_charge == "0.000750000"
        proc.p.send_signal(signal.SIGTERM)
        assert proc.p.wait(timeout=60) == 0, proc.log()
    finally:
        if proc.p.poll() is None:
            proc.p.kill()
        proc.p.wait(timeout=30)
        proc.close()
