"""Our SGLang calls against the installed, pinned SGLang package (on CPU: no engine runs here).

`make setup` installs the pinned wheel without its GPU dependencies (envs/sglang-contract.txt). What
we build (ServerArgs from config/config.yaml's engine options, SamplingParams from every source's
sampling) goes through SGLang's own classes and checks in tests/sglang_probe.py, a process of its own
(importing SGLang patches transformers). What SGLang does with results and signals is read from its
source (the Engine needs a GPU): each check below names the finding of issue 10 it guards.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from dflash_build import loops, toolcalls
from dflash_build.engines import Request, SamplingParams, sglang_fields
from dflash_build.engines.backends.sglang import BACKEND, DRIVER_FIELDS
from dflash_build.engines.gpus import GpuLease
from dflash_build.engines.openai_backend import OpenAIEngine
from dflash_build.engines.openai_http import generate_body
from dflash_build.engines.sglang_backend import (
    SGLANG_VERSION,
    sampling_params,
    server_args,
    server_kwargs,
)
from dflash_build.engines.sglang_wire import GenerateStream
from dflash_build.spec import LoopRule, ModelSpec
from dflash_build.stages.generate import SEED_BITS, fits_context, row_seed
from tests.conftest import REPO

PRODUCTION = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
QWEN_STOPS = [151645, 151643]  # end-of-turn ids of a Qwen tokenizer
QWEN_VOCAB = 248320


def sglang_source(relative: str) -> str:
    """A file of the installed SGLang, found without importing the package."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "make setup installs the pinned sglang wheel"
    return (Path(next(iter(spec.submodule_search_locations))) / relative).read_text()


def method(source: str, cls: str, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                    return item
    raise AssertionError(f"SGLang {SGLANG_VERSION} has no {cls}.{name}")


def production_model() -> ModelSpec:
    m = PRODUCTION["model"]
    return ModelSpec(m["path"], m.get("revision"), m.get("tokenizer"), None, {}, m.get("context_length"))


def production_server_args() -> list[dict[str, Any]]:
    options = PRODUCTION["engine"]["options"]
    lease = GpuLease("7", PRODUCTION["engine"]["base_port"] + 70, "lock", 0.0)
    shared = server_kwargs(production_model(), options, lease, lease.port)  # engine.shared's HTTP server
    return [server_args(production_model(), options, None), server_args(production_model(), options, lease), shared]


def production_sampling() -> list[dict[str, Any]]:
    """Every source's sampling as sent, with the extreme row seeds and greedy decoding too."""
    base = PRODUCTION["sampling"]
    out = []
    for name, source in PRODUCTION["sources"].items():
        s = {**base, **source.get("sampling", {})}
        params = SamplingParams(s["temperature"], s["top_p"], s["top_k"], s["min_p"], s["max_new_tokens"])
        for seed in (row_seed(s["seed"], f"{name}-0", 0), 0, 2**SEED_BITS - 1):
            out.append(sampling_params(Request("p", 0, [1, 2], params, seed), QWEN_STOPS))
    greedy = SamplingParams(0.0, 1.0, 0, 0.0, 1)
    out.append(sampling_params(Request("p", 0, [1], greedy, 0), QWEN_STOPS))
    return out


@pytest.fixture(scope="module")
def probe() -> dict[str, Any]:
    request = {
        "server_args": production_server_args(),
        "sampling": production_sampling(),
        "vocab_size": QWEN_VOCAB,
        "generate_bodies": _streamed_bodies(),
    }
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "sglang_probe.py")],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_one_pinned_version_everywhere(probe: dict[str, Any]) -> None:
    extra = re.search(r'sglang = \["sglang==([^"]+)"\]', (REPO / "pyproject.toml").read_text())
    env = re.search(r"- sglang==(\S+)", (REPO / "envs" / "sglang.yaml").read_text())
    assert extra and env
    assert probe["version"] == SGLANG_VERSION == extra.group(1) == env.group(1) == sglang_fields.VERSION


def test_recorded_fields_are_the_installed_servers_args(probe: dict[str, Any]) -> None:
    installed = {f for f in probe["fields"] if not f.startswith("_")}
    assert installed == set(sglang_fields.SERVER_ARGS), (
        "regenerate dflash_build/engines/sglang_fields.py (its docstring says how)"
    )


def test_production_engine_options_build_a_valid_server_args(probe: dict[str, Any]) -> None:
    """Finding 1 (cuda_graph_max_bs was split) and 10 (any field passes): SGLang's own ServerArgs
    accepts what the backend builds from config/config.yaml, each value of its field's type and choices."""
    assert probe["server_args"] == [None, None, None]


