"""End to end: the real Snakemake workflow on a tiny random-weight model, and incremental builds."""

from __future__ import annotations

import copy
import csv
import json
import os
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from dflash_build.publish import plots
from tests.conftest import (
    TOOLS_TEMPLATE,
    Workflow,
    base_config,
    copy_workflow,
    loaded_rows,
    once_per_session,
    write_jsonl,
)

pytestmark = pytest.mark.workflow

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def make_sources(data: Path) -> dict[str, Any]:
    write_jsonl(
        data / "alpha.jsonl",
        [{"instruction": f"Write function number {i}.", "input": "", "output": "x"} for i in range(6)],
    )
    write_jsonl(
        data / "beta.jsonl",
        [
            {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER_TOOL]},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]},
            {"messages": [{"role": "user", "content": "Weather in Rome?"}], "tools": json.dumps([WEATHER_TOOL])},
        ],
    )
    write_jsonl(
        data / "gamma.jsonl",
        [
            {"conversations": [{"from": "human", "value": "Tell me a joke."}, {"from": "gpt", "value": "no"}]},
            {"conversations": [{"from": "human", "value": "Name a colour."}]},
            '{"conversations": [',
            {"conversations": [{"from": "human", "value": "Count to three."}]},
        ],
    )
    return {
        "alpha": {"category": "coding", "files": [str(data / "alpha.jsonl")], "format": "alpaca"},
        "beta": {"category": "agent", "files": [str(data / "beta.jsonl")], "format": "messages"},
        # one of its 4 rows is bad on purpose: allowed explicitly, as a user would
        "gamma": {
            "category": "general",
            "files": [str(data / "gamma.jsonl")],
            "format": "sharegpt",
            "max_drop_fraction": 0.3,
        },
    }


