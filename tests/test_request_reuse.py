"""GPU time goes only to requests no engine has answered (issue 58): a row is reused whenever the engine
would be asked the same thing (the model, its numerics, the prompt's token ids, the sampling with the row's
seed), whatever re-keyed it: a template edit no prompt uses, a scheme bump, an edit that changes some
prompts (only those regenerate). ``plan`` counts the same before any GPU time, and the dataset after
reuse is the fresh build's, row for row."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import TOOLS_TEMPLATE, Workflow, base_config, copy_workflow, once_per_session, write_jsonl

pytestmark = pytest.mark.workflow

TOPICS = ["rivers", "stars", "bread", "chess", "glass", "wind", "salt", "ink"]
PLAIN = [{"instruction": f"Write two words about {t}.", **({"system": "Be brief."} if i % 2 else {})}
         for i, t in enumerate(TOPICS)]  # fmt: skip
CHATS = [
    {"messages": [
        {"role": "user", "content": f"Name a {thing}."},
        {"role": "assistant", "content": "One."},
        {"role": "user", "content": "And another?"},
        {"role": "assistant", "content": "Two."},
    ]}
    for thing in ("fruit", "colour", "tree", "bird")
]  # fmt: skip
# template edits: the tool preamble (no prompt has tools), a system turn's end, every turn after the second
UNUSED = ("You may call one or more functions", "You may call any of these functions")
SYSTEM = (
    "'<|im_start|>system\\n' + message['content'] + '<|im_end|>\\n'",
    "'<|im_start|>system\\n' + message['content'] + '\\n<|im_end|>\\n'",
)
LATER_TURNS = (
    "'<|im_start|>' + message['role'] + '\\n' + message['content']",
    "'<|im_start|>' + message['role'] + ('\\n' if loop.index0 < 2 else ':\\n') + message['content']",
)


def request_config(root: Path, model: Path) -> dict[str, Any]:
    write_jsonl(root / "data" / "plain.jsonl", PLAIN)
    write_jsonl(root / "data" / "chats.jsonl", CHATS)
    template = root / "data" / "template.jinja"
    shutil.copy2(TOOLS_TEMPLATE, template)
    data = root / "data"
    sources = {
        "plain": {"category": "general", "format": "alpaca", "files": [str(data / "plain.jsonl")]},
        "chats": {"category": "chat", "format": "messages", "files": [str(data / "chats.jsonl")], "turns": "all"},
    }
    config = base_config(model, sources, shard_size=8)
    config["model"]["chat_template"] = str(template)
    config["checks"]["allow_shortfall"] = True
    return config


@pytest.fixture(scope="module")
def built_once(tmp_path_factory: pytest.TempPathFactory, stoppy_model: Path) -> Path:
    def build(root: Path) -> None:
        Workflow.at(root / "work", request_config(root, stoppy_model)).build()

    return once_per_session(tmp_path_factory, "request-reuse", build)


@pytest.fixture
def built(built_once: Path, tmp_path: Path) -> Workflow:
    """This test's copy of the build (its store and a template of its own to edit); the inputs stay where
    they were (moved, Snakemake would prepare them again for the new paths)."""
    wf = Workflow(built_once / "work").copy_to(tmp_path / "work")
    config = yaml.safe_load((wf.workdir / "config.yaml").read_text())
    template = tmp_path / "template.jinja"
    shutil.copy2(config["model"]["chat_template"], template)
    config["model"]["chat_template"] = str(template)
    wf.write_config(config)
    return wf


def edit_template(wf: Workflow, *edits: tuple[str, str]) -> None:
    template = Path(yaml.safe_load((wf.workdir / "config.yaml").read_text())["model"]["chat_template"])
    text = template.read_text()
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    template.write_text(text)


def generation(wf: Workflow) -> dict[str, dict[str, int]]:
    """Each source's accounting in the build's own completion shards (the ones its dataset names)."""
    manifest = json.loads((wf.workdir / "dist" / "test-mix" / "manifest.json").read_text())
    out: dict[str, dict[str, int]] = {}
    for source, entry in manifest["sources"].items():
        folder = wf.workdir / "store" / "completions" / source / entry["gen_key"]
        for stats in (json.loads(p.read_text()) for p in folder.glob("*.stats.json")):
            for k in ("input_rows", "generated", "reused", "continued", "reused_across_settings", "resumed_turns"):
                out.setdefault(source, {}).setdefault(k, 0)
                out[source][k] += stats[k]
    return out


def planned_rows(wf: Workflow) -> dict[str, tuple[int, int]]:
    """What ``dflash-build plan`` says each source's jobs reuse and generate."""
    return {e["source"]: (e["rows_reused"], e["rows_to_generate"]) for e in json.loads(wf.cli("plan", "--json").stdout)}


