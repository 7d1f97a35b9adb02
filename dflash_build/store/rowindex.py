"""Per-row index of published completions, for regenerating requests rather than shards.

Shard targets stay per shard, but before generating, a job looks up every (prompt_id, sample_idx) among
the completions already in the store whose requests were made to the same engine: the same model, the
same engine options that change the numbers, the same sampling (``keys.reuse_key``). What else decides
an answer each row holds: the prompt token ids the engine saw and the row's seed (which depends only on
the base seed, the prompt id and the sample index). So a row found here answers this build's request when
its prompt ids are the ones this build renders, its seed is this build's, and its answer is what the
engine returns under this build's stop ids and budget; ``stages.generate.reuse`` checks each, whatever
changed the key around it (a template edit no prompt uses, a scheme bump, another prompt set). Under a new
max_new_tokens M, a row with n output tokens is used:

- whole, when it stopped and n + 1 <= M (it stopped before the limit);
- cut to its first M tokens (a truncated sample under M), when n >= M;
- as a prefix to continue from, when it was truncated with n < M: the engine generates the rest,
  which is as valid a sample as one generated from scratch.

A ``turns: all`` row is reused turn by turn from the first, while each turn's request is the same (its
prompt on the history, its budget), under a key of its own (``keys.reuse_key(..., conversations=True)``):
each later turn's prompt holds the earlier answers, so a turn is never cut or continued. Each row also
keeps its generation key (``keys.generation_key``), so a row reused across a template, prepare or scheme
change is counted apart from one reused within the same generation settings.

SQLite (one file per store) keeps the lookup fast at millions of rows and safe for concurrent jobs:
every lookup and delete goes through an index, and a write transaction holds the lock only for its own
shard's statements (rows are read and prepared before it begins). On a local filesystem it runs in WAL
mode (readers never wait for a writer); on a network filesystem (NFS, Lustre, GPFS, ...) in rollback
journal mode, whose locks are the filesystem's own file locks, since WAL's index of the log lives in
shared memory that one host alone sees (:mod:`dflash_build.store.filesystem` tells which).
Inspection (plan, verify, gc without --yes) opens it read-only and, where it is out of step with the
store, reads the store into an index in memory: nothing is written, and the answers are true. Paths in
it are relative to the store, so every working directory (and every mount point of a shared store)
reads the same entries. The index is derived data and heals itself: :meth:`RowIndex.open` rebuilds an
index that is not a database or is of an older layout, and adds the published shards it lacks, with a
warning: at the start of every build (a full comparison with the store), and in any job that finds it
empty (a lost index); ``dflash-build reindex`` rebuilds it by hand.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_build.keys import generation_key, reuse_key
from dflash_build.store import filesystem, layout

log = logging.getLogger(__name__)
INDEX_FILE = layout.INDEX_FILE
LOCK_FILE = layout.INDEX_LOCK
# PRAGMA user_version: 2 = store-relative paths and per-shard row counts; 3 = turns: all rows; 4 = rows by
# their requests (keys.reuse_key), with their generation key
LAYOUT = 4
_SCHEMA = """
CREATE TABLE IF NOT EXISTS rows (
    reuse_key TEXT NOT NULL,
    prompt_id TEXT NOT NULL,
    sample_idx INTEGER NOT NULL,
    gen_key TEXT NOT NULL,
    generation_key TEXT NOT NULL,
    path TEXT NOT NULL,
    row INTEGER NOT NULL,
    finish_reason TEXT NOT NULL,
    n_output INTEGER NOT NULL,
    max_new_tokens INTEGER NOT NULL,
    PRIMARY KEY (reuse_key, prompt_id, sample_idx, gen_key)
);
CREATE TABLE IF NOT EXISTS shards (path TEXT PRIMARY KEY, gen_key TEXT NOT NULL, indexed_rows INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS rows_by_path ON rows (path);
"""


class IndexCorrupt(RuntimeError):
    """The index file is damaged in a way found only while using it."""


def _indexed(rows: Iterable[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """The rows worth indexing: rows that stopped or ran out."""
    # a row that ended at a trainer's window continues like a truncated one; one the loop rule stopped is a
    # prefix too: a build that does not stop on that rule continues it
    reusable = ("stop", "length", "window", "loop")
    return [(i, r) for i, r in enumerate(rows) if r["finish_reason"] in reusable]


def _outcome(row: dict[str, Any]) -> tuple[str, int]:
    return row["finish_reason"], row["n_output_tokens"]


@dataclass(frozen=True)
class Candidate:
    prompt_id: str
    sample_idx: int
    gen_key: str
    generation_key: str
    path: str
    row: int
    finish_reason: str
    n_output: int
    max_new_tokens: int

    def use_for(self, max_new_tokens: int) -> str:
        """How this row serves a build with ``max_new_tokens``: whole, cut to a prefix, or continued."""
        if self.finish_reason == "stop" and self.n_output + 1 <= max_new_tokens:
            return "whole"
        if self.n_output >= max_new_tokens:
            return "cut"
        return "continue"


def _rank(cand: Candidate, max_new_tokens: int) -> tuple[bool, int]:
    return cand.use_for(max_new_tokens) != "continue", cand.n_output


LOCK_WAIT_SECONDS = 60.0


def _busy(error: sqlite3.OperationalError) -> bool:
    """Another connection holds the lock: wait for it (it is no damage)."""
    return "locked" in str(error) or "busy" in str(error)


def _when_free(statement: Callable[[], object], seconds: float = LOCK_WAIT_SECONDS) -> None:
    """Run ``statement``, waiting while another process holds the database's lock.

    SQLite's busy timeout does not cover every statement: switching to WAL answers "database is
    locked" at once while another connection writes (two builds starting on one store at once).
    """
    deadline = time.monotonic() + seconds
    delay = 0.01
    while True:
        try:
            statement()
            return
        except sqlite3.OperationalError as e:
            if not _busy(e) or time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def journal_mode(store: Path) -> str:
    """WAL on a local filesystem; the rollback journal where several hosts may share the store."""
    return "DELETE" if filesystem.mount_of(store).network else "WAL"


def _uri(path: Path, *options: str) -> str:
    return f"file:{urllib.parse.quote(str(path.absolute()))}?{'&'.join(('mode=ro', *options))}"


def read_only(path: Path) -> sqlite3.Connection:
    """A read-only connection that creates nothing, also where the folder cannot be written.

    A WAL database opened read-only needs its shared-memory file, which a read-only folder cannot get;
    with no log to read (``-wal`` absent or empty: the last writer closed cleanly) the file alone is the
    whole database, and SQLite reads it as immutable.
    """
    db = sqlite3.connect(_uri(path), uri=True, timeout=LOCK_WAIT_SECONDS)
    try:
        db.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchone()
        return db
    except sqlite3.OperationalError:
        db.close()
        wal = Path(f"{path}-wal")
        if wal.exists() and wal.stat().st_size:
            raise
    db = sqlite3.connect(_uri(path, "immutable=1"), uri=True)
    db.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchone()
    return db


class RowIndex:
    def __init__(self, store: Path, db: sqlite3.Connection | None = None) -> None:
        """Connect for writing, without any check (use :meth:`open`); or wrap ``db``, to read only."""
        self.store = store
        self.path = store / INDEX_FILE
        self.read_only = db is not None
        if db is not None:
            self.db = db
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, timeout=LOCK_WAIT_SECONDS)
        mode = journal_mode(store)
        _when_free(lambda: self.db.execute(f"PRAGMA journal_mode={mode}"))
        _when_free(lambda: self.db.executescript(_SCHEMA))

    @classmethod
    @contextlib.contextmanager
    def open(cls, store: Path, sync: bool | None = True, readonly: bool = False) -> Iterator[RowIndex]:
        """The store's index, healed first: rebuilt when damaged or old, completed when shards are missing.

        ``sync``: True compares it with every published shard (a scan of every sidecar: at the start of
        a build, and in commands); None does so only when the index is empty (lost), as a job does, since
        at 100,000 shards a scan per job would cost more than the reuse saves; False never.
        ``readonly``: write nothing (inspection): the index as it is when it is whole and in step with the
        store, else one read from the store into memory.
        """
        index = cls.reading(store) if readonly else cls._healthy(store)
        try:
            if not readonly and (
                sync or (sync is None and index.db.execute("SELECT 1 FROM shards LIMIT 1").fetchone() is None)
            ):
                index.sync()
            yield index
        except sqlite3.DatabaseError as e:
            if (env := filesystem.fault(e, index.path)) is not None:
                raise env from None
            raise IndexCorrupt(
                f"the row index {index.path} is damaged ({e}); run `dflash-build reindex` to rebuild it"
            ) from e
        finally:
            index.close()

    @classmethod
    def reading(cls, store: Path) -> RowIndex:
        """The index to read only: the file when it is usable and in step with the store, else the store
        read into memory (with a note: the next build heals the file)."""
        path = store / INDEX_FILE
        why = "missing"
        if path.exists():
            try:
                index = cls(store, read_only(path))
                if index.db.execute("PRAGMA user_version").fetchone()[0] != LAYOUT:
                    why = "of an older layout"
                else:
                    missing, gone = index.differences()
                    if not missing and not gone:
                        return index
                    why = f"out of step ({len(missing)} shards missing, {len(gone)} gone)"
                index.close()
            except sqlite3.DatabaseError as e:
                why = f"not readable ({e})"
        shards = published_shards(store)
        if shards:
            log.info("row index %s is %s: read %d shards into memory (the next build heals it)", path, why, len(shards))
        memory = cls(store, sqlite3.connect(":memory:"))
        memory.db.executescript(_SCHEMA)
        for data in shards:
            _index_file(memory, data)
        return memory

    @classmethod
    def _healthy(cls, store: Path) -> RowIndex:
        try:
            index = cls(store)
            layout = index.db.execute("PRAGMA user_version").fetchone()[0]
            has_rows = index.db.execute("SELECT 1 FROM shards LIMIT 1").fetchone() is not None
        except sqlite3.DatabaseError as e:
            if isinstance(e, sqlite3.OperationalError) and _busy(e):
                raise  # held by another process past every wait: not damage, never rebuilt under it
            if (env := filesystem.fault(e, store / INDEX_FILE)) is not None:
                raise env from None  # a full disk or a store we cannot write: rebuilding would not help
            log.warning("row index %s is not readable (%s): rebuilding it from the store", store / INDEX_FILE, e)
            rebuild(store, force=False)
            return cls(store)
        if layout != LAYOUT:
            if has_rows:
                log.warning("row index %s has an older layout: rebuilding it from the store", index.path)
                index.close()
                rebuild(store, force=False)
                return cls(store)
            index.db.execute(f"PRAGMA user_version = {LAYOUT}")
        return index

    @staticmethod
    def problem(store: Path) -> tuple[str, bool] | None:
        """Why the index cannot be used as it is, and whether that is damage (False: it cannot be read,
        for permission or I/O, which no rebuild mends); None: it can, or there is none yet."""
        path = store / INDEX_FILE
        if not path.exists():
            return None
        try:
            db = read_only(path)
            try:
                layout = db.execute("PRAGMA user_version").fetchone()[0]
                check = db.execute("PRAGMA quick_check").fetchone()[0]
                tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            finally:
                db.close()
        except sqlite3.DatabaseError as e:
            if not os.access(path, os.R_OK) or getattr(e, "sqlite_errorname", "").startswith("SQLITE_IOERR"):
                return f"cannot be read ({e}): check its permissions and the disk", False
            return f"not a readable SQLite database ({e})", True
        if check != "ok":
            return f"damaged ({check})", True
        if not {"rows", "shards"} <= tables:
            return "holds no index tables (an emptied or foreign file)", True
        if layout not in (0, LAYOUT):
            return f"layout {layout}, this version writes {LAYOUT}", True
        return None

    def close(self) -> None:
        self.db.close()

    def relative(self, path: str | os.PathLike[str]) -> str:
        """``path`` as the index names it: relative to the store, whatever the working directory."""
        return os.path.relpath(os.path.abspath(path), os.path.abspath(self.store))

    def add_shard(
        self, gen_key: str, components: Mapping[str, Any], path: Path, rows: Iterable[dict[str, Any]]
    ) -> None:
        """Index a published completion shard of ``gen_key`` (its recorded ``components``): single-turn rows
        and ``turns: all`` rows each under their key (keys.reuse_key), with the shard's generation key."""
        name = self.relative(path)
        keys = {False: reuse_key(components), True: reuse_key(components, conversations=True)}
        generation = generation_key(components)
        max_new_tokens = components["sampling"]["max_new_tokens"]
        values = [
            (keys[bool(r.get("turns"))], r["prompt_id"], r["sample_idx"], gen_key, generation, name, i, *_outcome(r))
            for i, r in _indexed(rows)
        ]
        values = [(*v, max_new_tokens) for v in values]
        with self._writing():
            self.db.execute("DELETE FROM rows WHERE path = ?", (name,))
            self.db.executemany("INSERT OR REPLACE INTO rows VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", values)
            self.db.execute("INSERT OR REPLACE INTO shards VALUES (?, ?, ?)", (name, gen_key, len(values)))

    def remove_shard(self, path: Path) -> None:
        name = self.relative(path)
        with self._writing():
            self.db.execute("DELETE FROM rows WHERE path = ?", (name,))
            self.db.execute("DELETE FROM shards WHERE path = ?", (name,))

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """One write transaction, taking the write lock at its start (BEGIN IMMEDIATE): a transaction
        that first reads and then wants to write can fail at once under concurrent writers."""
        try:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self.db.rollback()
                raise
            self.db.commit()
        except sqlite3.OperationalError as e:
            if (env := filesystem.fault(e, self.path)) is not None:
                raise env from None  # a full disk is no damaged index: the next build heals what is missing
            raise

    def differences(self) -> tuple[list[Path], list[str]]:
        """(published shards the index lacks or lists with another row count, indexed shards that are gone)."""
        indexed = dict(self.db.execute("SELECT path, indexed_rows FROM shards"))
        counted = dict(self.db.execute("SELECT path, COUNT(*) FROM rows GROUP BY path"))
        published = {self.relative(p): p for p in published_shards(self.store)}
        missing = [
            path
            for name, path in sorted(published.items())
            if name not in indexed or counted.get(name, 0) != indexed[name]
        ]
        gone = sorted(name for name in indexed if name not in published)
        return missing, gone

    def sync(self) -> int:
        """Index what the store has and the index lacks; forget what is gone. Returns shards changed."""
        missing, gone = self.differences()
        for name in gone:
            self.remove_shard(self.store / name)
        for data in missing:
            _index_file(self, data)
        if missing:
            log.warning("row index %s lacked %d published shards: indexed them now", self.path, len(missing))
        return len(missing) + len(gone)

    def lookup(
        self, key: str, wanted: Iterable[tuple[str, int]], max_new_tokens: int
    ) -> dict[tuple[str, int], list[Candidate]]:
        """Every earlier row of each wanted (prompt_id, sample_idx) under ``key``, the best first: a whole or
        cut row costs nothing, and among continuations the longest prefix wastes least. Reuse takes the
        first that answers its request (the others were made under other settings); paths are relative to
        the store."""
        found: dict[tuple[str, int], list[Candidate]] = {}
        wanted = list(wanted)
        for start in range(0, len(wanted), 500):
            chunk = wanted[start : start + 500]
            ids = sorted({pid for pid, _ in chunk})
            marks = ",".join("?" * len(ids))
            cursor = self.db.execute(
                f"SELECT prompt_id, sample_idx, gen_key, generation_key, path, row, finish_reason, n_output, "
                f"max_new_tokens FROM rows WHERE reuse_key = ? AND prompt_id IN ({marks})",
                (key, *ids),
            )
            keys = set(chunk)
            for values in cursor:
                cand = Candidate(*values)
                pair = (cand.prompt_id, cand.sample_idx)
                if pair in keys:
                    found.setdefault(pair, []).append(cand)
        for cands in found.values():
            cands.sort(key=lambda c: (_rank(c, max_new_tokens), c.gen_key), reverse=True)
        return found


def published_shards(store: Path) -> list[Path]:
    """Completion shards with their stats sidecar (a shard is published when both exist)."""
    out = []
    for stats_file in layout.store_sidecars(store, layout.COMPLETIONS):
        data = layout.data_of(stats_file)
        if data.exists():
            out.append(data)
    return out


def _index_file(index: RowIndex, data: Path) -> None:
    import pyarrow.parquet as pq

    stats_file = layout.sidecar(data)
    try:
        stats = json.loads(stats_file.read_text())
        components = stats["components"]
        rows = pq.read_table(
            data, columns=["prompt_id", "sample_idx", "finish_reason", "n_output_tokens", "turns"]
        ).to_pylist()
    except (OSError, ValueError, KeyError) as e:  # pyarrow's errors are OSError/ValueError
        log.warning("cannot index %s (%s): `dflash-build verify` checks it", data, e)
        return
    index.add_shard(stats["gen_key"], components, data, rows)


def rebuild(store: Path, force: bool = True) -> int:
    """Recreate the index from every published completion shard; returns the shard count.

    One process rebuilds at a time (a lock beside the index); jobs that found it damaged meanwhile
    wait, then use the one rebuilt (``force=False`` rebuilds only if it is still unusable).
    """
    lock = store / LOCK_FILE
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        if not force and RowIndex.problem(store) is None and (store / INDEX_FILE).exists():
            with contextlib.closing(RowIndex(store)) as fresh:
                if fresh.db.execute("PRAGMA user_version").fetchone()[0] == LAYOUT:
                    return 0
        index_file = store / INDEX_FILE
        for suffix in ("", "-wal", "-shm"):
            Path(str(index_file) + suffix).unlink(missing_ok=True)
        index = RowIndex(store)
        index.db.execute(f"PRAGMA user_version = {LAYOUT}")
        shards = published_shards(store)
        for data in shards:
            _index_file(index, data)
        index.close()
        return len(shards)
