"""GPU pinning under Snakemake, on fake GPUs: each generate job holds one through its lock. (Kill and
resume: tests/test_faults.py.)"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Workflow, base_config, own_engines, write_jsonl

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
