"""Long-lived engines shared by consecutive jobs (dflash_build.engines.host), on real servers: our own
server around the transformers backend on a tiny model (fake GPU ids on the CPU, as the pinning tests
do) and llama.cpp's server on the SmolLM2 GGUF."""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from dflash_build import config as config_mod
from dflash_build import plan as plan_mod
from dflash_build import workflow
from dflash_build.engines import Request, SamplingParams
from dflash_build.engines import host as engine_host
from dflash_build.engines.gpus import Gpu, GpuLease, job_locks
from dflash_build.spec import Config, ConfigError, EngineSpec
from dflash_build.store import atomic
from tests.conftest import (
    Workflow,
    base_config,
    completion_rows,
    engine_history,
    job_logs,
    lock_free,
    once_per_session,
    own_engines,
    own_ports,
    wait_until,
    write_jsonl,
)


def _source(data: Path, n: int) -> dict[str, Any]:
    write_jsonl(data / "p.jsonl", [{"instruction": f"Write line number {i} of a poem."} for i in range(n)])
    return {"poems": {"category": "general", "files": [str(data / "p.jsonl")], "format": "alpaca"}}


def _alive(pid: int) -> bool:
    return engine_host.alive(pid)


def _first_failed_contact(logs: Path) -> float:
    """When a generate job's first request or health check to a server failed (its log's timestamp)."""
    stamps = []
    for log in (logs / "completions").rglob("*.log"):
        for line in log.read_text().splitlines():
            if re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}", line) and (
                "failed (" in line or "leaves the pool" in line
            ):
                stamps.append(datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp())
                break
    assert stamps, "no generate job logged a failed contact with its server"
    return min(stamps)


# -- through Snakemake -------------------------------------------------------------------------------
def _workflow(root: Path, model: Path, shared: bool, n: int = 12, **engine: Any) -> Workflow:
    config = base_config(model, _source(root / "data", n), shard_size=2)
    own_engines(config, root / "locks", gpus=["0", "1"], shared=shared, **engine)
    config["sampling"]["max_new_tokens"] = 8
    wf = Workflow(root / "work")
    wf.workdir.mkdir(parents=True, exist_ok=True)
    wf.write_config(config)
    return wf


