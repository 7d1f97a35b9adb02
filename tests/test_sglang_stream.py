"""Issue 79 on SGLang: a looping row's ``/generate`` answer is streamed and closed where the loop rule fires.

End to end against the stand-in (tests/standin_server.py), which streams SGLang 0.5.23's format (the
answer so far, or with ``incremental`` its new tokens, every ``stream_interval`` tokens) and stops
generating when the client closes the stream, as SGLang's server aborts such a request: the job's client
(``OpenAIEngine`` with ``api: generate``, what a shared SGLang engine's jobs use) cuts a looping row where
the rule first fires, finish reason ``loop``, and the stand-in sees the stream closed a few tokens past
that; a row that does not loop comes back as it does whole. The reader itself (``GenerateStream``) on
SGLang's chunk shapes, statuses included, and the in-job engine's stream are below and in
tests/test_sglang_backend.py; SGLang's own route and chunk fields in tests/test_sglang_contract.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from dflash_build import loops
from dflash_build.engines import Request, Result, SamplingParams
from dflash_build.engines.openai_backend import OpenAIEngine
from dflash_build.engines.sglang_wire import GenerateStream, MalformedChunk, Refused
from dflash_build.spec import LoopRule
from tests.standin_server import LOOP_ID, SPEC, STOP_ID, StandIn, generate_answer

MODEL = "/models/tiny-model"
RULE = LoopRule()  # the defaults: period <= 64, 3 periods, 96 tokens
BUDGET = 2048
TOKEN_SECONDS = 0.003  # a looping row left to its budget would take 6 s
# tokens the stand-in may generate past the cut: the chunk the rule fired in (one loop check, 16 tokens),
# then the client's reaction on a machine shared with other jobs
SLACK = 6 * loops.CHECK_EVERY


def _requests(rule: LoopRule | None) -> list[Request]:
    params = SamplingParams(0.6, 0.95, 20, 0.0, BUDGET)
    prompts = [[1, 300 + i, 7] + ([LOOP_ID] if i % 2 else []) for i in range(8)]
    return [Request(f"p{i}", 0, p, params, seed=100 + i, stop_loops=rule) for i, p in enumerate(prompts)]


def _run(server: StandIn, requests: list[Request], **kw: Any) -> dict[str, Result]:
    opts = {"urls": [server.url], "api": "generate", "retries": 2, "backoff": 0.01, "concurrency": 4}
    engine = OpenAIEngine(opts, [STOP_ID], None, MODEL, **kw)
    try:
        return {r.prompt_id: r for r in engine.generate(requests)}
    finally:
        engine.close()


@pytest.fixture
def server() -> Iterator[StandIn]:
    standin = StandIn(model_id="tiny-model", token_seconds=TOKEN_SECONDS).start()
    yield standin
    standin.stop()


def _whole(request: Request) -> list[int]:
    """The stand-in's whole answer to the request, its stop token left off as a Result has it."""
    ids, finish = generate_answer({"input_ids": request.prompt_ids, "sampling_params": {"max_new_tokens": BUDGET,
                                   "sampling_seed": request.seed}})  # fmt: skip
    return ids[:-1] if finish["type"] == "stop" else ids


@pytest.mark.parametrize("incremental", [True, False], ids=["new-tokens", "answer-so-far"])
def test_a_looping_row_is_cut_where_the_rule_fires_and_its_stream_closed(server: StandIn, incremental: bool) -> None:
    server.incremental = incremental
    requests = _requests(RULE)
    got = _run(server, requests)
    by_prompt = {tuple(g["body"]["input_ids"]): g for g in server.settled()}
    for request in requests:
        whole, seen = _whole(request), by_prompt[tuple(request.prompt_ids)]
        body = seen["body"]
        assert body["stream"] is True and body["sampling_params"]["stream_interval"] == loops.CHECK_EVERY
        assert "stop_loops" not in body, "SGLang has no such field: the client stops the row"
        result = got[request.prompt_id]
        if LOOP_ID not in request.prompt_ids:  # a row that does not loop: as it comes whole
            assert (result.finish_reason, result.output_ids, result.stop_token_id) == ("stop", whole, STOP_ID)
            assert not seen["closed"] and seen["generated"] == len(whole) + 1
            continue
        end = loops.loop_end(whole, RULE)
        assert end is not None and end < 200
        assert (result.finish_reason, result.output_ids) == ("loop", whole[:end]), "cut where the rule first fired"
        assert seen["closed"], "the stand-in saw the stream closed"
        assert seen["generated"] <= end + SLACK, (seen["generated"], end)


