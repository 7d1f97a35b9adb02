"""GPU pinning for independent single-GPU generation jobs.

Snakemake counts `--resources gpu=N` but never says which GPU a job gets. A job takes a free one with
a non-blocking ``flock`` on one lock file per GPU (the kernel drops the lock when the job dies, even
on SIGKILL), and sets CUDA_VISIBLE_DEVICES before any engine is imported. Each GPU slot gets its own
port range, so several engines on one machine never collide (SGLang derives its NCCL port from its
port when it is not given one). When a scheduler already assigned GPUs (SLURM sets
CUDA_VISIBLE_DEVICES per job), that assignment wins and nothing is locked.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dflash_build.config import EngineSpec

log = logging.getLogger(__name__)
PORTS_PER_SLOT = 10
_SCHEDULER_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")


@dataclass(frozen=True)
class GpuLease:
    gpu: str  # what CUDA_VISIBLE_DEVICES is set to
    slot: int  # index in the GPU list, for ports
    port: int
    source: str  # "lock" or "scheduler"
    acquired_at: float

    @property
    def ports(self) -> range:
        return range(self.port, self.port + PORTS_PER_SLOT)


def scheduler_assigned() -> str | None:
    """CUDA_VISIBLE_DEVICES as set by a batch scheduler for this job, if any."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible and any(os.environ.get(v) for v in _SCHEDULER_VARS):
        return visible
    return None


def visible_gpus() -> list[str]:
    """GPUs this machine shows: CUDA_VISIBLE_DEVICES if set, else what nvidia-smi lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [g.strip() for g in visible.split(",") if g.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, check=False
    )
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def gpu_list(engine: EngineSpec) -> list[str]:
    gpus = list(engine.gpus) if engine.gpus is not None else visible_gpus()
    if not gpus:
        raise RuntimeError(
            "config key 'engine.gpus': no GPU to run on (none configured, CUDA_VISIBLE_DEVICES unset, "
            "nvidia-smi lists none)"
        )
    return gpus


def _try_lock(path: Path) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def job_locks(engine: EngineSpec, gpus: list[str]) -> list[tuple[int, Path]]:
    """(GPU slot, lock file) a job may take. Its own engine: the GPU's lock. Shared engines: one of
    ``jobs_per_engine`` job locks per GPU (the engine's host holds the GPU's lock, see engine_host)."""
    if not engine.shared:
        return [(slot, engine.lock_dir / f"gpu-{g}.lock") for slot, g in enumerate(gpus)]
    return [
        (slot, engine.lock_dir / f"gpu-{g}.job-{k}.lock")
        for k in range(engine.jobs_per_engine)
        for slot, g in enumerate(gpus)
    ]


@contextmanager
def pinned(engine: EngineSpec) -> Iterator[GpuLease]:
    """Hold one GPU (with shared engines: one of its job places) for the block; sets CUDA_VISIBLE_DEVICES."""
    assigned = scheduler_assigned()
    if assigned is not None:
        log.info("GPU %s assigned by the scheduler", assigned)
        yield GpuLease(assigned, 0, engine.base_port, "scheduler", time.time())
        return
    gpus = gpu_list(engine)
    places = job_locks(engine, gpus)
    engine.lock_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + engine.gpu_wait_seconds
    # Start at a pid-dependent place so jobs that start together do not all try GPU 0 first.
    start = os.getpid() % len(gpus)
    while True:
        for offset in range(len(places)):
            slot, path = places[(start + offset) % len(places)]
            fd = _try_lock(path)
            if fd is None:
                continue
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus[slot]
            lease = GpuLease(gpus[slot], slot, engine.base_port + PORTS_PER_SLOT * slot, "lock", time.time())
            log.info("took GPU %s (slot %d, ports %d-%d, %s)", lease.gpu, slot, lease.port, lease.ports[-1], path.name)
            try:
                yield lease
            finally:
                os.close(fd)  # releases the flock
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"no free GPU among {gpus} after {engine.gpu_wait_seconds:g}s (locks in {engine.lock_dir}); "
                "is another build holding them, or does --resources gpu exceed config key 'engine.gpus'?"
            )
        time.sleep(0.5)
