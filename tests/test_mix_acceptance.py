"""The mix's choice by acceptance (mix.by_acceptance) on planted rows: the hard part comes from the pool of
the lowest-τ rows, the rest in rank order, rows without a measurement never in the pool, the category's
target and its language floors met as before, and the manifest's counts exact."""

from __future__ import annotations

import numpy as np

from dflash_build.spec import AcceptanceRule
from dflash_build.stages import mix
from dflash_build.stages.mix import acceptance

N = 40
RANK = np.arange(N, dtype=np.uint64)[::-1].copy()  # the seeded rank: the last sample first
TOKENS = np.full(N, 10, dtype=np.int32)
# τ: rows 0-9 the drafter's weakest (1.0-1.9), 10-29 easy (3.0), 30-39 unmeasured
TAUS = np.concatenate([1 + np.arange(10) / 10, np.full(20, 3.0), np.full(10, np.nan)])


def test_the_hard_part_is_drawn_from_the_lowest_tau_pool_and_leads_the_order() -> None:
    members = np.arange(N)
    ordered, hard = acceptance.order(members, RANK, TOKENS, TAUS, target=100, rule=AcceptanceRule(0.5, 2))
    # hard part 50 tokens (5 rows); pool 100 tokens: the 10 lowest-τ rows; drawn from it by rank (9, 8, ...)
    assert set(hard) <= set(range(10)) and len(hard) == 5
    assert list(hard) == [9, 8, 7, 6, 5], "drawn in the mix's rank order, not by τ"
    assert list(ordered[:5]) == list(hard) and sorted(ordered) == list(range(N)), "every member once, hard first"
    assert list(ordered[5:]) == [m for m in np.argsort(RANK[members], kind="stable") if m not in hard]
    no_pool, none = acceptance.order(members[30:], RANK, TOKENS, TAUS, target=100, rule=AcceptanceRule(1.0, 4))
    assert len(none) == 0 and list(no_pool) == list(range(39, 29, -1)), "unmeasured rows: rank order, no pool"


def test_the_category_target_and_a_language_floor_hold_and_the_report_counts_what_each_part_chose() -> None:
    language = np.where(np.arange(N) % 4 == 0, 1, 0).astype(np.int16)  # every fourth row zh
    cand = mix._Candidates(RANK, TOKENS, np.zeros(N, np.int16), np.array([0, N]), np.arange(N, dtype=np.uint64),
                           np.zeros(N, np.int16), language, ["en", "zh"])  # fmt: skip
    members = np.arange(N)
    rule = AcceptanceRule(0.5, 1)  # the pool is the hard part: the 10 lowest-τ rows, all drawn
    ordered, hard = acceptance.order(members, RANK, TOKENS, TAUS, 200, rule)
    assert sorted(hard) == list(range(10))
    take = mix._fill(cand, ordered, 200, {"zh": 0.3})
    assert TOKENS[take].sum() == 200, "the category's target, as without the rule"
    assert TOKENS[take][language[take] == 1].sum() >= 0.3 * 200, "the zh floor"
    chosen = np.zeros(N, dtype=bool)
    chosen[take] = True
    plain = mix._fill(cand, members[np.argsort(RANK, kind="stable")], 200, {"zh": 0.3})
    report = acceptance.report(rule, hard, members, chosen, TAUS, TOKENS)
    assert report["hard_rows"] == int(np.isin(take, hard).sum()) and report["hard_rows"] + report["rest_rows"] == 20
    assert report["chosen"]["rows"] + report["left_out"]["rows"] == N
    assert report["unmeasured_chosen"] == int(np.isnan(TAUS[take]).sum())
    without = np.nanmean(TAUS[plain])
    assert report["chosen"]["tau_per_row"] < without, "the rule chose rows the drafter accepted less"
    assert report["chosen"]["tau_per_row"] < report["left_out"]["tau_per_row"]
