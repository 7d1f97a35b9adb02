"""Engines that outlive a job: one long-lived server per GPU, shared by the generate jobs (``engine.shared``).

Starting a large model's engine takes minutes, and a job that owns its engine also idles the GPU while
its shard's last long answers drain at a shrinking batch. With shared engines:

- **Start.** The first job that needs GPU g's engine starts it: a *host* process (``python -m
  dflash_build.engines.host serve``, in its own session, so Snakemake's end does not take it down) takes
  GPU g's lock (the same lock an in-process engine takes: never two engines on one GPU) and runs the
  server on g's port with ``CUDA_VISIBLE_DEVICES=g``: SGLang's HTTP server (``sglang_backend.serve``),
  llama.cpp's, or our own around the transformers backend (``engines.server``). Its output goes to
  ``logs/engines/<slot>.log``; once the server answers, the host writes ``<lock_dir>/engine-<slot>.json``.
- **Identity.** An engine serves only jobs that want exactly what it was started with (``identity``: the
  backend, the model and its fingerprint, every launch option, the stop ids). A job that wants another
  waits until the engine's users are done, stops it and starts its own.
- **Use.** A job holds a shared lock on ``engine-<slot>.use.lock`` while it sends requests, and sends
  them to its own GPU's engine and to every other running engine of the same identity, least loaded
  first. Two jobs per GPU (``engine.jobs_per_engine``) keep each engine's batch full while one of them
  waits for its last answers, and the last shards of the build spread over every GPU.
- **Stop.** A host stops its server when nobody has used it for ``engine.idle_timeout`` seconds, when the
  workflow ends (``stop_idle``, from the Snakefile's onsuccess/onerror), or on ``dflash-build engines
  --stop``; the server dies with its host even on SIGKILL (PDEATHSIG). So after a crash or a kill -9 of
  everything, nothing holds a GPU longer than the idle timeout. Each engine's life is appended to
  ``logs/engines/engines.jsonl`` (start, ready, stop, reason, time in use).
- **Under a scheduler** (SLURM): an engine serves the jobs of its own allocation only (its slot and
  identity name the scheduler's job id), so the generate jobs that Snakemake groups into one allocation
  share it, and it stops when the allocation's task ends, whatever the cluster does with leftover
  processes. GPU locks and ports follow the node's GPU index, so two allocations on a node never collide.

``dflash-build engines`` lists the running ones. With ``engine.shared: false`` a server backend
(``llamacpp``) still runs through a host, started and stopped by its job.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dflash_build import hashing
from dflash_build.engines import EngineFailed, registry
from dflash_build.engines.gpus import GpuLease, gpu_lock, scheduler_assigned
from dflash_build.engines.openai_backend import OpenAIEngine, PoolChange, ServerDown
from dflash_build.engines.sglang_backend import OWN_OPTIONS
from dflash_build.spec import Config, EngineSpec
from dflash_build.store import atomic

log = logging.getLogger(__name__)
POLL_SECONDS = 0.2
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # localhost: never via a proxy
STOP_GRACE_SECONDS = 30.0


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a host needs to run one engine; ``identity`` says which jobs it may serve."""

    slot: str  # "gpu-3", "cpu", or under a scheduler "job-<id>.gpu-3"
    backend: str
    argv: list[str]
    env: dict[str, str]
    url: str
    identity: dict[str, Any]
    lock_dir: str
    log_dir: str
    gpu_lock: str | None
    idle_timeout: float
    start_timeout: float
    health_path: str = "/health"  # answers 200 once the server serves
    owner_pid: int | None = None  # under a scheduler: the allocation's task; the engine stops with it

    @property
    def identity_key(self) -> str:
        return hashing.digest(self.identity)[:16]


# -- files of one slot -----------------------------------------------------------------------------
def state_path(lock_dir: Path | str, slot: str) -> Path:
    return Path(lock_dir) / f"engine-{slot}.json"


