"""Same key, same rows: a shard built fresh equals the shard built through reuse, continuation and resume.

Real workflow, tiny model on the transformers backend, random small configs (seeded). The model stops
often and runs out often, so reuse whole, cut, continuation and context skips all happen.
"""

from __future__ import annotations

import copy
import json
import random
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow.parquet as pq
import pytest

from dflash_build import config as cfg
from dflash_build import configfile
from dflash_build import plan as plan_mod
from dflash_build import workflow as workflow_mod  # not `workflow`: snakemake's validate reads that global
from dflash_build.spec import ModelSpec
from dflash_build.stages.common import chat
from tests.conftest import TOOLS_TEMPLATE, Workflow, base_config, write_jsonl

SHORT = 4  # max_new_tokens of the first build
LONG = 12  # ... of the build that reuses and continues it


def _gen_dir(workdir: Path) -> Path:
    """The completion shards of the last build (the store also holds earlier builds' shards)."""
    manifest = json.loads((workdir / "dist" / "test-mix" / "manifest.json").read_text())
    return workdir / "store" / "completions" / "s" / manifest["sources"]["s"]["gen_key"]


def _rows(workdir: Path) -> dict[tuple[str, int], tuple[Any, ...]]:
    rows = {}
    for path in _gen_dir(workdir).glob("*.parquet"):
        for r in pq.read_table(path).to_pylist():
            rows[(r["prompt_id"], r["sample_idx"])] = (r["finish_reason"], r["output_ids"], r["stop_token_id"])
    return rows


def _stats(workdir: Path) -> dict[str, int]:
    total: dict[str, int] = {}
    for path in _gen_dir(workdir).glob("*.stats.json"):
        for k in ("reused", "continued", "generated", "skipped", "input_rows"):
            total[k] = total.get(k, 0) + json.loads(path.read_text())[k]
    return total


def _config(root: Path, model: Path, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega"]
    # mostly short prompts, one long one that only fits the context with SHORT new tokens
    sizes = [rng.choice([2, 3, 4]) for _ in range(9)] + [30]
    prompts = [" ".join(rng.choice(words) for _ in range(n)) + f" #{i}" for i, n in enumerate(sizes)]
    data = write_jsonl(root / "data" / "p.jsonl", [{"instruction": p} for p in prompts])
    config = base_config(model, {"s": {"category": "c", "files": [str(data)], "format": "alpaca"}})
    config["sampling"].update(
        temperature=rng.choice([0.7, 1.0]), top_k=rng.choice([0, 50]), seed=rng.randint(0, 99), samples_per_prompt=2
    )
    config["shard_size"] = 5  # two shards of five prompts (ten rows each)
    config["checks"]["max_failed_fraction"] = 1.0  # context skips are part of what is compared here
    # the longest prompt fits with SHORT new tokens but not with LONG: reuse must skip it like a fresh build
    tok = chat.load_tokenizer(ModelSpec(str(model), None, None, str(TOOLS_TEMPLATE), {}))
    lengths = [len(chat.render(tok, [{"role": "user", "content": p}], None, {})) for p in prompts]
    config["model"]["context_length"] = max(lengths) + SHORT
    assert min(lengths) + LONG <= max(lengths) + SHORT, "the random prompts must differ in length"
    return config


def _build(root: Path, config: dict[str, Any], max_new_tokens: int, **run: Any) -> subprocess.CompletedProcess[str]:
    root.mkdir(parents=True, exist_ok=True)
    wf = Workflow(root)
    config = copy.deepcopy(config)
    config["sampling"]["max_new_tokens"] = max_new_tokens
    wf.write_config(config)
    return wf.run(**run)


@pytest.mark.workflow
@pytest.mark.parametrize("seed", [0, 1])
def test_fresh_equals_reused_continued_and_resumed_row_for_row(tmp_path: Path, stoppy_model: Path, seed: int) -> None:
    config = _config(tmp_path, stoppy_model, seed)
    _build(tmp_path / "fresh", config, LONG)
    fresh = _rows(tmp_path / "fresh")
    assert any(r[0] == "skipped" for r in fresh.values()) and any(r[0] == "stop" for r in fresh.values())

    grown = tmp_path / "grown"
    _build(grown, config, SHORT)
    _build(grown, config, LONG)
    assert _rows(grown) == fresh
    stats = _stats(grown)
    assert stats["continued"] > 0 and stats["reused"] > 0, stats  # the invariant was really exercised

    resumed = tmp_path / "resumed"
    proc = _build(resumed, config, LONG, check=False, env_extra={"DFLASH_BUILD_KILL_AT": "rows:3"})
    assert proc.returncode != 0  # the first run died mid-shard, after 3 journaled rows
    _build(resumed, config, LONG)
    assert _rows(resumed) == fresh


def test_a_job_whose_key_moved_since_planning_fails_before_any_work(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_jsonl(tmp_path / "p.jsonl", [{"instruction": "one task"}])
    raw = base_config(tiny_model, {"s": {"category": "c", "files": [str(data)], "format": "alpaca"}})
    raw["store"] = str(tmp_path / "store")
    planned = plan_mod.build(cfg.from_dict(_validated(raw, tmp_path)))
    plan_mod.record_components(planned)  # as the Snakefile does when it plans
    changed = copy.deepcopy(raw)
    changed["sampling"]["temperature"] = 0.5  # the config file was edited while the workflow ran
    monkeypatch.setattr(chat, "load_tokenizer", lambda *a: pytest.fail("the job loaded a tokenizer"))
    sp = planned.sources["s"]
    smk = SimpleNamespace(
        config=_validated(changed, tmp_path),
        log=[str(tmp_path / "job.log")],
        wildcards=SimpleNamespace(source="s", key=sp.gen_key, shard="00000"),
        params=SimpleNamespace(),
        input=SimpleNamespace(prompts=str(tmp_path / "manifest.json")),
        output=SimpleNamespace(data=str(tmp_path / "x.parquet"), stats=str(tmp_path / "x.json")),
    )
    with pytest.raises(workflow_mod.KeyMismatchError) as err:
        workflow_mod.run_rule(smk, "generate")
    message = str(err.value)
    assert sp.gen_key in message and "sampling.temperature: 0.8 → 0.5" in message


def _validated(raw: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    raw = copy.deepcopy(raw)
    configfile.fill_defaults(raw)
    return raw
