from __future__ import annotations

from pathlib import Path

from dflash_build.journal import Journal


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
    again.remove()
    assert not (tmp_path / "j").exists()


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
