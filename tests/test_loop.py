"""The loop closed (issue 78): the build trains a drafter on its own dataset and measures it on the
held-out split, and the data moves acceptance.

The toy target (tests/toy_target.py: a tiny Qwen3 trained on its own templated chats, its weights in
tests/data/toy_target) answers two categories, math and prose, each with its own template. One store, two
datasets built by the workflow with opposite category mixes (80/20 and 20/80 by tokens), a drafter trained
on each by NeMo Automodel's own DFlash recipe (the `train` stage, in .venv-automodel), and `accept` on the
shared held-out split with vLLM's CPU server serving each trained drafter. Then a second round on the
math-leaning dataset: the next-round table's change for its weakest category applied, the drafter trained
again, `accept` again. Every figure is printed (docs/acceptance.md, "The loop", quotes them). It builds
from empty (one fixture, `loop`, once per session): its target is the toy, which no shared fixture
serves, and the datasets it trains on are what it proves.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from dflash_build.publish import release
from dflash_build.store import layout
from tests import toy_target
from tests.conftest import Workflow, base_config, once_per_session, parse_dry_run, shared_engine, write_jsonl

pytestmark = pytest.mark.workflow

PROMPTS = 240  # of each category, of the prompts the target was trained on (its answers are its templates)
DRAFT = 3
LEANS = {"math": {"math": 0.8, "prose": 0.2}, "prose": {"math": 0.2, "prose": 0.8}}
TRAIN = {
    "trainer": "automodel",
    "gpus": 0,
    "settings": {
        "recipe_args": {
            "mask_token_id": toy_target.SPECIAL_TOKENS.index(toy_target.MASK),
            "block_size": 4,
            "num_anchors": 16,
            "micro_batch_size": 4,
            "num_epochs": 2,
            "shuffle_seed": 0,
        },
        "optimizer": {"lr": 3e-3},
    },
}


def loop_config(root: Path, lean: str, automodel_python: Path) -> dict[str, Any]:
    """A dataset leaning to ``lean``, on the store every dataset of the test shares."""
    target = toy_target.COMMITTED
    data = root / "data"
    sources = {}
    for category in toy_target.CATEGORIES:
        rows = [{"instruction": p} for p in toy_target.prompts(category, PROMPTS, seed=0)]
        sources[category] = {
            "category": category,
            "format": "alpaca",
            "files": [str(write_jsonl(data / f"{category}.jsonl", rows))],
        }
    config = base_config(target, sources, engine=shared_engine(target, "vllm"))
    config["model"].pop("chat_template")  # the toy's own ChatML
    config["store"] = str(root / "store")
    config["dataset"]["name"] = f"lean-{lean}"
    config["sampling"] = {"temperature": 0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 48, "seed": 0}
    config["shard_size"] = 120
    config["mix"] = {"categories": dict(LEANS[lean])}
    config["checks"] = {"share_tolerance": 0.05}
    config["eval"] = {"share": 0.125, "cap": 30}
    config["train"] = {**TRAIN, "python": str(automodel_python)}
    drafter = {"method": "dflash", "trained": True, "options": {"num_speculative_tokens": DRAFT}}
    config["accept"] = {"drafters": {"trained": drafter}, "max_new_tokens": 48, "calibration": {"rows": 0}}
    return config


def _report(wf: Workflow, name: str) -> dict[str, Any]:
    return json.loads((wf.workdir / "dist" / f"{name}-acceptance" / layout.ACCEPTANCE_REPORT).read_text())


def _tau(report: dict[str, Any], category: str) -> float:
    return float(report["per_slice"]["trained"]["category"][category]["tau"])


def _trained(wf: Workflow, name: str) -> dict[str, Any]:
    version = release.current(wf.workdir / "dist" / f"{name}-drafter")
    assert version is not None
    return json.loads((version / layout.TRAINED_RECORD).read_text())


def _timed(steps: dict[str, float], step: str, run: Any) -> Any:
    started = time.monotonic()
    out = run()
    steps[step] = steps.get(step, 0.0) + time.monotonic() - started
    return out


def _apply(config: dict[str, Any], change: dict[str, Any]) -> None:
    """The next round's change (``{dotted key: {from, to}}``) applied to ``config``."""
    for key, value in change.items():
        *path, last = key.split(".")
        node = config
        for part in path:
            node = node[part]
        node[last] = value["to"]


