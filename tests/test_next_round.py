"""The next round, named with its cost (issue 70): for a weak slice, the prompts the dataset does not hold,
the config change that takes them, and what generating them costs, as `dflash-build plan` counts it once
the change is applied; the change, built, takes them."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from dflash_build import config as config_mod
from dflash_build import plan as plan_mod
from dflash_build.ops import nextround
from dflash_build.publish import acceptance, release
from tests.conftest import Workflow, write_jsonl

CODE_ROWS = [{"instruction": f"Write a function that returns the number {i} squared."} for i in range(12)]


def _edit(config: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(config)
    for dotted, value in change.items():
        *parents, last = dotted.split(".")
        node = out
        for part in parents:
            node = node[part]
        node[last] = value
    return out


def _prompts(dataset: Path, source: str) -> int:
    table = pq.read_table(release.in_place(dataset).files[0].parent, columns=["source", "prompt_id"])
    return len(
        {p for s, p in zip(table["source"].to_pylist(), table["prompt_id"].to_pylist(), strict=True) if s == source}
    )


def test_the_weight_that_takes_a_category_whole_is_the_least_that_makes_it_bind() -> None:
    from dflash_build.stages.common.targets import binds, category_targets

    supply = {"coding": 9000.0, "general": 4000.0, "math": 1000.5}
    weights = {"coding": 46.0, "general": 26.0, "math": 11.0}  # weights as written, not shares
    w = nextround._whole(weights, None, supply, "coding")
    assert w is not None and w == nextround._round_up(w) and len(f"{w:g}".replace(".", "").lstrip("0")) <= 3

    def targets(weight: float) -> dict[str, float]:
        shares = {**weights, "coding": weight}
        total = sum(shares.values())
        return category_targets({c: v / total for c, v in shares.items()}, {c: int(v) for c, v in supply.items()}, None)

    assert binds(targets(w)["coding"], supply["coding"]) and not binds(targets(w * 0.99)["coding"], supply["coding"])
    w = nextround._whole(weights, 12_000, supply, "coding")
    assert w is not None and w / (w + 37) * 12_000 >= supply["coding"] > 0.99 * w / (w + 37) * 12_000
    assert nextround._whole(weights, 8000, supply, "coding") is None, "a budget below the supply"
    assert nextround._whole(weights, None, {**supply, "coding": 10.0}, "coding") == 46.0, "binds already: its weight"


@pytest.mark.workflow
def test_the_next_rounds_change_costs_what_plan_says_and_takes_the_prompts(
    operated_store: tuple[Path, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wf = Workflow(operated_store[0]).copy_to(tmp_path / "w")
    config = copy.deepcopy(operated_store[1])
    write_jsonl(wf.workdir / "code.jsonl", CODE_ROWS)
    config["sources"]["code"] = {"category": "coding", "files": ["code.jsonl"], "format": "alpaca", "max_samples": 5}
    config["mix"] = {"categories": {"general": 0.5, "coding": 0.5}}
    wf.write_config(config)
    wf.build()  # 5 code prompts generated; coding binds, so the mix leaves some of general's 20 out
    dataset = wf.workdir / "dist" / "test-mix"
    monkeypatch.chdir(wf.workdir)  # the config's paths are relative to it
    plan = plan_mod.build(config_mod.load("config.yaml"))
    assert _prompts(dataset, "objs") < 20 and _prompts(dataset, "code") == 5

    weak = [("category", "general"), ("source", "code"), ("language", "en")]
    general, code, language = nextround.rows(nextround.next_round(plan, weak, dataset))

    # general: prompts generated and left out; the change costs no GPU time
    assert general["left_out_prompts"] == {"objs": 20 - _prompts(dataset, "objs")} and not general["over_max_samples"]
    [(key, change)] = general["change"].items()
    assert key == "mix.categories.general" and change["from"] == 0.5 and change["to"] > 0.5
    assert general["rows_to_generate"] == 0 and general["gpu_hours"] == 0

    # code: 7 prompts past max_samples; the change lifts it and raises coding's weight
    assert code["left_out_prompts"] == {"code": 0} and code["over_max_samples"] == {"code": 7}
    assert code["change"]["sources.code.max_samples"] == {"from": 5, "to": None}
    assert code["rows_to_generate"] == 7 and code["answer_tokens"] > 0 and code["gpu_hours"] > 0
    assert language["note"] and not language["change"], "a language slice is no set of prompts one edit takes"
    lines = acceptance.nextround_lines([general, code, language])
    assert any(li.startswith("| source=code | 0 | 7 | `sources.code.max_samples: 5 → null`") for li in lines), lines
    assert "assumption, not a measurement" in lines[-1]
    print("\n".join(lines))  # docs/acceptance.md shows this table

    # plan with the code change applied says the same rows, answer tokens and GPU-hours
    changed = _edit(config, {k: c["to"] for k, c in code["change"].items()})
    wf.write_config(changed)
    [estimate] = [e for e in json.loads(wf.cli("plan", "--json").stdout) if e["source"] == "code"]
    assert estimate["rows_to_generate"] == code["rows_to_generate"]
    assert round(estimate["output_tokens"]) == code["answer_tokens"]
    assert round(estimate["gpu_hours"], 4) == code["gpu_hours"]
    wf.build()
    assert _prompts(dataset, "code") == 12, "the change took every code prompt"

    # general's change, against the config it was named for, takes every prompt generated before and
    # generates nothing (the code rows past max_samples stay in the store, unread)
    wf.write_config(_edit(config, {k: c["to"] for k, c in general["change"].items()}))
    plan_text = wf.cli("plan").stdout
    assert "total: 0 generate jobs" in plan_text, plan_text
    wf.build()
    assert _prompts(dataset, "objs") == 20 - sum(general["degenerate_rows"].values()), "every prompt but a degenerate"
