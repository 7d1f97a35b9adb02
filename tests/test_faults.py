"""Fault suite: whatever dies or misbehaves, no finished row is generated twice, and after recovery the
dataset equals an uninterrupted build's (same rows, same token ids: the same files, byte for byte).

Real workflow runs: one matrix of which process dies where (Snakemake, a job, the engine, every process;
SIGKILL, SIGTERM, a hang) from one prepared store to one uninterrupted dataset, two working directories
building at once on one store, a stand-in OpenAI server that misbehaves in each way seen in production, and
damaged derived state (fingerprint cache, row index, journals, a killed mix's temporary folder).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from dflash_build import killpoints
from dflash_build.engines import host as engine_host
from dflash_build.killpoints import KILL_AT_ENV
from dflash_build.store.journal import PUBLISHED_DATA, PUBLISHED_STATS, ROWS_FILE, Journal
from dflash_build.store.layout import prepare_rule_name
from tests.conftest import (
    Workflow,
    base_config,
    engine_history,
    job_logs,
    loaded_rows,
    lock_free,
    once_per_session,
    own_engines,
    wait_until,
    write_jsonl,
)
from tests.standin_server import StandIn

pytestmark = pytest.mark.workflow

SHARD_SIZE = 8  # three shards of the 24 prompts
PROMPTS = [f"question {i}: " + " ".join(["alpha", "beta", "gamma", "delta"][: 1 + i % 4]) for i in range(24)]


def _config(
    root: Path, model: Path, sources: tuple[str, ...] = ("s",), store: str = "store", shard_size: int = SHARD_SIZE
) -> dict[str, Any]:
    """24 prompts in three shards: two jobs run at once and a third waits, so a kill finds shards
    published, in flight and not started."""
    data = write_jsonl(root / "data" / "p.jsonl", [{"instruction": p} for p in PROMPTS])
    config = base_config(
        model,
        {name: {"category": "c", "files": [str(data)], "format": "alpaca"} for name in sources},
        shard_size=shard_size,
    )
    config["store"] = store
    if len(sources) > 1:  # one prompt file for every source on purpose: each keeps its own samples
        config["dedup"] = {"across_sources": False}
    config["engine"]["journal_flush_rows"] = 1
    config["sampling"]["max_new_tokens"] = 12
    return config


def dataset(wf: Workflow) -> list[tuple[str, str]]:
    """The built dataset's files and their content hashes (the names carry a digest of the content too)."""
    manifest = json.loads((wf.workdir / "dist" / "test-mix" / "manifest.json").read_text())
    return [(f["path"], f["sha256"]) for f in manifest["files"]]