def test_the_shared_engine_server_starts_as_sglangs_launch_server_does() -> None:
    """engine.shared runs ``sglang_backend.serve``: load_plugins, run_server(ServerArgs), then
    kill_process_tree of its own children, as ``python -m sglang.launch_server`` does."""
    launch = ast.parse(sglang_source("launch_server.py"))
    run_server = next(n for n in launch.body if isinstance(n, ast.FunctionDef) and n.name == "run_server")
    assert [a.arg for a in run_server.args.args] == ["server_args"]
    main = ast.unparse(launch)
    assert "load_plugins()" in main and "kill_process_tree(os.getpid(), include_parent=False)" in main
    plugins = ast.parse(sglang_source("srt/plugins/__init__.py"))
    assert any(isinstance(n, ast.FunctionDef) and n.name == "load_plugins" and not n.args.args for n in plugins.body)
    http = sglang_source("srt/entrypoints/http_server.py")
    assert '@app.get("/health")' in http and re.search(r'@app\.api_route\(\s*"/generate",\s*methods=\["POST"', http)


def test_every_decided_and_every_driver_option_is_a_real_field() -> None:
    decided = {name for name, option in BACKEND.options.items() if not option.driver}
    assert decided <= sglang_fields.SERVER_ARGS, sorted(decided - sglang_fields.SERVER_ARGS)
    assert set(DRIVER_FIELDS) <= sglang_fields.SERVER_ARGS
    assert not decided & set(DRIVER_FIELDS)


def test_sampling_params_of_every_source_pass_sglangs_own_checks(probe: dict[str, Any]) -> None:
    """Finding 3: row seeds, at their extremes too, are in the range the pinned version verifies."""
    assert probe["sampling"] == [None] * len(probe["sampling"])


def test_seed_tensor_is_int64() -> None:
    """Finding 3: the pinned version builds its per-row seed tensor as int64 (0.5.5: int32)."""
    source = sglang_source("srt/sampling/sampling_batch_info.py")
    at = source.index("sampling_seed = (")
    assert "dtype=torch.int64" in source[at : at + 600]


def test_engine_calls_we_make_exist() -> None:
    engine = sglang_source("srt/entrypoints/engine.py")
    generate = method(engine, "Engine", "async_generate")
    names = {a.arg for a in generate.args.args + generate.args.kwonlyargs}
    assert {"input_ids", "sampling_params", "rid"} <= names
    manager = sglang_source("srt/managers/tokenizer_manager.py")
    method(manager, "TokenizerManager", "auto_create_handle_loop")
    abort = method(manager, "TokenizerManager", "abort_request")
    assert abort.args.args[1].arg == "rid"
    assert "self._subprocess_watchdog" in manager or "_subprocess_watchdog" in engine
    assert "self.loop = self._ensure_event_loop()" in engine


def finish_json(cls: str) -> dict[str, Any]:
    to_json = method(sglang_source("srt/managers/schedule_batch.py"), cls, "to_json")
    returned = next(n for n in ast.walk(to_json) if isinstance(n, ast.Return))
    assert isinstance(returned.value, ast.Dict)
    pairs = zip(returned.value.keys, returned.value.values, strict=True)
    return {ast.literal_eval(k): ast.unparse(v) for k, v in pairs}  # type: ignore[arg-type]


def test_finish_reason_shapes_are_the_ones_parse_output_reads() -> None:
    """Findings 4, 6, 8: the shapes tests/test_sglang_backend.py feeds parse_output."""
    assert finish_json("FINISH_MATCHED_TOKEN") == {"type": "'stop'", "matched": "self.matched"}
    assert finish_json("FINISH_MATCHED_STR") == {"type": "'stop'", "matched": "self.matched"}
    assert finish_json("FINISH_LENGTH") == {"type": "'length'", "length": "self.length"}
    assert set(finish_json("FINISH_ABORT")) == {"type", "message", "status_code", "err_type"}
    batch = sglang_source("srt/managers/schedule_batch.py")
    assert 'FINISH_MATCHED_STR(matched="NaN happened")' in batch
    through = ast.unparse(method(batch, "Req", "output_ids_through_stop"))
    assert "self.output_ids[:self.finished_len]" in through, "the stop token is returned inside output_ids"