def _lock_path(lock_dir: Path | str, slot: str, what: str) -> Path:
    return Path(lock_dir) / f"engine-{slot}.{what}.lock"


def read_state(lock_dir: Path | str, slot: str) -> dict[str, Any] | None:
    """The running engine of a slot, or None (no file, a torn file, or a host that is gone)."""
    try:
        state = json.loads(state_path(lock_dir, slot).read_text())
    except (OSError, ValueError):
        return None
    return state if _alive(int(state.get("pid", 0))) else None


def running(lock_dir: Path | str) -> list[dict[str, Any]]:
    """Every running engine whose state is in ``lock_dir``."""
    found = []
    for path in sorted(Path(lock_dir).glob("engine-*.json")):
        state = read_state(lock_dir, path.stem.removeprefix("engine-"))
        if state is not None:
            found.append(state)
    return found


def _alive(pid: int) -> bool:
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


def _open_lock(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)


def _flock(fd: int, how: int, timeout: float | None = None) -> bool:
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


# -- what to launch --------------------------------------------------------------------------------
def launch_spec(
    cfg: Config, stop_ids: list[int], lease: GpuLease | None, model_fingerprint: Any, context: int | None
) -> LaunchSpec:
    """The server for this config on the lease's GPU (or the CPU slot), and the identity it serves."""
    engine, model = cfg.engine, cfg.model
    slot = "cpu" if lease is None else f"gpu-{lease.node_id}"
    if lease is not None and lease.allocation:  # engines serve their own allocation only
        slot = f"job-{lease.allocation}.{slot}"
    port = lease.port if lease is not None else engine.base_port
    # the driver's own options (how a job talks to the engine) are not what the engine is
    options = {k: v for k, v in engine.options.items() if k not in OWN_OPTIONS}
    env = {"CUDA_VISIBLE_DEVICES": lease.gpu} if lease is not None else {}
    serve = registry.get(engine.backend).serve
    if serve is None:
        raise ValueError(f"config key 'engine.backend': {engine.backend} engines run in the job, not as servers")
    argv = serve.argv(model, options, stop_ids, port, context, lease)
    identity = {
        "backend": engine.backend,
        "model": model.path,
        "revision": model.revision,
        "model_fingerprint": model_fingerprint,
        "context": context,
        "options": options,
        "stop_ids": list(stop_ids),
        "allocation": lease.allocation or None if lease is not None else None,
    }
    return LaunchSpec(
        slot=slot,
        backend=engine.backend,
        argv=argv,
        env=env,
        url=f"http://127.0.0.1:{port}",
        identity=identity,
        lock_dir=str(engine.lock_dir),
        log_dir=str((cfg.logs / "engines").resolve()),  # absolute: the host and other workdirs read it
        # the lock an in-process engine takes: one engine per GPU, also across allocations on a node
        gpu_lock=None if lease is None else str(gpu_lock(engine, lease.node_id)),
        idle_timeout=engine.idle_timeout,
        start_timeout=engine.start_timeout,
        health_path=serve.health_path,
        owner_pid=_allocation_task() if lease is not None and lease.allocation else None,
    )


def _allocation_task() -> int | None:
    """The process whose end ends the engine: the batch step's task (see the broker), else this job
    step's. Where the cluster does not kill what a job leaves behind (proctrack/linuxproc), the host
    watches it, so an engine never outlives its allocation and holds a GPU SLURM gave another job."""
    pid = os.environ.get(OWNER_ENV) or os.environ.get("SLURM_TASK_PID", "")
    return int(pid) if pid.isdigit() else None


# -- the job's side --------------------------------------------------------------------------------
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
        os.close(member[1])
        return member[0]

    def release(self) -> None:
        for url in list(self.members):
            self.leave(url)  # drops the shared use lock


