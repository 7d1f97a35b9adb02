"""Sampling variants (config ``variants``) through the real workflow on a Qwen3-style thinking template:
each prompt generated under the variant its id draws (or under every variant), every row saying its
variant and prompted as it says, one variant's edit regenerating that variant's rows only, cross-source
dedup within a variant, and the mix's and card's accounting."""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml
from transformers import AutoTokenizer

from dflash_build import config as cfg
from dflash_build import plan as plan_mod
from dflash_build.store import layout
from tests.conftest import REPO, Workflow, base_config, once_per_session, write_jsonl

pytestmark = pytest.mark.workflow

QWEN3_TEMPLATE = REPO / "tests" / "data" / "templates" / "qwen3-thinking.jinja"
# The tiny random model never closes the thinking block Qwen3's template opens (think variant): its answers
# are kept here, as the variants' accounting is under test, not the detector
RANDOM_THINKING = {"unclosed_reasoning": {"policy": "keep"}}
VARIANTS = {
    "think": {"share": 1, "sampling": {"temperature": 0.6}, "chat_template_kwargs": {"enable_thinking": True}},
    "fast": {"share": 1, "sampling": {"temperature": 0.9}, "chat_template_kwargs": {"enable_thinking": False}},
}


def _config(root: Path, tiny_model: Path) -> dict[str, Any]:
    shared = [{"instruction": f"Explain topic number {i} briefly."} for i in range(6)]
    write_jsonl(root / "a.jsonl", shared + [{"instruction": f"Write a short poem about item {i}."} for i in range(8)])
    write_jsonl(root / "b.jsonl", shared + [{"instruction": f"Summarise chapter {i} of a novel."} for i in range(8)])
    write_jsonl(root / "c.jsonl", [{"instruction": f"Translate sentence {i} into French."} for i in range(4)])
    sources = {
        "a": {"category": "chat", "format": "alpaca", "files": [str(root / "a.jsonl")]},
        "b": {"category": "chat", "format": "alpaca", "files": [str(root / "b.jsonl")]},
        # every prompt under both variants: its own table replaces the top level's
        "c": {
            "category": "chat",
            "format": "alpaca",
            "files": [str(root / "c.jsonl")],
            "variants": {
                name: {"every": True, **{k: v for k, v in s.items() if k != "share"}} for name, s in VARIANTS.items()
            },
        },
    }
    config = base_config(tiny_model, sources, variants=copy.deepcopy(VARIANTS), shard_size=16)
    config["model"]["chat_template"] = str(QWEN3_TEMPLATE)
    config["degenerate"] = RANDOM_THINKING
    config["dedup"] = {"prefer": ["a"]}
    config["checks"] = {"share_tolerance": 0.1}
    config["export"] = {"conversations": {}, "speculators": {}}
    return config


def _completions(plan: plan_mod.Plan, source: str) -> list[dict[str, Any]]:
    return [r for p in plan.completion_shards(source) for r in pq.read_table(p).to_pylist()]


def _stats(plan: plan_mod.Plan, source: str) -> dict[str, Any]:
    (shard,) = plan.completion_shards(source)
    return json.loads(layout.sidecar(shard).read_text())


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> tuple[Workflow, dict[str, Any], str]:

    def build(root: Path) -> None:
        wf = Workflow.at(root, _config(root, tiny_model))
        (root / "plan-before.txt").write_text(wf.cli("plan").stdout)
        wf.build()

    root = once_per_session(tmp_path_factory, "variants", build)
    wf = Workflow(root)
    return wf, yaml.safe_load((root / "config.yaml").read_text()), (root / "plan-before.txt").read_text()


