"""Generate to the mix (issue 39): under ``mix.generate: as_needed`` a source is generated only as far down
its shards as its category's target needs, sized on a pilot and topped up once.

Real workflow, tiny model (transformers backend). Two categories whose answers differ eightfold (24
new tokens against 3); the long category's first shard holds its longest prompts, so the pilot
overestimates its tokens per sample, the first round falls short and the second tops it up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from dflash_build import killpoints
from dflash_build.stages.prepare.identity import prompt_id
from dflash_build.store import layout
from tests.conftest import Workflow, base_config, parse_dry_run, write_jsonl

pytestmark = pytest.mark.workflow

SHARD_SIZE = 8
LONG_ROWS, SHORT_ROWS = 64, 48


def _pid(text: str) -> int:
    return int(prompt_id([{"role": "user", "content": text}], None), 16)


def _long_source_rows() -> list[dict[str, str]]:
    """Short prompts, except the first shard's (the smallest prompt ids), which are long."""
    longs = sorted(
        (f"Explain in detail topic {i}: " + "why and how it works, step by step. " * 6 for i in range(40)), key=_pid
    )
    first = longs[:SHARD_SIZE]
    shorts = [t for t in (f"Explain topic {i}." for i in range(400)) if _pid(t) > _pid(first[-1])]
    return [{"instruction": t} for t in first + shorts[: LONG_ROWS - SHARD_SIZE]]


def _config(root: Path, model: Path, generate: str) -> dict[str, Any]:
    long = write_jsonl(root / "long.jsonl", _long_source_rows())
    short = write_jsonl(root / "short.jsonl", [{"instruction": f"Name a tool {i}."} for i in range(SHORT_ROWS)])
    config = base_config(
        model,
        {
            "long": {
                "category": "coding",
                "files": [str(long)],
                "format": "alpaca",
                "sampling": {"max_new_tokens": 24},
            },
            "short": {
                "category": "agent",
                "files": [str(short)],
                "format": "alpaca",
                "sampling": {"max_new_tokens": 3},
            },
        },
        store="store",
        shard_size=SHARD_SIZE,
    )
    config["mix"] = {"categories": {"coding": 0.5, "agent": 0.5}, "generate": generate}
    config["checks"]["share_tolerance"] = 0.05
    return config


def _generated_shards(workdir: Path, source: str) -> set[str]:
    return {p.stem for p in (workdir / "store" / "completions" / source).glob("*/*.parquet")}


