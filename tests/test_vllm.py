"""The vllm backend on a real vLLM server: vLLM 0.32.0's CPU build (``make vllm``) serving a tiny random Qwen3.

One server per pytest worker serves the builds that share it, started once as production starts one per
GPU (``engine.shared``); the fault tests run servers of their own and kill, stop or starve them.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from dflash_build import loops
from dflash_build.engines import host as engine_host
from dflash_build.engines import openai_backend
from dflash_build.engines.registry import gauges
from dflash_build.spec import LoopRule
from dflash_build.stages.generate import row_seed
from dflash_build.store import layout
from tests.conftest import (
    Workflow,
    base_config,
    completion_rows,
    engine_history,
    job_logs,
    once_per_session,
    own_engines,
    shared_engine,
    wait_until,
    warm_engine,
    write_jsonl,
)

pytestmark = pytest.mark.workflow

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_CONVERSATION = {
    "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temperature": 21}'},
        {"role": "assistant", "content": "It is 21 degrees in Paris."},
    ],
    "tools": [TOOL],
}
CHAT = {
    "messages": [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "An apple."},
        {"role": "user", "content": "And a vegetable?"},
        {"role": "assistant", "content": "A carrot."},
    ]
}
QUESTIONS = [{"instruction": f"Write one sentence about the number {i}."} for i in range(6)]


def vllm_config(model: Path, data: Path, **engine: Any) -> dict[str, Any]:
    """Six alpaca prompts with two samples each, and two conversations (one with a tool call) of turns: all."""
    write_jsonl(data / "questions.jsonl", QUESTIONS)
    write_jsonl(data / "chats.jsonl", [TOOL_CONVERSATION, CHAT])
    sources = {
        "questions": {
            "category": "general",
            "format": "alpaca",
            "files": [str(data / "questions.jsonl")],
            "sampling": {"samples_per_prompt": 2},
        },
        "chats": {"category": "agent", "format": "messages", "files": [str(data / "chats.jsonl")], "turns": "all"},
    }
    config = base_config(model, sources, engine={**shared_engine(model, "vllm"), **engine})
    config["model"]["tool_call_parser"] = "hermes"
    config["sampling"]["max_new_tokens"] = 12
    config["checks"]["allow_shortfall"] = True  # a handful of random answers: the shares are not the point
    return config


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, vllm_model: Path) -> Workflow:
    """The vLLM build, once per session: its tests read it or copy it."""

    def build(root: Path) -> None:
        Workflow.at(root / "work", vllm_config(vllm_model, root / "data")).build()

    return Workflow(once_per_session(tmp_path_factory, "vllm", build) / "work")


def _sidecars(store: Path, source: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((store / "completions" / source).glob(f"*/*{layout.SIDECAR}"))]


def test_a_build_on_the_vllm_server_keeps_every_rows_seed_samples_and_turns(built: Workflow, vllm_model: Path) -> None:
    store = built.workdir / "store"
    rows = {(r["prompt_id"], r["sample_idx"]): r for p in sorted((store / "completions").rglob("0*.parquet"))
            for r in pq.read_table(p).to_pylist()}  # fmt: skip
    questions = [r for r in rows.values() if r["turns"] is None]
    assert len(questions) == 12 and {r["sample_idx"] for r in questions} == {0, 1}, "samples_per_prompt: 2"
    stops = set(json.loads((vllm_model / "generation_config.json").read_text())["eos_token_id"])
    for r in questions:
        assert r["seed"] == row_seed(0, r["prompt_id"], r["sample_idx"]), "every sample keeps its own row seed"
        assert r["finish_reason"] == "stop" or (r["finish_reason"], r["n_output_tokens"]) == ("length", 12)
        assert (r["stop_token_id"] in stops) is (r["finish_reason"] == "stop"), "the stop id the server stopped on"
        assert not set(r["output_ids"]) & stops, "the stop token is kept apart from the answer"
    pairs = [(rows[(p, 0)], rows[(p, 1)]) for p in {r["prompt_id"] for r in questions}]
    assert sum(a["output_ids"] != b["output_ids"] for a, b in pairs) >= len(pairs) - 1, "two samples, two seeds"
    [sidecar] = _sidecars(store, "chats")
    assert sidecar["engine"]["backend"] == "vllm" and sidecar["engine"]["served"]["engines"]
    turns = sidecar["turns"]
    assert turns["conversations"] == 2 and turns["turns"] >= 2
    # the tool conversation goes on only if the random target called get_weather(city=Paris), as the dataset did
    assert turns["tool_calls_matched"] + turns["tool_call_mismatch"] >= 1
    dataset = built.workdir / "dist" / "test-mix"
    assert sum(pq.ParquetFile(p).metadata.num_rows for p in dataset.glob("data/*.parquet")) > 0


def test_a_rebuild_on_the_same_server_gives_the_same_rows(built: Workflow, tmp_path: Path, vllm_model: Path) -> None:
    """vLLM's seeded sampling is per request and does not depend on the batch (its CPU build, float32): a
    fresh store gets the same rows from the same server, token for token."""
    again = Workflow.at(tmp_path / "work", vllm_config(vllm_model, tmp_path / "data"))
    again.build()
    assert completion_rows(again.workdir / "store") == completion_rows(built.workdir / "store")


def _server(lock_dir: Path, wait: float = 300) -> dict[str, Any]:
    """The one running engine's state in ``lock_dir`` (its host's and its server's pids)."""
    wait_until(lambda: engine_host.running(lock_dir), wait, f"an engine running in {lock_dir}")
    [state] = engine_host.running(lock_dir)
    return state


