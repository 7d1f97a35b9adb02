"""The workflow's changes to Snakemake's own behaviour (dflash_build.snakemake_fixes) apply to the pinned
Snakemake: each finds the code it was written for. A Snakemake release that changed that code fails here,
so the pin and the fix are revisited together (the builds that rely on them are workflow tests)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from dflash_build import snakemake_fixes


def test_every_fix_finds_the_code_it_was_written_for() -> None:
    snakemake_fixes.apply()
    assert snakemake_fixes.fix_needrun_behind_ancient_inputs()
    assert snakemake_fixes.quiet_restore_without_backup()
    assert snakemake_fixes.fix_sigterm_during_job_selection()
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


# Snakemake's job selection, held up with the scheduler's lock taken (the soak caught a SIGTERM there)
SLOW_SELECTION = """
import os, pathlib, time
from snakemake.scheduling import job_scheduler

_update = job_scheduler.JobScheduler.update_available_resources


def update_available_resources(self, selected):
    marker = pathlib.Path(os.environ["DFLASH_TEST_SELECTING"])
    if not marker.exists():
        marker.write_text(str(os.getpid()))
        time.sleep(4)
    return _update(self, selected)


job_scheduler.JobScheduler.update_available_resources = update_available_resources
"""


@pytest.mark.workflow
def test_a_sigterm_while_snakemake_selects_jobs_ends_the_build(tmp_path: Path, tiny_model: Path) -> None:
    """The fault soak's find (bench/soak.py, seed 7, term-build): SIGTERM while Snakemake selected jobs
    deadlocked it (its handler waited for the lock the interrupted thread held). It ends now, as a
    SIGTERM at any other time does, and the next build finishes."""
    import os
    import signal
    import subprocess

    from tests.conftest import Workflow, base_config, write_jsonl

    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(SLOW_SELECTION)
    write_jsonl(tmp_path / "p.jsonl", [{"instruction": f"Say {i}."} for i in range(4)])
    sources = {"s": {"category": "c", "files": [str(tmp_path / "p.jsonl")], "format": "alpaca"}}
    wf = Workflow.at(tmp_path / "w", base_config(tiny_model, sources))
    wf.pythonpath = plant
    marker = tmp_path / "selecting"
    cmd, env = wf.command(env_extra={"DFLASH_TEST_SELECTING": str(marker)})
    proc = subprocess.Popen(
        cmd, cwd=wf.workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "Snakemake reached its job selection"
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) != 0, "the build stops on SIGTERM"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError("Snakemake did not end within 60 s of a SIGTERM during its job selection")
    wf.pythonpath = None
    wf.run("--unlock")
    wf.run("--rerun-incomplete")