def _kill_once_sized(wf: Workflow, round_: int) -> None:
    """Start the build and SIGKILL Snakemake and every job the moment sizing round ``round_`` is written."""
    sizing = wf.workdir / layout.sizing_file("logs", "test-mix", round_)
    cmd, env = wf.command()
    proc = subprocess.Popen(
        cmd, cwd=wf.workdir, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 600
    while not sizing.exists():
        assert proc.poll() is None and time.monotonic() < deadline, f"the build ended before {sizing} was written"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    wf.run("--unlock")


def _manifest(workdir: Path) -> dict[str, Any]:
    return json.loads((workdir / "dist" / "test-mix" / "manifest.json").read_text())


def test_as_needed_generates_what_the_mix_takes_topping_up_once_and_all_regenerates_nothing(
    tmp_path: Path, tiny_model: Path
) -> None:
    wf = Workflow.at(tmp_path / "work", _config(tmp_path, tiny_model, "as_needed"))
    pilot = parse_dry_run(wf.run("-n").stdout)
    assert sorted(j["shard"] for j in pilot["generate"]) == ["00000", "00000"], "the dry run shows the pilot"
    assert "size_pilot" in pilot, "with the checkpoint that sizes the first round"
    planned = wf.cli("plan", "--jobs").stdout
    assert "binding: agent (taken whole)" in planned and "would be left out by the mix" in planned, planned
    assert "as needed (mix.generate): shards per source long" in planned
    jobs = {line.split()[1] for line in planned.splitlines() if line.startswith("generate ")}
    assert jobs == {"long/00000", "short/00000"}, "plan lists the pilot, as the dry run does"

    # stopped after the pilot: the dry run shows the first round, not the pilot again
    wf.run("--until", "size_pilot")
    assert _generated_shards(wf.workdir, "long") == _generated_shards(wf.workdir, "short") == {"00000"}
    later = parse_dry_run(wf.run("-n").stdout)
    assert {j["shard"] for j in later.get("generate", [])} and "00000" not in {j["shard"] for j in later["generate"]}
    # Snakemake and its jobs killed between the rounds, as a lost node would be, then a top-up job killed
    # after its first row: the reruns generate no row again
    _kill_once_sized(wf, round_=2)
    crashed = wf.run("--rerun-incomplete", check=False, env_extra={killpoints.KILL_AT_ENV: "rows:1"})
    assert crashed.returncode != 0, "a top-up job died after its first row"
    wf.run("--rerun-incomplete")
    assert "total: 0 generate jobs" in wf.cli("plan").stdout
    status = json.loads(wf.cli("status", "--json").stdout)
    assert status["done"], "status counts the shards the sizing asked for, not every shard"

    rounds = [json.loads((wf.workdir / layout.sizing_file("logs", "test-mix", n)).read_text()) for n in (1, 2)]
    assert rounds[0]["shards"]["short"] == rounds[1]["shards"]["short"] == SHORT_ROWS // SHARD_SIZE, "agent binds"
    assert rounds[1]["shards"]["long"] > rounds[0]["shards"]["long"] > 1, "the pilot's estimate was short: one top-up"
    assert rounds[1]["measured"]["long"]["tokens_per_sample"] < rounds[0]["measured"]["long"]["tokens_per_sample"]
    assert len(list((wf.workdir / "logs" / "sizing").glob("*.json"))) == 2, "one top-up and no more"
    needed = rounds[1]["shards"]["long"]
    assert _generated_shards(wf.workdir, "long") == {f"{i:05d}" for i in range(needed)}
    assert needed < LONG_ROWS // SHARD_SIZE, "the mix leaves the rest of the long source out"
    resumed = 0
    for stats in (wf.workdir / "store" / "completions").glob("*/*/*.stats.json"):
        got = json.loads(stats.read_text())
        assert got["generated"] + got["resumed_turns"] == got["input_rows"], f"{stats}: a row was generated twice"
        resumed += got["resumed_turns"]
    assert resumed >= 1, "the crashed job's rows were resumed, not generated again"

    as_needed = _manifest(wf.workdir)
    use = as_needed["use"]
    assert use["used_share"] >= 0.9, use
    for c in as_needed["mix"]["categories"].values():
        assert abs(c["achieved_share"] - c["target_share"]) <= 0.05

    # the same config generating every prompt: the rest of the long source, and the mix leaves most out
    every = wf.copy_to(tmp_path / "every")
    every.write_config(_config(tmp_path, tiny_model, "all"))
    every.build()
    assert len(_generated_shards(every.workdir, "long")) == LONG_ROWS // SHARD_SIZE
    under_all = _manifest(every.workdir)["use"]
    assert under_all["generated_tokens"] > 1.5 * use["generated_tokens"]
    assert under_all["used_share"] < 0.75 < 0.9 <= use["used_share"]
    assert under_all["used_tokens"] == pytest.approx(use["used_tokens"], rel=0.05)


def test_a_raised_share_is_listed_by_plan_and_the_dry_run_before_the_build_generates_it(
    tmp_path: Path, tiny_model: Path
) -> None:
    config = _config(tmp_path, tiny_model, "as_needed")
    wf = Workflow.at(tmp_path / "work", config)
    wf.build()
    before = _generated_shards(wf.workdir, "long")
    assert wf.dry_run() == {} and "not listed below" not in wf.run("-n").stderr
    # more of the coding category: agent binds (taken whole), so coding's target grows with its share
    config["mix"]["categories"] = {"coding": 0.7, "agent": 0.3}
    wf.write_config(config)
    planned = wf.cli("plan", "--jobs").stdout
    jobs = sorted(line.split()[1] for line in planned.splitlines() if line.startswith("generate "))
    assert jobs and all(j.startswith("long/") for j in jobs), planned
    line = next(li for li in planned.splitlines() if li.startswith("as needed (mix.generate): the size jobs will name"))
    assert f"(+{len(jobs)} to generate)" in line, line
    total = next(li for li in planned.splitlines() if li.startswith("total:"))
    assert total.startswith(f"total: {len(jobs)} generate jobs"), total
    # the dry run lists the sizing it reruns, and says in one line which jobs come after it
    dry = wf.run("-n")
    note = next(li for li in dry.stderr.splitlines() if "not listed below will run too" in li)
    assert note.startswith(f"dflash-build: {len(jobs)} generate jobs") and jobs[0] in note, note
    assert "size_pilot" in parse_dry_run(dry.stdout)
    wf.build()
    added = sorted(f"long/{s}" for s in _generated_shards(wf.workdir, "long") - before)
    assert added == jobs, (added, jobs, line)
    assert "total: 0 generate jobs" in wf.cli("plan").stdout
    assert not _manifest(wf.workdir)["use"]["unread"], "the mix reads every shard built"
    # the share back down: the shards the raise added stay in the store, and the card counts them apart
    config["mix"]["categories"] = {"coding": 0.5, "agent": 0.5}
    wf.write_config(config)
    wf.build()
    unread = _manifest(wf.workdir)["use"]["unread"]
    assert list(unread) == ["long"] and unread["long"]["shards"] == len(jobs) and unread["long"]["tokens"] > 0
    card = (wf.workdir / "dist" / "test-mix" / "README.md").read_text()
    assert f"also generated: {unread['long']['tokens']} tokens in {len(jobs)} shards the current sizing" in card


def test_an_oversampled_category_generates_its_factor_for_the_mix_to_choose_from(
    tmp_path: Path, tiny_model: Path
) -> None:
    """mix.by_acceptance.CATEGORY.oversample (issue 70): plan prices it, the size jobs run again and name
    that much more of the category, only the shards it adds are generated, and the mix's targets stay."""
    config = _config(tmp_path, tiny_model, "as_needed")
    wf = Workflow.at(tmp_path / "work", config)
    wf.build()
    before = _generated_shards(wf.workdir, "long")
    targets = {c: v["target_tokens"] for c, v in _manifest(wf.workdir)["mix"]["categories"].items()}
    config["mix"]["by_acceptance"] = {"coding": {"fraction": 0.5, "oversample": 1.5}}
    wf.write_config(config)
    planned = wf.cli("plan", "--jobs").stdout
    line = next(li for li in planned.splitlines() if li.startswith("oversampling (mix.by_acceptance.coding.oversample"))
    jobs = sorted(li.split()[1] for li in planned.splitlines() if li.startswith("generate "))
    assert jobs and all(j.startswith("long/") for j in jobs), planned
    assert "GPU-hours, for the mix to choose from" in line, line
    wf.build()
    added = sorted(f"long/{s}" for s in _generated_shards(wf.workdir, "long") - before)
    assert added == jobs, (added, jobs)
    sizing = json.loads((wf.workdir / layout.sizing_file("logs", "test-mix", 2)).read_text())
    assert sizing["params"]["oversample"] == {"coding": 1.5} and sizing["shards"]["long"] == len(before) + len(jobs)
    manifest = _manifest(wf.workdir)
    coding = manifest["mix"]["categories"]["coding"]
    assert coding["available_tokens"] >= 1.3 * coding["target_tokens"], "a choice: more generated than taken"
    assert {c: v["target_tokens"] for c, v in manifest["mix"]["categories"].items()} == targets, "the targets stay"
    assert "total: 0 generate jobs" in wf.cli("plan").stdout
