"""A served engine that dies of its own error is named by that error, read from its log: the lines vLLM
0.32.0's CPU build wrote when top_k 20 under speculation killed its engine core (tests/data, captured from
tests/test_accept.py's run; paths shortened). A server killed by a signal has no error of its own."""

from __future__ import annotations

from pathlib import Path

from dflash_build.engines.host.logs import engine_error, exit_code
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