def test_stop_tokens_are_checked_before_the_length_limit() -> None:
    """Finding 5: the pinned version checks stop tokens first (0.5.5 checked the length first)."""
    update = ast.unparse(method(sglang_source("srt/managers/schedule_batch.py"), "Req", "update_finish_state"))
    assert update.index("_check_token_based_finish") < update.index("FINISH_LENGTH")


def test_context_rule_is_the_drivers() -> None:
    """Finding 7: SGLang refuses prompt + max_new_tokens > context; fits_context allows exactly the rest."""
    validate = ast.unparse(
        method(sglang_source("srt/managers/tokenizer_manager.py"), "TokenizerManager", "_validate_one_request")
    )
    assert "max_new_tokens + input_token_num > _max_req_len" in validate
    assert "input_token_num >= self.context_len" in validate


def test_aborts_with_a_status_are_raised() -> None:
    """Finding 8: a non-streamed abort with a status code is raised (ValueError for 400), not returned."""
    handle = ast.unparse(
        method(sglang_source("srt/managers/tokenizer_manager.py"), "TokenizerManager", "_handle_abort_finish_reason")
    )
    assert "raise ValueError(finish_reason['message'])" in handle
    assert "raise fastapi.HTTPException(status_code=status_code" in handle


def test_sglang_takes_sigterm_and_sigquit_and_shutdown_kills_every_child() -> None:
    """Finding 9: the handlers the backend removes, and why it does not call Engine.shutdown."""
    loop_setup = ast.unparse(
        method(sglang_source("srt/managers/tokenizer_manager.py"), "TokenizerManager", "auto_create_handle_loop")
    )
    assert "loop.add_signal_handler(signal.SIGTERM" in loop_setup
    assert "loop.add_signal_handler(signal.SIGQUIT" in loop_setup
    shutdown = ast.unparse(method(sglang_source("srt/entrypoints/engine.py"), "Engine", "shutdown"))
    assert "kill_process_tree(os.getpid(), include_parent=False" in shutdown


def test_the_pinned_version_has_the_target_models_architecture() -> None:
    """Finding 2: Qwen3.5/Qwen3.6 (hybrid GDN + attention) is in the pinned model registry."""
    registry = sglang_source("srt/models/qwen3_5.py")
    entry = next(
        n
        for n in ast.walk(ast.parse(registry))
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "EntryClass"
    )
    assert "Qwen3_5ForConditionalGeneration" in ast.unparse(entry.value)


@pytest.mark.parametrize(("prompt", "fits"), [(4095, True), (4096, True), (4097, False)])
def test_fits_context_is_sglangs_boundary(prompt: int, fits: bool) -> None:
    """Finding 7: prompt + max_new_tokens == context is accepted by the pinned version, one more is not."""
    assert fits_context(prompt, 4096, 8192) is fits


# -- tool calls: our parsers against SGLang's detectors of the same names (issue 40) --------------------------
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "filters": {"type": "object"},
                    "limit": {"type": ["integer", "null"]},
                    "min_score": {"type": "number"},
                    "tags": {"anyOf": [{"type": "array"}, {"type": "null"}]},
                    "order": {"enum": ["asc", "desc"]},
                },
            },
        },
    },
]


def _hermes(*calls: str) -> str:
    return "".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)


def _coder(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


_WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
TOOL_CALL_CASES = {
    "hermes": [
        "No tool is needed: it is 42.",
        "Let me look.\n\n" + _hermes(_WEATHER),
        _hermes(_WEATHER, '{"name": "search", "arguments": {"query": "rain", "filters": {"lang": "fr"}}}'),
        _hermes('[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "search", "arguments": {}}]'),
        _hermes('{"name": "search", "parameters": {"query": "parameters, not arguments"}}'),
        "Checking " + _hermes('{"name": "get_weather", "arguments": {"city": '),  # unparsable JSON
        _hermes('{"name": "launch_rocket", "arguments": {"now": true}}'),  # a function the tools lack
        _hermes(_WEATHER, '{"name": "launch_rocket", "arguments": {}}'),
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}',  # cut before its closing tag
        "The user asks for Beijing.\n</think>\n\n" + _hermes('{"name": "get_weather", "arguments": {"city": "北京"}}'),
        _hermes('"just a string"'),
    ],
    "qwen3_coder": [
        "No tool is needed: it is 42.",
        "Let me look.\n\n" + _coder("get_weather", city="Paris", days="3"),
        _coder("get_weather", city="Oslo", metric="True") + "\n" + _coder("search", query="rain", limit="null"),
        _coder("search", query="x", filters='{"lang": "fr", "n": [1, 2]}', min_score="2.50", tags="['a', 'b']"),
        _coder("search", query="x", min_score="7", order="desc", limit="seven"),
        _coder("launch_rocket", now="true"),  # a function the tools lack: kept, its values as text
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</function>\n</tool_call>",  # no </parameter>
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n",  # cut mid-call
        "The user asks for Beijing.\n</think>\n\n" + _coder("get_weather", city="北京", days="2"),
        _coder("search", query="line one\nline two\n"),  # a value's own last newline stays
    ],
}


