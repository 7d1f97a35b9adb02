"""The engine's calibration: does it measure acceptance right at the samplings the split asks for?

The target drafts for itself on a few eval rows of each sampling. Both pinned engines draft greedily:
vLLM 0.32.0 takes each draft token as the drafter's argmax and treats its probability as one-hot in the
rejection test (``SpeculativeConfig.draft_sample_method`` 'greedy', its default), SGLang's chain drafts
likewise take the top token. The drafter being the target, a draft token is then the target's own argmax,
accepted with the target's probability of it under the sampling (temperature, top_p, top_k, min_p); a
rejection resamples from what is left, never that token. So a draft position is accepted exactly when the
answer's token there is the target's argmax, and speculative sampling keeps each token's distribution the
target's: the share of the answer's tokens that are the target's argmax at their prefix is what the first
draft position must accept, up to sampling noise. That argmax is read from the same engine, one greedy
token at each prefix of each answer (the oracle). At temperature 0 both are 1: every draft accepted.

A sampling whose first-position acceptance is further from that share than its margin (three standard
errors, at least :data:`MIN_MARGIN`) fails: the drafters measured on that engine are marked untrusted in
the report and in `plan`.
"""

from __future__ import annotations

import math
from typing import Any

from dflash_build.engines import Request, Result, SamplingParams
from dflash_build.publish.acceptance import sampling_label

# The least margin between the first draft position's acceptance and the target's argmax share: the
# steps' first positions are not every position of an answer (they follow rejections and bonus tokens).
MIN_MARGIN = 0.15


def rows(split: list[dict[str, Any]], per_sampling: int) -> list[dict[str, Any]]:
    """The first ``per_sampling`` rows (by prompt id and turn) of each sampling the split asks for."""
    by: dict[str, list[dict[str, Any]]] = {}
    for row in sorted(split, key=lambda r: (r["prompt_id"], r["turn"])):
        group = by.setdefault(sampling_label(row), [])
        if len(group) < per_sampling:
            group.append(row)
    return [row for label in sorted(by) for row in by[label]]


def oracle_requests(requests: list[Request], results: dict[str, Result]) -> list[Request]:
    """One greedy token at each prefix of each answer: the target's argmax there."""
    greedy = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, max_new_tokens=1)
    out = []
    for request in requests:
        result = results.get(request.prompt_id)
        answer = [] if result is None else result.output_ids
        for j in range(len(answer)):
            out.append(Request(f"{request.prompt_id}:{j}", 0, [*request.prompt_ids, *answer[:j]], greedy, 0))
    return out


def verdict(
    rows_: list[dict[str, Any]],
    requests: list[Request],
    results: dict[str, Result],
    oracle: dict[str, Result],
    calibration_key: str,
) -> dict[str, Any]:
    """Per sampling: the first draft position's acceptance against the answers' argmax share, and whether
    the two agree within the margin."""
    groups: dict[str, dict[str, int]] = {}
    for row, request in zip(rows_, requests, strict=True):
        counts = groups.setdefault(
            sampling_label(row), dict.fromkeys(("rows", "steps", "first", "tokens", "argmax"), 0)
        )
        result = results.get(request.prompt_id)
        if result is None or result.acceptance is None:
            continue
        counts["rows"] += 1
        counts["steps"] += result.acceptance.steps
        counts["first"] += result.acceptance.per_position[0] if result.acceptance.per_position else 0
        for j, token in enumerate(result.output_ids):
            greedy = oracle.get(f"{request.prompt_id}:{j}")
            if greedy is not None and greedy.output_ids:
                counts["tokens"] += 1
                counts["argmax"] += int(greedy.output_ids[0] == token)
    samplings = []
    for label, c in sorted(groups.items()):
        expected = c["argmax"] / c["tokens"] if c["tokens"] else None
        first = c["first"] / c["steps"] if c["steps"] else None
        margin = MIN_MARGIN
        if expected is not None and c["steps"]:
            margin = max(MIN_MARGIN, 3 * math.sqrt(expected * (1 - expected) / c["steps"]))
        trusted = expected is not None and first is not None and abs(first - expected) <= margin
        samplings.append(
            {
                "sampling": label,
                **c,
                "position_1": round(first, 4) if first is not None else 0.0,
                "expected": round(expected, 4) if expected is not None else 0.0,
                "margin": round(margin, 4),
                "trusted": trusted,
            }
        )
    return {"kind": "calibration", "key": calibration_key, "trusted": all(s["trusted"] for s in samplings),
            "samplings": samplings}  # fmt: skip