def _after_rows(store: Path, rows: int, then: Any) -> threading.Thread:
    """``then()`` once the build's journals hold ``rows`` finished rows."""

    def watch() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if _journaled(store) >= rows:
                then()
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _journaled(store: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in store.glob(f"journal/*/*/{layout.JOURNAL_ROWS}"))


def _questions_only(config: dict[str, Any]) -> dict[str, Any]:
    config = {**config, "sources": {"questions": config["sources"]["questions"]}}
    config["sampling"] = {**config["sampling"], "max_new_tokens": 12}
    return config


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_server_killed_or_stopped_mid_shard_is_replaced_and_the_dataset_is_the_same(
    built: Workflow, tmp_path: Path, vllm_model: Path, fault: str
) -> None:
    """kill -9 of the server, or SIGSTOP past engine.stall_timeout: the job names it (a stopped one within
    the documented bound), its engine is replaced, no finished row is generated again, and every row is
    the uninterrupted build's."""
    config = _questions_only(vllm_config(vllm_model, tmp_path / "data"))
    config["shard_size"] = 12  # one shard: one job sees the fault and heals
    options = {**config["engine"]["options"], "max_inflight": 1}  # rows finish one at a time
    # each row in the journal as it finishes: the fault lands after the first, with eleven to go
    own_engines(config, tmp_path / "locks", shared=True, stall_timeout=6, journal_flush_rows=1, options=options)
    wf = Workflow.at(tmp_path / "work", config)
    store = wf.workdir / "store"
    faulted: dict[str, float] = {}

    def fault_it() -> None:
        server = _server(tmp_path / "locks")
        faulted["at"], faulted["group"] = time.time(), int(server["server_pid"])  # its workers' group too
        # stopped first, so that the rows journaled by then are those it finished before its fault (a
        # loaded machine may be slow to see the first row: without the stop the rest could finish meanwhile)
        os.kill(int(server["server_pid"]), signal.SIGSTOP)
        faulted["rows"] = _journaled(store)
        if fault == "kill":
            os.kill(int(server["server_pid"]), signal.SIGKILL)

    _after_rows(store, 1, fault_it)
    wf.build()
    assert "at" in faulted and faulted["rows"] < 12, f"the fault came after the shard was done: {faulted}"
    expected = {k: v for k, v in completion_rows(built.workdir / "store").items() if k[0] in _prompt_ids(store)}
    assert completion_rows(store) == expected and len(expected) == 12
    [stats] = _sidecars(store, "questions")
    assert stats["generated"] == 12 and stats["ok"] + stats["truncated"] == 12, "each row journaled once"
    history = engine_history(wf.workdir / "logs")
    assert [h["reason"] for h in history][:1] == ["server exited (-9)" if fault == "kill" else "stalled"], history
    assert not engine_host.processes(group=faulted["group"]), "the server's engine core and worker went with it"
    lost = stats["engine"]["served"]["lost"]
    assert len(lost) == 1 and lost[0]["stalled"] is (fault == "stop")
    if fault == "stop":
        line = next(x for x in job_logs(wf).splitlines() if "leaves the pool (stalled" in x)
        named = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000
        assert named - faulted["at"] <= openai_backend.stall_verdict_seconds(6) + 1.5, line


