"""One story after a loss: a dataset that stands while store shards it was built from are gone is told the
same by `snakemake -n`, `plan`, `verify` and `status` (dflash_build.ops.standing), and what they say is
what a build does."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Workflow, parse_dry_run

pytestmark = pytest.mark.workflow


def stories(wf: Workflow) -> dict[str, str]:
    dry = wf.run("-n")
    said = {"-n": dry.stdout + dry.stderr}
    for command in ("plan", "verify", "status"):
        proc = wf.cli(command, check=False)
        said[command] = proc.stdout + proc.stderr
    return said


def the_line(text: str) -> str:
    [line] = [li for li in text.splitlines() if " stands: " in li]
    return line.removeprefix("dflash-build: ")


def test_a_dataset_over_a_lost_store_is_one_story_from_every_tool(
    operated_store: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    wf = Workflow(operated_store[0]).copy_to(tmp_path / "w")
    # one of the two shards lost: its answers and samples (the journal's published copy stays)
    for kind in ("completions", "tokens"):
        for path in (wf.workdir / "store" / kind).rglob("00001.*"):
            path.unlink()
    said = stories(wf)
    assert "Nothing to be done" in said["-n"] and parse_dry_run(said["-n"]) == {}
    lines = {tool: the_line(text) for tool, text in said.items()}
    assert lines["plan"].startswith("dataset dist/test-mix stands: 1 of the 2 store shards it was built from are ")
    assert "missing (objs/00001); a build runs nothing for them while it stands" in lines["plan"]
    # every tool says the same; plan adds what making them again costs, the others send there for it
    assert lines["plan"].endswith(": 0 rows to generate, 10 reused"), lines["plan"]  # from the journal's copy
    common = lines["plan"].rsplit(": ", 1)[0]
    for tool in ("-n", "verify", "status"):
        assert lines[tool] == common + " (`dflash-build plan` counts their rows)", (tool, lines[tool])
    # ... and agree with the build: nothing to generate, the build is done, nothing of the dataset is bad
    assert "total: 0 generate jobs, 0 rows to generate" in said["plan"], said["plan"]
    assert said["status"].splitlines()[0].endswith("done"), said["status"]
    assert "BAD dist" not in said["verify"] and "BAD store/completions" not in said["verify"], said["verify"]
    built = wf.build()
    assert "rule generate" not in built.stdout + built.stderr

    # a change to the mix makes the dataset again: then every tool counts the lost shard as work, no line
    config = copy.deepcopy(operated_store[1])  # the session's fixture: other tests read it as it was
    config["checks"]["share_tolerance"] = 0.2
    wf.write_config(config)
    said = stories(wf)
    assert all(" stands: " not in text for text in said.values()), said
    assert [job["shard"] for job in parse_dry_run(said["-n"])["generate"]] == ["00001"]
    assert "total: 1 generate jobs, 0 rows to generate" in said["plan"], said["plan"]  # its rows come back reused
    assert "rows 10/20" in said["status"], said["status"]
    wf.build()
    assert {p.name for p in (wf.workdir / "store" / "completions").rglob("*.parquet")} == {
        "00000.parquet",
        "00001.parquet",
    }


def test_every_store_shard_lost_under_the_dataset(operated_store: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    wf = Workflow(operated_store[0]).copy_to(tmp_path / "w")
    for kind in ("completions", "tokens"):
        shutil.rmtree(wf.workdir / "store" / kind)
    said = stories(wf)
    lines = {tool: the_line(text) for tool, text in said.items()}
    assert "2 of the 2 store shards it was built from are missing (objs/00000, objs/00001)" in lines["verify"]
    assert lines["-n"] == lines["verify"] == lines["status"]
    assert lines["plan"].startswith(lines["verify"].split(" (`dflash-build plan`")[0])
    assert "total: 0 generate jobs" in said["plan"]
