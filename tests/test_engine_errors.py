"""A served engine that dies of its own error is named by that error, read from its log: the lines vLLM
0.32.0's CPU build wrote when top_k 20 under speculation killed its engine core (tests/data, captured from
tests/test_accept.py's run; paths shortened). A server killed by a signal has no error of its own."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash_build.engines.host import served
from dflash_build.engines.host.attach import Attached
from dflash_build.engines.host.launch import LaunchSpec
from dflash_build.engines.host.logs import engine_error, exit_code
from dflash_build.engines.host.served import ServedEngine
from dflash_build.engines.host.slots import state_path
from tests.conftest import REPO

CRASH = REPO / "tests" / "data" / "vllm_cpu_topk_crash.log"


def test_the_root_error_and_its_frame_are_read_and_the_wrappers_skipped() -> None:
    error = engine_error(CRASH)
    assert error is not None
    assert error.startswith("RuntimeError: index 49152 is out of bounds for dimension 1 with size 49152 (")
    assert "Worker failed" not in error and "EngineDeadError" not in error, "wrappers point back at it"
    assert error.endswith(" in apply_top_k_top_p_pytorch)"), error
    assert exit_code(CRASH) == 0, "the server exited on its own after its engine died"


def test_only_what_a_job_saw_counts_and_a_killed_server_has_no_error(tmp_path: Path) -> None:
    text = CRASH.read_text()
    assert engine_error(CRASH, since=len(CRASH.read_bytes())) is None, "an error before the job attached"
    killed = tmp_path / "cpu.log"
    ready = next(line for line in text.splitlines() if "serves http://" in line)
    killed.write_text(f"{ready}\n2026-12-06 03:16:52,858 ERROR engine-host: the server exited with -9\n")
    assert engine_error(killed) is None and exit_code(killed) == -9
    assert exit_code(tmp_path / "missing.log") is None and engine_error(tmp_path / "missing.log") is None


def test_an_argument_the_engine_refuses_at_start_is_named_with_its_detail() -> None:
    """pydantic's error says what was wrong on its next line (vLLM 0.32.0's CPU build refusing a max_model_len
    past the model's, captured from tests/test_preflight.py's run): the line a job quotes carries it."""
    error = engine_error(REPO / "tests" / "data" / "vllm_cpu_refused_max_model_len.log")
    assert error is not None and error.startswith("ValidationError: 1 validation error for ModelConfig: Value error, ")
    assert "User-specified max_model_len (1000000) is greater than the derived max_model_len" in error


@pytest.fixture
def host() -> Iterator[int]:
    """A live process standing in for the engine's host: its pid is what the state file names."""
    process = subprocess.Popen(["sleep", "60"])
    yield process.pid
    process.kill()
    process.wait()


def _served(tmp_path: Path, host: int) -> tuple[ServedEngine, Path, str]:
    """A job's view of one engine its host serves, the server's log as it was when the job attached (only
    what follows counts), and its state file."""
    url, log_path = "http://127.0.0.1:30000", tmp_path / "cpu.log"
    log_path.write_text(CRASH.read_text().splitlines()[0] + "\n")  # the host's "serves" line
    state = {"slot": "cpu", "url": url, "pid": host, "spawned_at": 1.0, "ready_at": 2.0, "log": str(log_path)}
    state_path(tmp_path, "cpu").write_text(json.dumps(state))
    spec = LaunchSpec("cpu", "vllm", [], {}, url, {}, str(tmp_path), str(tmp_path), None, 60.0, 60.0)
    use_fd = os.open(tmp_path / "use.lock", os.O_CREAT | os.O_RDWR)
    return ServedEngine(spec, Attached({url: (state, use_fd)}, started=False), False, pool=False), log_path, url


@pytest.mark.parametrize("refresh_first", [False, True])
def test_a_server_that_died_of_its_error_is_named_whichever_saw_it_go_first(
    tmp_path: Path, host: int, refresh_first: bool
) -> None:
    """The request's failure or the pool's refresh (its host removed the state file on the exit) may see the
    server go first; either way the job fails with the engine's own error, and starts no replacement."""
    engine, log_path, url = _served(tmp_path, host)
    with open(log_path, "a") as log:
        log.write("\n".join(CRASH.read_text().splitlines()[1:]) + "\n")
    state_path(tmp_path, "cpu").unlink()
    if refresh_first:
        assert engine.refresh().gone == [url]
    assert engine.lost(url, "its engine is no longer running", stalled=False).joined == []
    assert engine.died is not None and "RuntimeError: index 49152 is out of bounds" in str(engine.died)
    assert f"log: {log_path}" in str(engine.died) and not engine.replaced
    assert [lost["url"] for lost in engine.identity["lost"]] == [url]


def test_a_server_slow_to_exit_after_its_error_is_waited_for(
    tmp_path: Path, host: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a loaded machine vLLM may take longer than the usual wait to exit after it logged its error: the
    job waits on (not stopping and replacing it as if it had stalled)."""
    monkeypatch.setattr(served, "EXIT_WAIT_SECONDS", 0.2)
    engine, log_path, url = _served(tmp_path, host)
    crash = CRASH.read_text().splitlines()[1:]
    exited = next(i for i, line in enumerate(crash) if "the server exited with" in line)
    with open(log_path, "a") as log:
        log.write("\n".join(crash[:exited]) + "\n")

    def exit_later() -> None:
        time.sleep(1.0)
        with open(log_path, "a") as log:
            log.write("\n".join(crash[exited:]) + "\n")
        state_path(tmp_path, "cpu").unlink()

    threading.Thread(target=exit_later).start()
    engine.lost(url, "HTTP 500", stalled=False)
    assert engine.died is not None and "RuntimeError: index 49152" in str(engine.died) and not engine.replaced
