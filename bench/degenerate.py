"""The degenerate-answer detector on real answers: what it catches, what it spares, and what the early stop
saves, measured in the same run.

    make demo && .venv/bin/python bench/degenerate.py     # about 6 minutes on 2 cores

writes bench/results/degenerate.json. Two sets:

- **The demo's model looping**: SmolLM2-135M-Instruct (the demo's GGUF, through the transformers backend,
  the demo's engine) answers the demo's prompts (their rendered ids, read from the demo store's
  completions) with 384 new tokens, greedy and at the demo's sampling (T 0.6, top_p 0.95, top_k 20), once
  running every row to its budget and once with the loop rule stopping rows (``degenerate.loop``,
  defaults): rows caught per reason, output tokens and wall time both ways, and whether every stopped row
  is the prefix of its unstopped answer (the rule is one test on each prefix).
- **Answers that repeat for a reason** (false positives): every reference answer of the upstream-shaped
  fixtures (tests/data/upstream: code, tables of tool calls, JSON, math, chat, agent trajectories), the
  hand-picked shapes of tests/data/degenerate/repeats_for_a_reason.jsonl (code with repeated lines, a
  Markdown table, a JSON array, a numbered list, Chinese prose), and SmolLM2's own answers that stopped on
  their own; each tokenized with SmolLM2's tokenizer. Per answer, the longest periodic run (period <= 64)
  is recorded, so the margin below ``min_span`` is visible.
"""

from __future__ import annotations

import contextlib
import glob
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from dflash_build import config as config_mod  # noqa: E402
from dflash_build.engines.base import Request, SamplingParams  # noqa: E402
from dflash_build.spec import Degenerate  # noqa: E402
from dflash_build.stages.common import chat, degenerate  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "degenerate.json"
FALSE_POSITIVES = REPO / "tests" / "data" / "degenerate" / "repeats_for_a_reason.jsonl"
BUDGET = 384
SAMPLINGS = {"greedy": SamplingParams(0.0, 1.0, 0, 0.0, BUDGET), "T0.6": SamplingParams(0.6, 0.95, 20, 0.0, BUDGET)}


def longest_run(ids: list[int], max_period: int = 64) -> tuple[int, int]:
    """(span, period) of the longest stretch of ``ids`` that repeats a span of period <= max_period at least
    twice (what the loop rule measures against ``min_span``); (0, 0) for none."""
    a = np.asarray(ids, dtype=np.int64)
    best = (0, 0)
    for p in range(1, min(max_period, len(a) - 1) + 1):
        same = a[p:] == a[:-p]
        if not same.any():
            continue
        idx = np.arange(len(same))
        runs = idx - np.maximum.accumulate(np.where(same, -1, idx))
        if int(runs.max()) < p:  # not two whole periods: no repeat
            continue
        span = int(runs.max()) + p
        if span > best[0]:
            best = (span, p)
    return best


def upstream_answers() -> list[tuple[str, str]]:
    """Every reference answer the upstream-shaped fixtures hold, by where it is from."""
    up = REPO / "tests" / "data" / "upstream"
    out: list[tuple[str, str]] = []

    def texts(value: Any) -> list[str]:
        if isinstance(value, str):
            return [value]
        if isinstance(value, dict):
            role = value.get("role") or value.get("from")
            content = value.get("content") or value.get("value")
            if role in ("assistant", "gpt") and isinstance(content, str):
                return [content]
            return [t for v in value.values() for t in texts(v)] if role is None else []
        if isinstance(value, list):
            return [t for v in value for t in texts(v)]
        return []

    answer_columns = {"output", "answer", "canonical_solution", "code", "solution", "response", "messages",
                      "conversations", "conversation", "trajectory"}  # fmt: skip
    for path in sorted(up.rglob("*")):
        rows: list[dict[str, Any]] = []
        if path.suffix == ".parquet":
            rows = pq.read_table(path).to_pylist()
        elif path.suffix == ".jsonl":
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        elif path.suffix == ".json":
            rows = json.loads(path.read_text())
        for row in rows if isinstance(rows, list) else []:
            for column in answer_columns & set(row):
                value = row[column]
                if isinstance(value, str) and value.startswith("["):
                    with contextlib.suppress(ValueError):
                        value = json.loads(value)
                out += [(path.relative_to(up).parts[0], t) for t in texts(value) if len(t) > 40]
    return out


def demo_requests() -> tuple[list[tuple[str, list[int]]], list[list[int]]]:
    """The demo's rendered prompts (one per prompt id) and SmolLM2's answers that stopped on their own."""
    prompts: dict[str, list[int]] = {}
    stopped: list[list[int]] = []
    for path in sorted(glob.glob(str(REPO / "store" / "demo" / "completions" / "*" / "*" / "*.parquet"))):
        for row in pq.read_table(path, columns=["prompt_id", "prompt_ids", "output_ids", "finish_reason"]).to_pylist():
            prompts.setdefault(row["prompt_id"], row["prompt_ids"])
            if row["finish_reason"] == "stop":
                stopped.append(row["output_ids"])
    if not prompts:
        raise SystemExit("no demo completions under store/demo: run `make demo` first")
    return sorted(prompts.items()), stopped


