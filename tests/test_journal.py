from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from dflash_build.store.journal import Journal


def test_rows_survive_and_a_torn_tail_is_cut(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j", flush_rows=2, flush_seconds=3600)
    for i in range(3):
        journal.append({"prompt_id": f"p{i}", "sample_idx": 0})
    journal.close()
    with open(journal.path, "a") as f:
        f.write('{"prompt_id": "p3", "samp')  # a kill mid-write
    again = Journal(tmp_path / "j", 1, 0)
    assert [r["prompt_id"] for r in again.load()] == ["p0", "p1", "p2"]
    again.append({"prompt_id": "p3", "sample_idx": 0})
    again.close()
    assert [r["prompt_id"] for r in Journal(tmp_path / "j", 1, 0).load()] == ["p0", "p1", "p2", "p3"]
    again.retire()
    assert not again.path.exists() and (tmp_path / "j").is_dir(), "retired: rows go, the folder stays"


def test_a_damaged_line_costs_its_row_only(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j", flush_rows=1, flush_seconds=0)
    for i in range(3):
        journal.append({"prompt_id": f"p{i}", "sample_idx": 0})
    journal.close()
    lines = journal.path.read_bytes().splitlines(keepends=True)
    journal.path.write_bytes(lines[0] + b"\xff\x00garbage\n" + b"[1, 2]\n" + lines[2])
    assert [r["prompt_id"] for r in journal.load()] == ["p0", "p2"]


def test_a_second_job_on_the_shard_waits_for_the_first(tmp_path: Path) -> None:
    """Two processes (as from two working directories on one store): the second holds the lock only after."""
    folder = tmp_path / "j"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pathlib import Path\n"
            "from dflash_build.store.journal import Journal\n"
            f"with Journal(Path({str(folder)!r}), 1, 0).locked('a'):\n"
            "    print('held', flush=True)\n"
            "    time.sleep(1.5)\n"
            f"    Path({str(tmp_path / 'done')!r}).write_text('x')\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    assert "pid" in (folder / "lock").read_text(), "the lock says who holds it"
    start = time.monotonic()
    with Journal(folder, 1, 0).locked("b"):
        waited = time.monotonic() - start
        assert (tmp_path / "done").exists(), "the first job had finished its work under the lock"
    assert waited > 0.5
    holder.wait()


def test_sync_policy_by_rows(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j", flush_rows=2, flush_seconds=3600)
    journal.append({"a": 1})
    assert journal.path.read_text() == ""  # buffered until the second row
    journal.append({"a": 2})
    assert len(journal.path.read_text().splitlines()) == 2
    journal.close()


def test_read_only_view_skips_a_torn_tail_and_changes_nothing(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j", flush_rows=1, flush_seconds=0)
    journal.append({"prompt_id": "p0", "sample_idx": 0})
    journal.close()
    with open(journal.path, "a") as f:
        f.write('{"prompt_id": "p1"')
    before = journal.path.read_bytes()
    assert [r["prompt_id"] for r in Journal.read(journal.path)] == ["p0"]
    assert journal.path.read_bytes() == before
    assert Journal.read(tmp_path / "absent" / "rows.jsonl") == []
