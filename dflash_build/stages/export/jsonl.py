"""An export's files: JSONL shards named once all are written, and the ids of its samples."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import pyarrow.parquet as pq

from dflash_build import hashing
from dflash_build.store import atomic

DATA_DIR = "data"  # the trainers read this folder (a folder of the version also holds manifest.json)


def sample_id(prompt_id: str, sample_idx: int, turn: int | None = None, variant: str | None = None) -> str:
    """A sample's id in an export: ``prompt:sample``, ``:turn`` for one turn of a conversation, and
    ``@variant`` for a sampling variant's (one prompt under two variants is two samples)."""
    base = f"{prompt_id}:{sample_idx}" if turn is None else f"{prompt_id}:{sample_idx}:{turn}"
    return base if variant is None else f"{base}@{variant}"


class JsonlShards:
    """JSONL files of ``shard_rows`` rows each, named ``train-00000-of-0000N.jsonl`` once all are written."""

    def __init__(self, folder: Path, shard_rows: int) -> None:
        self.folder, self.shard_rows = folder, shard_rows
        folder.mkdir(parents=True, exist_ok=True)
        self.paths: list[Path] = []
        self.rows_in: list[int] = []
        self._file: IO[str] | None = None

    def write(self, row: Mapping[str, Any]) -> None:
        if self._file is None or self.rows_in[-1] >= self.shard_rows:
            self._next()
        assert self._file is not None
        self._file.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
        self.rows_in[-1] += 1

    def _next(self) -> None:
        self._close_one()
        self.paths.append(self.folder / f".part-{len(self.paths):05d}.jsonl")
        self.rows_in.append(0)
        self._file = open(self.paths[-1], "w", encoding="utf-8")  # noqa: SIM115 (held across writes)

    def _close_one(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())  # the version becomes visible by one rename: durable before it
            self._file.close()
            self._file = None

    def close(self, base: Path) -> list[dict[str, Any]]:
        """Name the files (an empty export is one empty file: the trainer's path exists) and list them."""
        if not self.paths:
            self._next()
        self._close_one()
        files = []
        for i, (path, rows) in enumerate(zip(self.paths, self.rows_in, strict=True)):
            final = self.folder / f"train-{i:05d}-of-{len(self.paths):05d}.jsonl"
            path.rename(final)
            files.append({"path": str(final.relative_to(base)), "rows": rows, "sha256": hashing.sha256_file(final)})
        atomic.fsync_dir(self.folder)
        return files


def samples(files: list[Path], columns: list[str]) -> Iterator[dict[str, Any]]:
    for path in files:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=2048, columns=columns):
            yield from batch.to_pylist()
