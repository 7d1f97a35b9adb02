"""The workflow's changes to Snakemake's own behaviour (dflash_build.snakemake_fixes) apply to the pinned
Snakemake: each finds the code it was written for. A Snakemake release that changed that code fails here,
so the pin and the fix are revisited together (the builds that rely on them are workflow tests)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_build import snakemake_fixes


def test_every_fix_finds_the_code_it_was_written_for() -> None:
    assert snakemake_fixes.apply() == []
    assert snakemake_fixes.fix_needrun_behind_ancient_inputs()
    assert snakemake_fixes.quiet_restore_without_backup()
    assert snakemake_fixes.fix_sigterm_during_job_selection()
    from snakemake.dag import DAG
    from snakemake.persistence import FileBackupMixin, PersistenceBase

    assert getattr(DAG.update_needrun, "dflash_fixed", False)
    assert getattr(PersistenceBase._input, "dflash_fixed", False)
    assert getattr(FileBackupMixin.restore_output, "dflash_fixed", False)


def test_a_recorded_inputs_method_of_other_code_is_left_alone_and_named_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """record_order_only_inputs_apart checks the code it wraps, as the other fixes do: a
    ``PersistenceBase._input`` that records its inputs another way is not wrapped, and the workflow stops
    in one line naming the fix (unless DFLASH_BUILD_SNAKEMAKE_UNFIXED is 1, where the fix is left out)."""
    from snakemake.persistence import PersistenceBase

    def _input(self: object, job: object) -> list[str]:  # a release that records its inputs another way
        return []

    monkeypatch.setattr(PersistenceBase, "_input", _input)
    monkeypatch.delenv(snakemake_fixes.UNFIXED_ENV, raising=False)
    assert snakemake_fixes.record_order_only_inputs_apart() is False
    assert PersistenceBase._input is _input
    with pytest.raises(SystemExit) as stopped:
        snakemake_fixes.apply()
    said = str(stopped.value.code)
    assert "\n" not in said and said.startswith("dflash-build: Snakemake "), said
    assert "its code is not what record_order_only_inputs_apart was written for" in said, said
    monkeypatch.setenv(snakemake_fixes.UNFIXED_ENV, "1")
    assert snakemake_fixes.apply() == ["record_order_only_inputs_apart"]
    assert PersistenceBase._input is _input


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


# A stub release: the installed Snakemake with its version, or the code one fix was written for, changed
# before the workflow's Snakefile reads it (sitecustomize runs at the interpreter's start).
STUB_VERSION = "import snakemake\nsnakemake.__version__ = '9.31.0'\n"
STUB_SCHEDULER = """
from snakemake.scheduling import job_scheduler
_init = job_scheduler.JobScheduler.__init__
def __init__(self, *args, **kwargs):  # a release that took another lock
    _init(self, *args, **kwargs)
job_scheduler.JobScheduler.__init__ = __init__
"""

STUB_RECORDED_INPUTS = """
from snakemake import persistence
def _input(self, job):  # a release that records its inputs another way
    return sorted(str(f) for f in job.input)
persistence.PersistenceBase._input = _input
"""


@pytest.mark.parametrize(
    ("stub", "said"),
    [
        (STUB_VERSION, "Snakemake 9.31.0: it is not tested (tested: 9.27.1)"),
        (STUB_SCHEDULER, "its code is not what fix_sigterm_during_job_selection was written for"),
        (STUB_RECORDED_INPUTS, "its code is not what record_order_only_inputs_apart was written for"),
    ],
)
def test_a_snakemake_the_fixes_were_not_written_for_stops_the_workflow_in_one_line(
    tmp_path: Path, stub: str, said: str
) -> None:
    from tests.conftest import REPO

    (tmp_path / "stub").mkdir()
    (tmp_path / "stub" / "sitecustomize.py").write_text(stub)
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--lint"]
    command += ["--configfile", str(REPO / "config" / "demo.yaml"), "--directory", str(REPO)]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'stub'}{os.pathsep}{REPO}"}
    env.pop(snakemake_fixes.UNFIXED_ENV, None)
    stopped = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    lines = [li for li in stopped.stderr.splitlines() if li.startswith("dflash-build:")]
    assert stopped.returncode != 0 and len(lines) == 1 and said in lines[0], stopped.stderr[-3000:]
    assert f"{snakemake_fixes.UNFIXED_ENV}=1" in lines[0] and "Traceback" not in stopped.stderr
    if stub != STUB_VERSION:
        return  # the opt-out, once
    opted_out = subprocess.run(
        command, env={**env, snakemake_fixes.UNFIXED_ENV: "1"}, capture_output=True, text=True, timeout=300
    )
    assert opted_out.returncode == 0 and "dflash-build: Snakemake" not in opted_out.stderr, opted_out.stderr[-3000:]
