"""Formats, counted drops, dedup, order-independent selection and sharding."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from dflash_build import config as cfg
from dflash_build import inputs
from dflash_build import plan as plan_mod
from dflash_build.spec import Sampling, SourceSpec
from dflash_build.stages import prepare
from dflash_build.stages.prepare import drops as D
from dflash_build.stages.registry import planned
from tests.conftest import write_jsonl

TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


def spec(fmt: str, **kw: Any) -> SourceSpec:
    sampling = Sampling(0.6, 0.95, 20, 0.0, 16, 0, 1)
    base: dict[str, Any] = {
        "name": "s",
        "category": "c",
        "format": fmt,
        "files": (),
        "hf": None,
        "fields": {},
        "roles": {},
        "max_samples": None,
        "seed": 0,
        "min_chars": 0,
        "max_chars": None,
        "sampling": sampling,
        "chat_template_kwargs": {},
    }
    base.update(kw)
    return SourceSpec(**base)


def test_sharegpt_keeps_the_conversation_up_to_the_first_assistant_turn() -> None:
    row = {
        "conversations": [
            {"from": "system", "value": "sys"},
            {"from": "human", "value": "q1"},
            {"from": "gpt", "value": "a1"},
            {"from": "human", "value": "q2"},
        ]
    }
    messages, tools = inputs.to_prompt(row, spec("sharegpt"))
    assert messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"}]
    assert tools is None


def test_messages_with_tools_and_field_mapping() -> None:
    row = {"chat": [{"speaker": "user", "text": "find x"}], "functions": json.dumps([TOOL["function"]])}
    s = spec("messages", fields={"messages": "chat", "role": "speaker", "content": "text", "tools": "functions"})
    messages, tools = inputs.to_prompt(row, s)
    assert messages == [{"role": "user", "content": "find x"}]
    assert tools == [TOOL]


def test_alpaca_and_prompt_formats() -> None:
    messages, _ = inputs.to_prompt({"instruction": "Do", "input": "this"}, spec("alpaca"))
    assert messages == [{"role": "user", "content": "Do\n\nthis"}]
    messages, _ = inputs.to_prompt({"q": "2+2?", "system": "math"}, spec("prompt", fields={"prompt": "q"}))
    assert messages == [{"role": "system", "content": "math"}, {"role": "user", "content": "2+2?"}]


@pytest.mark.parametrize(
    "tools_block",
    [json.dumps([TOOL]), json.dumps(TOOL["function"]) + "\n" + json.dumps(TOOL["function"])],
)
def test_hermes_takes_tools_from_the_system_prompt(tools_block: str) -> None:
    row = {
        "conversations": [
            {"from": "system", "value": f"You are a function caller. <tools> {tools_block} </tools> Use them."},
            {"from": "human", "value": "look it up"},
            {"from": "gpt", "value": "<tool_call>{}</tool_call>"},
        ]
    }
    messages, tools = inputs.to_prompt(row, spec("hermes"))
    assert messages == [{"role": "user", "content": "look it up"}]
    assert tools is not None and tools[0] == TOOL


def test_hermes_takes_tools_from_a_column() -> None:
    row = {"conversations": [{"from": "human", "value": "go"}], "tools": json.dumps([TOOL])}
    assert inputs.to_prompt(row, spec("hermes"))[1] == [TOOL]


@pytest.mark.parametrize(
    ("row", "fmt", "reason"),
    [
        (prepare.drops.Drop(D.DROP_MALFORMED), "sharegpt", D.DROP_MALFORMED),
        ([1, 2], "sharegpt", D.DROP_MALFORMED),
        ({"conversations": "text"}, "sharegpt", D.DROP_MALFORMED),
        ({"conversations": [{"from": "gpt", "value": "a"}]}, "sharegpt", D.DROP_NO_USER_TURN),
        ({"conversations": [{"from": "alien", "value": "a"}]}, "sharegpt", D.DROP_UNKNOWN_ROLE),
        ({"conversations": [{"from": "human", "value": "  "}]}, "sharegpt", D.DROP_EMPTY_CONTENT),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages", D.DROP_NON_STRING_CONTENT),
        ({"messages": [{"role": "user", "content": "x"}], "tools": "{bad"}, "messages", D.DROP_INVALID_TOOLS),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "messages",
            "invalid_tools",
        ),
        ({"text": "x"}, "alpaca", D.DROP_MISSING_FIELD),
        (
            {"conversations": [{"from": "system", "value": "<tools> {nope </tools>"}, {"from": "human", "value": "q"}]},
            "hermes",
            D.DROP_INVALID_TOOLS,
        ),
    ],
)
def test_bad_rows_are_dropped_with_a_reason(row: Any, fmt: str, reason: str) -> None:
    with pytest.raises(prepare.drops.Drop) as drop:
        inputs.to_prompt(row, spec(fmt))
    assert drop.value.reason == reason


def test_length_filters() -> None:
    with pytest.raises(prepare.drops.Drop, match=D.DROP_TOO_SHORT):
        inputs.to_prompt({"instruction": "hi"}, spec("alpaca", min_chars=5))
    with pytest.raises(prepare.drops.Drop, match=D.DROP_TOO_LONG):
        inputs.to_prompt({"instruction": "hello world"}, spec("alpaca", max_chars=5))


def test_extra_role_names_from_config() -> None:
    row = {"conversations": [{"from": "narrator", "value": "q"}]}
    assert inputs.to_prompt(row, spec("sharegpt", roles={"narrator": "user"}))[0][0]["role"] == "user"


def _plan_source(tmp_path: Path, files: list[str], shard_size: int = 4, **extra: Any) -> plan_mod.Plan:
    """The plan of one alpaca source ``s`` over ``files``; ``extra``: its settings, or top-level keys
    (``variants``) by name."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"gguf")
    top = {k: extra.pop(k) for k in ("variants",) if k in extra}
    raw = {
        "store": str(tmp_path / "store"),
        "shard_size": shard_size,
        "model": {"path": str(model)},
        "sources": {"s": {"category": "c", "format": "alpaca", "files": files, **extra}},
        "mix": {"categories": {"c": 1}},
        **top,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return plan_mod.build(cfg.load(path))


def _build_source(tmp_path: Path, files: list[str], **source: Any) -> tuple[plan_mod.Plan, dict[str, Any]]:
    plan = _plan_source(tmp_path, files, **source)
    return plan, prepare.run(planned(plan, "prepare", "s"))


def _shard_rows(plan: plan_mod.Plan) -> list[list[dict[str, Any]]]:
    return [pq.read_table(p).to_pylist() for p in plan.prompt_shards("s")]


def test_run_counts_every_drop_and_dedups(tmp_path: Path) -> None:
    rows = [{"instruction": f"task {i}"} for i in range(7)]
    rows += [{"instruction": "task  0 "}, {"instruction": "task 1"}, "{broken", {"instruction": ""}]
    write_jsonl(tmp_path / "in.jsonl", rows)
    plan, manifest = _build_source(tmp_path, [str(tmp_path / "in.jsonl")])
    assert manifest["rows_in"] == 11 and manifest["rows_out"] == 7
    assert manifest["drops"] == {"duplicate": 2, "empty_content": 1, "malformed_row": 1}
    assert manifest["rows_in"] == manifest["rows_out"] + sum(manifest["drops"].values())
    shards = _shard_rows(plan)
    assert [len(s) for s in shards] == [2, 2, 3]  # 11 raw rows plan 3 shards of 4; the 7 kept spread evenly
    ids = [r["prompt_id"] for s in shards for r in s]
    assert ids == sorted(ids) and len(set(ids)) == 7
    assert {k: v["rows"] for k, v in manifest["shards"].items()} == {"00000": 2, "00001": 2, "00002": 3}


def test_result_does_not_depend_on_row_or_file_order(tmp_path: Path) -> None:
    rows = [{"instruction": f"task {i}", "input": "x" * (i % 3)} for i in range(30)]
    rows += rows[:5]
    write_jsonl(tmp_path / "one" / "a.jsonl", rows[:20])
    write_jsonl(tmp_path / "one" / "b.jsonl", rows[20:])
    shuffled = list(rows)
    random.Random(7).shuffle(shuffled)
    write_jsonl(tmp_path / "two" / "a.jsonl", shuffled[:11])
    write_jsonl(tmp_path / "two" / "b.jsonl", shuffled[11:])
    results = []
    for variant in ("one", "two"):
        plan, manifest = _build_source(
            tmp_path / variant, [str(tmp_path / variant / "*.jsonl")], max_samples=12, seed=3
        )
        # (the prompt keys differ: they name the input files, which hold the rows differently)
        results.append([[r["prompt_id"] for r in s] for s in _shard_rows(plan)])
        assert manifest["drops"] == {"duplicate": 5, "over_max_samples": 18}
    assert results[0] == results[1]
    assert sum(len(s) for s in results[0]) == 12


def test_max_samples_choice_follows_the_seed(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "in.jsonl", [{"instruction": f"task {i}"} for i in range(40)])
    chosen = []
    for seed in (0, 1):
        plan, _ = _build_source(tmp_path / f"s{seed}", [str(tmp_path / "in.jsonl")], max_samples=10, seed=seed)
        chosen.append({r["prompt_id"] for s in _shard_rows(plan) for r in s})
    assert len(chosen[0]) == len(chosen[1]) == 10 and chosen[0] != chosen[1]


def test_parquet_input(tmp_path: Path) -> None:
    pq.write_table(pa.Table.from_pylist([{"instruction": f"p{i}"} for i in range(5)]), tmp_path / "in.parquet")
    plan, manifest = _build_source(tmp_path, [str(tmp_path / "in.parquet")])
    assert manifest["rows_out"] == 5 and plan.sources["s"].n_shards == 2


def test_hf_source_from_a_local_dataset_folder(tmp_path: Path) -> None:
    folder = tmp_path / "dataset"
    write_jsonl(folder / "train.jsonl", [{"instruction": f"hf {i}"} for i in range(6)])
    model = tmp_path / "model.gguf"
    model.write_bytes(b"gguf")
    raw = {
        "store": str(tmp_path / "store2"),
        "model": {"path": str(model)},
        "sources": {"s": {"category": "c", "format": "alpaca", "hf": {"path": str(folder)}, "max_samples": 5}},
        "mix": {"categories": {"c": 1}},
    }
    (tmp_path / "hf.yaml").write_text(yaml.safe_dump(raw))
    plan = plan_mod.build(cfg.load(tmp_path / "hf.yaml"))
    manifest = prepare.run(planned(plan, "prepare", "s"))
    assert manifest["rows_in"] == 6 and manifest["rows_out"] == 5
    assert manifest["drops"] == {"over_max_samples": 1}


def test_turns_all_keeps_every_turn_with_answers_emptied() -> None:
    row = {
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"name": "w"}]},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny."},
            {"role": "user", "content": "thanks"},
        ]
    }
    messages, _ = inputs.to_prompt(row, spec("messages", turns="all"))
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "user"]
    assert messages[1]["content"] == messages[3]["content"] == ""
    assert messages[2]["content"] == "sunny", "tool results are kept as they were"
    first, _ = inputs.to_prompt(row, spec("messages"))
    assert first == [{"role": "user", "content": "weather?"}]


