"""A published folder's data files: parquet parts named as Hugging Face's ``datasets`` reads one split."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from dflash_build import hashing
from dflash_build.store import atomic
from dflash_build.store import records as R


class RollingWriter:
    """Writes tables into data/train-XXXXX.parquet files of at most ``rows_per_file`` rows."""

    def __init__(self, folder: Path, rows_per_file: int, schema: pa.Schema = R.SAMPLE_SCHEMA) -> None:
        self.folder, self.rows_per_file, self.schema = folder, rows_per_file, schema
        self.pending: list[pa.Table] = []
        self.pending_rows = 0
        self.files: list[tuple[Path, dict[str, Any]]] = []

    def write(self, table: pa.Table) -> None:
        while table.num_rows:
            take = min(table.num_rows, self.rows_per_file - self.pending_rows)
            self.pending.append(table.slice(0, take))
            self.pending_rows += take
            table = table.slice(take)
            if self.pending_rows == self.rows_per_file:
                self._flush()

    def _flush(self) -> None:
        path = self.folder / f"part-{len(self.files):05d}.parquet"
        data = pa.concat_tables(self.pending) if self.pending else self.schema.empty_table()
        self.files.append((path, atomic.write_parquet(path, data)))
        self.pending, self.pending_rows = [], 0

    def close(self) -> list[dict[str, Any]]:
        if self.pending_rows or not self.files:
            self._flush()
        # Hugging Face's naming lets `datasets` see one train split. The content digest in the name
        # makes a rebuilt dataset new files: `datasets` caches a local folder by its file names.
        n = len(self.files)
        content = hashing.digest([info["sha256"] for _, info in self.files])[:12]
        files = []
        for i, (path, info) in enumerate(self.files):
            final = path.with_name(f"train-{i:05d}-of-{n:05d}-{content}.parquet")
            path.rename(final)
            files.append({"path": str(Path("data") / final.name), **info})
        atomic.fsync_dir(self.folder)
        return files
