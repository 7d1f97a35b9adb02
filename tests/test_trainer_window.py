"""trainer.max_length: no token generated past the trainer's window, rows that reach it kept as
complete samples, and a later window continuing (or cutting) them to exactly what a fresh build at
that window writes, through Snakemake on the tiny model."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from dflash_build import config as config_mod
from dflash_build import plan as plan_mod
from tests.conftest import Workflow, base_config, write_jsonl

pytestmark = pytest.mark.workflow

MAX_NEW_TOKENS = 24
PROMPTS = [f"Write line number {i} of a poem about the sea." for i in range(7)]
LONG_PROMPT = "Describe " + " ".join(["a very long and winding road"] * 8)  # leaves no room in the window


def _config(root: Path, model: Path, window: int) -> dict[str, Any]:
    data = write_jsonl(root / "p.jsonl", [{"instruction": p} for p in [*PROMPTS, LONG_PROMPT]])
    config = base_config(model, {"poems": {"category": "general", "files": [str(data)], "format": "alpaca"}})
    config.update(shard_size=8, truncated="drop", trainer={"max_length": window, "min_new_tokens": 4})
    config["sampling"]["max_new_tokens"] = MAX_NEW_TOKENS
    return config


def _completions(wf: Workflow) -> Path:
    """The completion folder of the workflow's current gen key."""
    with contextlib.chdir(wf.workdir):  # the config's paths are relative to it
        return wf.workdir / plan_mod.build(config_mod.load("config.yaml")).completion_dir("poems")


def _rows(wf: Workflow) -> dict[tuple[str, int], dict[str, Any]]:
    """The completions of the workflow's current gen key, by row."""
    folder = _completions(wf)
    return {
        (r["prompt_id"], r["sample_idx"]): {k: r[k] for k in ("prompt_ids", "output_ids", "finish_reason", "error")}
        for path in sorted(folder.glob("*.parquet"))
        for r in pq.read_table(path).to_pylist()
    }


def _fresh(root: Path, model: Path, window: int) -> dict[tuple[str, int], dict[str, Any]]:
    wf = Workflow.at(root / "work", _config(root, model, window))
    wf.run("--until", "generate")
    return _rows(wf)


def _without_error(rows: dict[tuple[str, int], dict[str, Any]]) -> dict[tuple[str, int], Any]:
    return {k: {**r, "error": None} for k, r in rows.items()}


def test_the_trainer_window_bounds_every_row_and_a_later_window_continues_or_cuts_them(
    tmp_path: Path, tiny_model: Path
) -> None:
    small, large, smaller = 56, 64, 50  # the prompts are about 42 tokens
    wf = Workflow.at(tmp_path / "a" / "work", _config(tmp_path / "a", tiny_model, small))
    summary = wf.build().stdout
    rows = _rows(wf)
    assert len(rows) == len(PROMPTS) + 1
    [skipped] = [r for r in rows.values() if r["finish_reason"] == "skipped"]
    assert skipped["error"].startswith("outside the trainer's window: prompt of"), skipped["error"]
    assert "in trainer.max_length 56 (trainer.min_new_tokens 4)" in skipped["error"], skipped["error"]
    windowed = 0
    for r in rows.values():
        if r["finish_reason"] == "skipped":
            continue
        length = len(r["prompt_ids"]) + len(r["output_ids"]) + (r["finish_reason"] == "stop")
        assert length <= small, "no token past the window"
        budget = min(MAX_NEW_TOKENS, small - len(r["prompt_ids"]))
        if r["finish_reason"] == "window":
            windowed += 1
            assert length == small and budget < MAX_NEW_TOKENS
        assert r["finish_reason"] in ("stop", "window")
    assert windowed > 0, "the tiny model rarely stops: most rows reach the window"
    [stats] = [json.loads(p.read_text()) for p in (wf.workdir / "store" / "completions").rglob("*.stats.json")]
    assert stats["window"] == windowed and stats["skipped"] == stats["outside_window"] == 1 and stats["truncated"] == 0
    dataset = [
        r
        for p in sorted((wf.workdir / "dist" / "test-mix" / "data").glob("*.parquet"))
        for r in pq.read_table(p).to_pylist()
    ]
    assert len(dataset) == len(rows) - 1, "truncated: drop keeps the rows that ended at the window"
    assert all(len(r["input_ids"]) <= small for r in dataset)
    assert sum(r["finish_reason"] == "window" for r in dataset) == windowed
    [header] = [line for line in summary.splitlines() if line.startswith("source ")]
    assert "truncated  at window" in header, "the card and the summary show the rows that ended at the window"
    card = (wf.workdir / "dist" / "test-mix" / "README.md").read_text()
    assert f"| {windowed / len(rows):.1%} |" in card
    assert "| outside window |" in card and f"| {windowed / len(rows):.1%} | 1 | 0.0% |" in card, "never a failure"
    # plan counted it before any GPU time, by rendering the prepared prompts at each turn position
    [outside] = [line for line in wf.cli("plan").stdout.splitlines() if line.startswith("outside trainer.max_length")]
    assert outside.startswith("outside trainer.max_length 56 (") and outside.endswith(": poems turn 0: 1 of 8 prompts")

    # a larger window continues the rows that ended at the smaller one; a smaller one cuts them
    for window in (large, smaller):
        wf.write_config(_config(tmp_path / "a", tiny_model, window))
        # the window's line (its numbers: tests/test_operate.py); an answer a window cut says nothing about
        # the answer without it, so only answers that stopped count, and the tiny model seldom stops
        planned = [line for line in wf.cli("plan").stdout.splitlines() if line.startswith("trainer.max_length")]
        assert len(planned) == 1 and planned[0].startswith(f"trainer.max_length {window}")
        assert "no answer of this model in the store" in planned[0] or "tokens past the window" in planned[0]
        wf.run("--until", "generate")
        expected = _fresh(tmp_path / f"fresh-{window}", tiny_model, window)
        got = _rows(wf)
        assert _without_error(got) == _without_error(expected), f"window {window}: as a fresh build"
        [stats] = [json.loads(p.read_text()) for p in _completions(wf).glob("*.json")]
        reused = stats["reused"] + stats.get("continued", 0)
        assert reused >= len(PROMPTS) - 1, f"window {window}: rows were continued or cut, not generated anew: {stats}"
