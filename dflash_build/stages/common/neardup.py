"""Near-duplicate prompts: MinHash signatures (rensa) cut into LSH bands, and the rule of which copy stays.

A prompt's set is its word ``ngram``-shingles (:mod:`dflash_build.stages.common.words`, every message but the
answers; a prompt shorter than ``ngram`` words is one shingle). Its MinHash signature of ``num_perm``
values is cut into ``bands`` bands of ``rows`` values, chosen for ``threshold`` as LSH does (the
split that minimises false positives plus false negatives around it); two prompts are near-copies
when a whole band of theirs agrees, so pairs at the threshold are caught about half of the time, at
0.1 above it nearly always, and at 0.1 below it seldom (:func:`dflash_build.lsh.catch_probability`).

The rule, the same in any input order: a prompt is dropped when a near-copy of it comes first, by
prompt id within a source (prepare) or by source priority and then prompt id across sources (mix). So
no two prompts that stay are near-copies, and every dropped prompt names a near-copy that comes before
it. Memory: the band keys, ``8 × bands`` bytes a prompt, and one sort of them at a time.
"""

from __future__ import annotations

import array
import gc
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import rensa

from dflash_build import hashing, lsh
from dflash_build.spec import NearSpec
from dflash_build.stages.common import words as W
from dflash_build.store import atomic

NO_MATCH = np.iinfo(np.uint64).max
_BAND_SALT = np.uint64(0xD1B54A32D192ED03)
_BAND_MULTIPLIER = np.uint64(0x9FB21C651E98DF25)


def band_keys(row_of_text: np.ndarray, found: W.Words, n_rows: int, spec: NearSpec) -> tuple[np.ndarray, np.ndarray]:
    """(band keys, shape (n_rows, bands), uint64; whether each row has a word at all).

    ``found``: the words of texts, ``row_of_text`` the row (0 ≤ row < n_rows) each text belongs to,
    ascending. A row without words has no set to compare: its keys mean nothing and it is never a copy.
    """
    bands, rows = lsh.bands_rows(spec)
    shingles, text_of = found.ngrams(spec.ngram, whole_if_shorter=True)
    row_of = row_of_text[text_of]
    counts = np.bincount(row_of, minlength=n_rows)
    offsets = np.zeros(n_rows + 1, dtype=np.uint64)
    np.cumsum(counts, out=offsets[1:])
    has_words = counts > 0
    if not len(shingles):
        return np.zeros((n_rows, bands), dtype=np.uint64), has_words
    width = bands * rows  # the permutations the bands use (rensa's first k of more are not these k)
    matrix = rensa.RMinHash.digest_matrix_from_flat_token_hashes(shingles, offsets, width, spec.seed)
    digest = _values(matrix, n_rows * width).reshape(n_rows, bands, rows)
    # a band's key: its values as one polynomial (mod 2^64), salted by the band, then mixed
    with np.errstate(over="ignore"):
        keys = (digest * _band_powers(rows)).sum(axis=2, dtype=np.uint64)
        keys ^= np.arange(bands, dtype=np.uint64) * _BAND_SALT
    return hashing.splitmix64(keys), has_words


def _band_powers(rows: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.cumprod(np.full(rows, _BAND_MULTIPLIER, dtype=np.uint64), dtype=np.uint64)


def _values(matrix: Any, count: int) -> np.ndarray:
    """A rensa digest matrix's values, row after row, as uint64. rensa 0.5 hands them out as Python
    lists only (:mod:`bench.dedup` measures what that costs): the collector is paused meanwhile, since
    lists of fresh ints would start it over and over."""
    paused = gc.isenabled()
    gc.disable()
    try:
        values = array.array("I", itertools.chain.from_iterable(matrix.to_rows()))
    finally:
        if paused:
            gc.enable()
    if len(values) != count:
        raise RuntimeError(f"rensa returned {len(values)} digest values, not {count}")
    return np.frombuffer(values, dtype=np.uint32).astype(np.uint64)


def first_copies(order: np.ndarray, keys: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """For each row, the smallest ``order`` (unique uint64 values: which copy comes first) among the
    rows it shares a band with, when that is smaller than its own; else :data:`NO_MATCH`.

    ``keys``: (rows, bands) band keys; ``rows``: the rows of ``keys`` that ``order`` is for (all when
    None), read one band at a time (no copy of the whole index). A row is a dropped near-copy exactly
    when its value is not NO_MATCH, and the value names the copy it matched."""
    order = np.asarray(order, dtype=np.uint64)
    matched = np.full(len(order), NO_MATCH, dtype=np.uint64)
    if not len(order):
        return matched
    for band in range(keys.shape[1]):
        column = keys[:, band] if rows is None else keys[rows, band]
        by_key = np.argsort(column)  # one key: ties (the copies) are ordered by the group's minimum below
        ordered = column[by_key]
        new_group = np.ones(len(ordered), dtype=bool)
        new_group[1:] = ordered[1:] != ordered[:-1]
        starts = np.flatnonzero(new_group)
        if len(starts) == len(ordered):
            continue  # no two rows share this band
        order_by_key = order[by_key]
        first = np.minimum.reduceat(order_by_key, starts)  # each group's smallest order
        group_first = first[np.cumsum(new_group) - 1]
        candidate = np.where(group_first < order_by_key, group_first, NO_MATCH)
        matched[by_key] = np.minimum(matched[by_key], candidate)
    return matched


def write_bands(path: Path, pids: Any, bands: Any) -> None:
    """The selected prompts' band keys, for the mix's comparison across sources."""
    table = pa.table(
        {
            "prompt_id": pa.array(pids, pa.uint64()),
            "bands": pa.FixedSizeListArray.from_arrays(
                pa.array(np.ascontiguousarray(bands).reshape(-1), pa.uint64()), bands.shape[1]
            ),
        }
    )
    atomic.write_parquet(path, table, dictionary=False, statistics=["prompt_id"])


def read_bands(path: Path) -> tuple[Any, Any]:
    """(prompt ids as uint64, band keys (prompts, bands)) written by :func:`write_bands`."""
    table = pq.read_table(path)
    column = table.column("bands").combine_chunks()
    width = column.type.list_size
    keys = column.flatten().to_numpy().reshape(-1, width) if len(column) else np.zeros((0, width), np.uint64)
    return table.column("prompt_id").to_numpy(), keys