def _prompt_ids(store: Path) -> set[str]:
    return {r["prompt_id"] for p in store.glob("prompts/*/*/0*.parquet") for r in pq.read_table(p).to_pylist()}


def test_a_request_the_server_refuses_and_a_prompt_over_the_context_are_counted_rows(
    tmp_path: Path, vllm_model: Path
) -> None:
    """The server's own window (max_model_len 96) below the driver's (model.context_length 200): a prompt of
    ~100 tokens is sent and refused (an error row naming the server and its answer); one of ~590 does not
    fit the driver's window and is skipped before any request; the rest are generated; the job passes."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    rows = [
        {"instruction": "Say hello."},
        {"instruction": "Count to three."},
        {"instruction": " ".join(words * 6)},  # ~100 tokens with the template's: within 200, past 96
        {"instruction": " ".join(words * 40)},  # ~590 tokens: past 200
    ]
    write_jsonl(tmp_path / "data" / "q.jsonl", rows)
    sources = {"q": {"category": "general", "format": "alpaca", "files": [str(tmp_path / "data" / "q.jsonl")]}}
    config = base_config(vllm_model, sources, engine=shared_engine(vllm_model, "vllm"))
    config["model"]["context_length"] = 200
    config["sampling"]["max_new_tokens"] = 8
    own_engines(config, tmp_path / "locks", shared=True, options={**config["engine"]["options"], "max_model_len": 96})
    wf = Workflow.at(tmp_path / "work", config)
    wf.build()
    [shard] = (wf.workdir / "store" / "completions").rglob("0*.parquet")
    by_reason: dict[str, list[dict[str, Any]]] = {}
    for row in pq.read_table(shard).to_pylist():
        by_reason.setdefault(row["finish_reason"], []).append(row)
    [refused], [skipped] = by_reason.pop("error"), by_reason.pop("skipped")
    assert sum(map(len, by_reason.values())) == 2 and set(by_reason) <= {"stop", "length"}
    assert "maximum context length is 96" in refused["error"] and "http://127.0.0.1:" in refused["error"]
    assert "prompt of 5" in skipped["error"] and "exceeds the context of 200" in skipped["error"]
    [stats] = _sidecars(wf.workdir / "store", "q")
    assert (stats["error"], stats["skipped"], stats["ok"] + stats["truncated"]) == (1, 1, 2)
    [server] = engine_history(wf.workdir / "logs")
    assert server["reason"] == "stopped", "one server, stopped when the workflow ended: the refusal cost it nothing"


def test_a_misspelled_vllm_option_stops_the_build_in_one_line_naming_the_closest(
    tmp_path: Path, vllm_model: Path
) -> None:
    config = vllm_config(vllm_model, tmp_path / "data")
    config["engine"]["options"]["max_num_seq"] = 64
    done = Workflow.at(tmp_path / "work", config).run(check=False)
    assert done.returncode != 0
    [line] = [x for x in done.stderr.splitlines() if "engine.options.max_num_seq" in x]
    assert "vLLM 0.32.0 has no such engine argument; did you mean 'max_num_seqs'" in line
    assert not list(tmp_path.glob("work/store/**/*.parquet")), "no job ran"


def _metrics(url: str, **names: str) -> dict[str, float]:
    """The server's Prometheus samples (``names``: ours -> vLLM's), as the engines read them (``gauges``)."""
    import urllib.request

    return gauges(urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode(), names)


def _generated_tokens(url: str) -> float:
    """The tokens the server has generated, as its Prometheus counter says (a client's abort counts none
    after it)."""
    return _metrics(url, generated="vllm:generation_tokens_total").get("generated", 0.0)


LAG = 3.0  # seconds the client reads nothing once the server has a request running


def _build_with_a_lagging_client(wf: Workflow, url: str) -> None:
    """``--until generate``, with Snakemake and its jobs (their process group) stopped for LAG seconds once
    the server runs a request: a client that reads nothing for a while, as a loaded machine makes it. The
    server goes on meanwhile; only a stop in the engine itself ends a looping row then."""
    import subprocess

    def running() -> float:
        return _metrics(url, running="vllm:num_requests_running").get("running", 0.0)

    cmd, env = wf.command("--until", "generate")
    build = subprocess.Popen(cmd, cwd=wf.workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while build.poll() is None and not running() and time.monotonic() < deadline:
        time.sleep(0.05)
    if build.poll() is None:
        os.killpg(build.pid, signal.SIGSTOP)
        time.sleep(LAG)
        os.killpg(build.pid, signal.SIGCONT)
    out, _ = build.communicate(timeout=600)
    assert build.returncode == 0, out[-6000:]


def _new_rows(store: Path, built: set[str]) -> tuple[str, dict[tuple[str, int], dict[str, Any]]]:
    """The questions' rows of the one generation key not in ``built``, and that key."""
    [key] = {s["gen_key"] for s in _sidecars(store, "questions")} - built
    paths = sorted((store / "completions" / "questions" / key).glob("0*.parquet"))
    return key, {(r["prompt_id"], r["sample_idx"]): r for p in paths for r in pq.read_table(p).to_pylist()}


