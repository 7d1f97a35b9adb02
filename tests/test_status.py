"""`dflash-build status` on a real build while it runs and after it finished, in text and JSON."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from dflash_build.store.journal import PUBLISHED_DATA, ROWS_FILE, Journal
from tests.conftest import Workflow, base_config, own_engines, write_jsonl

pytestmark = pytest.mark.workflow

PROMPTS = [f"Tell me about item {i} of the list." for i in range(24)]


def _journaled(store: Path) -> int:
    """Rows finished in the store right now: published shards and journals of unpublished ones."""
    import pyarrow.parquet as pq

    rows = 0
    for folder in store.glob("journal/*/*"):
        if (folder / PUBLISHED_DATA).exists():
            rows += pq.read_metadata(folder / PUBLISHED_DATA).num_rows
        else:
            rows += len({(r["prompt_id"], r["sample_idx"]) for r in Journal.read(folder / ROWS_FILE)})
    return rows


def _status(wf: Workflow, *args: str) -> dict[str, Any]:
    return json.loads(wf.cli("status", "--json", *args).stdout)


def _screen(status: dict[str, Any]) -> str:
    """The --watch screen (rich) for a status, as text."""
    from rich.console import Console

    from dflash_build.ops.status import Job, Screen, SourceStatus, Status

    sources = [SourceStatus(**s) for s in status["sources"]]
    jobs = [Job(**j) for j in status["jobs"]]
    console = Console(record=True, width=100, force_terminal=False, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(Screen().frame(Status(**{**status, "sources": sources, "jobs": jobs})))
    return console.export_text()


def test_status_follows_a_build_in_progress_and_says_done_at_the_end(tmp_path: Path, tiny_model: Path) -> None:
    data = write_jsonl(tmp_path / "p.jsonl", [{"instruction": p} for p in PROMPTS])
    config = base_config(tiny_model, {"s": {"category": "c", "files": [str(data)], "format": "alpaca"}}, shard_size=8)
    config["sampling"]["max_new_tokens"] = 96  # a few seconds a shard: time to look while it runs
    own_engines(config, tmp_path / "locks", journal_flush_rows=1)  # and at the end no engine is running
    wf = Workflow.at(tmp_path / "work", config)
    store = wf.workdir / "store"
    cmd, env = wf.command()
    build = subprocess.Popen(cmd, cwd=wf.workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    watch = subprocess.Popen(
        [*wf.cli_command("status", "--watch", "0.3", "--json")], cwd=wf.workdir, stdout=subprocess.PIPE, text=True
    )
    try:
        seen = None
        deadline = time.monotonic() + 300
        while seen is None and time.monotonic() < deadline and build.poll() is None:
            before = _journaled(store)
            status = _status(wf)
            after = _journaled(store)
            if status["jobs"] and 0 < status["rows_done"] < len(PROMPTS):
                seen = (before, status, after)
            time.sleep(0.2)
        assert seen is not None, "never caught the build in progress"
        before, status, after = seen
        assert before <= status["rows_done"] <= after, "the numbers are the journals' at that moment"
        assert status["rows"] == len(PROMPTS) and not status["done"]
        assert status["rows_per_second"] > 0 and status["eta_seconds"] > 0
        for job in status["jobs"]:
            assert Path(f"/proc/{job['pid']}").exists(), "a running job is a live process"
            assert 0 <= job["rows_done"] <= job["rows"] == 8
        screen = _screen(status)  # what --watch draws on a terminal for these numbers
        assert f"{status['rows_done']}/{len(PROMPTS)}" in screen and "ETA " in screen, screen
        assert f"jobs running: {len(status['jobs'])}" in screen
        assert build.wait(timeout=600) == 0
        lines = [json.loads(line) for line in watch.communicate(timeout=120)[0].splitlines()]
    finally:
        build.kill()
        watch.kill()
    assert len(lines) >= 2 and lines[-1]["done"], "--watch refreshes until the build is done, then ends"
    done = [line["rows_done"] for line in lines]
    assert done == sorted(done), "rows done never go back"

    final = _status(wf)
    assert final["done"] and final["rows_done"] == final["rows"] == len(PROMPTS) == _journaled(store)
    assert final["eta_seconds"] is None and final["jobs"] == []
    assert [(s["source"], s["shards_done"], s["shards"]) for s in final["sources"]] == [("s", 3, 3)]
    plain = wf.cli("status").stdout
    assert plain.startswith(f"rows {len(PROMPTS)}/{len(PROMPTS)} (100.0%)") and "; done" in plain
    assert "jobs running: 0" in plain and "engines running: 0" in plain


def test_status_says_when_no_snakemake_runs_the_build_and_the_plain_rerun_finishes_it(
    tmp_path: Path, tiny_model: Path
) -> None:
    """kill -9 of Snakemake mid-build: status names every job still running by its own record, then (the
    orphaned jobs done) no ETA and what to run; the plain command then finishes the build with no row
    generated again (no --unlock, no --rerun-incomplete: issue 71)."""
    import signal

    from dflash_build.engines import host as engine_host
    from tests.conftest import wait_until

    data = write_jsonl(tmp_path / "p.jsonl", [{"instruction": p} for p in PROMPTS])
    config = base_config(tiny_model, {"s": {"category": "c", "files": [str(data)], "format": "alpaca"}}, shard_size=8)
    config["sampling"]["max_new_tokens"] = 96
    own_engines(config, tmp_path / "locks", journal_flush_rows=1)
    wf = Workflow.at(tmp_path / "work", config)
    cmd, env = wf.command()
    build = subprocess.Popen(cmd, cwd=wf.workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                             start_new_session=True)  # fmt: skip
    try:
        wait_until(lambda: _journaled(wf.workdir / "store") > 0, 300, "a row journaled")
        running = _status(wf)
        assert running["build"] is not None and running["build"]["pid"] == build.pid, running["build"]
        assert running["jobs"] and all(Path(f"/proc/{j['pid']}").exists() for j in running["jobs"])
        os.kill(build.pid, signal.SIGKILL)
        build.wait()
        killed = _status(wf)
        assert killed["build"] is None and killed["eta_seconds"] is None
        plain = wf.cli("status").stdout
        assert "no Snakemake runs this build now: run it again to go on" in plain.splitlines()[0], plain
        wait_until(lambda: not engine_host.processes(session=build.pid), 300, "the orphaned jobs finished")
    finally:
        if build.poll() is None:
            build.kill()
    before = _journaled(wf.workdir / "store")
    rerun = wf.run()  # the plain command
    assert "removed the locks of a run that ended without releasing them" in rerun.stdout + rerun.stderr
    final = _status(wf)
    assert final["done"] and final["rows_done"] == len(PROMPTS)
    generated = sum(
        json.loads(p.read_text())["generated"] for p in (wf.workdir / "store").glob("completions/*/*/*.stats.json")
    )
    assert generated == len(PROMPTS), "each row generated once: the killed run's by it, the rest by the rerun"
    assert 0 < before <= len(PROMPTS)
    # Snakemake deletes a log before it runs its job again: every run's lines stay in the history beside it
    histories = list(wf.workdir.glob("logs/completions/*/*/*.log.history"))
    assert len(histories) == len(list(wf.workdir.glob("logs/completions/*/*/*.log")))
    runs = [p.read_text().count("---- a run of this job") for p in histories]
    assert max(runs) == 2 and all(n >= 1 for n in runs), runs
    rerun_history = next(p.read_text() for p in histories if p.read_text().count("---- a run of this job") == 2)
    assert "published" in rerun_history.split("---- a run of this job")[1], "the first run's lines are kept"
