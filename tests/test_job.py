"""The one stage contract: a Job carries the paths its rule declares, and a stage reads and writes those."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from dflash_build import config as cfg
from dflash_build import configfile, engines, inputs, workflow
from dflash_build import plan as plan_mod
from dflash_build.publish import release
from dflash_build.stages import generate, mix, prepare, registry, tokenize
from dflash_build.stages.common.job import Job
from dflash_build.stages.registry import planned
from tests.conftest import REPO, write_jsonl
from tests.test_generate import EchoEngine


def _built(tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> plan_mod.Plan:
    """One source prepared, generated (a stand-in engine: the engine is not under test) and tokenized."""
    write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": f"task {i}"}]} for i in range(3)])
    raw = {
        "store": str(tmp_path / "store"),
        "dataset": {"name": "d", "out": str(tmp_path / "dist")},
        "model": {"path": str(tiny_model)},
        "sampling": {"samples_per_prompt": 1, "max_new_tokens": 3},
        "sources": {"s": {"category": "c", "format": "messages", "files": [str(tmp_path / "in.jsonl")]}},
        "mix": {"categories": {"c": 1}},
        # the stand-in answers each prompt's last token, the template's newline: an empty answer, kept here
        "degenerate": {"empty": {"policy": "keep"}},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    plan = plan_mod.build(cfg.load(tmp_path / "c.yaml"))
    monkeypatch.setattr(engines, "load", lambda *a, **k: EchoEngine())
    prepare.run(planned(plan, "prepare", "s"))
    generate.run(planned(plan, "generate", "s", "00000"))
    return plan


def test_a_stage_reads_and_writes_the_paths_its_job_declares(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokenize reads the completion shard the job names (not the plan's) and writes where it says."""
    plan = _built(tmp_path, tiny_model, monkeypatch)
    own = planned(plan, "tokenize", "s", "00000")
    moved = tmp_path / "elsewhere" / "completions.parquet"
    moved.parent.mkdir()
    moved.write_bytes(own.input("completions").read_bytes())
    own.input("completions").unlink()
    data, stats = tmp_path / "out" / "t.parquet", tmp_path / "out" / "t.json"
    job = dataclasses.replace(
        own, inputs={**own.inputs, "completions": (moved,)}, outputs={"data": (data,), "stats": (stats,)}
    )
    record = tokenize.run(job)
    assert pq.read_table(data).num_rows == 3 and json.loads(stats.read_text()) == record
    assert not own.output("data").exists()


def test_the_mix_takes_only_the_token_shards_its_job_declares(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _built(tmp_path, tiny_model, monkeypatch)
    tokenize.run(planned(plan, "tokenize", "s", "00000"))
    job = planned(plan, "mix")
    assert job.inputs["tokens"] == (planned(plan, "tokenize", "s", "00000").output("data"),)
    manifest = mix.run(job)
    assert manifest["rows"] == 3 and manifest["sources"]["s"]["shards"] == [str(job.inputs["tokens"][0])]
    assert release.folder_of(job.output("record")) == plan.config.dataset_dir
    stranger = tmp_path / "store" / "tokens" / "other" / "0123456789abcdef" / "00000.parquet"
    with pytest.raises(ValueError, match="lies in no source's store folder"):
        dataclasses.replace(job, inputs={**job.inputs, "tokens": (stranger,)}).by_source("tokens")


def test_a_snakemake_job_becomes_the_job_the_plan_would_make(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """workflow.job_of reads Snakemake's named inputs, outputs, wildcards and params into the same Job
    that planned() makes from the plan (what tests and benchmarks run)."""
    plan = _built(tmp_path, tiny_model, monkeypatch)
    config: dict[str, Any] = yaml.safe_load((tmp_path / "c.yaml").read_text())
    configfile.fill_defaults(config)
    sp = plan.sources["s"]
    for stage, wildcards, params in (
        ("tokenize", {"source": "s", "key": sp.tok_key, "shard": "00000"}, {}),
        ("prepare", {}, {"source": "s", "key": sp.prompt_key}),
        ("mix", {}, {}),
    ):
        want = planned(plan, stage, wildcards.get("source") or params.get("source"), wildcards.get("shard"))
        smk = SimpleNamespace(
            config=config,
            wildcards=SimpleNamespace(**wildcards),
            params=SimpleNamespace(**params),
            input=SimpleNamespace(**{k: [str(p) for p in v] for k, v in want.inputs.items()}),
            output=SimpleNamespace(**{k: [str(p) for p in v] for k, v in want.outputs.items()}),
        )
        got = workflow.job_of(smk, stage)
        assert (got.stage, got.source, got.shard, got.key) == (want.stage, want.source, want.shard, want.key)
        assert got.inputs == want.inputs and got.outputs == want.outputs, stage
        declared = registry.get(stage)
        assert set(got.inputs) == set(declared.inputs) and set(got.outputs) == set(declared.outputs)


def test_a_prompt_shard_missing_beside_its_manifest_names_the_manifest(tmp_path: Path) -> None:
    manifest = tmp_path / "prompts" / "manifest.json"
    job = Job("generate", None, {"prompts": (manifest,)}, shard="00003")  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match=f"delete {manifest}"):
        job.prompt_shard()


def test_a_build_record_names_its_folder() -> None:
    for folder in (Path("dist/demo"), Path("/x/dist/demo-packed-1024"), Path("out/a.b")):
        assert release.folder_of(release.record_dir(folder)) == folder


def test_every_input_format_has_one_conversion() -> None:
    """A new input format is one module of dflash_build.inputs (its FORMAT: fields, conversion, columnar
    shape) and its name in the schema's list: the two agree, and every format names its fields."""
    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())
    source = schema["properties"]["sources"]["additionalProperties"]["properties"]
    assert set(inputs.FORMATS) == set(source["format"]["enum"])
    for name, fmt in inputs.FORMATS.items():
        assert fmt.name == name and fmt.fields and set(fmt.required) <= set(fmt.fields), name


def test_a_stage_failure_ends_its_job_with_its_message_and_no_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dflash_build.stages.generate.accounting import ShardFailedError

    log = tmp_path / "job.log"
    with pytest.raises(SystemExit) as stop, workflow.logged(log):
        raise ShardFailedError("s/00000: 4 of 4 rows could not be generated\n  4 x prompt of N tokens")
    assert stop.value.code == 1
    text = log.read_text()
    assert "4 of 4 rows could not be generated" in text and "Traceback" not in text
    assert "Traceback" not in capsys.readouterr().err
