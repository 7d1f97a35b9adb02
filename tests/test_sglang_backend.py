"""The code around sglang.Engine: options, request building, result parsing, retries, signals, shutdown.

SGLang's engine cannot run here. The result shapes below are SGLang's own (FINISH_* ``to_json`` and
``output_ids_through_stop`` in managers/schedule_batch.py; tests/test_sglang_contract.py checks them
against the installed package). The engine tests use a stand-in for ``sglang.Engine`` with SGLang's
surface (event loop, tokenizer manager that installs loop signal handlers, child processes): a unit
test of the backend's own logic, not a proof that SGLang runs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from dflash_build import loops
from dflash_build.engines import EngineFailed, Request, SamplingParams, check_options
from dflash_build.engines import sglang_backend as sb
from dflash_build.engines.gpus import GpuLease
from dflash_build.spec import ConfigError, LoopRule, ModelSpec
from tests.conftest import Workflow, base_config, write_jsonl

MODEL = ModelSpec("/models/qwen", None, None, None, {}, 4096)
REQUEST = Request("p", 1, [1, 2, 3], SamplingParams(0.6, 0.95, 0, 0.0, 8192), seed=99)
STOPS = [2, 9]


def test_server_args_pin_ports_and_pass_any_real_field_through() -> None:
    lease = GpuLease("3", 31030, "lock", 0.0)
    options = {"mem_fraction_static": 0.85, "mamba_ssm_dtype": "float32", "page_size": 64, "max_inflight": 8}
    args = sb.server_args(MODEL, options, lease)
    assert args["skip_tokenizer_init"] is True and args["tp_size"] == 1 and args["base_gpu_id"] == 0
    assert (args["port"], args["nccl_port"]) == (31030, 31031)
    assert args["context_length"] == 4096 and args["model_path"] == "/models/qwen"
    assert (args["mem_fraction_static"], args["mamba_ssm_dtype"], args["page_size"]) == (0.85, "float32", 64)
    assert "max_inflight" not in args and args["log_level"] == "warning"
    assert sb.server_args(MODEL, {"log_level": "info"}, None)["log_level"] == "info"


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("cuda_graph_max_bs", "did you mean 'cuda_graph_max_bs_decode'"),
        ("mem_fraction", "did you mean 'mem_fraction_static'"),
        ("context_length", "model.context_length"),
        ("port", "engine.base_port"),
        ("skip_tokenizer_init", "renders and tokenizes"),
        ("zzz_not_an_option", "SGLang 0.5.23 has no such ServerArgs field"),
    ],
)
def test_an_unknown_or_driver_owned_option_is_refused_by_name(option: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"engine.options.{option}") as refused:
        check_options("sglang", {option: 1})
    assert message in str(refused.value)


def test_other_backends_name_the_closest_option_too() -> None:
    with pytest.raises(ConfigError, match="did you mean 'batch_size'"):
        check_options("transformers", {"batchsize": 4})
    with pytest.raises(ConfigError, match="did you mean 'concurrency'"):
        check_options("openai", {"concurency": 4, "urls": ["http://x"]})


@pytest.mark.workflow  # runs snakemake
def test_a_misspelled_option_stops_the_workflow_before_any_job(tmp_path: Path, tiny_model: Path) -> None:
    data = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "hi"}])
    config = base_config(tiny_model, {"a": {"category": "x", "format": "alpaca", "files": [str(data)]}})
    config["engine"] = {"backend": "sglang", "options": {"cuda_graph_max_bs": 256}}
    config["store"] = str(tmp_path / "store")
    wf = Workflow(tmp_path)
    wf.write_config(config)
    done = wf.run(check=False)
    assert done.returncode != 0
    assert "engine.options.cuda_graph_max_bs" in done.stderr and "cuda_graph_max_bs_decode" in done.stderr
    assert not list(tmp_path.glob("store/**/*.parquet")), "no job ran"


def test_sampling_params_carry_every_knob_and_the_row_seed() -> None:
    params = sb.sampling_params(REQUEST, STOPS)
    assert params["max_new_tokens"] == 8192 and params["sampling_seed"] == 99
    assert params["top_k"] == -1, "0 (disabled here) is -1 for SGLang"
    assert params["stop_token_ids"] == STOPS and params["skip_special_tokens"] is False
    assert (params["repetition_penalty"], params["frequency_penalty"], params["presence_penalty"]) == (1.0, 0.0, 0.0)
    assert "no_stop_trim" not in params, "it changes only detokenized text, which skip_tokenizer_init never makes"


def stop(matched: Any) -> dict[str, Any]:
    return {"type": "stop", "matched": matched}  # FINISH_MATCHED_TOKEN / FINISH_MATCHED_STR


def length(n: int) -> dict[str, Any]:
    return {"type": "length", "length": n}  # FINISH_LENGTH


def abort(message: str, status: int | None = None) -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": status, "err_type": None}  # FINISH_ABORT


@pytest.mark.parametrize(
    ("output_ids", "finish", "expected"),
    [
        # finding 4: output_ids_through_stop ends with the matched stop token
        ([5, 6, 9], stop(9), ([5, 6], "stop", 9)),
        # an eos from the model's own config (not in our list) that SGLang matched
        ([5, 6, 151643], stop(151643), ([5, 6], "stop", 151643)),
        # finding 5: before 0.5.6 a stop sampled as the last allowed token came back as `length`
        ([5, 6, 2], length(3), ([5, 6], "stop", 2)),
        ([5, 6, 7], length(3), ([5, 6, 7], "length", None)),
        # finding 6: a stop that matched a string is SGLang's NaN fault (the bad id replaced by a stop id)
        ([5, 2], stop("NaN happened"), ([5, 2], "abort", None)),
        # an abort returned (no status code): ours, or the scheduler's
        ([5], abort("Aborted"), ([5], "abort", None)),
        ([], {"type": "stop", "matched": None}, ([], "abort", None)),
    ],
)
def test_parse_output_reads_sglangs_shapes(output_ids: list[int], finish: dict[str, Any], expected: tuple) -> None:
    r = sb.parse_output(REQUEST, {"output_ids": output_ids, "meta_info": {"finish_reason": finish}}, STOPS)
    assert (r.output_ids, r.finish_reason, r.stop_token_id) == expected
    assert (r.prompt_id, r.sample_idx) == ("p", 1)
    assert (r.error is None) == (r.finish_reason != "abort")


def test_refusal_status_reads_what_sglang_raises() -> None:
    """Finding 8: ValueError for a 400, fastapi.HTTPException (status_code) for the rest."""
    http = type("HTTPException", (Exception,), {})("busy")
    http.status_code = 503  # type: ignore[attr-defined]
    assert sb.refusal_status(ValueError("The input (9 tokens) is longer than the model's context")) == 400
    assert sb.refusal_status(http) == 503
    assert sb.refusal_status(RuntimeError("bug")) is None


# -- the engine loop, around a stand-in for sglang.Engine ---------------------------------------------
class HTTPException(Exception):
    def __init__(self, status_code: int, detail: str) -> None:
        super().__init__(detail)
        self.status_code, self.detail = status_code, detail


class StandInManager:
    """SGLang's TokenizerManager surface: lazy loop handlers for SIGTERM/SIGQUIT, abort by rid."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.event_loop, self.aborted = loop, None, []

    def auto_create_handle_loop(self) -> None:
        if self.event_loop is not None:
            return
        self.event_loop = self.loop
        self.loop.add_signal_handler(signal.SIGTERM, lambda: None)  # SGLang: drain, then kill the tree
        self.loop.add_signal_handler(signal.SIGQUIT, lambda: None)  # SGLang: kill the tree

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborted.append(rid)


