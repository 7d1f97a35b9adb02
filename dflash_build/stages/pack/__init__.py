"""Pack stage (optional): the mixed dataset → fixed-length training rows of whole samples.

A drafter trainer runs at tens of thousands of tokens per second and wastes GPU time on padding when
samples (mean ~2K tokens, long tail to the answer limit) come one per row. Each packed row holds whole
samples, back to back, with what a varlen attention kernel needs so that no sample attends to another:
``seq_lens`` (each sample's length, then the padding's), ``position_ids`` that restart at every sample,
and ``loss_mask`` 0 on padding. A sample longer than ``seq_len`` is dropped and counted, or, with
``split_long``, cut into ``seq_len`` pieces (positions continue across its pieces).

Packing (:func:`pack_lengths`): samples are put in a seeded order (a hash of seed and sample id, so the
result does not depend on file order) and cut into windows; within a window each row starts with the
longest sample left and is filled, again and again, with the longest sample that still fits. The data
is read twice: once for the lengths, once to spill each window's samples into a file of its own, so
memory holds one window, never the dataset.
"""

from __future__ import annotations

import bisect
import logging
import random
import shutil
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_build import hashing
from dflash_build.publish import release
from dflash_build.publish.card import card_header
from dflash_build.publish.files import RollingWriter
from dflash_build.publish.report import length_stats
from dflash_build.spec import PackSpec
from dflash_build.stages.common.job import Job
from dflash_build.store import atomic, layout
from dflash_build.versions import PACK_VERSION

log = logging.getLogger(__name__)

PACKED_SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("position_ids", pa.list_(pa.int32())),
        ("seq_lens", pa.list_(pa.int32())),  # samples (or pieces) in order, then the padding if any
        ("num_samples", pa.int32()),
        ("n_pad", pa.int32()),
        ("prompt_id", pa.list_(pa.string())),  # of each sample, in order
        ("sample_idx", pa.list_(pa.int32())),
        ("turn", pa.list_(pa.int32())),  # of each sample: its turn when it is one turn of a conversation
        ("category", pa.list_(pa.string())),
    ]
)


@dataclass(frozen=True)
class Piece:
    """Tokens [start, start + length) of one sample of the mixed dataset."""

    sample: int
    start: int
    length: int


