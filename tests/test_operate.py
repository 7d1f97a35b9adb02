"""Operating the store through the real commands and workflow: reuse, plan, explain, gc, verify."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.conftest import OPERATED_ROWS as ROWS
from tests.conftest import Workflow, base_config, write_jsonl


def completions(wf: Workflow, source: str = "objs") -> dict[str, dict[tuple[str, int], dict[str, Any]]]:
    """Completion rows per gen_key folder."""
    out: dict[str, dict[tuple[str, int], dict[str, Any]]] = {}
    for shard in (wf.workdir / "store" / "completions" / source).glob("*/*.parquet"):
        rows = out.setdefault(shard.parent.name, {})
        rows.update({(r["prompt_id"], r["sample_idx"]): r for r in pq.read_table(shard).to_pylist()})
    return out


def generate_jobs(wf: Workflow) -> list[str]:
    jobs = wf.dry_run().get("generate", [])
    return sorted(f"{j['source']}/{j['shard']}" for j in jobs)


@pytest.fixture(scope="module")
def base(operated_store: tuple[Path, dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
    return operated_store


def workflow_copy(base: tuple[Path, dict[str, Any]], tmp_path: Path) -> tuple[Workflow, dict[str, Any]]:
    return Workflow(base[0]).copy_to(tmp_path / "work"), copy.deepcopy(base[1])


@pytest.mark.workflow
def test_adding_ten_percent_more_rows_generates_only_those(base: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    wf, _config = workflow_copy(base, tmp_path)
    before = completions(wf)
    [old_rows] = before.values()
    write_jsonl(
        wf.workdir / "objs.jsonl",
        [*ROWS, {"instruction": "Describe object 20."}, {"instruction": "Describe object 21."}],
    )

    planned = json.loads(wf.cli("plan", "--json").stdout)[0]
    jobs = generate_jobs(wf)
    assert [f"objs/{shard}" for shard in ("00000", "00001", "00002")] == jobs  # 22 rows: 3 new shard paths
    assert sorted(planned["generate_jobs"]) == jobs, "plan lists exactly the jobs snakemake -n lists"
    assert planned["rows_to_generate"] == 2 and planned["rows_reused"] == 20

    wf.build()
    stats = [json.loads(p.read_text()) for p in (wf.workdir / "store" / "completions" / "objs").glob("*/*.stats.json")]
    new = [s for s in stats if s["gen_key"] not in before]
    assert sum(s["generated"] for s in new) == 2 == planned["rows_to_generate"]
    assert sum(s["reused"] for s in new) == 20
    [new_rows] = [rows for key, rows in completions(wf).items() if key not in before]
    fresh_tokens = sum(r["n_output_tokens"] for r in new_rows.values() if not r["reused_from"])
    engine_tokens = sum(s["output_tokens_per_second"] * s["wall_seconds"] for s in new)
    assert abs(engine_tokens - fresh_tokens) <= 0.01 * fresh_tokens + 1, "tok/s counts only what the engine made"
    for pair, row in old_rows.items():
        assert new_rows[pair]["output_ids"] == row["output_ids"] and new_rows[pair]["reused_from"]


@pytest.mark.workflow
def test_raising_max_new_tokens_generates_only_for_truncated_rows(
    base: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    wf, config = workflow_copy(base, tmp_path)
    [old_rows] = completions(wf).values()
    stopped = {k for k, r in old_rows.items() if r["finish_reason"] == "stop"}
    truncated = {k for k, r in old_rows.items() if r["finish_reason"] == "length"}
    assert stopped and truncated, "the fixture model gives both kinds"

    config["sampling"]["max_new_tokens"] = 12
    wf.write_config(config)
    planned = json.loads(wf.cli("plan", "--json").stdout)[0]
    assert planned["rows_to_generate"] == planned["rows_continued"] == len(truncated)
    assert planned["rows_reused"] == len(stopped)
    wf.build()
    [new_rows] = [rows for rows in completions(wf).values() if rows.keys() == old_rows.keys() and rows != old_rows]
    assert {k for k, r in new_rows.items() if r["continued"]} == truncated
    for k in truncated:  # continued from the old prefix: as valid a sample as a fresh one
        assert new_rows[k]["output_ids"][:6] == old_rows[k]["output_ids"]
        assert len(new_rows[k]["output_ids"]) > 6 or new_rows[k]["finish_reason"] == "stop"
    for k in stopped:
        assert new_rows[k]["output_ids"] == old_rows[k]["output_ids"] and new_rows[k]["finish_reason"] == "stop"
    new_stats = [
        json.loads(p.read_text())
        for p in (wf.workdir / "store" / "completions" / "objs").glob("*/*.stats.json")
        if json.loads(p.read_text())["components"]["sampling"]["max_new_tokens"] == 12
    ]
    assert sum(s["continued"] for s in new_stats) == sum(s["generated"] for s in new_stats) == len(truncated)
    assert sum(s["reused"] for s in new_stats) == len(stopped)


@pytest.mark.workflow
def test_lowering_max_new_tokens_generates_nothing(base: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    wf, config = workflow_copy(base, tmp_path)
    [old_rows] = completions(wf).values()
    config["sampling"]["max_new_tokens"] = 3
    wf.write_config(config)
    assert json.loads(wf.cli("plan", "--json").stdout)[0]["rows_to_generate"] == 0
    wf.build()
    [new_rows] = [rows for rows in completions(wf).values() if rows != old_rows]
    for k, row in new_rows.items():
        old = old_rows[k]
        assert row["output_ids"] == old["output_ids"][:3]
        assert row["finish_reason"] == (
            "stop" if old["finish_reason"] == "stop" and len(old["output_ids"]) < 3 else "length"
        )


@pytest.mark.workflow
def test_explain_names_the_changed_component(base: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    wf, config = workflow_copy(base, tmp_path)
    config["sources"]["objs"]["sampling"] = {"temperature": 0.5}
    wf.write_config(config)
    out = wf.cli("explain", "objs", "00000").stdout
    assert "missing: it will be built" in out
    assert "sampling.temperature: 0.8 → 0.5" in out
    assert "model" not in out.split("differs from")[1], "only what changed is named"
    shard = next((wf.workdir / "store" / "tokens" / "objs").rglob("00000.parquet"))
    config["sources"]["objs"]["sampling"] = {}
    wf.write_config(config)
    assert "built: nothing to do" in wf.cli("explain", str(shard.relative_to(wf.workdir))).stdout


@pytest.mark.workflow
def test_gc_deletes_only_unreferenced_entries(base: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    wf, config = workflow_copy(base, tmp_path)
    config["sources"]["objs"]["sampling"] = {"temperature": 0.5}
    wf.write_config(config)
    wf.build()
    listed = wf.cli("gc").stdout
    assert listed.count("unreferenced") == 3, listed
    assert all(f"{stage}/objs" in listed for stage in ("completions", "tokens")) and "journal/" in listed
    wf.cli("gc", "--yes")
    assert "nothing unreferenced" in wf.cli("gc").stdout
    assert wf.dry_run() == {}, "every referenced file is still there"
    assert wf.cli("verify").returncode == 0


@pytest.mark.workflow
def test_gc_with_an_edited_config_keeps_what_the_built_dataset_uses(
    base: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """The operator's move: edit a source's sampling, start that build (it registers, then fails before
    its mix), run gc to reclaim disk. The dataset in dist/ was built from the first config's entries."""
    wf, built_with = workflow_copy(base, tmp_path)
    store = wf.workdir / "store"
    kept = sorted(p for stage in ("prompts", "completions", "tokens", "journal") for p in store.glob(f"{stage}/**/"))
    edited = copy.deepcopy(built_with)
    edited["sources"]["objs"]["sampling"] = {"temperature": 0.5}
    wf.write_config(edited)
    before = wf.cli("configs").stdout
    assert wf.cli("gc", "--yes").returncode == 0
    assert wf.cli("configs").stdout == before, "gc registers nothing"
    wf.run("--until", "prepare_objs")  # the edited build starts: its registration replaces the first one
    listed = wf.cli("gc").stdout
    completions = next(store.glob("completions/objs/*"))
    assert f"keep {completions.relative_to(wf.workdir)}" in listed and "used by dataset dist/test-mix" in listed
    wf.cli("gc", "--yes")
    assert all(p.exists() for p in kept), "nothing the dataset was built from is deleted"
    wf.write_config(built_with)
    assert wf.dry_run() == {} and wf.cli("verify").returncode == 0
    assert json.loads(wf.cli("plan", "--json").stdout)[0]["rows_to_generate"] == 0

    # deleting it takes the flag and names the dataset it breaks, which goes too: then every command agrees
    wf.write_config(edited)
    broken = wf.cli("gc", "--yes", "--break-datasets").stdout
    assert f"delete {completions.relative_to(wf.workdir)}" in broken and "breaks dataset dist/test-mix" in broken
    assert "delete dist/test-mix" in broken and not (wf.workdir / "dist" / "test-mix").exists()
    wf.write_config(built_with)
    assert generate_jobs(wf) == ["objs/00000", "objs/00001"]
    assert json.loads(wf.cli("plan", "--json").stdout)[0]["rows_to_generate"] == len(ROWS)
    assert wf.cli("verify").returncode == 0, "nothing built is left to be bad"


