"""deploy/systemd: the units as systemd reads them (`systemd-analyze
verify`, whose complaints about unknown keys or bad values are warnings on
stderr, so stderr must be empty too), their sandbox as systemd scores it
(`systemd-analyze security --offline`), and the keys the kit promises
(deploy/README.md, "systemd"). verify wants ExecStart's binary to exist:
the units' /opt/... venvs are replaced by the test venv, which has both
commands."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
# Each unit and the venv its ExecStart runs from.
UNITS = {
    "burstgate.service": "/opt/burstgate/bin/",
    "burstgate-sidecar.service": "/opt/burstgate-sidecar/bin/",
}
BIN = str(Path(sys.executable).parent) + "/"
# systemd's own scale: 0 is a full sandbox, 10 none; below 2 it calls "OK".
MAX_EXPOSURE = 2.0


def keys(text: str) -> dict[str, list[str]]:
    """Section.Key -> every value given (systemd keys may repeat)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key}", []).append(value)
    return out


def installed(tmp_path: Path, name: str) -> Path:
    text = (ROOT / "deploy" / "systemd" / name).read_text()
    assert UNITS[name] in text
    path = tmp_path / name
    path.write_text(text.replace(UNITS[name], BIN))
    return path


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip


def test_the_kit_ships_exactly_these_units() -> None:
    assert sorted(p.name for p in (ROOT / "deploy" / "systemd").iterdir()) == sorted(UNITS)


@pytest.mark.parametrize("name", sorted(UNITS))
def test_systemd_verifies_the_unit_without_a_complaint(tmp_path: Path, name: str) -> None:
    out = analyze("verify", str(installed(tmp_path, name)))
    assert (out.returncode, out.stderr) == (0, ""), out.stderr


def test_verify_complains_of_a_misspelt_key(tmp_path: Path) -> None:
    """What makes the empty-stderr check above worth something."""
    path = installed(tmp_path, "burstgate.service")
    path.write_text(path.read_text().replace("ProtectSystem=strict", "ProtectSytem=strict"))
    out = analyze("verify", str(path))
    assert "ProtectSytem" in out.stderr


@pytest.mark.parametrize("name", sorted(UNITS))
def test_the_sandbox_scores_ok(tmp_path: Path, name: str) -> None:
    out = analyze("security", "--offline=yes", str(installed(tmp_path, name)))
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out.stdout)
    assert m is not None, out.stdout + out.stderr
    assert float(m[1]) <= MAX_EXPOSURE, out.stdout


@pytest.mark.parametrize("name", sorted(UNITS))
def test_the_unit_is_hardened_restarts_and_keeps_its_state(name: str) -> None:
    k = keys((ROOT / "deploy" / "systemd" / name).read_text())
    state = name.removesuffix(".service")
    want = {
        "Service.DynamicUser": ["yes"],
        "Service.StateDirectory": [state],
        "Service.WorkingDirectory": [f"/var/lib/{state}"],
        "Service.ProtectSystem": ["strict"],
        "Service.NoNewPrivileges": ["yes"],
        "Service.PrivateTmp": ["yes"],
        "Service.ProtectHome": ["yes"],
        "Service.CapabilityBoundingSet": [""],
        "Service.Restart": ["on-failure"],
        "Install.WantedBy": ["multi-user.target"],
    }
    assert {key: k.get(key) for key in want} == want
    # a bad setting (exit 2) is not restarted in a loop
    assert "2" in k["Service.RestartPreventExitStatus"][0].split()
    [exec_start] = k["Service.ExecStart"]
    assert exec_start.startswith(UNITS[name])
    # what it writes lies in its state directory (the rest is read-only)
    writes = re.findall(r"--spool (\S+)", exec_start)
    writes += [v.split("=", 1)[1] for v in k.get("Service.Environment", [])
               if v.startswith("BURSTGATE_LEDGER_SPOOL_DIR=")]  # fmt: skip
    assert writes, name
    for path in writes:
        assert path.startswith(f"/var/lib/{state}/"), path


def test_the_plane_keeps_sqlite_in_its_state_directory() -> None:
    k = keys((ROOT / "deploy" / "systemd" / "burstgate.service").read_text())
    env = dict(v.split("=", 1) for v in k["Service.Environment"])
    assert env["BURSTGATE_DATABASE_URL"] == "sqlite:////var/lib/burstgate/burstgate.db"
    # secrets come from a root-only file read before privileges drop
    assert k["Service.EnvironmentFile"] == ["-/etc/burstgate/burstgate.env"]
