"""Record schemas of the store's parquet files and the names of per-shard stats.

Stat names are constants so the stages that write a sidecar and the commands that read it agree.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa

PROMPT_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("source", pa.string()),
        ("category", pa.string()),
        ("messages", pa.string()),  # JSON list of {role, content}
        ("tools", pa.string()),  # JSON list of tool schemas, or null
        ("meta", pa.string()),  # JSON: where the row came from
        # JSON: this row's chat-template kwargs (sources.*.chat_template_kwargs_from), or null. Prompt
        # files written before it lack the column: readers take a missing one as null.
        ("template_kwargs", pa.string()),
    ]
)

# What a speculative engine counted of one answer (engine.drafter; engines.Acceptance): verify steps,
# draft tokens proposed and accepted, steps by drafts accepted, and (vLLM's detailed metrics) each step's.
ACCEPTANCE_TYPE = pa.struct(
    [
        ("steps", pa.int32()),
        ("drafted", pa.int32()),
        ("accepted", pa.int32()),
        ("histogram", pa.list_(pa.int32())),
        ("accepted_steps", pa.list_(pa.int16())),
        ("drafted_steps", pa.list_(pa.int16())),
    ]
)

COMPLETION_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("sample_idx", pa.int32()),
        ("seed", pa.int64()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("output_ids", pa.list_(pa.int32())),  # without the stop token; see stop_token_id
        ("stop_token_id", pa.int32()),  # the token that ended the answer, null unless finish_reason=stop
        ("text", pa.string()),
        ("finish_reason", pa.string()),  # stop | length | abort | error | skipped
        ("error", pa.string()),  # why a row could not be generated, else null
        ("n_prompt_tokens", pa.int32()),
        ("n_output_tokens", pa.int32()),
        ("reused_from", pa.string()),  # "gen_key/shard" the row was taken from, null when generated here
        ("continued", pa.bool_()),  # reused as a truncated prefix that the engine continued
        # turns: all only: true when each turn is its own sample (turn_samples), its context_ids the
        # whole prompt; false when the turns make one sequence. Null for single-turn rows and in shards
        # written before the column (read as false).
        ("per_turn", pa.bool_()),
        # turns: all only: every regenerated turn, context ids first (null for single-turn rows)
        (
            "turns",
            pa.list_(
                pa.struct(
                    [
                        ("context_ids", pa.list_(pa.int32())),
                        ("output_ids", pa.list_(pa.int32())),
                        ("stop_token_id", pa.int32()),
                        ("finish_reason", pa.string()),
                        ("text", pa.string()),
                        # per-turn samples: the prompt holds earlier answers as text the template wrote
                        ("history_retokenized", pa.bool_()),
                        ("acceptance", ACCEPTANCE_TYPE),
                    ]
                )
            ),
        ),
        # the sampling variant the row was generated under (config variants); null without variants and in
        # shards written before the column
        ("variant", pa.string()),
        # the row's acceptance under engine.drafter (its turns' sums for a conversation); null when no
        # drafter served it, the engine did not count it, or a shard was written before the column
        ("acceptance", ACCEPTANCE_TYPE),
    ]
)

SAMPLE_SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("source", pa.string()),
        ("category", pa.string()),
        ("language", pa.string()),  # the prompt's (dflash_build.language): ISO 639, und without letters
        ("prompt_id", pa.string()),
        ("sample_idx", pa.int32()),
        ("turn", pa.int32()),  # a per-turn sample's turn of its conversation; null for a whole row
        ("variant", pa.string()),  # the sampling variant it was generated under (config variants), else null
        ("finish_reason", pa.string()),
        ("n_tokens", pa.int32()),
        ("n_loss_tokens", pa.int32()),
        # engine.drafter only (null otherwise, and in shards tokenized before these columns): the verify
        # steps, draft tokens proposed and accepted over the sample's answers, and per token of input_ids
        # (lined up with loss_mask): 1 a draft the target accepted, 0 the target's own token where it
        # turned the draft down, -1 no draft judged it (the prompt, a first or bonus token, unplaced steps)
        ("spec_steps", pa.int32()),
        ("spec_drafted", pa.int32()),
        ("spec_accepted", pa.int32()),
        ("spec_histogram", pa.list_(pa.int32())),  # verify steps by drafts accepted (index i: i accepted)
        ("draft_mark", pa.list_(pa.int8())),
    ]
)


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with ``schema``'s columns in its order, a column it lacks (a file written before it was
    added) as nulls."""
    columns = [
        table.column(f.name) if f.name in table.column_names else pa.nulls(table.num_rows, f.type) for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"
FINISH_SKIPPED = "skipped"  # never sent: the prompt does not fit the context with max_new_tokens
FINISH_WINDOW = "window"  # ended at the trainer's window (trainer.max_length): a complete training sample
FINISH_LOOP = "loop"  # stopped by the engine when the loop rule fired (degenerate.loop.stop_early): never a sample
RAN_OUT = (FINISH_LENGTH, FINISH_WINDOW)  # an answer cut by its budget
NO_ANSWER = (FINISH_ERROR, FINISH_ABORT)  # the engine refused or dropped the request: nothing to keep or resume
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_WINDOW, FINISH_LOOP, FINISH_ABORT, FINISH_ERROR, FINISH_SKIPPED)