@pytest.fixture(scope="module")
def per_job_rows(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[tuple[str, int], Any]:

    def build(root: Path) -> None:
        wf = _workflow(root, tiny_model, shared=False)
        wf.run("--resources", "gpu=2", "--until", "generate", cores=4)
        assert not engine_history(wf.workdir / "logs"), "jobs on their own engines start no engine host"

    return completion_rows(once_per_session(tmp_path_factory, "per-job-engines", build) / "work" / "store")


@pytest.mark.workflow
def test_shared_engines_write_exactly_what_per_job_engines_write(
    tmp_path: Path, tiny_model: Path, per_job_rows: dict[tuple[str, int], Any]
) -> None:
    wf = _workflow(tmp_path, tiny_model, shared=True)
    proc = wf.run("--resources", "gpu=2", "--until", "generate", cores=6)
    assert "gpu_jobs=" in proc.stdout + proc.stderr, "the rule asks for gpu_jobs, registered as gpu x jobs_per_engine"
    assert completion_rows(wf.workdir / "store") == per_job_rows, "a shared engine must not change a single row"

    history = engine_history(wf.workdir / "logs")
    assert sorted(h["slot"] for h in history) == ["gpu-0", "gpu-1"], f"one engine per GPU for all 6 jobs: {history}"
    assert all(h["reason"] == "stopped" for h in history), "the workflow's end stops its engines"
    assert not engine_host.running(tmp_path / "locks")
    stats = [json.loads(p.read_text()) for p in (wf.workdir / "store" / "completions").rglob("*.stats.json")]
    assert len(stats) == 6
    keys = {s["engine"]["served"]["identity_key"] for s in stats}
    assert len(keys) == 1, "every job wanted the same engine"
    started = sum(s["engine"]["served"]["started_here"] for s in stats)
    assert started == 2, "the first job on each GPU started its engine; the others reused it"
    # jobs feed every running engine of their identity, not only their own GPU's
    assert any(len(s["engine"]["served"]["engines"]) == 2 for s in stats)
    # at most jobs_per_engine jobs per GPU at once (gpu_jobs = 2 x 2), each holding its own place
    spans = [(s["started_at"], s["finished_at"]) for s in stats]
    for t in itertools.chain.from_iterable(spans):
        assert sum(a <= t < b for a, b in spans) <= 4


@pytest.mark.workflow
def test_a_stopped_shared_engine_is_replaced_and_the_build_writes_what_an_undisturbed_one_does(
    tmp_path: Path, tiny_model: Path, per_job_rows: dict[tuple[str, int], Any]
) -> None:
    """SIGSTOP of the one GPU's server once it served a shard: within stall_timeout and a health check,
    the jobs that send it requests name it, its host kills it, one job starts a replacement that the
    other joins, the stalled requests are sent again, and the rows are exactly the undisturbed build's
    (which ran on two GPUs: which engine answers changes nothing)."""
    stall_timeout = 2.0
    wf = _workflow(tmp_path, tiny_model, shared=True, stall_timeout=stall_timeout)
    config = yaml.safe_load((wf.workdir / "config.yaml").read_text())
    config["engine"]["gpus"] = ["0"]  # nowhere else to go: the build goes on only if the engine is replaced
    wf.write_config(config)
    locks, stopped = tmp_path / "locks", {}

    def stop_the_server() -> None:
        store = wf.workdir / "store"
        wait_until(lambda: any(store.glob("completions/*/*/*.parquet")), 180, "a shard is published")
        state = engine_host.read_state(locks, "gpu-0")
        assert state is not None
        os.kill(state["server_pid"], signal.SIGSTOP)
        stopped.update(state, stopped_at=time.time())

    stopper = threading.Thread(target=stop_the_server)
    stopper.start()
    wf.run("--resources", "gpu=1", "--until", "generate", cores=4)
    stopper.join()
    assert completion_rows(wf.workdir / "store") == per_job_rows, "the healed build lost or changed no row"

    history = engine_history(wf.workdir / "logs")
    [stall] = [h for h in history if h["reason"] == "stalled"]
    assert stall["host_pid"] == stopped["pid"] and stall["slot"] == "gpu-0"
    # a job's next request or its first health check, then stall_timeout and a check of two attempts; a
    # job sees the stop only once it sends something (on a loaded machine the next job starts seconds
    # later): from its first failed contact, less that attempt's deadline (stall_timeout)
    seen_from = max(stopped["stopped_at"], _first_failed_contact(wf.workdir / "logs") - stall_timeout)
    handled = stall["stopped_at"] - seen_from
    assert handled < 3 * stall_timeout + 15, f"the stopped engine was handled {handled:.1f}s after a job could see it"
    assert not _alive(stopped["server_pid"]), "the stopped server was killed, not left holding its GPU"
    replacements = [h for h in history if h["host_pid"] != stopped["pid"]]
    assert [h["reason"] for h in replacements] == ["stopped"], "one replacement, stopped with the workflow"
    assert replacements[0]["spawned_at"] >= stall["stopped_at"] - 1

    logs = job_logs(wf)
    assert f"{stopped['url']} leaves the pool (stalled: no answer " in logs
    pids = f"host pid {stopped['pid']}, server pid {stopped['server_pid']}"
    assert f"stopping the stalled engine on gpu-0 ({pids}" in logs
    assert "starting a replacement engine on gpu-0" in logs
    stats = [json.loads(p.read_text()) for p in (wf.workdir / "store" / "completions").rglob("*.stats.json")]
    lost = [e for s in stats for e in s["engine"]["served"].get("lost", [])]
    assert lost and all(e["slot"] == "gpu-0" and e["pid"] == stopped["pid"] for e in lost), lost
    assert not engine_host.running(locks)


# -- the host itself ---------------------------------------------------------------------------------
def _config(root: Path, raw: dict[str, Any]) -> Config:
    path = root / "config.yaml"
    path.write_text(json.dumps(raw))
    return config_mod.load(path)


def _spec(root: Path, model: Path, gpu: str = "0", idle_timeout: float = 600, **options: Any) -> engine_host.LaunchSpec:
    cfg = _host_config(root, model, idle_timeout, **options)
    lease = GpuLease(gpu, cfg.engine.base_port + 10 * int(gpu), "lock", time.time())
    return engine_host.launch_spec(cfg, [2], lease, {"weights": str(model)}, 2048)


def _host_config(root: Path, model: Path, idle_timeout: float = 600, **options: Any) -> Config:
    return _config(
        root,
        {
            **base_config(model, _source(root / "data", 1)),
            "logs": str(root / "logs"),
            "engine": {
                "backend": "transformers",
                "options": {"device": "cpu", "batch_size": 4, "threads": 1, **options},
                "lock_dir": str(root / "locks"),
                "shared": True,
                "idle_timeout": idle_timeout,
                "start_timeout": 120,
                "base_port": own_ports(),
            },
        },
    )


@pytest.mark.workflow
def test_a_job_reuses_a_matching_engine_and_replaces_another_once_its_users_are_done(
    tmp_path: Path, tiny_model: Path
) -> None:
    spec_a = _spec(tmp_path, tiny_model)
    first = engine_host.attach(spec_a)
    assert first.started
    pid_a = first.engines[0]["pid"]
    second = engine_host.attach(spec_a)
    assert not second.started and second.engines[0]["pid"] == pid_a, "same identity: the running engine serves"
    first.release()

    spec_b = _spec(tmp_path, tiny_model, dtype="bfloat16")  # a keyed option: another identity
    assert spec_b.identity_key != spec_a.identity_key and spec_b.slot == spec_a.slot
    got: list[engine_host.Attached] = []
    waiter = threading.Thread(target=lambda: got.append(engine_host.attach(spec_b)))
    waiter.start()
    time.sleep(2)
    assert not got and _alive(pid_a), "the engine is not replaced under a job that still uses it"
    second.release()
    waiter.join(timeout=120)
    assert got and got[0].started
    assert not _alive(pid_a)
    assert engine_host.read_state(spec_b.lock_dir, spec_b.slot)["identity_key"] == spec_b.identity_key
    assert [h["reason"] for h in engine_history(tmp_path / "logs")] == ["replaced"]
    got[0].release()
    assert engine_host.stop_idle(spec_b.lock_dir) == [spec_b.slot]


@pytest.mark.workflow
def test_an_unused_engine_stops_after_its_idle_timeout_and_frees_its_gpu(tmp_path: Path, tiny_model: Path) -> None:
    spec = _spec(tmp_path, tiny_model, idle_timeout=1)
    attached = engine_host.attach(spec)
    state = attached.engines[0]
    time.sleep(2.5)
    assert _alive(state["pid"]), "in use: no idle timeout"
    attached.release()
    wait_until(lambda: not _alive(state["pid"]) and not _alive(state["server_pid"]), 30, "the idle engine stopped")
    assert engine_host.read_state(spec.lock_dir, spec.slot) is None
    assert [h["reason"] for h in engine_history(tmp_path / "logs")] == ["idle for 1s"]
    assert lock_free(Path(spec.gpu_lock)), "the GPU is free again"


@pytest.mark.workflow
def test_a_use_shorter_than_the_hosts_poll_restarts_its_idle_clock(tmp_path: Path, tiny_model: Path) -> None:
    """A job that attaches, asks and leaves between two of the host's polls used the engine: the idle
    timeout counts from there (the CI's vLLM test saw its warm server stop under the build it warmed)."""
    spec = _spec(tmp_path, tiny_model, idle_timeout=2)
    attached = engine_host.attach(spec)
    state = attached.engines[0]
    attached.release()
    for _ in range(12):  # 3.6 s of brief uses, each far shorter than the host's 0.2-s poll
        time.sleep(0.3)
        engine_host.attach(spec, pool=False).release()
    assert _alive(state["pid"]) and engine_host.read_state(spec.lock_dir, spec.slot) == state, "used: not idle"
    wait_until(lambda: not _alive(state["pid"]), 30, "the idle engine stopped")
    assert [h["reason"] for h in engine_history(tmp_path / "logs")] == ["idle for 2s"]


@pytest.mark.workflow
def test_the_server_dies_with_its_host_even_on_sigkill(tmp_path: Path, tiny_model: Path) -> None:
    spec = _spec(tmp_path, tiny_model)
    attached = engine_host.attach(spec)
    state = attached.engines[0]
    os.kill(state["pid"], signal.SIGKILL)
    wait_until(lambda: not _alive(state["server_pid"]), 10, "the server followed its host (PDEATHSIG)")
    assert engine_host.read_state(spec.lock_dir, spec.slot) is None, "a dead host's state does not count"
    attached.release()


@pytest.mark.workflow
def test_a_host_lost_once_it_served_is_started_again_by_the_job_that_waited_for_it(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The soak's find (bench/soak.py, seed 7: kill -9 of an engine host): a host killed just after it
    wrote its state, before the job that started it saw it ready, failed that job ("did not start"). It
    had started; the job starts it again, as a job replaces any engine it loses."""
    import importlib

    attach_mod = importlib.import_module("dflash_build.engines.host.attach")  # the package's `attach` is its function

    spec = _spec(tmp_path, tiny_model)
    first: list[dict[str, Any]] = []
    real_read_state = attach_mod.read_state

    def read_state(lock_dir: Any, slot: str) -> dict[str, Any] | None:
        state = real_read_state(lock_dir, slot)
        if state is not None and not first:  # the first host, as it serves: gone before the job looks
            first.append(state)
            os.kill(state["pid"], signal.SIGKILL)
            wait_until(lambda: not _alive(state["pid"]), 10, "the first host is gone")
            return None
        return state

    monkeypatch.setattr(attach_mod, "read_state", read_state)
    attached = attach_mod.attach(spec, pool=False)
    try:
        [state] = attached.engines
        assert first and state["pid"] != first[0]["pid"] and attached.started
        assert _alive(state["pid"]) and not _alive(first[0]["server_pid"])
    finally:
        attached.release()
        engine_host.stop_idle(spec.lock_dir)


@pytest.mark.workflow
def test_a_host_whose_starting_job_was_killed_is_joined_not_started_twice(tmp_path: Path, tiny_model: Path) -> None:
    """The soak's find (bench/soak.py, seed 0, kill -9 of a generate job waiting for the engine it
    started): the next job saw no ready engine and started a second host, which waited behind the first
    for the GPU while its use lock kept the first from idling out: both jobs stalled until start_timeout.
    The next job waits for the starting host and joins it."""
    import importlib

    attach_mod = importlib.import_module("dflash_build.engines.host.attach")
    spec = _spec(tmp_path, tiny_model)
    spec_file = Path(spec.lock_dir) / f"engine-{spec.slot}.spec.json"
    Path(spec.lock_dir).mkdir(parents=True, exist_ok=True)
    Path(spec.log_dir).mkdir(parents=True, exist_ok=True)
    atomic.write_json(spec_file, dataclasses.asdict(spec))
    orphan = attach_mod._spawn(spec_file, Path(spec.log_dir) / f"{spec.slot}.log")  # its job is gone
    host_lock = Path(spec.lock_dir) / f"engine-{spec.slot}.host.lock"
    wait_until(lambda: host_lock.exists() and not lock_free(host_lock), 30, "the orphan host holds its slot")
    start = time.monotonic()
    attached = engine_host.attach(spec, pool=False)
    try:
        [state] = attached.engines
        assert state["pid"] == orphan and not attached.started, "the starting host was joined"
        assert time.monotonic() - start < 60
    finally:
        attached.release()
        engine_host.stop_idle(spec.lock_dir)


@pytest.mark.workflow
def test_in_an_allocation_the_batch_steps_broker_keeps_the_engine_until_the_allocation_ends(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What SLURM does, without SLURM: each job runs in its own job step, so the engine is started by the
    allocation's batch step (its broker), serves the allocation's later jobs, and ends with the batch step.
    tests/test_slurm.py runs the same on a real cluster."""
    batch_task = subprocess.Popen(["sleep", "600"])  # the allocation's batch step
    for var in ("SLURM_STEP_ID", engine_host.BROKER_ENV, engine_host.OWNER_ENV):
        monkeypatch.setenv(var, "")  # recorded, so the broker's own settings are undone after the test too
        monkeypatch.delenv(var)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_TASK_PID", str(batch_task.pid))
    cfg = _host_config(tmp_path, tiny_model)
    generate = ["--target-jobs", "generate:source=poems,key=0123456789abcdef,shard=00000"]
    assert engine_host.start_allocation_broker(cfg, ["--target-jobs", "tokenize:source=poems"]) is None
    spool = engine_host.start_allocation_broker(cfg, generate)
    assert spool is not None and os.environ[engine_host.BROKER_ENV] == str(spool)

    monkeypatch.setenv("SLURM_STEP_ID", "0")  # from here on: the job steps, which inherit the broker
    monkeypatch.setenv("SLURM_TASK_PID", str(os.getpid()))
    assert engine_host.start_allocation_broker(cfg, generate) is None, "one broker per allocation"
    lease = GpuLease("0", cfg.engine.base_port, "scheduler", time.time(), "0", "77")
    spec = engine_host.launch_spec(cfg, [2], lease, {"weights": str(tiny_model)}, 2048)
    assert spec.slot == "job-77.gpu-0" and spec.owner_pid == batch_task.pid
    assert spec.identity["allocation"] == "77", "another allocation's jobs never use this engine"
    first = engine_host.attach(spec)
    state = first.engines[0]
    host_parent = int(Path(f"/proc/{state['pid']}/stat").read_text().split(")")[-1].split()[1])
    assert "broker" in Path(f"/proc/{host_parent}/cmdline").read_text(), "the broker started the host"
    first.release()
    second = engine_host.attach(spec)  # the allocation's next job
    assert not second.started and second.engines[0]["pid"] == state["pid"]
    second.release()

    batch_task.kill()  # the allocation ends
    batch_task.wait()
    wait_until(lambda: not _alive(state["pid"]) and not _alive(state["server_pid"]), 30, "the engine ended with it")
    assert [h["reason"] for h in engine_history(tmp_path / "logs")] == ["allocation ended"]
    assert lock_free(Path(spec.gpu_lock))


@pytest.mark.workflow
def test_a_shared_engine_answers_like_the_in_process_backend(tmp_path: Path, tiny_model: Path) -> None:
    """The same requests through the server (as two jobs at once) and through the backend in-process."""
    from dflash_build.engines.openai_backend import OpenAIEngine
    from dflash_build.engines.transformers_backend import TransformersEngine
    from dflash_build.spec import ModelSpec
    from dflash_build.stages.common import chat

    spec = _spec(tmp_path, tiny_model)
    stop = spec.identity["stop_ids"]
    params = SamplingParams(0.8, 0.95, 50, 0.0, 12)
    requests = [Request(f"p{i}", 0, list(range(10, 14 + i % 5)), params, 1000 + i) for i in range(16)]
    own = TransformersEngine(str(tiny_model), {"device": "cpu", "batch_size": 3}, stop)
    expected = {r.prompt_id: r for r in own.generate(requests)}
    tokenizer = chat.load_tokenizer(ModelSpec(str(tiny_model), None, None, None, {}))
    attached = [engine_host.attach(spec), engine_host.attach(spec)]
    clients = [
        OpenAIEngine({"urls": a.urls, "api": "generate", "concurrency": 5}, stop, tokenizer, str(tiny_model))
        for a in attached
    ]
    answers: dict[str, Any] = {}

    def feed(client: OpenAIEngine, part: list[Request]) -> None:
        answers.update({r.prompt_id: r for r in client.generate(part)})

    threads = [threading.Thread(target=feed, args=(c, requests[i::2])) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c, a in zip(clients, attached, strict=True):
        c.close()
        a.release()
    engine_host.stop_idle(spec.lock_dir)
    assert {k: (r.output_ids, r.finish_reason, r.stop_token_id) for k, r in answers.items()} == {
        k: (r.output_ids, r.finish_reason, r.stop_token_id) for k, r in expected.items()
    }


# -- llama.cpp's server, per job and shared ----------------------------------------------------------
@pytest.mark.workflow
@pytest.mark.parametrize("shared", [False, True])
def test_llamacpp_engines_start_per_job_or_once(tmp_path: Path, gguf_path: Path, shared: bool) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python[server] is installed by make setup")
    config = base_config(gguf_path, _source(tmp_path / "data", 6), shard_size=2)
    config["engine"] = {
        "backend": "llamacpp",
        "options": {"threads": 2},
        "lock_dir": str(tmp_path / "locks"),
        "shared": shared,
        "base_port": own_ports(),
    }
    config["sampling"]["max_new_tokens"] = 4
    wf = Workflow(tmp_path / "work")
    wf.workdir.mkdir()
    wf.write_config(config)
    wf.run("--until", "generate", cores=1)
    history = engine_history(wf.workdir / "logs")
    assert len(history) == (1 if shared else 3), history
    assert not engine_host.running(tmp_path / "locks")
    rows = completion_rows(wf.workdir / "store")
    assert len(rows) == 6 and all(r[3] in ("stop", "length") for r in rows.values())


# -- units -------------------------------------------------------------------------------------------
_LEADER_EXITS_FIRST = """
import ctypes, fcntl, os, sys, threading, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
threading.Thread(target=time.sleep, args=(float(sys.argv[2]),)).start()
print("locked", flush=True)
ctypes.CDLL(None).syscall(60, 0)  # SYS_exit on x86-64: only this (the leader) thread exits
"""


def test_a_process_is_alive_until_its_last_thread_exits(tmp_path: Path) -> None:
    """A leader thread shows Z while the process's other threads run and hold its locks (the host
    imports numpy, whose thread pool outlives the leader by a moment when it exits)."""
    if os.uname().machine != "x86_64":
        pytest.skip("the test calls SYS_exit by its x86-64 number")
    lock = tmp_path / "held.lock"
    proc = subprocess.Popen([sys.executable, "-c", _LEADER_EXITS_FIRST, str(lock), "2"], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"locked\n"
    wait_until(lambda: Path(f"/proc/{proc.pid}/stat").read_text().split(")")[-1].split()[0] == "Z", 5, "leader exits")
    assert not lock_free(lock) and _alive(proc.pid), "a thread still runs and holds the lock"
    proc.wait(10)  # reaped: gone for good
    assert lock_free(lock) and not _alive(proc.pid)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_until(lambda: Path(f"/proc/{zombie.pid}/stat").read_text().split(")")[-1].split()[0] == "Z", 5, "child exits")
    assert not _alive(zombie.pid), "an exited child that is not reaped yet is gone"
    zombie.wait()


def test_generate_resources_turn_gpus_into_job_places() -> None:
    def engine(**kw: Any) -> EngineSpec:
        base = dict(
            backend="sglang",
            options={},
            gpus=None,
            lock_dir=Path("/l"),
            gpu_wait_seconds=1,
            base_port=1,
            journal_flush_rows=1,
            journal_flush_seconds=1,
        )
        return EngineSpec(**{**base, **kw})

    assert workflow.generate_resources(engine(), 8) == (1, 0, None)
    assert workflow.generate_resources(engine(shared=True), 8) == (0, 1, 16)
    assert workflow.generate_resources(engine(shared=True, jobs_per_engine=3), 8) == (0, 1, 24)
    assert workflow.generate_resources(engine(shared=True), None) == (0, 1, None)
    assert workflow.generate_resources(engine(backend="llamacpp"), 8) == (0, 0, None)
    two = [Gpu("0", "0", 0), Gpu("1", "1", 1)]
    places = job_locks(engine(shared=True), two)
    assert [(g.visible, p.name) for g, p in places] == [
        ("0", "gpu-0.job-0.lock"),
        ("1", "gpu-1.job-0.lock"),
        ("0", "gpu-0.job-1.lock"),
        ("1", "gpu-1.job-1.lock"),
    ]
    assert [p.name for _, p in job_locks(engine(), two)] == ["gpu-0.lock", "gpu-1.lock"]


def test_the_openai_backend_cannot_be_shared(tmp_path: Path, tiny_model: Path) -> None:
    config = base_config(tiny_model, _source(tmp_path, 1))
    config["engine"] = {"backend": "openai", "options": {"urls": ["http://x"]}, "shared": True}
    with pytest.raises(ConfigError, match=r"engine\.shared"):
        plan_mod.build(_config(tmp_path, config))  # where the engine is chosen, before any job


# A server that starts a worker of its own, as vLLM's API server starts its engine core (which holds the
# GPU's memory): the engine is not what is under test here, what its host leaves running is.
SERVER_WITH_A_WORKER = """
import http.server, subprocess, sys
port, pids = int(sys.argv[1]), sys.argv[2]
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(pids, "a") as f:
    f.write(f"{worker.pid}\\n")
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_a_killed_servers_workers_are_stopped_by_its_host_and_a_killed_hosts_by_the_next(tmp_path: Path) -> None:
    """kill -9 of the server: its host stops the worker it left. kill -9 of the host: the server follows it
    (PDEATHSIG), its worker does not; the next host of the slot stops it before its own server starts, and
    the end of a workflow (stop_idle) stops it where no host comes."""
    script, pids = tmp_path / "server.py", tmp_path / "workers"
    script.write_text(SERVER_WITH_A_WORKER)
    # this worker's own ports, below the ephemeral range (32768-60999 here): a port there can be taken by a
    # client socket of the other worker's tests between the second server's death and the third's start
    port = own_ports()

    def spec(slot: str) -> engine_host.LaunchSpec:
        return engine_host.LaunchSpec(
            slot=slot, backend="vllm", argv=[sys.executable, str(script), str(port), str(pids)], env={},
            url=f"http://127.0.0.1:{port}", identity={"slot": slot}, lock_dir=str(tmp_path / "locks"),
            log_dir=str(tmp_path / "logs"), gpu_lock=None, idle_timeout=600, start_timeout=60,
        )  # fmt: skip

    def worker() -> int:
        return int(pids.read_text().split()[-1])

    first = engine_host.attach(spec("gpu-0"))
    os.kill(first.engines[0]["server_pid"], signal.SIGKILL)
    wait_until(lambda: not _alive(worker()), 15, "the host stopped the worker its killed server left")
    first.release()

    second = engine_host.attach(spec("gpu-0"))
    orphan = worker()
    os.kill(second.engines[0]["pid"], signal.SIGKILL)
    wait_until(lambda: not _alive(second.engines[0]["server_pid"]), 10, "the server followed its host")
    assert _alive(orphan), "nothing stops it yet: no host of the slot runs"
    second.release()
    third = engine_host.attach(spec("gpu-0"))
    assert not _alive(orphan) and _alive(worker()), "the next host stopped the orphan, then started its own"
    host = third.engines[0]["pid"]
    os.kill(host, signal.SIGKILL)
    orphan = worker()
    third.release()
    wait_until(lambda: not _alive(host), 10, "the host died")
    engine_host.stop_idle(tmp_path / "locks")
    assert not _alive(orphan), "the end of a workflow stops what a killed host's server left"