def attach(spec: LaunchSpec, pool: bool = True) -> Attached:
    """Make sure the slot's engine runs with ``spec``'s identity and hold it; with ``pool``, join every
    other running engine of that identity too. Blocks while another job starts or replaces the engine."""
    start_fd = _open_lock(_lock_path(spec.lock_dir, spec.slot, "start"))
    use_fd = _open_lock(_lock_path(spec.lock_dir, spec.slot, "use"))
    try:
        _flock(start_fd, fcntl.LOCK_EX)  # one job at a time decides about this slot
        state, started = _ensure(spec, use_fd), False
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
        fd = _join(spec.lock_dir, other)
        if fd is not None:
            attached.members[other["url"]] = (other, fd)
            joined.append(other["url"])
    return joined


def _ensure(spec: LaunchSpec, use_fd: int) -> dict[str, Any] | None:
    """The slot's running engine if it serves ``spec`` (now held); else stop whatever runs there."""
    state = read_state(spec.lock_dir, spec.slot)
    if state is not None and state["identity_key"] == spec.identity_key:
        _flock(use_fd, fcntl.LOCK_SH)
        if read_state(spec.lock_dir, spec.slot) == state:  # not stopped while we waited
            return state
        fcntl.flock(use_fd, fcntl.LOCK_UN)
        state = read_state(spec.lock_dir, spec.slot)
    _flock(use_fd, fcntl.LOCK_EX)  # its users (other identity) finish first
    if state is not None:
        log.warning(
            "engine on %s serves another identity (%s, not %s): stopping it",
            spec.slot,
            state["identity_key"],
            spec.identity_key,
        )
        _stop_host(state, "replaced")
    return None


