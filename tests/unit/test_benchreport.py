"""tools/benchreport.py, the command that regenerates BENCHMARKS.md.

The list of benchmarks is held to bench/ (a new script must get a standard
size), the flags of each standard size to its script, and the committed
BENCHMARKS.md to the tool's output (a section per benchmark). The tool itself
runs for real on scripts made here: their reports become sections, their
target rows the targets table, a failure is reported, and ``--only`` keeps
the other sections with their rows.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("benchreport", ROOT / "tools/benchreport.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["benchreport"] = mod
    spec.loader.exec_module(mod)
    return mod


br = _load()


def test_every_benchmark_has_a_standard_size() -> None:
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py") if not p.name.startswith("_")}
    listed = [b.script for b in br.BENCHMARKS]
    assert len(listed) == len(set(listed)), "a benchmark listed twice"
    assert set(listed) == scripts


@pytest.mark.parametrize("bench", br.BENCHMARKS, ids=lambda b: b.script)
def test_standard_size_flags_exist(bench: object) -> None:
    """Each flag of a standard size is one its script defines (a renamed
    flag would fail `make bench` only when somebody runs it)."""
    source = (ROOT / "bench" / f"{bench.script}.py").read_text()  # type: ignore[attr-defined]
    for arg in bench.args:  # type: ignore[attr-defined]
        if arg.startswith("--"):
            assert f'"{arg}"' in source, f"{bench.script}: no flag {arg}"  # type: ignore[attr-defined]


def test_committed_file_has_every_section() -> None:
    assert br.main(["--check", "--out", str(ROOT / "BENCHMARKS.md")]) == 0


def test_demote_leaves_code_alone() -> None:
    text = "# Title\n## Sub\n```\n# not a heading\n```\n#hashtag"
    assert br.demote(text) == "### Title\n#### Sub\n```\n# not a heading\n```\n#hashtag"


FAKE = """
import sys
sys.path.insert(0, {bench!r})
from _summary import record
print("# fake report")
print("| a | b |")
print("|---|---|")
print("| 1 | 2 |")
record(what="{what}", ours=90.0, unit="x/s", baseline=100.0, baseline_name="empty",
       target=">= 0.8x empty", met=True)
sys.exit({code})
"""


@pytest.fixture
def fake_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bench = tmp_path / "bench"
    bench.mkdir()
    for name, what, code in (("fast", "fast row", 0), ("broken", "broken row", 3)):
        (bench / f"{name}.py").write_text(
            FAKE.format(bench=str(ROOT / "bench"), what=what, code=code)
        )
    monkeypatch.setattr(br, "BENCH", bench)
    monkeypatch.setattr(
        br,
        "BENCHMARKS",
        (br.Benchmark("fast", (), "Fast one", 0.1), br.Benchmark("broken", (), "Broken one", 0.1)),
    )
    return tmp_path / "BENCHMARKS.md"


def test_regenerates_sections_and_targets(fake_bench: Path) -> None:
    assert br.main(["--out", str(fake_bench)]) == 1  # the broken one failed
    text = fake_bench.read_text()
    assert "## Fast one (`fast`)" in text and "### fake report" in text
    assert "**FAILED** (exit 3)" in text
    # the target rows of both runs (a failing run's rows are still shown)
    rows = [ln for ln in text.splitlines() if ln.startswith("| fast row")]
    assert rows == [
        "| fast row | 90.0 | x/s | 100 (empty) | 0.90x | >= 0.8x empty | **yes** | `fast` |"
    ]
    assert "| broken row |" in text
    assert re.search(r"load average before [\d.]+ \(1 min\)", text)
    assert "## Where the time goes" in text  # the profiles' page, pasted in


def test_only_keeps_the_other_sections(fake_bench: Path) -> None:
    br.main(["--out", str(fake_bench)])
    before = br.parse_sections(fake_bench.read_text())
    marked = fake_bench.read_text().replace("### fake report", "### fake report (old)", 1)
    fake_bench.write_text(marked)
    assert br.main(["--only", "broken", "--out", str(fake_bench)]) == 1
    after = br.parse_sections(fake_bench.read_text())
    assert "(old)" in after["fast"].body  # kept, not re-run
    assert after["fast"].rows == before["fast"].rows
    assert "| fast row |" in fake_bench.read_text()  # its target row still in the table


def test_only_rejects_unknown_names(fake_bench: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        br.main(["--only", "nope", "--out", str(fake_bench)])
    assert "no benchmark named nope" in capsys.readouterr().err