def test_turns_all_needs_a_user_turn_before_the_first_answer() -> None:
    row = {"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "q"}]}
    with pytest.raises(prepare.drops.Drop, match=D.DROP_NO_USER_TURN):
        inputs.to_prompt(row, spec("sharegpt", turns="all"))


def _in_memory_reference(plan: plan_mod.Plan, source: str) -> tuple[list[list[dict[str, Any]]], dict[str, int]]:
    """Prepare's documented selection, done the obvious way with every record in memory: duplicates
    keep the smallest (prompt id, meta), max_samples the smallest seeded ranks, shards contiguous runs
    of prompt ids."""
    sp = plan.sources[source]
    kept: dict[str, dict[str, Any]] = {}
    drops: dict[str, int] = {}
    for raw in prepare.read.raw_rows(plan, source):
        try:
            messages, tools = inputs.to_prompt(raw.value, sp.spec)
        except prepare.drops.Drop as d:
            drops[d.reason] = drops.get(d.reason, 0) + 1
            continue
        record = {
            "prompt_id": prepare.identity.prompt_id(messages, tools),
            "source": source,
            "category": sp.spec.category,
            "messages": json.dumps(messages, ensure_ascii=False),
            "tools": None if tools is None else json.dumps(tools, ensure_ascii=False),
            "meta": json.dumps(raw.origin, sort_keys=True),
            "template_kwargs": None,  # the source reads none (chat_template_kwargs_from)
        }
        key = prepare.identity.dedup_key(messages, tools)
        if key in kept:
            drops["duplicate"] = drops.get("duplicate", 0) + 1
        if key not in kept or (record["prompt_id"], record["meta"]) < (kept[key]["prompt_id"], kept[key]["meta"]):
            kept[key] = record
    records = list(kept.values())
    if sp.spec.max_samples is not None and len(records) > sp.spec.max_samples:
        records.sort(key=lambda r: prepare.identity.selection_rank(sp.spec.seed, r["prompt_id"]))
        drops["over_max_samples"] = len(records) - sp.spec.max_samples
        records = records[: sp.spec.max_samples]
    records.sort(key=lambda r: r["prompt_id"])
    return [records[lo:hi] for lo, hi in prepare.identity.shard_bounds(len(records), sp.n_shards)], drops


@pytest.mark.parametrize(
    ("rows", "max_samples", "shard_size"),
    [(300, None, 7), (300, 40, 3), (300, 250, 50), (12, None, 1), (40, 5, 2)],
)
def test_streaming_prepare_equals_the_in_memory_selection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: int, max_samples: int | None, shard_size: int
) -> None:
    """Row for row, across many spill buckets and flushes: whitespace variants (one dedup group, several
    prompt ids), exact copies in two files (one prompt id, several metas), bad rows, and more shards
    than rows once the duplicates go."""
    monkeypatch.setattr(prepare.spill, "ROWS_PER_BUCKET", 8)
    monkeypatch.setattr(prepare.spill, "SPILL_FLUSH_ROWS", 3)
    rng = random.Random(rows)
    base = [{"instruction": f"task {rng.randrange(rows // 2)}", "input": rng.choice(["", "ctx"])} for _ in range(rows)]
    variants = [{**r, "instruction": r["instruction"].replace(" ", rng.choice([" ", "  ", " \t"]))} for r in base]
    write_jsonl(tmp_path / "in" / "a.jsonl", [*variants[: rows // 2], "{broken"])
    write_jsonl(tmp_path / "in" / "b.jsonl", [*variants[rows // 3 :], {"instruction": " "}])
    source = {"max_samples": max_samples, "seed": 5, "max_drop_fraction": 0.5}
    raw = {
        "store": str(tmp_path / "store"),
        "shard_size": shard_size,
        "model": {"path": str(tmp_path / "model.gguf")},
        "sources": {"s": {"category": "c", "format": "alpaca", "files": [str(tmp_path / "in" / "*.jsonl")], **source}},
        "mix": {"categories": {"c": 1}},
    }
    (tmp_path / "model.gguf").write_bytes(b"gguf")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    plan = plan_mod.build(cfg.load(tmp_path / "config.yaml"))
    manifest = prepare.run(planned(plan, "prepare", "s"))
    expected, expected_drops = _in_memory_reference(plan, "s")
    assert _shard_rows(plan) == expected
    assert manifest["drops"] == expected_drops
    assert manifest["rows_out"] == sum(len(s) for s in expected)
    assert len(manifest["drop_examples"]["duplicate"]) == prepare.drops.EXAMPLES_PER_REASON
    assert prepare.spill.bucket_count(plan.sources["s"].raw_rows or 0) > 1
    assert not list(plan.prompt_dir("s").glob(".spill-*")), "the spill is removed"
    assert prepare.selection.select(plan, "s").shard_prompt_ids() == {
        name: [r["prompt_id"] for r in shard] for name, shard in zip(plan.sources["s"].shards, expected, strict=True)
    }


def test_group_firsts_are_each_groups_smallest_prompt_id() -> None:
    """Against a dictionary, on keys whose first words tie often (as duplicates' do) and second words
    differ within a tie (as a 64-bit collision would)."""
    rng = np.random.default_rng(4)
    for _ in range(200):
        n = int(rng.integers(1, 400))
        keys = rng.integers(0, int(rng.integers(1, 20)), (n, 2)).astype(np.uint64)
        pids = rng.integers(0, 2**63, n, dtype=np.uint64)
        copies = rng.integers(0, n, n // 3)
        pids[rng.integers(0, n, len(copies))] = pids[copies]  # one prompt id: one key (the same messages)
        first_key: dict[int, tuple[int, int]] = {}
        for key, pid in zip(map(tuple, keys.tolist()), pids.tolist(), strict=True):
            first_key.setdefault(pid, key)
        keys = np.array([first_key[p] for p in pids.tolist()], dtype=np.uint64)
        smallest: dict[tuple[int, int], int] = {}
        for key, pid in zip(map(tuple, keys.tolist()), pids.tolist(), strict=True):
            smallest[key] = min(pid, smallest.get(key, pid))
        assert prepare.selection.group_firsts(keys, pids).tolist() == sorted(smallest.values())


def test_selection_ranks_are_the_documented_digests() -> None:
    pids = np.random.default_rng(2).integers(0, 2**64 - 1, 50, dtype=np.uint64)
    for seed in (0, 3, 12345678901, 7.0):
        expected = b"".join(bytes.fromhex(prepare.identity.selection_rank(seed, f"{int(p):016x}")[:32]) for p in pids)
        assert prepare.identity.selection_ranks(seed, pids) == expected


def test_prompt_ids_and_dedup_keys_are_the_content_keys_of_their_documented_bodies() -> None:
    """The per-row fast path hashes exactly what hashing.content_key/digest would (ids in stores stay valid)."""
    from dflash_build import hashing

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": 1.0, "t": (1, 2.5), "n": None}}}]
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "e\u0301  tab\tq "}]
    for t in (None, tools):
        assert prepare.identity.prompt_id(messages, t) == hashing.content_key({"messages": messages, "tools": t})
        folded = [{"role": "system", "content": "s"}, {"role": "user", "content": "\u00e9 tab q"}]
        assert prepare.identity.dedup_key(messages, t) == hashing.digest({"messages": folded, "tools": t})
        assert prepare.identity.dedup_key(folded, t)[: hashing.KEY_LENGTH] == prepare.identity.prompt_id(folded, t)


def _prepare_variants(tmp_path: Path, rows: list[dict[str, Any]], variants: dict[str, Any]) -> dict[str, list[str]]:
    """Prepare every variant source of one source: its prompt ids, by variant source."""
    write_jsonl(tmp_path / "in.jsonl", rows)
    plan = _plan_source(tmp_path, [str(tmp_path / "in.jsonl")], 8, variants=variants, max_samples=60)
    out = {}
    for name in plan.sources:
        manifest = prepare.run(planned(plan, "prepare", name))
        ids = [r["prompt_id"] for p in plan.prompt_shards(name) for r in pq.read_table(p).to_pylist()]
        assert manifest["rows_out"] == len(ids)
        assert manifest["rows_in"] == manifest["rows_out"] + sum(manifest["drops"].values())
        out[name] = ids
    return out


def test_variants_split_the_selection_by_prompt_id_and_every_takes_all(tmp_path: Path) -> None:
    """Each prompt of the parent's selection goes to the one variant its prompt id draws by share (the
    others count it as other_variant), every: true takes them all, and the draw is per prompt: adding
    rows and shuffling them moves no prompt to another variant."""
    rows = [{"instruction": f"task {i}"} for i in range(90)]
    variants = {"think": {"share": 3}, "fast": {"share": 1, "sampling": {"temperature": 0.7}}, "all": {"every": True}}
    first = _prepare_variants(tmp_path / "one", rows, variants)
    assert set(first) == {"s@think", "s@fast", "s@all"}
    think, fast, every = set(first["s@think"]), set(first["s@fast"]), set(first["s@all"])
    assert not think & fast and think | fast == every and len(every) == 60  # max_samples of the parent
    assert 0.6 < len(think) / len(every) < 0.9  # a 3:1 draw
    more = rows + [{"instruction": f"another task {i}"} for i in range(40)]
    random.Random(3).shuffle(more)
    second = _prepare_variants(tmp_path / "two", more, variants)
    # the parent's selection changes with the input; a prompt both keep stays under its variant
    both = set(second["s@all"]) & every
    assert both and set(second["s@think"]) & both == think & both
    assert set(second["s@fast"]) & both == fast & both


def test_a_variant_the_draw_leaves_empty_is_a_selection_said_in_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its prompts went to its sibling: no defect (it failed prepare before), and the warning says so."""
    rows = [{"instruction": f"task {i}"} for i in range(3)]
    with caplog.at_level(logging.WARNING):
        drawn = _prepare_variants(tmp_path, rows, {"big": {"share": 1000}, "tiny": {"share": 0.0001}})
    assert len(drawn["s@big"]) == 3 and drawn["s@tiny"] == []
    assert "the variant draw gave this variant none of its 3 prompts (other_variant 3)" in caplog.text
    # a variant emptied by defects is still one: the draw does not hide them
    bad = [{"instruction": f"task {i}"} for i in range(3)] + [{"no": "instruction"}] * 3
    with pytest.raises(prepare.checks.SourceLossError, match="dropped for defects"):
        _prepare_variants(tmp_path / "bad", bad, {"big": {"share": 1000}, "tiny": {"share": 0.0001}})
