"""The locks this repository runs: make them, check them, compare them.

``pyproject.toml`` keeps ranges (people install burstgate as a library); the
environments this repository runs (``make demo``, ``make test``, CI, the
benchmarks, the images) install exact, hash-checked versions from two locks
made by uv from the same inputs:

- ``requirements/dev.txt``: every extra, ``requirements/build.in`` (pip,
  setuptools, the pinned Cython) and ``requirements/dev.in`` (uv);
- ``requirements/serve.txt``: the server alone (no extras) with
  ``build.in``, constrained by ``dev.txt`` so that every package the two
  share has the same version in both, and ``make demo`` then ``make test``
  in one venv changes nothing.

Both are universal resolutions for Python 3.11 and later (markers where a
version differs), checked here for Linux on x86_64 and aarch64, with the
hashes of every file of each release. Each carries a fingerprint of its
inputs, so that a change to ``pyproject.toml`` or ``requirements/*.in`` that
was not locked is caught (``tests/unit/test_lock.py``).

Commands (``python tools/lockfile.py ...``; the Makefile wraps them):

- ``compile [--upgrade]``: write both locks (``make lock`` keeps every pin
  the inputs still allow; ``make lock-upgrade`` takes the newest allowed);
- ``check``: print what disagrees and exit 1 (the test calls the function);
- ``latest OUT``: resolve the newest versions pyproject.toml allows, for this
  machine, into OUT (``make test-latest``);
- ``diff OLD NEW``: what moved between two locks, for this machine.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import Marker, default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
REQ_DIR = ROOT / "requirements"
DEV_LOCK = REQ_DIR / "dev.txt"
SERVE_LOCK = REQ_DIR / "serve.txt"
BUILD_IN = REQ_DIR / "build.in"
DEV_IN = REQ_DIR / "dev.in"

REFRESH = "make lock"
PYTHON_VERSION = "3.11"
# What a lock must serve: the Python and platforms this repository runs on.
TARGETS: dict[str, dict[str, str]] = {
    f"linux-{machine}": {
        "implementation_name": "cpython",
        "implementation_version": "3.11.0",
        "os_name": "posix",
        "platform_machine": machine,
        "platform_python_implementation": "CPython",
        "platform_system": "Linux",
        "python_full_version": "3.11.0",
        "python_version": PYTHON_VERSION,
        "sys_platform": "linux",
    }
    for machine in ("x86_64", "aarch64")
}
FINGERPRINT_PREFIX = "# inputs: sha256:"
_FINGERPRINT_RE = re.compile(r"^# inputs: sha256:([0-9a-f]{64})\b", re.MULTILINE)


@dataclass(frozen=True)
class Pin:
    name: str  # canonical
    version: str
    marker: Marker | None
    hashes: tuple[str, ...] = field(default=())

    def applies(self, env: Mapping[str, str]) -> bool:
        return self.marker is None or self.marker.evaluate(dict(env))


# ---------------------------------------------------------------- the inputs


def _pyproject(root: Path, where: str = "pyproject.toml") -> dict[str, object]:
    with (root / where).open("rb") as f:
        return tomllib.load(f)


# The client wing's distribution: a path source of the server's (uv reads
# its dependencies from here); left out of the locks, which hold only what
# an index serves, and installed from the tree (`make install`).
CLIENT = "burstgate-client"
CLIENT_PYPROJECT = "clients/python/pyproject.toml"


def _in_lines(path: Path) -> list[str]:
    """A requirements ``.in`` file without comments and blank lines."""
    lines = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            lines.append(line)
    return lines


def _project_requirements(root: Path, extras: bool) -> list[str]:
    project = _pyproject(root)["project"]
    assert isinstance(project, dict)
    reqs = list(project.get("dependencies", []))
    if extras:
        for group in project.get("optional-dependencies", {}).values():
            reqs.extend(group)
    return [spec for req in reqs for spec in _through_client(root, req)]


def _through_client(root: Path, spec: str) -> list[str]:
    """``spec``, or, for the client wing (not locked itself), what it needs
    with the extras asked for."""
    req = Requirement(spec)
    if canonicalize_name(req.name) != CLIENT:
        return [spec]
    client = _pyproject(root, CLIENT_PYPROJECT)["project"]
    assert isinstance(client, dict)
    out = list(client.get("dependencies", []))
    for extra in sorted(req.extras):
        out.extend(client.get("optional-dependencies", {})[extra])
    return out


def build_system_requires(root: Path = ROOT) -> list[str]:
    build = _pyproject(root)["build-system"]
    assert isinstance(build, dict)
    return list(build.get("requires", []))


def input_requirements(root: Path, lock: Path) -> list[str]:
    """What the lock at ``lock`` was asked to satisfy."""
    req_dir = root / "requirements"
    if lock.name == DEV_LOCK.name:
        return (
            _project_requirements(root, extras=True)
            + _in_lines(req_dir / BUILD_IN.name)
            + _in_lines(req_dir / DEV_IN.name)
        )
    return _project_requirements(root, extras=False) + _in_lines(req_dir / BUILD_IN.name)


def fingerprint(root: Path = ROOT) -> str:
    """A hash of everything the locks are made from (and how), normalised so
    that comments and layout do not count."""
    pyproject = _pyproject(root)
    project = pyproject["project"]
    assert isinstance(project, dict)
    client = _pyproject(root, CLIENT_PYPROJECT)["project"]
    assert isinstance(client, dict)
    req_dir = root / "requirements"
    payload = {
        "dependencies": project.get("dependencies", []),
        "optional-dependencies": project.get("optional-dependencies", {}),
        "client-dependencies": client.get("dependencies", []),
        "client-optional-dependencies": client.get("optional-dependencies", {}),
        "requires-python": project.get("requires-python"),
        "build-system": build_system_requires(root),
        "build.in": _in_lines(req_dir / BUILD_IN.name),
        "dev.in": _in_lines(req_dir / DEV_IN.name),
        "options": _common_options(),
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


# ------------------------------------------------------------------ the locks


def parse_lock(text: str) -> list[Pin]:
    """The pins of a hash-checked requirements file as uv writes it."""
    pins: list[Pin] = []
    # Join continuation lines; drop comments.
    logical: list[str] = []
    current = ""
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0] if not raw.lstrip().startswith("#") else ""
        line = line.rstrip()
        if not line:
            if current:
                logical.append(current)
                current = ""
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        logical.append(current)
        current = ""
    if current:
        logical.append(current)
    for entry in logical:
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            continue
        hashes = tuple(re.findall(r"--hash=(\S+)", entry))
        spec = re.sub(r"\s*--hash=\S+", "", entry).strip()
        req = Requirement(spec)
        versions = [s.version for s in req.specifier if s.operator == "=="]
        if len(versions) != 1:
            raise ValueError(f"not an exact pin: {spec!r}")
        pins.append(Pin(canonicalize_name(req.name), versions[0], req.marker, hashes))
    return pins


def pins_for(pins: Iterable[Pin], env: Mapping[str, str]) -> dict[str, str]:
    """name -> version for one environment (a universal lock may fork a
    package by marker; exactly one pin of a name applies)."""
    out: dict[str, str] = {}
    for pin in pins:
        if not pin.applies(env):
            continue
        if pin.name in out and out[pin.name] != pin.version:
            raise ValueError(f"{pin.name}: two pins apply ({out[pin.name]}, {pin.version})")
        out[pin.name] = pin.version
    return out


def problems(root: Path = ROOT) -> list[str]:
    """Every way the locks disagree with their inputs (empty when they agree)."""
    found: list[str] = []
    expected = fingerprint(root)
    locks: dict[Path, list[Pin]] = {}
    for lock in (root / "requirements" / DEV_LOCK.name, root / "requirements" / SERVE_LOCK.name):
        rel = lock.relative_to(root)
        if not lock.exists():
            found.append(f"{rel} is missing: run `{REFRESH}`")
            continue
        text = lock.read_text()
        m = _FINGERPRINT_RE.search(text)
        if m is None:
            found.append(f"{rel} has no inputs fingerprint: run `{REFRESH}`")
        elif m.group(1) != expected:
            found.append(
                f"{rel} was locked from other inputs than pyproject.toml and "
                f"requirements/*.in hold now: run `{REFRESH}`"
            )
        try:
            pins = parse_lock(text)
        except ValueError as exc:
            found.append(f"{rel}: {exc}: run `{REFRESH}`")
            continue
        locks[lock] = pins
        unhashed = sorted(p.name for p in pins if not p.hashes)
        if unhashed:
            found.append(f"{rel}: pins without hashes: {', '.join(unhashed)}: run `{REFRESH}`")
        for target, env in TARGETS.items():
            try:
                chosen = pins_for(pins, env)
            except ValueError as exc:
                found.append(f"{rel} ({target}): {exc}")
                continue
            for spec in input_requirements(root, lock):
                found.extend(
                    f"{rel} ({target}): {msg}: run `{REFRESH}`"
                    for msg in _unmet(Requirement(spec), chosen, env)
                )
    dev = locks.get(root / "requirements" / DEV_LOCK.name)
    serve = locks.get(root / "requirements" / SERVE_LOCK.name)
    if dev is not None and serve is not None:
        for target, env in TARGETS.items():
            try:
                d, s = pins_for(dev, env), pins_for(serve, env)
            except ValueError:
                continue
            for name, version in sorted(s.items()):
                if d.get(name) != version:
                    found.append(
                        f"serve.txt pins {name}=={version} but dev.txt "
                        f"{d.get(name, 'nothing')} ({target}): run `{REFRESH}`"
                    )
    return found


def _unmet(req: Requirement, chosen: Mapping[str, str], env: Mapping[str, str]) -> list[str]:
    if req.marker is not None and not req.marker.evaluate(dict(env)):
        return []
    name = canonicalize_name(req.name)
    version = chosen.get(name)
    if version is None:
        return [f"{req} is not locked"]
    if not req.specifier.contains(Version(version), prereleases=True):
        return [f"{req} is locked at {version}, outside the range"]
    return []


# --------------------------------------------------------------- making them


def _common_options() -> list[str]:
    return ["--python-version", PYTHON_VERSION, "--generate-hashes", "--no-emit-package", CLIENT]


def _uv(args: Sequence[str], cwd: Path) -> None:
    cmd = [sys.executable, "-m", "uv", "pip", "compile", "--quiet", *args]
    subprocess.run(cmd, cwd=cwd, check=True)


def _stamp(lock: Path, digest: str) -> None:
    """Add the inputs fingerprint under uv's header."""
    lines = lock.read_text().splitlines(keepends=True)
    lines = [line for line in lines if not line.startswith(FINGERPRINT_PREFIX)]
    at = 0
    while at < len(lines) and lines[at].startswith("#"):
        at += 1
    note = (
        f"{FINGERPRINT_PREFIX}{digest} (pyproject.toml and requirements/*.in; "
        "tests/unit/test_lock.py compares)\n"
    )
    lines.insert(at, note)
    lock.write_text("".join(lines))


