"""The hand-written stubs of the compiled modules (fastpath/_buckets_c.pyi,
fastpath/_sched_c.pyi, fastpath/_reqlog_c.pyi, fastpath/_wire_c.pyi) against the modules
themselves, with mypy's stubtest: a name, parameter, default or class trait that differs fails here.
(Type checkers only ever read the stubs; nothing else compares them with the build.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .conftest import compiled

REPO_ROOT = Path(__file__).resolve().parents[3]
MODULES = (
    "fastpath._buckets_c",
    "fastpath._sched_c",
    "fastpath._reqlog_c",
    "fastpath._wire_c",
)


def test_compiled_stubs_match_the_compiled_modules() -> None:
    for name in MODULES:  # skips (pure-Python job) or fails when a build is missing
        compiled(name.removeprefix("fastpath."))
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", *MODULES],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
