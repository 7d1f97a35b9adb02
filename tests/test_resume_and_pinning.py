"""Production generation on CPU: GPU pinning under Snakemake, and kill -9 then resume."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.conftest import Workflow, base_config, once_per_session, own_engines, write_jsonl

pytestmark = pytest.mark.workflow


def _source(data: Path, n: int) -> dict[str, Any]:
    write_jsonl(data / "p.jsonl", [{"instruction": f"Write line number {i} of a poem."} for i in range(n)])
    return {"poems": {"category": "general", "files": [str(data / "p.jsonl")], "format": "alpaca"}}


GPUS = 2  # fake ones: each job pins one through its lock


def test_twice_as_many_shards_as_fake_gpus_never_share_a_gpu(tmp_path: Path, tiny_model: Path) -> None:
    """Twice as many jobs as GPUs, and more job places than GPUs: the locks, not Snakemake, keep them apart."""
    config = base_config(tiny_model, _source(tmp_path / "data", 2 * GPUS), shard_size=1)
    own_engines(config, tmp_path / "locks", gpus=[str(i) for i in range(GPUS)])  # one engine in each job
    config["sampling"]["max_new_tokens"] = 4
    wf = Workflow(tmp_path / "work")
    wf.workdir.mkdir()
    wf.write_config(config)
    # 2 x GPUS job places: jobs beyond GPUS wait for a lock, so a GPU is never held twice
    wf.run("--resources", f"gpu={2 * GPUS}", "--until", "generate", cores=2 * GPUS)

    stats = [json.loads(p.read_text()) for p in (wf.workdir / "store" / "completions").rglob("*.stats.json")]
    assert len(stats) == 2 * GPUS
    spans = [(s["engine"]["gpu"]["id"], s["started_at"], s["finished_at"]) for s in stats]
    assert all(s["engine"]["gpu"]["via"] == "lock" for s in stats)
    for (gpu_a, start_a, end_a), (gpu_b, start_b, end_b) in itertools.combinations(spans, 2):
        if gpu_a == gpu_b:
            assert end_a <= start_b or end_b <= start_a, f"GPU {gpu_a} held by two jobs at once"
    events = sorted([(start, 1) for _, start, _ in spans] + [(end, -1) for _, _, end in spans])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    assert 1 < peak <= GPUS, f"{peak} jobs held a GPU at once"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[tuple[str, int], list[int]]:

    def build(root: Path) -> None:
        _generate(root, tiny_model)

    return _rows(Workflow(once_per_session(tmp_path_factory, "resume-baseline", build) / "work"))


def _generate(
    root: Path, tiny_model: Path, kill_at: str | None = None
) -> tuple[dict[tuple[str, int], list[int]], Workflow]:
    config = base_config(tiny_model, _source(root / "data", 10), shard_size=16)
    config["engine"]["journal_flush_rows"] = 1
    config["sampling"]["max_new_tokens"] = 4
    wf = Workflow(root / "work")
    wf.workdir.mkdir(exist_ok=True)
    wf.write_config(config)
    if kill_at is not None:
        proc = wf.run("--until", "generate", check=False, env_extra={"DFLASH_BUILD_KILL_AT": kill_at})
        assert proc.returncode != 0, "the killed job fails the run"
        return {}, wf
    wf.run("--until", "generate")
    return _rows(wf), wf


def _rows(wf: Workflow) -> dict[tuple[str, int], list[int]]:
    [shard] = (wf.workdir / "store" / "completions").rglob("00000.parquet")
    return {(r["prompt_id"], r["sample_idx"]): r["output_ids"] for r in pq.read_table(shard).to_pylist()}


@pytest.mark.parametrize(("kill_at", "journaled"), [("rows:0", 0), ("rows:4", 4), ("publish", 10)])
def test_kill_minus_nine_then_rerun_loses_and_repeats_nothing(
    tmp_path: Path, tiny_model: Path, uninterrupted: dict[tuple[str, int], list[int]], kill_at: str, journaled: int
) -> None:
    _, wf = _generate(tmp_path, tiny_model, kill_at)
    store = wf.workdir / "store"
    assert not list((store / "completions").rglob("*.parquet")), "nothing is published by a killed job"
    journal_files = list((store / "journal").rglob("rows.jsonl"))
    assert sum(len(f.read_text().splitlines()) for f in journal_files) == journaled

    resumed, _ = _generate(tmp_path, tiny_model)
    assert len(resumed) == len(uninterrupted) == 10
    assert resumed == uninterrupted, "same rows, same answers (each row has its own seed)"
    [stats_file] = (store / "completions").rglob("*.stats.json")
    stats = json.loads(stats_file.read_text())
    assert stats["resumed_turns"] == journaled
    assert stats["input_rows"] == stats["ok"] + stats["truncated"] + stats["error"] + stats["skipped"] == 10
    assert not list((store / "journal").rglob("rows.jsonl")), "the journal goes once the shard is published"
