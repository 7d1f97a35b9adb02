"""Decontamination: prompts that share a run of ``ngram`` words with a benchmark item are dropped.

The reference sets (``decontaminate.references``) are read like sources, from local files or a pinned
hub dataset; each item's text is one column, a string or a list of strings (MT-Bench's turns). Words
are normalised as for near-duplicates (:mod:`dflash_build.stages.common.words`). An item shorter than ``ngram`` words
has no such run and cannot be matched: the index counts those, and the prompt manifest reports them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_build import readers
from dflash_build.spec import DecontaminationSpec, ReferenceSpec
from dflash_build.stages.common import words as W

NO_ITEM = -1


class ReferenceError(ValueError):
    """A reference set that cannot be read as configured; the message names the file, row and key."""


@dataclass
class ReferenceIndex:
    """The n-gram hashes of every reference item, sorted, each with the item it came from."""

    ngram: int
    hashes: np.ndarray  # uint64, ascending
    item_of: np.ndarray  # int32: index into ``items`` (the smallest, where items share an n-gram)
    items: list[str] = field(default_factory=list)  # each item as "set:location"
    summary: dict[str, dict[str, int]] = field(default_factory=dict)  # per set: items, too short to match
    _top_bits: np.ndarray | None = None  # see _table
    _shift: int = 48

    def _table(self) -> tuple[np.ndarray, np.uint64]:
        """Whether any reference n-gram has these top bits: 16 table slots per n-gram (so about one
        n-gram in 16 passes on to the search), at least 2^16 and at most 2^24 slots (cache-sized)."""
        if self._top_bits is None:
            bits = min(24, max(16, len(self.hashes).bit_length() + 4))
            self._shift = 64 - bits
            self._top_bits = np.zeros(1 << bits, dtype=bool)
            self._top_bits[self.hashes >> self._shift] = True
        return self._top_bits, np.uint64(self._shift)

    @classmethod
    def build(cls, spec: DecontaminationSpec, files: dict[str, tuple[Path, ...]]) -> ReferenceIndex:
        items: list[str] = []
        texts: list[str] = []
        item_of_text: list[int] = []
        spans: dict[str, tuple[int, int]] = {}  # each set's items: items[first:end]
        for name, ref in sorted(spec.references.items()):
            first = len(items)
            for location, value in reference_items(ref, files.get(name, ())):
                for text in value:
                    texts.append(text)
                    item_of_text.append(len(items))
                items.append(f"{name}:{location}")
            spans[name] = (first, len(items))
        found = W.words(pa.array(texts, pa.large_string()))
        hashes, text_of = found.ngrams(spec.ngram, whole_if_shorter=False)
        item_of = np.asarray(item_of_text, dtype=np.int32)[text_of] if len(text_of) else np.zeros(0, np.int32)
        matchable = np.zeros(len(items), dtype=bool)
        matchable[item_of] = True
        summary = {
            name: {"items": end - first, "too_short": int((~matchable[first:end]).sum())}
            for name, (first, end) in spans.items()
        }
        order = np.lexsort((item_of, hashes))
        hashes, item_of = hashes[order], item_of[order]
        first_of_hash = np.ones(len(hashes), dtype=bool)
        first_of_hash[1:] = hashes[1:] != hashes[:-1]
        return cls(spec.ngram, hashes[first_of_hash], item_of[first_of_hash], items, summary)

    def matches(self, row_of_text: np.ndarray, found: W.Words, n_rows: int) -> np.ndarray:
        """For each row, the first reference item (int32 index) one of its texts shares an n-gram
        with, or NO_ITEM. ``found``: the words of the texts; ``row_of_text``: each text's row."""
        matched = np.full(n_rows, NO_ITEM, dtype=np.int32)
        if not len(self.hashes) or not len(found.hashes):
            return matched
        hashes, text_of = found.ngrams(self.ngram, whole_if_shorter=False)
        # a table lookup first: only the few n-grams whose top bits a reference n-gram has are searched
        table, shift = self._table()
        maybe = np.flatnonzero(table[hashes >> shift])
        at = np.minimum(np.searchsorted(self.hashes, hashes[maybe]), len(self.hashes) - 1)
        hit = self.hashes[at] == hashes[maybe]
        if hit.any():
            rows = row_of_text[text_of[maybe[hit]]]
            items = self.item_of[at[hit]]
            first = np.full(n_rows, np.iinfo(np.int32).max, dtype=np.int64)
            np.minimum.at(first, rows, items)
            hit_rows = first < np.iinfo(np.int32).max
            matched[hit_rows] = first[hit_rows]
        return matched


def reference_items(ref: ReferenceSpec, files: tuple[Path, ...]) -> Iterator[tuple[str, list[str]]]:
    """(location, texts) of every item of a reference set."""
    key = f"decontaminate.references.{ref.name}.field"
    if ref.hf is not None:
        import datasets

        hf = ref.hf
        rows = datasets.load_dataset(
            hf.path, hf.name, split=hf.split, revision=None if hf.is_local else hf.revision, data_files=hf.data_files
        )
        for i, row in enumerate(rows):
            where = f"{hf.path}[{hf.split}]#{i}"
            yield where, _texts(row, ref.field, where, key)
        return
    for path in files:
        for where, row in _local_rows(path):
            yield where, _texts(row, ref.field, where, key)


def _local_rows(path: Path) -> Iterator[tuple[str, Any]]:
    if path.suffix == ".parquet":
        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}:row {i}", row
    elif path.suffix == ".jsonl":
        with open(path, "rb") as f:
            for i, line in enumerate(f, 1):  # line numbers, as prepare's locations
                value = readers.parse_jsonl_line(line)
                if value is readers.BLANK:
                    continue
                if isinstance(value, readers.InvalidJson | readers.InvalidUtf8):
                    raise ReferenceError(f"{path}:{i}: not a JSON object ({value.detail})")
                yield f"{path}:{i}", value
    else:
        for i, row in enumerate(readers.load_json(path)):
            yield f"{path}:item {i}", row


def _texts(row: Any, column: str, where: str, key: str) -> list[str]:
    value = row.get(column) if isinstance(row, dict) else None
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    found = f"columns: {', '.join(sorted(row))}" if isinstance(row, dict) else f"a {type(row).__name__}"
    raise ReferenceError(f"{where}: no text in column '{column}' ({key}; the row has {found})")
