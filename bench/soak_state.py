"""What the fault soak (bench/soak.py) reads from the build it strikes: the dataset, the journals, the jobs
holding shards, the engines' own logs and processes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

from dflash_build.engines import host as engine_host
from dflash_build.store import layout, records
from dflash_build.store.journal import LOCK_FILE, ROWS_FILE, Journal, answers
from tests.conftest import lock_free

_HOLDER = re.compile(r"pid (\d+) on ")
_ANSWERED = re.compile(r"answered (\d+) requests")  # our transformers server, a line per batch
# vLLM (enable_log_requests): each request it took, and each it gave up on (its client gone, refused)
_VLLM_TOOK = re.compile(r"Added request ")
_VLLM_GAVE_UP = re.compile(r"Request \S+ (?:aborted|failed)")


class InvariantBroken(AssertionError):
    """What the soak found: an invariant that does not hold after the faults and their recoveries."""


def dataset_files(workdir: Path) -> list[tuple[str, str]]:
    manifest = workdir / "dist" / "soak" / layout.MANIFEST
    if not manifest.exists():
        return []
    return [(f["path"], f["sha256"]) for f in json.loads(manifest.read_text())["files"]]


def journaled(store: Path) -> dict[str, int]:
    """Rows with an answer each unpublished shard's journal holds now (every process of the run is gone:
    durable); a refused or aborted row is asked again by the rerun."""
    out = {}
    for rows_file in store.glob(f"journal/*/*/{ROWS_FILE}"):
        rows = answers(Journal.read(rows_file))
        answered = {
            (r["prompt_id"], r["sample_idx"])
            for r in rows
            if r.get("turn") == 0 and r.get("finish_reason") not in records.NO_ANSWER
        }
        out[f"{rows_file.parent.parent.name}/{rows_file.parent.name}"] = len(answered)
    return out


def errors(run_log: Path, count: int = 3) -> str:
    """The last distinct error lines of a run's log, the latest first."""
    lines = [x for x in run_log.read_text(errors="replace").splitlines() if " ERROR " in x]
    return "\n".join(list(dict.fromkeys(reversed(lines)))[:count])


def generate_jobs(store: Path) -> list[int]:
    """The pids of the generate jobs holding a shard now (their journal lock says who holds it)."""
    pids = []
    for lock in store.glob(f"journal/*/*/{LOCK_FILE}"):
        with contextlib.suppress(OSError):
            match = _HOLDER.search(lock.read_text())
            if match and engine_host.alive(int(match.group(1))):
                pids.append(int(match.group(1)))
    return pids


def in_flight(store: Path, shard_rows: int) -> int:
    """Rows the shards being generated now have not journaled (``shard_rows`` each): what a fault now can
    cost at most."""
    total = 0
    for lock in store.glob(f"journal/*/*/{LOCK_FILE}"):
        with contextlib.suppress(OSError):
            match = _HOLDER.search(lock.read_text())
            if match and engine_host.alive(int(match.group(1))):
                total += max(0, shard_rows - len(Journal.read(lock.parent / ROWS_FILE)))
    return total


def answered(logs: Path) -> int | None:
    """Rows the engines answered in all, from their logs: our transformers server counts each batch; vLLM
    logs each request it took and each it gave up on (a request in flight when its server died counts as
    answered, as it was in flight at that fault). None where the logs say neither."""
    texts = [p.read_text(errors="replace") for p in (logs / "engines").glob("*.log")]
    counted = [int(m.group(1)) for text in texts for m in _ANSWERED.finditer(text)]
    if counted:
        return sum(counted)
    took = sum(len(_VLLM_TOOK.findall(text)) for text in texts)
    return took - sum(len(_VLLM_GAVE_UP.findall(text)) for text in texts) if took else None


def wait_session_gone(session: int, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not engine_host.processes(session=session):
            return
        time.sleep(0.2)
    raise InvariantBroken(f"the processes of a build (session {session}) still run {seconds:.0f}s after it ended")


def continue_stopped(locks: Path) -> None:
    """A server stopped (SIGSTOP) that the build ended before replacing: its host stops it once idle, and
    SIGTERM reaches a stopped process only once it is continued."""
    for state in engine_host.running(locks):
        with contextlib.suppress(ProcessLookupError):
            os.kill(state["server_pid"], signal.SIGCONT)


def wait_engines_gone(locks: Path, seconds: float = 60) -> list[str]:
    """Once the idle timeout passed: the engines still running or GPU locks still held (empty: none)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        continue_stopped(locks)
        running = [
            s for s in engine_host.running(locks) if engine_host.alive(s["pid"]) or engine_host.alive(s["server_pid"])
        ]
        held = [p.name for p in locks.glob("gpu-*.lock") if not lock_free(p)]
        # what a server started (vLLM's engine core) and left behind when it or its host was killed
        left = {slot: pids for slot in engine_host.host_slots(locks) if (pids := engine_host.leftovers(locks, slot))}
        if not running and not held and not left:
            return []
        time.sleep(0.5)
    return (
        [f"engine {s['slot']} (pid {s['pid']}) still running" for s in running]
        + [f"{h} held" for h in held]
        + [f"processes a server of {slot} left: {pids}" for slot, pids in left.items()]
    )


def largest(store: Path, count: int = 8) -> str:
    """The store's largest files, for a store that filled up by itself."""
    files = sorted((p for p in store.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size, reverse=True)
    return ", ".join(f"{p.relative_to(store)} ({p.stat().st_size} B)" for p in files[:count])
