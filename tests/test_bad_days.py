"""The machine's bad days (issue 43): a full disk, a read-only store, a network filesystem and a closed
pipe, each on the real thing where this machine has it: a small tmpfs, a read-only bind mount, the real
SQLite, Snakemake and CLI. The workflow tests start from the shared built store (``operated_store``)
and copy it. A killed mix's record is tested with the killed mix (tests/test_faults.py); the stall
verdict's bound with the pool (tests/test_engine_pool.py).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import hashlib
import os
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dflash_build.store import atomic, filesystem, rowindex
from dflash_build.store.rowindex import RowIndex
from tests.conftest import Workflow

# -- mounts (root only; CI runs as root and must run these) --------------------------------------------


def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        why = f"mount {' '.join(args)}: {proc.stderr.strip()}"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the environment-fault tests: {why}")
        pytest.skip(why)


@contextlib.contextmanager
def tmpfs(at: Path, size: str) -> Iterator[Path]:
    """A small filesystem of its own at ``at`` (made if missing): it fills up for real."""
    at.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(at))
    try:
        yield at
    finally:
        subprocess.run(["umount", "-l", str(at)], check=True)


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[Path]:
    """``folder`` mounted read-only over itself, as a teammate's store one may read but not write."""
    _mount("--bind", str(folder), str(folder))
    try:
        _mount("-o", "remount,bind,ro", str(folder))
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def fill(folder: Path, leave: int) -> Path:
    """Fill ``folder``'s filesystem until ``leave`` bytes are free; the filler file is returned."""
    free, _ = filesystem.free_bytes(folder)
    filler = folder / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler


