"""Answers that are not training data, found on token ids: a loop, a repetitive answer, reasoning that never
closes, and an empty answer (config ``degenerate``).

- **loop**: somewhere in the answer a span of period at most ``max_period`` tokens repeats, as one run, for
  ``min_span`` tokens or more and ``min_repeats`` periods or more. The rule is one test on each prefix,
  so the engine can stop a row the moment it fires (``stop_early``) and the same row checked after the
  fact, stopped or not, gives the same verdict (:func:`loop_end`).
- **repetitive**: an answer of ``min_tokens`` or more whose distinct ``ngram``-grams are fewer than
  ``min_distinct`` of all its n-grams (a loop with variations: counters, shuffled items).
- **unclosed_reasoning**: the turn ends inside a reasoning block: its last open marker (from the prompt's
  render, as Qwen3's template opens ``<think>``, or the answer) has no close marker after it.
- **empty**: an answer that stopped with nothing but whitespace, or with nothing after its reasoning.

Each reason has a policy (``drop`` or ``keep``); tokenize applies it and counts every decision. accept
leaves every degenerate answer out of τ (a drafter predicts a loop easily) and counts it apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_build.loops import loop_end
from dflash_build.spec import DEGENERATE_REASONS, Degenerate
from dflash_build.store.records import FINISH_LOOP

REASONS = DEGENERATE_REASONS
LOOP, REPETITIVE, UNCLOSED, EMPTY = REASONS


def distinct_ratio(ids: Sequence[int], n: int) -> float:
    """Distinct n-grams over all n-grams of ``ids`` (1.0 for fewer than n tokens)."""
    if len(ids) < n:
        return 1.0
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams)


def _last(ids: Sequence[int], marker: Sequence[int]) -> int:
    """Where ``marker`` last occurs in ``ids`` (its start), or -1."""
    m = len(marker)
    if not m:
        return -1
    # the marker's first token found by numpy, then each place it starts tried from the end: a context of
    # thousands of tokens costs one array pass, not a Python loop per sample
    starts = np.flatnonzero(np.asarray(ids, dtype=np.int64)[: max(len(ids) - m + 1, 0)] == marker[0])
    for i in starts[::-1]:
        if list(ids[i : i + m]) == list(marker):
            return int(i)
    return -1


@dataclass(frozen=True)
class Detector:
    """The config's thresholds with the reasoning markers as this tokenizer writes them, and a test for
    answers that hold nothing but whitespace (``blank``: decodes the ids)."""

    config: Degenerate
    open_ids: tuple[int, ...] = ()
    close_ids: tuple[int, ...] = ()
    blank: Callable[[Sequence[int]], bool] = lambda ids: not ids

    @classmethod
    def for_tokenizer(cls, config: Degenerate, tokenizer: Any) -> Detector:
        encode, decode = tokenizer.encode, tokenizer.decode
        marks = [tuple(encode(m, add_special_tokens=False)) for m in config.reasoning_markers]
        return cls(
            config,
            *(marks or [(), ()]),
            blank=lambda ids: not ids or not decode(list(ids), skip_special_tokens=True).strip(),
        )

    def reason(self, context: Sequence[int], output: Sequence[int], finish_reason: str) -> str | None:
        """Why one turn's answer (``output``, after the ids the model saw, ``context``) is degenerate, or
        None. The first reason that applies, in :data:`REASONS`' order."""
        cfg = self.config
        if finish_reason == FINISH_LOOP or loop_end(output, cfg.loop) is not None:
            return LOOP
        if len(output) >= cfg.repetitive_min_tokens and distinct_ratio(output, cfg.repetitive_ngram) < (
            cfg.repetitive_min_distinct
        ):
            return REPETITIVE
        after = self._after_reasoning(context, output)
        if after is None:
            return UNCLOSED
        if finish_reason == "stop" and self.blank(after):
            return EMPTY
        return None

    def _after_reasoning(self, context: Sequence[int], output: Sequence[int]) -> Sequence[int] | None:
        """The answer after its reasoning block closes (all of it when none is open), None when one is
        left open at the end."""
        if not self.open_ids or not self.close_ids:
            return output
        whole = list(context) + list(output)  # the render may open the block (Qwen3's thinking mode)
        opened, closed = _last(whole, self.open_ids), _last(whole, self.close_ids)
        if opened > closed:
            return None
        if closed < 0:
            return output
        start = closed + len(self.close_ids) - (len(whole) - len(output))
        return output[max(start, 0) :]


def reason(output_ids: Sequence[int], finish_reason: str, config: Degenerate | None = None) -> str | None:
    """Why an answer is degenerate on token ids alone (no markers, an empty answer is one of no ids)."""
    return Detector(config or Degenerate()).reason((), output_ids, finish_reason)
