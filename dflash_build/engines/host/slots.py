"""The files of one engine slot in ``engine.lock_dir``: its state (the running engine), and its locks.

``engine-<slot>.json`` names the running engine (written by its host once the server answers);
``engine-<slot>.start.lock`` lets one job at a time decide about the slot, ``.use.lock`` is held shared by
the jobs that send it requests (and taken exclusively by whoever stops it), ``.host.lock`` keeps one host
per slot. A lock is an ``flock``, which the kernel drops when its holder dies, even on ``kill -9``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
STOP_GRACE_SECONDS = 30.0


def state_path(lock_dir: Path | str, slot: str) -> Path:
    return Path(lock_dir) / f"engine-{slot}.json"


def lock_path(lock_dir: Path | str, slot: str, what: str) -> Path:
    return Path(lock_dir) / f"engine-{slot}.{what}.lock"


def read_state(lock_dir: Path | str, slot: str) -> dict[str, Any] | None:
    """The running engine of a slot, or None (no file, a torn file, or a host that is gone)."""
    try:
        state = json.loads(state_path(lock_dir, slot).read_text())
    except (OSError, ValueError):
        return None
    return state if alive(int(state.get("pid", 0))) else None


def recorded_pid(lock_dir: Path | str, slot: str) -> int | None:
    """The host a slot's state file names, alive or not (None: no readable file): a host writes it once
    its server answers, so a dead host it names had served."""
    try:
        return int(json.loads(state_path(lock_dir, slot).read_text()).get("pid", 0))
    except (OSError, ValueError, TypeError):
        return None


def running(lock_dir: Path | str) -> list[dict[str, Any]]:
    """Every running engine whose state is in ``lock_dir``."""
    found = []
    for path in sorted(Path(lock_dir).glob("engine-*.json")):
        state = read_state(lock_dir, path.stem.removeprefix("engine-"))
        if state is not None:
            found.append(state)
    return found


def alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not reaped yet) is gone, but only once its last thread is: a multi-threaded
    # process's leader shows Z while its other threads still exit, and they still hold its locks.
    with contextlib.suppress(OSError, ValueError):
        status = dict(
            line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
        )
        if status["State"].split()[0] == "Z" and int(status["Threads"]) <= 1:
            return False
    return True


def open_lock(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)


def flock(fd: int, how: int, timeout: float | None = None) -> bool:
    """flock with a deadline (None: wait for ever); False when it ran out."""
    if timeout is None:
        fcntl.flock(fd, how)
        return True
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def join_slot(lock_dir: str, state: dict[str, Any]) -> int | None:
    """Hold another slot's engine for this job, unless it is stopping."""
    fd = open_lock(lock_path(lock_dir, state["slot"], "use"))
    if flock(fd, fcntl.LOCK_SH, timeout=5.0) and read_state(lock_dir, state["slot"]) == state:
        return fd
    os.close(fd)
    return None


_STOP_SIGNALS = {"replaced": signal.SIGUSR1, "stalled": signal.SIGUSR2}  # else SIGTERM: "stopped"


def stop_host(state: dict[str, Any], reason: str, wait: float = STOP_GRACE_SECONDS + 30) -> None:
    """Signal a host to stop (its users are gone, or its server stalled) and wait until it exits."""
    pid = int(state["pid"])
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, _STOP_SIGNALS.get(reason, signal.SIGTERM))
    deadline = time.monotonic() + wait
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # its server dies with it (PDEATHSIG)


def starting(lock_dir: Path | str) -> list[dict[str, Any]]:
    """Engine hosts alive whose server is not serving yet (loading a model takes minutes): slot, host pid,
    since when."""
    found = []
    for path in sorted(Path(lock_dir).glob("engine-*.server.json")):
        slot = path.name.removeprefix("engine-").removesuffix(".server.json")
        try:
            record = json.loads(path.read_text())
            since = path.stat().st_mtime
        except (OSError, ValueError):
            continue
        if alive(int(record.get("host_pid", 0))) and read_state(lock_dir, slot) is None:
            found.append({"slot": slot, "host_pid": record["host_pid"], "since": round(since, 3)})
    return found


def server_record(lock_dir: Path | str, slot: str) -> Path:
    """Which server a slot's host started last: its process group (the server leads it) and its session."""
    return Path(lock_dir) / f"engine-{slot}.server.json"


def leftovers(lock_dir: Path | str, slot: str) -> list[int]:
    """The live processes of the slot's last server: its process group within its session (both recorded at
    spawn; read from /proc/PID/stat, since vLLM rewrites its workers' titles and with them /proc's environ). A
    server's workers (vLLM's engine core, holding the GPU's memory) outlive it when the server or its host
    is killed -9: PDEATHSIG reaches the server alone."""
    try:
        record = json.loads(server_record(lock_dir, slot).read_text())
        group, session = int(record["group"]), int(record["session"])
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return processes(group=group, session=session)


def processes(group: int | None = None, session: int | None = None) -> list[int]:
    """The live (not zombie) processes in process group ``group`` and session ``session`` (either left
    out: any), from /proc/PID/stat."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command name, which may hold ")"
            if fields[0] != "Z" and group in (None, int(fields[2])) and session in (None, int(fields[3])):
                found.append(int(stat.parent.name))
    return found


def stop_leftovers(lock_dir: Path | str, slot: str, what: str, wait: float = 30.0) -> list[int]:
    """Kill what a server of the slot left running and wait until it is gone (its GPU memory with it).
    Only for a slot no host serves: its host calls it, or whoever holds its host lock."""
    pids = leftovers(lock_dir, slot)
    if pids:
        log.warning("stopping %d processes %s on %s: %s", len(pids), what, slot, pids)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids


def host_slots(lock_dir: Path | str) -> list[str]:
    """Every slot a host ever ran on in ``lock_dir`` (its host lock names it)."""
    locks = sorted(Path(lock_dir).glob(lock_path("", "*", "host").name))
    return [p.name.removeprefix("engine-").removesuffix(".host.lock") for p in locks]


def sweep(lock_dir: Path | str) -> list[str]:
    """The slots no host runs on whose last server left processes (its host killed -9): stopped now."""
    swept = []
    for slot in host_slots(lock_dir):
        fd = open_lock(lock_path(lock_dir, slot, "host"))
        try:
            if flock(fd, fcntl.LOCK_EX, timeout=0) and stop_leftovers(lock_dir, slot, "a killed host's server left"):
                swept.append(slot)
        finally:
            os.close(fd)
    return swept


def stop_idle(lock_dir: Path | str, slots: list[str] | None = None) -> list[str]:
    """Stop every engine (of ``slots``) nobody uses now; returns the slots stopped. An engine another
    job or build still uses is left to its idle timeout."""
    stopped = []
    for state in running(lock_dir):
        if slots is not None and state["slot"] not in slots:
            continue
        fd = open_lock(lock_path(lock_dir, state["slot"], "use"))
        try:
            if not flock(fd, fcntl.LOCK_EX, timeout=1.0):
                continue
            if read_state(lock_dir, state["slot"]) == state:
                stop_host(state, "workflow ended")
                stopped.append(state["slot"])
        finally:
            os.close(fd)
    sweep(lock_dir)
    return stopped