def tree_state(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every data file of a dataset folder as a loader reads it (through its link); the tables
    beside them carry the run's own times and resume counts."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob("data/*")}


def copied(base: tuple[Path, dict[str, Any]], dest: Path) -> tuple[Workflow, dict[str, Any]]:
    return Workflow(base[0]).copy_to(dest), copy.deepcopy(base[1])


# -- unit: the filesystem, the index, the errors ------------------------------------------------------


def test_the_mount_table_names_the_filesystem_and_network_ones_are_known(tmp_path: Path) -> None:
    table = tmp_path / "mountinfo"
    table.write_text(
        "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
        "40 22 0:50 / /shared/my\\040store rw,relatime - nfs4 server:/export rw,vers=4.2\n"
        "41 22 0:51 / /scratch ro,relatime - lustre 10.0.0.1@o2ib:/fs rw,flock\n"
        "42 22 0:52 / /home/u/remote rw - fuse.sshfs u@host: rw\n"
    )
    store = Path("/shared/my store/store")
    assert filesystem.mount_of(store, table) == filesystem.Mount(Path("/shared/my store"), "nfs4", False)
    assert filesystem.mount_of(store, table).network
    scratch = filesystem.mount_of(Path("/scratch/x"), table)
    assert scratch.fstype == "lustre" and scratch.network and scratch.read_only
    assert filesystem.mount_of(Path("/home/u/remote/s"), table).network
    assert not filesystem.mount_of(Path("/home/u/local"), table).network
    real = filesystem.mount_of(tmp_path)  # this machine's own table
    assert real.fstype != "unknown" and (real.point == tmp_path or real.point in tmp_path.parents)


def test_the_index_uses_sqlites_rollback_journal_on_a_network_filesystem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = RowIndex(tmp_path / "local")
    assert local.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    local.close()
    nfs = filesystem.Mount(tmp_path, "nfs4", False)
    monkeypatch.setattr(filesystem, "mount_of", lambda path, *a: nfs)
    shared = RowIndex(tmp_path / "shared")
    try:
        assert shared.db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        assert not Path(f"{shared.path}-shm").exists(), "no shared-memory file: nothing one host alone sees"
    finally:
        shared.close()
    # a store made on a local disk and then moved to NFS leaves WAL when it is next opened
    moved = RowIndex(tmp_path / "local")
    assert moved.db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    moved.close()


def test_a_full_disk_under_the_index_is_one_line_not_a_damaged_index(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "store", "512k") as store:
        index = RowIndex(store)
        fill(store, leave=0)
        rows = [
            {"prompt_id": f"p{i:06d}" * 8, "sample_idx": 0, "finish_reason": "stop", "n_output_tokens": 5}
            for i in range(5000)
        ]
        with pytest.raises(filesystem.StoreFault) as err:
            components = {"model": "m", "engine": {}, "sampling": {"seed": 0, "max_new_tokens": 8}}
            index.add_shard("g", components, store / "completions/s/g/00000.parquet", rows)
        index.close()
        message = str(err.value)
        assert message.startswith(
            f"no space left writing {store / 'index' / 'rows.sqlite'} (filesystem {store} (tmpfs)"
        )
        assert "free of 512.0 KB" in message and "\n" not in message
        assert not isinstance(err.value, rowindex.IndexCorrupt)
        with pytest.raises(OSError) as failed_write:  # a write's error names no file: the atomic writer adds it
            atomic.write_text(store / "x" / "big.txt", "x" * 100_000)
        assert str(filesystem.fault(failed_write.value)).startswith(f"no space left writing {store}/x/big.txt (")
        assert [p.name for p in (store / "x").iterdir()] == [], "no temporary left behind"


def test_pyarrows_and_sqlites_errors_without_an_errno_are_read_as_what_they_are(tmp_path: Path) -> None:
    arrow = OSError("Error writing bytes to file. Detail: [errno 28] No space left on device")
    assert str(filesystem.fault(arrow, tmp_path / "a.parquet")).startswith(
        f"no space left writing {tmp_path}/a.parquet"
    )
    full = sqlite3.OperationalError("database or disk is full")
    full.sqlite_errorname = "SQLITE_FULL"  # type: ignore[attr-defined]
    assert str(filesystem.fault(full, tmp_path / "i.sqlite")).startswith("no space left writing")
    assert filesystem.fault(ValueError("x")) is None
    assert filesystem.fault(OSError(errno.ENOENT, "missing", "f")) is None, "a missing file is no environment fault"


# -- workflow: on the built store ----------------------------------------------------------------------


@pytest.mark.workflow
def test_inspection_works_on_a_read_only_store_and_a_build_there_fails_in_one_line(
    operated_store: tuple[Path, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wf, _ = copied(operated_store, tmp_path / "work")
    store = wf.workdir / "store"
    shutil.rmtree(store / ".cache")  # a cold cache: the commands must hash the model and keep that elsewhere
    env_cache = tmp_path / "user-cache"
    before = tree_state(store)
    monkeypatch.setenv("XDG_CACHE_HOME", str(env_cache))
    with read_only(store):
        plan = wf.cli("plan")
        status = wf.cli("status")
        verify = wf.cli("verify")
        gc = wf.cli("gc")
        explain = wf.cli("explain", "objs", "00000")
        reindex = wf.cli("reindex", check=False)
        failed = wf.run(check=False)
        assert tree_state(store) == before, "nothing in the store was written"
    assert "total: 0 generate jobs, 0 rows to generate" in plan.stdout, plan.stdout + plan.stderr
    head = status.stdout.splitlines()[0]
    assert head.startswith("rows 20/20 (100.0%)") and head.endswith("; done"), status.stdout
    assert verify.stdout.rstrip().endswith("0 bad"), verify.stdout
    assert gc.stdout.splitlines()[-1] == "nothing unreferenced", gc.stdout
    assert "built: nothing to do" in explain.stdout.splitlines(), explain.stdout
    assert list(env_cache.glob("dflash-build/fingerprints/*.json")), "the digests went to the user's cache"
    # the one command that rewrites the store says so in one line, as the build does
    assert reindex.returncode == 2 and reindex.stderr.strip().count("\n") == 0, reindex.stderr
    assert f"dflash-build reindex: cannot write {store}: the filesystem is mounted read-only" in reindex.stderr
    assert failed.returncode != 0
    said = failed.stdout + failed.stderr
    assert f"cannot write {store}: the filesystem is mounted read-only" in said, said[-3000:]
    [line] = [x for x in said.splitlines() if "cannot write" in x]
    assert line.startswith("dflash-build: cannot write") and "File " not in said, said
    assert "Traceback" not in said and "rule generate" not in said, "it failed before any job"


@pytest.mark.workflow
def test_a_full_disk_fails_in_one_line_plan_warns_first_and_the_rerun_is_identical_without_repair(
    operated_store: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    reference, config = copied(operated_store, tmp_path / "reference")
    config["sampling"]["max_new_tokens"] = 40  # every truncated row is continued: both shards regenerate
    config["checks"]["min_free_gb"] = 0
    reference.write_config(config)
    reference.build()
    built = operated_store[0]
    wf = Workflow(tmp_path / "work")
    wf.workdir.mkdir()
    for name in ("objs.jsonl",):
        shutil.copy2(built / name, wf.workdir / name)
    wf.write_config(config)
    with tmpfs(wf.workdir / "store", "2m") as store:
        shutil.copytree(built / "store", store, dirs_exist_ok=True, symlinks=True)
        shutil.rmtree(store / "configs")
        # room for the run's own writes (components, registration, index), not for the two shards' jobs
        filler = fill(store, leave=48 * 1024)
        plan = wf.cli("plan")
        assert "disk: the remaining work writes about" in plan.stdout, plan.stdout
        assert "warning: the store's filesystem has" in plan.stderr, plan.stdout + plan.stderr
        failed = wf.run(check=False)
        said = failed.stdout + failed.stderr
        assert failed.returncode != 0
        assert "no space left writing " + str(store) in said, said[-4000:]
        assert "Traceback" not in said and "IndexCorrupt" not in said, said[-4000:]
        on_full = wf.cli("verify", check=False)
        assert "not a readable SQLite database" not in on_full.stdout, on_full.stdout
        assert "Traceback" not in on_full.stderr
        assert wf.cli("plan", check=False).returncode in (0, 1), "plan works on the full disk"
        filler.unlink()
        wf.build()
        verify = wf.cli("verify")  # no --repair in between
        assert verify.stdout.rstrip().endswith("0 bad"), verify.stdout
        rerun = digests(wf.workdir / "dist" / "test-mix")
        assert rerun and rerun == digests(reference.workdir / "dist" / "test-mix")


@pytest.mark.workflow
def test_every_command_exits_quietly_when_its_reader_goes_away(
    operated_store: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    wf, _ = copied(operated_store, tmp_path / "work")
    for args in (("status",), ("plan", "--jobs"), ("gc",)):
        command = " ".join(wf.cli_command(*args))
        # `true` reads nothing and is gone before the command writes: its first write meets a closed pipe
        proc = subprocess.run(
            ["bash", "-c", f"set -o pipefail; {command} | true"], cwd=wf.workdir, capture_output=True, text=True
        )
        assert proc.returncode == 0 and proc.stderr == "", f"{args}: {proc.returncode} {proc.stderr[-2000:]}"


def test_a_build_refuses_to_start_below_the_free_space_floor(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from dflash_build import workflow

    free, _ = filesystem.free_bytes(tmp_path)
    config = SimpleNamespace(store=tmp_path / "store", checks=SimpleNamespace(min_free_gb=(free + 1e9) / 1e9))
    with pytest.raises(filesystem.StoreFault) as err:
        workflow.check_store(config)  # type: ignore[arg-type]
    assert str(err.value).startswith(f"refusing to start: {tmp_path / 'store'} has ")
    assert "below checks.min_free_gb" in str(err.value) and "\n" not in str(err.value)
    config.checks.min_free_gb = 0.0
    workflow.check_store(config)  # type: ignore[arg-type]
    assert (tmp_path / "store").is_dir() and not list((tmp_path / "store").iterdir()), "its probe file is gone"
