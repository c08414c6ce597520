"""The batch path's dense counters against a plain count of the same rows."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np

from controlplane.service import records as R
from controlplane.service.stats import AdmissionStats, DenseTally


def test_dense_tally_counts_like_a_counter_while_tenants_and_lanes_grow() -> None:
    rnd = random.Random(13)
    tally = DenseTally()
    decisions: Counter[tuple[int, str, int]] = Counter()
    tokens: Counter[tuple[int, str, int]] = Counter()
    names = [""]  # interned names: lanes mixed with models and pools, as in the request log
    for batch in range(300):
        if rnd.random() < 0.1 or len(names) == 1:
            names.append(f"lane{len(names)}" if rnd.random() < 0.5 else f"model{len(names)}")
        lanes = [i for i, name in enumerate(names) if name.startswith("lane")]
        if not lanes:
            continue
        slots = rnd.randint(1, 5 + batch)  # tenants configured so far (grows the arrays)
        rows = np.zeros((rnd.randint(1, 50), R.FIELDS), dtype=np.int64)
        for row in rows:
            slot, lane, reason = rnd.randint(-1, slots - 1), rnd.choice(lanes), rnd.randint(0, 12)
            reserved = rnd.randint(1, 1000) if reason == 0 else 0
            row[[R.SLOT, R.LANE, R.REASON, R.RESERVED]] = slot, lane, reason, reserved
            decisions[(slot, names[lane], reason)] += 1
            tokens[(slot, names[lane], reason)] += reserved
        tally.add(rows, names, slots)
    got = {(s, lane, r): (n, t) for s, lane, r, n, t in tally.cells()}
    assert got == {k: (n, tokens[k]) for k, n in decisions.items()}
    assert len(tally.lanes) > 4 and len(tally.arrays[1]) > 9 * tally.arrays[0]  # both grew


def test_unary_and_batch_counts_add_up_in_the_totals() -> None:
    stats = AdmissionStats()
    # one admitted unary decision of slot 0 in lane "standard", one refused (reason 1)
    ok = R.admitted(70, 1, 20, 0, -1, -1, "standard", 0, 1, "", "", 1.0, 0, 1, 0, 0, 0, 0)
    stats.count(ok)
    stats.count(R.refused(1, 5, "standard", 0, 1, 1))
    rows = np.zeros((3, R.FIELDS), dtype=np.int64)
    rows[:, R.SLOT], rows[:, R.LANE], rows[:, R.REASON] = 0, 1, [0, 0, 1]
    rows[:, R.RESERVED] = [10, 10, 0]
    stats.count_rows(rows, ["", "standard"], 1, False)
    cells = sorted(stats.outcome_cells())
    assert cells == [
        (0, "standard", 0, 1, 70), (0, "standard", 0, 2, 20),
        (0, "standard", 1, 1, 0), (0, "standard", 1, 1, 0),
    ]  # fmt: skip
    assert stats.decision_counts == {(1, 0): 3, (2, 1): 2}