# Stats sidecar names.
STAT_INPUT_ROWS = "input_rows"
STAT_OK = "ok"
STAT_TRUNCATED = "truncated"
STAT_WINDOW = "window"  # rows that ended at the trainer's window (kept: complete samples)
STAT_ERROR = "error"
STAT_SKIPPED = "skipped"
# Of the skipped rows, those the trainer's window (trainer.max_length) leaves too little room for: a
# selection, as a length filter is, never a failure. Their error starts with OUTSIDE_WINDOW.
STAT_OUTSIDE_WINDOW = "outside_window"
OUTSIDE_WINDOW = "outside the trainer's window:"
# Of the skipped rows, copies of a prompt that a source ranked above keeps (dedup.across_sources),
# skipped before any GPU time: a selection too. Their error starts with one of the two reasons.
# A tool conversation that ended because the target's calls were not the dataset's (turns: all with
# model.tool_call_parser): its row's error starts with this; the turns it has are samples.
TOOL_CALL_MISMATCH = "tool_call_mismatch"
STAT_TOOL_CALLS_MATCHED = "tool_calls_matched"  # turns whose calls were the dataset's: the conversation went on
STAT_CROSS_SOURCE = "cross_source"
CROSS_SOURCE_DUPLICATE = "cross_source_duplicate"
CROSS_SOURCE_NEAR_DUPLICATE = "cross_source_near_duplicate"


def failed_rows(stats: dict[str, Any]) -> int:
    """A generate sidecar's (or a sum of them) rows that could not be generated: errors, aborts and rows
    skipped over the context; the rows a selection left out (the window, another source's copies) are
    none of them."""
    selected_out = stats.get(STAT_OUTSIDE_WINDOW, 0) + stats.get(STAT_CROSS_SOURCE, 0)
    return int(stats.get(STAT_ERROR, 0) + stats.get(STAT_SKIPPED, 0) - selected_out)


def selection_of(finish_reason: str, error: str | None) -> str | None:
    """Which selection left a skipped row out (outside_window, or a cross-source reason), or None for a
    row that was not skipped, or was skipped for another reason (over the context: a failure)."""
    if finish_reason != FINISH_SKIPPED or not error:
        return None
    if error.startswith(OUTSIDE_WINDOW):
        return STAT_OUTSIDE_WINDOW
    reason = error.partition(":")[0]
    return reason if reason in (CROSS_SOURCE_DUPLICATE, CROSS_SOURCE_NEAR_DUPLICATE) else None


STAT_RESUMED_TURNS = "resumed_turns"
STAT_RETOKENIZED_TURNS = "retokenized_turns"  # answers that came back as text (openai backend)
STAT_RETOKENIZE_DRIFT = "retokenize_drift_rate"  # of those, share whose length differs from the server's
STAT_PROMPT_TOKENS = "prompt_tokens"
STAT_OUTPUT_TOKENS = "output_tokens"
STAT_WALL_SECONDS = "wall_seconds"
STAT_OUTPUT_TOK_PER_S = "output_tokens_per_second"
STAT_ROWS_OUT = "rows_out"
STAT_DROPPED = "dropped"
STAT_TOKENS = "tokens"
STAT_LOSS_TOKENS = "loss_tokens"
STAT_DATA = "data"  # {"rows", "sha256"} of the parquet file the sidecar describes
STAT_REUSED = "reused"  # rows taken from completions already in the store
STAT_CONTINUED = "continued"  # rows whose earlier truncated answer the engine continued
STAT_REUSED_ACROSS = "reused_across_settings"  # reused (or continued) rows a generation under other settings made
STAT_REUSED_FROM = "reused_from"  # {"gen_key/shard": rows}, reused and continued
STAT_GENERATED = "generated"  # rows the engine produced in the run that generated the shard
STAT_TURNS = "turns"  # turns: all: what became of the conversations (generate.turn_counts)
STAT_PER_TURN_SAMPLES = "per_turn_samples"  # samples that are one turn of a conversation
STAT_LANGUAGES = "languages"  # samples by their prompt's language
# tokenize: degenerate samples by reason, then by language ({reason: {language: n}}), whatever the policy
STAT_DEGENERATE = "degenerate"
STAT_LOOPS_STOPPED = "loops_stopped"  # generate: rows the engine stopped on the loop rule (finish reason loop)
STAT_LOOP_TOKENS = "loop_tokens"  # generate: the output tokens those rows had when stopped
STAT_REGENERATED = "regenerated"  # generate: degenerate answers asked again in this run (policy regenerate)
STAT_REGENERATED_ROWS = "regenerated_rows"  # generate: rows whose answer is a later attempt's
STAT_DRAFTING = "drafting"  # generate: what the engine counted of the rows engine.drafter served (or null)
STAT_RESTORED = "restored"  # {from, at}: a later job republished the shard; the numbers stay the generation's


def is_per_turn(row: dict[str, Any]) -> bool:
    """Whether each turn of this completion row is a sample of its own."""
    return bool(row.get("per_turn")) and bool(row.get("turns"))


def iter_turn_tokens(row: dict[str, Any]) -> Iterator[tuple[list[int], list[int]]]:
    """(context ids, generated ids incl. stop token) for each turn of a completion row."""
    if row.get("turns"):
        for t in row["turns"]:
            stop = [t["stop_token_id"]] if t["stop_token_id"] is not None else []
            yield t["context_ids"], t["output_ids"] + stop
        return
    stopped = row["finish_reason"] == FINISH_STOP and row["stop_token_id"] is not None
    stop = [row["stop_token_id"]] if stopped else []
    yield row["prompt_ids"], row["output_ids"] + stop


# A prompt folder's manifest (prepare's record), read by the mix, the card, plan, verify and gc.
PROMPTS_ROWS_IN = "rows_in"
PROMPTS_ROWS_OUT = "rows_out"
PROMPTS_DROPS = "drops"  # {reason: rows}
PROMPTS_DROP_EXAMPLES = "drop_examples"  # {reason: [location: detail]}
PROMPTS_SHARDS = "shards"  # {shard: {"rows", "sha256"}}
PROMPTS_REFERENCES = "references"  # with decontaminate: each reference set's items
