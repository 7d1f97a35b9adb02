"""Which rows of a source become prompts: every row converted once (columns where they are plain,
else the row path), spilled, and selected on its digests: exact dedup, the language list, the text
filters (near-dup, decontamination, lengths), then ``max_samples`` by seeded rank."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from dflash_build import language
from dflash_build.inputs import to_prompt
from dflash_build.inputs.rows import role_map, row_template_kwargs
from dflash_build.plan import Plan, SourcePlan
from dflash_build.spec import SourceSpec
from dflash_build.stages.common.decontaminate import ReferenceIndex
from dflash_build.stages.common.filters import Example, TextFilters
from dflash_build.stages.prepare import columnar
from dflash_build.stages.prepare.drops import (
    DROP_DUPLICATE,
    DROP_HELD_OUT,
    DROP_LANGUAGE,
    DROP_OTHER_VARIANT,
    DROP_OVER_MAX_SAMPLES,
    EXAMPLES_PER_REASON,
    Drop,
    DropCounter,
)
from dflash_build.stages.prepare.identity import (
    dedup_key,
    drawn_variant,
    held_out,
    prompt_id,
    selection_ranks,
    shard_bounds,
)
from dflash_build.stages.prepare.read import RowBatch, batches
from dflash_build.stages.prepare.spill import SPILL_SCHEMA, Spill

_RECORD_JSON = json.JSONEncoder(ensure_ascii=False)  # = json.dumps(x, ensure_ascii=False), one encoder
_META_JSON = json.JSONEncoder(sort_keys=True)


@dataclass
class Selection:
    """What prepare keeps of one source: the selected prompt ids in order, and the accounting.

    ``selected`` holds the prompt ids (as 64-bit integers, ascending) that become prompts: one per
    group of duplicates (the smallest prompt id), then the ``max_samples`` with the smallest seeded
    rank. Shard ``i`` takes the ``i``-th contiguous run of them (:func:`shard_bounds`).
    """

    selected: Any  # numpy uint64 array
    winners: Any  # numpy uint64 array: every group's smallest prompt id (selected ⊆ winners)
    rows_in: int
    drops: DropCounter
    shard_names: list[str]
    examples: list[Example] = field(default_factory=list)  # filter drops, by prompt id until located
    bands: Any = None  # with dedup.near: the selected prompts' band keys, (selected, bands) uint64
    references: dict[str, dict[str, int]] | None = None  # with decontaminate: each reference set's items
    held_out: Any = None  # with eval: the prompt ids (uint64, ascending) of the eval split, never selected
    held_out_bands: Any = None  # with eval and dedup.near: their band keys, (held_out, bands) uint64

    @property
    def rows_out(self) -> int:
        return len(self.selected)

    def bounds(self) -> list[tuple[int, int]]:
        return shard_bounds(self.rows_out, len(self.shard_names))

    def shard_prompt_ids(self) -> dict[str, list[str]]:
        return {
            name: [f"{int(p):016x}" for p in self.selected[lo:hi]]
            for name, (lo, hi) in zip(self.shard_names, self.bounds(), strict=True)
        }


class _Scanned:
    """The digests (24 bytes a converted row, and what ``filters`` keep) and, through the spill, the
    records of a source."""

    def __init__(self, source: str, spec: SourceSpec, spill: Spill, filters: TextFilters) -> None:
        self.source, self.spec, self.spill, self.filters = source, spec, spill, filters
        self.roles = role_map(spec)
        self.dedup_digests = bytearray()  # 16 bytes per converted row
        self.pids = bytearray()  # 8 bytes per converted row, big-endian
        self.rows_in = 0
        self.drops = DropCounter()
        # with a language list: each converted row's language, as an index into language_names
        self.language_codes = bytearray()  # uint16 a row
        self.language_names: dict[str, int] = {}

    def _add_languages(self, found: list[str]) -> None:
        """The languages of the rows converted next (only with a language list: detecting costs time)."""
        codes = [self.language_names.setdefault(code, len(self.language_names)) for code in found]
        self.language_codes += np.array(codes, dtype=np.uint16).tobytes()

    def add(self, batch: RowBatch) -> None:
        self.rows_in += len(batch.numbers)
        # per-row template kwargs: the row path reads them
        columns = batch.table is not None and not self.spec.chat_template_kwargs_from
        converted = columnar.convert(batch.table, self.spec, self.roles) if columns else None
        plain = converted.plain if converted is not None else np.zeros(len(batch.numbers), dtype=bool)
        if converted is not None and plain.any():
            self._add_plain(batch, converted)
        records, pids = [], bytearray()
        found_languages: list[str] = []
        texts: list[str] = []
        text_rows: list[int] = []
        for raw in batch.raw_rows(np.flatnonzero(~plain).tolist()):
            try:
                messages, tools = to_prompt(raw.value, self.spec)
                kwargs = row_template_kwargs(raw.value, self.spec)
            except Drop as d:
                self.drops.add(d.reason, raw.location, d.detail)
                continue
            texts += [m["content"] for m in messages]
            if self.spec.languages is not None:
                found_languages.append(language.of_messages(messages))
            text_rows += [len(records)] * len(messages)
            pid = prompt_id(messages, tools, kwargs)
            self.dedup_digests += bytes.fromhex(dedup_key(messages, tools, kwargs)[:32])
            pids += bytes.fromhex(pid)
            records.append(
                {
                    "prompt_id": pid,
                    "source": self.source,
                    "category": self.spec.category,
                    "messages": _RECORD_JSON.encode(messages),
                    "tools": None if tools is None else _RECORD_JSON.encode(tools),
                    "meta": _META_JSON.encode(raw.origin),
                    "template_kwargs": None if kwargs is None else _RECORD_JSON.encode(kwargs),
                    "location": raw.location,
                }
            )
        self.pids += pids
        if self.spec.languages is not None:
            self._add_languages(found_languages)
        self.spill.add(pa.Table.from_pylist(records, schema=SPILL_SCHEMA), native_u64(pids))
        if self.filters.active:
            self.filters.add(np.array(text_rows, dtype=np.int64), pa.array(texts, pa.string()), len(records))

    def _add_plain(self, batch: RowBatch, converted: columnar.Converted) -> None:
        import pyarrow.compute as pc

        digest = np.frombuffer(columnar.digests(converted.prompt_bodies, 16), dtype=np.uint8).reshape(-1, 16).copy()
        pids = digest[:, :8].tobytes()
        if len(converted.refolded_rows):  # the rest: their prompt body's digest (dedup_key)
            refolded = np.frombuffer(columnar.digests(converted.dedup_bodies, 16), dtype=np.uint8)
            digest[converted.refolded_rows] = refolded.reshape(-1, 16)
        self.pids += pids
        self.dedup_digests += digest.tobytes()
        count = len(converted.messages)
        hex_ids = pids.hex().encode("ascii")
        ids = pa.StringArray.from_buffers(
            count, pa.py_buffer(np.arange(0, 16 * count + 1, 16, dtype=np.int32).tobytes()), pa.py_buffer(hex_ids)
        )
        numbers = pa.array(batch.numbers[converted.plain]).cast(pa.string())
        join = pc.binary_join_element_wise
        records = pa.table(
            {
                "prompt_id": ids,
                "source": pa.repeat(self.source, count).cast(pa.string()),
                "category": pa.repeat(self.spec.category, count).cast(pa.string()),
                "messages": converted.messages.cast(pa.string()),
                "tools": pa.nulls(count, pa.string()),
                "meta": join(f'{{"input": {_META_JSON.encode(batch.input)}, "row": ', numbers, "}", ""),
                "template_kwargs": pa.nulls(count, pa.string()),
                "location": join(batch.where, numbers, ""),
            },
            schema=SPILL_SCHEMA,
        )
        if self.spec.languages is not None:
            self._add_languages(language.of_messages_json(converted.messages.cast(pa.string()).to_pylist()))
        self.spill.add(records, native_u64(bytearray(pids)))
        if self.filters.active:
            self.filters.add(converted.text_rows, converted.texts, count)

    def _in_languages(self, rows: np.ndarray, pids: np.ndarray) -> tuple[np.ndarray, list[Example]]:
        """Of ``rows``, those in the source's languages (all without a list), and examples of the rest."""
        if self.spec.languages is None:
            return rows, []
        names = list(self.language_names)
        allowed = np.array([name in self.spec.languages for name in names], dtype=bool)
        codes = np.frombuffer(self.language_codes, dtype=np.uint16)[rows]
        keep = allowed[codes]
        self.drops.counts[DROP_LANGUAGE] += int((~keep).sum())
        examples = [
            Example(DROP_LANGUAGE, int(pids[rows[i]]), detail=f"language '{names[codes[i]]}'")
            for i in np.flatnonzero(~keep)[:EXAMPLES_PER_REASON]
        ]
        return rows[keep], examples

    def selection(self, shard_names: list[str]) -> Selection:
        """Dedup, then max_samples, on the digests."""
        spec, drops = self.spec, self.drops
        pid_values = native_u64(self.pids)
        winner_rows = _group_first_rows(native_u64(self.dedup_digests).reshape(-1, 2), pid_values)
        winners = pid_values[winner_rows]
        drops.counts[DROP_DUPLICATE] += len(pid_values) - len(winners)  # examples: as the shards are written
        in_language, language_examples = self._in_languages(winner_rows, pid_values)
        filtered = self.filters.apply(in_language, pid_values, EXAMPLES_PER_REASON)
        filtered.examples[:0] = language_examples
        drops.counts.update(filtered.counts)
        filtered_ids = pid_values[filtered.rows]  # ascending
        held = held_out(filtered_ids, spec.held_out)  # before max_samples: the training prompts keep their number
        kept = filtered_ids[~np.isin(filtered_ids, held)]
        drops.counts[DROP_HELD_OUT] += len(held)
        selected = kept
        if spec.max_samples is not None and len(kept) > spec.max_samples:
            ranks = native_u64(bytearray(selection_ranks(spec.seed, kept))).reshape(-1, 2)
            by_rank = np.lexsort((ranks[:, 1], ranks[:, 0]))
            over = by_rank[spec.max_samples :]
            drops.counts[DROP_OVER_MAX_SAMPLES] += len(over)
            drops.examples[DROP_OVER_MAX_SAMPLES] = [f"{int(kept[i]):016x}" for i in over[:EXAMPLES_PER_REASON]]
            selected = np.sort(kept[by_rank[: spec.max_samples]])
        selected = _drawn_to_variant(spec, selected, drops)
        if spec.drawn_share is not None:  # a variant's eval prompts are those drawn to it, as its training
            held = held[drawn_variant(held, spec.draw) == spec.variant]
        for reason in (DROP_DUPLICATE, DROP_LANGUAGE, DROP_HELD_OUT):
            if not drops.counts[reason]:
                del drops.counts[reason]
        bands = held_bands = None
        if self.filters.near is not None:  # the band keys of the selected and the held-out prompts' rows
            bands = self.filters.bands(filtered.rows[np.searchsorted(filtered_ids, selected)])
            held_bands = self.filters.bands(filtered.rows[np.searchsorted(filtered_ids, held)])
        references = self.filters.references.summary if self.filters.references is not None else None
        return Selection(
            selected, winners, self.rows_in, drops, shard_names, filtered.examples, bands, references, held, held_bands
        )


