"""Answers that are not an answer, found on token ids: a loop to the budget, and an empty answer.

A **loop** ran to its budget (finish reason ``length`` or ``window``) repeating a short span: its last
``min_span`` tokens or more have a period of at most ``max_period`` tokens, repeated ``min_repeats``
times or more. An answer that repeats for a reason (code with repeated lines, a list, a table) stops on
its own, so the budget is what tells them apart. An **empty** answer stopped with no token before its
stop token. A drafter predicts a loop easily, so `accept` leaves both out of τ and counts them apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

LOOP = "loop"
EMPTY = "empty"
REASONS = (LOOP, EMPTY)
RAN_OUT = ("length", "window")  # the finish reasons of an answer its budget ended


@dataclass(frozen=True)
class Thresholds:
    """When a repeated tail is a loop (measured on SmolLM2's own loops: periods of 7-41 tokens repeated
    for 209-362 tokens to the budget)."""

    max_period: int = 64
    min_repeats: int = 3
    min_span: int = 96


def tail_period(ids: Sequence[int], max_period: int) -> tuple[int, int]:
    """(period, span): the period of at most ``max_period`` whose repetition covers the longest tail of
    ``ids``, and that tail's length; (0, 0) for none."""
    best = (0, 0)
    n = len(ids)
    for period in range(1, min(max_period, n // 2) + 1):
        span = period
        while span < n and ids[n - 1 - span] == ids[n - 1 - span + period]:
            span += 1
        if span >= 2 * period and span > best[1]:
            best = (period, span)
    return best


def reason(output_ids: Sequence[int], finish_reason: str, thresholds: Thresholds = Thresholds()) -> str | None:
    """Why an answer is degenerate (:data:`LOOP`, :data:`EMPTY`), or None for an answer."""
    if finish_reason == "stop" and not output_ids:
        return EMPTY
    if finish_reason in RAN_OUT:
        period, span = tail_period(output_ids, thresholds.max_period)
        if period and span >= thresholds.min_span and span >= thresholds.min_repeats * period:
            return LOOP
    return None
