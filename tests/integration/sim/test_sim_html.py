"""``burstgate simulate --html``: the self-contained report, checked against
the JSON and table output of the same run on a slice of the shared trace."""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from html.parser import HTMLParser
from pathlib import Path

from typer.testing import CliRunner

from controlplane.cli import app

# ../shared/ beside the repository (read-only input on every machine and CI)
AZURE = Path(__file__).resolve().parents[4] / "shared/traces/AzureLLMInferenceTrace_conv.csv"
ARGS = ["simulate", str(AZURE), "--limit", "300", "--load", "0.6", "--load", "1.4",
        "--policy", "fifo", "--policy", "burstgate"]  # fmt: skip
LANES = ("premium", "standard", "batch")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
runner = CliRunner()


class Page(HTMLParser):
    """The tables (rows of cell texts), image sources and embedded JSON of a page."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self.images: list[str] = []
        self.data = ""
        self._cell: list[str] | None = None
        self._in_data = False
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "img":
            self.images.append(a.get("src") or "")
        elif tag == "script" and a.get("id") == "burstgate-data":
            self._in_data = True

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append("".join(self._cell))
            self._cell = None
        elif tag == "script":
            self._in_data = False

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        elif self._in_data:
            self.data += data

    def table(self, first_header: str, third_header: str) -> list[list[str]]:
        """Data rows of the table whose header starts with these columns."""
        for t in self.tables:
            if t and t[0][:1] == [first_header] and t[0][2:3] == [third_header]:
                return t[1:]
        raise AssertionError(f"no table headed {first_header!r}, ?, {third_header!r}")


def _run(tmp_path: Path, *extra: str) -> tuple[str, str, Page, str]:
    out = tmp_path / "r.html"
    result = runner.invoke(app, [*ARGS, *extra, "--html", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    text = out.read_text(encoding="utf-8")
    return result.stdout, result.output, Page(text), text


def test_html_report_matches_the_json_of_the_same_run(tmp_path: Path) -> None:
    stdout, output, page, text = _run(tmp_path, "--json")
    # the notice goes to stderr so that stdout stays one JSON document
    assert f"report written to {tmp_path / 'r.html'}" in output
    assert "report written" not in stdout
    runs = {(r["load"], r["policy"]): r for r in json.loads(stdout)["runs"]}
    assert set(runs) == {(load, p) for load in (0.6, 1.4) for p in ("fifo", "burstgate")}

    lane_rows = {tuple(row[:3]): row for row in page.table("load", "lane")}
    assert set(lane_rows) == {
        (load, p, lane)
        for load in ("0.6x", "1.4x")
        for p in ("fifo", "burstgate")
        for lane in (*LANES, "all")
    }
    for (load, policy), r in runs.items():
        for lane in (*LANES, "all"):
            g = r["overall"] if lane == "all" else r["lanes"][lane]
            row = lane_rows[(f"{load:g}x", policy, lane)]
            assert row[3] == f"{g['attainment']:.1%}", (load, policy, lane, row)
            assert row[4] == f"{g['goodput_tps']:,.0f}"
            assert row[5] == f"{g['ttft_p50_ms']:,.0f} / {g['ttft_p99_ms']:,.0f}"
    # past capacity FIFO misses premium SLOs on this slice: the figure is not a trivial 100%
    premium = runs[(1.4, "fifo")]["lanes"]["premium"]["attainment"]
    assert premium < 1.0
    assert f"<td>{premium:.1%}</td>" in text

    summary = {tuple(row[:2]): row for row in page.table("load", "goodput / capacity")}
    assert set(summary) == {(f"{k[0]:g}x", k[1]) for k in runs}
    heavy = runs[(1.4, "fifo")]
    row = summary[("1.4x", "fifo")]
    assert row[3] == f"{heavy['jain_fairness']:.3f}"
    assert row[5] == f"{heavy['engine_queue_max']:,} / {heavy['engine_queue_mean']:,.1f}"

    # the embedded data is the --json document itself
    assert page.data.replace("<\\/", "</") == stdout.strip()

    # five plots, all inline PNGs; nothing fetched from anywhere
    assert len(page.images) == 5
    for src in page.images:
        prefix = "data:image/png;base64,"
        assert src.startswith(prefix)
        png = base64.b64decode(src[len(prefix) :], validate=True)
        assert png.startswith(PNG_SIGNATURE) and len(png) > 5_000
    assert text.count('src="data:image/png;base64,') == 5
    assert not re.search(r"https?://", text, re.IGNORECASE)
    assert not re.search(r"<(link|iframe|object|embed)\b", text, re.IGNORECASE)
    assert "<script" not in text.replace('<script type="application/json"', "")


def test_html_tables_carry_the_same_figures_as_the_terminal_tables(tmp_path: Path) -> None:
    stdout, _, page, _ = _run(tmp_path, "--markdown")
    # table output unchanged, the notice after it
    assert stdout.rstrip().endswith(f"report written to {tmp_path / 'r.html'}")
    markdown = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in stdout.splitlines()
        if line.startswith("| ") and "---" not in line
    ]
    heads = [i for i, row in enumerate(markdown) if row[0] == "load"]
    tables = [markdown[a + 1 : b] for a, b in zip(heads, [*heads[1:], len(markdown)], strict=True)]
    runs, comparison, lanes, summary = tables
    assert runs == page.table("load", "capacity req/s")
    assert comparison == page.table("load", "")
    assert lanes == page.table("load", "lane")
    assert summary == page.table("load", "goodput / capacity")
    assert len(runs) == 2 and len(comparison) == 2 * 7
    assert len(lanes) == 2 * 2 * 4 and len(summary) == 2 * 2
    # the comparison: a column per policy, premium / standard / batch in one cell
    assert markdown[heads[1]][3:] == ["fifo", "burstgate"]
    assert comparison[0][2] == "SLO met % (premium / standard / batch)"


def test_html_report_escapes_names_and_title() -> None:
    from controlplane.sim.html import render_html
    from controlplane.sim.run import SimSpec, simulate

    (run,) = simulate(SimSpec(trace=AZURE, policies=("fifo",), limit=60))
    evil = dataclasses.replace(run, policy="config:<b>a&b</b>.yaml")
    text = render_html([evil], title="<i>t</i>", command="burstgate simulate 'x<y'")
    assert "<b>a&b</b>" not in text and "<i>t</i>" not in text and "'x<y'" not in text
    assert "config:&lt;b&gt;a&amp;b&lt;/b&gt;.yaml" in text
    assert "<title>&lt;i&gt;t&lt;/i&gt;</title>" in text
    assert "burstgate simulate &#x27;x&lt;y&#x27;" in text


def test_html_into_a_missing_directory_is_refused_before_simulating(tmp_path: Path) -> None:
    target = tmp_path / "no-such-dir" / "r.html"
    result = runner.invoke(app, [*ARGS, "--html", str(target)])
    assert result.exit_code == 2, result.output
    assert f"--html: directory {target.parent} does not exist" in result.output
    assert "| load |" not in result.output  # refused up front, no simulation ran
    assert not target.parent.exists()
