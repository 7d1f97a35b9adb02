"""The warm job runner (dflash_build.warm) under a real Snakemake: jobs done by forks of one runner, in
their job's process group, ending as their own processes would have ended, and a killed job's process
taking its fork with it. Builds from empty: a Snakefile of a few lines, no dataset (about 15 s)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dflash_build import warm

pytestmark = pytest.mark.workflow

REPO = Path(__file__).resolve().parent.parent

JOBS = """
import os, signal, sys, time
from pathlib import Path

def ok(smk):
    print(f"stdout of {smk.wildcards.n}", flush=True)
    print(f"stderr of {smk.wildcards.n}", file=sys.stderr)
    import pyarrow  # what a stage imports: the runner holds it for the next job of the rule
    seen = [os.getpid(), os.getppid(), os.getpgrp(), os.getcwd(), os.environ.get("WARM_TEST_VALUE")]
    Path(smk.output[0]).write_text(" ".join(map(str, seen)))

def exits(smk):
    sys.exit(3)

def exits_negative(smk):
    sys.exit(-1)

def raises(smk):
    raise ValueError("a failing job")

def killed(smk):
    os.kill(os.getpid(), signal.SIGKILL)

def waits(smk):
    Path(smk.params.pid).write_text(str(os.getpid()))
    time.sleep(120)
"""

SNAKEFILE = """
rule ok:
    output: "ok/{n}"
    script: "job.py"
for name in ("exits", "exits_negative", "raises", "killed", "waits"):
    rule:
        name: name
        output: f"{name}/out"
        params: pid=f"{name}.pid"
        script: "job.py"
"""


@pytest.fixture
def workflow(tmp_path: Path) -> Path:
    (tmp_path / "warmjobs.py").write_text(JOBS)
    (tmp_path / "Snakefile").write_text(textwrap.dedent(SNAKEFILE))
    (tmp_path / "job.py").write_text(
        'from dflash_build import warm\nwarm.run(snakemake, f"warmjobs:{snakemake.rule}")\n'
    )
    return tmp_path


def _snakemake(workdir: Path, *targets: str, warm_env: str = "1", own_session: bool = False) -> subprocess.Popen[str]:
    env = {**os.environ, warm.WARM_ENV: warm_env, "WARM_TEST_VALUE": "seen"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(workdir), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "snakemake", "--cores", "2", "--keep-going", *targets]
    return subprocess.Popen(
        cmd,
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=own_session,
    )


def _seen(workdir: Path, n: int) -> list[str]:
    return (workdir / "ok" / str(n)).read_text().split()


def test_jobs_are_forks_of_one_runner_in_their_jobs_group_and_end_as_their_processes_would(workflow: Path) -> None:
    """Each job's fork has the runner for parent (not Snakemake), Snakemake's process group, the job's
    working directory, environment and output; a job that exits 3 or -1, raises or is killed by a signal fails
    as it does in a process of its own; a second build is served by the same runner, the first job of
    the rule included."""
    first = _snakemake(workflow, "ok/1", "ok/2", "ok/3", "exits/out", "exits_negative/out", "raises/out", "killed/out")
    said, _ = first.communicate(timeout=120)
    assert first.returncode != 0
    runners = {_seen(workflow, n)[1] for n in (1, 2, 3)}
    assert len(runners) == 1 and int(runners.pop()) != first.pid, said
    for n in (1, 2, 3):
        _, _, group, cwd, value = _seen(workflow, n)
        assert (int(group), cwd, value) == (os.getpgrp(), str(workflow), "seen")  # Snakemake's group: this one
        assert f"stdout of {n}" in said and f"stderr of {n}" in said
    second = _snakemake(workflow, "ok/4")
    assert second.wait(timeout=120) == 0
    assert _seen(workflow, 4)[1] == _seen(workflow, 1)[1]
    plain = _snakemake(workflow, "ok/5", "exits/out", "exits_negative/out", "raises/out", "killed/out", warm_env="0")
    said_plain, _ = plain.communicate(timeout=120)
    assert int(_seen(workflow, 5)[1]) == plain.pid  # the job's own process, Snakemake's child
    for text in (said, said_plain):
        assert "non-zero exit status 3" in text and "non-zero exit status 255" in text, text
        assert "ValueError: a failing job" in text, text
        assert re.search(r"died with <Signals.SIGKILL: 9>|negative exit status -9|exit status 137", text), text


def test_a_killed_jobs_process_takes_its_fork_with_it_and_a_builds_own_session_empties(workflow: Path) -> None:
    """SIGKILL to a job's process (what Snakemake's kill of a job sends) closes its connection; the
    runner kills the fork, which would otherwise go on unwatched. The build runs in a session of its own
    (``setsid``): once its Snakemake ends, its runner ends too, and nothing is left in the session."""
    build = _snakemake(workflow, "waits/out", own_session=True)
    pid_file = workflow / "waits.pid"
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    fork = int(pid_file.read_text())
    client = next(p for p in _children(build.pid) if b"job.py" in Path(f"/proc/{p}/cmdline").read_bytes())
    os.kill(client, signal.SIGKILL)
    assert build.wait(timeout=60) != 0
    deadline = time.monotonic() + 10
    while _alive(fork) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(fork)
    while _in_session(build.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _in_session(build.pid), "the runner ends with its session's Snakemake"


def _children(parent: int) -> list[int]:
    return [pid for pid, fields in _processes() if int(fields[1]) == parent]


def _in_session(session: int) -> list[int]:
    return [pid for pid, fields in _processes() if int(fields[3]) == session and fields[0] != "Z"]


def _processes() -> list[tuple[int, list[str]]]:
    """Each live process and its /proc stat fields after the command name (state, ppid, group, session)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):  # gone meanwhile
                found.append((int(entry.name), (entry / "stat").read_text().rsplit(")", 1)[1].split()))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