def pack_lengths(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group item indices into bins of at most ``capacity`` tokens; every item fits, none is left out.

    Each bin opens with the longest item left and takes, while any fits, the longest item that fits
    the space left. Items of one length are taken in the order given.
    """
    by_length: dict[int, list[int]] = defaultdict(list)
    for index in reversed(range(len(lengths))):  # popped from the end: the given order
        if not 0 < lengths[index] <= capacity:
            raise ValueError(f"item {index} has length {lengths[index]}, not in 1..{capacity}")
        by_length[lengths[index]].append(index)
    sizes = sorted(by_length)  # the distinct lengths still available
    bins = []
    while sizes:
        items, free = [], capacity
        while True:
            at = bisect.bisect_right(sizes, free) - 1
            if at < 0:
                break
            size = sizes[at]
            stack = by_length[size]
            items.append(stack.pop())
            free -= size
            if not stack:
                del sizes[at]
        bins.append(items)
    return bins


Row = tuple[int, list[Piece]]  # (window, pieces)


def plan_rows(lengths: Sequence[int], ranks: Sequence[str], spec: PackSpec) -> tuple[list[Row], dict[str, int]]:
    """Packed rows with their window, window by window, and counts of what did not fit as it is."""
    order = sorted(range(len(lengths)), key=ranks.__getitem__)
    rows: list[Row] = []
    counts: Counter[str] = Counter()
    rng = random.Random(f"pack/{spec.seed}")
    for window, start in enumerate(range(0, len(order), spec.window)):
        pieces: list[Piece] = []
        for sample in order[start : start + spec.window]:
            n = lengths[sample]
            if n <= spec.seq_len:
                pieces.append(Piece(sample, 0, n))
            elif not spec.split_long:
                counts["dropped_long"] += 1
                counts["dropped_long_tokens"] += n
            else:
                counts["split"] += 1
                full, rest = divmod(n, spec.seq_len)
                rows.extend((window, [Piece(sample, k * spec.seq_len, spec.seq_len)]) for k in range(full))
                if rest:
                    pieces.append(Piece(sample, full * spec.seq_len, rest))
        window_rows = [[pieces[i] for i in b] for b in pack_lengths([p.length for p in pieces], spec.seq_len)]
        rng.shuffle(window_rows)  # long-first rows would otherwise come first
        rows.extend((window, row) for row in window_rows)
    return rows, dict(counts)


def pack_key(mix_manifest: dict[str, Any], spec: PackSpec) -> str:
    """What decides the packed rows: the mixed dataset's content, the pack settings, the scheme."""
    content = [f["sha256"] for f in mix_manifest["files"]]
    return hashing.digest({"mix": content, "pack": asdict(spec), "version": PACK_VERSION})[:16]


def run(job: Job) -> dict[str, Any]:
    """Pack the dataset (the job's declared input) into a new version of the packed folder, swapped in
    whole like the dataset (:mod:`dflash_build.publish.release`); the job's output is its build record."""
    cfg = job.plan.config
    assert cfg.pack is not None
    spec, rows_per_file = cfg.pack, cfg.rows_per_file
    record = job.output("record")
    out_dir = release.folder_of(record)
    dataset = release.in_place(job.published("dataset"))
    mix_manifest, files = dataset.manifest, dataset.files
    lengths, ranks = _lengths_and_ranks(files, spec.seed)
    rows, counts = plan_rows(lengths, ranks, spec)
    window_of = {piece.sample: window for window, row in rows for piece in row}
    with release.publish(out_dir, record) as tmp:
        spill = tmp / "spill"
        _spill(files, window_of, spill)
        writer = RollingWriter(tmp / "data", rows_per_file, PACKED_SCHEMA)
        fill: list[int] = []
        pad_tokens = 0
        for window, window_rows in _by_window(rows):
            table = pq.read_table(spill / f"{window:06d}.parquet")
            packed = _build(table, window_rows, spec)
            pads = packed["n_pad"].to_pylist()
            fill += [sum(n) - pad for n, pad in zip(packed["seq_lens"].to_pylist(), pads, strict=True)]
            pad_tokens += sum(pads)
            writer.write(packed)
        shutil.rmtree(spill)
        data_files = writer.close()
        real = sum(fill)
        n_rows = len(fill)
        manifest = {
            "stage": "pack",
            "scheme": PACK_VERSION,
            "pack_key": pack_key(mix_manifest, spec),
            "dataset": out_dir.name,
            "mixed_from": mix_manifest["dataset"],
            "pack": asdict(spec),
            "files": data_files,
            "rows": n_rows,
            "samples": len(lengths) - counts.get("dropped_long", 0),
            "samples_in": len(lengths),
            "dropped_long": counts.get("dropped_long", 0),
            "dropped_long_tokens": counts.get("dropped_long_tokens", 0),
            "split": counts.get("split", 0),
            "tokens": real,
            "pad_tokens": pad_tokens,
            "fill_efficiency": round(real / (n_rows * spec.seq_len), 6) if n_rows else 0.0,
            "row_tokens": length_stats(fill),
            "row_tokens_histogram": _histogram(fill, spec.seq_len),
        }
        atomic.write_json(tmp / layout.MANIFEST, manifest)
        atomic.write_text(tmp / "README.md", card(manifest))
    log.info("%s", summary(manifest, out_dir))
    return manifest


def _lengths_and_ranks(files: list[Path], seed: int) -> tuple[list[int], list[str]]:
    """Every sample's length and seeded rank (a hash of its ids: the same in any file order)."""
    ids: list[tuple[str, int, int | None]] = []
    lengths: list[int] = []
    for path in files:
        table = pq.read_table(path, columns=["prompt_id", "sample_idx", "turn", "n_tokens"])
        columns = (table[c].to_pylist() for c in ("prompt_id", "sample_idx", "turn"))
        ids += zip(*columns, strict=True)
        lengths += table["n_tokens"].to_pylist()
    return lengths, [_rank(seed, *sample) for sample in ids]


def _rank(seed: int, prompt_id: str, sample_idx: int, turn: int | None) -> str:
    # a whole row's rank leaves the turn out, as it was before per-turn samples
    turn_part = {} if turn is None else {"turn": turn}
    return hashing.digest({"seed": seed, "prompt_id": prompt_id, "sample_idx": sample_idx, **turn_part})


def _by_window(rows: list[Row]) -> list[tuple[int, list[list[Piece]]]]:
    grouped: dict[int, list[list[Piece]]] = defaultdict(list)
    for window, row in rows:
        grouped[window].append(row)
    return sorted(grouped.items())


def _spill(files: list[Path], window_of: dict[int, int], folder: Path) -> None:
    """Copy each sample into its window's file (with its global index), reading the dataset once."""
    folder.mkdir()
    writers: dict[int, pq.ParquetWriter] = {}
    offset = 0
    try:
        for path in files:
            table = pq.read_table(
                path, columns=["input_ids", "loss_mask", "prompt_id", "sample_idx", "turn", "category"]
            )
            index = np.arange(offset, offset + table.num_rows, dtype=np.int64)
            offset += table.num_rows
            windows = np.array([window_of.get(int(i), -1) for i in index], dtype=np.int64)
            table = table.append_column("sample", pa.array(index))
            for window in np.unique(windows[windows >= 0]):
                part = table.filter(pa.array(windows == window))
                if int(window) not in writers:
                    writers[int(window)] = pq.ParquetWriter(folder / f"{int(window):06d}.parquet", part.schema)
                writers[int(window)].write_table(part)
    finally:
        for w in writers.values():
            w.close()


def _build(table: pa.Table, rows: list[list[Piece]], spec: PackSpec) -> pa.Table:
    """The packed rows of one window, from its spilled samples."""
    position = {int(s): i for i, s in enumerate(table["sample"].to_numpy())}
    ids_col = table["input_ids"].combine_chunks()
    mask_col = table["loss_mask"].combine_chunks()
    ids_flat, mask_flat = ids_col.values.to_numpy(), mask_col.values.to_numpy()
    offsets = ids_col.offsets.to_numpy()
    prompt_ids, sample_idxs, turns, categories = (
        table[c].to_pylist() for c in ("prompt_id", "sample_idx", "turn", "category")
    )
    out: dict[str, list[Any]] = {name: [] for name in PACKED_SCHEMA.names}
    for row in rows:
        ids_parts, mask_parts, pos_parts, seq_lens = [], [], [], []
        for piece in row:
            at = position[piece.sample]
            lo = offsets[at] + piece.start
            ids_parts.append(ids_flat[lo : lo + piece.length])
            mask_parts.append(mask_flat[lo : lo + piece.length])
            pos_parts.append(np.arange(piece.start, piece.start + piece.length, dtype=np.int32))
            seq_lens.append(piece.length)
        used = sum(seq_lens)
        pad = spec.seq_len - used if spec.pad else 0
        if pad:
            ids_parts.append(np.full(pad, spec.pad_token_id, dtype=np.int32))
            mask_parts.append(np.zeros(pad, dtype=np.int8))
            pos_parts.append(np.arange(pad, dtype=np.int32))
            seq_lens.append(pad)
        at_rows = [position[p.sample] for p in row]
        out["input_ids"].append(np.concatenate(ids_parts))
        out["loss_mask"].append(np.concatenate(mask_parts))
        out["position_ids"].append(np.concatenate(pos_parts))
        out["seq_lens"].append(seq_lens)
        out["num_samples"].append(len(row))
        out["n_pad"].append(pad)
        out["prompt_id"].append([prompt_ids[i] for i in at_rows])
        out["sample_idx"].append([sample_idxs[i] for i in at_rows])
        out["turn"].append([turns[i] for i in at_rows])
        out["category"].append([categories[i] for i in at_rows])
    return pa.table({name: out[name] for name in PACKED_SCHEMA.names}, schema=PACKED_SCHEMA)


def _histogram(values: list[int], seq_len: int, buckets: int = 10) -> list[dict[str, int]]:
    """Rows by real tokens, in ``buckets`` equal ranges of 0..seq_len."""
    width = max(1, -(-seq_len // buckets))
    counts = Counter(min(v // width, buckets - 1) for v in values)
    return [{"from": b * width, "to": min(seq_len, (b + 1) * width), "rows": counts.get(b, 0)} for b in range(buckets)]


def summary(manifest: dict[str, Any], where: Path) -> str:
    p = manifest["pack"]
    lines = [
        f"packed: {where} ({manifest['rows']} rows of {p['seq_len']} tokens, {manifest['samples']} samples, "
        f"fill {manifest['fill_efficiency']:.1%}, {manifest['pad_tokens']} padding tokens)"
    ]
    if manifest["dropped_long"]:
        lines.append(
            f"note: {manifest['dropped_long']} samples longer than {p['seq_len']} tokens were dropped "
            f"({manifest['dropped_long_tokens']} tokens); pack.split_long: true cuts them into pieces instead"
        )
    if manifest["split"]:
        lines.append(f"note: {manifest['split']} samples longer than {p['seq_len']} tokens were cut into pieces")
    return "\n".join(lines)


def card(manifest: dict[str, Any]) -> str:
    hist = "\n".join(f"| {h['from']}–{h['to']} | {h['rows']} |" for h in manifest["row_tokens_histogram"])
    return f"""{card_header(manifest)}
`{manifest["mixed_from"]}` packed by dflash-build into rows of {manifest["pack"]["seq_len"]} tokens. Each row
holds whole samples back to back: `seq_lens` gives their lengths (then the padding's, if any),
`position_ids` restart at every sample, `loss_mask` is 0 on padding; pass `seq_lens` to a varlen
attention kernel so that no sample attends to another. `prompt_id`/`sample_idx` name each sample of
the mixed dataset.

```
{summary(manifest, Path("."))}
```

Real tokens per row:

| tokens | rows |
|---|---|
{hist}
"""
