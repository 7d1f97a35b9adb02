"""The host process: one engine server per slot, started, watched, stopped.

A host (``python -m dflash_build.engines.host serve SPEC``, in its own session) takes the slot's host lock
and its GPU's lock, runs the server in a process group of its own (killed with the host however it dies:
PDEATHSIG; the processes the server starts: with it, or before the slot's next server starts, see
``slots.leftovers``), writes the slot's state once the server answers, stops it after
``engine.idle_timeout`` unused or when asked, and appends the engine's life to ``logs/engines/engines.jsonl``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from dflash_build.engines.host.launch import LaunchSpec, die_with_parent
from dflash_build.engines.host.slots import (
    STOP_GRACE_SECONDS,
    alive,
    flock,
    lock_path,
    open_lock,
    server_record,
    state_path,
    stop_leftovers,
)
from dflash_build.store import atomic

log = logging.getLogger(__name__)
POLL_SECONDS = 0.2
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # localhost: never via a proxy


class _Host:
    """Runs one server: GPU lock, child process, readiness, idle timeout, stop, history."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.stop_reason: str | None = None
        self.spawned_at = time.time()
        self.busy_seconds = 0.0
        self.child: subprocess.Popen[bytes] | None = None
        signal.signal(signal.SIGTERM, lambda *_: self._request_stop("stopped"))
        signal.signal(signal.SIGUSR1, lambda *_: self._request_stop("replaced"))
        signal.signal(signal.SIGUSR2, lambda *_: self._request_stop("stalled"))
        signal.signal(signal.SIGINT, lambda *_: self._request_stop("interrupted"))

    def _request_stop(self, reason: str) -> None:
        self.stop_reason = self.stop_reason or reason

    def run(self) -> int:
        spec = self.spec
        # One host per slot (a stopping one may still hold its port) and one engine per GPU.
        locks = [lock_path(spec.lock_dir, spec.slot, "host")] + ([Path(spec.gpu_lock)] if spec.gpu_lock else [])
        for path in locks:
            if not flock(open_lock(path), fcntl.LOCK_EX, timeout=spec.start_timeout):
                log.error("%s is held by another engine for %gs; not starting", path, spec.start_timeout)
                return 3
        stop_leftovers(spec.lock_dir, spec.slot, "an earlier server of this slot left (its host was killed)")
        self.child = subprocess.Popen(
            spec.argv,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **spec.env},
            process_group=0,  # its own group: stopping it stops its workers, not this host
            preexec_fn=die_with_parent,
        )
        log.info("host %d: started %s (pid %d) on %s", os.getpid(), spec.backend, self.child.pid, spec.slot)
        # before the server starts its workers: what a later host stops if they outlive both
        record = {"host_pid": os.getpid(), "session": os.getsid(0), "group": self.child.pid}
        atomic.write_json(server_record(spec.lock_dir, spec.slot), record)
        ready_at = self._wait_ready()
        if ready_at is None:
            return self._finish(1, None)
        state = {
            "slot": spec.slot,
            "backend": spec.backend,
            "url": spec.url,
            "identity": spec.identity,
            "identity_key": spec.identity_key,
            "pid": os.getpid(),
            "server_pid": self.child.pid,
            "gpu": spec.env.get("CUDA_VISIBLE_DEVICES"),  # None: a CPU engine
            "spawned_at": round(self.spawned_at, 3),
            "ready_at": round(ready_at, 3),
            "idle_timeout": spec.idle_timeout,
            "log": str(Path(spec.log_dir) / f"{spec.slot}.log"),
        }
        atomic.write_json(state_path(spec.lock_dir, spec.slot), state)
        log.info("host %d: %s serves %s (identity %s)", os.getpid(), spec.slot, spec.url, spec.identity_key)
        # The GPU and host locks stay held until this process exits, after its server is gone.
        return self._finish(self._serve(), ready_at)

    def _wait_ready(self) -> float | None:
        assert self.child is not None
        deadline = time.monotonic() + self.spec.start_timeout
        while self.stop_reason is None:
            if self.child.poll() is not None:
                log.error("the server exited with %s before it answered", self.child.returncode)
                self.stop_reason = "failed to start"
                return None
            try:
                with _DIRECT.open(self.spec.url + self.spec.health_path, timeout=5) as r:
                    if r.status == 200:
                        return time.time()
            except OSError:
                pass
            if time.monotonic() > deadline:
                log.error("the server did not answer within %gs", self.spec.start_timeout)
                self.stop_reason = "start timeout"
                return None
            time.sleep(POLL_SECONDS)
        return None

    def _serve(self) -> int:
        """Until the server dies, a stop is asked for, or nobody used it for the idle timeout."""
        assert self.child is not None
        use_fd = open_lock(lock_path(self.spec.lock_dir, self.spec.slot, "use"))
        idle_since = time.monotonic()
        last = time.monotonic()
        while self.stop_reason is None:
            time.sleep(POLL_SECONDS)
            now = time.monotonic()
            if self.child.poll() is not None:
                log.error("the server exited with %s", self.child.returncode)
                self.stop_reason = f"server exited ({self.child.returncode})"
                break
            if self.spec.owner_pid is not None and not alive(self.spec.owner_pid):
                self.stop_reason = "allocation ended"
                break
            try:
                fcntl.flock(use_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a job holds it
                self.busy_seconds += now - last
                idle_since = now
            else:
                idle_since = max(idle_since, now - max(0.0, time.time() - os.fstat(use_fd).st_mtime))
                if now - idle_since >= self.spec.idle_timeout:
                    self.stop_reason = f"idle for {self.spec.idle_timeout:g}s"
                    state_path(self.spec.lock_dir, self.spec.slot).unlink(missing_ok=True)  # before anyone joins
                    break
                fcntl.flock(use_fd, fcntl.LOCK_UN)
            last = now
        state_path(self.spec.lock_dir, self.spec.slot).unlink(missing_ok=True)
        os.close(use_fd)
        return 0 if self.child.poll() is None else 1

    def _finish(self, code: int, ready_at: float | None) -> int:
        child = self.child
        if child is not None:
            # a stalled server may be stopped or deadlocked: it would never act on SIGTERM; one that exited
            # (kill -9) may have left its workers (vLLM's engine core, holding the GPU's memory)
            graceful = child.poll() is None and self.stop_reason != "stalled"
            _terminate_group(child, grace=STOP_GRACE_SECONDS if graceful else 0.0)
            stop_leftovers(self.spec.lock_dir, self.spec.slot, "the server left")
        stopped_at = time.time()
        life = stopped_at - self.spawned_at
        record = {
            "slot": self.spec.slot,
            "backend": self.spec.backend,
            "identity_key": self.spec.identity_key,
            "host_pid": os.getpid(),
            "spawned_at": round(self.spawned_at, 3),
            "ready_at": None if ready_at is None else round(ready_at, 3),
            "stopped_at": round(stopped_at, 3),
            "reason": self.stop_reason,
            "in_use_seconds": round(self.busy_seconds, 3),
            "life_seconds": round(life, 3),
        }
        with open(Path(self.spec.log_dir) / "engines.jsonl", "a") as history:
            history.write(json.dumps(record) + "\n")
        log.info(
            "host %d: stopped (%s) after %.0fs, in use %.0fs", os.getpid(), self.stop_reason, life, self.busy_seconds
        )
        return code


def _terminate_group(child: subprocess.Popen[bytes], grace: float = STOP_GRACE_SECONDS) -> None:
    if grace:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)  # its workers too
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=10)


def serve(spec_file: str) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine-host: %(message)s")
    spec = LaunchSpec(**json.loads(Path(spec_file).read_text()))
    return _Host(spec).run()
