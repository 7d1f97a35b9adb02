"""config/config.yaml itself, every source, through the real workflow.

Two substitutions, and only these (README, "Production rehearsal"):
1. each hub source's `hf.path` points at its upstream-shaped fixture folder in tests/data/upstream
   (same layout, card configs, columns and quirks; a few dozen rows);
2. the model is the tiny random-weight test model (its eos ids make answers short) and the engine is
   the transformers backend on CPU.
Everything else (sampling, shard size, truncation policy, mix shares, checks) is the production config.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import REPO, TOOLS_TEMPLATE, Workflow, once_per_session, shared_engine

pytestmark = pytest.mark.workflow

UPSTREAM = REPO / "tests" / "data" / "upstream"
HUB_FIXTURES = {
    "nvidia/Nemotron-Post-Training-Dataset-v2": "nemotron-post-training-v2",
    "sahil2801/CodeAlpaca-20k": "code-alpaca-20k",
    "BAAI/Infinity-Instruct": "infinity-instruct",
    "NousResearch/hermes-function-calling-v1": "hermes-function-calling-v1",
    "bigcode/self-oss-instruct-sc2-exec-filter-50k": "self-oss-instruct-sc2-exec-filter-50k",
    "nebius/SWE-rebench-openhands-trajectories": "swe-rebench-openhands-trajectories",
}
# decontaminate's reference sets: stand-ins of the same layout (nothing of the benchmarks ships)
REFERENCE_FIXTURES = {
    "openai/gsm8k": "gsm8k",
    "HuggingFaceH4/MATH-500": "math-500",
    "openai/openai_humaneval": "openai-humaneval",
    "google-research-datasets/mbpp": "mbpp",
    "HuggingFaceH4/mt_bench_prompts": "mt-bench-prompts",
}
PINNED = "0123456789abcdef0123456789abcdef01234567"


def production_config() -> dict[str, Any]:
    return yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def variant_sources(config: dict[str, Any]) -> dict[str, tuple[str, float]]:
    """The sources the config builds, as docs/configuration.md states the expansion: each source under
    each of its variants (its own table, else the top level's) as SOURCE@VARIANT, with the variant's
    part of its prompts (its share over the table's shares); a source without variants as itself."""
    out = {}
    for name, source in config["sources"].items():
        table = source["variants"] if source.get("variants") is not None else config.get("variants") or {}
        total = sum(v.get("share", 0) for v in table.values())
        for variant, v in table.items():
            out[f"{name}@{variant}"] = (name, 1.0 if v.get("every") else v["share"] / total)
        if not table:
            out[name] = (name, 1.0)
    return out


def substitute(config: dict[str, Any], model: Path) -> dict[str, Any]:
    config = copy.deepcopy(config)
    # a few dozen rows a source: the draw's and the mix's cut's noise in a variant's share is several
    # times production's tolerance, which is sized for thousands of prompts
    for variant in config.get("variants", {}).values():
        variant["tolerance"] = 0.5
    for name, source in config["sources"].items():
        hub = source["hf"]["path"]
        assert hub in HUB_FIXTURES, f"source {name}: add an upstream-shaped fixture for {hub}"
        source["hf"]["path"] = str(UPSTREAM / HUB_FIXTURES[hub])
    for name, reference in config["decontaminate"]["references"].items():
        hub = reference["hf"]["path"]
        assert hub in REFERENCE_FIXTURES, f"reference set {name}: add a stand-in for {hub}"
        reference["hf"]["path"] = str(UPSTREAM / REFERENCE_FIXTURES[hub])
    config["model"]["path"] = str(model)
    config["engine"] = shared_engine(model, batch_size=16)
    return config


@pytest.fixture(scope="module")
def rehearsal_model(stoppy_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The short-answer tiny model, with a chat template that renders tools as its own."""
    import shutil

    out = tmp_path_factory.mktemp("rehearsal-model") / "model"
    shutil.copytree(stoppy_model, out)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = TOOLS_TEMPLATE.read_text()
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (out / "chat_template.jinja").unlink(missing_ok=True)  # newer tokenizers save it beside the config
    (out / "chat_template.jinja").write_text(TOOLS_TEMPLATE.read_text())
    return out


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory: pytest.TempPathFactory, rehearsal_model: Path) -> tuple[Workflow, dict[str, Any]]:
    work = tmp_path_factory.mktemp("rehearsal")
    wf = Workflow(work)
    config = substitute(production_config(), rehearsal_model)
    wf.write_config(config)
    return wf, config


def test_production_config_plans_every_shard_of_every_source(
    tmp_path: Path, rehearsal_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`snakemake -n` and `dflash-build plan` on the real hub sources, revisions pinned, nothing loaded: the
    pilot round as the production config has it (mix.generate as_needed), every shard under `all`."""
    from dflash_build import cli

    config = production_config()
    assert config["mix"]["generate"] == "as_needed"
    config["model"]["path"] = str(rehearsal_model)  # the 27B weights are not here; keys need files
    for source in [*config["sources"].values(), *config["decontaminate"]["references"].values()]:
        source["hf"]["revision"] = PINNED
    wf = Workflow(tmp_path)
    monkeypatch.chdir(tmp_path)
    for generate in ("as_needed", "all"):
        config["mix"]["generate"] = generate
        path = wf.write_config(config)
        expected = {
            (name, f"{i:05d}")
            for name, (parent, part) in variant_sources(config).items()
            for i in range(
                math.ceil(math.ceil(config["sources"][parent]["max_samples"] * part) / config["shard_size"])
                if generate == "all"
                else 1
            )
        }
        jobs = wf.dry_run()
        assert {(j["source"], j["shard"]) for j in jobs["generate"]} == expected, generate
        assert {(j["source"], j["shard"]) for j in jobs["tokenize"]} == expected
        assert ("size_pilot" in jobs) is (generate == "as_needed")
        assert {k for k in jobs if k.startswith("prepare_")} == {
            f"prepare_{n.replace('-', '_').replace('@', '_')}" for n in variant_sources(config)
        }
        capsys.readouterr()
        assert cli.main(["--configfile", str(path), "plan", "--jobs"]) == 0
        out = capsys.readouterr().out
        listed = {tuple(line.split()[1].split("/")) for line in out.splitlines() if line.startswith("generate ")}
        assert listed == expected, generate
        assert "binding:" in out and "would be left out by the mix" in out
        assert "sampling variants, still to generate: (no variant) " in out and "; thinking " in out


def _shards(wf: Workflow, stage: str, parent: str) -> list[Path]:
    """The shards of a source under every variant it has."""
    folders = [p for p in (wf.workdir / "store" / stage).iterdir() if p.name.split("@")[0] == parent]
    return [p for folder in folders for p in folder.rglob("0*.parquet")]


def test_rehearsal_dry_run_lists_every_shard(rehearsal: tuple[Workflow, dict[str, Any]]) -> None:
    from dflash_build import config as config_mod
    from dflash_build import plan as plan_mod

    wf, config = rehearsal
    jobs = wf.dry_run()
    plan = plan_mod.build(config_mod.load(wf.workdir / "config.yaml"))
    expected = {(name, shard) for name, sp in plan.sources.items() for shard in sp.shards}
    assert {(j["source"], j["shard"]) for j in jobs["generate"]} == expected
    assert {s for s, _ in expected} == set(variant_sources(config))


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory: pytest.TempPathFactory, rehearsal: tuple[Workflow, dict[str, Any]]) -> Workflow:
    """The rehearsal built, once per session: its tests read it or copy it."""

    def build(root: Path) -> None:
        Workflow.at(root, rehearsal[1]).build()

    return Workflow(once_per_session(tmp_path_factory, "rehearsal", build))


def test_rehearsal_builds_every_source_with_tools_and_shares(
    rehearsal: tuple[Workflow, dict[str, Any]], rehearsed: Workflow
) -> None:
    import datasets

    wf, config = rehearsed, rehearsal[1]
    dist = wf.workdir / config["dataset"]["out"] / config["dataset"]["name"]
    manifest = json.loads((dist / "manifest.json").read_text())
    for name, (parent, _) in variant_sources(config).items():
        prepared = json.loads(next((wf.workdir / "store" / "prompts" / name).rglob("manifest.json")).read_text())
        # No defect drops. The one planted benchmark question (gsm8k's stand-in holds a Nemotron math prompt)
        # goes, no other row does; the fixtures' templated prompts are near-copies of one another in part.
        drops = prepared["drops"]
        # (each variant of a source runs its selection and keeps the prompts drawn to it)
        assert prepared["rows_out"] > 0 and set(drops) <= {"near_duplicate", "contaminated", "other_variant"}, drops
        assert drops.get("contaminated", 0) == (1 if parent == "nemotron-math" else 0), (name, drops)
        assert all(": near-copy of " in e for e in prepared["drop_examples"].get("near_duplicate", []))
        assert set(prepared["references"]) == set(config["decontaminate"]["references"])
        tokenized = sum(
            pq.read_metadata(p).num_rows for p in (wf.workdir / "store" / "tokens" / name).rglob("0*.parquet")
        )
        assert tokenized > 0, f"{name} gives samples"
    # every category reaches the dataset; at a few dozen rows a category's target is a handful of samples,
    # and which of its sources give them is the mix's seeded rank (swe-rebench-openhands' are long)
    assert {c for c, cat in manifest["mix"]["categories"].items() if cat["rows"]} == set(config["mix"]["categories"])
    # tool rows carry their schemas, and the template showed them to the model
    for name in ("hermes-function-calling", "hermes-glaive"):
        prompts = [r for p in _shards(wf, "prompts", name) for r in pq.read_table(p).to_pylist()]
        with_tools = [r for r in prompts if r["tools"]]
        assert len(with_tools) >= 9
        for r in with_tools:
            assert "<tools>" not in r["messages"], "the dataset's own preamble is replaced by the template's"
    # hermes-glaive runs turns: all under qwen3_coder: the tiny model never calls, so every conversation
    # whose dataset called at its first turn ends there, counted; the card says so
    calling = [
        r
        for p in _shards(wf, "prompts", "hermes-glaive")
        for r in pq.read_table(p).to_pylist()
        if r["tools"] and json.loads(r["messages"])[1].get("tool_calls")
    ]
    turns = [
        s["generation"]["turns"] for n, s in manifest["report"]["by_source"].items() if n.startswith("hermes-glaive@")
    ]
    assert len(turns) == 2 and sum(t["tool_call_mismatch"] for t in turns) == len(calling) > 0, turns
    assert sum(t["tool_calls_matched"] for t in turns) == 0
    assert "| tool calls matched | ended on a tool-call mismatch |" in (dist / "README.md").read_text()
    # swe-rebench-openhands runs history: source: every assistant step of a trajectory regenerated on its
    # own history, whatever the tiny model called; the tool schemas as a server sends them (no nulls)
    trajectories = {
        r["prompt_id"]: r
        for p in (wf.workdir / "store" / "prompts" / "swe-rebench-openhands").rglob("0*.parquet")
        for r in pq.read_table(p).to_pylist()
    }
    assert trajectories and all("null" not in r["tools"] for r in trajectories.values())
    for p in (wf.workdir / "store" / "completions" / "swe-rebench-openhands").rglob("0*.parquet"):
        for row in pq.read_table(p).to_pylist():
            messages = json.loads(trajectories[row["prompt_id"]]["messages"])
            assert len(row["turns"]) == sum(m["role"] == "assistant" for m in messages) >= 2, row["error"]
    ds = datasets.load_dataset(str(dist), split="train")
    assert len(ds) == manifest["rows"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(config["model"]["path"])
    # every row of a source with variants says which; the thinking-only agent source's say none
    assert set(manifest["variants"]) == {"thinking", "direct"}
    assert {r["variant"] for r in ds if "@" in r["source"]} == {"thinking", "direct"}
    assert all(r["variant"] is None for r in ds if "@" not in r["source"])
    agent_rows = [r for r in ds if r["source"].startswith("hermes-function-calling@")]
    assert agent_rows and all("<tools>" in tok.decode(r["input_ids"]) for r in agent_rows)
    tolerance = config["checks"]["share_tolerance"]
    total_share = sum(config["mix"]["categories"].values())
    for category, c in manifest["mix"]["categories"].items():
        target = config["mix"]["categories"][category] / total_share
        assert abs(c["achieved_share"] - target) <= tolerance, (category, c)
    assert wf.dry_run() == {}


def test_loading_the_folder_always_gives_the_current_build(
    rehearsal: tuple[Workflow, dict[str, Any]], rehearsed: Workflow, tmp_path: Path
) -> None:
    import datasets

    config = rehearsal[1]
    wf = rehearsed.copy_to(tmp_path / "work")
    dist = wf.workdir / config["dataset"]["out"] / config["dataset"]["name"]
    before = datasets.load_dataset(str(dist), split="train")
    changed = copy.deepcopy(config)
    changed["mix"]["seed"] = 7  # another selection of the same samples
    wf.write_config(changed)
    wf.build()
    after = datasets.load_dataset(str(dist), split="train")
    manifest = json.loads((dist / "manifest.json").read_text())
    current = pq.read_table(sorted((dist / "data").glob("*.parquet"))).to_pylist()
    assert len(after) == manifest["rows"] == len(current)
    assert [(r["prompt_id"], r["sample_idx"]) for r in after] == [(r["prompt_id"], r["sample_idx"]) for r in current]
    assert [(r["prompt_id"], r["sample_idx"]) for r in after] != [(r["prompt_id"], r["sample_idx"]) for r in before]
