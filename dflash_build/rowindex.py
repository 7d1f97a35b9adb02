"""Per-row index of published completions, for regenerating rows rather than shards.

Shard targets stay per shard, but before generating, a job looks up every (prompt_id, sample_idx) in
the completions already in the store for the same model, template, template kwargs and sampling
(everything of gen_key but the prompt set and max_new_tokens: the ``reuse_key``). A row's seed
depends only on (seed, prompt_id, sample_idx), so a row generated for another prompt set is a valid
sample of this one. Under a new max_new_tokens M, a row with n output tokens is used:

- whole, when it stopped and n + 1 <= M (it stopped before the limit);
- cut to its first M tokens (a truncated sample under M), when n >= M;
- as a prefix to continue from, when it was truncated with n < M: the engine generates the rest,
  which is as valid a sample as one generated from scratch.

SQLite (WAL, one file per store) keeps the lookup fast at millions of rows and safe for concurrent
jobs. The index is derived data: ``rebuild`` recreates it from the shards' stats sidecars.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_build import hashing

INDEX_FILE = Path("index") / "rows.sqlite"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS rows (
    reuse_key TEXT NOT NULL,
    prompt_id TEXT NOT NULL,
    sample_idx INTEGER NOT NULL,
    gen_key TEXT NOT NULL,
    path TEXT NOT NULL,
    row INTEGER NOT NULL,
    finish_reason TEXT NOT NULL,
    n_output INTEGER NOT NULL,
    max_new_tokens INTEGER NOT NULL,
    PRIMARY KEY (reuse_key, prompt_id, sample_idx, gen_key)
);
CREATE TABLE IF NOT EXISTS shards (path TEXT PRIMARY KEY, gen_key TEXT NOT NULL);
"""


def _outcome(row: dict[str, Any], max_new_tokens: int) -> tuple[str, int, int]:
    return row["finish_reason"], row["n_output_tokens"], max_new_tokens


def reuse_key(gen_components: dict[str, Any]) -> str:
    """gen_key without the prompt set and max_new_tokens: rows under one reuse_key are interchangeable."""
    parts = {k: v for k, v in gen_components.items() if k != "prompt_key"}
    parts["sampling"] = {
        k: v for k, v in parts["sampling"].items() if k not in ("max_new_tokens", "samples_per_prompt")
    }
    return hashing.content_key(parts)


@dataclass(frozen=True)
class Candidate:
    prompt_id: str
    sample_idx: int
    gen_key: str
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


class RowIndex:
    def __init__(self, store: Path) -> None:
        self.path = store / INDEX_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, timeout=60)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(_SCHEMA)

    def close(self) -> None:
        self.db.close()

    def add_shard(
        self, key: str, gen_key: str, path: Path, rows: Iterable[dict[str, Any]], max_new_tokens: int
    ) -> None:
        """Index a published completion shard (multi-turn rows are not reused, so not indexed)."""
        with self.db:
            self.db.execute("DELETE FROM rows WHERE path = ?", (str(path),))
            self.db.executemany(
                "INSERT OR REPLACE INTO rows VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (*(key, r["prompt_id"], r["sample_idx"], gen_key, str(path), i), *_outcome(r, max_new_tokens))
                    for i, r in enumerate(rows)
                    if r["finish_reason"] in ("stop", "length") and not r.get("turns")
                ],
            )
            self.db.execute("INSERT OR REPLACE INTO shards VALUES (?, ?)", (str(path), gen_key))

    def remove_shard(self, path: Path) -> None:
        with self.db:
            self.db.execute("DELETE FROM rows WHERE path = ?", (str(path),))
            self.db.execute("DELETE FROM shards WHERE path = ?", (str(path),))

    def lookup(
        self, key: str, wanted: Iterable[tuple[str, int]], max_new_tokens: int, exclude_gen_key: str
    ) -> dict[tuple[str, int], Candidate]:
        """The best usable earlier row for each wanted (prompt_id, sample_idx)."""
        best: dict[tuple[str, int], Candidate] = {}
        wanted = list(wanted)
        for start in range(0, len(wanted), 500):
            chunk = wanted[start : start + 500]
            ids = sorted({pid for pid, _ in chunk})
            marks = ",".join("?" * len(ids))
            cursor = self.db.execute(
                f"SELECT prompt_id, sample_idx, gen_key, path, row, finish_reason, n_output, max_new_tokens "
                f"FROM rows WHERE reuse_key = ? AND gen_key != ? AND prompt_id IN ({marks})",
                (key, exclude_gen_key, *ids),
            )
            keys = set(chunk)
            for values in cursor:
                cand = Candidate(*values)
                pair = (cand.prompt_id, cand.sample_idx)
                if pair not in keys:
                    continue
                # a whole or cut row costs nothing; among continuations the longest prefix wastes least
                old = best.get(pair)
                if old is None or _rank(cand, max_new_tokens) > _rank(old, max_new_tokens):
                    best[pair] = cand
        return best


def rebuild(store: Path) -> int:
    """Recreate the index from every completion shard's stats sidecar; returns the shard count."""
    import pyarrow.parquet as pq

    index_file = store / INDEX_FILE
    for suffix in ("", "-wal", "-shm"):
        Path(str(index_file) + suffix).unlink(missing_ok=True)
    index = RowIndex(store)
    count = 0
    for stats_file in sorted((store / "completions").glob("*/*/*.stats.json")):
        data = stats_file.with_name(stats_file.name.replace(".stats.json", ".parquet"))
        if not data.exists():
            continue
        stats = json.loads(stats_file.read_text())
        rows = pq.read_table(
            data, columns=["prompt_id", "sample_idx", "finish_reason", "n_output_tokens", "turns"]
        ).to_pylist()
        components = stats["components"]
        index.add_shard(reuse_key(components), stats["gen_key"], data, rows, components["sampling"]["max_new_tokens"])
        count += 1
    index.close()
    return count
