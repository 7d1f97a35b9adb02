"""Tokenize stage: completions → training samples, without re-tokenizing any generated text.

A sample is the prompt ids the model saw, then the ids it generated, then the stop token it emitted
when it stopped on its own (for ``turns: all`` in one sequence, each turn in order; a conversation
whose turns are samples of their own gives one sample per turn, ``turn`` naming it). loss_mask is 1
exactly on the generated ids (stop tokens included).
Truncated answers follow the `truncated` policy; rows the engine could not generate are dropped.
A degenerate answer (a loop, a repetitive answer, reasoning left open, an empty answer:
:mod:`~dflash_build.stages.common.degenerate`, per turn) follows its reason's policy (config `degenerate`):
dropped, or kept; either way counted by reason and language (``degenerate`` in the sidecar).
Every dropped row is counted by reason in the stats sidecar. Each sample carries its prompt's language
(:mod:`dflash_build.language`), read from the shard's prompts.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_build import language
from dflash_build.engines.base import MARK_NONE, Acceptance, summed_histogram
from dflash_build.stages.common import chat, degenerate
from dflash_build.stages.common.job import Job
from dflash_build.store import atomic
from dflash_build.store import records as R

log = logging.getLogger(__name__)

DROP_TRUNCATED = "truncated"
DROP_ENGINE_ERROR = "engine_error"
DROP_EMPTY_ANSWER = "empty_answer"
DROP_SKIPPED = "skipped"
DROP_OUTSIDE_WINDOW = R.STAT_OUTSIDE_WINDOW  # skipped: the trainer's window left too little room


def _dropped(reason: str, truncated_policy: str, error: str | None = None) -> str | None:
    """Why an answer that ended with ``reason`` is no sample, or None when it is one (a row the loop rule
    stopped is judged as degenerate, by its policy)."""
    if reason in R.NO_ANSWER:
        return DROP_ENGINE_ERROR
    if reason == R.FINISH_SKIPPED:  # a selection (the window, another source's copy) names itself
        return R.selection_of(reason, error) or DROP_SKIPPED
    if reason == R.FINISH_LENGTH and truncated_policy == "drop":
        return DROP_TRUNCATED
    return None


def _turns(row: dict[str, Any]) -> list[tuple[list[int], list[int], str]]:
    """(context ids, answer ids without the stop token, finish reason) of each turn of a completion row."""
    if row.get("turns"):
        return [(t["context_ids"], t["output_ids"], t["finish_reason"]) for t in row["turns"]]
    return [(row["prompt_ids"], row["output_ids"], row["finish_reason"])]


def degenerate_reason(detector: degenerate.Detector, turns: list[tuple[list[int], list[int], str]]) -> str | None:
    """The first turn's reason to be no training data, or None (a whole row is as good as its worst turn)."""
    for context, output, finish in turns:
        found = detector.reason(context, output, finish)
        if found is not None:
            return found
    return None


def to_sample(row: dict[str, Any], truncated_policy: str) -> tuple[list[int], list[int]] | str:
    """(input_ids, loss_mask) of one completion as one sequence, or the reason it is dropped.

    Every turn adds the ids the model saw before its answer (mask 0), then the answer and the stop
    token it emitted (mask 1).
    """
    reason = _dropped(row["finish_reason"], truncated_policy, row.get("error"))
    if reason is not None:
        return reason
    input_ids: list[int] = []
    loss_mask: list[int] = []
    for context, generated in R.iter_turn_tokens(row):
        input_ids += list(context) + list(generated)
        loss_mask += [0] * len(context) + [1] * len(generated)
    if not any(loss_mask):
        return DROP_EMPTY_ANSWER
    return input_ids, loss_mask


def to_samples(row: dict[str, Any], truncated_policy: str) -> list[tuple[int | None, list[int], list[int]] | str]:
    """The samples of one completion as (turn, input_ids, loss_mask), each or the reason it is dropped.

    A row whose turns are samples of their own (:func:`records.is_per_turn`) gives one per turn: the
    whole prompt that turn saw (mask 0), then its answer and stop token (mask 1); each turn follows
    the truncated policy by its own finish reason. Any other row is one sample (:func:`to_sample`,
    turn None).
    """
    if not R.is_per_turn(row):
        sample = to_sample(row, truncated_policy)
        return [sample if isinstance(sample, str) else (None, *sample)]
    out: list[tuple[int | None, list[int], list[int]] | str] = []
    for i, (t, (context, generated)) in enumerate(zip(row["turns"], R.iter_turn_tokens(row), strict=True)):
        reason = _dropped(t["finish_reason"], truncated_policy)
        if reason is None and not generated:
            reason = DROP_EMPTY_ANSWER
        if reason is not None:
            out.append(reason)
            continue
        out.append((i, list(context) + list(generated), [0] * len(context) + [1] * len(generated)))
    return out


_UNMEASURED = dict.fromkeys(("spec_steps", "spec_drafted", "spec_accepted", "spec_histogram", "draft_mark"))