@pytest.mark.workflow
@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_verify_repair_rebuilds_exactly_the_damaged_shard(
    base: tuple[Path, dict[str, Any]], tmp_path: Path, damage: str
) -> None:
    wf, _ = workflow_copy(base, tmp_path)
    [shard] = (wf.workdir / "store" / "completions" / "objs").glob("*/00001.parquet")
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 3] ^= 0xFF
    shard.write_bytes(bytes(data))

    found = wf.cli("verify", check=False)
    assert found.returncode == 1 and f"BAD {shard.relative_to(wf.workdir)}" in found.stdout
    wf.cli("verify", "--repair")
    assert generate_jobs(wf) == ["objs/00001"]
    wf.build()
    assert wf.cli("verify").returncode == 0


@pytest.mark.workflow
@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_lost_prompt_shard_reruns_prepare_and_keeps_every_completion(
    base: tuple[Path, dict[str, Any]], tmp_path: Path, damage: str
) -> None:
    """Prompt shards are reached through their manifest, not declared to Snakemake one by one: a lost
    one is found by verify; repair removes the manifest with it, so the completions stay and prepare
    runs again when a generate job next needs the prompts."""
    wf, config = workflow_copy(base, tmp_path)
    [shard] = (wf.workdir / "store" / "prompts" / "objs").glob("*/00001.parquet")
    manifest = shard.with_name("manifest.json")
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:100])
    before = completions(wf)
    found = wf.cli("verify", check=False)
    assert found.returncode == 1 and f"BAD {shard.relative_to(wf.workdir)}" in found.stdout, found.stdout
    wf.cli("verify", "--repair")
    assert not manifest.exists()
    assert wf.dry_run() == {}, "the completions stay valid"
    assert completions(wf) == before and wf.cli("verify").returncode == 0
    config["sampling"]["seed"] = 11  # now every shard generates again, from its prompts
    wf.write_config(config)
    assert "prepare_objs" in wf.dry_run()
    wf.build()
    assert shard.exists() and manifest.exists() and wf.cli("verify").returncode == 0