def _start(spec: LaunchSpec, use_fd: int) -> dict[str, Any]:
    """Start a host for ``spec`` (the use lock is held exclusively) and wait until it serves."""
    fcntl.flock(use_fd, fcntl.LOCK_SH)  # we are its first user; held before the host can see it idle
    log_dir = Path(spec.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    spec_file = Path(spec.lock_dir) / f"engine-{spec.slot}.spec.json"
    atomic.write_json(spec_file, asdict(spec))
    log_path = log_dir / f"{spec.slot}.log"
    broker = os.environ.get(BROKER_ENV)
    host_pid = _spawn_via_broker(Path(broker), spec, spec_file, log_path) if broker else _spawn(spec_file, log_path)
    log.info("starting the %s engine on %s (host pid %d, log %s)", spec.backend, spec.slot, host_pid, log_path)
    deadline = time.monotonic() + spec.start_timeout + 60
    while True:
        state = read_state(spec.lock_dir, spec.slot)
        if state is not None and state["pid"] == host_pid:
            log.info("engine on %s ready after %.0fs", spec.slot, state["ready_at"] - state["spawned_at"])
            return state
        if not _alive(host_pid) or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(host_pid, signal.SIGKILL)
            raise EngineFailed(
                f"the {spec.backend} engine on {spec.slot} did not start (host pid {host_pid}); "
                f"its log {log_path} ends:\n{_tail(log_path)}"
            )
        time.sleep(POLL_SECONDS)


def _host_argv(spec_file: Path) -> list[str]:
    return [sys.executable, "-m", "dflash_build.engines.host", "serve", str(spec_file)]


def _spawn(spec_file: Path, log_path: Path) -> int:
    """Start a host from this job, in its own session: it outlives the job and Snakemake's process group."""
    with open(log_path, "ab") as out:
        host = subprocess.Popen(
            _host_argv(spec_file),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": _package_root()},
        )
    return host.pid  # a host that exits early is a zombie until Popen's bookkeeping reaps it: _alive says gone


# -- SLURM: engines that live as long as the allocation -------------------------------------------
# Snakemake runs each job of a group in its own job step (srun), and a cluster with cgroup process
# tracking kills what a step leaves behind when it ends: an engine started by a job would die with that
# job. So the allocation's batch step (the Snakemake that runs the group) starts a *broker*, and jobs ask
# it to start their hosts: the engine then lives in the batch step, as long as the allocation.
BROKER_ENV = "DFLASH_BUILD_ENGINE_BROKER"  # the broker's spool folder, inherited by the job steps
OWNER_ENV = "DFLASH_BUILD_ALLOCATION_PID"  # the batch step's task: engines stop when it is gone
BROKER_ANSWER_SECONDS = 60.0


def start_allocation_broker(cfg: Config, argv: list[str]) -> Path | None:
    """In the batch step of a SLURM allocation whose jobs generate on shared engines, start the broker
    (once: the job steps inherit its folder) and return its folder; elsewhere do nothing."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or os.environ.get("SLURM_STEP_ID") or os.environ.get(BROKER_ENV) or not cfg.engine.shared:
        return None
    if not any(arg.startswith("generate:") for arg in argv):  # Snakemake's --target-jobs of this allocation
        return None
    spool = Path(cfg.engine.lock_dir) / f"broker-{job}"
    spool.mkdir(parents=True, exist_ok=True)
    owner = os.environ.get("SLURM_TASK_PID") or str(os.getpid())
    subprocess.Popen(
        [sys.executable, "-m", "dflash_build.engines.host", "broker", str(spool), owner],
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": _package_root()},
        preexec_fn=_die_with_parent,  # with the batch step's Snakemake
    )
    os.environ[BROKER_ENV] = str(spool)
    os.environ[OWNER_ENV] = owner
    log.info("allocation %s: engine broker in %s", job, spool)
    return spool


def _spawn_via_broker(spool: Path, spec: LaunchSpec, spec_file: Path, log_path: Path) -> int:
    """Ask the allocation's broker to start the host; its pid once the broker has."""
    request = {"slot": spec.slot, "spec": str(spec_file), "log": str(log_path), "id": f"{os.getpid()}-{time.time()}"}
    atomic.write_json(spool / f"{spec.slot}.request.json", request)
    deadline = time.monotonic() + BROKER_ANSWER_SECONDS
    answer = spool / f"{spec.slot}.host.json"
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            started = json.loads(answer.read_text())
            if started["id"] == request["id"]:
                return int(started["pid"])
        time.sleep(POLL_SECONDS)
    raise EngineFailed(
        f"the allocation's engine broker ({spool}) did not start the engine for {spec.slot} within "
        f"{BROKER_ANSWER_SECONDS:g}s; it runs in the job's batch step (see the SLURM log of this job)"
    )


def broker(spool: Path, owner: int) -> int:
    """Start the hosts the allocation's jobs ask for, as children of the batch step, until it ends."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine-broker: %(message)s")
    # The job steps may number their GPU differently from this batch step: map by the node's index.
    visible = {g.node_id: g.visible for g in scheduler_assigned() or []}
    hosts: list[subprocess.Popen[bytes]] = []
    while _alive(owner):
        for path in sorted(spool.glob("*.request.json")):
            request = json.loads(path.read_text())
            spec_file = Path(request["spec"])
            spec = json.loads(spec_file.read_text())
            node_gpu = spec["slot"].rsplit("gpu-", 1)[-1]
            if node_gpu in visible:
                spec["env"] = {**spec["env"], "CUDA_VISIBLE_DEVICES": visible[node_gpu]}
                atomic.write_json(spec_file, spec)
            with open(request["log"], "ab") as out:
                host = subprocess.Popen(
                    _host_argv(spec_file), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
                )
            hosts.append(host)
            atomic.write_json(spool / f"{request['slot']}.host.json", {"pid": host.pid, "id": request["id"]})
            path.unlink()
            log.info("started the host of %s (pid %d) for %s", request["slot"], host.pid, request["id"])
        hosts = [h for h in hosts if h.poll() is None]  # reaps the ones that stopped
        time.sleep(POLL_SECONDS)
    log.info("the allocation's task %d ended; its engines stop with it", owner)
    for host in hosts:
        with contextlib.suppress(subprocess.TimeoutExpired):
            host.wait(timeout=STOP_GRACE_SECONDS + 30)
    return 0


def _join(lock_dir: str, state: dict[str, Any]) -> int | None:
    """Hold another slot's engine for this job, unless it is stopping."""
    fd = _open_lock(_lock_path(lock_dir, state["slot"], "use"))
    if _flock(fd, fcntl.LOCK_SH, timeout=5.0) and read_state(lock_dir, state["slot"]) == state:
        return fd
    os.close(fd)
    return None


_STOP_SIGNALS = {"replaced": signal.SIGUSR1, "stalled": signal.SIGUSR2}  # else SIGTERM: "stopped"


def _stop_host(state: dict[str, Any], reason: str, wait: float = STOP_GRACE_SECONDS + 30) -> None:
    """Signal a host to stop (its users are gone, or its server stalled) and wait until it exits."""
    pid = int(state["pid"])
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, _STOP_SIGNALS.get(reason, signal.SIGTERM))
    deadline = time.monotonic() + wait
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # its server dies with it (PDEATHSIG)


