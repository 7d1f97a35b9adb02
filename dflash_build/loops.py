"""The loop rule on token ids (config ``degenerate.loop``): one test on each prefix of an answer, so an engine
can stop a row the moment it fires and the row checked after the fact, stopped or not, gets the same
verdict. The engines' stop and tokenize's check (:mod:`dflash_build.stages.common.degenerate`) share it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dflash_build.spec import LoopRule

CHECK_EVERY = 16  # tokens between an engine's checks of a running row: one numpy pass each


def longest_span(rule: LoopRule) -> int:
    """The most tokens one firing of the rule covers (its longest period's ``min_repeats`` periods, or
    ``min_span``)."""
    return max(rule.min_span, rule.min_repeats * rule.max_period)


def loop_end(ids: Sequence[int] | np.ndarray, rule: LoopRule, clear: int = 0) -> int | None:
    """The length of the shortest prefix of ``ids`` on which the loop rule fires, or None.

    For each period p, a run of consecutive positions i with ids[i] == ids[i - p] of length L makes
    ids[i - L - p + 1 .. i] p-periodic, L + p tokens long: the rule fires at the first position where that
    span reaches ``min_span`` and ``min_repeats`` periods.

    ``clear``: a prefix already found clear (a running row's last check). A firing after it covers at most
    :func:`longest_span` tokens, so only that much before it is read again: each check of a running row
    costs the same however long the row is, and gives the answer the whole scan gives.
    """
    offset = max(0, clear - longest_span(rule))
    found = _first_end(np.asarray(ids[offset:], dtype=np.int64), rule)
    return None if found is None else found + offset


def _first_end(a: np.ndarray, rule: LoopRule) -> int | None:
    n = len(a)
    first: int | None = None
    for p in range(1, min(rule.max_period, n - 1) + 1):
        need = max(rule.min_span, rule.min_repeats * p) - p  # matching positions the run needs
        if need > n - p:
            continue
        same = a[p:] == a[:-p]
        # run length ending at each position: positions since the last mismatch
        idx = np.arange(len(same))
        last_miss = np.maximum.accumulate(np.where(same, -1, idx))
        runs = idx - last_miss
        hits = np.flatnonzero(runs >= need)
        if len(hits):
            end = int(hits[0]) + p + 1
            first = end if first is None else min(first, end)
    return first
