"""Every generate job waits for every source's prepare (the gate, rules/prepared.smk): a defect a
source's first rows hide stops the build before any GPU time, a gate that reruns regenerates nothing, and
what a rerun gate leaves to build is listed by ``-n`` and built in one run (dflash_build.snakemake_fixes)."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Workflow, base_config, engine_history, write_jsonl

pytestmark = pytest.mark.workflow


def sources(data: Path, math_rows: list[Any] | None = None) -> dict[str, Any]:
    write_jsonl(data / "code.jsonl", [{"instruction": f"Write function number {i}.", "output": "x"} for i in range(6)])
    math = math_rows or [{"instruction": f"What is {i} + {i}?", "output": "x"} for i in range(5)]
    write_jsonl(data / "math.jsonl", math)
    return {
        "code": {"category": "coding", "files": [str(data / "code.jsonl")], "format": "alpaca"},
        "math": {"category": "math", "files": [str(data / "math.jsonl")], "format": "alpaca"},
    }


def completion_shards(wf: Workflow) -> list[Path]:
    return sorted((wf.workdir / "store" / "completions").rglob("0*.parquet"))


def test_a_defect_prepare_finds_stops_the_build_before_any_generate_job(tmp_path: Path, tiny_model: Path) -> None:
    # 3 of 5 lines malformed, the first two good: the parse-time check of the first rows passes it, and
    # only prepare, reading them all, finds the defect (60% dropped, over max_drop_fraction)
    good = [{"instruction": f"What is {i} + {i}?", "output": "x"} for i in range(2)]
    wf = Workflow.at(tmp_path / "w", base_config(tiny_model, sources(tmp_path / "data", [*good, "{", "[1,", '{"a"'])))
    proc = wf.run(check=False)
    assert proc.returncode == 1
    out = proc.stdout + proc.stderr
    # the prepare of the other source ran and passed, and then nothing generated: no shard, no engine
    assert (wf.workdir / "store" / "prompts" / "code").is_dir()
    assert completion_shards(wf) == [] and "rule generate:" not in out
    assert engine_history(wf.workdir / "logs") == []
    # the defect, and what stopped the build, each in a line that names the source and what to change
    assert "sources.math" in out and "malformed_row: 3" in out
    line = next(li for li in out.splitlines() if "no generate job started" in li)
    assert "math" in line and "code" not in line.split("not prepared:")[1], line
    # fixed, the build goes on from the prepared source
    fixed = [*good, *({"instruction": f"Add {i}.", "output": "x"} for i in range(3))]
    write_jsonl(tmp_path / "data" / "math.jsonl", fixed)
    rerun = wf.run()
    assert "prepare_code" not in rerun.stdout + rerun.stderr
    assert len(completion_shards(wf)) == 4


def recorded_inputs(wf: Workflow, output: Path) -> list[str]:
    """The inputs Snakemake recorded for the job that wrote ``output`` (its metadata file)."""
    rel = str(output.relative_to(wf.workdir))
    name = base64.urlsafe_b64encode(rel.encode()).decode()  # Snakemake's metadata file name
    return json.loads((wf.workdir / ".snakemake" / "metadata" / name).read_text())["input"]


@pytest.mark.parametrize("change", ["a new source", "moved input files"])
def test_what_a_rerun_gate_leaves_to_build_is_listed_and_built_in_one_run(
    tmp_path: Path, tiny_model: Path, change: str
) -> None:
    data = tmp_path / "data"
    config = base_config(tiny_model, sources(data))
    wf = Workflow.at(tmp_path / "w", config)
    wf.build()
    built = completion_shards(wf)
    # the gate is waited for, not recorded: a rule given it reran nothing it made before
    assert all("prepared" not in p for p in recorded_inputs(wf, built[0]))
    # a prepare (or the gate) reruns, and every generate job's request changes in the same edit (the
    # temperature): each of them has inputs from the rerun job that are all ancient and present
    if change == "a new source":
        write_jsonl(data / "extra.jsonl", [{"instruction": f"Say {i}.", "output": "x"} for i in range(3)])
        config["sources"]["extra"] = {"category": "coding", "files": [str(data / "extra.jsonl")], "format": "alpaca"}
    else:
        shutil.move(data, tmp_path / "moved")
        for spec in config["sources"].values():
            spec["files"] = [f.replace(str(data), str(tmp_path / "moved")) for f in spec["files"]]
    config["sampling"]["temperature"] = 0.7
    wf.write_config(config)
    planned = wf.dry_run()
    expected = len(built) + (1 if change == "a new source" else 0)
    assert len(planned.get("generate", [])) == expected, planned.keys()
    wf.build()
    assert len(completion_shards(wf)) == len(built) + expected
    assert "generate" not in wf.dry_run()
