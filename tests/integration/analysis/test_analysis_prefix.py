"""Prefix-cache hit rates of ``analyze`` on logs with block ids
(docs/analysis.md, "Prefix-cache hit rate").

The figures are checked against ``reference``, an implementation of the
textbook semantics written here from the documentation alone (an
OrderedDict LRU, one request at a time, no NumPy), on seeded random traces
whose requests share system prompts and grow multi-turn conversations, with
out-of-order and tied timestamps, repeated and string ids, empty and missing
id lists and lengths that disagree with the ids. They must agree exactly.
"""

from __future__ import annotations

import csv
import json
import math
import random
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer

from controlplane.domain.prefixcache import PrefixCache
from tests.integration.analysis.conftest import run

EXACT = 1e-9


@dataclass(frozen=True)
class Req:
    ts_ms: int
    length: int
    ids: list[Any] | None  # None: the key is absent


def make_trace(seed: int, n: int = 400, block_size: int = 512) -> list[Req]:
    """Requests in file order: conversations on shared system prompts."""
    rng = random.Random(seed)
    next_id = 0

    def fresh(k: int) -> list[Any]:
        nonlocal next_id
        ids: list[Any] = list(range(next_id, next_id + k))
        next_id += k
        return ids

    systems = [fresh(rng.randint(1, 5)) for _ in range(6)]
    systems.append([f"sys-{seed}-a", f"sys-{seed}-b"])  # string ids
    chats: list[list[Any]] = []
    reqs: list[Req] = []
    t = 0
    for _ in range(n):
        t += rng.choice((0, 0, 5, 40, 250, 900, 3000))  # ties, bursts and lulls
        kind = rng.random()
        if chats and kind < 0.5:
            chat = rng.choice(chats)
            chat.extend(fresh(rng.randint(1, 3)))
            ids: list[Any] | None = list(chat)
        elif kind < 0.9:
            ids = [*rng.choice(systems), *fresh(rng.randint(0, 6))]
            chats.append(list(ids))
        elif kind < 0.93:
            ids = []
        elif kind < 0.96:
            ids = None
        else:
            ids = [*fresh(2), 7, 7]  # a repeated id inside one request
        count = len(ids or [])
        if rng.random() < 0.08:  # a length that disagrees with the ids
            length = rng.randint(0, (count + 2) * block_size)
        else:
            length = max(0, count - 1) * block_size + rng.randint(1, block_size)
        ts = max(0, t - rng.choice((0, 0, 0, 0, 700)))  # some arrive out of order
        reqs.append(Req(ts, length, ids))
    return reqs


def write_jsonl(path: Path, reqs: list[Req]) -> Path:
    with path.open("w") as out:
        for r in reqs:
            row: dict[str, Any] = {"timestamp": r.ts_ms, "input_length": r.length}
            row["output_length"] = 7
            if r.ids is not None:
                row["hash_ids"] = r.ids
            out.write(json.dumps(row) + "\n")
    return path


def write_csv(path: Path, reqs: list[Req]) -> Path:
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["timestamp", "input_length", "output_length", "hash_ids"])
        for r in reqs:
            ids = "" if r.ids is None else json.dumps(r.ids)
            writer.writerow([r.ts_ms, r.length, 7, ids])
    return path


# --------------------------------------------------------------------------- the reference


@dataclass
class Tally:
    hit_blocks: int = 0
    blocks: int = 0
    hit_tokens: int = 0
    tokens: int = 0


