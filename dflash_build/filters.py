"""Prepare's text filters after exact dedup: decontamination, then near-duplicates (dedup.near).

Prepare's scan hands each batch's prompt texts here (every message but the answers, with the row each
belongs to); this keeps, per converted row, 4 bytes (the reference item it matched) and the band keys
(8 bytes a band). Selection then drops, among the exact-dedup winners in prompt id order, the
contaminated rows and then every row whose near-copy has a smaller prompt id, before max_samples: so
max_samples still keeps as many as it can, and a contaminated row never wins over its clean near-copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from dflash_build import neardup, words
from dflash_build.decontaminate import NO_ITEM, ReferenceIndex
from dflash_build.neardup import NearSpec

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
        self._items: list[np.ndarray] = []
        self._bands: list[np.ndarray] = []
        self._has_words: list[np.ndarray] = []
        self._all_bands: np.ndarray | None = None  # the batches' keys joined, once selection reads them

    @property
    def active(self) -> bool:
        return self.near is not None or self.references is not None

    def add(self, row_of_text: np.ndarray, texts: pa.Array, n_rows: int) -> None:
        """The texts of ``n_rows`` more converted rows (in the order their prompt ids were added)."""
        found = words.words(texts)  # once for both filters: the same normalisation
        if self.references is not None:
            self._items.append(self.references.matches(row_of_text, found, n_rows))
        if self.near is not None:
            keys, has_words = neardup.band_keys(row_of_text, found, n_rows, self.near)
            self._bands.append(keys)
            self._has_words.append(has_words)

    def apply(self, rows: np.ndarray, pids: np.ndarray, examples: int) -> Filtered:
        """Of ``rows`` (indices of converted rows, by prompt id ascending; ``pids`` of every row), those
        that stay; up to ``examples`` examples per reason."""
        out = Filtered(rows)
        if self.references is not None:
            items = np.concatenate(self._items)[rows]
            hit = items != NO_ITEM
            out.counts[DROP_CONTAMINATED] = int(hit.sum())
            for i in np.flatnonzero(hit)[:examples]:
                detail = f"shares {self.references.ngram} words with {self.references.items[int(items[i])]}"
                out.examples.append(Example(DROP_CONTAMINATED, int(pids[rows[i]]), detail=detail))
            out.rows = rows = rows[~hit]
        if self.near is not None:
            comparable = rows[np.concatenate(self._has_words)[rows]]
            matched = neardup.first_copies(pids[comparable], self.bands(comparable))
            copies = matched != neardup.NO_MATCH
            out.counts[DROP_NEAR_DUPLICATE] = int(copies.sum())
            for i in np.flatnonzero(copies)[:examples]:
                out.examples.append(Example(DROP_NEAR_DUPLICATE, int(pids[comparable[i]]), int(matched[i])))
            out.rows = np.setdiff1d(rows, comparable[copies], assume_unique=True)
            out.rows = out.rows[np.argsort(pids[out.rows], kind="stable")]
        out.counts = {k: v for k, v in out.counts.items() if v}
        return out

    def bands(self, rows: np.ndarray) -> np.ndarray:
        """The band keys of these converted rows: (rows, bands) uint64."""
        if self._all_bands is None:
            self._all_bands = np.concatenate(self._bands)
            self._bands = []
        return self._all_bands[rows]
