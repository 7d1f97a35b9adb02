"""Converted rows on disk, in buckets by prompt id, while the selection runs on their digests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from dflash_build.store.records import PROMPT_SCHEMA

# Prepare streams: each converted row goes to a spill bucket on disk (by the top bits of its prompt id)
# and leaves only its digests in memory, 24 bytes a row. Selection runs on those arrays; the buckets
# are then read back one at a time, in prompt id order, and the shards written as they fill. Peak
# memory: the digest arrays and their sort, the bucket buffers (SPILL_BUFFER_BYTES) and one bucket.
# The spill is uncompressed Arrow, mapped back one bucket at a time: about as much disk as the
# converted rows, beside the manifest (LZ4 saved disk but cost an eighth of prepare's time).
SPILL_BUFFER_BYTES = 32 << 20


SPILL_FLUSH_ROWS = 1024
ROWS_PER_BUCKET = 32768
MAX_BUCKETS = 512
SPILL_SCHEMA = pa.schema([*PROMPT_SCHEMA, ("location", pa.string())])


def bucket_count(expected_rows: int) -> int:
    """A power of two, so a bucket is a contiguous range of prompt ids."""
    buckets = 1
    while buckets < MAX_BUCKETS and buckets * ROWS_PER_BUCKET < expected_rows:
        buckets *= 2
    return buckets


class Spill:
    """Converted records in bucket files under ``folder`` (removed by the caller), or nowhere."""

    def __init__(self, folder: Path | None, buckets: int) -> None:
        self.folder = folder
        self.shift = 64 - (buckets.bit_length() - 1)
        self.buffers: list[list[pa.Table]] = [[] for _ in range(buckets)]
        self.writers: dict[int, pa.ipc.RecordBatchFileWriter] = {}
        self.buffered_rows = [0] * buckets
        self.buffered_bytes = [0.0] * buckets

    def _path(self, bucket: int) -> Path:
        assert self.folder is not None
        return self.folder / f"{bucket:04d}.arrow"

    def add(self, records: pa.Table, pids: np.ndarray) -> None:
        """Buffer each record (``pids``: their prompt ids as integers) in its bucket."""
        if self.folder is None or not records.num_rows:
            return
        buckets = pids >> np.uint64(self.shift) if self.shift < 64 else np.zeros(len(pids), dtype=np.uint64)
        order = np.argsort(buckets, kind="stable")
        records = records.take(pa.array(order))
        row_bytes = records.nbytes / records.num_rows  # once: a slice's nbytes walks its buffers
        ordered = buckets[order]
        starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
        for lo, hi in zip(starts.tolist(), [*starts[1:].tolist(), len(ordered)], strict=True):
            bucket = int(ordered[lo])
            self.buffers[bucket].append(records.slice(lo, hi - lo))
            self.buffered_rows[bucket] += hi - lo
            self.buffered_bytes[bucket] += (hi - lo) * row_bytes
            if self.buffered_rows[bucket] >= SPILL_FLUSH_ROWS:
                self._flush(bucket)
        if sum(self.buffered_bytes) > SPILL_BUFFER_BYTES:
            for b in range(len(self.buffers)):
                self._flush(b)

    def _flush(self, bucket: int) -> None:
        parts = self.buffers[bucket]
        if not parts or self.folder is None:
            return
        if bucket not in self.writers:  # Arrow files, uncompressed: read back by mapping them
            self.writers[bucket] = pa.ipc.new_file(self._path(bucket), SPILL_SCHEMA)
        self.writers[bucket].write_table(pa.concat_tables(parts))
        self.buffers[bucket], self.buffered_rows[bucket], self.buffered_bytes[bucket] = [], 0, 0.0

    def close(self) -> None:
        for bucket in range(len(self.buffers)):
            self._flush(bucket)
        for writer in self.writers.values():
            writer.close()

    def tables(self) -> Iterator[pa.Table]:
        """Each bucket's rows, in bucket order (prompt id ranges ascending)."""
        for bucket in sorted(self.writers):
            with pa.memory_map(str(self._path(bucket))) as source, pa.ipc.open_file(source) as reader:
                yield reader.read_all()