class Streamed:
    """A scripted streamed answer as ``async_generate(..., stream=True)`` yields it in the job: a chunk per
    ``stream_interval`` tokens (the first at once), each holding SGLang's own growing list of the answer so
    far; it records how far it generated and whether it was closed before its end (where SGLang's
    ``generate_request`` aborts the request, tokenizer_manager.py:958-967)."""

    def __init__(self, ids: list[int], finish: dict[str, Any]) -> None:
        self.ids, self.finish, self.generated, self.closed = ids, finish, 0, False

    async def chunks(self, interval: int) -> Any:
        out: list[int] = []
        try:
            for i, token in enumerate(self.ids, 1):
                out.append(token)
                self.generated = i
                if i == 1 or i % interval == 0 or i == len(self.ids):
                    finish = self.finish if i == len(self.ids) else None
                    yield {"output_ids": out, "meta_info": {"finish_reason": finish, "completion_tokens": i}}
                await asyncio.sleep(0)
        except BaseException:
            self.closed = True
            raise


class StandInEngine:
    script: dict[str, list[Any]]  # prompt_id -> what each attempt does: an output dict, an exception, "hang", Streamed

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.tokenizer_manager = StandInManager(self.loop)
        self.children = [subprocess.Popen(["sleep", "300"]) for _ in range(2)]  # scheduler, detokenizer
        self.calls: dict[str, int] = {}
        self.rids: dict[str, str] = {}  # prompt_id -> its last streamed request's rid

    async def async_generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str, stream: bool = False
    ) -> Any:
        pid = rid.split("/")[0]
        attempt = self.calls[pid] = self.calls.get(pid, -1) + 1
        step = self.script[pid][min(attempt, len(self.script[pid]) - 1)]
        if isinstance(step, Streamed):
            assert stream, "a streamed answer only to a request that asks for one"
            self.rids[pid] = rid
            return step.chunks(sampling_params["stream_interval"])
        assert not stream
        if step == "hang":
            await asyncio.sleep(3600)
        if isinstance(step, Exception):
            raise step
        return step


