"""The workflow's changes to Snakemake's own behaviour (dflash_build.snakemake_fixes) apply to the pinned
Snakemake: each finds the code it was written for. A Snakemake release that changed that code fails here,
so the pin and the fix are revisited together (the builds that rely on them are workflow tests)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dflash_build import snakemake_fixes


def test_every_fix_finds_the_code_it_was_written_for() -> None:
    snakemake_fixes.apply()
    assert snakemake_fixes.fix_needrun_behind_ancient_inputs()
    assert snakemake_fixes.quiet_restore_without_backup()
    from snakemake.dag import DAG
    from snakemake.persistence import FileBackupMixin, PersistenceBase

    assert getattr(DAG.update_needrun, "dflash_fixed", False)
    assert getattr(PersistenceBase._input, "dflash_fixed", False)
    assert getattr(FileBackupMixin.restore_output, "dflash_fixed", False)


def test_a_failed_update_output_with_no_earlier_version_is_not_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Snakemake's own backup store: an output that had a version before is restored as before; one that
    had none (a new shard whose job failed) returns False without "Cannot restore ...: no backup found"."""
    snakemake_fixes.apply()
    from snakemake.persistence import FileBackupMixin

    class Backups(FileBackupMixin):
        def __init__(self, path: Path) -> None:
            self.path = path

    backups = Backups(tmp_path / ".snakemake")
    kept = tmp_path / "kept.parquet"
    kept.write_text("v1")
    backups.backup_output(kept)
    kept.write_text("half-written")
    new = tmp_path / "new.parquet"
    new.write_text("half-written")
    with caplog.at_level(logging.WARNING):
        assert backups.restore_output(kept) is True
        assert backups.restore_output(new) is False
    assert kept.read_text() == "v1"
    assert "no backup found" not in caplog.text
