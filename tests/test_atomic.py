from __future__ import annotations

import os
import stat
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_build.store import atomic


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    dest = tmp_path / "out.json"
    atomic.write_json(dest, {"v": 1})
    with pytest.raises(RuntimeError), atomic.atomic_open(dest) as f:
        f.write('{"v": 2')
        raise RuntimeError("killed mid-write")
    assert dest.read_text().strip().endswith("}")
    assert '"v": 1' in dest.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_parquet_and_folder_swaps(tmp_path: Path) -> None:
    atomic.write_parquet(tmp_path / "t.parquet", pa.table({"a": [1, 2]}))
    assert pq.read_table(tmp_path / "t.parquet")["a"].to_pylist() == [1, 2]
    target = tmp_path / "dist"
    for version in ("one", "two"):
        with atomic.atomic_dir(target) as tmp:
            atomic.write_text(tmp / "v.txt", version)
    assert (target / "v.txt").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dist", "t.parquet"]


def test_link_gives_a_second_name_that_outlives_the_first(tmp_path: Path) -> None:
    src = tmp_path / "journal" / "published.parquet"
    src.parent.mkdir()
    src.write_bytes(b"shard")
    dest = tmp_path / "out" / "00000.parquet"
    dest.parent.mkdir()
    dest.write_bytes(b"stale")  # replaced whole
    atomic.link(src, dest)
    assert dest.read_bytes() == b"shard" and dest.stat().st_ino == src.stat().st_ino
    dest.unlink()
    assert src.read_bytes() == b"shard"
    assert not list(dest.parent.glob(".*.tmp")), "no temporary left behind"


def test_published_files_and_folders_get_the_modes_a_plain_write_gives(tmp_path: Path) -> None:
    """Temporaries are private (mkstemp: 0600); what they become must be readable as usual."""
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    os.mkdir(tmp_path / "plain-dir")
    atomic.write_text(tmp_path / "a.txt", "x")
    atomic.write_parquet(tmp_path / "a.parquet", pa.table({"x": [1]}))
    with atomic.atomic_dir(tmp_path / "d") as d:
        atomic.write_json(d / "m.json", {})
    mode = stat.S_IMODE
    assert mode((tmp_path / "a.txt").stat().st_mode) == mode(plain.stat().st_mode)
    assert mode((tmp_path / "a.parquet").stat().st_mode) == mode(plain.stat().st_mode)
    assert mode((tmp_path / "d").stat().st_mode) == mode((tmp_path / "plain-dir").stat().st_mode)
    assert mode((tmp_path / "d" / "m.json").stat().st_mode) == mode(plain.stat().st_mode)
