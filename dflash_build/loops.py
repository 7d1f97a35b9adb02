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


def engine_check(rule: LoopRule) -> dict[str, int]:
    """vLLM's per-request ``repetition_detection`` that stops a row in the engine's scheduler (after every
    step, with no client in the loop) only where the loop rule has fired: the engine's first stop on a loop.

    vLLM stops when its output's last ``c`` x ``m`` tokens repeat one ``m``-token pattern ``c`` times, for
    some m in [low, max_period] (``v1/core/sched/utils.py``: ``check_sequence_repetition``). That tail is
    m-periodic, m <= max_period, and m x c >= max(min_span, min_repeats x m) (c >= min_repeats and
    c >= min_span / low): the rule has fired on it, so the engine never ends a row the rule would let run.
    Every period p <= max_period has a multiple in [low, max_period] (low = ceil(max_period / 2)), so every
    loop the rule sees is also stopped by the engine, at most about twice as far in as the rule fires
    (p-periodic over low x c tokens where the rule needs max(min_span, min_repeats x p)). The job still cuts
    the row where the rule first fired (:func:`loop_end`): the engine's check only ends the generating.
    """
    low = max(1, -(-rule.max_period // 2))
    count = max(2, rule.min_repeats, -(-rule.min_span // low))
    return {"max_pattern_size": rule.max_period, "min_pattern_size": low, "min_count": count}


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


class Watch:
    """One running row's checks against the rule, as an engine streams it: every ``CHECK_EVERY`` new tokens
    and once more on its last ones (the rule may fire in them), each reading only what the last check left
    open (:func:`loop_end`'s ``clear``). The streamed backends (vLLM's and SGLang's, over HTTP or in the
    job) share it, so a row is cut at the same place whichever streams it."""

    def __init__(self, rule: LoopRule) -> None:
        self.rule = rule
        self.checked = 0  # the prefix found clear

    def end(self, ids: Sequence[int], last: bool = False) -> int | None:
        """Where the rule first fired in ``ids`` (the row so far; ``last``: it ends here), or None."""
        if len(ids) - self.checked < CHECK_EVERY and not last:
            return None
        end, self.checked = loop_end(ids, self.rule, clear=self.checked), len(ids)
        return end


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
