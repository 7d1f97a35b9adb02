"""The mix forecast `plan` prints before any GPU time (issue 39): the mix's own targets over the tokens
every prompt would give, from lengths measured where the store has them and assumed where it has none."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from dflash_build import config as cfg
from dflash_build import plan as plan_mod
from dflash_build.ops import estimate, forecast
from dflash_build.stages.common.targets import category_targets
from tests.conftest import Workflow, base_config, write_jsonl


def _plan(tmp_path: Path, tiny_model: Path, **mix_settings: object) -> plan_mod.Plan:
    sources = {}
    for name, category, rows in (("long", "coding", 30), ("short", "agent", 10)):
        data = write_jsonl(tmp_path / f"{name}.jsonl", [{"instruction": f"{name} task {i}"} for i in range(rows)])
        sources[name] = {"category": category, "files": [str(data)], "format": "alpaca"}
    raw = base_config(tiny_model, sources, store=str(tmp_path / "store"), logs=str(tmp_path / "logs"))
    raw["mix"] = {"categories": {"coding": 0.8, "agent": 0.2}, **mix_settings}
    raw["sources"]["long"]["sampling"] = {"max_new_tokens": 400}
    raw["sources"]["short"]["sampling"] = {"max_new_tokens": 40}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    return plan_mod.build(cfg.load(tmp_path / "c.yaml"))


def test_before_anything_is_built_the_forecast_assumes_half_the_budget_and_names_the_binding_category(
    tmp_path: Path, tiny_model: Path
) -> None:
    plan = _plan(tmp_path, tiny_model)
    _, _, got = estimate.estimate_with_disk(plan, default_tokens_per_second=100.0)
    assert set(got.bases.values()) == {forecast.ASSUMED}
    by = {c.category: c for c in got.categories}
    assert by["coding"].expected_tokens == 30 * 200 and by["agent"].expected_tokens == 10 * 20
    # agent's 200 tokens back a 20% share of 1000; coding's 6000 are cut to 800
    targets = category_targets({"coding": 0.8, "agent": 0.2}, {"coding": 6000, "agent": 200}, None)
    assert by["coding"].target_tokens == pytest.approx(targets["coding"]) == pytest.approx(800)
    assert [c.category for c in got.categories if c.binds] == ["agent"]
    assert got.left_out_tokens == pytest.approx(5200)
    assert got.left_out_gpu_hours == pytest.approx(5200 / 100 / 3600)
    assert "binding: agent (taken whole)" in got.lines()[0] and "5200 of 6200 tokens (84%)" in got.lines()[0]


def test_with_a_budget_the_budget_binds(tmp_path: Path, tiny_model: Path) -> None:
    plan = _plan(tmp_path, tiny_model, budget_tokens=500)
    _, _, got = estimate.estimate_with_disk(plan)
    assert sum(c.target_tokens for c in got.categories) == pytest.approx(500)
    assert not any(c.binds for c in got.categories) and "binding: mix.budget_tokens" in got.lines()[0]


def test_a_categorys_need_is_split_by_weight_capped_at_each_sources_supply() -> None:
    from dflash_build.stages.size import Supply, shards_needed

    supplies = [
        Supply("big", "c", shards=20, built=1, samples_per_shard=4, tokens_per_sample=25),  # 100 a shard
        Supply("small", "c", shards=2, built=1, samples_per_shard=4, tokens_per_sample=25),
        Supply("scarce", "d", shards=5, built=1, samples_per_shard=4, tokens_per_sample=10),  # 200 in all
    ]
    shards, targets = shards_needed({"c": 0.5, "d": 0.5}, None, supplies, part=1.0)
    assert targets == {"c": 200, "d": 200} and shards["scarce"] == 5, "d binds: taken whole"
    # by supply: big 2000 of 2200, small 200: 182 and 18 tokens, so 2 shards and 1 (its built one)
    assert shards == {"big": 2, "small": 1, "scarce": 5}
    weighted = [Supply(**{**s.__dict__, "weight": 1.0}) if s.category == "c" else s for s in supplies]
    shards, _ = shards_needed({"c": 0.5, "d": 0.5}, None, weighted, part=1.0)
    assert shards["big"] == 1 and shards["small"] == 1, "equal weights: 100 tokens each"
    # a weight asking more than a source holds takes it whole and moves the rest to the others
    heavy = [Supply(**{**s.__dict__, "weight": 10.0 if s.source == "small" else 1.0}) for s in supplies]
    shards, _ = shards_needed({"c": 0.5, "d": 0.5}, 600, heavy, part=1.0)
    assert shards["small"] == 2 and shards["big"] == 1


def test_an_oversampled_category_is_sized_to_its_factor_and_plan_prices_the_difference(
    tmp_path: Path, tiny_model: Path
) -> None:
    """mix.by_acceptance.CATEGORY.oversample (as_needed): the sizing asks for that multiple of the target,
    capped at the supply, in the size jobs' params only where set; the forecast prices the extra shards."""
    from dflash_build.stages import size
    from dflash_build.stages.size import Supply, shards_needed

    supplies = [
        Supply("code", "c", shards=20, built=1, samples_per_shard=4, tokens_per_sample=25),  # 100 a shard
        Supply("scarce", "d", shards=5, built=1, samples_per_shard=4, tokens_per_sample=10),  # 200 in all
    ]
    plain, targets = shards_needed({"c": 0.5, "d": 0.5}, None, supplies, part=1.0)
    assert targets["c"] == 200 and plain["code"] == 2
    more, same = shards_needed({"c": 0.5, "d": 0.5}, None, supplies, part=1.0, oversample={"c": 1.5})
    assert more["code"] == 3 and same == targets, "1.5 x 200 tokens: 3 shards of 100; the targets stay"
    whole, _ = shards_needed({"c": 0.5, "d": 0.5}, None, supplies, part=1.0, oversample={"c": 50.0})
    assert whole["code"] == 20, "capped at the supply"

    base = _plan(tmp_path / "a", tiny_model, generate="as_needed")
    over = _plan(
        tmp_path / "b", tiny_model, generate="as_needed", by_acceptance={"coding": {"fraction": 0.5, "oversample": 2}}
    )
    assert "oversample" not in size.params(base.config), "a config without it keeps its sizing's params"
    assert size.params(over.config)["oversample"] == {"coding": 2.0}
    assert over.config.mix_by_acceptance["coding"].mix_params() == {"fraction": 0.5, "pool": 4.0}
    _, _, plain_forecast = estimate.estimate_with_disk(base, 100)
    _, _, got = estimate.estimate_with_disk(over, 100)
    (extra,) = got.oversampled.values()
    k_plain, k_over = plain_forecast.as_needed["long"][0], got.as_needed["long"][0]
    # long: 30 prompts in 8 shards at the assumed 200 answer tokens (a mean of 3.75 rows a shard)
    assert k_over > k_plain and extra.shards == k_over - k_plain
    assert extra.rows == pytest.approx(extra.shards * 30 / 8) and extra.answer_tokens == pytest.approx(extra.rows * 200)
    line = next(x for x in got.lines() if x.startswith("oversampling"))
    assert f"+{extra.shards} shards" in line and f"{extra.answer_tokens / 100 / 3600:.2f} GPU-hours" in line
    assert not plain_forecast.oversampled and not any(x.startswith("oversampling") for x in plain_forecast.lines())


