"""GPU pinning for independent single-GPU generation jobs.

Snakemake counts `--resources gpu=N` but never says which GPU a job gets. A job takes a free one with
a non-blocking ``flock`` on one lock file per GPU (the kernel drops the lock when the job dies, even
on SIGKILL), and sets CUDA_VISIBLE_DEVICES before any engine is imported. Each GPU gets its own port
range, so several engines on one machine never collide (SGLang derives its NCCL port from its port when
it is not given one).

Under a batch scheduler (SLURM sets CUDA_VISIBLE_DEVICES per job) the allocation's GPUs are the only
candidates, and a job still locks one of them: an allocation of several GPUs runs several jobs. A
scheduler may renumber CUDA_VISIBLE_DEVICES from 0 in every job (cgroup-constrained devices), so locks
and ports are named by the node's own GPU index (SLURM_STEP_GPUS / SLURM_JOB_GPUS): two allocations on
one node never share a lock or a port. The lock folder must be local to the node (the default is).
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

from dflash_build.spec import EngineSpec

log = logging.getLogger(__name__)
PORTS_PER_SLOT = 10
_SCHEDULER_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")


@dataclass(frozen=True)
class GpuLease:
    gpu: str  # what CUDA_VISIBLE_DEVICES is set to
    port: int  # the first of the GPU's PORTS_PER_SLOT ports
    source: str  # where the candidates came from: "lock" (config or the machine) or "scheduler"
    acquired_at: float
    node_gpu: str = ""  # the node's own index of the GPU, which names its lock (gpu if empty)
    allocation: str = ""  # the scheduler's job id, if any

    @property
    def ports(self) -> range:
        return range(self.port, self.port + PORTS_PER_SLOT)

    @property
    def node_id(self) -> str:
        return self.node_gpu or self.gpu


@dataclass(frozen=True)
class Gpu:
    visible: str  # CUDA_VISIBLE_DEVICES for a job on it
    node_id: str  # the node's own index: names the GPU's lock and, when numeric, its port range
    slot: int  # its port range: base_port + PORTS_PER_SLOT * slot


def scheduler_job() -> str | None:
    """The batch scheduler's id of the job (allocation) this process runs in, if any."""
    return next((os.environ[v] for v in _SCHEDULER_VARS if os.environ.get(v)), None)


def scheduler_assigned() -> list[Gpu] | None:
    """The GPUs a batch scheduler assigned to this job, if any."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible or scheduler_job() is None:
        return None
    ids = [g.strip() for g in visible.split(",") if g.strip()]
    node_ids = ids
    for var in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):  # the node's indices, parallel to CUDA_VISIBLE_DEVICES
        listed = [g.strip() for g in os.environ.get(var, "").split(",") if g.strip()]
        if len(listed) == len(ids):
            node_ids = listed
            break
    return [Gpu(v, n, int(n) if n.isdigit() else i) for i, (v, n) in enumerate(zip(ids, node_ids, strict=True))]


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


def candidates(engine: EngineSpec) -> tuple[list[Gpu], str]:
    """The GPUs a job may take, and where that list came from."""
    assigned = scheduler_assigned()
    if assigned is not None:
        return assigned, "scheduler"
    return [Gpu(g, g, slot) for slot, g in enumerate(gpu_list(engine))], "lock"


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


def job_locks(engine: EngineSpec, gpus: list[Gpu]) -> list[tuple[Gpu, Path]]:
    """(GPU, lock file) a job may take. Its own engine: the GPU's lock. Shared engines: one of
    ``jobs_per_engine`` job locks per GPU (the engine's host holds the GPU's lock, see engine_host)."""
    if not engine.shared:
        return [(g, gpu_lock(engine, g.node_id)) for g in gpus]
    return [(g, engine.lock_dir / f"gpu-{g.node_id}.job-{k}.lock") for k in range(engine.jobs_per_engine) for g in gpus]


def gpu_lock(engine: EngineSpec, node_id: str) -> Path:
    """The lock whose holder runs the one engine on that GPU."""
    return engine.lock_dir / f"gpu-{node_id}.lock"


def every_gpu(engine: EngineSpec) -> list[GpuLease]:
    """A lease of each GPU the build would use, by the ports and slots its jobs take (``preflight`` starts an
    engine on each as they would; a shared engine's host takes the GPU's own lock, not a job's place)."""
    gpus, source = candidates(engine)
    allocation = (scheduler_job() or "") if source == "scheduler" else ""
    return [
        GpuLease(g.visible, engine.base_port + PORTS_PER_SLOT * g.slot, source, time.time(), g.node_id, allocation)
        for g in gpus
    ]


@contextmanager
def pinned(engine: EngineSpec) -> Iterator[GpuLease]:
    """Hold one GPU (with shared engines: one of its job places) for the block; sets CUDA_VISIBLE_DEVICES for
    the block, and puts back what it was."""
    gpus, source = candidates(engine)
    if source == "scheduler":
        log.info("GPUs %s assigned by the scheduler (job %s)", [g.visible for g in gpus], scheduler_job())
    places = job_locks(engine, gpus)
    engine.lock_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + engine.gpu_wait_seconds
    # Start at a pid-dependent place so jobs that start together do not all try GPU 0 first.
    start = os.getpid() % len(gpus)
    while True:
        for offset in range(len(places)):
            gpu, path = places[(start + offset) % len(places)]
            fd = _try_lock(path)
            if fd is None:
                continue
            before = os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu.visible
            port = engine.base_port + PORTS_PER_SLOT * gpu.slot
            allocation = (scheduler_job() or "") if source == "scheduler" else ""
            lease = GpuLease(gpu.visible, port, source, time.time(), gpu.node_id, allocation)
            log.info(
                "took GPU %s (node GPU %s, ports %d-%d, %s)", gpu.visible, gpu.node_id, port, lease.ports[-1], path.name
            )
            try:
                yield lease
            finally:
                os.close(fd)  # releases the flock
                # the process's own view again: a later lease (accept's next server) chooses among them all
                if before is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = before
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"no free GPU among {[g.visible for g in gpus]} ({source}) after {engine.gpu_wait_seconds:g}s "
                f"(locks in {engine.lock_dir}); is another build holding them, or does --resources gpu exceed "
                "config key 'engine.gpus' (or the GPUs the scheduler gave this job)?"
            )
        time.sleep(0.5)
