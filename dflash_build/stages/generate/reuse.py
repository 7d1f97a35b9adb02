"""Rows an earlier build already generated, taken from the row index instead of the engine: a
``turns: first`` row whole, cut or as a prefix to continue; a ``turns: all`` row every turn of it
(see :mod:`dflash_build.store.rowindex`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_build import keys
from dflash_build.engines import Result
from dflash_build.plan import planned_components
from dflash_build.stages.generate.conversation import Conversation
from dflash_build.stages.generate.work import ShardWork, apply_result, fits_context, journal_row
from dflash_build.store import records as R
from dflash_build.store.journal import Journal
from dflash_build.store.rowindex import Candidate, RowIndex

log = logging.getLogger(__name__)


def reuse(work: ShardWork, journal: Journal) -> int:
    """Take every row an earlier build already generated validly (see rowindex); returns how many."""
    sp = work.plan.sources[work.source]
    limit = sp.spec.sampling.max_new_tokens
    pending = [c.key for c in work.pending() if not c.turns]
    if not pending:
        return 0
    store = work.plan.config.store
    with RowIndex.open(store, sync=None) as index:  # the build's start synced it with the store
        found = index.lookup(sp.reuse_key, pending, limit)
        count = 0
        columns = ["prompt_ids", "output_ids", "stop_token_id", "finish_reason"]
        for cand, old, origin in _earlier_rows(store, index, found.values(), columns):
            conv = work.convs[(cand.prompt_id, cand.sample_idx)]
            ids = work.renderer.next_context(conv)
            if ids != old["prompt_ids"]:
                continue  # rendered differently (should not happen under one reuse_key): generate it
            budget = work.budget(len(ids))
            if not fits_context(len(ids), budget, work.context) or work.plan.config.trainer.leaves_too_little(budget):
                continue  # a fresh build skips it, so reuse does too (next_requests records the skip)
            output = list(old["output_ids"])
            use = cand.use_for(budget)
            if use == "continue":
                conv.prefix, conv.prefix_from = output, origin  # the engine generates the rest
                continue
            if use == "whole":
                result = Result(conv.prompt_id, conv.sample_idx, output, R.FINISH_STOP, old["stop_token_id"])
            else:  # a prefix of a longer sample is this budget's truncated sample (or window's)
                result = Result(conv.prompt_id, conv.sample_idx, output[:budget], work.ran_out(budget))
            turn = apply_result(conv, ids, result)
            turn.reused_from = origin
            journal.append(journal_row(conv, turn))
            count += 1
        journal.sync()
        if count:
            log.info("%s: %d rows reused from earlier completions", work.label, count)
        return count


def reuse_conversations(work: ShardWork, journal: Journal) -> int:
    """Take every ``turns: all`` row an earlier build generated under the same conversation key (the
    same budgets; see rowindex), every turn of it, checking that each turn renders to the prompt it had;
    where one does not, the turns before it stay and the rest is generated. Returns the rows taken."""
    sp = work.plan.sources[work.source]
    pending = [c.key for c in work.pending() if not c.turns]
    if not pending:
        return 0
    store = work.plan.config.store
    count = 0

    @functools.cache
    def tool_settings(gen_key: str) -> Any:
        """The tool-call settings an earlier row was generated under (its key's recorded components)."""
        components = planned_components(store, gen_key)
        return "unknown" if components is None else components.get(keys.TOOL_CALLS)

    with RowIndex.open(store, sync=None) as index:
        found = index.lookup(sp.conversation_reuse_key, pending, sp.spec.sampling.max_new_tokens)
        for cand, old, origin in _earlier_rows(store, index, found.values(), ["turns", "per_turn", "error"]):
            conv = work.convs[(cand.prompt_id, cand.sample_idx)]
            if conv.tools and tool_settings(cand.gen_key) != sp.gen_components.get(keys.TOOL_CALLS):
                continue  # where a tool conversation went on was decided otherwise
            count += _replay_turns(work, conv, old, origin, journal)
    journal.sync()
    if count:
        log.info("%s: %d conversations reused from earlier completions", work.label, count)
    return count


def _replay_turns(work: ShardWork, conv: Conversation, old: dict[str, Any], origin: str, journal: Journal) -> int:
    """Apply an earlier row's turns to ``conv`` while each renders to the prompt it had; 1 if any did."""
    turns = old["turns"] or []
    for k, (turn, prompt) in enumerate(zip(turns, _whole_prompts(old), strict=True)):
        try:
            ids = work.renderer.next_context(conv)
        except Exception:  # the template refuses it now: next_requests records that as a fresh build does
            break
        if conv.request_ids(ids) != prompt:
            break  # rendered differently (should not happen under one key): generate from here
        last = k == len(turns) - 1
        result = Result(
            conv.prompt_id,
            conv.sample_idx,
            turn["output_ids"],
            turn["finish_reason"],
            turn["stop_token_id"],
            old["error"] if last and turn["finish_reason"] != R.FINISH_STOP else None,
        )
        applied = work.apply(conv, ids, result)
        applied.reused_from = origin if k == 0 else None
        journal.append(journal_row(conv, applied))
    return int(bool(conv.turns))


def _whole_prompts(row: dict[str, Any]) -> list[list[int]]:
    """Each turn's whole prompt as the engine saw it: a per-turn row keeps them as its contexts, a
    one-sequence row as the sequence so far plus the turn's context."""
    if row.get("per_turn"):
        return [t["context_ids"] for t in row["turns"]]
    prompts, sequence = [], []
    for t in row["turns"]:
        prompts.append(sequence + t["context_ids"])
        sequence = prompts[-1] + t["output_ids"] + ([t["stop_token_id"]] if t["stop_token_id"] is not None else [])
    return prompts


def _earlier_rows(
    store: Path, index: RowIndex, found: Iterable[Candidate], columns: list[str]
) -> Iterator[tuple[Candidate, dict[str, Any], str]]:
    """(candidate, its row's ``columns``, "gen_key/shard" it comes from), shard by shard; a shard the
    index names but that cannot be read is dropped from the index (the rows are generated instead)."""
    by_file: dict[str, list[Candidate]] = {}
    for cand in found:
        by_file.setdefault(cand.path, []).append(cand)
    for path, cands in by_file.items():
        try:
            table = pq.read_table(store / path, columns=columns)
            rows = table.take(pa.array([c.row for c in cands], type=pa.int64())).to_pylist()
        except (OSError, pa.ArrowException, IndexError) as e:
            log.warning("index points at unreadable %s (%s): dropping its entries", store / path, e)
            index.remove_shard(store / path)
            continue
        origin = f"{Path(path).parent.name}/{Path(path).stem}"
        yield from ((cand, old, origin) for cand, old in zip(cands, rows, strict=True))