def done(ids: list[int]) -> dict[str, Any]:
    return {"output_ids": ids, "meta_info": {"finish_reason": stop(ids[-1])}}


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[StandInEngine]]:
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=StandInEngine))
    monkeypatch.setattr(sb, "_RETRY_DELAY_SECONDS", 0.01)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)}
    yield StandInEngine
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def request(pid: str) -> Request:
    return Request(pid, 0, [1, 2], SamplingParams(0.6, 0.95, 0, 0.0, 16), seed=1)


def test_turned_away_requests_are_retried_refusals_become_abort_rows_and_bugs_error_rows(
    standin: type[StandInEngine],
) -> None:
    standin.script = {
        "busy": [HTTPException(503, "Retracted under decode memory pressure. Retry later."), done([4, 9])],
        "long": [ValueError("Requested token count exceeds the model's maximum context length")],
        "oom": [HTTPException(500, "Out of memory even after retracting all other requests")],
        "always-busy": [HTTPException(503, "Retry later.")],
        "bug": [RuntimeError("scheduler bug")],
    }
    engine = sb.SGLangEngine(MODEL, {"retries": 2}, STOPS, None)
    try:
        results = {r.prompt_id: r for r in engine.generate([request(p) for p in standin.script])}
    finally:
        engine.close()
    assert (results["busy"].finish_reason, results["busy"].output_ids) == ("stop", [4])
    assert engine.engine.calls["busy"] == 1 and engine.engine.calls["always-busy"] == 2
    assert results["long"].finish_reason == "abort" and "(400)" in (results["long"].error or "")
    assert results["oom"].finish_reason == "abort" and engine.engine.calls["oom"] == 0, "a 500 is not retried"
    assert results["always-busy"].finish_reason == "abort" and "(503)" in (results["always-busy"].error or "")
    assert results["bug"].finish_reason == "error" and "scheduler bug" in (results["bug"].error or "")