def false_positives(tokenizer: Any, stopped: list[list[int]], cfg: Degenerate) -> dict[str, Any]:
    sets: dict[str, list[list[int]]] = {}
    for where, text in upstream_answers():
        sets.setdefault(f"upstream/{where}", []).append(chat.encode(tokenizer, text))
    for row in (json.loads(line) for line in FALSE_POSITIVES.read_text().splitlines() if line.strip()):
        sets.setdefault(f"repeats_for_a_reason/{row['shape']}", []).append(chat.encode(tokenizer, row["text"]))
    sets["smollm2/stopped on its own"] = stopped
    detector = degenerate.Detector.for_tokenizer(cfg, tokenizer)
    out = {}
    for name, answers in sets.items():
        runs = [longest_run(a) for a in answers]
        caught = [detector.reason([], a, "stop") for a in answers]
        out[name] = {
            "answers": len(answers),
            "caught": {r: caught.count(r) for r in set(caught) if r is not None},
            "longest_run": max(runs)[0] if runs else 0,
            "min_distinct_4gram": round(min(degenerate.distinct_ratio(a, 4) for a in answers if len(a) >= 8), 3),
        }
    return out


def generate(model: str, stop_ids: list[int], requests: list[Request]) -> tuple[dict[str, Any], float]:
    from dflash_build.engines.transformers_backend import TransformersEngine

    engine = TransformersEngine(model, {"device": "cpu", "dtype": "float32", "batch_size": 8, "threads": 2}, stop_ids)
    start = time.perf_counter()
    results = {r.prompt_id: r for r in engine.generate(requests)}
    return results, time.perf_counter() - start


def main() -> None:
    """The whole bench; with ``--false-positives``, only that set again, into the results of the last run."""
    cfg = config_mod.load(REPO / "config" / "demo.yaml")
    if sys.argv[1:] == ["--false-positives"]:
        tokenizer = chat.load_tokenizer(cfg.model)
        report = json.loads(RESULTS.read_text())
        report["false_positives"] = false_positives(tokenizer, demo_requests()[1], cfg.degenerate)
        for name, got in report["false_positives"].items():
            print(f"{name:<55} {got}")
        RESULTS.write_text(json.dumps(report, indent=2) + "\n")
        return
    tokenizer = chat.load_tokenizer(cfg.model)
    stop_ids = chat.stop_token_ids(tokenizer, cfg.model.path)
    prompts, stopped = demo_requests()
    rule = cfg.degenerate.loop
    detector = degenerate.Detector.for_tokenizer(cfg.degenerate, tokenizer)
    report: dict[str, Any] = {"model": cfg.model.path, "budget": BUDGET, "rule": rule.as_dict()}
    report["prompts"] = len(prompts)
    for name, params in SAMPLINGS.items():
        runs = {}
        for stop in (None, rule):
            requests = [Request(pid, 0, ids, params, 1000 + i, stop) for i, (pid, ids) in enumerate(prompts)]
            results, wall = generate(cfg.model.path, stop_ids, requests)
            runs["stopped" if stop else "whole"] = (results, wall)
        whole, wall_whole = runs["whole"]
        cut, wall_cut = runs["stopped"]
        reasons = {pid: detector.reason(ids, whole[pid].output_ids, whole[pid].finish_reason) for pid, ids in prompts}
        loops = [pid for pid, r in reasons.items() if r == degenerate.LOOP]
        stopped_rows = [pid for pid in cut if cut[pid].finish_reason == "loop"]
        report[name] = {
            "caught": {r: list(reasons.values()).count(r) for r in degenerate.REASONS},
            "ran_to_budget": sum(r.finish_reason == "length" for r in whole.values()),
            "loops_stopped": len(stopped_rows),
            "stopped_rows_are_loops_after_the_fact": sorted(stopped_rows) == sorted(loops),
            "stopped_rows_are_prefixes": all(
                whole[pid].output_ids[: len(cut[pid].output_ids)] == cut[pid].output_ids for pid in stopped_rows
            ),
            "loop_periods": sorted(longest_run(whole[pid].output_ids)[1] for pid in loops),
            "output_tokens_whole": sum(len(r.output_ids) for r in whole.values()),
            "output_tokens_stopped": sum(len(r.output_ids) for r in cut.values()),
            "loop_tokens_whole": sum(len(whole[pid].output_ids) for pid in loops),
            "loop_tokens_stopped": sum(len(cut[pid].output_ids) for pid in stopped_rows),
            "wall_seconds_whole": round(wall_whole, 1),
            "wall_seconds_stopped": round(wall_cut, 1),
        }
        r = report[name]
        r["output_tokens_ratio"] = round(r["output_tokens_stopped"] / r["output_tokens_whole"], 3)
        r["wall_ratio"] = round(wall_cut / wall_whole, 3)
        print(name, json.dumps(r), flush=True)
    report["false_positives"] = false_positives(tokenizer, stopped, cfg.degenerate)
    for name, got in report["false_positives"].items():
        print(f"{name:<55} {got}")
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