def samples(wf: Workflow) -> dict[tuple[str, int, Any], tuple[Any, ...]]:
    """The dataset's samples by (prompt, sample, turn): its ids, mask and finish reason."""
    out = {}
    for path in sorted((wf.workdir / "dist" / "test-mix" / "data").glob("*.parquet")):
        for r in pq.read_table(path).to_pylist():
            out[(r["prompt_id"], r["sample_idx"], r["turn"])] = (r["input_ids"], r["loss_mask"], r["finish_reason"])
    return out


def fresh(wf: Workflow, tmp_path: Path) -> Workflow:
    """The same config built on an empty store."""
    again = Workflow.at(tmp_path / "fresh", yaml.safe_load((wf.workdir / "config.yaml").read_text()))
    again.build()
    return again


def test_a_template_edit_no_prompt_uses_re_keys_but_generates_nothing(built: Workflow, tmp_path: Path) -> None:
    """The probe of the issue (a template gaining tool-call lines no prompt uses regenerated 37 of 37
    rows): the keys tell what changed (the dry run lists every generate job), the jobs generate nothing."""
    before = samples(built)
    edit_template(built, UNUSED)
    assert {j["source"] for j in built.dry_run()["generate"]} == {"plain", "chats"}, "the template is in gen_key"
    assert planned_rows(built) == {"plain": (8, 0), "chats": (4, 0)}
    done = built.build()
    assert "reused across settings: 12 rows whose requests did not change (chats 4, plain 8)" in done.stdout
    counts = generation(built)
    assert counts["plain"] == {"input_rows": 8, "generated": 0, "reused": 8, "continued": 0,
                               "reused_across_settings": 8, "resumed_turns": 0}  # fmt: skip
    assert counts["chats"]["generated"] == 0 and counts["chats"]["reused_across_settings"] == 4
    assert samples(built) == before == samples(fresh(built, tmp_path)), "the dataset a fresh build makes"


def test_a_template_edit_regenerates_exactly_the_rows_whose_prompts_it_changed(built: Workflow, tmp_path: Path) -> None:
    """A system turn rendered otherwise: the four plain prompts with a system column change, the four
    without and every conversation (none has one) do not. plan says so first; the dataset is a fresh build's."""
    edit_template(built, SYSTEM)
    assert planned_rows(built) == {"plain": (4, 4), "chats": (4, 0)}
    built.build()
    counts = generation(built)
    assert (counts["plain"]["generated"], counts["plain"]["reused"]) == (4, 4)
    assert (counts["chats"]["generated"], counts["chats"]["reused"]) == (0, 4)
    assert samples(built) == samples(fresh(built, tmp_path))


def test_a_conversation_is_reused_only_as_far_as_its_turns_requests_are_the_same(
    built: Workflow, tmp_path: Path
) -> None:
    """Every turn after the second written otherwise: each conversation's first turn is the same request
    (reused), its second is not (generated); a single-turn prompt is untouched."""
    edit_template(built, LATER_TURNS)
    planned = planned_rows(built)
    built.build()
    counts = generation(built)
    assert counts["plain"]["generated"] == 0 and planned["plain"] == (8, 0)
    # per conversation: its first turn taken (its row says where from), its second generated; one whose first
    # answer did not stop ended there (nothing to generate: plan counts it reused)
    shards = (built.workdir / "store" / "completions" / "chats").glob("*/*.parquet")
    rows = [r for p in shards for r in pq.read_table(p).to_pylist() if r["reused_from"]]
    went_on = sum(r["turns"][0]["finish_reason"] == "stop" for r in rows)
    assert len(rows) == 4 and counts["chats"]["generated"] == sum(len(r["turns"]) - 1 for r in rows) == went_on
    assert planned["chats"] == (4 - went_on, went_on), "plan counts what the build then does"
    assert samples(built) == samples(fresh(built, tmp_path))


def test_a_scheme_bump_that_changes_no_request_generates_nothing(built: Workflow, tmp_path: Path) -> None:
    """PREP_VERSION and GEN_VERSION bumped (as a code change that changes what the stages write would):
    every key moves, prepare runs again, and under which every prompt renders as before no row, single-turn
    or turns: all, is generated again."""
    code = copy_workflow(tmp_path / "code")
    versions = code / "dflash_build" / "versions.py"
    text = versions.read_text()
    for name in ("PREP_VERSION", "GEN_VERSION"):
        text = re.sub(rf"^{name} = (\d+)", lambda m, n=name: f"{n} = {int(m.group(1)) + 1}", text, flags=re.M)
    versions.write_text(text)
    bumped = Workflow(built.workdir, snakefile=code / "Snakefile", pythonpath=code)
    jobs = bumped.dry_run()
    assert {"prepare_plain", "prepare_chats", "generate"} <= set(jobs)
    bumped.build()
    counts = generation(bumped)
    assert counts["plain"]["generated"] == counts["chats"]["generated"] == 0
    assert counts["plain"]["reused_across_settings"] == 8 and counts["chats"]["reused_across_settings"] == 4
