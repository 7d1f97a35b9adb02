"""The workflow on a real SLURM cluster through profiles/slurm (snakemake-executor-plugin-slurm).

A single-node cluster with 4 fake GPUs runs the pipeline with the tiny model; the dataset must equal the
one a local run builds, every job must have run as a SLURM job, the generate jobs of one group must have
shared one engine in one allocation, and each shard's tokenize job must have run in that allocation too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dflash_build.engines import host as engine_host
from dflash_build.publish import release
from dflash_build.store import layout
from tests import slurm_cluster
from tests.conftest import REPO, Workflow, base_config, completion_rows, own_engines, write_jsonl

pytestmark = pytest.mark.workflow

SHARDS = 4  # 2 + 2 generate jobs, in groups of 2: two allocations, at once, on two of the node's GPUs
GROUP = 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    why = slurm_cluster.missing()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the SLURM test: {why}")
        pytest.skip(why)
    with slurm_cluster.cluster(tmp_path_factory.mktemp("slurm")) as root:
        yield root


def _workflow(root: Path, model: Path, on_cluster: bool = False, train: dict[str, Any] | None = None) -> Workflow:
    """The test's config: on the cluster, engines of its own (locks and ports), else the worker's
    engine; no engine setting is in any key, so both build the same dataset (``train``, not part of the
    build, neither)."""
    data = root / "data"
    write_jsonl(data / "p.jsonl", [{"instruction": f"Write line number {i} of a poem."} for i in range(6)])
    write_jsonl(data / "q.jsonl", [{"instruction": f"Add {i} and {i + 1}."} for i in range(6)])
    sources = {
        "poems": {"category": "general", "files": [str(data / "p.jsonl")], "format": "alpaca"},
        "sums": {"category": "math", "files": [str(data / "q.jsonl")], "format": "alpaca"},
    }
    config = base_config(model, sources, shard_size=3)
    if on_cluster:  # fake GPU ids: the cluster run takes the ones SLURM assigns
        own_engines(config, root / "locks", gpus=["0", "1"], shared=True)
    config["sampling"]["max_new_tokens"] = 8
    if train is not None:
        config["train"] = train
    wf = Workflow(root / "work")
    wf.workdir.mkdir(parents=True, exist_ok=True)
    wf.write_config(config)
    return wf


def _dataset(wf: Workflow) -> list[tuple[str, str]]:
    manifest = json.loads((wf.workdir / "dist" / "test-mix" / "manifest.json").read_text())
    return [(f["path"], f["sha256"]) for f in manifest["files"]]


def _on_cluster(wf: Workflow, cluster: Path, *targets: str) -> str:
    """``targets`` built through profiles/slurm; Snakemake's output (with what the cluster says where it
    failed, which Snakemake's output does not show)."""
    proc = wf.run(
        *targets,  # first: --set-resources takes every word after it
        *("--profile", str(REPO / "profiles" / "slurm")),
        "--slurm-no-account",  # no accounting database here
        *("--slurm-init-seconds-before-status-checks", "1", "--seconds-between-status-checks", "2"),
        *("--latency-wait", "5", "--slurm-keep-successful-logs"),
        *("--group-components", f"generate_batch={GROUP}"),
        # the profile's production sizes do not fit this 16 GB node
        # (set-resources on the command line replace the profile's: generate's GPU request is repeated)
        *("--default-resources", "mem_mb=500", "runtime=10", "--set-resources", "generate:mem_mb=1000"),
        *("generate:gpu=1", "generate:gpu_jobs=0", "mix:mem_mb=1000", "train:mem_mb=3000"),
        check=False,
    )
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        slurm_logs = [p.read_text()[-3000:] for p in sorted((wf.workdir / ".snakemake").rglob("slurm_logs/**/*.log"))]
        daemons = [p.read_text()[-3000:] for p in sorted((cluster / "log").glob("*.log"))]
        raise AssertionError("\n----\n".join([log[-6000:], *slurm_logs[-3:], *daemons]))
    return log


