"""The rules declare what the planner plans: every job a dry run lists has exactly the inputs and outputs
``stages.registry.planned`` gives for it (the rules' input functions call the planner; this holds them
to it), on the production config (pilot round and every shard) and the demo's (pack and exports)."""

from __future__ import annotations

import contextlib
import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from dflash_build import config as config_mod
from dflash_build import plan as plan_mod
from dflash_build.stages.registry import planned
from dflash_build.store import layout
from tests.conftest import REPO, Workflow, smollm2_gguf
from tests.test_production_rehearsal import PINNED, production_config

pytestmark = pytest.mark.workflow

_JOB = re.compile(r"^(?:local)?(?:rule|checkpoint) (\S+):$")


def dry_run_jobs(text: str) -> list[dict[str, Any]]:
    """Each job of a dry run: its rule, wildcards, inputs and outputs as Snakemake prints them."""
    jobs: list[dict[str, Any]] = []
    for line in text.splitlines():
        stripped = line.strip()
        if match := _JOB.match(stripped):
            jobs.append({"rule": match.group(1), "wildcards": {}, "input": set(), "output": set()})
        elif jobs and (field := stripped.partition(":")[0]) in ("input", "output", "wildcards"):
            items = [p.strip() for p in stripped.partition(":")[2].split(", ") if p.strip()]
            if field == "wildcards":
                jobs[-1]["wildcards"] = dict(item.partition("=")[::2] for item in items)
            else:
                jobs[-1][field] = {item.removesuffix(" (update)") for item in items}
    return [j for j in jobs if j["rule"] != "all"]


def planned_paths(plan: plan_mod.Plan, job: dict[str, Any]) -> tuple[set[str], set[str]]:
    """(inputs, outputs) the planner gives the dry run's job. Shards a sizing checkpoint decides are, until
    it has run, "<TBD>", as Snakemake lists them."""
    rule, wildcards = job["rule"], job["wildcards"]
    prepares = {layout.prepare_rule_name(s): s for s in plan.sources}
    cfg = plan.config
    if rule in prepares:
        found = planned(plan, "prepare", source=prepares[rule])
    elif rule.startswith("size_"):
        found = planned(plan, "size", round_=layout.SIZING_ROUNDS[rule != "size_pilot"])
    else:
        found = planned(plan, rule, **{k: wildcards.get(k) for k in ("source", "shard", "fmt")})
    # before the pilot's sizing exists, the top-up and the mix wait on a checkpoint for their shards
    waits = rule in ("size_topup", "mix") and cfg.mix_generate == "as_needed"
    sized = Path(layout.sizing_file(cfg.logs, cfg.dataset_name, layout.SIZING_ROUNDS[0])).exists()
    inputs = {str(p) for paths in found.inputs.values() for p in paths} | ({"<TBD>"} if waits and not sized else set())
    return inputs, {str(p) for paths in found.outputs.values() for p in paths}


def assert_rules_declare_the_plan(wf: Workflow, *targets: str) -> set[str]:
    """Every job of the workdir's dry run (of ``targets``, else the default) against its planned job; the
    rules seen."""
    jobs = dry_run_jobs(wf.run("-n", *targets).stdout)
    with contextlib.chdir(wf.workdir):  # the config's relative paths, as Snakemake reads them
        plan = plan_mod.build(config_mod.load(wf.workdir / "config.yaml"))
        for job in jobs:
            declared, made = planned_paths(plan, job)
            assert job["input"] == declared, (job["rule"], job["wildcards"], job["input"] ^ declared)
            assert job["output"] == made, (job["rule"], job["wildcards"], job["output"] ^ made)
    return {j["rule"] for j in jobs}


@pytest.mark.parametrize("generate", ["as_needed", "all"])
def test_the_production_rules_declare_what_the_planner_plans(tmp_path: Path, tiny_model: Path, generate: str) -> None:
    config = production_config()
    config["model"]["path"] = str(tiny_model)  # the 27B weights are not here; keys need files
    for source in [*config["sources"].values(), *config["decontaminate"]["references"].values()]:
        source["hf"]["revision"] = PINNED  # planned from hub ids and commits: nothing is loaded
    config["mix"]["generate"] = generate
    rules = assert_rules_declare_the_plan(Workflow.at(tmp_path, config))
    assert {"generate", "tokenize"} <= rules and any(r.startswith("prepare_") for r in rules)
    assert ("size_pilot" in rules) is (generate == "as_needed")
    assert {"mix", "export"} <= rules or generate == "as_needed", rules


def demo_config() -> dict[str, Any]:
    config = copy.deepcopy(yaml.safe_load((REPO / "config" / "demo.yaml").read_text()))
    config["model"]["path"] = str(smollm2_gguf())
    config["model"]["chat_template"] = str(REPO / config["model"]["chat_template"])
    for source in config["sources"].values():
        source["files"] = [str(REPO / f) for f in source["files"]]
    return config


def test_the_demo_rules_declare_what_the_planner_plans(tmp_path: Path) -> None:
    rules = assert_rules_declare_the_plan(Workflow.at(tmp_path, demo_config()))
    assert {"generate", "tokenize", "mix", "pack", "export"} <= rules, rules


def test_the_eval_split_and_accept_rules_declare_what_the_planner_plans(tmp_path: Path) -> None:
    config = demo_config()
    config["eval"] = {"share": 0.2, "cap": 2}
    config["engine"] = {"backend": "vllm", "options": {"device": "cpu"}}
    config["accept"] = {"drafters": {"ngram": {"method": "ngram", "options": {"num_speculative_tokens": 3}}}}
    wf = Workflow.at(tmp_path, config)
    rules = assert_rules_declare_the_plan(wf, "accept")
    assert {"prepared", "mix", "evalset", "accept"} <= rules, rules
    # a build makes the eval split; acceptance needs a speculative server: only on request
    rules = assert_rules_declare_the_plan(wf)
    assert "evalset" in rules and "accept" not in rules, rules