def run_loop(root: Path, automodel_python: Path) -> None:
    """Both datasets built (one generation server), both drafters trained, both measured (a server each);
    then the second round on the math-leaning dataset."""
    seconds: dict[str, float] = {}
    results: dict[str, Any] = {"seconds": seconds}
    flows = {lean: Workflow.at(root / f"work-{lean}", loop_config(root, lean, automodel_python)) for lean in LEANS}
    env = {"OMP_NUM_THREADS": "1"}  # a drafter this small trains in seconds on one thread, minutes on two
    for lean, wf in flows.items():
        _timed(seconds, "build", lambda wf=wf: wf.run())
        results[f"{lean}_dataset"] = json.loads((wf.workdir / "dist" / f"lean-{lean}" / layout.MANIFEST).read_text())
    for lean, wf in flows.items():
        results[f"{lean}_plan_before"] = wf.cli("plan").stdout  # the second knows the first's training's rate
        _timed(seconds, "train", lambda wf=wf: wf.run("train", env_extra=env))
        results[f"{lean}_plan_after"] = wf.cli("plan").stdout
    for lean, wf in flows.items():
        _timed(seconds, "accept", lambda wf=wf: wf.run("accept", env_extra=env))
        results[lean] = {"report": _report(wf, f"lean-{lean}"), "trained": _trained(wf, f"lean-{lean}")}
    # the second round, on the math-leaning dataset: its weakest category's change, from its report
    wf = flows["math"]
    weak = [r for r in results["math"]["report"].get("next_round", []) if r["slice"].startswith("category=")]
    results["next_round"] = [r for r in weak if r["change"]]
    if results["next_round"]:
        config = loop_config(root, "math", automodel_python)
        _apply(config, results["next_round"][0]["change"])
        wf.write_config(config)
        results["round2_plan"] = wf.cli("plan").stdout
        results["round2_dry_run"] = wf.run("-n", "accept").stdout
        _timed(seconds, "round2", lambda: wf.run("accept", env_extra=env))
        results["round2"] = {"report": _report(wf, "lean-math"), "trained": _trained(wf, "lean-math")}
        results["round2_dataset"] = json.loads((wf.workdir / "dist" / "lean-math" / layout.MANIFEST).read_text())
    results["untouched_dry_run"] = flows["prose"].run("-n", "accept").stdout
    results["drafters_in_store"] = len(layout.trained_entries(root / "store"))
    results["measurements_in_store"] = len(layout.acceptance_entries(root / "store"))
    (root / "loop.json").write_text(json.dumps(results, indent=1, default=str))


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory, automodel_python: Path) -> dict[str, Any]:
    root = once_per_session(tmp_path_factory, "loop", lambda root: run_loop(root, automodel_python))
    results = json.loads((root / "loop.json").read_text())
    print(json.dumps({k: v for k, v in results.items() if k in ("seconds", "drafters_in_store")}))
    return results


def test_each_drafter_accepts_more_on_the_category_its_data_leaned_to(loop: dict[str, Any]) -> None:
    taus = {lean: {c: _tau(loop[lean]["report"], c) for c in toy_target.CATEGORIES} for lean in LEANS}
    print(f"tau by drafter (the category its data leaned to) and category: {taus}")
    assert taus["math"]["math"] > taus["prose"]["math"], taus
    assert taus["prose"]["prose"] > taus["math"]["prose"], taus


def test_each_drafter_was_trained_on_its_own_dataset_version(loop: dict[str, Any]) -> None:
    for lean in LEANS:
        record, dataset = loop[lean]["trained"], loop[f"{lean}_dataset"]
        shares = {k: (c["achieved_share"], c["rows"]) for k, c in dataset["mix"]["categories"].items()}
        print(f"{lean}: {record['run'].get('steps')} steps, loss {record['run'].get('final_loss')}, {shares}")
        assert record["trainer"]["name"] == "automodel" and record["trainer"]["version"] == "0.7.0"
        assert record["dataset"]["tokens"] == dataset["tokens"] and record["dataset"]["rows"] == dataset["rows"]
        assert record["run"]["final_loss"] < record["run"]["first_loss"]
    assert loop["math"]["trained"]["key"] != loop["prose"]["trained"]["key"]


def test_plan_says_what_would_train_before_and_nothing_after(loop: dict[str, Any]) -> None:
    for lean in LEANS:
        assert "train: trains a drafter on dataset version" in loop[f"{lean}_plan_before"], loop[f"{lean}_plan_before"]
        assert "nothing to train" in loop[f"{lean}_plan_after"], loop[f"{lean}_plan_after"]
    # the second round's mix change: plan trains on what the build makes next, not on the version in place
    round2 = loop.get("round2_plan", "")
    assert "on the dataset the build makes next: the mix runs again first" in round2, round2
    # the second dataset's plan knows the first training's rate
    assert "GPU-hours at the store's last training" in loop["prose_plan_before"], loop["prose_plan_before"]


def test_the_second_round_retrains_and_measures_only_what_it_changed(loop: dict[str, Any]) -> None:
    assert loop["next_round"], "the math-leaning dataset's report names a change for its weakest category"
    change = loop["next_round"][0]
    category = change["slice"].split("=", 1)[1]
    before, after = _tau(loop["math"]["report"], category), _tau(loop["round2"]["report"], category)
    shares = {k: c["achieved_share"] for k, c in loop["round2_dataset"]["mix"]["categories"].items()}
    print(f"second round: {change['slice']} {change['change']} -> shares {shares}: tau {before:.3f} -> {after:.3f}")
    jobs = parse_dry_run(loop["round2_dry_run"])
    assert {"mix", "train", "accept"} <= set(jobs) and "generate" not in jobs, jobs  # rows the store holds
    assert loop["round2"]["trained"]["key"] != loop["math"]["trained"]["key"]
    assert loop["round2"]["trained"]["dataset"]["version"] != loop["math"]["trained"]["dataset"]["version"]
    assert not parse_dry_run(loop["untouched_dry_run"]), loop["untouched_dry_run"]  # the other loop is done
    assert loop["drafters_in_store"] == 3 and loop["measurements_in_store"] == 3