def _drawn_to_variant(spec: SourceSpec, selected: Any, drops: DropCounter) -> Any:
    """Of the parent's selection, the prompts a variant source generates: those drawn to its variant
    (all of them for a variant that takes every prompt); the rest are counted as ``other_variant``."""
    if spec.drawn_share is None:
        return selected
    mine = drawn_variant(selected, spec.draw) == spec.variant
    others = selected[~mine]
    if len(others):
        drops.counts[DROP_OTHER_VARIANT] += len(others)
        drops.examples[DROP_OTHER_VARIANT] = [f"prompt {int(p):016x}" for p in others[:EXAMPLES_PER_REASON]]
    return selected[mine]


def group_firsts(keys: Any, pids: Any) -> Any:
    """The smallest prompt id of each group of rows with equal ``keys`` (two 64-bit words a row),
    ascending."""
    return pids[_group_first_rows(keys, pids)]


def _group_first_rows(keys: Any, pids: Any) -> Any:
    """The row of :func:`group_firsts`' each prompt id, in the same order."""
    order, tied = sorted_by(keys[:, 0], lambda rows: np.lexsort((pids[rows], keys[rows, 1], keys[rows, 0])))
    starts = np.ones(len(order), dtype=bool)
    starts[1:] = ~tied
    at = np.flatnonzero(tied) + 1
    starts[at] = keys[order[at], 1] != keys[order[at - 1], 1]
    # the same prompt id is the same messages, so it is in one group only: no two firsts share one
    firsts = order[starts]
    return firsts[np.argsort(pids[firsts])]


