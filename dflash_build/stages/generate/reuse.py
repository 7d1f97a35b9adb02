"""Rows an earlier build already generated, taken from the row index instead of the engine: a
``turns: first`` row whole, cut or as a prefix to continue; a ``turns: all`` row turn by turn from the
first (see :mod:`dflash_build.store.rowindex`).

The index finds the rows asked of the same engine (model, numerics, sampling); each is taken only when it
answers the request this build would send: the same prompt token ids (rendered now, with today's
template), the same seed, and the answer the engine returns under today's stop ids and budget. So a
template edit no prompt uses, or a scheme bump under which every prompt renders as before, costs no GPU
time, and one that changes some prompts regenerates exactly those.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_build import keys, loops
from dflash_build.engines import Result
from dflash_build.plan import planned_components
from dflash_build.stages.generate.conversation import Conversation
from dflash_build.stages.generate.work import ShardWork, apply_result, fits_context, journal_row, row_seed
from dflash_build.store import records as R
from dflash_build.store.journal import Journal
from dflash_build.store.rowindex import Candidate, RowIndex

log = logging.getLogger(__name__)
_COLUMNS = ["prompt_ids", "output_ids", "stop_token_id", "finish_reason", "seed"]
_TURN_COLUMNS = ["turns", "per_turn", "error", "seed"]


@dataclass(frozen=True)
class Earlier:
    """An earlier row that may answer a request of this shard: its index entry, its columns, where from."""

    cand: Candidate
    row: dict[str, Any]
    origin: str  # "gen_key/shard"


def reuse(work: ShardWork, journal: Journal | None, index: RowIndex | None = None) -> int:
    """Take every row an earlier build generated for the request this one would send (see rowindex);
    returns how many (continuations not counted: the engine finishes them). ``journal`` None counts
    only (``plan``, with its read-only ``index``); the shard's conversations take the rows either way."""
    sp = work.plan.sources[work.source]
    pending = [c.key for c in work.pending() if not c.turns]
    if not pending:
        return 0
    count = 0
    with _index(work, index) as index:
        found = index.lookup(sp.reuse_key, pending, sp.spec.sampling.max_new_tokens)
        for pair, earlier in _earlier_rows(work.plan.config.store, index, found, _COLUMNS):
            conv = work.convs[pair]
            for old in earlier:
                use = _answers(work, conv, old)
                if use is None:
                    continue
                if use not in ("continue", "regenerate"):
                    count += 1
                    if journal is not None:
                        journal.append(journal_row(conv, conv.turns[-1]))
                break
    return _synced(work, journal, count, "rows")


def _answers(work: ShardWork, conv: Conversation, old: Earlier) -> str | None:
    """Apply ``old`` to ``conv`` if it answers the request this build sends for it: whole, cut to the
    budget, or as a prefix the engine continues; None (nothing applied) when it does not."""
    row = old.row
    ids = work.renderer.next_context(conv)
    attempt = _attempt(work, conv, old)
    if ids != row["prompt_ids"] or attempt is None:
        return None  # rendered or seeded otherwise: another request
    if attempt < conv.attempt:
        return None  # an attempt this shard's journal already rejected (replay): the row is past it
    budget = work.budget(len(ids))
    if not fits_context(len(ids), budget, work.context) or work.plan.config.trainer.leaves_too_little(budget):
        return None  # a fresh build skips it, so reuse does too (next_requests records the skip)
    use = old.cand.use_for(budget)
    across = old.cand.generation_key != work.plan.sources[work.source].generation_key
    output = list(row["output_ids"])
    used = output if use != "cut" else output[:budget]
    if not stops_alike(work, used, row["stop_token_id"] if use == "whole" else None):
        return None  # under today's stop ids the engine would have stopped elsewhere
    if work.stop_loops is not None and (end := loops.loop_end(used, work.stop_loops)) is not None:
        use, used = "loop", used[:end]  # this build's engine stops it there: that is the row it would write
    conv.attempt = attempt
    if use == "continue":
        conv.prefix, conv.prefix_from, conv.prefix_across = output, old.origin, across  # the engine adds the rest
        return use
    if use == "loop":
        result = Result(conv.prompt_id, conv.sample_idx, used, R.FINISH_LOOP)
    elif use == "whole":
        result = Result(conv.prompt_id, conv.sample_idx, output, R.FINISH_STOP, row["stop_token_id"])
    else:  # a prefix of a longer sample is this budget's truncated sample (or window's)
        result = Result(conv.prompt_id, conv.sample_idx, used, work.ran_out(budget))
    turn = apply_result(conv, ids, result)
    turn.reused_from, turn.across = old.origin, across
    if work.retry(conv):
        return "regenerate"  # degenerate under this build's policy: its next attempt is generated
    return use


def _attempt(work: ShardWork, conv: Conversation, old: Earlier) -> int | None:
    """Which attempt of this row's request ``old`` answers: 0 for its first seed; a later attempt's
    (degenerate policy regenerate) only from a generation under the same settings, which judged the
    attempts before it as this build does; None for another seed."""
    seed = work.spec.sampling.seed
    if old.row["seed"] == row_seed(seed, conv.prompt_id, conv.sample_idx):
        return 0
    if old.cand.generation_key != work.plan.sources[work.source].generation_key:
        return None
    retries = work.plan.config.degenerate.retries
    later = (
        k for k in range(1, retries + 1) if old.row["seed"] == row_seed(seed, conv.prompt_id, conv.sample_idx, 0, k)
    )
    return next(later, None)