def stop_idle(lock_dir: Path | str, slots: list[str] | None = None) -> list[str]:
    """Stop every engine (of ``slots``) nobody uses now; returns the slots stopped. An engine another
    job or build still uses is left to its idle timeout."""
    stopped = []
    for state in running(lock_dir):
        if slots is not None and state["slot"] not in slots:
            continue
        fd = _open_lock(_lock_path(lock_dir, state["slot"], "use"))
        try:
            if not _flock(fd, fcntl.LOCK_EX, timeout=1.0):
                continue
            if read_state(lock_dir, state["slot"]) == state:
                _stop_host(state, "workflow ended")
                stopped.append(state["slot"])
        finally:
            os.close(fd)
    return stopped


def stop_workflow_engines(cfg: Config) -> list[str]:
    """At the end of a workflow: stop the unused engines this config's builds started (their logs are
    under its logs folder); prints what it stopped."""
    if not through_server(cfg.engine):
        return []
    mine = (cfg.logs / "engines").resolve()
    slots = [s["slot"] for s in running(cfg.engine.lock_dir) if Path(s["log"]).parent == mine]
    stopped = stop_idle(cfg.engine.lock_dir, slots) if slots else []
    if stopped:
        history = cfg.logs / "engines" / "engines.jsonl"  # as the config names it
        print(f"dflash-build: stopped the shared engines on {', '.join(stopped)} (history: {history})")
    return stopped


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def _package_root() -> str:
    root = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])


# -- the engine a job talks to ---------------------------------------------------------------------
SHARED_REQUEST_TIMEOUT = 6 * 3600.0  # a request may wait behind other jobs' requests in the engine's queue


def concurrency(engine: EngineSpec) -> int:
    """Requests one job keeps in flight per engine: enough to fill its batch on its own."""
    serve = registry.get(engine.backend).serve
    return serve.concurrency(engine.options) if serve is not None else 2


STALLED_STOP_SECONDS = 20.0  # a stalled server is SIGKILLed by its host at once; then the host itself