def sidecars(store: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """Completion sidecars by (gen_key, shard)."""
    out = {}
    for path in store.glob("completions/*/*/*.stats.json"):
        stats = json.loads(path.read_text())
        out[(stats["gen_key"], stats["shard"])] = stats
    return out


def finished_rows(store: Path) -> dict[tuple[str, str], tuple[int, bool]]:
    """What the store holds for each shard before a recovery: (rows finished, published)."""
    out = {}
    for folder in store.glob("journal/*/*"):
        key = (folder.parent.name, folder.name)
        if (folder / PUBLISHED_DATA).exists():
            out[key] = (pq.read_metadata(folder / PUBLISHED_DATA).num_rows, True)
        else:
            rows = Journal.read(folder / ROWS_FILE)
            out[key] = (len({(r["prompt_id"], r["sample_idx"]) for r in rows if r.get("turn") == 0}), False)
    return out


def wait_session_gone(session: int) -> None:
    """Until the jobs a killed Snakemake left finish what they were doing, as after a real scheduler crash."""
    # a build started in its own session is Snakemake, its jobs and the warm runner that ends with it (an engine
    # host starts a session of its own)
    finished = f"the jobs of the killed build (session {session}) finished"
    wait_until(lambda: not engine_host.processes(session=session), 120, finished)


def recover(wf: Workflow, *args: str, cores: int = 2) -> subprocess.CompletedProcess[str]:
    """The recovery after any crash: the plain command (the profile reruns incomplete outputs, the workflow
    removes a dead run's locks)."""
    return wf.run(*args, cores=cores)


def generated_in_logs(workdir: Path) -> dict[tuple[str, str], int]:
    """Rows each generate job of a working directory reports it generated (0 for a restore)."""
    out: dict[tuple[str, str], int] = {}
    for log in workdir.glob("logs/completions/*/*/*.log"):
        text = log.read_text()
        key = (log.parent.name, log.stem)
        if "nothing generated" in text:
            out[key] = out.get(key, 0)
        for match in re.finditer(r"published \{.*'generated': (\d+)", text):
            out[key] = out.get(key, 0) + int(match.group(1))
    return out


# -- kill and resume: which process dies, and where ------------------------------------------------
@pytest.fixture(scope="module")
def built_once(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> tuple[Path, float]:
    """The module's config prepared (``prepared``: every kill starts from a copy of it) and built on
    uninterrupted (``work``: the dataset every recovery must give, copied by the tests that damage it);
    and the seconds from prepared to built."""

    def build(root: Path) -> None:
        prepared = Workflow.at(root / "prepared", _config(root, tiny_model))
        prepared.run("--until", prepare_rule_name("s"))
        wf = prepared.copy_to(root / "work")
        start = time.monotonic()
        wf.build()
        (root / "seconds").write_text(str(time.monotonic() - start))

    root = once_per_session(tmp_path_factory, "faults-uninterrupted", build)
    return root, float((root / "seconds").read_text())


@pytest.fixture(scope="module")
def uninterrupted(built_once: tuple[Path, float]) -> list[tuple[str, str]]:
    return dataset(Workflow(built_once[0] / "work"))


@dataclasses.dataclass(frozen=True)
class Kill:
    """One case of the matrix: what dies where (``DFLASH_BUILD_KILL_AT``, or ``random:SEED`` for a
    SIGKILL of Snakemake from outside at a random time), and where the rows are decoded: ``worker`` (the
    pytest worker's long-lived engine), ``job`` (in the generate job), ``served`` (a shared engine this
    build starts), ``gpus`` (shared engines this build starts on two fake GPUs, stopping after 3 s idle)."""

    at: str
    engine: str = "worker"

    @property
    def kind(self) -> str:
        return killpoints.parse(self.at)[0]

    @property
    def n(self) -> int:
        """The point's number: rows journaled, the decoding step, or the random time's seed."""
        return killpoints.parse(self.at)[1]


KILLS = [
    *(Kill(f"random:{seed}") for seed in range(3)),  # Snakemake, from outside: its jobs finish orphaned
    Kill("rows:0"),  # a generate job, SIGKILL: once its engine answers, before its first row
    Kill("rows:4"),  # ... halfway through its shard
    Kill("publish"),  # ... after its last row, before its shard is written
    Kill("sigterm:2", "job"),  # a generate job, SIGTERM (Snakemake's shutdown): its engine stops in the job
    Kill("sigterm:2", "served"),  # ... its requests are cancelled; the engine stays for the rerun
    Kill("hang:14", "job"),  # the engine, wedged mid-decoding: the job's heartbeat stops the job
    Kill("group-sigterm:2", "job"),  # every process, SIGTERM: Ctrl-C in a terminal, a SLURM preemption
    Kill("group-sigkill:2", "gpus"),  # every process, SIGKILL: a lost node; the engines outlive the jobs
]


def _with_engine(config: dict[str, Any], kill: Kill, locks: Path) -> tuple[dict[str, Any], tuple[str, ...], int]:
    """The config the fault runs under, and Snakemake's extra arguments and cores. No engine setting is
    keyed: every one of them builds the uninterrupted dataset."""
    config = copy.deepcopy(config)
    if kill.engine == "job":
        config["engine"] = {**config["engine"], "shared": False}
        if kill.kind == "hang":
            config["engine"]["stall_timeout"] = 1.5
    elif kill.engine == "served":
        own_engines(config, locks, shared=True, idle_timeout=60)
    elif kill.engine == "gpus":
        own_engines(config, locks, gpus=["0", "1"], shared=True, idle_timeout=3)
        return config, ("--resources", "gpu=2"), 6
    return config, (), 2


def _inflict(kill: Kill, wf: Workflow, args: tuple[str, ...], cores: int, seconds: float) -> float:
    """Run the build to the fault in a session of its own (a group signal reaches nothing else) and wait
    for every job it left; the wall seconds."""
    cmd, env = wf.command(*args, cores=cores, env_extra={} if kill.kind == "random" else {KILL_AT_ENV: kill.at})
    start = time.monotonic()
    with open(wf.workdir / "killed.log", "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=wf.workdir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            if kill.kind == "random":
                proc.wait(timeout=random.Random(kill.n).uniform(0.3, 0.9) * seconds)
            else:
                assert proc.wait(timeout=600) != 0, "the fault fails the build"
        except subprocess.TimeoutExpired:
            if kill.kind != "random":
                raise
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
    elapsed = time.monotonic() - start
    wait_session_gone(proc.pid)
    return elapsed


def _check_what_the_fault_left(kill: Kill, wf: Workflow, before: dict[tuple[str, str], tuple[int, bool]]) -> None:
    """What each kind of fault leaves before the recovery (a kill of Snakemake at a random time: anything)."""
    logs = job_logs(wf)
    if kill.kind in ("rows", "publish"):
        assert not list(wf.workdir.glob("store/completions/*/*/*.parquet")), "a killed job publishes nothing"
        journaled = SHARD_SIZE if kill.kind == "publish" else kill.n
        assert all(rows == journaled and not published for rows, published in before.values()), before
        assert kill.n == 0 or before, "the killed jobs' rows are journaled"
    if kill.kind == "sigterm":
        stops = re.findall(r"stopped by SIGTERM; the (\d+) rows finished in this run are kept in", logs)
        assert stops and all(int(n) >= kill.n for n in stops), logs[-2000:]
        assert before and all(rows >= kill.n and not published for rows, published in before.values())
    if kill.kind == "group-sigterm":
        assert "stopped by SIGTERM" in logs, (wf.workdir / "killed.log").read_text()[-3000:]
    if kill.kind == "hang":
        assert "hanging at decoding step 14" in logs, "the engine hung in its second batch of 4"
        assert re.search(r"no answer from the in-process transformers engine for \d+s while \d+ requests", logs)
        assert "It runs in this job, so it cannot be replaced: the rows finished so far are kept in" in logs
        assert sum(rows for rows, _ in before.values()) > 0, "rows that stopped before the hang are journaled"


def _check_the_engines_outlived_the_jobs(locks: Path, workdir: Path) -> None:
    """After a SIGKILL of every process of the build: its engines (their own session) stop once idle and
    free their GPUs."""
    states = engine_host.running(locks)
    assert states and all(engine_host.alive(s["pid"]) for s in states), "the engines outlive the jobs"
    wait_until(
        lambda: not any(engine_host.alive(s["pid"]) or engine_host.alive(s["server_pid"]) for s in states),
        30,
        "idle engines stopped",
    )
    history = engine_history(workdir / "logs")
    assert history and all(h["reason"] == "idle for 3s" for h in history)
    for s in states:
        assert lock_free(locks / f"{s['slot']}.lock"), f"{s['slot']}'s lock is held after its host is gone"


@pytest.mark.parametrize("kill", KILLS, ids=[f"{k.at}-{k.engine}-engine" for k in KILLS])
def test_whatever_dies_wherever_the_recovery_generates_only_unfinished_rows_and_gives_the_same_dataset(
    tmp_path: Path, built_once: tuple[Path, float], uninterrupted: list[tuple[str, str]], kill: Kill
) -> None:
    """Each case starts from the same prepared store and must end at the same dataset, byte for byte."""
    root, seconds = built_once
    wf = Workflow(root / "prepared").copy_to(tmp_path / "work")
    served = yaml.safe_load((wf.workdir / "config.yaml").read_text())
    config, args, cores = _with_engine(served, kill, tmp_path / "locks")
    wf.write_config(config)
    elapsed = _inflict(kill, wf, args, cores, seconds)
    if kill.kind == "hang":
        assert elapsed < 120, f"stall_timeout 1.5 s and a 10 s grace held the build {elapsed:.0f}s"
    if kill.kind == "group-sigkill":
        _check_the_engines_outlived_the_jobs(tmp_path / "locks", wf.workdir)
    store = wf.workdir / "store"
    before, sidecars_before = finished_rows(store), sidecars(store)
    _check_what_the_fault_left(kill, wf, before)

    if kill.engine == "job":  # the rerun on the worker's engine, as a user's next run may well be
        wf.write_config(served)
    recover(wf, *args, cores=cores)
    if kill.kind == "random":
        again = wf.run()
        assert "Nothing to be done" in again.stdout + again.stderr, "the recovery finished the build"
    assert dataset(wf) == uninterrupted
    check_recovered_sidecars(store, before, sidecars_before)


def check_recovered_sidecars(
    store: Path, before: dict[tuple[str, str], tuple[int, bool]], sidecars_before: dict[tuple[str, str], Any]
) -> None:
    """After a recovery: a shard published before it keeps its generation's numbers, with a record of the
    restore; any other generated exactly the rows that were not finished, and resumed the ones that were."""
    assert not list(store.glob(f"journal/*/*/{ROWS_FILE}")), "a journal's rows go once its shard is published"
    for key, stats in sidecars(store).items():
        assert stats["input_rows"] == stats["ok"] + stats["truncated"] + stats["error"] + stats["skipped"], key
        if stats == sidecars_before.get(key):
            continue  # Snakemake knew this shard was complete: no job ran
        rows_before, published = before.get(key, (0, False))
        if published:
            generation = json.loads((store / "journal" / key[0] / key[1] / PUBLISHED_STATS).read_text())
            assert stats == {**generation, "restored": stats["restored"]}, f"{key}: the restore rewrote its numbers"
            assert stats["generated"] > 0 and stats["output_tokens_per_second"] > 0
        else:
            assert "restored" not in stats
            assert stats["generated"] == stats["input_rows"] - rows_before, f"{key}: {rows_before} rows were finished"
            assert stats["resumed_turns"] == rows_before, key


# -- two working directories on one store ---------------------------------------------------------
def test_two_workdirs_at_once_on_one_store_share_the_work_and_keep_each_others_entries(
    tmp_path: Path, tiny_model: Path
) -> None:
    """A and B share source s; B sits deeper (relative store paths differ). Each row is generated once."""
    a_config = _config(tmp_path, tiny_model, ("s", "a_only"), store="../store", shard_size=12)
    b_config = _config(tmp_path, tiny_model, ("s", "b_only"), store="../../store", shard_size=12)
    # other seeds: no row of one source is a valid row of another (nothing reused across them)
    a_config["sources"]["a_only"]["sampling"] = {"seed": 11}
    b_config["sources"]["b_only"]["sampling"] = {"seed": 7}
    alone = {}
    for name, config in (("a", a_config), ("b", b_config)):
        wf = Workflow.at(tmp_path / "alone" / name / "work", config)
        wf.build()
        alone[name] = dataset(wf)

    a = Workflow.at(tmp_path / "shared" / "a", a_config)
    b = Workflow.at(tmp_path / "shared" / "deep" / "b", b_config)
    procs = []
    for wf in (a, b):
        cmd, env = wf.command()
        out = subprocess.PIPE
        procs.append(subprocess.Popen(cmd, cwd=wf.workdir, env=env, text=True, stdout=out, stderr=subprocess.STDOUT))
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert dataset(a) == alone["a"] and dataset(b) == alone["b"]

    # every row of the shared source was generated by exactly one of them
    store = tmp_path / "shared" / "store"
    s_key = next(k for (k, _), st in sidecars(store).items() if st["source"] == "s")
    counts: dict[tuple[str, str], list[int]] = {}
    for wf in (a, b):
        for key, n in generated_in_logs(wf.workdir).items():
            counts.setdefault(key, []).append(n)
    shared = {shard: n for (key, shard), n in counts.items() if key == s_key}
    assert len(shared) == 2 and all(sum(n) == 12 for n in shared.values()), shared

    # gc from either side keeps what the other references
    for wf in (a, b):
        listed = wf.cli("gc", "--yes").stdout
        assert "delete" not in listed, listed
    assert a.dry_run() == {} and b.dry_run() == {}

    # B plans one more sample per prompt of s: plan promises only the new samples, the build keeps that
    b_more = copy.deepcopy(b_config)
    b_more["sources"]["s"]["sampling"] = {"samples_per_prompt": 2}
    b.write_config(b_more)
    plan = json.loads(b.cli("plan", "--json").stdout)
    promised = next(e for e in plan if e["source"] == "s")
    assert promised["rows_to_generate"] == len(PROMPTS) and promised["rows_reused"] == len(PROMPTS)
    b.build()
    new = [st for st in sidecars(store).values() if st["source"] == "s" and st["gen_key"] != s_key]
    assert sum(st["generated"] for st in new) == len(PROMPTS)
    assert sum(st["reused"] for st in new) == len(PROMPTS)


# -- server faults ----------------------------------------------------------------------------------
def _server_config(root: Path, model: Path, url: str) -> dict[str, Any]:
    config = _config(root, model)
    config["shard_size"] = 12  # two jobs: a fault hits one of them, the other finishes
    config["engine"] = {
        "backend": "openai",
        "options": {"urls": [url], "prompt": "ids", "retries": 3, "backoff": 0.01, "timeout": 2, "concurrency": 2},
        "journal_flush_rows": 1,
    }
    return config


@pytest.fixture
def standin(tiny_model: Path) -> Iterator[StandIn]:
    server = StandIn(model_id=tiny_model.name).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def served_baseline(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> list[tuple[str, str]]:
    server = StandIn(model_id=tiny_model.name).start()
    try:
        root = tmp_path_factory.mktemp("served")
        wf = Workflow.at(root / "work", _server_config(root, tiny_model, server.url))
        wf.build()
        return dataset(wf)
    finally:
        server.stop()


# Each fault kind against the backend itself: tests/test_server_faults.py. End to end, one fault per outcome.
@pytest.mark.parametrize("fault", ["cut_mid_body"])
def test_a_passing_server_fault_is_retried_and_never_stored(
    tmp_path: Path, tiny_model: Path, standin: StandIn, served_baseline: list[tuple[str, str]], fault: str
) -> None:
    standin.fault, standin.first, standin.last = fault, 3, 5
    wf = Workflow.at(tmp_path / "work", _server_config(tmp_path, tiny_model, standin.url))
    wf.build()
    assert standin.faults_sent == 3
    assert dataset(wf) == served_baseline
    stats = sidecars(wf.workdir / "store")
    assert sum(s["error"] for s in stats.values()) == 0


def test_a_server_that_stops_answering_is_named_within_the_stall_timeout(
    tmp_path: Path, tiny_model: Path, standin: StandIn, served_baseline: list[tuple[str, str]]
) -> None:
    """Every request in flight hangs (as a SIGSTOPped server does): the job's heartbeat names the server
    after engine.stall_timeout, long before the per-request deadline; the retries then finish the build."""
    standin.fault, standin.first, standin.last, standin.hang_seconds = "hang", 3, 4, 6.0
    config = _server_config(tmp_path, tiny_model, standin.url)
    config["engine"]["options"]["timeout"] = 4
    config["engine"]["stall_timeout"] = 1.5
    wf = Workflow.at(tmp_path / "work", config)
    wf.build()
    logs = job_logs(wf)
    named = re.findall(rf"no answer from the server {re.escape(standin.url)} for (\d+)s while (\d+) requests", logs)
    assert named and all(1 <= int(s) <= 4 and int(n) >= 1 for s, n in named), logs[-3000:]
    assert dataset(wf) == served_baseline


@pytest.mark.parametrize("fault", ["http_503"])
def test_a_lasting_server_fault_fails_the_job_naming_the_server_and_keeps_its_rows(
    tmp_path: Path, tiny_model: Path, standin: StandIn, served_baseline: list[tuple[str, str]], fault: str
) -> None:
    standin.fault, standin.first = fault, 3  # the first two rows come back, then the server stays broken
    config = _server_config(tmp_path, tiny_model, standin.url)
    config["engine"]["options"].update(retries=1, timeout=1, concurrency=1)
    config["shard_size"] = 24  # one shard, one job
    wf = Workflow.at(tmp_path / "work", config)
    start = time.monotonic()
    failed = wf.run("--until", "generate", check=False)
    elapsed = time.monotonic() - start
    text = failed.stdout + failed.stderr
    assert failed.returncode != 0
    assert f"server {standin.url} failed /v1/completions after 2 attempts; last answer:" in text, text[-3000:]
    # a new shard had no earlier version: Snakemake's "Cannot restore ...: no backup found" is not said
    assert "Cannot restore" not in text and "no backup found" not in text, text[-3000:]
    assert elapsed < 60, f"a deadline of 1 s per attempt held the job {elapsed:.0f}s"
    assert not list((wf.workdir / "store").glob("completions/*/*/*.parquet")), "nothing published"
    [journal] = (wf.workdir / "store").glob(f"journal/*/*/{ROWS_FILE}")
    assert len(Journal.read(journal)) == 2

    standin.fault = None  # the server is fixed: the rerun generates only the rest
    wf.build()
    [stats] = sidecars(wf.workdir / "store").values()
    assert stats["generated"] == 22 and stats["resumed_turns"] == 2


# -- derived state ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def built(built_once: tuple[Path, float]) -> Path:
    return built_once[0]


def _copy(built: Path, tmp_path: Path) -> Workflow:
    return Workflow(built / "work").copy_to(tmp_path / "work")


def _verify(wf: Workflow, *args: str) -> subprocess.CompletedProcess[str]:
    return wf.cli("verify", *args, check=False)


def _more_samples(wf: Workflow) -> None:
    """An edit whose build can reuse every existing row: one more sample per prompt."""
    config = yaml.safe_load((wf.workdir / "config.yaml").read_text())
    config["sampling"]["samples_per_prompt"] = 2
    wf.write_config(config)


def _new_reused_generated(wf: Workflow, old_keys: set[str]) -> tuple[int, int]:
    new = [s for s in sidecars(wf.workdir / "store").values() if s["gen_key"] not in old_keys]
    return sum(s["reused"] for s in new), sum(s["generated"] for s in new)


def _damage_index(store: Path, damage: str) -> None:
    index = store / "index" / "rows.sqlite"
    if damage in ("rows_deleted", "old_layout"):
        db = sqlite3.connect(index)
        with db:
            if damage == "rows_deleted":
                db.execute("DELETE FROM rows")
            else:  # an index of the previous version: paths relative to the working directory
                db.execute("UPDATE rows SET path = 'store/' || path")
                db.execute("PRAGMA user_version = 0")
        db.close()
    else:
        for suffix in ("-wal", "-shm"):
            Path(f"{index}{suffix}").unlink(missing_ok=True)
        index.write_bytes(random.Random(0).randbytes(8192) if damage == "random_bytes" else b"")


def test_a_damaged_row_index_heals_and_every_row_is_still_reused(built: Path, tmp_path: Path) -> None:
    """End to end, for the worst damage (the file is noise); every kind heals in place (below)."""
    wf = _copy(built, tmp_path)
    old_keys = {k for k, _ in sidecars(wf.workdir / "store")}
    _damage_index(wf.workdir / "store", "random_bytes")
    found = _verify(wf)
    assert found.returncode == 1 and "BAD store/index/rows.sqlite" in found.stdout, found.stdout + found.stderr
    _more_samples(wf)
    wf.build()
    assert _new_reused_generated(wf, old_keys) == (len(PROMPTS), len(PROMPTS))
    assert _verify(wf).returncode == 0


@pytest.mark.parametrize("damage", ["random_bytes", "emptied_file", "rows_deleted", "old_layout"])
def test_every_kind_of_row_index_damage_is_found_and_healed_on_open(built: Path, tmp_path: Path, damage: str) -> None:
    """What a build's first step (RowIndex.open) does to a damaged index: every published row is found again."""
    from dflash_build.keys import reuse_key
    from dflash_build.store.rowindex import RowIndex

    wf = _copy(built, tmp_path)
    store = wf.workdir / "store"
    _damage_index(store, damage)
    found = _verify(wf)
    assert found.returncode == 1 and "BAD store/index/rows.sqlite" in found.stdout, found.stdout + found.stderr
    with RowIndex.open(store) as index:
        for path in store.glob("completions/*/*/*.parquet"):
            stats = json.loads(path.with_name(path.name.replace(".parquet", ".stats.json")).read_text())
            rows = [(r["prompt_id"], r["sample_idx"]) for r in pq.read_table(path).to_pylist()]
            hits = index.lookup(reuse_key(stats["components"]), rows, 12)
            assert sorted(hits) == sorted(rows), path
            assert {c.path for cands in hits.values() for c in cands} == {str(path.relative_to(store))}
    assert _verify(wf).returncode == 0


def test_a_restore_keeps_the_generations_statistics_in_the_store_the_card_and_the_plan(
    built: Path, tmp_path: Path
) -> None:
    """--forcerun generate restores every shard from its journal: the sidecars keep the numbers of the run
    that generated them (tok/s, wall time, rows generated), and so do the card and plan's estimate."""
    wf = _copy(built, tmp_path)
    store = wf.workdir / "store"
    generation = sidecars(store)
    report = json.loads((wf.workdir / "dist" / "test-mix" / "manifest.json").read_text())["report"]
    config = wf.workdir / "config.yaml"
    built_with = config.read_text()
    _more_samples(wf)  # a plan that estimates from the measured tok/s
    estimate = json.loads(wf.cli("plan", "--json").stdout)
    config.write_text(built_with)
    wf.run("--forcerun", "generate")
    restored = sidecars(store)
    assert restored.keys() == generation.keys()
    for key, stats in restored.items():
        assert stats == {**generation[key], "restored": stats["restored"]}, key
        copy = json.loads((store / "journal" / key[0] / key[1] / PUBLISHED_STATS).read_text())
        assert copy == generation[key], "the journal's copy is the generation's, untouched"
    assert json.loads((wf.workdir / "dist" / "test-mix" / "manifest.json").read_text())["report"] == report
    _more_samples(wf)
    assert json.loads(wf.cli("plan", "--json").stdout) == estimate


def test_a_damaged_fingerprint_cache_is_rebuilt_with_a_warning(built: Path, tmp_path: Path) -> None:
    wf = _copy(built, tmp_path)
    cache = wf.workdir / "store" / ".cache" / "fingerprints.json"
    damage = b"\xff\xfe" + random.Random(1).randbytes(200)
    cache.write_bytes(damage)
    dry = wf.run("-n")
    assert "fingerprint cache store/.cache/fingerprints.json is unreadable" in dry.stderr + dry.stdout
    assert wf.dry_run() == {}, "same keys: nothing to rebuild"
    assert _verify(wf).returncode == 0, "the run rewrote the cache"
    cache.write_bytes(damage)
    found = _verify(wf)
    assert found.returncode == 1 and "BAD store/.cache/fingerprints.json: unreadable" in found.stdout


def test_verify_finds_and_repairs_a_damaged_journal(built: Path, tmp_path: Path) -> None:
    wf = _copy(built, tmp_path)
    config = yaml.safe_load((wf.workdir / "config.yaml").read_text())
    config["sampling"]["seed"] = 5  # new rows to generate: a job killed after three leaves a journal
    wf.write_config(config)
    failed = wf.run("--until", "generate", check=False, env_extra={"DFLASH_BUILD_KILL_AT": "rows:3"})
    assert failed.returncode != 0
    journals = list((wf.workdir / "store").glob(f"journal/*/*/{ROWS_FILE}"))
    assert journals
    lines = journals[0].read_bytes().splitlines(keepends=True)
    journals[0].write_bytes(lines[0] + b'{"prompt_id": "x", "out\n' + b"".join(lines[1:]))
    found = _verify(wf)
    assert found.returncode == 1 and "1 damaged lines (first: line 2)" in found.stdout, found.stdout
    assert _verify(wf, "--repair").returncode == 0
    assert _verify(wf).returncode == 0
    assert len(Journal.read(journals[0])) == len(lines)


def test_a_killed_mix_keeps_the_last_good_dataset_and_gc_removes_what_it_left(built: Path, tmp_path: Path) -> None:
    wf = _copy(built, tmp_path)
    dist = wf.workdir / "dist"
    good = dataset(wf)
    failed = wf.run("--forcerun", "mix", check=False, env_extra={"DFLASH_BUILD_KILL_AT": "mix"})
    assert failed.returncode != 0
    assert dataset(wf) == good and loaded_rows(dist / "test-mix") == sum(f["rows"] for f in _files(wf)), "still there"
    strays = list((dist / ".test-mix.versions").glob(".*.tmp"))
    assert strays, "the killed mix left its temporary folder"
    listed = wf.cli("gc", "--tmp-age", "0").stdout
    assert f"stray temporary {strays[0].relative_to(wf.workdir)}" in listed, listed
    wf.cli("gc", "--tmp-age", "0", "--yes")
    assert not list((dist / ".test-mix.versions").glob(".*.tmp"))
    # the killed mix's record is gone (Snakemake deletes a failed job's output): -n, plan and verify agree
    assert wf.dry_run() == {"mix": [{}]}, "the failed mix runs again"
    again = (
        "dist/test-mix: built again by the next build (its last build failed or was stopped; the last good "
        f"version, {good_version(wf)}, stays"
    )
    assert again in wf.cli("plan").stdout
    verified = wf.cli("verify").stdout
    assert again in verified and "0 bad" in verified
    wf.build()
    assert dataset(wf) == good
    assert again not in wf.cli("plan").stdout + wf.cli("verify").stdout


def good_version(wf: Workflow) -> str:
    return Path(os.readlink(wf.workdir / "dist" / "test-mix")).name


def _files(wf: Workflow) -> list[dict[str, Any]]:
    return json.loads((wf.workdir / "dist" / "test-mix" / "manifest.json").read_text())["files"]
