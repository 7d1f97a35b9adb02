"""The generation journal: a shard's finished rows, kept across failed and killed jobs and schedulers.

It lives under store/journal/{gen_key}/{shard}/, outside every Snakemake output, so Snakemake never
deletes it. Rows are appended as JSON lines to ``rows.jsonl`` and fsync'd every N rows or T seconds;
a kill loses at most the rows since the last sync, which are then generated again (never twice: a
row is in the journal or it is not). A torn last line from a kill mid-write is cut off on open; a
line that does not parse (a damaged disk block) costs that row only, with a warning.

When the shard is published, the journal keeps it: the shard and its sidecar are written here first
(``published.parquet``, ``published.stats.json``) and the Snakemake outputs are hard links to them.
Whatever deletes the outputs later (``--rerun-incomplete`` after a killed Snakemake, a second
working directory's Snakemake, a forced rerun) leaves this copy, and the next job restores the shard
from it instead of generating it again. The copy goes when the shard's key is garbage (`gc`).

One job at a time owns a journal: :meth:`Journal.locked` takes an exclusive lock on the shard (a
second job, from this working directory or another one on the same store, waits for it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import platform
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from dflash_build.store import atomic, layout

log = logging.getLogger(__name__)
ROWS_FILE = layout.JOURNAL_ROWS
LOCK_FILE = layout.JOURNAL_LOCK
PUBLISHED_DATA = layout.PUBLISHED_DATA
PUBLISHED_STATS = layout.PUBLISHED_STATS
LOCK_REPORT_SECONDS = 60.0
# A row's field naming why the degenerate policy regenerate rejected its answer (asked again with the next
# attempt's seed): journaled so a resumed job goes on from that next attempt; never the row's answer.
REJECTED = "rejected"


def answers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The journaled rows that hold an answer: all but the attempts the degenerate policy rejected (only
    the driver's replay reads those, to resume from the next attempt)."""
    return [row for row in rows if not row.get(REJECTED)]


class Journal:
    def __init__(self, folder: Path, flush_rows: int, flush_seconds: float) -> None:
        self.folder = folder
        self.flush_rows, self.flush_seconds = flush_rows, flush_seconds
        self._file: IO[str] | None = None
        self._unsynced = 0
        self._last_sync = time.monotonic()
        self._lock = threading.RLock()  # the heartbeat of a stalled job syncs from its own thread

    @property
    def path(self) -> Path:
        return self.folder / ROWS_FILE

    @property
    def published_data(self) -> Path:
        return self.folder / PUBLISHED_DATA

    @property
    def published_stats(self) -> Path:
        return self.folder / PUBLISHED_STATS

    @contextlib.contextmanager
    def locked(self, label: str) -> Iterator[None]:
        """Hold the shard's lock; wait (saying who holds it) while another job does."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / LOCK_FILE, "a+", encoding="utf-8") as handle:
            waited_since = time.monotonic()
            reported = 0.0
            while True:
                try:
                    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    now = time.monotonic()
                    if now - reported >= LOCK_REPORT_SECONDS or not reported:
                        handle.seek(0)
                        holder = handle.read().strip() or "another job"
                        log.warning(
                            "%s: waiting for the shard's lock %s, held by %s (%.0fs so far)",
                            label,
                            self.folder / LOCK_FILE,
                            holder,
                            now - waited_since,
                        )
                        reported = now
                    time.sleep(0.5)
            handle.seek(0)
            handle.truncate()
            holder = f"pid {os.getpid()} on {platform.node()}, working directory {os.getcwd()}, since {time.ctime()}"
            handle.write(holder)
            handle.flush()
            try:
                yield
            finally:
                handle.seek(0)
                handle.truncate()
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

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
        rows, bad = parse(data[:end])
        if bad:
            log.warning(
                "journal %s: %d damaged lines (first: line %d) are skipped; their rows are generated again",
                self.path,
                len(bad),
                bad[0],
            )
        return rows

    @staticmethod
    def read(path: Path) -> list[dict[str, Any]]:
        """The complete, readable rows of a journal file, changing nothing (for `plan`, while a job writes)."""
        if not path.exists():
            return []
        data = path.read_bytes()
        return parse(data[: data.rfind(b"\n") + 1])[0]

    def append(self, row: dict[str, Any]) -> None:
        with self._lock:
            self._append(row)

    def _append(self, row: dict[str, Any]) -> None:
        if self._file is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            new = not self.path.exists()
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (held across calls)
            if new:
                atomic.fsync_dir(self.folder)
        with self._naming_errors():
            self._file.write(json.dumps(row, separators=(",", ":")) + "\n")
        self._unsynced += 1
        if self._unsynced >= self.flush_rows or time.monotonic() - self._last_sync >= self.flush_seconds:
            self.sync()

    def sync(self) -> None:
        with self._lock:
            if self._file is not None and self._unsynced:
                with self._naming_errors():
                    self._file.flush()
                    os.fsync(self._file.fileno())
            self._unsynced = 0
            self._last_sync = time.monotonic()

    @contextlib.contextmanager
    def _naming_errors(self) -> Iterator[None]:
        """A failed write (a full disk) names the journal file, which the OSError of a write does not."""
        try:
            yield
        except OSError as e:
            e.filename = e.filename or str(self.path)
            raise

    def close(self) -> None:
        self.sync()
        if self._file is not None:
            self._file.close()
            self._file = None

    def published(self) -> tuple[Path, dict[str, Any]] | None:
        """The shard this journal published, with its sidecar, if both are here."""
        if not (self.published_data.exists() and self.published_stats.exists()):
            return None
        try:
            return self.published_data, json.loads(self.published_stats.read_text())
        except (OSError, ValueError) as e:
            log.warning("journal %s: unreadable published sidecar (%s): the shard is rebuilt", self.folder, e)
            return None

    def discard_published(self) -> None:
        self.published_data.unlink(missing_ok=True)
        self.published_stats.unlink(missing_ok=True)

    def retire(self) -> None:
        """Called once the shard is published here: its rows live in ``published.parquet`` now."""
        self.close()
        self.path.unlink(missing_ok=True)
        atomic.fsync_dir(self.folder)


def parse(data: bytes) -> tuple[list[dict[str, Any]], list[int]]:
    """(rows, numbers of the lines that do not parse as a JSON object)."""
    rows, bad = [], []
    for lineno, line in enumerate(data.splitlines(), start=1):
        try:
            row = json.loads(line)
        except ValueError:
            bad.append(lineno)
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad.append(lineno)
    return rows, bad


def remove_tree(folder: Path) -> None:
    """Delete a journal folder, and its gen_key folder once that is empty."""
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        folder.parent.rmdir()