# Automodel's DFlash recipe on the CPU, a few steps, for a Qwen3 of the tiny model's tokenizer (the recipes
# train for Qwen3 (DFlash) or for a Llama of three layers or more (EAGLE-3); the tiny model is a Llama of two)
TRAIN = {
    "trainer": "automodel",
    "gpus": 0,
    "settings": {
        "recipe_args": {"mask_token_id": 3, "block_size": 4, "num_anchors": 8, "micro_batch_size": 4},
        "optimizer": {"lr": 1e-3},
    },
}


def test_the_workflow_runs_on_slurm_and_builds_the_local_dataset(
    cluster: Path, tmp_path: Path, tiny_model: Path, vllm_model: Path, automodel_python: Path
) -> None:
    """The build through SLURM equals the local one; then `snakemake train` is one SLURM job that publishes
    the drafter."""
    local = _workflow(tmp_path / "local", tiny_model)
    local.build()

    train = {**TRAIN, "python": str(automodel_python), "target": str(vllm_model)}  # SmolLM2's tokenizer too
    wf = _workflow(tmp_path / "slurm", tiny_model, on_cluster=True, train=train)
    log = _on_cluster(wf, cluster)

    assert _dataset(wf) == _dataset(local), "SLURM must build the very dataset a local run builds"
    assert completion_rows(wf.workdir / "store") == completion_rows(local.workdir / "store")

    # every job but the target rule was a SLURM job; the shards went in groups of GROUP, each shard's
    # generate and tokenize jobs in one allocation
    submission = r"Job \S+ has been submitted with SLURM jobid (\d+) \(log: (\S*/slurm_logs/([^/]+)/\S+)\)"
    submitted = re.findall(submission, log)
    kinds = ["group_generate_batch" if k.startswith("group_generate_batch") else k for _, _, k in submitted]
    assert sorted(kinds) == sorted(
        ["rule_prepare_poems", "rule_prepare_sums", "rule_mix"] + ["group_generate_batch"] * (SHARDS // GROUP)
    ), log[-4000:]
    assert "localrule all" in log and "localrule generate" not in log and "localrule tokenize" not in log
    groups = {sid: Path(path) for sid, path, kind in submitted if kind.startswith("group_")}  # SLURM id: its log
    for group_log in groups.values():
        ran = group_log.read_text()
        # each listed by the allocation's Snakemake, then run by its own job step (srun)
        assert ran.count("rule generate:") == ran.count("rule tokenize:") == 2 * GROUP, ran[-3000:]

    stats = [json.loads(p.read_text()) for p in (wf.workdir / "store" / "completions").rglob("*.stats.json")]
    assert len(stats) == SHARDS
    assert {s["scheduler_job"] for s in stats} == set(groups), "each shard records the allocation that wrote it"
    assert all(s["engine"]["gpu"]["via"] == "scheduler" for s in stats)
    # one engine per allocation, started by its first job and used by all of its jobs
    for job in groups:
        mine = [s for s in stats if s["scheduler_job"] == job]
        assert len(mine) == GROUP
        assert sum(s["engine"]["served"]["started_here"] for s in mine) == 1
        assert {e["slot"] for s in mine for e in s["engine"]["served"]["engines"]} == {
            f"job-{job}.gpu-{mine[0]['engine']['gpu']['node_gpu']}"
        }, "engines serve their own allocation only"
    history_file = wf.workdir / "logs" / "engines" / "engines.jsonl"
    history = [json.loads(line) for line in history_file.read_text().splitlines()]
    assert len(history) == 2 and all(h["reason"] == "allocation ended" for h in history), history
    assert not engine_host.running(tmp_path / "slurm" / "locks")
    queue = subprocess.run(["squeue", "-h"], capture_output=True, text=True, check=True).stdout
    assert not queue.strip(), f"jobs left in the queue:\n{queue}"

    trained = _on_cluster(wf, cluster, "train")
    assert [k for _, _, k in re.findall(submission, trained)] == ["rule_train"], trained[-4000:]
    assert "localrule train" not in trained
    version = release.current(wf.workdir / "dist" / "test-mix-drafter")
    assert version is not None, "the drafter is published"
    record = json.loads((version / layout.TRAINED_RECORD).read_text())
    assert record["trainer"]["recipe"] == "dflash" and record["run"]["steps"] > 0, record
    assert record["dataset"]["version"] == release.current(wf.workdir / "dist" / "test-mix").name
