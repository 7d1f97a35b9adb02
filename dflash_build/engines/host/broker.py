"""SLURM: engines that live as long as the allocation.

Snakemake runs each job of a group in its own job step (srun), and a cluster with cgroup process
tracking kills what a step leaves behind when it ends: an engine started by a job would die with that
job. So the allocation's batch step (the Snakemake that runs the group) starts a *broker*, and jobs ask
it to start their hosts: the engine then lives in the batch step, as long as the allocation.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from dflash_build.engines.base import EngineFailed
from dflash_build.engines.gpus import scheduler_assigned
from dflash_build.engines.host.launch import OWNER_ENV, LaunchSpec, die_with_parent, host_argv, package_root
from dflash_build.engines.host.slots import STOP_GRACE_SECONDS, alive
from dflash_build.spec import Config
from dflash_build.store import atomic

log = logging.getLogger(__name__)
POLL_SECONDS = 0.2
BROKER_ENV = "DFLASH_BUILD_ENGINE_BROKER"  # the broker's spool folder, inherited by the job steps
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
        env={**os.environ, "PYTHONPATH": package_root()},
        preexec_fn=die_with_parent,  # with the batch step's Snakemake
    )
    os.environ[BROKER_ENV] = str(spool)
    os.environ[OWNER_ENV] = owner
    log.info("allocation %s: engine broker in %s", job, spool)
    return spool


def spawn_via_broker(spool: Path, spec: LaunchSpec, spec_file: Path, log_path: Path) -> int:
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
    while alive(owner):
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
                    host_argv(spec_file), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
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