def test_rows_answered_whole_without_the_rule_and_the_same_rows_streamed(server: StandIn) -> None:
    """Without the rule nothing is streamed: the looping rows run to the budget, the others are the
    streamed build's rows, token for token."""
    server.token_seconds = 0.0
    whole = _run(server, _requests(None))
    assert not any(g["body"].get("stream") for g in server.generations)
    streamed = _run(server, _requests(RULE))
    for pid, row in whole.items():
        if row.finish_reason == "length":
            assert streamed[pid].finish_reason == "loop" and row.output_ids[: len(streamed[pid].output_ids)] == (
                streamed[pid].output_ids
            )
            assert len(row.output_ids) == BUDGET
        else:
            assert (streamed[pid].output_ids, streamed[pid].finish_reason) == (row.output_ids, row.finish_reason)


def test_speculative_counts_are_read_from_the_last_chunk(server: StandIn) -> None:
    server.spec, server.token_seconds = True, 0.0
    got = _run(server, _requests(RULE))
    for row in got.values():
        if row.finish_reason == "stop":
            assert row.acceptance is not None
            assert (row.acceptance.steps, row.acceptance.drafted, row.acceptance.accepted) == tuple(SPEC.values())
        else:  # a row cut short never got its last chunk: no counts, as on vLLM
            assert row.finish_reason == "loop" and row.acceptance is None


def test_a_retry_later_abort_in_the_stream_is_retried_like_a_503(server: StandIn) -> None:
    """SGLang streams a request it turns away ("retry later", 503) as an abort chunk with that status,
    where a whole request gets the status: both are asked again."""
    server.fault, server.first, server.last, server.token_seconds = "abort_503", 1, 2, 0.0
    got = _run(server, _requests(RULE)[:1])
    assert server.faults_sent == 2 and len(server.generations) == 3
    assert got["p0"].finish_reason == "stop" and got["p0"].output_ids == _whole(_requests(None)[0])


def test_a_server_that_stops_rows_itself_gets_the_rule_in_the_request(server: StandIn) -> None:
    """Our transformers server (registry.Serve.loops_in_request) stops a row on the rule the request names:
    nothing is streamed to it."""
    server.token_seconds = 0.0
    _run(server, _requests(RULE)[:2], loops_in_request=True)
    for seen in server.generations:
        assert "stream" not in seen["body"] and seen["body"]["stop_loops"] == RULE.as_dict()


# -- the reader, on SGLang's chunk shapes ----------------------------------------------------------
def _chunk(ids: list[int], count: int, finish: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"output_ids": ids, "meta_info": {"id": "r", "finish_reason": finish, "completion_tokens": count}}


def test_the_reader_takes_either_chunk_form_and_cuts_where_the_rule_fires() -> None:
    loop = list(range(300, 310)) + [5, 6, 7] * 60
    end = loops.loop_end(loop, RULE)
    assert end is not None
    so_far, new = GenerateStream(RULE), GenerateStream(RULE)
    cut_so_far = cut_new = None
    for i in range(0, len(loop), 16):
        cut_so_far = cut_so_far or so_far.read(_chunk(loop[: i + 16], len(loop[: i + 16])))
        cut_new = cut_new or new.read(_chunk(loop[i : i + 16], len(loop[: i + 16])))
    expected = {"output_ids": loop[:end], "meta_info": {"finish_reason": {"type": "loop"}, "completion_tokens": end}}
    assert cut_so_far == cut_new == expected
    shared: list[int] = [1, 2]  # in the job, SGLang hands the same growing list to every chunk
    stream = GenerateStream(RULE)
    stream.read(_chunk(shared, 2))
    shared.append(3)
    assert stream.whole()["output_ids"] == [1, 2], "the reader keeps a copy"


@pytest.mark.parametrize(
    ("chunk", "status"),
    [
        (_chunk([4], 1, {"type": "abort", "message": "Retry later.", "status_code": 503, "err_type": None}), 503),
        ({"error": {"message": "too long", "type": "invalid_request_error", "code": 400, "retryable": False}}, 400),
    ],
)
def test_what_a_whole_request_raises_comes_as_its_status(chunk: dict[str, Any], status: int) -> None:
    with pytest.raises(Refused) as refused:
        GenerateStream(RULE).read(chunk)
    assert refused.value.status_code == status


@pytest.mark.parametrize("chunk", [[1, 2], {"output_ids": [1]}, _chunk([1, 2, 3], 7)])
def test_a_chunk_that_is_not_sglangs_is_malformed(chunk: Any) -> None:
    with pytest.raises(MalformedChunk):
        GenerateStream(RULE).read(chunk)
