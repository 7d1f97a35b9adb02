"""A real single-node SLURM cluster on this machine, for the tests (Debian's slurm-wlm and munge, as root).

slurmctld and slurmd run in the foreground as children of the test; the node has 8 CPUs, 16 GB and 4
fake GPUs (character devices in a temporary folder, enough for the gres/gpu plugin to hand them out and
set CUDA_VISIBLE_DEVICES). The configuration goes to /etc/slurm, where the commands inside a job look
for it (Snakemake's SLURM job step drops SLURM_* variables such as SLURM_CONF), and is removed again.
Run by hand: ``python tests/slurm_cluster.py`` starts one and waits for Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

MARK = "# dflash-build test cluster"
CONF_DIR = Path("/etc/slurm")
GPUS = 4
NEEDED = ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "srun")


def missing() -> str | None:
    """Why no cluster can start here, or None."""
    if os.geteuid() != 0:
        return "the test cluster needs root (it writes /etc/slurm and starts munged)"
    absent = [c for c in NEEDED if shutil.which(c) is None and not Path("/usr/sbin", c).exists()]
    if absent:
        return f"{', '.join(absent)} not installed (Debian: apt-get install slurm-wlm munge; make test does)"
    conf = CONF_DIR / "slurm.conf"
    if conf.exists() and MARK not in conf.read_text():
        return f"{conf} belongs to a real cluster; not touching it"
    return None


def _config(root: Path, host: str) -> str:
    return f"""{MARK}
ClusterName=dflash
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
GresTypes=gpu
DefMemPerCPU=500
# squeue must still see a finished job when Snakemake asks (the plugin falls back to sacct below 3x its poll)
MinJobAge=600
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerParameters=sched_interval=1
NodeName={host} NodeAddr=127.0.0.1 CPUs=8 RealMemory=16000 Gres=gpu:{GPUS} State=UNKNOWN
PartitionName=main Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _munge_running() -> bool:
    if shutil.which("munge") is None:
        return False
    enc = subprocess.run(["munge", "-n"], capture_output=True, check=False)
    return enc.returncode == 0 and subprocess.run(["unmunge"], input=enc.stdout, capture_output=True).returncode == 0


def _wait(predicate: object, seconds: float, what: str, logs: Path) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(logs.glob("*.log")))
            raise RuntimeError(f"test cluster: {what} not within {seconds:g}s\n{tails}")
        time.sleep(0.5)


@contextlib.contextmanager
def cluster(root: Path) -> Iterator[Path]:
    """Start the cluster with its files under ``root``; stop it and remove its files on the way out."""
    why = missing()
    if why is not None:
        raise RuntimeError(why)
    host = socket.gethostname()
    for sub in ("state", "spool", "log", "dev"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for i in range(GPUS):  # the gres plugin wants character devices; these are /dev/nvidia's numbers
        dev = root / "dev" / f"nvidia{i}"
        if not dev.exists():
            os.mknod(dev, 0o600 | 0o020000, os.makedev(195, i))
    CONF_DIR.mkdir(parents=True, exist_ok=True)
    (CONF_DIR / "slurm.conf").write_text(_config(root, host))
    (CONF_DIR / "gres.conf").write_text(f"{MARK}\nNodeName={host} Name=gpu File={root}/dev/nvidia[0-{GPUS - 1}]\n")
    daemons: list[subprocess.Popen[bytes]] = []
    munged = None
    try:
        if not _munge_running():
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            munged = subprocess.Popen(["runuser", "-u", "munge", "--", _sbin("munged"), "--foreground"])
            _wait(_munge_running, 20, "munged answers", root / "log")
        for daemon in ("slurmctld", "slurmd"):
            out = open(root / "log" / f"{daemon}.stdout.log", "ab")  # noqa: SIM115 - the daemon's, closed with it
            daemons.append(subprocess.Popen([_sbin(daemon), "-D"], stdout=out, stderr=subprocess.STDOUT))

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, check=False)
            return out.stdout.strip() == "idle"

        _wait(idle, 60, "the node is idle", root / "log")
        yield root
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], capture_output=True, check=False)
        for proc in reversed(daemons + ([munged] if munged else [])):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for name in ("slurm.conf", "gres.conf"):
            path = CONF_DIR / name
            if path.exists() and MARK in path.read_text():
                path.unlink()


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory(prefix="slurm-") as tmp, cluster(Path(tmp)):
        print(f"cluster up (files in {tmp}); Ctrl-C stops it")
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