def test_oversampling_is_refused_where_every_prompt_is_generated(tmp_path: Path, tiny_model: Path) -> None:
    with pytest.raises(cfg.ConfigError, match=r"mix.by_acceptance.coding.oversample.*as_needed only"):
        _plan(tmp_path, tiny_model, by_acceptance={"coding": {"fraction": 0.5, "oversample": 2}})


def test_the_size_stage_sizes_each_round_from_the_shards_its_job_declares(tmp_path: Path, tiny_model: Path) -> None:
    """size.run on the pilot's token sidecars, then on the first round's: the rule's two checkpoints."""
    from dflash_build.stages import size
    from dflash_build.stages.registry import planned
    from dflash_build.store import atomic, layout

    plan = _plan(tmp_path, tiny_model, generate="as_needed")  # long: 8 shards of 4 prompts, short: 3
    assert plan.sources["long"].n_shards == 8 and plan.sources["short"].n_shards == 3

    def measured(source: str, shard: str, tokens_per_sample: int) -> None:
        path = layout.shard_file(plan.token_dir(source), shard)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_json(layout.sidecar(path), {"rows_out": 4, "tokens": 4 * tokens_per_sample})

    measured("long", "00000", 100)  # the pilot: coding 8 x 400, agent 3 x 80 -> agent binds
    measured("short", "00000", 20)
    first = planned(plan, "size", round_=1)
    assert [p.name for p in first.inputs["tokens"]] == ["00000.parquet", "00000.parquet"]
    record = size.run(first)
    # agent binds at 240 tokens, so coding's target is 960; the first round asks for 60%: 2 shards of 400
    assert record["round"] == 1 and record["shards"] == {"long": 2, "short": 3}
    assert record["targets"] == {"coding": 960, "agent": 240}
    measured("long", "00001", 50)  # the pilot overestimated: the first round's second shard is shorter
    for shard in ("00001", "00002"):
        measured("short", shard, 20)
    second = planned(plan, "size", round_=2)
    assert len(second.inputs["tokens"]) == 5, "the shards the first round named"
    record = size.run(second)
    # long measures 75 a sample, 300 a shard: 960 x 1.03 needs 4 shards; short is whole
    assert record["round"] == 2 and record["shards"] == {"long": 4, "short": 3}
    assert json.loads(Path(layout.sizing_file(plan.config.logs, "test-mix", 2)).read_text()) == record
    mix_job = planned(plan, "mix")
    assert [(p.parent.parent.name, p.stem) for p in mix_job.inputs["tokens"]] == [
        *(("long", f"{i:05d}") for i in range(4)),
        *(("short", f"{i:05d}") for i in range(3)),
    ], "the mix declares the shards the top-up names"


