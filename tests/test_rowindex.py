"""The row index under load: every lookup and delete uses an index, and eight writers at once lose nothing."""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
from pathlib import Path

import pytest

from dflash_build.keys import reuse_key
from dflash_build.store import rowindex
from dflash_build.store.rowindex import RowIndex

ROWS_PER_SHARD = 300
COMPONENTS = {"model": "m", "engine": {}, "sampling": {"temperature": 1.0, "seed": 0, "max_new_tokens": 16}}
KEY = reuse_key(COMPONENTS)


def _rows(writer: int, shard: int, finish: str = "stop") -> list[dict[str, object]]:
    return [
        {"prompt_id": f"{writer:04x}{shard:04x}{i:08x}", "sample_idx": 0, "finish_reason": finish, "n_output_tokens": 5}
        for i in range(ROWS_PER_SHARD)
    ]


def _shard_path(store: Path, writer: int, shard: int) -> Path:
    return store / "completions" / f"w{writer}" / "gk" / f"{shard:05d}.parquet"


def _writer(store: Path, writer: int, shards: int) -> None:
    """Add every shard, replace each once (as a republished shard), remove every third; look up meanwhile."""
    index = RowIndex(store)
    try:
        for shard in range(shards):
            path = _shard_path(store, writer, shard)
            index.add_shard("gk", COMPONENTS, path, _rows(writer, shard, "length"))
            index.add_shard("gk", COMPONENTS, path, _rows(writer, shard))
            found = index.lookup(KEY, [(r["prompt_id"], 0) for r in _rows(writer, shard)], 16)
            assert len(found) == ROWS_PER_SHARD and all(c.finish_reason == "stop" for [c] in found.values())
            if shard % 3 == 2:
                index.remove_shard(path)
    finally:
        index.close()


def test_eight_concurrent_writers_lose_no_row_and_leave_exactly_their_shards(tmp_path: Path) -> None:
    shards = 12
    RowIndex(tmp_path).close()  # the schema exists before the writers race
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(tmp_path, w, shards)) for w in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0] * 8
    db = sqlite3.connect(tmp_path / "index" / "rows.sqlite")
    kept = {(w, s) for w in range(8) for s in range(shards) if s % 3 != 2}
    expected_paths = {str(_shard_path(tmp_path, w, s).relative_to(tmp_path)) for w, s in kept}
    assert {p for (p,) in db.execute("SELECT path FROM shards")} == expected_paths
    counts = dict(db.execute("SELECT path, COUNT(*) FROM rows GROUP BY path"))
    assert counts == dict.fromkeys(expected_paths, ROWS_PER_SHARD)
    assert db.execute("SELECT COUNT(*) FROM rows WHERE finish_reason != 'stop'").fetchone()[0] == 0


def test_every_lookup_and_delete_uses_an_index(tmp_path: Path) -> None:
    index = RowIndex(tmp_path)
    statements: list[str] = []
    index.db.set_trace_callback(statements.append)
    path = _shard_path(tmp_path, 0, 0)
    index.add_shard("gk", COMPONENTS, path, _rows(0, 0))
    index.lookup(KEY, [("x", 0)], 16)
    index.remove_shard(path)
    index.db.set_trace_callback(None)
    checked = 0
    for sql in {s for s in statements if s.split()[0].upper() in ("SELECT", "DELETE", "UPDATE")}:
        params = sql.count("?")
        plan = index.db.execute(f"EXPLAIN QUERY PLAN {sql}", ("x",) * params).fetchall()
        details = [row[-1] for row in plan]
        assert not any(d.startswith("SCAN") for d in details), f"{sql}: {details}"
        checked += 1
    assert checked >= 3  # the lookup and both deletes
    index.close()


def test_a_lock_held_by_another_process_is_waited_for_never_taken_for_damage(tmp_path: Path) -> None:
    """Two builds starting on one store at once: the second waits for the first's write, and the
    index (rows included) is not rebuilt under it."""
    index = RowIndex(tmp_path)
    index.db.execute(f"PRAGMA user_version = {rowindex.LAYOUT}")
    index.add_shard("gk", COMPONENTS, _shard_path(tmp_path, 0, 0), _rows(0, 0))
    index.close()
    holder = sqlite3.connect(tmp_path / "index" / "rows.sqlite", isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    release = threading.Timer(1.0, lambda: holder.execute("COMMIT"))
    release.start()
    with RowIndex.open(tmp_path, sync=False) as waited:
        found = waited.lookup(KEY, [(r["prompt_id"], 0) for r in _rows(0, 0)], 16)
    release.join()
    assert len(found) == ROWS_PER_SHARD, "the rows written before are still there: nothing was rebuilt"


def test_only_a_busy_database_is_retried() -> None:
    calls: list[int] = []

    def busy_twice() -> None:
        calls.append(1)
        if len(calls) < 3:
            raise sqlite3.OperationalError("database is locked")

    rowindex._when_free(busy_twice, seconds=5)
    assert len(calls) == 3
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        rowindex._when_free(lambda: (_ for _ in ()).throw(sqlite3.OperationalError("no such table: x")))