BUDGET = 1024


def test_a_looping_row_is_stopped_on_the_server_where_the_rule_fires(
    built: Workflow, tmp_path: Path, vllm_model: Path
) -> None:
    """Issues 72 and 79 on vLLM: the random target loops greedily. With the loop rule (a shorter span than the
    default's) the job streams each answer with its token ids and closes the stream where the rule fires, and
    vLLM's own repetition check (loops.engine_check, sent with each such request) ends the generating in the
    engine: the row ends where the rule fired (finish reason loop), and the server's own token counter shows
    it generated at most the check's reach past that point for each looping row, however busy the machine
    (a closed stream alone reached a loaded server after it had generated every row's whole budget). The
    same row without the stop (stop_early off, continued from the stopped prefix) begins with it."""
    wf = built.copy_to(tmp_path / "work")
    store = wf.workdir / "store"
    config = _questions_only(yaml.safe_load((wf.workdir / "config.yaml").read_text()))
    # a budget the tiny model cannot finish before the job closes the stream, however busy the machine
    config["sampling"] = {**config["sampling"], "temperature": 0.0, "max_new_tokens": BUDGET}
    config["degenerate"] = {"loop": {"min_span": 32, "max_period": 16}}
    written = wf.write_config(config)  # with this worker's engine, which the fixture's may not be
    warm_engine(written)  # the shared server, started now to read its counters first
    lock_dir = yaml.safe_load(written.read_text())["engine"]["lock_dir"]
    [state] = engine_host.running(lock_dir)
    before = _generated_tokens(state["url"])
    keys = {s["gen_key"] for s in _sidecars(store, "questions")}
    _build_with_a_lagging_client(wf, state["url"])  # the random target loops on most rows: no mix
    key, rows = _new_rows(store, keys)
    stopped = {k: r for k, r in rows.items() if r["finish_reason"] == "loop"}
    assert stopped, {k: (r["finish_reason"], r["n_output_tokens"]) for k, r in rows.items()}
    assert all(r["n_output_tokens"] < BUDGET for r in stopped.values()), "stopped before the budget"
    assert engine_host.running(lock_dir) == [state], "the warm server served the build"
    spent = _generated_tokens(state["url"]) - before
    kept = sum(r["n_output_tokens"] for r in rows.values())
    # past the rule's cut: the engine's check fires within longest_span + max_period tokens (the contract test
    # tests/test_vllm_contract.py shows it on vLLM's own check), plus a step or two the scheduler has in flight
    rule = LoopRule(**config["degenerate"]["loop"])
    reach = loops.longest_span(rule) + rule.max_period + 4
    print(f"the server generated {spent:.0f} tokens for rows of {kept} ({len(stopped)} loops, reach {reach} each)")
    assert kept <= spent <= kept + reach * len(stopped), (spent, kept, len(stopped))  # this server's own count
    sidecars = [s for s in _sidecars(store, "questions") if s["gen_key"] == key]
    assert sum(s["loops_stopped"] for s in sidecars) == len(stopped)
    assert sum(s["loop_tokens"] for s in sidecars) == sum(r["n_output_tokens"] for r in stopped.values())

    config["degenerate"]["loop"]["stop_early"] = False
    wf.write_config(config)
    wf.run("--until", "generate")
    _, whole = _new_rows(store, keys | {key})
    for k, row in stopped.items():
        assert whole[k]["output_ids"][: row["n_output_tokens"]] == row["output_ids"], "the stopped row's prefix"
        assert whole[k]["finish_reason"] == "length" and whole[k]["n_output_tokens"] == BUDGET