def drafting(row: dict[str, Any], turn: int | None) -> dict[str, Any]:
    """A sample's acceptance columns (``records.SAMPLE_SCHEMA``) from its turns' counts: their sums, and each
    token's mark lined up with the sample's input_ids (its prompt -1, each answer as
    ``Acceptance.marks`` places it, -1 where it cannot); nulls unless every turn in it was measured."""
    if row.get("turns"):
        turns = row["turns"] if turn is None else [row["turns"][turn]]
        counted = [t.get("acceptance") for t in turns]
    else:
        counted = [row.get("acceptance")]
    measured = [Acceptance.of(c) for c in counted]
    if any(a is None for a in measured):
        return dict(_UNMEASURED)
    parts = list(R.iter_turn_tokens(row))
    mark: list[int] = []
    for (context, generated), counts in zip(parts if turn is None else [parts[turn]], measured, strict=True):
        placed = counts.marks(len(generated)) if counts is not None else None
        mark += [MARK_NONE] * len(context) + (placed if placed is not None else [MARK_NONE] * len(generated))
    return {
        "spec_steps": sum(a.steps for a in measured if a is not None),
        "spec_drafted": sum(a.drafted for a in measured if a is not None),
        "spec_accepted": sum(a.accepted for a in measured if a is not None),
        "spec_histogram": summed_histogram([a.histogram for a in measured if a is not None]),
        "draft_mark": mark,
    }


def prompt_languages(prompt_shard: Path) -> dict[str, str]:
    """Each prompt's language, by prompt id."""
    table = pq.read_table(prompt_shard, columns=["prompt_id", "messages"])
    ids = table.column("prompt_id").to_pylist()
    return dict(zip(ids, language.of_messages_json(table.column("messages").to_pylist()), strict=True))


def _samples(
    job: Job, completions: list[dict[str, Any]], languages: dict[str, str], detector: degenerate.Detector
) -> tuple[list[dict[str, Any]], Counter[str], dict[str, Counter[str]]]:
    """The shard's samples, the rows dropped by reason, and the degenerate ones found by reason and language
    (whatever their policy)."""
    plan, source = job.plan, str(job.source)
    sp, policy = plan.sources[source], plan.config.degenerate
    drops: Counter[str] = Counter()
    found: dict[str, Counter[str]] = {}
    samples = []
    for row in completions:
        turns = _turns(row)
        for sample in to_samples(row, plan.config.truncated):
            if isinstance(sample, str):
                drops[sample] += 1
                continue
            turn, input_ids, loss_mask = sample
            why = degenerate_reason(detector, turns if turn is None else [turns[turn]])
            if why is not None:
                found.setdefault(why, Counter())[languages[row["prompt_id"]]] += 1
                if policy.policy(why) != "keep":  # regenerate: still degenerate after its retries
                    drops[why] += 1
                    continue
            samples.append(
                {
                    "input_ids": input_ids,
                    "loss_mask": loss_mask,
                    "source": source,
                    "category": sp.spec.category,
                    "language": languages[row["prompt_id"]],
                    "prompt_id": row["prompt_id"],
                    "sample_idx": row["sample_idx"],
                    "turn": turn,
                    "variant": sp.spec.variant,
                    "finish_reason": row["finish_reason"] if turn is None else row["turns"][turn]["finish_reason"],
                    "n_tokens": len(input_ids),
                    "n_loss_tokens": sum(loss_mask),
                    **drafting(row, turn),
                }
            )
    return samples, drops, found


def run(job: Job) -> dict[str, Any]:
    """Tokenize the job's completion shard (each sample's language is its prompt's, from the prompt shard
    beside the declared manifest); returns the stats sidecar."""
    plan, source, shard = job.plan, job.source, job.shard
    assert source is not None and shard is not None
    sp = plan.sources[source]
    completions = pq.read_table(job.input("completions")).to_pylist()
    languages = prompt_languages(job.prompt_shard())
    policy = plan.config.degenerate
    detector = degenerate.Detector.for_tokenizer(policy, chat.load_tokenizer(plan.config.model, plan.tokenizer_cache()))
    samples, drops, found = _samples(job, completions, languages, detector)
    stats = {
        "stage": "tokenize",
        "source": source,
        "shard": shard,
        "variant": sp.spec.variant,
        "tok_key": sp.tok_key,
        "components": sp.tok_components,
        R.STAT_INPUT_ROWS: len(completions),
        R.STAT_ROWS_OUT: len(samples),
        R.STAT_DROPPED: dict(sorted(drops.items())),
        R.STAT_TRUNCATED: sum(r["finish_reason"] == R.FINISH_LENGTH for r in completions),
        R.STAT_TOKENS: sum(s["n_tokens"] for s in samples),
        R.STAT_LOSS_TOKENS: sum(s["n_loss_tokens"] for s in samples),
        R.STAT_PER_TURN_SAMPLES: sum(s["turn"] is not None for s in samples),
        R.STAT_LANGUAGES: dict(Counter(s["language"] for s in samples).most_common()),
        R.STAT_DEGENERATE: {why: dict(by_language.most_common()) for why, by_language in sorted(found.items())},
    }
    table = pa.Table.from_pylist(samples, schema=R.SAMPLE_SCHEMA)
    stats[R.STAT_DATA] = atomic.write_parquet(job.output("data"), table)
    atomic.write_json(job.output("stats"), stats)
    log.info("%s/%s: %d samples, dropped %s", source, shard, len(samples), dict(drops))
    return stats