def reference(
    reqs: list[Req], capacity: int | None, block_size: int, window_s: int
) -> tuple[Tally, dict[int, Tally]]:
    """Overall and per-window tallies, by the documented rules, request by request."""
    cache: OrderedDict[Any, None] = OrderedDict()
    t0 = min(r.ts_ms for r in reqs)
    overall, windows = Tally(), dict[int, Tally]()
    for r in sorted(reqs, key=lambda r: r.ts_ms):  # stable: ties keep file order
        ids = r.ids or []
        hits = 0
        for block in ids:  # the leading run of cached blocks
            if block not in cache:
                break
            hits += 1
        for block in ids:  # then every block, most recent last
            cache[block] = None
            cache.move_to_end(block)
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
        n = len(ids)
        weights = [block_size] * (n - 1) + [max(0, r.length - (n - 1) * block_size)] if n else []
        window = windows.setdefault((r.ts_ms - t0) * 1000 // (window_s * 1_000_000), Tally())
        for tally in (overall, window):
            tally.hit_blocks += hits
            tally.blocks += n
            tally.hit_tokens += sum(weights[:hits])
            tally.tokens += sum(weights)
    return overall, windows


def _ratio(a: int, b: int) -> float | None:
    return a / b if b else None


def assert_matches(cache: dict[str, Any], tally: Tally) -> None:
    assert (cache["hit_blocks"], cache["blocks"]) == (tally.hit_blocks, tally.blocks)
    assert (cache["hit_tokens"], cache["tokens"]) == (tally.hit_tokens, tally.tokens)
    for key, expected in (
        ("block_hit_rate", _ratio(tally.hit_blocks, tally.blocks)),
        ("token_hit_rate", _ratio(tally.hit_tokens, tally.tokens)),
    ):
        if expected is None:
            assert cache[key] is None
        else:
            assert cache[key] == pytest.approx(expected, abs=EXACT)


def analyse(app: typer.Typer, path: Path, *extra: str) -> dict[str, Any]:
    code, out, err = run(app, "analyze", str(path), "--json", "--no-per-tenant", *extra)
    assert code == 0, err
    document: dict[str, Any] = json.loads(out)
    return document


CAPACITIES = (1, 7, 40, 250)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_hit_rates_equal_an_independent_lru(app: typer.Typer, tmp_path: Path, seed: int) -> None:
    reqs = make_trace(seed)
    flags = [arg for c in CAPACITIES for arg in ("--cache-blocks", str(c))]
    prefix = analyse(app, write_jsonl(tmp_path / "t.jsonl", reqs), *flags)["prefix_cache"]
    assert prefix["available"] and prefix["block_size"] == 512
    caches = prefix["caches"]
    assert [c["capacity_blocks"] for c in caches] == [None, *CAPACITIES]
    for cache in caches:
        overall, windows = reference(reqs, cache["capacity_blocks"], 512, 60)
        assert_matches(cache, overall)
        for i, window in enumerate(prefix["windows"]):
            assert_matches(window["caches"][caches.index(cache)], windows.get(i, Tally()))
    # The model has something to show: reuse exists, and a small cache loses some.
    assert caches[0]["block_hit_rate"] > 0.3
    assert caches[1]["block_hit_rate"] < caches[-1]["block_hit_rate"] <= caches[0]["block_hit_rate"]


def test_csv_with_ids_in_a_column_agrees_with_the_reference(
    app: typer.Typer, tmp_path: Path
) -> None:
    reqs = make_trace(4, n=300)
    prefix = analyse(
        app, write_csv(tmp_path / "t.csv", reqs), "--cache-blocks", "30", "--block-size", "256"
    )["prefix_cache"]
    assert prefix["block_size"] == 256 and prefix["block_size_source"] == "option"
    for cache in prefix["caches"]:
        assert_matches(cache, reference(reqs, cache["capacity_blocks"], 256, 60)[0])
    assert prefix["missing"] == sum(r.ids is None for r in reqs)


def test_arrow_and_row_by_row_reading_agree(
    app: typer.Typer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the first chunk (10,000 rows) JSON Lines go through pyarrow when
    every value is plain; the row-by-row parser defines the result."""
    rng = random.Random(9)
    reqs = [Req(i * 50, 600, [i % 13, i % 13 + 100, rng.randrange(3000)]) for i in range(10_500)]
    path = write_jsonl(tmp_path / "big.jsonl", reqs)
    fast = analyse(app, path, "--cache-blocks", "500")["prefix_cache"]
    monkeypatch.setenv("BURSTGATE_ANALYZE_ARROW", "0")
    slow = analyse(app, path, "--cache-blocks", "500")["prefix_cache"]
    assert fast == slow
    assert_matches(fast["caches"][1], reference(reqs, 500, 512, 60)[0])


def test_a_hand_computed_trace(app: typer.Typer, tmp_path: Path) -> None:
    """Four-token blocks. Unbounded: r1 hits 1,2 (miss at 4); r3 hits 1,2,3.
    LRU of 3: after r1 the cache is [1,2,4], after r2 [2,4,5], so r3 misses at
    once. LRU of 1: nothing is ever hit; 2+3+1+4 evictions."""
    reqs = [
        Req(0, 10, [1, 2, 3]),  # tokens 4+4+2
        Req(1000, 12, [1, 2, 4]),  # 4+4+4
        Req(2000, 3, [5]),  # 3
        Req(3000, 15, [1, 2, 3, 6]),  # 4+4+4+3
    ]
    path = write_jsonl(tmp_path / "tiny.jsonl", reqs)
    prefix = analyse(app, path, "--block-size", "4", "--cache-blocks", "3", "--cache-blocks", "1")[
        "prefix_cache"
    ]
    by_capacity = {c["capacity_blocks"]: c for c in prefix["caches"]}
    expected = {  # capacity: (hit blocks, hit tokens, evictions)
        None: (5, 20, 0),
        3: (2, 8, 5),
        1: (0, 0, 10),
    }
    for capacity, (hit_blocks, hit_tokens, evictions) in expected.items():
        cache = by_capacity[capacity]
        assert (cache["blocks"], cache["tokens"]) == (11, 40)
        assert (cache["hit_blocks"], cache["hit_tokens"]) == (hit_blocks, hit_tokens)
        assert cache["evictions"] == evictions
    assert by_capacity[None]["block_hit_rate"] == pytest.approx(5 / 11)
    assert by_capacity[None]["token_hit_rate"] == pytest.approx(0.5)
    assert prefix["distinct_blocks"] == 6 and prefix["length_mismatches"] == 0


def test_ids_of_every_kind_are_compared_as_values(app: typer.Typer, tmp_path: Path) -> None:
    """Hash-sized, negative and beyond-int64 integers, and strings that look
    like them: the integer columns are switched to interned codes at the first
    id that is not an int64, and equal ids stay equal across the switch."""
    big, huge = 2**62 + 11, 2**64 + 3
    reqs = [
        Req(0, 1000, [big, -4]),
        Req(10, 1000, [big, -4]),  # 2 hits
        Req(20, 1000, [huge, "7"]),  # switch: not an int64
        Req(30, 1000, [big, -4, 7]),  # 2 hits: 7 is not "7"
        Req(40, 1000, [huge, "7"]),  # 2 hits
    ]
    prefix = analyse(app, write_jsonl(tmp_path / "kinds.jsonl", reqs))["prefix_cache"]
    unbounded = prefix["caches"][0]
    assert (unbounded["hit_blocks"], unbounded["blocks"]) == (6, 11)
    assert prefix["distinct_blocks"] == 5
    assert_matches(unbounded, reference(reqs, None, 512, 60)[0])


def test_kv_capacity_in_tokens_is_whole_blocks(app: typer.Typer, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", make_trace(5, n=120))
    prefix = analyse(app, path, "--kv-capacity-tokens", "20000", "--cache-blocks", "39")
    caches = prefix["prefix_cache"]["caches"]
    # 20,000 // 512 = 39 blocks: the same cache as --cache-blocks 39, modelled once.
    assert [c["capacity_blocks"] for c in caches] == [None, 39]
    assert caches[1]["capacity_tokens"] == 39 * 512


def test_end_to_end_text_json_and_html(app: typer.Typer, tmp_path: Path) -> None:
    reqs = make_trace(6, n=600)
    path = write_jsonl(tmp_path / "mooncake.jsonl", reqs)
    html = tmp_path / "report.html"
    code, out, err = run(app, "analyze", str(path), "--cache-blocks", "50", "--html", str(html))
    assert code == 0, err
    assert "hash_ids" in err  # the input line names the block-id column
    assert re.search(r"Prefix cache \(hash_ids, 512-token blocks, the preset's\)", out)
    unbounded, lru = reference(reqs, None, 512, 60)[0], reference(reqs, 50, 512, 60)[0]
    row = re.search(r"unbounded\s+([\d.]+)%\s+([\d.]+)%", out)
    assert row is not None
    assert float(row.group(1)) == pytest.approx(
        100 * unbounded.hit_blocks / unbounded.blocks, abs=0.05
    )
    assert re.search(r"LRU 50 blocks \(25,600 tokens\)\s+[\d.]+%", out)
    page = html.read_text()
    section = page[page.index('<section id="prefix-cache">') : page.index('<section id="tenants">')]
    assert section.count("data:image/png;base64,") == 2  # hit rate against load, and over time
    assert 'alt="prefix-cache hit rate against load"' in section
    cell = re.search(r'data-metric="prefix_cache.caches.1.token_hit_rate">([\d.]+)%<', section)
    assert cell is not None
    assert float(cell.group(1)) == pytest.approx(100 * lru.hit_tokens / lru.tokens, abs=0.05)
    data = json.loads(re.search(r'id="burstgate-data">(.*?)</script>', page, re.S).group(1))  # type: ignore[union-attr]
    prefix = data["prefix_cache"]
    for key in ("windows", "by_load", "median_requests_per_s", "distinct_blocks", "window"):
        assert key in prefix
    assert {"load", "requests_per_s", "caches"} <= set(prefix["windows"][0])
    assert sum(b["requests"] for b in prefix["by_load"]) <= len(reqs)


def test_bailian_trace_is_read_in_seconds_with_16_token_blocks(
    app: typer.Typer, tmp_path: Path
) -> None:
    path = tmp_path / "bailian.jsonl"
    rows = [
        {"chat_id": i, "parent_chat_id": i - 1 if i % 3 else -1, "timestamp": i * 0.5,
         "input_length": 40, "output_length": 9, "type": "text", "turn": 1 + i % 3,
         "hash_ids": [1, 2, 100 + i]}
        for i in range(30)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    document = analyse(app, path)
    assert document["input"]["preset"] == "bailian"
    prefix = document["prefix_cache"]
    assert (prefix["block_size"], prefix["block_size_source"]) == (16, "preset")
    assert document["span"]["seconds"] == 15  # 14.5 s of arrivals, in seconds not ms
    # Every request after the first hits its two shared blocks: 16 + 16 of 40 tokens.
    assert prefix["caches"][0]["hit_tokens"] == 29 * 32
    assert prefix["length_mismatches"] == 0


def test_a_log_without_block_ids_says_so(app: typer.Typer, tmp_path: Path) -> None:
    path = tmp_path / "plain.csv"
    path.write_text("timestamp,input_length,output_length\n" + "".join(
        f"{i * 100},{50 + i},{9}\n" for i in range(50)))  # fmt: skip
    code, out, err = run(app, "analyze", str(path), "--cache-blocks", "10")
    assert code == 0, err
    assert "Prefix cache: the log has no block ids (no column hash_ids" in out
    assert "--block-ids-col" in out
    assert "warning: --cache-blocks, --kv-capacity-tokens and --block-size are ignored" in err
    document = analyse(app, path)
    assert document["prefix_cache"] == {
        "available": False,
        "note": document["prefix_cache"]["note"],
    }
    assert "no block ids" in document["prefix_cache"]["note"]


def test_a_named_block_id_column_and_a_bad_row(app: typer.Typer, tmp_path: Path) -> None:
    path = tmp_path / "named.jsonl"
    lines = [
        {"ts": 0, "prompt_tokens": 10, "prefix": {"blocks": ["a", "b"]}},
        {"ts": 1, "prompt_tokens": 10, "prefix": {"blocks": ["a", 2.5]}},
        {"ts": 2, "prompt_tokens": 10, "prefix": {"blocks": ["a", "c"]}},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    document = analyse(app, path, "--block-ids-col", "prefix.blocks", "--block-size", "5")
    assert document["rows"]["bad_rows"] == [
        {"line": 2, "reason": "block id 2.5 is a float; expected integers or strings"}
    ]
    unbounded = document["prefix_cache"]["caches"][0]
    assert (unbounded["hit_blocks"], unbounded["blocks"]) == (1, 4)
    assert (unbounded["hit_tokens"], unbounded["tokens"]) == (5, 20)


def test_a_wrong_block_size_is_flagged(app: typer.Typer, tmp_path: Path) -> None:
    """Ids for 16-token blocks read as 512-token ones: the count disagrees."""
    reqs = [Req(i * 100, 160 + i, list(range(i, i + 11))) for i in range(40)]
    prefix = analyse(app, write_jsonl(tmp_path / "t.jsonl", reqs))["prefix_cache"]
    assert prefix["length_mismatches"] == 40
    assert prefix["tokens_per_block_median"] == pytest.approx(179.5 / 11)
    assert "--block-size" in prefix["note"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--cache-blocks", "0"), "--cache-blocks must be at least 1 block (got 0)"),
        (("--cache-blocks", "-1"), "--cache-blocks must be at least 1 block (got -1)"),
        (("--cache-blocks", "many"), "'--cache-blocks'"),
        (("--kv-capacity-tokens", "0"), "--kv-capacity-tokens must be at least 1 (got 0)"),
        (("--kv-capacity-tokens", "100"), "--kv-capacity-tokens 100 holds no whole block of 512"),
        (("--block-size", "0"), "--block-size must be at least 1 token (got 0)"),
        (("--kv-window-seconds", "0"), "--kv-window-seconds must be a whole number of seconds"),
        (("--block-ids-col", "nope"), "--block-ids-col nope: no such column"),
    ],
)
def test_bad_options_name_the_flag(
    app: typer.Typer, tmp_path: Path, args: tuple[str, str], message: str
) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", make_trace(7, n=20))
    code, _, err = run(app, "analyze", str(path), *args)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_the_cache_model_itself() -> None:
    cache = PrefixCache(2)
    assert cache.access(["a", "b", "c"]) == 0  # longer than the cache: its last 2 stay
    assert ("a" in cache, "b" in cache, "c" in cache) == (False, True, True)
    assert cache.match(["b", "c", "d"]) == 2
    assert len(cache) == 2 and cache.evictions == 1  # match changed nothing
    assert cache.access(["c", "x"]) == 1  # c refreshed; b is now the oldest and goes
    assert "b" not in cache and cache.match(["c", "x"]) == 2
    with pytest.raises(ValueError, match="at least 1 block"):
        PrefixCache(0)
    assert math.isclose(PrefixCache(None).access([1, 1]), 0)
