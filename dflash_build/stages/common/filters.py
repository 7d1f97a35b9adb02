"""Prepare's text filters after exact dedup: decontamination, then near-duplicates (dedup.near).

Prepare's scan hands each batch's prompt texts here (every message but the answers, with the row
each belongs to); this keeps, per converted row, 4 bytes (the reference item it matched), the band
keys (8 bytes a band) and whether it has a word (1 byte). Selection then drops, among the exact-dedup
winners in prompt id order, the contaminated rows and then every row whose near-copy has a smaller
prompt id, before max_samples: so max_samples still keeps as many as it can, and a contaminated row
never wins over its clean near-copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from dflash_build import lsh
from dflash_build.spec import NearSpec
from dflash_build.stages.common import neardup, words
from dflash_build.stages.common.decontaminate import NO_ITEM, ReferenceIndex

DROP_CONTAMINATED = "contaminated"
DROP_NEAR_DUPLICATE = "near_duplicate"


@dataclass
class Example:
    """A dropped row by prompt id; prepare fills in the locations when it writes the shards."""

    reason: str
    pid: int
    matched_pid: int | None = None  # near_duplicate: the copy that stays
    detail: str = ""  # contaminated: the reference item


@dataclass
class Filtered:
    rows: np.ndarray  # the rows that stay, in prompt id order
    counts: dict[str, int] = field(default_factory=dict)
    examples: list[Example] = field(default_factory=list)


class TextFilters:
    def __init__(self, near: NearSpec | None, references: ReferenceIndex | None) -> None:
        self.near, self.references = near, references
        # grown in place, batch by batch (a list of arrays would be copied whole to join them)
        self._items = bytearray()  # int32 a row
        self._bands = bytearray()  # uint64 × bands a row
        self._has_words = bytearray()  # bool a row

    @property
    def active(self) -> bool:
        return self.near is not None or self.references is not None

    def add(self, row_of_text: np.ndarray, texts: pa.Array, n_rows: int) -> None:
        """The texts of ``n_rows`` more converted rows (in the order their prompt ids were added)."""
        found = words.words(texts)  # once for both filters: the same normalisation
        if self.references is not None:
            self._items += self.references.matches(row_of_text, found, n_rows).tobytes()
        if self.near is not None:
            keys, has_words = neardup.band_keys(row_of_text, found, n_rows, self.near)
            self._bands += keys.tobytes()
            self._has_words += has_words.tobytes()

    def apply(self, rows: np.ndarray, pids: np.ndarray, examples: int) -> Filtered:
        """Of ``rows`` (indices of converted rows, by prompt id ascending; ``pids`` of every row), those
        that stay; up to ``examples`` examples per reason."""
        out = Filtered(rows)
        if self.references is not None:
            items = np.frombuffer(self._items, dtype=np.int32)[rows]
            hit = items != NO_ITEM
            out.counts[DROP_CONTAMINATED] = int(hit.sum())
            for i in np.flatnonzero(hit)[:examples]:
                detail = f"shares {self.references.ngram} words with {self.references.items[int(items[i])]}"
                out.examples.append(Example(DROP_CONTAMINATED, int(pids[rows[i]]), detail=detail))
            out.rows = rows = rows[~hit]
        if self.near is not None:
            at = np.flatnonzero(np.frombuffer(self._has_words, dtype=bool)[rows])  # rows with a set to compare
            matched = neardup.first_copies(pids[rows[at]], self._keys(), rows[at])
            copies = matched != neardup.NO_MATCH
            out.counts[DROP_NEAR_DUPLICATE] = int(copies.sum())
            for i in np.flatnonzero(copies)[:examples]:
                out.examples.append(Example(DROP_NEAR_DUPLICATE, int(pids[rows[at[i]]]), int(matched[i])))
            keep = np.ones(len(rows), dtype=bool)
            keep[at[copies]] = False
            out.rows = rows[keep]  # still in prompt id order
        out.counts = {k: v for k, v in out.counts.items() if v}
        return out

    def _keys(self) -> np.ndarray:
        assert self.near is not None
        return np.frombuffer(self._bands, dtype=np.uint64).reshape(-1, lsh.bands_rows(self.near)[0])

    def bands(self, rows: np.ndarray) -> np.ndarray:
        """The band keys of these converted rows: (rows, bands) uint64."""
        return self._keys()[rows]