@pytest.fixture(scope="module")
def built_once(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """A full build with a copy of the workflow (``code``, which runs it), once per session."""

    def build(root: Path) -> None:
        code = copy_workflow(root / "code")
        (root / "work").mkdir()
        wf = Workflow(root / "work", snakefile=code / "Snakefile", pythonpath=code)
        config = base_config(tiny_model, make_sources(root / "data"))
        # Agent is the scarcest category for its share, so it is taken whole: every tool row reaches the
        # dataset whatever the mix's ranks. Its rows carry a tool schema (~200 tokens against a few dozen
        # for the others), and the other categories' targets are met only to within half a sample.
        config["mix"]["categories"] = {"coding": 0.2, "general": 0.1, "agent": 0.7}
        config["checks"]["share_tolerance"] = 0.3
        wf.write_config(config)
        wf.build()

    return once_per_session(tmp_path_factory, "workflow-built", build)


@pytest.fixture
def built(built_once: Path, tmp_path: Path) -> tuple[Workflow, dict[str, Any]]:
    """This test's copy of the build, whose config, store and dataset it may change, and its config."""
    code = built_once / "code"
    wf = Workflow(built_once / "work", snakefile=code / "Snakefile", pythonpath=code)
    mine = wf.copy_to(tmp_path / "built", registration=True)
    return mine, yaml.safe_load((mine.workdir / "config.yaml").read_text())


def test_build_writes_a_loadable_dataset_whose_samples_are_prompt_then_answer(
    built: tuple[Workflow, dict[str, Any]], tiny_model: Path
) -> None:
    import datasets
    from transformers import AutoTokenizer

    wf, _ = built
    dist = wf.workdir / "dist" / "test-mix"
    ds = datasets.load_dataset("parquet", data_files=sorted(str(p) for p in (dist / "data").glob("*.parquet")))["train"]
    manifest = json.loads((dist / "manifest.json").read_text())
    assert len(ds) == manifest["rows"] > 0
    assert set(ds["category"]) <= {"coding", "agent", "general"}

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = TOOLS_TEMPLATE.read_text()
    completions = {
        (r["prompt_id"], r["sample_idx"]): r
        for f in (wf.workdir / "store" / "completions").rglob("*.parquet")
        for r in pq.read_table(f).to_pylist()
    }
    prompts = {
        r["prompt_id"]: r
        for f in (wf.workdir / "store" / "prompts").rglob("*.parquet")
        for r in pq.read_table(f).to_pylist()
    }
    seen_tools = False
    for sample in ds:
        comp = completions[(sample["prompt_id"], sample["sample_idx"])]
        prompt = prompts[sample["prompt_id"]]
        tools = json.loads(prompt["tools"]) if prompt["tools"] else None
        rendered = tok.apply_chat_template(
            json.loads(prompt["messages"]), tools=tools, add_generation_prompt=True, tokenize=False
        )
        n_prompt = comp["n_prompt_tokens"]
        ids, mask = sample["input_ids"], sample["loss_mask"]
        assert tok.decode(ids[:n_prompt]) == rendered
        expected_answer = comp["output_ids"] + ([comp["stop_token_id"]] if comp["finish_reason"] == "stop" else [])
        assert ids[n_prompt:] == expected_answer
        assert tok.decode(ids[n_prompt:]).startswith(comp["text"])
        assert mask == [0] * n_prompt + [1] * len(expected_answer)
        if tools:
            seen_tools = True
            assert "<tools>" in rendered and "get_weather" in rendered
    assert seen_tools, "rows with tool schemas reach the dataset"


def test_manifests_account_for_every_row(built: tuple[Workflow, dict[str, Any]]) -> None:
    wf, _ = built
    gamma = json.loads(next((wf.workdir / "store" / "prompts" / "gamma").rglob("manifest.json")).read_text())
    assert gamma["rows_in"] == 4 and gamma["rows_out"] == 3
    assert gamma["drops"] == {"malformed_row": 1}
    assert "gamma.jsonl:3" in gamma["drop_examples"]["malformed_row"][0]
    alpha_shards = sorted((wf.workdir / "store" / "prompts" / "alpha").rglob("0*.parquet"))
    assert [pq.read_metadata(p).num_rows for p in alpha_shards] == [3, 3]  # 6 rows, shard_size 4 -> 2 shards
    for stats_file in (wf.workdir / "store" / "completions").rglob("*.stats.json"):
        stats = json.loads(stats_file.read_text())
        assert stats["ok"] + stats["truncated"] + stats["error"] + stats["skipped"] == stats["input_rows"] > 0
        assert stats["engine"]["options"]["batch_size"] == 4
    dist_manifest = json.loads((wf.workdir / "dist" / "test-mix" / "manifest.json").read_text())
    assert set(dist_manifest["sources"]) == {"alpha", "beta", "gamma"}
    for name, src in dist_manifest["sources"].items():
        for shard in src["shards"]:
            assert f"/tokens/{name}/{src['tok_key']}/" in shard


def test_the_report_numbers_are_the_datas_and_the_sidecars(built: tuple[Workflow, dict[str, Any]]) -> None:
    """Every number of the card's tables, recomputed from the dataset's rows and the generate sidecars."""
    from dflash_build.publish.report import length_stats

    wf, _ = built
    dist = wf.workdir / "dist" / "test-mix"
    manifest = json.loads((dist / "manifest.json").read_text())
    rows = [r for f in sorted((dist / "data").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    sidecars: dict[str, list[dict[str, Any]]] = {}
    for path in (wf.workdir / "store" / "completions").rglob("*.stats.json"):
        stats = json.loads(path.read_text())
        sidecars.setdefault(stats["source"], []).append(stats)
    by = manifest["report"]["by_source"]
    assert set(by) == {"alpha", "beta", "gamma"}
    for name, entry in by.items():
        mine = [r for r in rows if r["source"] == name]
        completion = [r["n_loss_tokens"] for r in mine]
        assert entry["rows"] == len(mine)
        assert entry["completion_tokens"] == sum(completion)
        assert entry["prompt_tokens"] == sum(r["n_tokens"] - r["n_loss_tokens"] for r in mine)
        assert entry["completion_length"] == length_stats(completion)
        gen = entry["generation"]
        for key in ("input_rows", "ok", "truncated", "error", "skipped"):
            assert gen[key] == sum(s[key] for s in sidecars[name]), (name, key)
        assert gen["truncation_rate"] == round(gen["truncated"] / gen["input_rows"], 6)
        assert gen["gpu_hours"] == 0 and gen["job_hours"] > 0  # a CPU engine holds no GPU
    for category, entry in manifest["report"]["by_category"].items():
        mine = [r["n_loss_tokens"] for r in rows if r["category"] == category]
        assert entry["rows"] == len(mine) == manifest["mix"]["categories"][category]["rows"]
        assert entry["completion_tokens"] == sum(mine)
    card = (dist / "README.md").read_text()
    table = card[card.index("### By source") : card.index("### By category")]
    for name, entry in by.items():  # the card's table says the same
        line = next(line for line in table.splitlines() if line.startswith(f"| {name} | {entry['category']} | "))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[2:5] == [str(entry["rows"]), str(entry["prompt_tokens"]), str(entry["completion_tokens"])]
    assert "## Recipe" in card and manifest["sources"]["alpha"]["gen_key"] in card
    for name in by:  # tokens by the prompt's language, as the rows say
        tokens: dict[str, int] = {}
        for r in rows:
            if r["source"] == name:
                tokens[r["language"]] = tokens.get(r["language"], 0) + r["n_tokens"]
        assert manifest["languages"]["by_source"].get(name, {}) == tokens
    assert "## Languages" in card
    with open(dist / "tables" / "by_source.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    assert {r["source"]: int(r["rows"]) for r in csv_rows} == {n: e["rows"] for n, e in by.items()}


def test_every_plot_is_a_valid_png_and_in_the_card_and_the_snakemake_report(
    built: tuple[Workflow, dict[str, Any]],
) -> None:
    import matplotlib.image

    wf, _ = built
    dist = wf.workdir / "dist" / "test-mix"
    manifest = json.loads((dist / "manifest.json").read_text())
    card = (dist / "README.md").read_text()
    assert [Path(p).name for p in manifest["plots"]] == list(plots.PLOTS)
    for plot in manifest["plots"]:
        data = (dist / plot).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(dist / plot)  # decodes the whole file
        assert image.shape[0] > 200 and image.shape[1] > 300
        assert f"]({plot})" in card
    wf.run("--report", str(wf.workdir / "report.html"))
    html = (wf.workdir / "report.html").read_text(errors="replace")
    for plot in manifest["plots"]:
        assert Path(plot).name in html


def test_nothing_to_do_after_build_and_after_touching_everything(built: tuple[Workflow, dict[str, Any]]) -> None:
    wf, config = built
    assert wf.dry_run() == {}
    for folder in (wf.workdir / "store", wf.workdir / "dist", Path(config["sources"]["alpha"]["files"][0]).parent):
        for path in folder.rglob("*"):
            os.utime(path)
    assert wf.dry_run() == {}


def _sources_of(jobs: dict[str, list[dict[str, str]]], rule: str) -> list[str]:
    return sorted(j["source"] for j in jobs.get(rule, []))


def _dry_run_with(wf: Workflow, config: dict[str, Any], changed: dict[str, Any]) -> dict[str, list[dict[str, str]]]:
    """Jobs a dry run lists for ``changed``; the built config is written back afterwards."""
    wf.write_config(changed)
    try:
        return wf.dry_run()
    finally:
        wf.write_config(config)


def test_changing_one_sources_sampling_lists_only_its_jobs(built: tuple[Workflow, dict[str, Any]]) -> None:
    wf, config = built
    changed = copy.deepcopy(config)
    changed["sources"]["beta"]["sampling"] = {"temperature": 0.5}
    jobs = _dry_run_with(wf, config, changed)
    assert set(jobs) == {"generate", "tokenize", "mix"}
    assert _sources_of(jobs, "generate") == _sources_of(jobs, "tokenize") == ["beta"]


def test_engine_speed_options_rerun_nothing_and_a_numerics_option_regenerates(
    built: tuple[Workflow, dict[str, Any]],
) -> None:
    """The descriptor's decisions, through the real build: batch size and threads enter no key; dtype
    (the numbers the model computes) re-keys every generate job, and only what follows from them."""
    wf, config = built
    changed = copy.deepcopy(config)
    changed["engine"]["options"] = {"device": "cpu", "batch_size": 1, "threads": 2}
    assert _dry_run_with(wf, config, changed) == {}
    changed["engine"]["options"]["dtype"] = "bfloat16"
    jobs = _dry_run_with(wf, config, changed)
    assert set(jobs) == {"generate", "tokenize", "mix"}
    assert set(_sources_of(jobs, "generate")) == set(config["sources"]) == set(_sources_of(jobs, "tokenize"))


def test_adding_a_source_lists_only_its_jobs(built: tuple[Workflow, dict[str, Any]]) -> None:
    wf, config = built
    data = Path(config["sources"]["alpha"]["files"][0]).parent
    write_jsonl(data / "delta.jsonl", [{"question": "What is 2 + 2?"}, {"question": "What is 3 * 3?"}])
    changed = copy.deepcopy(config)
    changed["sources"]["delta"] = {
        "category": "math",
        "files": [str(data / "delta.jsonl")],
        "format": "prompt",
        "fields": {"prompt": "question"},
    }
    changed["mix"]["categories"]["math"] = 0.25
    jobs = _dry_run_with(wf, config, changed)
    # the gate every generate job waits on runs again after a prepare (a local job; it makes nothing rerun)
    assert set(jobs) == {"prepare_delta", "prepared", "generate", "tokenize", "mix"}
    assert _sources_of(jobs, "generate") == _sources_of(jobs, "tokenize") == ["delta"]


def test_a_dry_run_writes_nothing_but_the_digest_cache(tmp_path: Path, tiny_model: Path) -> None:
    """`snakemake -n` on a fresh store starts no process and records nothing: the one file it leaves is
    the file-digest cache (derived state that spares the next run hashing the model again)."""
    config = base_config(tiny_model, make_sources(tmp_path / "data"))
    wf = Workflow.at(tmp_path / "wd", config)
    jobs = wf.dry_run()
    assert {"generate", "tokenize", "mix"} <= set(jobs)
    ours = [p.relative_to(wf.workdir) for p in wf.workdir.rglob("*") if p.is_file()]
    written = sorted(str(p) for p in ours if p.parts[0] != ".snakemake")  # Snakemake's own metadata
    assert written == ["config.yaml", "store/.cache/fingerprints.json"], written


def test_changing_the_model_lists_every_generate_job(
    built: tuple[Workflow, dict[str, Any]], tiny_model_b: Path
) -> None:
    wf, config = built
    changed = copy.deepcopy(config)
    changed["model"]["path"] = str(tiny_model_b)
    jobs = _dry_run_with(wf, config, changed)
    assert set(jobs) == {"generate", "tokenize", "mix"}
    assert _sources_of(jobs, "generate") == ["alpha", "alpha", "beta", "gamma"]


def test_comment_edits_in_rules_and_package_rerun_nothing(
    built: tuple[Workflow, dict[str, Any]], tmp_path: Path
) -> None:
    code = copy_workflow(tmp_path / "code")  # this test's own: the build's runs every other test
    wf = Workflow(built[0].workdir, snakefile=code / "Snakefile", pythonpath=code)
    for path in (code / "rules" / "generate.smk", code / "dflash_build" / "stages" / "generate" / "__init__.py"):
        path.write_text(path.read_text() + "\n# a comment added by a test\n")
    assert wf.dry_run() == {}


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("every row over the context", "4 of 4 rows could not be generated"),
        ("empty input", "the input has no rows"),
        ("every answer truncated and dropped", "source 'alpha' reaches the mix with no samples"),
    ],
)
def test_a_build_that_would_lose_a_source_fails_and_says_why(
    tmp_path: Path, tiny_model: Path, case: str, expected: str
) -> None:
    data = tmp_path / "data"
    rows = [{"instruction": f"Write function number {i}."} for i in range(4)]
    config = base_config(
        tiny_model,
        {
            "alpha": {
                "category": "coding",
                "files": [str(write_jsonl(data / "alpha.jsonl", rows))],
                "format": "alpaca",
            },
            "beta": {
                "category": "general",
                "files": [str(write_jsonl(data / "beta.jsonl", [{"instruction": "Say hi."}]))],
                "format": "alpaca",
            },
        },
    )
    if case == "every row over the context":
        config["model"]["context_length"] = 20
    elif case == "empty input":
        (data / "alpha.jsonl").write_text("")
    else:
        config["truncated"] = "drop"
        config["sources"]["alpha"]["sampling"] = {"max_new_tokens": 1, "temperature": 0.0}
    wf = Workflow(tmp_path)
    wf.write_config(config)
    proc = wf.run(check=False)
    assert proc.returncode != 0
    assert expected in proc.stdout + proc.stderr
    assert not (tmp_path / "dist" / "test-mix").exists()


def test_editing_the_model_folders_readme_lists_no_job(built: tuple[Workflow, dict[str, Any]]) -> None:
    wf, config = built
    readme = Path(config["model"]["path"]) / "README.md"
    readme.write_text("# a model card edited after the build\n")
    try:
        assert wf.dry_run() == {}
    finally:
        readme.unlink()


@pytest.mark.parametrize("options", [{"dtype": "bfloat16"}, {"device": "cuda"}])
def test_numerics_options_list_every_generate_job(
    built: tuple[Workflow, dict[str, Any]], options: dict[str, Any]
) -> None:
    wf, config = built
    changed = copy.deepcopy(config)
    changed["engine"]["options"].update(options)
    jobs = _dry_run_with(wf, config, changed)
    assert set(jobs) == {"generate", "tokenize", "mix"}
    assert _sources_of(jobs, "generate") == ["alpha", "alpha", "beta", "gamma"]


def _reversed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _reversed(v) for k, v in reversed(list(value.items()))}
    return value


def test_a_failed_rebuild_keeps_the_last_good_dataset_and_a_passing_one_swaps_in_whole(
    built: tuple[Workflow, dict[str, Any]],
) -> None:
    wf, config = built
    folder = wf.workdir / "dist" / "test-mix"
    good = json.loads((folder / "manifest.json").read_text())
    rows = loaded_rows(folder)
    missed = copy.deepcopy(config)
    missed["mix"]["categories"] = {"coding": 0.98, "general": 0.01, "agent": 0.01}
    missed["checks"]["share_tolerance"] = 0.001
    wf.write_config(missed)
    for attempt in ((), ("--forcerun", "mix")):  # a share edit that misses, and a forced rerun that fails
        failed = wf.run(*attempt, check=False)
        assert failed.returncode != 0 and "the mix misses the configured dataset" in failed.stdout + failed.stderr
        assert json.loads((folder / "manifest.json").read_text()) == good
        assert loaded_rows(folder) == rows, "the last good dataset still loads, whole"
    assert set(wf.dry_run()) == {"mix"}, "the failed mix runs again"
    said = wf.cli("plan").stdout + wf.cli("verify", check=False).stdout
    assert said.count("dist/test-mix: built again by the next build") == 2, "plan and verify say so too"

    # a passing edit swaps the new dataset in; the old version is superseded and gc takes it
    reseeded = copy.deepcopy(config)
    reseeded["mix"]["seed"] = 7
    wf.write_config(reseeded)
    before = (wf.workdir / "dist" / ".test-mix.versions" / good_version(folder)).resolve()
    wf.build()
    assert folder.resolve() != before and json.loads((folder / "manifest.json").read_text())["mix"]["seed"] == 7
    listed = wf.cli("gc").stdout
    assert f"superseded version of dist/test-mix {before.relative_to(wf.workdir.resolve())}" in listed, listed
    wf.cli("gc", "--yes")
    assert not before.exists() and loaded_rows(folder) > 0 and wf.cli("verify").returncode == 0
    assert wf.dry_run() == {}


def good_version(folder: Path) -> str:
    return Path(os.readlink(folder)).name


def test_a_category_whose_target_is_under_half_a_sample_gets_its_shortest_sample(
    built: tuple[Workflow, dict[str, Any]],
) -> None:
    """The demo at max_new_tokens 12 had a category that took no sample and then failed its own check."""
    wf, tiny = built
    tiny["mix"]["categories"]["general"] = 0.0005
    wf.write_config(tiny)
    assert set(wf.dry_run()) == {"mix"}
    wf.build()
    manifest = json.loads((wf.workdir / "dist" / "test-mix" / "manifest.json").read_text())
    general = manifest["mix"]["categories"]["general"]
    assert general["target_tokens"] * 2 < general["tokens"] and general["rows"] == 1
    sources = [name for name, src in manifest["sources"].items() if src["category"] == "general"]
    lengths = [r["n_tokens"] for src in sources for p in _token_shards(wf, src) for r in pq.read_table(p).to_pylist()]
    assert general["tokens"] == min(lengths), "the shortest sample: the closest the category can come"


def _token_shards(wf: Workflow, source: str) -> list[Path]:
    manifest = json.loads((wf.workdir / "dist" / "test-mix" / "manifest.json").read_text())
    return [wf.workdir / p for p in manifest["sources"][source]["shards"]]


def test_list_changes_names_only_what_changed(built: tuple[Workflow, dict[str, Any]]) -> None:
    """Snakemake's `snakemake -R $(snakemake --list-changes params)` idiom reruns exactly what changed."""
    wf, config = built

    def listed(kind: str) -> list[str]:
        out = wf.run("--list-changes", kind).stdout
        return [line for line in out.splitlines() if line.strip() and (wf.workdir / line.strip()).exists()]

    assert {kind: listed(kind) for kind in ("params", "code", "input")} == {"params": [], "code": [], "input": []}
    changed = copy.deepcopy(config)
    changed["mix"]["categories"]["coding"] += 0.1
    wf.write_config(changed)
    assert listed("params") == ["dist/.test-mix.versions/built"], "the mix's output: its build record"
    wf.write_config(config)
    assert listed("params") == []


def test_a_changed_mix_check_reruns_only_the_mix(built: tuple[Workflow, dict[str, Any]]) -> None:
    """A tightened share tolerance is checked against the dataset again; nothing is regenerated."""
    wf, config = built
    for checks in ({"share_tolerance": 0.001}, {"allow_shortfall": ["general"]}):
        wf.write_config({**config, "checks": {**config["checks"], **checks}})
        assert set(wf.dry_run()) == {"mix"}, checks
    wf.write_config(config)
    assert wf.dry_run() == {}


def test_reordering_the_config_reruns_nothing(built: tuple[Workflow, dict[str, Any]]) -> None:
    """Same key, same params: the components Snakemake records are canonical, whatever the YAML order."""
    wf, config = built
    assert _dry_run_with(wf, config, _reversed(config)) == {}


def test_exports_are_build_targets_and_an_export_edit_reruns_only_that_export(
    built: tuple[Workflow, dict[str, Any]],
) -> None:
    """Adding exports to a built config plans the export jobs and nothing else; an export's settings
    rerun only it; gc and verify know the export folders. (Each export read by its trainer's loader:
    tests/test_demo_smollm2.py.)"""
    wf, config = built
    config["export"] = {"specforge": {"max_length": 64}, "speculators": {"max_length": 64, "long": "cut"}}
    config["export"]["conversations"] = {}  # all defaults
    wf.write_config(config)
    planned = wf.dry_run()
    assert set(planned) == {"export"}, planned
    assert sorted(job["fmt"] for job in planned["export"]) == ["conversations", "specforge", "speculators"]
    summary = wf.build().stdout
    dataset_rows = loaded_rows(wf.workdir / "dist" / "test-mix")
    for fmt in ("specforge", "speculators", "conversations"):
        manifest = json.loads((wf.workdir / "dist" / f"test-mix-{fmt}" / "manifest.json").read_text())
        assert manifest["samples_in"] == dataset_rows and f"export {fmt}: dist/test-mix-{fmt}" in summary
        dropped = sum((manifest.get("dropped") or {}).values())
        assert manifest["rows"] + dropped == dataset_rows or manifest["export"]["long"] == "split"
    before = {fmt: (wf.workdir / "dist" / f"test-mix-{fmt}").resolve() for fmt in ("conversations", "speculators")}

    config["export"]["specforge"]["long"] = "drop"
    wf.write_config(config)
    assert wf.dry_run() == {"export": [{"fmt": "specforge"}]}, "only the edited export reruns"
    wf.build()
    after = {fmt: (wf.workdir / "dist" / f"test-mix-{fmt}").resolve() for fmt in before}
    assert after == before
    dropped = json.loads((wf.workdir / "dist" / "test-mix-specforge" / "manifest.json").read_text())["dropped"]
    assert dropped.get("longer_than_max_length", 0) > 0, "the tool rows (~200 tokens) are over 64"
    assert "superseded version of dist/test-mix-specforge" in wf.cli("gc").stdout
    assert wf.cli("verify").returncode == 0 and wf.dry_run() == {}

    # a window no sample fits: the export fails loudly and the last good one stays
    good = (wf.workdir / "dist" / "test-mix-specforge").resolve()
    config["export"]["specforge"]["max_length"] = 4
    wf.write_config(config)
    failed = wf.run(check=False)
    text = failed.stdout + failed.stderr
    assert failed.returncode != 0 and "export.specforge: all " in text and "a trainer would get nothing" in text
    assert (wf.workdir / "dist" / "test-mix-specforge").resolve() == good