@pytest.mark.workflow
def test_plan_forecasts_the_share_check_the_build_then_fails_and_the_fix_it_names(
    operated_store: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Issue 71: a category whose target is under half a sample still takes one, so a small dataset's
    shares move by whole samples. `plan` says so before any GPU time (on mean lengths), the build then
    fails the same check, `plan` on the built shards says exactly what the mix says, and the tolerance it
    names lets the build through."""
    wf = Workflow(operated_store[0]).copy_to(tmp_path / "w")
    config = copy.deepcopy(operated_store[1])
    write_jsonl(wf.workdir / "code.jsonl", [{"instruction": "Write a function that reverses a list in place."}])
    config["sources"]["code"] = {"category": "coding", "files": ["code.jsonl"], "format": "alpaca"}
    config["mix"] = {"categories": {"general": 0.98, "coding": 0.02}}
    config["checks"] = {"share_tolerance": 0.02}
    wf.write_config(config)

    before = wf.cli("plan").stdout
    assert "warning: at these mean lengths the mix's checks would fail:" in before, before
    assert "category 'general' reaches" in before, before

    failed = wf.run(check=False)
    assert failed.returncode != 0
    log = (wf.workdir / "logs" / "dist" / "test-mix.log").read_text()
    said = re.search(r"  - (category 'general' reaches .*)", log)
    assert said, log

    after = wf.cli("plan").stdout
    assert "warning: on the built token shards the mix's checks would fail:" in after, after
    assert f"  - {said.group(1)}" in after.splitlines(), "plan says what the mix said, word for word"

    tolerance = re.search(r"checks\.share_tolerance: ([0-9.]+)", said.group(1))
    assert tolerance, said.group(1)
    config["checks"] = {"share_tolerance": float(tolerance.group(1))}
    wf.write_config(config)
    assert "mix checks: every category within" in wf.cli("plan").stdout
    wf.build()
    assert (wf.workdir / "dist" / "test-mix" / "manifest.json").exists()