def test_the_driver_keeps_its_signal_handlers_and_close_stops_only_sglangs_processes(
    standin: type[StandInEngine],
) -> None:
    """Finding 9: SGLang's loop handlers are removed; close() spares the driver's other children."""
    unrelated = subprocess.Popen(["sleep", "300"])

    def drivers(signum: int, frame: Any) -> None:
        pass

    signal.signal(signal.SIGTERM, drivers)
    try:
        engine = sb.SGLangEngine(MODEL, {}, STOPS, None)
        assert signal.getsignal(signal.SIGTERM) is drivers
        assert signal.getsignal(signal.SIGQUIT) == engine._child_failed
        own = [p.pid for p in engine.engine.children]
        assert sorted(p.pid for p in engine._own) == sorted(own)
        engine.close()
        time.sleep(0.2)
        assert all(not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE for pid in own)
        assert unrelated.poll() is None, "close() killed a process SGLang did not start"
    finally:
        unrelated.kill()
        unrelated.wait()


def test_interrupt_aborts_in_flight_requests_and_yields_only_finished_ones(standin: type[StandInEngine]) -> None:
    standin.script = {"quick": [done([3, 9])], "slow-1": ["hang"], "slow-2": ["hang"], "queued": [done([5, 9])]}
    engine = sb.SGLangEngine(MODEL, {"max_inflight": 3}, STOPS, None)
    try:
        got = []
        for result in engine.generate([request(p) for p in standin.script]):
            got.append(result.prompt_id)
            engine.interrupt()
        assert got == ["quick"], "queued requests are not sent after an interrupt, in-flight ones not yielded"
        assert {rid.split("/")[0] for rid in engine.engine.tokenizer_manager.aborted} == {"slow-1", "slow-2"}
    finally:
        engine.close()


def test_a_failing_sglang_child_fails_the_job_instead_of_killing_the_driver(standin: type[StandInEngine]) -> None:
    standin.script = {"a": ["hang"], "b": ["hang"]}
    engine = sb.SGLangEngine(MODEL, {}, STOPS, None)
    engine.loop.call_later(0.2, os.kill, os.getpid(), signal.SIGQUIT)  # what SGLang's children do
    try:
        with pytest.raises(EngineFailed, match="SIGQUIT"):
            list(engine.generate([request("a"), request("b")]))
    finally:
        engine.close()


def test_a_looping_row_is_streamed_cut_where_the_rule_fires_and_aborted(standin: type[StandInEngine]) -> None:
    """Issue 79 in the job: with the loop rule the engine's answer is streamed, one chunk per loop check; a
    looping row is cut where the rule first fired (finish reason loop), its request aborted and its stream
    closed within a chunk; a row that stops, and one SGLang turns away in its stream (503), end as whole ones."""
    rule = LoopRule()
    looping = list(range(300, 320)) + [7, 8, 5] * 700
    end = loops.loop_end(looping, rule)
    assert end is not None
    script = {
        "loops": Streamed(looping, length(len(looping))),
        "stops": Streamed([5, 6, 9], stop(9)),
        "busy": Streamed([5], abort("Retry later.", 503)),
    }
    standin.script = {
        "loops": [script["loops"]],
        "stops": [script["stops"]],
        "busy": [script["busy"], Streamed([4, 9], stop(9))],
    }
    params = SamplingParams(0.6, 0.95, 0, 0.0, 4096)
    requests = [Request(pid, 0, [1, 2], params, seed=1, stop_loops=rule) for pid in standin.script]
    engine = sb.SGLangEngine(MODEL, {"retries": 2}, STOPS, None)
    try:
        results = {r.prompt_id: r for r in engine.generate(requests)}
    finally:
        engine.close()
    assert (results["loops"].finish_reason, results["loops"].output_ids) == ("loop", looping[:end])
    assert engine.engine.tokenizer_manager.aborted == [engine.engine.rids["loops"]]
    assert script["loops"].closed and script["loops"].generated < end + loops.CHECK_EVERY
    assert (results["stops"].finish_reason, results["stops"].output_ids, results["stops"].stop_token_id) == (
        "stop",
        [5, 6],
        9,
    )
    assert not script["stops"].closed
    assert (results["busy"].finish_reason, results["busy"].output_ids) == ("stop", [4])
    assert engine.engine.calls["busy"] == 1, "asked again, as a 503 raised from a whole request is"