class ServedEngine:
    """The Engine interface over the servers a job is attached to (the openai backend does the HTTP).

    It owns the backend's pool (``PoolHooks``): a server that stalls is stopped (its host SIGKILLs it,
    so the GPU is free) unless another job already replaced it, and the job's own slot gets one
    replacement; a server that died is left; engines of the identity that start later are joined.
    """

    def __init__(self, spec: LaunchSpec, attached: Attached, stop_on_close: bool, pool: bool) -> None:
        self.spec, self.attached, self.stop_on_close, self.pool = spec, attached, stop_on_close, pool
        self.client: Any = None
        self.replaced = self.closed = False
        self._lock = threading.Lock()  # the pool's changes come from threads of their own
        self.identity: dict[str, Any] = {
            "identity_key": spec.identity_key,
            "started_here": attached.started,
            "engines": [_described(e) for e in attached.engines],
        }

    @property
    def name(self) -> str:
        """How warnings name it: every engine the job feeds now, with its host's pid."""
        served = ", ".join(f"{e['slot']} (pid {e['pid']}, {e['url']})" for e in self.attached.engines)
        return f"the shared engine {served or '(none left in the pool; a replacement may be starting)'}"

    def generate(self, requests: Any) -> Any:
        try:
            yield from self.client.generate(requests)
        except ServerDown as e:
            slots = sorted({engine["slot"] for engine in self.identity["engines"]})
            logs = ", ".join(str(Path(self.spec.log_dir) / f"{slot}.log") for slot in slots)
            e.add_note(
                f"No engine of the pool is left (each job replaces its own GPU's engine once). Finished rows are "
                f"journaled. See the engines' logs ({logs}) and the GPUs (nvidia-smi), then run the build again: "
                "it generates only the rest."
            )
            raise

    def lost(self, url: str, why: str, stalled: bool) -> PoolChange:
        """A server left the backend's pool: stop it if it stalled (or, when this job replaces it, stopped
        answering), and replace our own slot's once."""
        with self._lock:
            state = self.attached.leave(url)
        if state is None:
            return PoolChange()
        self.identity.setdefault("lost", []).append({**_described(state), "stalled": stalled, "why": why[:300]})
        # nobody replaced it yet: a stalled server is stopped, and so is one that does not answer when we are
        # about to replace it (a stall, as far as this job can tell; else the replacement would find its
        # host still up, while another job stops it, and join it again)
        if (stalled or self._replaces(state)) and read_state(self.spec.lock_dir, state["slot"]) == state:
            log.warning(
                "stopping the stalled engine on %s (host pid %d, server pid %s, log %s)",
                state["slot"],
                state["pid"],
                state.get("server_pid"),
                state.get("log"),
            )
            _stop_host(state, "stalled", wait=STALLED_STOP_SECONDS)
        if not self._replaces(state):  # asked again: the job may have closed while the engine stopped
            return PoolChange()
        self.replaced = True
        log.warning("starting a replacement engine on %s", self.spec.slot)
        attached = attach(self.spec, pool=False)  # or join the one another job started meanwhile
        with self._lock:
            if self.closed:
                attached.release()
                return PoolChange()
            for joined_url, (joined, fd) in attached.members.items():
                if joined_url in self.attached.members:  # a refresh joined it meanwhile: hold it once
                    os.close(fd)
                    continue
                self.attached.members[joined_url] = (joined, fd)
                self.identity["engines"].append(_described(joined))
        return PoolChange(joined=attached.urls)

    def _replaces(self, lost: dict[str, Any]) -> bool:
        """Whether this job replaces the lost engine: its own slot's, once, while the job is open."""
        return lost["slot"] == self.spec.slot and not (self.replaced or self.closed)

    def refresh(self) -> PoolChange:
        """Members whose engine stopped or was replaced leave; with ``pool``, newly started ones join."""
        with self._lock:
            if self.closed:
                return PoolChange()
            gone = [
                url
                for url, (state, _) in self.attached.members.items()
                if read_state(self.spec.lock_dir, state["slot"]) != state
            ]
            for url in gone:
                self.attached.leave(url)
            joined = join_others(self.spec, self.attached) if self.pool else []
            self.identity["engines"] += [_described(self.attached.members[url][0]) for url in joined]
        return PoolChange(joined=joined, gone=gone)

    def interrupt(self) -> None:
        self.client.interrupt()

    def close(self) -> None:
        try:
            if self.client is not None:
                self.client.close()
        finally:
            with self._lock:
                self.closed = True
                self.attached.release()
            if self.stop_on_close:
                stop_idle(self.spec.lock_dir, [self.spec.slot])


def _described(state: dict[str, Any]) -> dict[str, Any]:
    return {k: state[k] for k in ("slot", "url", "pid", "spawned_at", "ready_at")}


