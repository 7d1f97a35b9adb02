"""``turns: all`` on a thinking template (Qwen3-style: history without reasoning, a generation prompt
that opens ``<think>``): one sample per regenerated turn, each equal to an independent render of its
conversation so far + the engine's ids; per-row template kwargs; resume mid-conversation.

The driver around the engine is tested here with a scripted stand-in (its answers hold reasoning, so
the template's rewrite is visible); the real transformers engine runs the same checks in
:func:`test_per_turn_samples_with_the_real_engine_resume_mid_conversation_row_for_row`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from dflash_build import config as cfg
from dflash_build import engines
from dflash_build import plan as plan_mod
from dflash_build.engines import Request, Result
from dflash_build.killpoints import KILL_AT_ENV
from dflash_build.ops import window as turn_window
from dflash_build.spec import ConfigError
from dflash_build.stages import generate, mix, prepare, tokenize
from dflash_build.stages.export import conversations, jsonl
from dflash_build.stages.registry import planned
from dflash_build.store import records as R
from tests.conftest import REPO, TOOLS_TEMPLATE, Workflow, base_config, shared_engine, write_jsonl

QWEN3_TEMPLATE = REPO / "tests" / "data" / "templates" / "qwen3-thinking.jinja"
NEMOTRON = REPO / "tests" / "data" / "upstream" / "nemotron-post-training-v2"
STOP = 2  # <|im_end|> in SmolLM2's vocabulary

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
MESSAGES_ROWS = [  # an OpenAI-messages conversation with a tool call and its result, and a plain one
    {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather"}}]},
            {"role": "tool", "content": '{"temperature": 18, "sky": "cloudy"}'},
            {"role": "assistant", "content": "It is 18 degrees and cloudy."},
            {"role": "user", "content": "Should I take an umbrella?"},
            {"role": "assistant", "content": "Perhaps."},
        ],
        "tools": [WEATHER_TOOL],
    },
    {
        "messages": [
            {"role": "user", "content": "Name a prime number."},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": "And an even one?"},
            {"role": "assistant", "content": "2"},
        ]
    },
]
SHAREGPT_ROWS = [
    {
        "conversations": [
            {"from": "human", "value": "What is the capital of France?"},
            {"from": "gpt", "value": "Paris."},
            {"from": "human", "value": "And of Italy?"},
            {"from": "gpt", "value": "Rome."},
            {"from": "human", "value": "Which of the two is larger?"},
        ]
    }
]


class ThinkingEngine:
    """Stand-in: answers turn k with reasoning, ``</think>`` and an answer, then the stop token. The
    turn is read from the prompt (its assistant headers), so a new instance answers a resumed job alike;
    at ``loop_at_turn`` the answer is a loop (one word over and over), which still stops."""

    def __init__(
        self,
        tokenizer: Any,
        length_at_turn: int | None = None,
        fail_after: int | None = None,
        loop_at_turn: int | None = None,
    ) -> None:
        self.tokenizer, self.length_at_turn, self.fail_after = tokenizer, length_at_turn, fail_after
        self.loop_at_turn = loop_at_turn
        self.requests: list[Request] = []

    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        for r in requests:
            if self.fail_after is not None and len(self.requests) >= self.fail_after:
                raise RuntimeError("the engine died")
            self.requests.append(r)
            turn = self.tokenizer.decode(r.prompt_ids).count("<|im_start|>assistant") - 1
            text = f"reasoning {turn} of {r.prompt_id[:6]}\n</think>\n\nanswer {turn} of {r.prompt_id[:6]}"
            if turn == self.loop_at_turn:
                text = f"reasoning {turn}\n</think>\n\n" + "again " * 150
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if turn == self.length_at_turn:  # runs out: the whole budget, as an engine does
                yield Result(
                    r.prompt_id, r.sample_idx, (ids * r.params.max_new_tokens)[: r.params.max_new_tokens], "length"
                )
            elif len(ids) + 1 > r.params.max_new_tokens:  # as an engine does: never past the budget
                yield Result(r.prompt_id, r.sample_idx, ids[: r.params.max_new_tokens], "length")
            else:
                yield Result(r.prompt_id, r.sample_idx, ids, "stop", stop_token_id=STOP)

    def close(self) -> None:
        pass


def _plan(
    tmp_path: Path,
    model: Path,
    source: dict[str, Any],
    template: Path = QWEN3_TEMPLATE,
    model_settings: dict[str, Any] | None = None,
    **extra: Any,
) -> plan_mod.Plan:
    tmp_path.mkdir(exist_ok=True)
    raw = {
        "store": str(tmp_path / "store"),
        "model": {"path": str(model), "chat_template": str(template), **(model_settings or {})},
        "engine": {"backend": "transformers", "options": {"device": "cpu", "batch_size": 4, "threads": 1}},
        "sampling": {"max_new_tokens": 40, "temperature": 0.8, "seed": 3},
        "sources": {"s": {"category": "c", "turns": "all", **source}},
        "mix": {"categories": {"c": 1}},
        "truncated": "drop",
        **extra,
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    plan = plan_mod.build(cfg.load(tmp_path / "c.yaml"))
    prepare.run(planned(plan, "prepare", "s"))
    return plan


def _messages_plan(tmp_path: Path, model: Path, **source: Any) -> plan_mod.Plan:
    write_jsonl(tmp_path / "chat.jsonl", MESSAGES_ROWS)
    return _plan(tmp_path, model, {"format": "messages", "files": [str(tmp_path / "chat.jsonl")], **source})


def _tokenizer(model: Path, template: Path = QWEN3_TEMPLATE) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = template.read_text()
    return tok


def _completions(plan: plan_mod.Plan) -> list[dict[str, Any]]:
    return pq.read_table(plan.completion_dir("s") / "00000.parquet").to_pylist()


def _prompts(plan: plan_mod.Plan) -> dict[str, dict[str, Any]]:
    return {r["prompt_id"]: r for r in pq.read_table(plan.prompt_dir("s") / "00000.parquet").to_pylist()}


def check_against_independent_renders(
    plan: plan_mod.Plan, tok: Any, kwargs: dict[str, Any] | None = None
) -> list[tuple[int | None, list[int], list[int]]]:
    """Every per-turn sample is the template's render (by transformers, not our renderer) of its
    conversation so far, earlier answers being the engine's decoded ids, then the engine's ids and
    stop token; the loss mask is 0 on the prompt and 1 on exactly those ids. Returns the samples."""
    prompts = _prompts(plan)
    samples = []
    for row in _completions(plan):
        assert row["error"] is None, row["error"]
        prompt = prompts[row["prompt_id"]]
        messages, tools = json.loads(prompt["messages"]), json.loads(prompt["tools"]) if prompt["tools"] else None
        row_kwargs = {**(kwargs or {}), **json.loads(prompt["template_kwargs"] or "{}")}
        slots = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if messages[-1]["role"] != "assistant":
            slots.append(len(messages))
        if row["turns"] is None:  # a conversation of one answer: one sample, rendered the same way
            text = tok.apply_chat_template(
                messages[: slots[0]], tools=tools, add_generation_prompt=True, tokenize=False, **row_kwargs
            )
            assert len(slots) == 1 and row["prompt_ids"] == tok(text, add_special_tokens=False)["input_ids"]
            continue
        assert row["per_turn"] is True
        assert len(row["turns"]) == len(slots), "every assistant turn is regenerated"
        got = tokenize.to_samples(row, "drop")
        assert len(got) == len(slots)
        for k, (turn, sample) in enumerate(zip(row["turns"], got, strict=True)):
            history = [dict(m) for m in messages[: slots[k]]]
            for j in range(k):
                history[slots[j]] = {"role": "assistant", "content": tok.decode(row["turns"][j]["output_ids"])}
            text = tok.apply_chat_template(
                history, tools=tools, add_generation_prompt=True, tokenize=False, **row_kwargs
            )
            expected_prompt = tok(text, add_special_tokens=False)["input_ids"]
            answer = turn["output_ids"] + [STOP]
            assert sample == (k, expected_prompt + answer, [0] * len(expected_prompt) + [1] * len(answer))
            assert turn["context_ids"] == expected_prompt
            samples.append(sample)
    return samples


def test_each_turn_is_a_sample_on_a_template_that_drops_earlier_reasoning(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _messages_plan(tmp_path, tiny_model)
    tok = _tokenizer(tiny_model)
    stand_in = ThinkingEngine(tok)
    monkeypatch.setattr(engines, "load", lambda *a, **k: stand_in)
    stats = generate.run(planned(plan, "generate", "s", "00000"))
    assert stats["error"] == 0 and stats["ok"] == 2 and stats["errors"] == {}
    assert stats["turns"] == {
        "conversations": 2,
        "turns": 5,  # 3 answers around the tool call, 2 in the plain conversation
        "per_turn": 2,
        "history_retokenized": 2,
        "ended_early": 0,
        "by_count": {"2": 1, "3": 1},
    }
    samples = check_against_independent_renders(plan, tok)
    assert len(samples) == 5
    # the template wrote each earlier answer without its reasoning: the prompt of turn 2 holds answers
    # 0 and 1, not their reasoning, and the engine saw exactly these prompts
    tool_row = next(r for r in _completions(plan) if len(r["turns"]) == 3)
    last_prompt = tok.decode(tool_row["turns"][2]["context_ids"])
    pid = tool_row["prompt_id"][:6]
    assert f"answer 0 of {pid}" in last_prompt and f"answer 1 of {pid}" in last_prompt
    assert "reasoning" not in last_prompt and "<tool_response>" in last_prompt
    assert last_prompt.endswith("<|im_start|>assistant\n<think>\n")
    # Answer 0 comes before the tool result, after the last user query: the template writes it with its
    # reasoning, as generated, so turn 1 extends the sequence; the new user query of turn 2 rewrites both.
    # So turns 0 and 1 keep the ids the engine saw, and only turn 2's prompt holds re-tokenized history.
    assert [t["history_retokenized"] for t in tool_row["turns"]] == [False, False, True]
    assert (
        tool_row["turns"][1]["context_ids"][: len(tool_row["turns"][0]["context_ids"])]
        == tool_row["turns"][0]["context_ids"]
    )
    sent = {tuple(r.prompt_ids) for r in stand_in.requests}
    assert {tuple(t["context_ids"]) for r in _completions(plan) for t in r["turns"]} == sent

    shard = tokenize.run(planned(plan, "tokenize", "s", "00000"))
    assert shard["rows_out"] == 5 and shard["per_turn_samples"] == 5 and shard["dropped"] == {}
    tokens = pq.read_table(plan.token_dir("s") / "00000.parquet").to_pylist()
    assert sorted((t["prompt_id"], t["turn"]) for t in tokens) == sorted(
        (r["prompt_id"], k) for r in _completions(plan) for k in range(len(r["turns"]))
    )


def test_a_prefix_stable_template_keeps_one_sequence_and_per_turn_can_be_forced(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """chatml-tools writes history as a prefix of the next prompt: auto keeps today's single sequence
    (no id re-tokenized); turn_samples: per_turn makes samples of its turns anyway."""
    write_jsonl(tmp_path / "chat.jsonl", MESSAGES_ROWS)
    source = {"format": "messages", "files": [str(tmp_path / "chat.jsonl")]}
    tok = _tokenizer(tiny_model, TOOLS_TEMPLATE)
    monkeypatch.setattr(engines, "load", lambda *a, **k: ThinkingEngine(tok))
    auto = _plan(tmp_path / "auto", tiny_model, source, TOOLS_TEMPLATE)
    generate.run(planned(auto, "generate", "s", "00000"))
    rows = _completions(auto)
    assert all(r["per_turn"] is False and len(r["turns"]) >= 2 for r in rows)
    assert all(tokenize.to_samples(r, "drop")[0][0] is None and len(tokenize.to_samples(r, "drop")) == 1 for r in rows)
    forced = _plan(
        tmp_path / "forced",
        tiny_model,
        {**source, "turn_samples": "per_turn"},
        TOOLS_TEMPLATE,
    )
    assert forced.sources["s"].gen_key != auto.sources["s"].gen_key, "turn_samples is keyed"
    generate.run(planned(forced, "generate", "s", "00000"))
    samples = check_against_independent_renders(forced, tok)
    assert len(samples) == sum(len(r["turns"]) for r in rows)
    # the same conversation, the same answers: each per-turn sample is a prefix of the sequence
    sequences = {r["prompt_id"]: tokenize.to_sample(r, "drop")[0] for r in rows}
    for row in _completions(forced):
        for _, ids, _ in tokenize.to_samples(row, "drop"):
            assert sequences[row["prompt_id"]][: len(ids)] == ids


def test_sequence_on_a_rewriting_template_is_an_error_row_that_names_the_fix(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _messages_plan(tmp_path, tiny_model, turn_samples="sequence")
    monkeypatch.setattr(engines, "load", lambda *a, **k: ThinkingEngine(_tokenizer(tiny_model)))
    with pytest.raises(
        generate.ShardFailedError, match=r"2 x .*not prefix-stable\); set turn_samples: auto or per_turn"
    ):
        generate.run(planned(plan, "generate", "s", "00000"))


def test_a_truncated_turn_ends_its_conversation_and_is_counted(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _messages_plan(tmp_path, tiny_model)
    monkeypatch.setattr(engines, "load", lambda *a, **k: ThinkingEngine(_tokenizer(tiny_model), length_at_turn=1))
    stats = generate.run(planned(plan, "generate", "s", "00000"))
    assert stats["truncated"] == 2 and stats["turns"]["ended_early"] == 1  # the 2-turn one ended on its last
    assert stats["turns"]["by_count"] == {"2": 2}, "no turn is generated after a truncated one"
    rows = {len(json.loads(p["messages"])): p["prompt_id"] for p in _prompts(plan).values()}
    per_turn = {r["prompt_id"]: r["per_turn"] for r in _completions(plan)}
    # the tool conversation is still one sequence at turn 1 (see the first test): truncated, it is one
    # dropped sample; the plain one is per-turn from turn 1, so its turn 0 stays a sample
    assert per_turn == {rows[7]: False, rows[4]: True}
    shard = tokenize.run(planned(plan, "tokenize", "s", "00000"))
    assert shard["rows_out"] == 1 and shard["dropped"] == {"truncated": 2} and shard["per_turn_samples"] == 1


@pytest.mark.parametrize("history", ["regenerated", "source"])
def test_the_conversations_export_holds_no_turn_that_tokenize_dropped(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, history: str
) -> None:
    """Issue 79: a turn of a ``turns: all`` conversation that tokenize drops as degenerate (a loop at turn 1
    of each conversation, every turn a sample of its own) is no answer of the conversations export either:
    on the dataset's history the export's turns are the dataset's samples, one for one; on the regenerated
    history a conversation ends before its dropped turn (the turn after it was asked on the loop). The
    tokenize shard stands for the dataset (the mix's samples have its columns)."""
    from dflash_build.spec import ExportSpec
    from dflash_build.stages.export.formats import Written

    write_jsonl(tmp_path / "chat.jsonl", MESSAGES_ROWS)
    source = {"format": "messages", "files": [str(tmp_path / "chat.jsonl")], "turn_samples": "per_turn"}
    sampling = {"max_new_tokens": 300, "temperature": 0.8, "seed": 3}  # room for the loop to be one
    plan = _plan(tmp_path, tiny_model, {**source, "history": history}, sampling=sampling)
    monkeypatch.setattr(engines, "load", lambda *a, **k: ThinkingEngine(_tokenizer(tiny_model), loop_at_turn=1))
    generate.run(planned(plan, "generate", "s", "00000"))
    rows = _completions(plan)
    assert sorted(len(r["turns"]) for r in rows) == [2, 3] and all(r["per_turn"] for r in rows)
    assert tokenize.run(planned(plan, "tokenize", "s", "00000"))["dropped"] == {"loop": 2}
    dataset = plan.token_dir("s") / "00000.parquet"
    trained = {(r["prompt_id"], r["turn"]) for r in pq.read_table(dataset).to_pylist()}
    assert trained == {(r["prompt_id"], k) for r in rows for k in range(len(r["turns"])) if k != 1}

    stores = {"s": [(plan.prompt_dir("s") / "00000.parquet", plan.completion_dir("s") / "00000.parquet")]}
    out = jsonl.JsonlShards(tmp_path / "export", 100)
    counts = conversations.write(
        Written([dataset], stores, ExportSpec("conversations"), out, {"s": plan.sources["s"].spec})
    )
    files = out.close(tmp_path / "export")
    exported = [json.loads(line) for f in files for line in (tmp_path / "export" / f["path"]).read_text().splitlines()]
    assert "again again" not in json.dumps(exported), "the loop tokenize dropped is exported"

    def regenerated(record: dict[str, Any]) -> list[str]:
        """A record's answers from the target: every one on the regenerated history, the last on the dataset's."""
        said = [m["content"].strip() for m in record["conversations"] if m["role"] == "assistant"]
        return said[-1:] if history == "source" else said

    answers = {r["id"]: regenerated(r) for r in exported}
    if history == "source":
        assert set(answers) == {jsonl.sample_id(pid, 0, k) for pid, k in trained}, "the dataset's samples"
        assert all(a == [f"answer {i.split(':')[2]} of {i[:6]}"] for i, a in answers.items())
    else:
        assert answers == {jsonl.sample_id(r["prompt_id"], 0): [f"answer 0 of {r['prompt_id'][:6]}"] for r in rows}
    assert counts["regenerated_turns"] == sum(map(len, answers.values()))


def test_a_killed_job_resumes_at_the_next_unfinished_turn(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = _messages_plan(tmp_path / "whole", tiny_model)
    tok = _tokenizer(tiny_model)
    monkeypatch.setattr(engines, "load", lambda *a, **k: ThinkingEngine(tok))
    generate.run(planned(whole, "generate", "s", "00000"))
    plan = _messages_plan(tmp_path / "resumed", tiny_model)
    monkeypatch.setattr(engines, "load", lambda *a, **k: ThinkingEngine(tok, fail_after=3))
    with pytest.raises(RuntimeError, match="the engine died"):
        generate.run(planned(plan, "generate", "s", "00000"))
    journaled = (plan.journal_dir("s", "00000") / "rows.jsonl").read_text().splitlines()
    assert [json.loads(r)["turn"] for r in journaled] == [0, 0, 1], "two conversations, one of them mid-way"
    rerun = ThinkingEngine(tok)
    monkeypatch.setattr(engines, "load", lambda *a, **k: rerun)
    stats = generate.run(planned(plan, "generate", "s", "00000"))
    assert stats["resumed_turns"] == 3 and len(rerun.requests) == 2, "only the unfinished turns are generated"
    assert _completions(plan) == _completions(whole)


def test_conversations_are_reused_whole_from_an_earlier_prompt_set_and_only_under_the_same_budgets(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another prompt set (a row added) with the same model, template and sampling: every earlier
    conversation is taken from the row index, every turn of it, one ending on a truncated turn too;
    only the new one reaches the engine, and the rows equal a fresh build's. Under another
    max_new_tokens a turn is taken only where the engine would answer it the same (its answer stopped
    within the new budget; one that ran out, not), from the first turn on: the rows equal that budget's
    fresh build's."""
    tok = _tokenizer(tiny_model)
    first = _messages_plan(tmp_path, tiny_model)
    plan_mod.record_components(first)  # as the Snakefile does: reuse reads what an earlier key was made of
    monkeypatch.setattr(engines, "load", lambda *a, **k: ThinkingEngine(tok, length_at_turn=2))
    generate.run(planned(first, "generate", "s", "00000"))
    new_row = {"messages": [{"role": "user", "content": "Count to two."}, {"role": "assistant", "content": "1 2"}]}
    write_jsonl(tmp_path / "chat.jsonl", [*MESSAGES_ROWS, new_row])
    grown = _plan(tmp_path, tiny_model, {"format": "messages", "files": [str(tmp_path / "chat.jsonl")]})
    assert grown.sources["s"].gen_key != first.sources["s"].gen_key
    assert grown.sources["s"].conversation_reuse_key == first.sources["s"].conversation_reuse_key
    engine = ThinkingEngine(tok, length_at_turn=2)
    monkeypatch.setattr(engines, "load", lambda *a, **k: engine)
    stats = generate.run(planned(grown, "generate", "s", "00000"))
    assert stats["reused"] == 2 and stats["generated"] == 1 and len(engine.requests) == 1, stats
    assert {r.prompt_id for r in engine.requests} == set(_prompts(grown)) - set(_prompts(first))
    fresh = _plan(tmp_path / "fresh", tiny_model, {"format": "messages", "files": [str(tmp_path / "chat.jsonl")]})
    generate.run(planned(fresh, "generate", "s", "00000"))
    columns = ["prompt_id", "sample_idx", "prompt_ids", "output_ids", "finish_reason", "turns", "per_turn"]
    assert pq.read_table(grown.completion_dir("s") / "00000.parquet", columns=columns).to_pylist() == (
        pq.read_table(fresh.completion_dir("s") / "00000.parquet", columns=columns).to_pylist()
    )
    # 30 new tokens: every answer that stopped still fits; the turn that ran out at 40 would run out sooner
    shorter_source = {"format": "messages", "files": [str(tmp_path / "chat.jsonl")], "sampling": {"max_new_tokens": 30}}
    shorter = _plan(tmp_path, tiny_model, shorter_source)
    assert shorter.sources["s"].conversation_reuse_key == first.sources["s"].conversation_reuse_key
    again = ThinkingEngine(tok, length_at_turn=2)
    monkeypatch.setattr(engines, "load", lambda *a, **k: again)
    stats = generate.run(planned(shorter, "generate", "s", "00000"))
    # under another budget a turn is taken only if the engine answers it the same (it stopped within the
    # new budget, or ran out at exactly it): the rows are a fresh build's under that budget
    monkeypatch.setattr(engines, "load", lambda *a, **k: ThinkingEngine(tok, length_at_turn=2))
    fresh_short = _plan(tmp_path / "fresh-short", tiny_model, shorter_source)
    generate.run(planned(fresh_short, "generate", "s", "00000"))
    assert pq.read_table(shorter.completion_dir("s") / "00000.parquet", columns=columns).to_pylist() == (
        pq.read_table(fresh_short.completion_dir("s") / "00000.parquet", columns=columns).to_pylist()
    )
    rows = pq.read_table(shorter.completion_dir("s") / "00000.parquet").to_pylist()
    assert stats["reused"] == 2 and 0 < stats["generated"] < sum(len(r["turns"] or []) for r in rows), stats


def test_a_column_sets_thinking_per_row(tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nemotron v2's ``reasoning`` (on/off) as enable_thinking: each row renders as the data says; the
    same messages with thinking on and off are two prompts; a value the map lacks drops the row."""
    folder = tmp_path / "nemotron"
    shutil.copytree(NEMOTRON, folder)
    table = pq.read_table(folder / "data" / "chat-00000-of-00001.parquet")
    rows = table.to_pylist()
    twin = {**rows[1], "reasoning": "off" if rows[1]["reasoning"] == "on" else "on", "uuid": "twin"}
    odd = {**rows[2], "reasoning": "maybe", "uuid": "odd"}
    pq.write_table(
        type(table).from_pylist([*rows, twin, odd], schema=table.schema),
        folder / "data" / "chat-00000-of-00001.parquet",
    )
    source = {
        "format": "messages",
        "hf": {"path": str(folder), "split": "chat"},
        "chat_template_kwargs_from": {"enable_thinking": {"field": "reasoning", "map": {"on": True, "off": False}}},
        "max_drop_fraction": 0.5,
    }
    plan = _plan(tmp_path, tiny_model, source)
    manifest = json.loads(plan.prompt_manifest("s").read_text())
    assert manifest["rows_out"] == len(rows) + 1 and manifest["drops"] == {"template_kwarg": 1}
    [example] = manifest["drop_examples"]["template_kwarg"]
    assert "'maybe'" in example and "enable_thinking" in example
    prompts = _prompts(plan)
    kwargs = {pid: json.loads(p["template_kwargs"]) for pid, p in prompts.items()}
    assert {json.dumps(k) for k in kwargs.values()} == {'{"enable_thinking": true}', '{"enable_thinking": false}'}
    by_messages: dict[str, set[bool]] = {}
    for p in prompts.values():
        by_messages.setdefault(p["messages"], set()).add(kwargs[p["prompt_id"]]["enable_thinking"])
    assert {True, False} in by_messages.values(), "the twin kept both renders of its messages"
    tok = _tokenizer(tiny_model)
    stand_in = ThinkingEngine(tok)
    monkeypatch.setattr(engines, "load", lambda *a, **k: stand_in)
    generate.run(planned(plan, "generate", "s", "00000"))
    check_against_independent_renders(plan, tok)
    firsts = {r["prompt_id"]: tok.decode(r["prompt_ids"]) for r in _completions(plan)}
    for pid, text in firsts.items():
        thinking = kwargs[pid]["enable_thinking"]
        assert text.endswith("<think>\n" if thinking else "<think>\n\n</think>\n\n"), (thinking, text[-30:])


def test_a_bare_on_off_map_key_is_a_config_error(tmp_path: Path, tiny_model: Path) -> None:
    (tmp_path / "c.yaml").write_text(
        f"""
store: {tmp_path}/store
model: {{path: {tiny_model}}}
sources:
  s:
    category: c
    format: messages
    files: [{tmp_path}/x.jsonl]
    chat_template_kwargs_from: {{enable_thinking: {{field: reasoning, map: {{on: true, off: false}}}}}}
mix: {{categories: {{c: 1}}}}
"""
    )
    write_jsonl(tmp_path / "x.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ConfigError, match=r"sources\.s\.chat_template_kwargs_from\.enable_thinking\.map.*quote"):
        cfg.load(tmp_path / "c.yaml")


def test_turn_samples_needs_turns_all(tmp_path: Path, tiny_model: Path) -> None:
    write_jsonl(tmp_path / "x.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    raw = {
        "store": str(tmp_path / "store"),
        "model": {"path": str(tiny_model)},
        "sources": {
            "s": {
                "category": "c",
                "format": "messages",
                "files": [str(tmp_path / "x.jsonl")],
                "turn_samples": "per_turn",
            }
        },
        "mix": {"categories": {"c": 1}},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"sources\.s\.turn_samples.*turns: all"):
        cfg.load(tmp_path / "c.yaml")


def test_each_turn_ranks_apart_in_the_mix_and_has_its_own_export_id() -> None:
    """Per-turn samples of one conversation rank apart in the mix and carry distinct export ids."""
    import numpy as np
    import pyarrow as pa

    ids = pa.array(["ab" * 8] * 3)
    ranks = mix.sample_ranks(0, ids, np.zeros(3), np.array([0, 1, 2]))
    assert len(set(ranks.tolist())) == 3
    assert mix.sample_ranks(0, ids[:1], np.zeros(1))[0] == ranks[0], "a whole row ranks as turn 0 did before"
    assert jsonl.sample_id("p", 0) == "p:0" and jsonl.sample_id("p", 0, 2) == "p:0:2"


@pytest.mark.workflow
def test_per_turn_samples_with_the_real_engine_resume_mid_conversation_row_for_row(
    tmp_path: Path, gguf_path: Path
) -> None:
    """SmolLM2-135M-Instruct (its GGUF, through the transformers backend) on the Qwen3-style template,
    built by Snakemake: zero error rows, one sample per assistant turn, each equal to an independent
    render + the engine's ids, counted by the mix and the card; a job stopped after its first turn
    resumes mid-conversation and gives the same rows. A tool conversation under history: source builds with
    no error row."""
    from transformers import AutoTokenizer

    write_jsonl(tmp_path / "chat.jsonl", SHAREGPT_ROWS)
    # a tool conversation on the dataset's history, short answers (the CPU engine writes a few tokens a
    # second); the target's own history: the stand-in server's test
    write_jsonl(tmp_path / "called.jsonl", TOOL_ROWS[:1])
    tools = {"category": "c", "format": "messages", "turns": "all", "sampling": {"max_new_tokens": 4}}

    def config(root: Path) -> dict[str, Any]:
        return {
            "store": str(root / "store"),
            "logs": str(root / "logs"),
            "dataset": {"name": "mt", "out": str(root / "dist")},
            "model": {"path": str(gguf_path), "chat_template": str(QWEN3_TEMPLATE), "tool_call_parser": "hermes"},
            "engine": shared_engine(gguf_path, batch_size=2, threads=2),
            "sampling": {"max_new_tokens": 48, "temperature": 0.0, "seed": 0},
            "sources": {
                "s": {"category": "c", "format": "sharegpt", "files": [str(tmp_path / "chat.jsonl")], "turns": "all"},
                "tools_source": {**tools, "files": [str(tmp_path / "called.jsonl")], "history": "source"},
            },
            "mix": {"categories": {"c": 1}},
            "truncated": "keep",  # the tool conversations' short answers are samples too
            # SmolLM2 never closes the thinking block Qwen3's template opens: those answers are kept here
            "degenerate": {"unclosed_reasoning": {"policy": "keep"}},
        }

    Workflow.at(tmp_path / "whole", config(tmp_path / "whole")).build()
    whole = plan_mod.build(cfg.load(tmp_path / "whole" / "config.yaml"))
    [row] = _completions(whole)
    assert row["finish_reason"] == "stop" and len(row["turns"]) == 3, [t["text"] for t in row["turns"]]
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.chat_template = QWEN3_TEMPLATE.read_text()
    samples = check_against_independent_renders(whole, tok)
    tokens = pq.read_table(whole.token_dir("s") / "00000.parquet").to_pylist()
    assert [(t["turn"], t["input_ids"], t["loss_mask"]) for t in tokens] == samples
    # the mix and the card count the per-turn samples and the turns per conversation
    manifest = json.loads((tmp_path / "whole" / "dist" / "mt" / "manifest.json").read_text())
    card = (tmp_path / "whole" / "dist" / "mt" / "README.md").read_text()
    assert manifest["rows"] == manifest["per_turn_samples"], "every sample is one turn of a conversation"
    # the tool conversation: no error row, every assistant turn answered on the dataset's history
    [tool_row] = pq.read_table(whole.completion_dir("tools_source") / "00000.parquet").to_pylist()
    assert R.FINISH_ERROR not in [tool_row["finish_reason"], *(t["finish_reason"] for t in tool_row["turns"])]
    assert tool_row["error"] is None and len(tool_row["turns"]) == 3
    assert "| tools_source | 1 | 3 | 1 |" in card
    retokenized = sum(t["history_retokenized"] for t in row["turns"])
    assert "## Multi-turn conversations" in card
    assert f"| s | 1 | 3 | 1 | {retokenized} | 0 | 0 | 0 | 3 turns: 1 |" in card

    root = tmp_path / "resumed"
    root.mkdir()
    (root / "c.yaml").write_text(yaml.safe_dump(config(root)))
    resumed = plan_mod.build(cfg.load(root / "c.yaml"))
    prepare.run(planned(resumed, "prepare", "s"))
    os.environ[KILL_AT_ENV] = "sigterm:1"  # SIGTERM after the first journaled turn: a clean stop mid-way
    try:
        with pytest.raises(generate.Interrupted):
            generate.run(planned(resumed, "generate", "s", "00000"))
    finally:
        del os.environ[KILL_AT_ENV]
    journaled = (resumed.journal_dir("s", "00000") / "rows.jsonl").read_text().splitlines()
    assert [json.loads(r)["turn"] for r in journaled] == [0]
    stats = generate.run(planned(resumed, "generate", "s", "00000"))
    assert stats["resumed_turns"] == 1 and stats["generated"] == 2
    assert _completions(resumed) == [row], "fresh = resumed, row for row"


# -- tool conversations (issue 40): the target's calls against the dataset's ---------------------------
def _call(city: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}


def _weather_row(question: str, first_answer: dict[str, Any]) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": question},
            first_answer,
            {"role": "tool", "content": '{"temperature": 18}'},
            {"role": "assistant", "content": "It is 18 degrees."},
            {"role": "user", "content": "Should I take an umbrella?"},
            {"role": "assistant", "content": "No."},
        ],
        "tools": [WEATHER_TOOL],
    }


TOOL_ROWS = [
    _weather_row("Weather in Paris?", {"role": "assistant", "content": "", "tool_calls": [_call("Paris")]}),
    _weather_row("Weather in Lyon?", {"role": "assistant", "content": "", "tool_calls": [_call("Lyon")]}),
    _weather_row("Is it warm in Paris?", {"role": "assistant", "content": "Usually, in summer."}),
]


PARIS_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def tool_answer(prompt_text: str) -> str:
    """The stand-ins' answer to a tool conversation's prompt: at the first turn (read from the prompt's
    assistant headers) a call of get_weather for Paris, whatever was asked; later turns answer in text."""
    turn = prompt_text.count("<|im_start|>assistant") - 1
    return PARIS_CALL if turn == 0 else f"answer {turn}"


class ToolEngine(ThinkingEngine):
    """Stand-in: reasons, then answers as :func:`tool_answer`."""

    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        for r in requests:
            if self.fail_after is not None and len(self.requests) >= self.fail_after:
                raise RuntimeError("the engine died")
            self.requests.append(r)
            prompt = self.tokenizer.decode(r.prompt_ids)
            turn = prompt.count("<|im_start|>assistant") - 1
            text = f"reasoning {turn}\n</think>\n\n{tool_answer(prompt)}"
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            yield Result(r.prompt_id, r.sample_idx, ids, "stop", stop_token_id=STOP)


@pytest.mark.parametrize("tool_match", ["arguments", "name"])
def test_a_tool_conversation_goes_on_while_the_targets_calls_are_the_datasets(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, tool_match: str
) -> None:
    """Every turn regenerated while the target's call (read by the hermes parser) is the dataset's: the
    next prompt is the template's render of the history with that call, structured, and the dataset's
    result. A call with other arguments (under tool_match: arguments), or a call where the dataset
    answered in text, ends the conversation after that turn, counted as tool_call_mismatch."""
    write_jsonl(tmp_path / "tools.jsonl", TOOL_ROWS)
    source = {"format": "messages", "files": [str(tmp_path / "tools.jsonl")], "tool_match": tool_match}
    raw_model = {"tool_call_parser": "hermes"}
    plan = _plan(tmp_path, tiny_model, source, model_settings=raw_model)
    tok = _tokenizer(tiny_model)
    monkeypatch.setattr(engines, "load", lambda *a, **k: ToolEngine(tok))
    stats = generate.run(planned(plan, "generate", "s", "00000"))
    by_question = {json.loads(p["messages"])[0]["content"]: p["prompt_id"] for p in _prompts(plan).values()}
    rows = {r["prompt_id"]: r for r in _completions(plan)}
    paris, lyon, text = (
        rows[by_question[q]] for q in ("Weather in Paris?", "Weather in Lyon?", "Is it warm in Paris?")
    )
    assert len(paris["turns"]) == 3 and paris["error"] is None
    assert len(lyon["turns"]) == (1 if tool_match == "arguments" else 3)
    assert len(text["turns"]) == 1 and text["error"].startswith("tool_call_mismatch: turn 0 answered ['get_weather']")
    assert stats["turns"]["tool_calls_matched"] == (1 if tool_match == "arguments" else 2)
    assert stats["turns"]["tool_call_mismatch"] == (2 if tool_match == "arguments" else 1)
    assert stats["error"] == 0 and stats["ok"] == 3, "an ended conversation keeps its turns as samples"
    if tool_match == "arguments":
        assert lyon["error"].startswith("tool_call_mismatch: turn 0 called get_weather (call 1 of 1) with arguments")
        # the note shows both arguments, so the operator sees what differed
        assert '{"city": "Paris"} where the dataset has {"city": "Lyon"}' in lyon["error"], lyon["error"]
    # the prompt of the turn after the call: an independent render of the history with the call, structured
    called = {
        "role": "assistant",
        "content": "reasoning 0\n</think>",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    }
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        called,
        {"role": "tool", "content": '{"temperature": 18}'},
    ]
    text_1 = tok.apply_chat_template(history, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
    samples = tokenize.to_samples(paris, "drop")
    assert (
        samples[1][1][: len(samples[1][1]) - len(paris["turns"][1]["output_ids"]) - 1]
        == tok(text_1, add_special_tokens=False)["input_ids"]
    )
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text_1
    assert '<tool_response>\n{"temperature": 18}\n</tool_response>' in text_1
    # the conversations export writes the target's call structured
    exported = conversations.conversation(
        json.loads(_prompts(plan)[paris["prompt_id"]]["messages"]),
        [t["text"] for t in paris["turns"]],
        ("<think>", "</think>"),
        "hermes",
        [WEATHER_TOOL],
    )
    assert exported[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert exported[2] == {"role": "tool", "content": '{"temperature": 18}'}


def test_history_source_regenerates_every_turn_on_the_datasets_own_history(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """history: source: every assistant turn is regenerated on the dataset's history up to it (its
    answers, calls and results as the dataset has them), one sample per assistant turn, whatever the
    target called before; a job that dies mid-conversation resumes to the same rows."""
    write_jsonl(tmp_path / "tools.jsonl", TOOL_ROWS)
    source = {"format": "messages", "files": [str(tmp_path / "tools.jsonl")], "history": "source"}
    plan = _plan(tmp_path / "whole", tiny_model, source, model_settings={"tool_call_parser": "hermes"})
    tok = _tokenizer(tiny_model)
    engine = ToolEngine(tok)
    monkeypatch.setattr(engines, "load", lambda *a, **k: engine)
    stats = generate.run(planned(plan, "generate", "s", "00000"))
    assert stats["error"] == 0 and stats["ok"] == 3 and stats["turns"]["turns"] == 9
    assert stats["turns"]["tool_call_mismatch"] == 0, "no conversation ends on the target's calls"
    assert stats["turns"]["tool_calls_matched"] == 1, "only Paris's first call is the dataset's"
    prompts = _prompts(plan)
    for row in _completions(plan):
        assert row["error"] is None and row["per_turn"] is True and len(row["turns"]) == 3
        messages = json.loads(prompts[row["prompt_id"]]["messages"])
        assert messages[3] == {"role": "assistant", "content": "It is 18 degrees."}, "the dataset's answer is kept"
        slots = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        for k, (turn, sample) in enumerate(zip(row["turns"], tokenize.to_samples(row, "drop"), strict=True)):
            text = tok.apply_chat_template(
                messages[: slots[k]], tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False
            )
            expected = tok(text, add_special_tokens=False)["input_ids"]
            assert turn["context_ids"] == expected and sample[1] == expected + turn["output_ids"] + [STOP]
    lyon = next(m for p in prompts.values() if "Lyon" in (m := json.loads(p["messages"]))[0]["content"])
    assert lyon[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Lyon"}, "Lyon's call stays the dataset's"

    resumed = _plan(tmp_path / "resumed", tiny_model, source, model_settings={"tool_call_parser": "hermes"})
    dying = ToolEngine(tok, fail_after=4)
    monkeypatch.setattr(engines, "load", lambda *a, **k: dying)
    with pytest.raises(RuntimeError, match="the engine died"):
        generate.run(planned(resumed, "generate", "s", "00000"))
    rerun = ToolEngine(tok)
    monkeypatch.setattr(engines, "load", lambda *a, **k: rerun)
    stats = generate.run(planned(resumed, "generate", "s", "00000"))
    assert stats["resumed_turns"] == 4 and len(rerun.requests) == 5
    assert _completions(resumed) == _completions(plan), "resumed = uninterrupted, row for row"


def test_a_tool_conversation_killed_mid_way_resumes_to_the_uninterrupted_rows(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """history: regenerated: replaying the journal applies the same match rule, so a conversation that
    went on after a matched call, and one that ended on a mismatch, come out as without the kill."""
    write_jsonl(tmp_path / "tools.jsonl", TOOL_ROWS)
    source = {"format": "messages", "files": [str(tmp_path / "tools.jsonl")]}
    settings = {"tool_call_parser": "hermes"}
    tok = _tokenizer(tiny_model)
    whole = _plan(tmp_path / "whole", tiny_model, source, model_settings=settings)
    monkeypatch.setattr(engines, "load", lambda *a, **k: ToolEngine(tok))
    generate.run(planned(whole, "generate", "s", "00000"))
    plan = _plan(tmp_path / "resumed", tiny_model, source, model_settings=settings)
    monkeypatch.setattr(engines, "load", lambda *a, **k: ToolEngine(tok, fail_after=4))
    with pytest.raises(RuntimeError, match="the engine died"):
        generate.run(planned(plan, "generate", "s", "00000"))
    journaled = [json.loads(r) for r in (plan.journal_dir("s", "00000") / "rows.jsonl").read_text().splitlines()]
    assert [r["turn"] for r in journaled] == [0, 0, 0, 1], "Paris mid-way after its matched call"
    rerun = ToolEngine(tok)
    monkeypatch.setattr(engines, "load", lambda *a, **k: rerun)
    stats = generate.run(planned(plan, "generate", "s", "00000"))
    assert stats["resumed_turns"] == 4 and len(rerun.requests) == 1
    assert stats["turns"]["tool_call_mismatch"] == 2 and stats["turns"]["tool_calls_matched"] == 1
    assert _completions(plan) == _completions(whole)


def _scripted(tok: Any) -> Any:
    """A server's answers, :func:`tool_answer` without reasoning (the turn is read from the prompt, so every
    request stands alone, as on a real server)."""

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        prompt = body["prompt"]
        text = tool_answer(tok.decode(prompt) if isinstance(prompt, list) else prompt)
        ids = tok(text, add_special_tokens=False)["input_ids"][: int(body["max_tokens"])]
        return {
            "choices": [{"token_ids": [*ids, STOP], "finish_reason": "stop"}],
            "usage": {"completion_tokens": len(ids)},
        }

    return respond


def _turn_prompts(row: dict[str, Any]) -> list[list[int]]:
    """The whole prompt the server saw at each turn of a completion row, in either sample form."""
    prompts, sequence = [], []
    for t in row["turns"]:
        generated = t["output_ids"] + ([t["stop_token_id"]] if t["stop_token_id"] is not None else [])
        prompt = t["context_ids"] if row["per_turn"] else sequence + t["context_ids"]
        prompts.append(prompt)
        sequence = prompt + generated
    return prompts


@pytest.mark.workflow
def test_tool_conversations_through_a_server_build_count_and_show_on_the_card(
    tmp_path: Path, tiny_model: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built by Snakemake through the openai backend against a scripted stand-in server (the engine is not
    under test): a conversation whose call matches the dataset's gets every turn regenerated, each prompt
    the template's render of the history with the parsed call and the dataset's result; one whose call
    differs ends after that turn, counted as tool_call_mismatch; history: source gives one sample per
    assistant turn; the sidecars, the manifest and the card count them."""
    from transformers import AutoTokenizer

    from tests.standin_server import StandIn

    write_jsonl(tmp_path / "tools.jsonl", TOOL_ROWS)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = TOOLS_TEMPLATE.read_text()
    server = StandIn(model_id=str(tiny_model), respond=_scripted(tok)).start()
    files = [str(tmp_path / "tools.jsonl")]
    sources = {
        "agent": {"category": "agent", "format": "messages", "files": files, "turns": "all"},
        "trajectories": {
            "category": "agent",
            "format": "messages",
            "files": files,
            "turns": "all",
            "history": "source",
        },
    }
    config = base_config(tiny_model, sources, dedup={"across_sources": False})
    config["model"]["tool_call_parser"] = "hermes"
    config["engine"] = {"backend": "openai", "options": {"urls": [server.url], "concurrency": 2}}
    config["sampling"].update(max_new_tokens=64)
    config["export"] = {"conversations": {}}
    try:
        Workflow.at(tmp_path / "work", config).build()
    finally:
        server.stop()
    monkeypatch.chdir(tmp_path / "work")
    plan = plan_mod.build(cfg.load(tmp_path / "work" / "config.yaml"))
    prompts = {r["prompt_id"]: r for r in pq.read_table(plan.prompt_dir("agent") / "00000.parquet").to_pylist()}
    rows = {
        json.loads(prompts[r["prompt_id"]]["messages"])[0]["content"]: r
        for r in pq.read_table(plan.completion_dir("agent") / "00000.parquet").to_pylist()
    }
    paris = rows["Weather in Paris?"]
    assert [len(rows[q]["turns"]) for q in ("Weather in Paris?", "Weather in Lyon?", "Is it warm in Paris?")] == [
        3,
        1,
        1,
    ]
    assert rows["Weather in Lyon?"]["error"].startswith("tool_call_mismatch: turn 0")
    messages = json.loads(prompts[paris["prompt_id"]]["messages"])
    called = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    }
    histories = [messages[:1], [messages[0], called, messages[2]], [messages[0], called, messages[2]]]
    histories[2] += [{"role": "assistant", "content": "answer 1"}, messages[4]]
    for history, prompt in zip(histories, _turn_prompts(paris), strict=True):
        text = tok.apply_chat_template(history, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
        assert tok.decode(prompt) == text
    assert '<tool_response>\n{"temperature": 18}\n</tool_response>' in tok.decode(_turn_prompts(paris)[1])
    stats = json.loads((plan.completion_dir("agent") / "00000.stats.json").read_text())["turns"]
    assert (stats["tool_calls_matched"], stats["tool_call_mismatch"], stats["turns"]) == (1, 2, 5)
    source_rows = pq.read_table(plan.completion_dir("trajectories") / "00000.parquet").to_pylist()
    assert [len(r["turns"]) for r in source_rows] == [3, 3, 3] and all(r["error"] is None for r in source_rows)
    tokens = pq.read_table(plan.token_dir("trajectories") / "00000.parquet").to_pylist()
    assert len(tokens) == 9, "one sample per assistant turn"
    manifest = json.loads((tmp_path / "work" / "dist" / "test-mix" / "manifest.json").read_text())
    card = (tmp_path / "work" / "dist" / "test-mix" / "README.md").read_text()
    assert manifest["per_turn_samples"] == 3 + 9
    assert "| agent | 3 | 5 | 1 | 2 | 2 | 1 | 2 | 1 turns: 2, 3 turns: 1 |" in card
    assert "| trajectories | 3 | 9 | 3 | 6 | 0 | 1 | 0 | 3 turns: 3 |" in card, "none ends on a mismatch"
    # the conversations export: a history: source turn is written on the history it was asked on
    exported = [
        json.loads(line)
        for path in sorted((tmp_path / "work" / "dist" / "test-mix-conversations" / "data").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    on_history = {r["id"]: r["conversations"] for r in exported if r["id"].count(":") == 2}
    assert len(on_history) == 9 and len(exported) == 9 + 3
    paris_turn_1 = next(c for i, c in on_history.items() if i.endswith(":1") and c[0]["content"] == "Weather in Paris?")
    assert [m["role"] for m in paris_turn_1] == ["user", "assistant", "tool", "assistant"]
    assert paris_turn_1[1]["tool_calls"] == [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ], "the dataset's call, as a server sends it"
    assert paris_turn_1[3] == {"role": "assistant", "content": "answer 1"}, "the target's answer"


@pytest.mark.parametrize("history", ["source", "regenerated"])
def test_plan_counts_by_turn_position_the_prompts_the_window_leaves_out_as_generate_does(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, history: str
) -> None:
    """Before any GPU time, plan renders each prepared prompt at each answer slot and counts it at the
    first turn position that leaves fewer than trainer.min_new_tokens of trainer.max_length: exactly what
    generate then skips (turn 0) or ends (later turns), never a failure; under history: regenerated a
    later turn's count is a lower bound (the target's answers are not written yet)."""
    long_question = _weather_row(
        "Weather in Paris? " * 40, {"role": "assistant", "content": "", "tool_calls": [_call("Paris")]}
    )
    write_jsonl(tmp_path / "tools.jsonl", [*TOOL_ROWS, long_question])
    tok = _tokenizer(tiny_model)
    rows = [(r["messages"], [i for i, m in enumerate(r["messages"]) if m["role"] == "assistant"]) for r in TOOL_ROWS]

    def rendered(messages: list[dict[str, Any]]) -> int:
        text = tok.apply_chat_template(messages, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    first = [rendered(m[: s[0]]) for m, s in rows]
    window = {"max_length": max(first) + 24 + 8, "min_new_tokens": 8}  # every first turn fits, with max_new_tokens
    source = {"format": "messages", "files": [str(tmp_path / "tools.jsonl")], "history": history}
    settings = {"tool_call_parser": "hermes"}
    plan = _plan(tmp_path / "w", tiny_model, source, model_settings=settings, trainer=window)
    [counted] = turn_window.turn_windows(plan)
    assert counted.sampled == counted.rows == 4 and counted.lower_bound == (history == "regenerated")
    monkeypatch.setattr(engines, "load", lambda *a, **k: ToolEngine(tok))
    stats = generate.run(planned(plan, "generate", "s", "00000"))
    assert stats["error"] == 0 and stats["skipped"] == counted.outside[0] == 1, "the long question, not a failure"
    ended = Counter(len(r["turns"]) for r in _completions(plan) if "trainer.max_length" in (r["error"] or ""))
    if history == "source":
        assert counted.outside == ended and sum(ended.values()) >= 1, "what plan counted is what generate ended"
    else:  # turn 0 is exact; a later turn's count holds for the conversations that get that far
        assert "+" in counted.line()
    assert counted.line().startswith("s turn 0: 1") and "of 4 prompts" in counted.line()
    as_json = json.loads(json.dumps(dataclasses.asdict(counted)))  # plan --json
    assert as_json["outside"] == {str(k): n for k, n in counted.outside.items()}
