"""The job's side of a shared engine: make sure its slot's engine runs with the job's identity (start it,
or stop one of another identity first), hold it, and join the other running engines of that identity."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dflash_build.engines.base import EngineFailed
from dflash_build.engines.host.broker import BROKER_ENV, spawn_via_broker
from dflash_build.engines.host.launch import LaunchSpec, host_argv, package_root
from dflash_build.engines.host.logs import engine_error
from dflash_build.engines.host.slots import (
    alive,
    flock,
    join_slot,
    lock_path,
    open_lock,
    read_state,
    recorded_pid,
    running,
    stop_host,
)
from dflash_build.store import atomic

log = logging.getLogger(__name__)
POLL_SECONDS = 0.2
START_ATTEMPTS = 2  # a host lost once it served is started again, once


@dataclass
class Attached:
    """Engines one job uses (its own slot's first, then others of the same identity), each held by a
    shared lock on its use lock, by URL."""

    members: dict[str, tuple[dict[str, Any], int]]  # url -> (the engine's state, its use-lock fd)
    started: bool  # this job started its own slot's engine

    @property
    def urls(self) -> list[str]:
        return list(self.members)

    @property
    def engines(self) -> list[dict[str, Any]]:
        return [state for state, _ in list(self.members.values())]  # a snapshot: the pool changes in threads

    def leave(self, url: str) -> dict[str, Any] | None:
        """Stop holding ``url``'s engine (so a job that replaces it is not kept waiting); its state."""
        member = self.members.pop(url, None)
        if member is None:
            return None
        # the host's idle clock reads this: a use shorter than its poll is never seen holding the lock
        os.utime(member[1])
        os.close(member[1])
        return member[0]

    def release(self) -> None:
        for url in list(self.members):
            self.leave(url)  # drops the shared use lock


def attach(spec: LaunchSpec, pool: bool = True) -> Attached:
    """Make sure the slot's engine runs with ``spec``'s identity and hold it; with ``pool``, join every
    other running engine of that identity too. Blocks while another job starts or replaces the engine."""
    start_fd = open_lock(lock_path(spec.lock_dir, spec.slot, "start"))
    use_fd = open_lock(lock_path(spec.lock_dir, spec.slot, "use"))
    try:
        flock(start_fd, fcntl.LOCK_EX)  # one job at a time decides about this slot
        state, started = _ensure(spec, use_fd), False
        if state is None:
            state = _join_starting(spec, use_fd)
        if state is None:
            state, started = _start(spec, use_fd), True
    except BaseException:
        os.close(use_fd)
        raise
    finally:
        os.close(start_fd)
    attached = Attached({state["url"]: (state, use_fd)}, started)
    if pool:
        join_others(spec, attached)
    return attached


def join_others(spec: LaunchSpec, attached: Attached) -> list[str]:
    """Join the running engines of ``spec``'s identity that ``attached`` does not hold yet; their URLs."""
    joined = []
    held = {state["slot"] for state in attached.engines}
    for other in running(spec.lock_dir):
        if other["slot"] in held or other["identity_key"] != spec.identity_key or other["url"] in attached.members:
            continue
        fd = join_slot(spec.lock_dir, other)
        if fd is not None:
            attached.members[other["url"]] = (other, fd)
            joined.append(other["url"])
    return joined


def _ensure(spec: LaunchSpec, use_fd: int) -> dict[str, Any] | None:
    """The slot's running engine if it serves ``spec`` (now held); else stop whatever runs there."""
    state = read_state(spec.lock_dir, spec.slot)
    if state is not None and state["identity_key"] == spec.identity_key:
        flock(use_fd, fcntl.LOCK_SH)
        if read_state(spec.lock_dir, spec.slot) == state:  # not stopped while we waited
            return state
        fcntl.flock(use_fd, fcntl.LOCK_UN)
        state = read_state(spec.lock_dir, spec.slot)
    flock(use_fd, fcntl.LOCK_EX)  # its users (other identity) finish first
    if state is not None:
        log.warning(
            "engine on %s serves another identity (%s, not %s): stopping it",
            spec.slot,
            state["identity_key"],
            spec.identity_key,
        )
        stop_host(state, "replaced")
    return None


def _join_starting(spec: LaunchSpec, use_fd: int) -> dict[str, Any] | None:
    """A host of the slot that is starting without a job waiting for it (the job that started it was
    killed): wait for it and hold it once it serves ``spec`` (None when no host holds the slot). A second
    host would wait for its GPU behind the first, while this job's use lock kept the first from idling
    out (the fault soak, bench/soak.py, found that wait)."""
    host_lock = open_lock(lock_path(spec.lock_dir, spec.slot, "host"))
    deadline = time.monotonic() + spec.start_timeout + 60
    try:
        while time.monotonic() < deadline:
            state = read_state(spec.lock_dir, spec.slot)
            if state is not None and state["identity_key"] == spec.identity_key:
                fcntl.flock(use_fd, fcntl.LOCK_SH)  # from the exclusive hold _ensure took: now its user
                log.info("engine on %s (host pid %d), started by a job that is gone, joined", spec.slot, state["pid"])
                return state
            if state is not None:  # it came up serving another identity: stopped, as _ensure stops one
                stop_host(state, "replaced")
            try:
                fcntl.flock(host_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                time.sleep(POLL_SECONDS)  # a host is starting (or stopping) on the slot
                continue
            fcntl.flock(host_lock, fcntl.LOCK_UN)
            return None  # no host: this job starts one
        return None
    finally:
        os.close(host_lock)


def _start(spec: LaunchSpec, use_fd: int) -> dict[str, Any]:
    """Start a host for ``spec`` (the use lock is held exclusively) and wait until it serves. A host lost
    right after it came up (killed before this job saw it ready) is started once more: the engine did
    start, and a job that waits for one must not fail for what any job that uses one recovers from."""
    fcntl.flock(use_fd, fcntl.LOCK_SH)  # we are its first user; held before the host can see it idle
    log_dir = Path(spec.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    spec_file = Path(spec.lock_dir) / f"engine-{spec.slot}.spec.json"
    atomic.write_json(spec_file, asdict(spec))
    log_path = log_dir / f"{spec.slot}.log"
    broker = os.environ.get(BROKER_ENV)
    for attempt in range(START_ATTEMPTS):
        since = log_path.stat().st_size if log_path.exists() else 0  # this start's lines follow
        host_pid = spawn_via_broker(Path(broker), spec, spec_file, log_path) if broker else _spawn(spec_file, log_path)
        log.info("starting the %s engine on %s (host pid %d, log %s)", spec.backend, spec.slot, host_pid, log_path)
        state = _wait_ready(spec, host_pid, log_path, since, last=attempt == START_ATTEMPTS - 1)
        if state is not None:
            return state
        log.warning("the engine on %s (host pid %d) was lost once it served: starting it again", spec.slot, host_pid)
    raise AssertionError("unreachable: the last attempt raises")


def _wait_ready(spec: LaunchSpec, host_pid: int, log_path: Path, since: int, last: bool) -> dict[str, Any] | None:
    """The host's state once it serves; None if it died after it served (not on the ``last`` attempt);
    EngineFailed if it died before that, or did not serve in time."""
    deadline = time.monotonic() + spec.start_timeout + 60
    while True:
        state = read_state(spec.lock_dir, spec.slot)
        if state is not None and state["pid"] == host_pid:
            log.info("engine on %s ready after %.0fs", spec.slot, state["ready_at"] - state["spawned_at"])
            return state
        if not alive(host_pid) or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(host_pid, signal.SIGKILL)
            if not last and recorded_pid(spec.lock_dir, spec.slot) == host_pid:
                return None  # it served, then died: lost, as a running engine may be
            if (error := engine_error(log_path, since)) is not None:  # the engine's own words, in one line
                raise EngineFailed(f"the {spec.backend} engine on {spec.slot} did not start: {error}; log: {log_path}")
            raise EngineFailed(
                f"the {spec.backend} engine on {spec.slot} did not start (host pid {host_pid}); "
                f"its log {log_path} ends:\n{tail(log_path)}"
            )
        time.sleep(POLL_SECONDS)


def _spawn(spec_file: Path, log_path: Path) -> int:
    """Start a host from this job, in its own session: it outlives the job and Snakemake's process group."""
    with open(log_path, "ab") as out:
        host = subprocess.Popen(
            host_argv(spec_file),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": package_root()},
        )
    return host.pid  # a host that exits early is a zombie until Popen's bookkeeping reaps it: alive() says gone


def tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"
