"""The container images (Dockerfile, Dockerfile.sidecar), checked without a
Docker engine: the Dockerfiles only order deploy/image/build.sh's stages,
and this runs those stages on the host, from exactly the files the build
context (.dockerignore) keeps, then starts what they installed.

Two shortcuts, both about what cannot run here, neither about what the
script does: the build venv is the test venv (the same lock's pip,
setuptools and Cython; `build-venv` needs an index), and `runtime` links the
test venv's site-packages instead of installing the lock (BURSTGATE_DEPS_SITE;
which pins it would install is checked below, on the lock). CFLAGS=-O0:
the extension is compiled and imported, its speed is not the point."""

from __future__ import annotations

import http.server
import json
import os
import re
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support import free_port
from tools import deploykit

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = "deploy/image/build.sh"
DOCKERFILES = {"plane": ROOT / "Dockerfile", "sidecar": ROOT / "Dockerfile.sidecar"}
VENV_OF = {"plane": "/opt/burstgate", "sidecar": "/opt/burstgate-sidecar"}
COMPILERS = ("gcc", "cc ", "clang", "build-essential", "cython")


# ------------------------------------------------------------- the Dockerfiles


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_every_run_calls_the_build_script_and_the_final_stage_is_bare(kind: str) -> None:
    text = DOCKERFILES[kind].read_text()
    stages = deploykit.stages(deploykit.dockerfile_instructions(text))
    assert len(stages) >= 2, "multi-stage: a build stage and the runtime"
    used = []
    for stage in stages:
        for ins in stage:
            if ins.keyword != "RUN":
                continue
            argv = json.loads(ins.args)  # exec form: no shell between us and the script
            assert argv[:2] == ["sh", f"/src/{SCRIPT}"], f"line {ins.line}: {ins.args}"
            used.append(argv[2])
    expected = ["build-venv", "wheels", "runtime", "app"]
    assert used == (["toolchain", *expected] if kind == "plane" else expected)
    final = stages[-1]
    keywords = [i.keyword for i in final]
    assert "RUN" not in keywords  # nothing installed in the runtime stage
    [copy] = [i for i in final if i.keyword == "COPY"]
    assert copy.args == f"--from=build {VENV_OF[kind]} {VENV_OF[kind]}"  # the venv alone
    assert not any(c in " ".join(i.args for i in final).lower() for c in COMPILERS)
    [user] = [i.args for i in final if i.keyword == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, user  # numeric: runAsNonRoot can verify it
    [health] = [i.args for i in final if i.keyword == "HEALTHCHECK"]
    probe = json.loads(health.split("CMD", 1)[1])
    assert probe[:2] == ["burstgate-healthcheck", "grpc" if kind == "plane" else "http"]
    # the build stage and the runtime start from the same base (the venv's
    # interpreter path must exist in both)
    assert {s[0].args.split()[0] for s in stages} == {"${PYTHON_IMAGE}"}


def test_the_plane_build_stage_installs_its_compiler_through_the_script() -> None:
    script = (ROOT / SCRIPT).read_text()
    toolchain = script.split("toolchain)", 1)[1].split(";;", 1)[0]
    assert "gcc" in toolchain


# ------------------------------------------------------------- the lock subsets


def _closure(names: list[str]) -> set[str]:
    """What the installed distributions ``names`` need on this machine,
    extras followed (psycopg[binary])."""
    seen: set[tuple[str, str]] = set()
    todo = [(n, "") for n in names]
    while todo:
        name, extra = todo.pop()
        key = (canonicalize_name(name), extra)
        if key in seen:
            continue
        seen.add(key)
        for spec in metadata.requires(key[0]) or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                todo.extend((req.name, x) for x in ["", *sorted(req.extras)])
    return {name for name, _ in seen}


def _picked(roots: list[str]) -> set[str]:
    text = (ROOT / "requirements" / "serve.txt").read_text()
    env = {k: str(v) for k, v in default_environment().items()}
    out = set()
    for e in deploykit.closure(deploykit.parse_lock_entries(text), roots):
        first = e.text.splitlines()[0].rstrip(" \\")
        req = Requirement(first)
        if req.marker is None or req.marker.evaluate(env):
            out.add(e.name)
    return out


def test_the_sidecar_image_installs_the_client_closure_and_nothing_of_the_server() -> None:
    picked = _picked(["burstgate-client"])
    assert picked == _closure(["burstgate-client"]) - {"burstgate-client"}
    assert not picked & {"sqlalchemy", "psycopg", "alembic", "numpy", "cython", "setuptools"}


def test_the_plane_image_installs_the_servers_closure_without_build_tools() -> None:
    picked = _picked(["burstgate", "burstgate-client"])
    assert picked == _closure(["burstgate"]) - {"burstgate", "burstgate-client"}
    assert not picked & {"cython", "setuptools", "pip"}


def test_lock_subset_keeps_each_entry_whole_with_its_hashes() -> None:
    text = (ROOT / "requirements" / "serve.txt").read_text()
    subset = deploykit.lock_subset(text, ["pip", "setuptools", "cython"])
    pins = re.findall(r"^([a-z0-9-]+)==", subset, re.MULTILINE)
    assert pins == ["cython", "pip", "setuptools"]
    for block in subset.split("\n", 1)[1:]:
        assert "--hash=sha256:" in block


# ------------------------------------------------------------- the build, run


@dataclass
class Built:
    plane: Path
    sidecar: Path
    wheels: Path


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> str:
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, f"{argv}:\n{out.stdout}\n{out.stderr}"
    return out.stdout


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    tmp = tmp_path_factory.mktemp("image")
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.split("\0")  # fmt: skip
    present = [f for f in files if f and os.path.lexists(ROOT / f)]
    context = deploykit.build_context(present, (ROOT / ".dockerignore").read_text())
    src = tmp / "src"
    src.mkdir()
    archive = subprocess.run(
        ["tar", "-cf", "-", "-T", "-"], cwd=ROOT, input="\n".join(context).encode(),
        check=True, capture_output=True,
    ).stdout  # fmt: skip
    subprocess.run(["tar", "-xf", "-", "-C", str(src)], input=archive, check=True)
    env = {
        **os.environ,
        "BUILD_VENV": str(Path(sys.executable).parent.parent),
        "PYTHON": sys.executable,
        "BURSTGATE_DEPS_SITE": sysconfig.get_paths()["purelib"],
        "CFLAGS": "-O0",
    }
    script = str(src / SCRIPT)
    wheels = tmp / "wheels"
    _run(["sh", script, "wheels", str(src), str(wheels), "plane"], tmp, env)
    out = Built(tmp / "plane", tmp / "sidecar", wheels)
    for kind in ("plane", "sidecar"):
        venv = str(getattr(out, kind))
        _run(["sh", script, "runtime", venv, kind], tmp, env)
        _run(["sh", script, "app", venv, str(wheels), kind], tmp, env)
    return out


def test_the_build_makes_both_wheels(built: Built) -> None:
    names = sorted(p.name for p in built.wheels.glob("*.whl"))
    assert [n.split("-")[0] for n in names] == ["burstgate", "burstgate_client"]


def test_the_plane_venv_runs_the_compiled_fast_path_from_its_own_files(built: Built) -> None:
    out = _run(
        [str(built.plane / "bin" / "python"), "-c",
         "import controlplane, fastpath, fastpath._buckets_c as c; "
         "print(fastpath.IMPLEMENTATION); print(controlplane.__file__); print(c.__file__)"],
        built.plane, dict(os.environ),
    ).split()  # fmt: skip
    assert out[0] == "cython"
    assert all(Path(p).is_relative_to(built.plane) for p in out[1:]), out
    assert "Usage" in _run([str(built.plane / "bin" / "burstgate"), "--help"], built.plane, {})


def test_the_sidecar_venv_has_the_sidecar_and_not_the_server(built: Built) -> None:
    assert "--upstream" in _run(
        [str(built.sidecar / "bin" / "burstgate-sidecar"), "--help"], built.sidecar, {}
    )
    assert not (built.sidecar / "bin" / "burstgate").exists()
    probe = subprocess.run(
        [str(built.sidecar / "bin" / "python"), "-c", "import controlplane"],
        cwd=built.sidecar, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert probe.returncode != 0


class _Engine(http.server.BaseHTTPRequestHandler):
    """An engine that only answers /health (what the sidecar's /health asks)."""

    healthy = True

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" and _Engine.healthy else 503)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


class _Started:
    """A process started from a built venv, past its "listening" line; its
    output is drained on a thread so that it never blocks on a full pipe."""

    def __init__(self, argv: list[str], env: dict[str, str], ready: str) -> None:
        self.proc = subprocess.Popen(
            argv, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        self.lines: list[str] = []
        for line in self.proc.stdout:
            self.lines.append(line)
            if ready in line:
                break
        else:
            self.proc.wait(timeout=30)
            self.proc.stdout.close()
            raise AssertionError(f"{argv[0]} exited before it was ready:\n{''.join(self.lines)}")
        self._drain = threading.Thread(target=self.lines.extend, args=(self.proc.stdout,))
        self._drain.start()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._drain.join(timeout=10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def servers(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, int]]:
    """The built plane (`serve --migrate`, SQLite) and the built sidecar in
    front of a stub engine, as the images' commands start them."""
    state = tmp_path_factory.mktemp("state")
    plane_port, sidecar_port = free_port(), free_port()
    engine = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    plane = _Started(
        [str(built.plane / "bin" / "burstgate"), "serve", "--migrate"],
        {"BURSTGATE_DATABASE_URL": f"sqlite:///{state}/bg.db", "BURSTGATE_PORT": str(plane_port),
         "BURSTGATE_METRICS_PORT": "-1", "BURSTGATE_ADMISSION_AUTH": "false"},
        "burstgate listening",
    )  # fmt: skip
    try:
        sidecar = _Started(
            [str(built.sidecar / "bin" / "burstgate-sidecar"),
             "--upstream", f"http://127.0.0.1:{engine.server_port}",
             "--control-plane", f"127.0.0.1:{plane_port}", "--port", str(sidecar_port),
             "--spool", str(state / "completions.spool")],
            {}, "sidecar listening",
        )  # fmt: skip
        try:
            yield {"plane": plane_port, "sidecar": sidecar_port}
        finally:
            sidecar.stop()
    finally:
        plane.stop()
        engine.shutdown()
        engine.server_close()


def _healthcheck(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / "burstgate-healthcheck"), *args, "--timeout", "5"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip


def test_the_plane_healthcheck_asks_the_grpc_health_service(
    built: Built, servers: dict[str, int]
) -> None:
    target = f"127.0.0.1:{servers['plane']}"
    ok = _healthcheck(built.plane, "grpc", "--target", target)
    assert ok.returncode == 0, ok.stderr
    # the service the readiness probe asks (deploy/k8s/base/deployment.yaml)
    ok = _healthcheck(built.plane, "grpc", "--target", target,
                      "--service", "burstgate.v1.AdmissionService")  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    unknown = _healthcheck(built.plane, "grpc", "--target", target, "--service", "no.Such")
    assert (unknown.returncode, "NOT_FOUND" in unknown.stderr) == (1, True), unknown.stderr
    down = _healthcheck(built.plane, "grpc", "--target", f"127.0.0.1:{free_port()}")
    assert down.returncode == 1 and down.stderr.startswith("unhealthy:"), down.stderr


def test_the_sidecar_healthcheck_follows_its_engine(built: Built, servers: dict[str, int]) -> None:
    url = f"http://127.0.0.1:{servers['sidecar']}/health"
    ok = _healthcheck(built.sidecar, "http", "--url", url)
    assert ok.returncode == 0, ok.stderr
    _Engine.healthy = False
    try:
        sick = _healthcheck(built.sidecar, "http", "--url", url)
    finally:
        _Engine.healthy = True
    assert sick.returncode == 1 and "503" in sick.stderr, sick.stderr


def test_the_healthcheck_names_a_bad_flag(built: Built) -> None:
    bad = subprocess.run(
        [str(built.plane / "bin" / "burstgate-healthcheck"), "grpc", "--timeout", "0"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and "--timeout" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


def test_the_plane_wheel_carries_the_migrations_and_serves_the_demo(
    built: Built, tmp_path: Path
) -> None:
    """What `pip install .` installs serves without the repository beside it:
    the package, its compiled extensions, the demo config and the Alembic
    migrations all come from the wheel (the plane venv has nothing else)."""
    import signal
    import zipfile

    from burstgate_client.protoclient import ProtoClient, pb

    (wheel,) = built.wheels.glob("burstgate-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "controlplane/_migrations/env.py" in names
    assert any(n.startswith("controlplane/_migrations/versions/") for n in names)
    assert any(n.startswith("fastpath/_buckets_c.") and n.endswith(".so") for n in names)
    port = free_port()
    demo = _Started(
        [str(built.plane / "bin" / "burstgate"), "demo", "--port", str(port)],
        {"BURSTGATE_DATABASE_URL": f"sqlite:///{tmp_path}/demo.db",
         "BURSTGATE_METRICS_PORT": "-1", "BURSTGATE_LOG_FORMAT": "json"},
        "burstgate listening",
    )  # fmt: skip
    try:
        with ProtoClient(f"127.0.0.1:{port}") as c:
            d = c.admit("acme", "r1", prompt_tokens=1200, max_tokens=400)
            assert d.decision == pb.DECISION_ADMIT
            s = c.complete("acme", "r1", prompt_tokens=1200, generated_tokens=100)
            assert s.user_charge == "0.000750000"  # the demo's prices, from the wheel
        demo.proc.send_signal(signal.SIGTERM)
        assert demo.proc.wait(timeout=60) == 0, "".join(demo.lines)
    finally:
        demo.stop()
