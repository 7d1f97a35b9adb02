"""Writing a source's prompt shards: the spill read back bucket by bucket, each shard written (atomically)
as soon as its rows are all there, and the duplicates' and filters' examples located on the way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from dflash_build import hashing
from dflash_build.stages.prepare.drops import DROP_DUPLICATE, EXAMPLES_PER_REASON
from dflash_build.stages.prepare.selection import Selection, record_examples, sorted_by
from dflash_build.stages.prepare.spill import SPILL_SCHEMA, Spill
from dflash_build.store import atomic, layout
from dflash_build.store.records import PROMPT_SCHEMA


def write_shards(selection: Selection, spill: Spill, out_dir: Path) -> dict[str, dict[str, int | str]]:
    """Read the spill back bucket by bucket and write each shard as soon as its rows are all there."""
    bounds = iter(zip(selection.shard_names, selection.bounds(), strict=True))
    name, (lo, hi) = next(bounds)
    written: dict[str, dict[str, int | str]] = {}
    pending: list[pa.Table] = []
    have = 0

    def flush_full() -> None:
        nonlocal name, lo, hi, pending, have
        while have >= hi - lo:
            table = pa.concat_tables(pending) if pending else SPILL_SCHEMA.empty_table()
            shard, rest = table.slice(0, hi - lo), table.slice(hi - lo)
            written[name] = atomic.write_parquet(
                layout.shard_file(out_dir, name),
                shard.select(PROMPT_SCHEMA.names),
                ["source", "category"],
                ["prompt_id"],
            )
            # a slice, not a copy: it holds the buffers of this bucket and at most one shard before it
            pending, have = ([rest] if rest.num_rows else []), rest.num_rows
            step = next(bounds, None)
            if step is None:
                return
            name, (lo, hi) = step

    flush_full()  # leading empty shards, when there are more shards than rows
    wanted = _example_ids(selection)
    held: list[pa.Table] = []
    for table in spill.tables():
        if wanted:
            _locate(table, wanted)
        if selection.held_out is not None and len(selection.held_out):
            held.append(_in_order(table, selection.held_out).select(PROMPT_SCHEMA.names))
        kept = _selected_in_order(table, selection)
        if kept.num_rows:
            pending.append(kept)
            have += kept.num_rows
            flush_full()
        del table, kept
    if len(written) != len(selection.shard_names):
        raise RuntimeError(f"prepare wrote {len(written)} of {len(selection.shard_names)} shards; this is a bug")
    record_examples(selection, {pid: where for pid, where in wanted.items() if where is not None})
    if selection.held_out is not None:
        rows = pa.concat_tables(held) if held else PROMPT_SCHEMA.empty_table()
        atomic.write_parquet(out_dir / layout.HELD_OUT, rows, ["source", "category"], ["prompt_id"])
    return written


def _in_order(bucket: pa.Table, ids: Any) -> pa.Table:
    """A bucket's rows whose prompt id is in ``ids`` (uint64, ascending), once each, by prompt id."""
    order, row_ids, keep, _ = _first_of_each_id(bucket)
    return bucket.take(pa.array(order[keep & np.isin(row_ids, ids)]))


def _first_of_each_id(bucket: pa.Table) -> tuple[Any, Any, Any, Any]:
    """(order, the ids in that order, which rows are the first of their id, which repeat the id before):
    a bucket's rows by prompt id, each id's first the one with the smallest meta."""
    ids = hashing.hex_to_u64(bucket.column("prompt_id"))
    meta = bucket.column("meta")
    order, repeat = sorted_by(ids, lambda rows: _id_meta_order(ids[rows], meta.take(pa.array(rows))))
    keep = np.ones(len(order), dtype=bool)
    keep[1:] = ~repeat
    return order, ids[order], keep, repeat


def _example_ids(selection: Selection) -> dict[int, str | None]:
    """The prompt ids whose locations the filter examples name (None until found)."""
    ids = [e.pid for e in selection.examples] + [e.matched_pid for e in selection.examples if e.matched_pid is not None]
    return dict.fromkeys(ids)


def _locate(bucket: pa.Table, wanted: dict[int, str | None]) -> None:
    ids = hashing.hex_to_u64(bucket.column("prompt_id"))
    for i in np.flatnonzero(np.isin(ids, np.fromiter(wanted, dtype=np.uint64, count=len(wanted)))):
        pid = int(ids[i])
        if wanted[pid] is None:  # a repeated row: the first one found stands for it
            wanted[pid] = bucket.column("location")[int(i)].as_py()


def _selected_in_order(bucket: pa.Table, selection: Selection) -> pa.Table:
    """A bucket's rows that become prompts, by prompt id: each id once (of rows repeated in the input,
    the one with the smallest meta), and only the selected ids."""
    order, ids, keep, repeat = _first_of_each_id(bucket)
    at = np.searchsorted(selection.selected, ids)
    inside = at < len(selection.selected)
    keep &= inside
    keep[inside] &= selection.selected[at[inside]] == ids[inside]
    _duplicate_examples(selection, bucket.column("location"), order, ids, keep, repeat)
    return bucket.take(pa.array(order[keep]))


def _id_meta_order(ids: Any, meta: pa.Array) -> Any:
    import pyarrow.compute as pc

    keys = pa.table({"id": ids, "meta": meta})
    return pc.sort_indices(keys, [("id", "ascending"), ("meta", "ascending")]).to_numpy()


def _duplicate_examples(
    selection: Selection, locations: pa.ChunkedArray, order: Any, ids: Any, keep: Any, repeat: Any
) -> None:
    """Note where dropped duplicates came from: rows (``order``, sorted ``ids``; ``repeat``: each but the
    first repeats the id before) not kept whose id is no group's smallest, or repeats an id just kept
    (the rest that is not kept went over max_samples)."""
    examples = selection.drops.examples[DROP_DUPLICATE]
    if len(examples) >= EXAMPLES_PER_REASON or DROP_DUPLICATE not in selection.drops.counts:
        return
    at = np.minimum(np.searchsorted(selection.winners, ids), max(len(selection.winners) - 1, 0))
    is_winner = selection.winners[at] == ids if len(selection.winners) else np.zeros(len(ids), dtype=bool)
    repeats = np.zeros(len(ids), dtype=bool)
    repeats[1:] = repeat
    for i in np.flatnonzero(~keep & (~is_winner | repeats))[: EXAMPLES_PER_REASON - len(examples)]:
        examples.append(locations[int(order[i])].as_py())