def test_tool_call_parsers_read_answers_as_sglangs_own_detectors_do() -> None:
    cases = [{"parser": p, "text": t, "tools": _TOOLS} for p, texts in TOOL_CALL_CASES.items() for t in texts]
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "sglang_probe.py")],
        input=json.dumps({"tool_calls": cases}),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout)["tool_calls"]
    for case, expected in zip(cases, theirs, strict=True):
        ours = toolcalls.parse(case["parser"], case["text"], case["tools"])
        got = {"content": ours.content, "calls": [[c.name, c.arguments] for c in ours.calls]}
        assert got == expected, (case["parser"], case["text"])
    assert sum(bool(e["calls"]) for e in theirs) >= 14 and any(not e["calls"] for e in theirs[1:]), (
        "the table tests both"
    )


def test_speculative_algorithms_and_meta_info_fields_are_the_pinned_releases() -> None:
    """`accept` names SGLang's algorithms as its SpeculativeAlgorithm enum does, and reads the counts its
    TokenizerManager writes into each request's meta_info (SGLang's per-request acceptance)."""
    from dflash_build.engines.backends import sglang as sglang_backend

    tree = ast.parse(sglang_source("srt/speculative/spec_info.py"))
    [enum] = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "SpeculativeAlgorithm"]
    members = {t.id for n in enum.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    assert set(sglang_backend.SPECULATIVE_ALGORITHMS) == members - {"NONE"}
    source = sglang_source("srt/managers/tokenizer_manager.py")
    counts = ("spec_verify_ct", "spec_num_proposed_drafts", "spec_num_correct_drafts", "spec_correct_drafts_histogram")
    for name in counts:
        assert f'meta_info["{name}"]' in source, name
    for name in ("speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps"):
        assert name in sglang_fields.SERVER_ARGS, name


# -- a looping row's stream (issue 79): SGLang's /generate stream, and its abort of a closed one ------------------
def _streamed_bodies() -> list[dict[str, Any]]:
    """The /generate bodies a job sends for a row the loop rule stops, under every source's sampling."""
    bodies = []
    for params in production_sampling():
        body = generate_body(
            Request("p", 0, [1, 2, 3], SamplingParams(0.6, 0.95, 20, 0.0, 8), 7, LoopRule()), QWEN_STOPS
        )
        bodies.append(GenerateStream.streamed({**body, "sampling_params": params}))
    return bodies


def test_a_streamed_generate_body_passes_sglangs_own_checks(probe: dict[str, Any]) -> None:
    """What /generate's contract gate (api_contract.generate_contract_error, the route's schema check) and
    SamplingParams (normalize, verify) say of the body, and each key a field of GenerateReqInput; in the job
    the same keys are Engine.async_generate's arguments."""
    bodies = _streamed_bodies()
    assert all(b["stream"] is True and b["sampling_params"]["stream_interval"] == 16 for b in bodies)
    assert all("stop_loops" not in b for b in bodies), "SGLang has no such field"
    assert probe["generate_bodies"] == [None] * len(bodies)
    request_class = next(
        n
        for n in ast.walk(ast.parse(sglang_source("srt/managers/io_struct.py")))
        if isinstance(n, ast.ClassDef) and n.name == "GenerateReqInput"
    )
    fields = {
        n.target.id for n in request_class.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    assert set(bodies[0]) <= fields, set(bodies[0]) - fields
    generate = method(sglang_source("srt/entrypoints/engine.py"), "Engine", "async_generate")
    arguments = {a.arg for a in generate.args.args + generate.args.kwonlyargs}
    assert {"input_ids", "sampling_params", "rid", "stream"} <= arguments


def test_the_stream_format_is_the_pinned_releases() -> None:
    """sglang_wire's reading: SSE events of dumps_json(chunk), [DONE] last; a token-id chunk is output_ids (new
    tokens with incremental_streaming_output) and meta_info, whose completion_tokens counts the whole answer."""
    route = ast.unparse(
        next(
            n
            for n in ast.parse(sglang_source("srt/entrypoints/http_server.py")).body
            if isinstance(n, ast.AsyncFunctionDef) and n.name == "serve_generate_request"
        )
    )
    assert "yield (b'data: ' + dumps_json(out) + b'\\n\\n')" in route
    assert "yield b'data: [DONE]\\n\\n'" in route
    assert "background=_global_state.tokenizer_manager.create_abort_task(obj)" in route
    manager = sglang_source("srt/managers/tokenizer_manager.py")
    output = ast.unparse(method(manager, "TokenizerManager", "_handle_batch_output"))
    token_ids = output[output.index("elif isinstance(recv_obj, BatchTokenIDOutput):") :]
    assert "incremental = is_stream and self.incremental_streaming_output" in token_ids
    assert "out_dict = {'output_ids': output_token_ids, 'meta_info': meta_info}" in token_ids
    assert "'completion_tokens': recv_obj.completion_tokens[i]" in output
    streamer = sglang_source("srt/managers/scheduler_components/output_streamer.py")
    assert "else len(output_ids_)" in streamer and "req.sampling_params.stream_interval" in streamer
    assert "incremental_streaming_output" in sglang_fields.SERVER_ARGS


def test_a_closed_stream_is_aborted_by_sglang_itself() -> None:
    """Why the job sends no /abort_request: generate_request aborts a request it is ended on (a cancelled or
    closed stream) once it went to the scheduler, and the stream's background task aborts it again 2 s later."""
    manager = sglang_source("srt/managers/tokenizer_manager.py")
    generate = method(manager, "TokenizerManager", "generate_request")
    [handler] = [h for n in ast.walk(generate) if isinstance(n, ast.Try) for h in n.handlers]
    assert ast.unparse(handler.type) == "BaseException"  # type: ignore[arg-type]
    assert [ast.unparse(s) for s in handler.body] == ["self._release_req_states_on_failure(request_states)", "raise"]
    release = ast.unparse(method(manager, "TokenizerManager", "_release_req_states_on_failure"))
    assert "if state.dispatched:\n                try:\n                    self.abort_request(rid)" in release
    abort_task = ast.unparse(method(manager, "TokenizerManager", "create_abort_task"))
    assert "await asyncio.sleep(2)" in abort_task
    assert "if rid in self.rid_to_state:\n                self.abort_request(rid)" in abort_task


def test_sglangs_own_route_streams_what_the_job_reads_and_aborts_the_stream_it_closes() -> None:
    """SGLang's serve_generate_request and create_abort_task (tests/sglang_route.py), under uvicorn: the job's
    client reads its stream, cuts a looping row where the rule fires and closes the stream; the route ends the
    tokenizer manager's generator at once (where SGLang aborts the request) and aborts it again later."""
    pytest.importorskip("uvicorn")
    from tests import sglang_route
    from tests.standin_server import LOOP_ID, STOP_ID

    rule = LoopRule()
    params = SamplingParams(0.6, 0.95, 20, 0.0, 4096)
    requests = [Request(f"p{i}", 0, [1, 5 + i, LOOP_ID] if i else [1, 5], params, i, rule) for i in range(3)]
    with sglang_route.serve("tiny-model") as (url, manager):
        engine = OpenAIEngine({"urls": [url], "api": "generate", "retries": 0}, [STOP_ID], None, "/models/tiny-model")
        try:
            got = {r.prompt_id: r for r in engine.generate(requests)}
        finally:
            engine.close()
        deadline = time.monotonic() + 10  # the stream's background task aborts ABORT_WAIT after its stream ended
        while len(manager.aborted) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    print(f"the ASGI spec versions uvicorn gave: {manager.spec_versions}")
    looping = list(manager.rid_to_state)  # aborted, so never answered
    assert len(looping) == 2 and sorted(manager.aborted) == sorted(looping * 2), "at once, and by the background"
    for request in requests:
        ids, finish = sglang_route.generate_answer({"input_ids": request.prompt_ids, "sampling_params": {
            "max_new_tokens": 4096, "sampling_seed": request.seed}})  # fmt: skip
        if finish["type"] == "stop":
            assert (got[request.prompt_id].finish_reason, got[request.prompt_id].output_ids) == ("stop", ids[:-1])
            continue
        end = loops.loop_end(ids, rule)
        assert end is not None and got[request.prompt_id].output_ids == ids[:end]
        assert got[request.prompt_id].finish_reason == "loop"
    assert all(manager.generated[rid] < 200 + 6 * loops.CHECK_EVERY for rid in looping), manager.generated