def stops_alike(work: ShardWork, output: list[int], stop: int | None) -> bool:
    """Whether an answer is what the engine returns under this build's stop ids: it holds none of them
    before its end, and the one it stopped on (if it stopped) is one of them."""
    stops = work.stop_ids
    return not any(t in stops for t in output) and (stop is None or stop in stops)


def reuse_conversations(work: ShardWork, journal: Journal | None, index: RowIndex | None = None) -> int:
    """Take every ``turns: all`` row an earlier build generated for the same requests, turn by turn from
    the first while each turn's request is this build's (its prompt on the history, its seed, its
    budget, its answer under today's stop ids); the rest is generated. Returns the rows taken;
    ``journal`` None counts only."""
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

    with _index(work, index) as index:
        found = index.lookup(sp.conversation_reuse_key, pending, sp.spec.sampling.max_new_tokens)
        for pair, earlier in _earlier_rows(store, index, found, _TURN_COLUMNS):
            conv = work.convs[pair]
            for old in earlier:
                if conv.tools and tool_settings(old.cand.gen_key) != sp.gen_components.get(keys.TOOL_CALLS):
                    continue  # where a tool conversation went on was decided otherwise
                if old.row["seed"] != row_seed(sp.spec.sampling.seed, conv.prompt_id, conv.sample_idx):
                    continue
                if _replay_turns(work, conv, old, journal):
                    count += 1
                    break
    return _synced(work, journal, count, "conversations")


def _synced(work: ShardWork, journal: Journal | None, count: int, what: str) -> int:
    """Sync what a reuse pass journaled (None: it only counted) and say how much it took."""
    if journal is not None:
        journal.sync()
        if count:
            log.info("%s: %d %s reused from earlier completions", work.label, count, what)
    return count


@contextlib.contextmanager
def _index(work: ShardWork, index: RowIndex | None) -> Iterator[RowIndex]:
    """The caller's index (``plan``'s, read-only), else the store's, as a job opens it (the build's start
    synced it with the store)."""
    if index is not None:
        yield index
        return
    with RowIndex.open(work.plan.config.store, sync=None) as opened:
        yield opened


def _replay_turns(work: ShardWork, conv: Conversation, old: Earlier, journal: Journal | None) -> bool:
    """Apply ``old``'s turns to ``conv`` while each answers this build's request; True if any did."""
    turns = old.row["turns"] or []
    across = old.cand.generation_key != work.plan.sources[work.source].generation_key
    for k, (turn, prompt) in enumerate(zip(turns, _whole_prompts(old.row), strict=True)):
        try:
            ids = work.renderer.next_context(conv)
        except Exception:  # the template refuses it now: next_requests records that as a fresh build does
            break
        if conv.request_ids(ids) != prompt:
            break  # rendered differently: generate from here
        finish = _finish_under(work, turn, len(prompt))
        if finish is None:
            break  # under this build's budget or stop ids the engine answers otherwise
        last = k == len(turns) - 1
        result = Result(
            conv.prompt_id,
            conv.sample_idx,
            turn["output_ids"],
            finish,
            turn["stop_token_id"],
            old.row["error"] if last and finish != R.FINISH_STOP else None,
        )
        applied = work.apply(conv, ids, result)
        applied.reused_from, applied.across = (old.origin, across) if k == 0 else (None, False)
        if journal is not None:
            journal.append(journal_row(conv, applied))
    return bool(conv.turns)


def _finish_under(work: ShardWork, turn: dict[str, Any], prompt_tokens: int) -> str | None:
    """How an earlier turn ends under this build's budget and stop ids, if the engine would answer it the
    same: one that stopped, within the budget; one that ran out, at exactly the budget; else None."""
    budget, n = work.budget(prompt_tokens), len(turn["output_ids"])
    stopped = turn["finish_reason"] == R.FINISH_STOP
    if not stops_alike(work, turn["output_ids"], turn["stop_token_id"] if stopped else None):
        return None
    if stopped:
        return R.FINISH_STOP if n + 1 <= budget else None
    return work.ran_out(budget) if n == budget else None


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
    store: Path, index: RowIndex, found: dict[tuple[str, int], list[Candidate]], columns: list[str]
) -> Iterator[tuple[tuple[str, int], list[Earlier]]]:
    """Each wanted pair with its earlier rows' ``columns``, the best first, read a shard at a time; a shard
    the index names but that cannot be read is dropped from the index (the rows are generated instead)."""
    by_file: dict[str, list[Candidate]] = {}
    for cands in found.values():
        for cand in cands:
            by_file.setdefault(cand.path, []).append(cand)
    rows: dict[Candidate, Earlier] = {}
    for path, cands in by_file.items():
        for cand, row in _read(store, index, path, cands, columns):
            rows[cand] = Earlier(cand, row, f"{Path(path).parent.name}/{Path(path).stem}")
    for pair, cands in found.items():
        yield pair, [rows[c] for c in cands if c in rows]


def _read(
    store: Path, index: RowIndex, path: str, cands: Iterable[Candidate], columns: list[str]
) -> list[tuple[Candidate, dict[str, Any]]]:
    cands = list(cands)
    try:
        table = pq.read_table(store / path, columns=columns)
        rows = table.take(pa.array([c.row for c in cands], type=pa.int64())).to_pylist()
    except (OSError, pa.ArrowException, IndexError) as e:
        log.warning("index points at unreadable %s (%s): dropping its entries", store / path, e)
        if not index.read_only:
            index.remove_shard(store / path)
        return []
    return list(zip(cands, rows, strict=True))
