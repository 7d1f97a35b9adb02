"""GPU pinning with fake GPU ids: real flocks, real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_build.engines import gpus
from dflash_build.spec import EngineSpec


def spec(tmp_path: Path, ids: list[str], wait: float = 0.5) -> EngineSpec:
    return EngineSpec("transformers", {}, tuple(ids), tmp_path / "locks", wait, 40000, 64, 30)


@pytest.fixture(autouse=True)
def no_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID"):
        monkeypatch.delenv(var, raising=False)


def test_each_holder_gets_its_own_gpu_and_ports(tmp_path: Path) -> None:
    engine = spec(tmp_path, ["3", "5"])
    with gpus.pinned(engine) as a, gpus.pinned(engine) as b:
        assert {a.gpu, b.gpu} == {"3", "5"}
        assert os.environ["CUDA_VISIBLE_DEVICES"] == b.gpu
        assert set(a.ports).isdisjoint(b.ports)
        with pytest.raises(RuntimeError, match="no free GPU among"), gpus.pinned(engine):
            pass
    with gpus.pinned(engine) as c:  # released on exit
        assert c.gpu in {"3", "5"}
    assert "CUDA_VISIBLE_DEVICES" not in os.environ, "the process's own view is put back"


def test_a_killed_holder_releases_its_gpu(tmp_path: Path) -> None:
    engine = spec(tmp_path, ["0"], wait=5)
    engine.lock_dir.mkdir(parents=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(engine.lock_dir / 'gpu-0.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    with pytest.raises(RuntimeError), gpus.pinned(spec(tmp_path, ["0"], wait=0.2)):
        pass
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    start = time.monotonic()
    with gpus.pinned(engine) as lease:
        assert lease.gpu == "0" and time.monotonic() - start < 2


def test_a_scheduler_assignment_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6")
    with gpus.pinned(spec(tmp_path, ["0", "1"])) as lease:
        assert (lease.gpu, lease.source, lease.allocation) == ("6", "scheduler", "42")
        assert (tmp_path / "locks" / "gpu-6.lock").exists(), "the configured GPUs are not this job's"
        with pytest.raises(RuntimeError, match="the GPUs the scheduler gave"), gpus.pinned(spec(tmp_path, ["0"])):
            pass


def test_an_allocation_of_several_gpus_runs_a_job_on_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # renumbered by the cluster
    monkeypatch.setenv("SLURM_STEP_GPUS", "4,6")  # the node's own indices
    engine = spec(tmp_path, [])
    with gpus.pinned(engine) as a:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # as the next job's own process sees it
        with gpus.pinned(engine) as b:
            assert sorted([(a.gpu, a.node_id), (b.gpu, b.node_id)]) == [("0", "4"), ("1", "6")]
            assert sorted([a.port, b.port]) == [40040, 40060], "ports follow the node's GPU index"
            assert sorted(p.name for p in (tmp_path / "locks").iterdir()) == ["gpu-4.lock", "gpu-6.lock"]


def test_two_allocations_on_one_node_never_share_a_lock_or_a_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With cgroup-constrained devices every job sees its GPU as 0; the node's index tells them apart."""

    def allocation(job: str, node_gpu: str) -> None:  # what each job's own process sees
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
        monkeypatch.setenv("SLURM_JOB_GPUS", node_gpu)

    allocation("7", "2")
    with gpus.pinned(spec(tmp_path, [], wait=0.2)) as a:
        allocation("8", "3")
        with gpus.pinned(spec(tmp_path, [], wait=0.2)) as b:
            assert a.gpu == b.gpu == "0" and (a.node_id, b.node_id) == ("2", "3")
            assert set(a.ports).isdisjoint(b.ports)


def test_gpu_list_defaults_to_visible_devices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,4")
    engine = EngineSpec("sglang", {}, None, tmp_path, 0, 40000, 64, 30)
    assert gpus.gpu_list(engine) == ["2", "4"]