def sorted_by(words: Any, order_of: Callable[[Any], Any]) -> tuple[Any, Any]:
    """Row order by ``words`` (64-bit integers), rows that tie on them ordered by ``order_of(rows)``
    (their order under a full key that starts with ``words``); and, for each row in that order but
    the first, whether it ties the row before on ``words``. One unstable sort of every row; only the
    tied runs (duplicates, mostly) are sorted again: a lexsort of every row on the full key costs
    ten times as much."""
    order = np.argsort(words)
    ordered = words[order]
    tied = ordered[1:] == ordered[:-1]
    in_run = np.zeros(len(order), dtype=bool)
    in_run[1:] |= tied
    in_run[:-1] |= tied
    at = np.flatnonzero(in_run)  # whole runs: sorting them again keeps each run where it is
    rows = order[at]
    order[at] = rows[order_of(rows)]
    return order, tied


def scan(plan: Plan, source: str, spill: Spill) -> Selection:
    """Read and convert every row once, spill it, and select."""
    sp: SourcePlan = plan.sources[source]
    scanned = _Scanned(source, sp.spec, spill, text_filters(plan))
    for batch in batches(plan, source):
        scanned.add(batch)
    spill.close()
    return scanned.selection(sp.shards)


def text_filters(plan: Plan) -> TextFilters:
    """The filters the config turns on: decontaminate's reference index is read once per prepare."""
    decon = plan.config.decontaminate
    references = None if decon is None else ReferenceIndex.build(decon, plan.reference_files)
    return TextFilters(plan.config.dedup.near, references)


def native_u64(big_endian: bytearray) -> Any:
    """Big-endian 64-bit words as native integers, in place (no copy of the digest set)."""
    words = np.frombuffer(big_endian, dtype=">u8")
    return words.byteswap(inplace=True).view(np.uint64) if words.dtype != np.dtype(np.uint64) else words


def select(plan: Plan, source: str) -> Selection:
    """Prepare's selection without writing anything (``dflash-build plan`` uses it): memory as prepare."""
    selection = scan(plan, source, Spill(None, 1))
    record_examples(selection, {})
    return selection


def record_examples(selection: Selection, where: dict[int, str]) -> None:
    """The filters' examples, each naming where the dropped row (and its near-copy) came from."""

    def named(pid: int) -> str:
        return where.get(pid) or f"prompt {pid:016x}"

    for e in selection.examples:
        detail = e.detail if e.matched_pid is None else f"near-copy of {named(e.matched_pid)}"
        selection.drops.examples[e.reason].append(f"{named(e.pid)}: {detail}")