def compile_locks(root: Path = ROOT, upgrade: bool = False) -> None:
    req = "requirements"
    common = [
        *_common_options(),
        "--universal",
        "--custom-compile-command",
        "make lock-upgrade" if upgrade else REFRESH,
    ]
    if upgrade:
        common.append("--upgrade")
    _uv(
        [
            "pyproject.toml",
            f"{req}/{BUILD_IN.name}",
            f"{req}/{DEV_IN.name}",
            "--all-extras",
            *common,
            "-o",
            f"{req}/{DEV_LOCK.name}",
        ],
        root,
    )
    _uv(
        [
            "pyproject.toml",
            f"{req}/{BUILD_IN.name}",
            "-c",
            f"{req}/{DEV_LOCK.name}",
            *common,
            "-o",
            f"{req}/{SERVE_LOCK.name}",
        ],
        root,
    )
    digest = fingerprint(root)
    for name in (DEV_LOCK.name, SERVE_LOCK.name):
        _stamp(root / req / name, digest)


def compile_latest(out: Path, root: Path = ROOT) -> None:
    """The newest versions pyproject.toml allows, for this machine: every
    extra, the build system's range (not build.in's exact Cython) and pip."""
    inputs = out.with_suffix(".in")
    inputs.write_text("\n".join([*build_system_requires(root), "pip"]) + "\n")
    _uv(
        [
            "pyproject.toml",
            str(inputs),
            "--all-extras",
            *_common_options(),
            "--upgrade",
            "--no-header",
            "-o",
            str(out),
        ],
        root,
    )


def _this_machine() -> dict[str, str]:
    return {key: str(value) for key, value in default_environment().items()}


def moved(old: Path, new: Path) -> list[str]:
    env = _this_machine()
    a = pins_for(parse_lock(old.read_text()), env)
    b = pins_for(parse_lock(new.read_text()), env)
    lines = []
    for name in sorted(set(a) | set(b)):
        if a.get(name) != b.get(name):
            lines.append(f"  {name}: {a.get(name, '-')} -> {b.get(name, '-')}")
    return lines


def main(argv: Sequence[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    cmd, *rest = argv
    if cmd == "compile":
        compile_locks(upgrade="--upgrade" in rest)
        return 0
    if cmd == "check":
        found = problems()
        for line in found:
            print(line)
        return 1 if found else 0
    if cmd == "latest" and len(rest) == 1:
        compile_latest(Path(rest[0]).resolve())
        return 0
    if cmd == "diff" and len(rest) == 2:
        lines = moved(Path(rest[0]), Path(rest[1]))
        print(f"{len(lines)} packages differ from {rest[0]} on this machine:")
        print("\n".join(lines))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
