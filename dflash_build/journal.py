"""The generation journal: finished rows of an unpublished shard, kept across failed and killed jobs.

It lives under store/journal/{gen_key}/{shard}/, outside every Snakemake output, so Snakemake never
deletes it when a job fails. Rows are appended as JSON lines and fsync'd every N rows or T seconds;
a kill loses at most the rows since the last sync, which are then generated again (never twice: a
row is in the journal or it is not). A torn last line from a kill mid-write is cut off on open.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import IO, Any

from dflash_build import atomic

log = logging.getLogger(__name__)
ROWS_FILE = "rows.jsonl"


class Journal:
    def __init__(self, folder: Path, flush_rows: int, flush_seconds: float) -> None:
        self.folder = folder
        self.flush_rows, self.flush_seconds = flush_rows, flush_seconds
        self._file: IO[str] | None = None
        self._unsynced = 0
        self._last_sync = time.monotonic()

    @property
    def path(self) -> Path:
        return self.folder / ROWS_FILE

    def load(self) -> list[dict[str, Any]]:
        """Rows journaled so far; cuts a torn last line (a kill mid-write) off the file."""
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            log.warning("journal %s: dropping a torn last line of %d bytes", self.path, len(data) - end)
            with open(self.path, "rb+") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        return _parse(self.path, data[:end])

    @staticmethod
    def read(path: Path) -> list[dict[str, Any]]:
        """The complete rows of a journal file, changing nothing (for `plan`, while a job may write it)."""
        if not path.exists():
            return []
        data = path.read_bytes()
        return _parse(path, data[: data.rfind(b"\n") + 1])

    def append(self, row: dict[str, Any]) -> None:
        if self._file is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            new = not self.path.exists()
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (held across calls)
            if new:
                atomic.fsync_dir(self.folder)
        self._file.write(json.dumps(row, separators=(",", ":")) + "\n")
        self._unsynced += 1
        if self._unsynced >= self.flush_rows or time.monotonic() - self._last_sync >= self.flush_seconds:
            self.sync()

    def sync(self) -> None:
        if self._file is not None and self._unsynced:
            self._file.flush()
            os.fsync(self._file.fileno())
        self._unsynced = 0
        self._last_sync = time.monotonic()

    def close(self) -> None:
        self.sync()
        if self._file is not None:
            self._file.close()
            self._file = None

    def remove(self) -> None:
        """Called once the shard is published: its rows live in the shard now."""
        self.close()
        shutil.rmtree(self.folder, ignore_errors=True)
        with contextlib.suppress(OSError):  # the gen_key folder goes with its last shard
            self.folder.parent.rmdir()


def _parse(path: Path, data: bytes) -> list[dict[str, Any]]:
    rows = []
    for lineno, line in enumerate(data.splitlines(), start=1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise RuntimeError(f"journal {path}:{lineno} is corrupt ({e.msg}); delete it to regenerate") from e
    return rows
