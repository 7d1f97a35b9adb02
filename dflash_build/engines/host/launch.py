"""What a host launches for one engine: the :class:`LaunchSpec` (its command, GPU, ports, identity), and
the host's own command line."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_build import hashing
from dflash_build.engines import registry
from dflash_build.engines.gpus import GpuLease, gpu_lock
from dflash_build.spec import Config, EngineSpec

OWNER_ENV = "DFLASH_BUILD_ALLOCATION_PID"  # the batch step's task: engines stop when it is gone


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


def launch_spec(
    cfg: Config,
    stop_ids: list[int],
    lease: GpuLease | None,
    model_fingerprint: Any,
    context: int | None,
    engine: EngineSpec | None = None,
) -> LaunchSpec:
    """The server for this config (``engine``: another engine for its target) on the lease's GPU (or the
    CPU slot), and the identity it serves."""
    engine, model = engine or registry.for_generation(cfg.engine), cfg.model
    slot = "cpu" if lease is None else f"gpu-{lease.node_id}"
    if lease is not None and lease.allocation:  # engines serve their own allocation only
        slot = f"job-{lease.allocation}.{slot}"
    port = lease.port if lease is not None else engine.base_port
    backend = registry.get(engine.backend)
    # the driver's own options (how a job talks to the engine) are not what the engine is
    options = backend.engine_options(engine.options)
    serve = backend.serve
    if serve is None:
        raise ValueError(f"config key 'engine.backend': {engine.backend} engines run in the job, not as servers")
    argv = serve.argv(model, engine.options, stop_ids, port, context, lease)
    env = {**serve.env(engine.options), **({"CUDA_VISIBLE_DEVICES": lease.gpu} if lease is not None else {})}
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


def host_argv(spec_file: Path) -> list[str]:
    return [sys.executable, "-m", "dflash_build.engines.host", "serve", str(spec_file)]


def package_root() -> str:
    root = str(Path(__file__).resolve().parents[3])
    return os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])


def die_with_parent() -> None:
    """In the server's process: SIGKILL when the host dies, however it dies (Linux PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), errno.errorcode.get(ctypes.get_errno(), "prctl"))
