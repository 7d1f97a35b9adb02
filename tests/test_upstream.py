"""Prepare on files shaped like the real upstream datasets (tests/data/upstream), and their byte quirks."""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from dflash_build import config as cfg
from dflash_build import inputs
from dflash_build import plan as plan_mod
from dflash_build.spec import ConfigError, Sampling, SourceSpec
from dflash_build.stages import prepare
from dflash_build.stages.registry import planned
from tests.conftest import write_jsonl

UPSTREAM = Path(__file__).resolve().parent / "data" / "upstream"


def _plan(tmp_path: Path, sources: dict[str, Any], **extra: Any) -> plan_mod.Plan:
    tmp_path.mkdir(parents=True, exist_ok=True)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"gguf")
    categories = {s["category"] for s in sources.values()}
    raw = {
        "store": str(tmp_path / "store"),
        "model": {"path": str(model)},
        "sources": sources,
        "mix": {"categories": dict.fromkeys(categories, 1)},
        **extra,
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    return plan_mod.build(cfg.load(tmp_path / "c.yaml"))


def _prepared(tmp_path: Path, source: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    plan = _plan(tmp_path, {"s": {"category": "c", **source}})
    manifest = prepare.run(planned(plan, "prepare", "s"))
    rows = [r for p in plan.prompt_shards("s") for r in pq.read_table(p).to_pylist()]
    for r in rows:
        r["messages"] = json.loads(r["messages"])
        r["tools"] = json.loads(r["tools"]) if r["tools"] else None
    assert manifest["rows_in"] == manifest["rows_out"] + sum(manifest["drops"].values())
    return manifest, rows


def _hf(folder: str, **kw: Any) -> dict[str, Any]:
    return {"path": str(UPSTREAM / folder), **kw}


def test_nemotron_v2_keeps_every_row_despite_its_empty_system_turn(tmp_path: Path) -> None:
    for split, n in (("code", 40), ("chat", 30), ("math", 30)):
        manifest, rows = _prepared(
            tmp_path / split, {"format": "messages", "hf": _hf("nemotron-post-training-v2", split=split)}
        )
        assert manifest["rows_out"] == n and manifest["drops"] == {}, (split, manifest["drops"])
        for r in rows:
            assert [m["role"] for m in r["messages"]] == ["user"], "the empty system turn is skipped, not kept"
            assert r["messages"][0]["content"].strip()


def test_hermes_tools_come_out_of_the_system_prompt_in_json_and_python_literal_form(tmp_path: Path) -> None:
    manifest, rows = _prepared(
        tmp_path, {"format": "hermes", "hf": _hf("hermes-function-calling-v1", name="func_calling_singleturn")}
    )
    assert manifest["rows_out"] == 12 and manifest["drops"] == {}
    for r in rows:
        assert r["tools"] is not None and len(r["tools"]) == 2
        assert all(t["type"] == "function" and t["function"]["parameters"]["required"] for t in r["tools"])
        # the dataset's own preamble goes: the target's template writes its own from `tools`
        assert [m["role"] for m in r["messages"]] == ["user"]
        assert "<tools>" not in json.dumps(r["messages"])


def test_glaive_rows_with_and_without_tools(tmp_path: Path) -> None:
    manifest, rows = _prepared(
        tmp_path, {"format": "hermes", "hf": _hf("hermes-function-calling-v1", name="glaive_func_calling")}
    )
    assert manifest["rows_out"] == 12 and manifest["drops"] == {}
    with_tools = [r for r in rows if r["tools"]]
    without = [r for r in rows if not r["tools"]]
    assert len(with_tools) == 9 and len(without) == 3
    assert all([m["role"] for m in r["messages"]] == ["user"] for r in with_tools)
    assert all(r["messages"][0]["content"].startswith("You are a helpful assistant") for r in without)


def test_glaive_under_turns_all_keeps_the_datasets_calls_and_unwraps_its_tool_results(tmp_path: Path) -> None:
    """turns: all on Hermes' glaive rows: each answer slot holds the dataset's calls (written there as a
    Python literal in <tool_call> tags), parsed to structured tool_calls, for a regenerated turn to be
    compared with; a tool result loses its <tool_response> tags, which the target's template writes."""
    manifest, rows = _prepared(
        tmp_path,
        {"format": "hermes", "turns": "all", "hf": _hf("hermes-function-calling-v1", name="glaive_func_calling")},
    )
    assert manifest["rows_out"] == 12 and manifest["drops"] == {}
    with_tools = [r for r in rows if r["tools"]]
    assert len(with_tools) == 9
    for r in with_tools:
        roles = [m["role"] for m in r["messages"]]
        assert roles == ["user", "assistant", "tool", "assistant"]
        call = r["messages"][1]["tool_calls"]
        name = r["tools"][0]["function"]["name"]
        amount = int(r["messages"][0]["content"].split(" ")[5])  # "Hi, I need to convert {100 + i} US dollars"
        assert call == [{"type": "function", "function": {"name": name, "arguments": {"amount": amount, "to": "EUR"}}}]
        assert r["messages"][1]["content"] == "" and "tool_calls" not in r["messages"][3]
        assert r["messages"][2]["content"] == "{'converted_amount': 85.0}"
    for r in rows:
        if not r["tools"]:
            assert all("tool_calls" not in m for m in r["messages"])


@pytest.mark.parametrize(
    ("folder", "source", "rows_out", "first_user"),
    [
        ("infinity-instruct", {"format": "sharegpt", "hf": {"name": "0625"}}, 30, None),
        ("code-alpaca-20k", {"format": "alpaca", "hf": {}}, 40, "Write a function that builds"),
        (
            "self-oss-instruct-sc2-exec-filter-50k",
            {"format": "prompt", "fields": {"prompt": "instruction"}, "hf": {}},
            20,
            "Write a Python function `scale_",
        ),
        ("gsm8k", {"format": "prompt", "fields": {"prompt": "question"}, "hf": {"name": "main"}}, 10, "Natalia"),
    ],
)
def test_other_upstream_formats_arrive_whole(
    tmp_path: Path, folder: str, source: dict[str, Any], rows_out: int, first_user: str | None
) -> None:
    source = {**source, "hf": _hf(folder, **source["hf"])}
    manifest, rows = _prepared(tmp_path, source)
    assert manifest["rows_out"] == rows_out and manifest["drops"] == {}
    users = [m["content"] for r in rows for m in r["messages"] if m["role"] == "user"]
    assert len(users) == rows_out  # turns: first keeps exactly one user turn per row here
    if first_user is not None:
        assert all(u.startswith(first_user) for u in users)


def test_code_alpaca_input_is_appended_to_the_instruction(tmp_path: Path) -> None:
    _, rows = _prepared(tmp_path, {"format": "alpaca", "hf": _hf("code-alpaca-20k")})
    with_input = [r["messages"][0]["content"] for r in rows if "\n\n[" in r["messages"][0]["content"]]
    assert len(with_input) == 20


def test_plan_counts_a_local_hub_folder_by_its_split_files(tmp_path: Path) -> None:
    plan = _plan(
        tmp_path,
        {
            "code": {"category": "c", "format": "messages", "hf": _hf("nemotron-post-training-v2", split="code")},
            "glaive": {
                "category": "c",
                "format": "hermes",
                "hf": _hf("hermes-function-calling-v1", name="glaive_func_calling"),
            },
        },
        shard_size=16,
    )
    assert (plan.sources["code"].planned_rows, plan.sources["code"].n_shards) == (40, 3)
    assert (plan.sources["glaive"].planned_rows, plan.sources["glaive"].n_shards) == (12, 1)
    with pytest.raises(ConfigError, match=r"sources\.x\.hf.*no split 'nope'"):
        _plan(
            tmp_path / "bad",
            {"x": {"category": "c", "format": "messages", "hf": _hf("nemotron-post-training-v2", split="nope")}},
        )


# -- byte-level quirks of local files ----------------------------------------------------------------
def _alpaca_lines(n: int) -> list[bytes]:
    return [json.dumps({"instruction": f"task number {i}"}).encode() + b"\n" for i in range(n)]


def test_a_utf8_bom_costs_no_row(tmp_path: Path) -> None:
    (tmp_path / "bom.jsonl").write_bytes(codecs.BOM_UTF8 + b"".join(_alpaca_lines(5)))
    (tmp_path / "bom.json").write_bytes(
        codecs.BOM_UTF8 + json.dumps([{"instruction": f"json task {i}"} for i in range(3)]).encode()
    )
    manifest, _ = _prepared(
        tmp_path, {"format": "alpaca", "files": [str(tmp_path / "bom.jsonl"), str(tmp_path / "bom.json")]}
    )
    assert manifest["rows_out"] == 8 and manifest["drops"] == {}


def test_invalid_utf8_is_one_counted_drop_with_its_location(tmp_path: Path) -> None:
    lines = _alpaca_lines(10)
    lines[3] = b'{"instruction": "caf\xe9 au lait"}\n'  # latin-1 byte inside a UTF-8 file
    lines[5] = b'{"instruction": "half a pair \\ud83d here"}\n'  # valid JSON, but no UTF-8 text holds it
    lines[6] = b'{"instruction": "a pair \\ud83d\\ude00 and a backslash \\\\ud800"}\n'  # both fine
    (tmp_path / "bad.jsonl").write_bytes(b"".join(lines))
    items = [{"instruction": f"json task {i}"} for i in range(6)]
    raw = json.dumps(items).encode().replace(b"json task 2", b"json task \xff\xfe")
    (tmp_path / "bad.json").write_bytes(raw)
    plan = _plan(tmp_path, {"s": {"category": "c", "format": "alpaca", "files": [str(tmp_path / "bad.*")]}})
    assert plan.sources["s"].planned_rows == 16  # the plan counts rows without decoding them whole
    manifest = prepare.run(planned(plan, "prepare", "s"))
    assert manifest["rows_out"] == 13
    assert manifest["drops"] == {prepare.drops.DROP_INVALID_UTF8: 3}
    examples = manifest["drop_examples"][prepare.drops.DROP_INVALID_UTF8]
    assert any(e.startswith(f"{tmp_path / 'bad.jsonl'}:4: ") for e in examples)
    assert any(e.startswith(f"{tmp_path / 'bad.jsonl'}:6: ") and "surrogate" in e for e in examples)
    assert any(e.startswith(f"{tmp_path / 'bad.json'}:item 2") for e in examples)


def test_role_mapping_keys_are_case_folded_like_speaker_names(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "in.jsonl",
        [{"conversations": [{"from": "Narrator", "value": f"Once upon a time {i}"}]} for i in range(4)],
    )
    manifest, rows = _prepared(tmp_path, {"format": "sharegpt", "files": [str(path)], "roles": {"Narrator": "user"}})
    assert manifest["rows_out"] == 4 and all(r["messages"][0]["role"] == "user" for r in rows)


# -- loud failure ---------------------------------------------------------------------------------------
def test_a_source_that_loses_too_many_rows_fails_naming_the_cause_and_the_key(tmp_path: Path) -> None:
    rows = [{"conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(6)]
    rows += [{"conversations": [{"from": "Wizard", "value": f"w{i}"}]} for i in range(4)]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    plan = _plan(tmp_path, {"s": {"category": "c", "format": "sharegpt", "files": [str(path)]}})
    with pytest.raises(prepare.checks.SourceLossError) as err:
        prepare.run(planned(plan, "prepare", "s"))
    message = str(err.value)
    assert "sources.s" in message and "4 of 10 rows (40.0%)" in message
    assert "unknown_role: 4 rows, e.g." in message and f"{path}:7" in message
    assert "sources.s.roles" in message and "sources.s.max_drop_fraction" in message
    assert not plan.prompt_shards("s")[0].exists(), "nothing is published"
    # the override is the documented way to accept it
    plan = _plan(
        tmp_path / "ok", {"s": {"category": "c", "format": "sharegpt", "files": [str(path)], "max_drop_fraction": 0.5}}
    )
    assert prepare.run(planned(plan, "prepare", "s"))["rows_out"] == 6


def test_a_source_whose_first_rows_are_all_defects_fails_at_planning(tmp_path: Path) -> None:
    """A wrong mapping (here: alpaca fields on prompt rows) is found from one batch, before any job."""
    path = write_jsonl(tmp_path / "in.jsonl", [{"question": f"q{i}"} for i in range(30)])
    source = {"category": "c", "format": "alpaca", "files": [str(path)]}
    plan = _plan(tmp_path, {"s": source})
    with pytest.raises(prepare.checks.SourceLossError) as err:
        prepare.checks.check_sample(plan, "s", rows=20)
    found = f"the first 20 rows are all dropped for defects (missing_field: 20, e.g. {path}:1"
    assert f"sources.s ({path}): {found}" in str(err.value)
    assert "sources.s.fields" in str(err.value)
    mapped = _plan(tmp_path / "mapped", {"s": {**source, "format": "prompt", "fields": {"prompt": "question"}}})
    prepare.checks.check_sample(mapped, "s", rows=20)  # one good row is enough
    good_later = write_jsonl(tmp_path / "later.jsonl", [{"question": "q"}] * 5 + [{"instruction": "a task"}])
    prepare.checks.check_sample(_plan(tmp_path / "later", {"s": {**source, "files": [str(good_later)]}}), "s", rows=20)
    allowed = _plan(tmp_path / "allowed", {"s": {**source, "max_drop_fraction": 1.0}})
    prepare.checks.check_sample(allowed, "s", rows=20)


def test_a_source_with_no_usable_row_fails_even_when_drops_are_allowed(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [{"instruction": "   "}, {"instruction": ""}])
    plan = _plan(
        tmp_path,
        {"s": {"category": "c", "format": "alpaca", "files": [str(path)]}},
        checks={"max_drop_fraction": 1.0},
    )
    with pytest.raises(prepare.checks.SourceLossError, match="yields no prompt at all"):
        prepare.run(planned(plan, "prepare", "s"))


def test_intended_drops_never_count_as_loss(tmp_path: Path) -> None:
    rows = [{"instruction": f"task {i % 3}"} for i in range(12)]  # 9 duplicates
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    plan = _plan(tmp_path, {"s": {"category": "c", "format": "alpaca", "files": [str(path)], "max_samples": 2}})
    manifest = prepare.run(planned(plan, "prepare", "s"))
    assert manifest["rows_out"] == 2 and manifest["drops"] == {"duplicate": 9, "over_max_samples": 1}


@pytest.mark.parametrize(
    "prose",
    [
        "within <tools> </tools> XML tags.",
        "within <tools></tools> XML tags.",
        "within <tools> XML tags.",  # an unclosed mention must not swallow the real block
        "in the block below.",
    ],
)
def test_hermes_tool_block_is_found_whatever_the_prose_says(prose: str) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    for block in (json.dumps(tools), repr(tools)):
        system = (
            f"You are a function calling AI model. You are provided with function signatures {prose}\n"
            f"<tools>\n{block}\n</tools>\nReturn <tool_call> tags."
        )
        row = {"conversations": [{"from": "system", "value": system}, {"from": "human", "value": "find it"}]}
        spec = SourceSpec(
            name="s", category="c", format="hermes", files=(), hf=None, fields={}, roles={}, max_samples=None,
            seed=0, min_chars=0, max_chars=None, sampling=Sampling(0.6, 0.95, 20, 0.0, 16, 0, 1),
            chat_template_kwargs={},
        )  # fmt: skip
        messages, found = inputs.to_prompt(row, spec)
        assert found == tools and messages == [{"role": "user", "content": "find it"}]


def test_the_demo_agent_rows_all_carry_their_tools(tmp_path: Path) -> None:
    demo = Path(__file__).resolve().parent.parent / "data" / "demo" / "agent.jsonl"
    manifest, rows = _prepared(tmp_path, {"format": "hermes", "files": [str(demo)]})
    assert manifest["drops"] == {} and rows
    assert all(r["tools"] and [m["role"] for m in r["messages"]] == ["user"] for r in rows)