def test_each_prompt_is_generated_under_its_variant_and_says_so(
    built: tuple[Workflow, dict[str, Any], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    wf, config, plan_before = built
    monkeypatch.chdir(wf.workdir)
    plan = plan_mod.build(cfg.load(wf.workdir / "config.yaml"))
    assert sorted(plan.sources) == ["a@fast", "a@think", "b@fast", "b@think", "c@fast", "c@think"]
    tok = AutoTokenizer.from_pretrained(config["model"]["path"])
    tok.chat_template = QWEN3_TEMPLATE.read_text()
    ids: dict[str, set[str]] = {}
    for name, sp in plan.sources.items():
        variant = sp.spec.variant
        assert variant is not None
        rows = _completions(plan, name)
        stats = _stats(plan, name)
        assert stats["variant"] == variant
        assert stats["components"]["sampling"]["temperature"] == VARIANTS[variant]["sampling"]["temperature"]
        prompts = {
            r["prompt_id"]: json.loads(r["messages"])
            for p in plan.prompt_shards(name)
            for r in pq.read_table(p).to_pylist()
        }
        ids[name] = set(prompts)
        for row in rows:
            assert row["variant"] == variant
            if row["finish_reason"] == "skipped":  # a copy of a's prompt, skipped before generation
                continue
            thinking = VARIANTS[variant]["chat_template_kwargs"]["enable_thinking"]
            expected = tok.apply_chat_template(
                prompts[row["prompt_id"]], tokenize=True, add_generation_prompt=True, enable_thinking=thinking
            )
            expected = expected if isinstance(expected, list) else expected["input_ids"]
            assert row["prompt_ids"] == list(expected), f"{name}: not prompted as {variant} says"
    # a and b split their prompts between the variants by prompt id; c has every prompt under both
    assert not ids["a@think"] & ids["a@fast"] and len(ids["a@think"] | ids["a@fast"]) == 14
    assert ids["c@think"] == ids["c@fast"] and len(ids["c@think"]) == 4
    # a prompt a and b both hold goes to the same variant in both (the draw is the prompt id's)
    shared_a = (ids["a@think"] | ids["a@fast"]) & (ids["b@think"] | ids["b@fast"])
    assert len(shared_a) == 6 and shared_a & ids["a@think"] <= ids["b@think"]
    assert "sampling variants, still to generate: fast " in plan_before and "think " in plan_before

    data = pq.read_table(wf.workdir / "dist" / "test-mix" / "data").to_pylist()
    by_variant = Counter((r["variant"], r["prompt_id"]) for r in data)
    assert max(by_variant.values()) == 1  # within a variant, each prompt once: b's copies of a's went
    per_prompt = Counter(r["prompt_id"] for r in data)
    assert all(per_prompt[p] == 2 for p in ids["c@think"])  # under two variants: two samples by design
    assert {r["variant"] for r in data if r["source"].startswith("c@")} == {"think", "fast"}
    copies = sum(_stats(plan, n).get("cross_source", 0) for n in ("b@think", "b@fast"))
    assert copies == 6  # b skipped a's prompts before generation, each under the variant it was drawn to

    manifest = json.loads((wf.workdir / "dist" / "test-mix" / "manifest.json").read_text())
    variants = manifest["variants"]
    assert set(variants) == {"think", "fast"}
    assert sum(v["prompts"] for v in variants.values()) == len({(r["variant"], r["prompt_id"]) for r in data})
    for name, v in variants.items():
        assert v["rows"] == sum(r["variant"] == name for r in data)
        assert v["drawn_share"] is not None and abs(v["achieved_share"] - v["drawn_share"]) <= 0.1
    for fmt in ("conversations", "speculators"):  # one prompt under two variants: two ids, each its variant's
        lines = [
            json.loads(x) for f in sorted((wf.workdir / "dist" / f"test-mix-{fmt}").rglob("*.jsonl")) for x in f.open()
        ]
        exported = [r["id"] for r in lines]
        assert len(exported) == len(set(exported)) == len(data)
        assert {f"{p}:0@{v}" for p in ids["c@think"] for v in ("think", "fast")} <= set(exported)
    card = (wf.workdir / "dist" / "test-mix" / "README.md").read_text()
    assert "## Sampling variants" in card
    assert f"| think | a@think, b@think, c@think | 50.0% | {variants['think']['drawn_share']:.1%} |" in card


def test_editing_one_variants_temperature_regenerates_that_variant_only(
    built: tuple[Workflow, dict[str, Any], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wf = built[0].copy_to(tmp_path / "copy")
    monkeypatch.chdir(wf.workdir)
    config = copy.deepcopy(built[1])
    before = plan_mod.build(cfg.load(wf.workdir / "config.yaml"))
    think_bytes = {n: [p.read_bytes() for p in before.completion_shards(n)] for n in ("a@think", "b@think")}
    config["variants"]["fast"]["sampling"]["temperature"] = 0.3
    wf.write_config(config)
    jobs = wf.dry_run()
    assert sorted(j["source"] for j in jobs["generate"]) == ["a@fast", "b@fast"]
    wf.build()
    after = plan_mod.build(cfg.load(wf.workdir / "config.yaml"))
    for name in ("a@fast", "b@fast"):
        stats = _stats(after, name)
        rows = _completions(after, name)
        assert stats["generated"] == sum(r["finish_reason"] != "skipped" for r in rows) > 0
    for name, data in think_bytes.items():
        assert after.completion_dir(name) == before.completion_dir(name)
        assert [p.read_bytes() for p in after.completion_shards(name)] == data


def test_a_new_draw_generates_only_the_prompts_that_moved_and_reuses_the_rest(
    built: tuple[Workflow, dict[str, Any], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shares are a config edit: the variants' prompt sets change, and a prompt that stays under its
    variant keeps its rows (the row index reuses rows across configs that sample alike), so only the
    prompts drawn to another variant than before are generated."""
    wf = built[0].copy_to(tmp_path / "copy")
    monkeypatch.chdir(wf.workdir)
    before = plan_mod.build(cfg.load(wf.workdir / "config.yaml"))
    old = {n: {r["prompt_id"] for r in _completions(before, n)} for n in ("a@think", "a@fast")}
    config = copy.deepcopy(built[1])
    config["variants"]["think"]["share"] = 2
    wf.write_config(config)
    wf.build()
    after = plan_mod.build(cfg.load(wf.workdir / "config.yaml"))
    moved = 0
    for name in ("a@think", "a@fast"):
        assert after.sources[name].prompt_key != before.sources[name].prompt_key
        rows = _completions(after, name)
        stats = _stats(after, name)
        stayed = {r["prompt_id"] for r in rows} & old[name]
        assert stats["reused"] == len(stayed) and stats["generated"] == len(rows) - len(stayed)
        moved += stats["generated"]
    assert moved > 0  # prompts moved from fast to think; think grew
    assert len(_completions(after, "a@think")) > len(old["a@think"])


def test_a_draw_that_leaves_a_small_sources_variant_empty_is_a_selection_not_a_failure(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One prompt, two variants: the draw gives it to one of them. The other variant generates nothing, and
    plan, prepare and the mix take that as the selection it is (it failed both before)."""
    write_jsonl(tmp_path / "one.jsonl", [{"instruction": "Name one prime number."}])
    write_jsonl(tmp_path / "many.jsonl", [{"instruction": f"Describe animal number {i}."} for i in range(6)])
    sources = {
        "one": {"category": "chat", "format": "alpaca", "files": [str(tmp_path / "one.jsonl")]},
        "many": {"category": "chat", "format": "alpaca", "files": [str(tmp_path / "many.jsonl")]},
    }
    config = base_config(tiny_model, sources, variants=copy.deepcopy(VARIANTS), shard_size=16)
    config["model"]["chat_template"] = str(QWEN3_TEMPLATE)
    config["degenerate"] = RANDOM_THINKING
    config["checks"] = {"share_tolerance": 0.5}
    wf = Workflow.at(tmp_path / "w", config)
    planned = wf.cli("plan", check=False)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert "every one of its" not in planned.stdout + planned.stderr
    built = wf.build()
    said = built.stdout + built.stderr
    assert "the variant draw gave this variant none of its 1 prompts (other_variant 1)" in said, said[-3000:]
    monkeypatch.chdir(wf.workdir)  # the config's store is relative to its working directory
    plan = plan_mod.build(cfg.load(wf.workdir / "config.yaml"))
    rows = {name: sum(pq.read_metadata(p).num_rows for p in plan.completion_shards(name)) for name in plan.sources}
    assert sorted(rows[f"one@{v}"] for v in VARIANTS) == [0, 1], rows
    manifest = json.loads((wf.workdir / "dist" / "test-mix" / "manifest.json").read_text())
    assert sum(manifest["sources"][f"one@{v}"]["rows"] for v in VARIANTS) == 1
