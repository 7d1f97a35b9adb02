"""Row reuse lookup at scale: the SQLite row index against scanning the completion shards.

Builds a store-like index of N rows (default 1M, in shards of 4096) and times finding the earlier
completions of one new shard's rows (4096 lookups), against the baseline a job without an index
would need: reading the prompt_id/sample_idx columns of every completion shard. Prints both and
their ratio, measured in the same run.

    python bench/rowindex_lookup.py [--rows 1000000]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_build.keys import reuse_key
from dflash_build.store.rowindex import RowIndex

SHARD = 4096


def pid(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp)
        index = RowIndex(store)
        components = {"model": "m", "engine": {}, "sampling": {"seed": 0, "max_new_tokens": 8192}}
        start = time.perf_counter()
        for shard, lo in enumerate(range(0, args.rows, SHARD)):
            rows = [
                {"prompt_id": pid(i), "sample_idx": 0, "finish_reason": "stop", "n_output_tokens": 100}
                for i in range(lo, min(lo + SHARD, args.rows))
            ]
            path = store / "completions" / "src" / "k" / f"{shard:05d}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(rows), path)
            index.add_shard("old", components, path, rows)
        print(f"built {args.rows} rows in {time.perf_counter() - start:.1f}s")

        wanted = [(pid(i), 0) for i in random.Random(0).sample(range(args.rows), SHARD)]
        start = time.perf_counter()
        found = index.lookup(reuse_key(components), wanted, 8192)
        indexed = time.perf_counter() - start
        assert len(found) == SHARD

        start = time.perf_counter()
        want = set(wanted)
        hits = 0
        for path in sorted((store / "completions").rglob("*.parquet")):
            table = pq.read_table(path, columns=["prompt_id", "sample_idx"])
            hits += sum((p, s) in want for p, s in zip(*(c.to_pylist() for c in table.columns), strict=True))
        scanned = time.perf_counter() - start
        assert hits == SHARD
        index.close()
    print(f"index lookup of {SHARD} rows: {indexed * 1000:.1f} ms")
    print(f"baseline scan of every shard: {scanned * 1000:.1f} ms")
    print(f"ratio (scan / index): {scanned / indexed:.1f}x")


if __name__ == "__main__":
    main()