def open_engine(
    cfg: Config,
    stop_ids: list[int],
    lease: GpuLease | None,
    tokenizer: Any,
    model_fingerprint: Any,
    context: int | None,
) -> ServedEngine:
    """Attach to (starting if needed) the engine servers for this config and return a client of them."""
    spec = launch_spec(cfg, stop_ids, lease, model_fingerprint, context)
    attached = attach(spec, pool=cfg.engine.shared)
    served = ServedEngine(spec, attached, stop_on_close=not cfg.engine.shared, pool=cfg.engine.shared)
    try:
        options = {
            "urls": attached.urls,
            "api": registry.get(spec.backend).serve.api,  # type: ignore[union-attr]  # launch_spec checked it
            "concurrency": concurrency(cfg.engine),
            "timeout": SHARED_REQUEST_TIMEOUT,  # a last resort: stalls are caught by engine.stall_timeout
            "retries": int(cfg.engine.options.get("retries", 3)),
        }
        served.client = OpenAIEngine(
            options, stop_ids, tokenizer, cfg.model.path, cfg.engine.stall_timeout, spec.health_path, pool=served
        )
    except BaseException:
        served.close()
        raise
    return served


# -- the host process ------------------------------------------------------------------------------
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
        locks = [_lock_path(spec.lock_dir, spec.slot, "host")] + ([Path(spec.gpu_lock)] if spec.gpu_lock else [])
        for path in locks:
            if not _flock(_open_lock(path), fcntl.LOCK_EX, timeout=spec.start_timeout):
                log.error("%s is held by another engine for %gs; not starting", path, spec.start_timeout)
                return 3
        self.child = subprocess.Popen(
            spec.argv,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **spec.env},
            process_group=0,  # its own group: stopping it stops its workers, not this host
            preexec_fn=_die_with_parent,
        )
        log.info("host %d: started %s (pid %d) on %s", os.getpid(), spec.backend, self.child.pid, spec.slot)
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
        use_fd = _open_lock(_lock_path(self.spec.lock_dir, self.spec.slot, "use"))
        idle_since = time.monotonic()
        last = time.monotonic()
        while self.stop_reason is None:
            time.sleep(POLL_SECONDS)
            now = time.monotonic()
            if self.child.poll() is not None:
                log.error("the server exited with %s", self.child.returncode)
                self.stop_reason = f"server exited ({self.child.returncode})"
                break
            if self.spec.owner_pid is not None and not _alive(self.spec.owner_pid):
                self.stop_reason = "allocation ended"
                break
            try:
                fcntl.flock(use_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a job holds it
                self.busy_seconds += now - last
                idle_since = now
            else:
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
        if child is not None and child.poll() is None:
            # a stalled server may be stopped or deadlocked: it would never act on SIGTERM
            _terminate_group(child, grace=0.0 if self.stop_reason == "stalled" else STOP_GRACE_SECONDS)
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


def _die_with_parent() -> None:
    """In the server's process: SIGKILL when the host dies, however it dies (Linux PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), errno.errorcode.get(ctypes.get_errno(), "prctl"))


def serve(spec_file: str) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine-host: %(message)s")
    spec = LaunchSpec(**json.loads(Path(spec_file).read_text()))
    return _Host(spec).run()


def describe(states: list[dict[str, Any]]) -> str:
    """A line per running engine (``dflash-build engines``)."""
    if not states:
        return "no engine running"
    lines = []
    now = time.time()
    for s in states:
        lines.append(
            f"{s['slot']:<8} {s['backend']:<12} {s['url']:<24} identity {s['identity_key']} "
            f"up {now - s['ready_at']:.0f}s, host pid {s['pid']}, log {s['log']}"
        )
    return "\n".join(lines)


def through_server(engine: EngineSpec) -> bool:
    """Whether jobs talk to a host's server instead of an engine of their own."""
    return engine.shared or registry.get(engine.backend).always_through_server


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        sys.exit(serve(sys.argv[2]))
    if len(sys.argv) == 4 and sys.argv[1] == "broker":
        sys.exit(broker(Path(sys.argv[2]), int(sys.argv[3])))
    sys.exit("usage: python -m dflash_build.engines.host serve SPEC_FILE | broker SPOOL OWNER_PID")