@pytest.mark.workflow
def test_a_generate_job_without_its_prompt_shard_names_the_manifest_to_delete(
    base: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    wf, config = workflow_copy(base, tmp_path)
    [shard] = (wf.workdir / "store" / "prompts" / "objs").glob("*/00000.parquet")
    shard.unlink()
    config["sampling"]["seed"] = 7  # every shard must generate again
    wf.write_config(config)
    failed = wf.run(check=False)
    assert failed.returncode != 0
    assert f"delete {shard.parent.relative_to(wf.workdir)}/manifest.json" in failed.stdout + failed.stderr


@pytest.mark.workflow
def test_a_rerun_generate_job_keeps_its_intact_shard_when_the_journal_is_gone(
    base: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """What an upgrade does (a rule's inputs or params changed, so Snakemake reruns every generate job),
    forced here: a job whose journal is gone keeps the shard it published instead of generating it."""
    wf, _ = workflow_copy(base, tmp_path)
    store = wf.workdir / "store"
    shutil.rmtree(store / "journal")
    shards = sorted((store / "completions" / "objs").glob("*/*.parquet"))
    before = {p: (p.read_bytes(), p.with_suffix("").with_suffix(".stats.json")) for p in shards}
    sidecars_before = {p: s.read_text() for p, (_, s) in before.items()}
    wf.run("--forcerun", "generate")
    for path, (data, sidecar) in before.items():
        assert path.read_bytes() == data
        assert sidecar.read_text() == sidecars_before[path], "the sidecar of the run that generated it stays"
    logs = "".join(p.read_text() for p in (wf.workdir / "logs" / "completions").rglob("*.log"))
    assert logs.count("is intact; nothing generated") == len(shards)


@pytest.mark.workflow  # runs snakemake
def test_plan_fails_on_a_source_its_prepare_would_lose_before_anything_runs(tmp_path: Path, tiny_model: Path) -> None:
    write_jsonl(tmp_path / "good.jsonl", ROWS)
    write_jsonl(tmp_path / "bad.jsonl", [{"question": f"no instruction field {i}"} for i in range(5)])
    sources = {
        "good": {"category": "general", "files": ["good.jsonl"], "format": "alpaca"},
        "bad": {"category": "general", "files": ["bad.jsonl"], "format": "alpaca"},
    }
    wf = Workflow.at(tmp_path, base_config(tiny_model, sources))
    planned = wf.cli("plan", check=False)
    assert planned.returncode == 1, planned.stdout + planned.stderr
    lost = "5 of 5 rows (100.0%) were dropped for defects, so the source yields no prompt at all"
    assert f"error: sources.bad (bad.jsonl): {lost}" in planned.stderr
    assert "missing_field: 5 rows" in planned.stderr and "good" in planned.stdout
    as_json = wf.cli("plan", "--json", check=False)
    assert as_json.returncode == 1
    assert {e["source"]: e["errors"] != [] for e in json.loads(as_json.stdout)} == {"bad": True, "good": False}
    dry = wf.run("-n", check=False)
    assert dry.returncode != 0
    assert "sources.bad (bad.jsonl): the first 5 rows are all dropped" in dry.stdout + dry.stderr
    assert not (tmp_path / "store" / "completions").exists(), "planning ran nothing"


@pytest.mark.workflow  # runs snakemake
def test_plan_names_the_rows_prepare_leaves_out_within_its_limits_before_and_after_prepare(
    tmp_path: Path, tiny_model: Path
) -> None:
    """Malformed rows under checks.max_drop_fraction: `plan` names them before anything runs, as the
    manifest counts them after prepare (before, only the card showed them, after the build)."""
    rows = [*ROWS, *({"instruction": f"Say {i}."} for i in range(20))]
    (tmp_path / "some-bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "{\n[1,\n")
    sources = {"some": {"category": "general", "files": ["some-bad.jsonl"], "format": "alpaca"}}
    wf = Workflow.at(tmp_path, base_config(tiny_model, sources))
    before = wf.cli("plan").stdout
    assert "prepare leaves out: some 2 (malformed_row 2)" in before, before
    wf.run("--until", "prepare_some")
    manifest = json.loads(next((tmp_path / "store" / "prompts").rglob("manifest.json")).read_text())
    assert manifest["drops"] == {"malformed_row": 2}
    assert "prepare leaves out: some 2 (malformed_row 2)" in wf.cli("plan").stdout


def test_configfile_is_taken_after_the_subcommand_too(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from dflash_build import cli

    missing = str(tmp_path / "not-there.yaml")
    for argv in (["--configfile", missing, "plan"], ["plan", "--configfile", missing]):
        assert cli.main(argv) == 2
        assert "not-there.yaml" in capsys.readouterr().err


def test_the_trainer_windows_effect_on_the_rows_to_generate() -> None:
    """A worked pair, then the limits: a window no answer reaches changes nothing, one no prompt fits
    skips every row; the estimate scales with the rows to generate."""
    from dflash_build.ops.estimate import WindowEffect, window_effect
    from dflash_build.spec import TrainerSpec

    trainer = TrainerSpec(max_length=40, min_new_tokens=4)
    # 10 + 100 runs out at max_new_tokens 50: dropped without the window, 30 tokens with it; 10 + 5 stops
    assert window_effect([(10, 100), (10, 5)], 2, 50, trainer, drop=True) == WindowEffect(2, 35, 55, 0, 1, 0)
    kept = window_effect([(10, 100), (10, 5)], 2, 50, trainer, drop=False)
    assert kept is not None and (kept.past_window_tokens, kept.dropped_rows) == (20, 0)
    lengths = [(p, a) for p in (5, 50, 200) for a in (1, 30, 400)]
    wide = window_effect(lengths, len(lengths), 512, TrainerSpec(max_length=10_000), drop=True)
    assert wide is not None and wide.output_tokens == wide.output_tokens_without and wide.past_window_tokens == 0
    narrow = window_effect(lengths, 3 * len(lengths), 512, TrainerSpec(max_length=8, min_new_tokens=4), drop=True)
    assert narrow is not None and narrow.output_tokens == 0 and narrow.skipped_rows == 3 * len(lengths)
    assert window_effect(lengths, 9, 512, TrainerSpec(), drop=True) is None, "no window, no estimate"
