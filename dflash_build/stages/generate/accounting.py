"""A shard's accounting: every row counted by outcome in its stats sidecar, and the refusal of a
mostly failed shard."""

from __future__ import annotations

import dataclasses
import platform
import time
from collections import Counter
from pathlib import Path
from typing import Any

from dflash_build.engines import gpus
from dflash_build.engines.base import tau
from dflash_build.plan import Plan
from dflash_build.stages.common.job import StageFailure
from dflash_build.stages.generate.conversation import Conversation
from dflash_build.store import records as R


class ShardFailedError(StageFailure):
    """Too many rows of a shard could not be generated; publishing it would hide that."""


def check_failures(stats: dict[str, Any], max_failed_fraction: float, journal_path: Path) -> None:
    """Refuse to publish a shard whose rows mostly (or all) ended as error, abort or skipped over the
    context. Rows outside the trainer's window and copies another source keeps are a selection and never
    count."""
    window = stats.get(R.STAT_OUTSIDE_WINDOW, 0)
    failed = R.failed_rows(stats)
    rows = stats[R.STAT_INPUT_ROWS] - window - stats.get(R.STAT_CROSS_SOURCE, 0)
    over_context = failed - stats[R.STAT_ERROR]
    if rows <= 0 or failed / rows <= max_failed_fraction:
        return
    reasons = [
        kv
        for kv in sorted(stats["errors"].items(), key=lambda kv: -kv[1])
        if R.selection_of(R.FINISH_SKIPPED, kv[0]) is None
    ]
    kept = f" Finished rows stay in {journal_path}." if journal_path.exists() else ""
    lines = [
        f"{stats['source']}/{stats['shard']}: {failed} of {rows} rows could not be generated "
        f"({stats[R.STAT_ERROR]} error/abort, {over_context} skipped over the context"
        + (f"; {window} more outside the trainer's window are not counted" if window else "")
        + f"); the limit is {max_failed_fraction:.0%} (checks.max_failed_fraction); the shard was not written.{kept}"
    ]
    lines += [f"  {n} x {reason}" for reason, n in reasons[:3]]
    advice = []
    if over_context:
        advice.append("rows over the context: raise model.context_length or lower sampling.max_new_tokens")
    if stats[R.STAT_ERROR]:
        advice.append("template errors: fix model.chat_template; engine aborts: see the engine log above")
    lines.append("; ".join(advice).capitalize() + ".")
    raise ShardFailedError("\n".join(lines))


def turn_counts(convs: list[Conversation], reads_calls: bool = False) -> dict[str, Any]:
    """What ``turns: all`` made of a shard's conversations: how many turns each got, how many became
    per-turn samples, and how many ended before their last answer (the row's ``error`` says why)."""
    by_count: dict[str, int] = {}
    for conv in convs:
        by_count[str(len(conv.turns))] = by_count.get(str(len(conv.turns)), 0) + 1
    counts = {
        "conversations": len(convs),
        "turns": sum(len(c.turns) for c in convs),
        "per_turn": sum(c.per_turn for c in convs),
        "history_retokenized": sum(t.history_retokenized for c in convs for t in c.turns),
        "ended_early": sum(0 < len(c.turns) < len(c.slots) for c in convs),
        "by_count": dict(sorted(by_count.items(), key=lambda kv: int(kv[0]))),
    }
    if reads_calls:  # model.tool_call_parser: turns whose calls were the dataset's, so the conversation
        # went on; conversations that ended on calls that were not, with examples
        mismatched = [c for c in convs if (c.error or "").startswith(R.TOOL_CALL_MISMATCH)]
        counts[R.STAT_TOOL_CALLS_MATCHED] = sum(t.tool_calls == "matched" for c in convs for t in c.turns)
        counts[R.TOOL_CALL_MISMATCH] = len(mismatched)
        counts["tool_call_mismatch_examples"] = [c.error for c in mismatched[:3]]
    return counts


def shard_stats(
    plan: Plan,
    source: str,
    shard: str,
    rows: list[dict[str, Any]],
    resumed_turns: int,
    lease: gpus.GpuLease | None,
    wall: float,
    engine_tokens: int,
) -> dict[str, Any]:
    cfg = plan.config
    sp = plan.sources[source]
    output_tokens = sum(r["n_output_tokens"] for r in rows)
    stats = {
        "stage": "generate",
        "source": source,
        "shard": shard,
        "variant": sp.spec.variant,
        "gen_key": sp.gen_key,
        "components": sp.gen_components,
        "model_fingerprint": plan.model_fingerprint,
        "template_fingerprint": plan.template_fingerprint,
        # Recorded; only the options that change the numbers are keyed (each backend's descriptor).
        "engine": {
            "backend": cfg.backend,
            "options": dict(cfg.engine_options),
            # engine.drafter, which enters no key: the drafter that served the rows generated in this run
            "drafter": None if cfg.engine.drafter is None else dataclasses.asdict(cfg.engine.drafter),
            "host": platform.node(),
            "gpu": None
            if lease is None
            else {"id": lease.gpu, "node_gpu": lease.node_id, "port": lease.port, "via": lease.source},
        },
        "scheduler_job": gpus.scheduler_job(),  # e.g. SLURM_JOB_ID: which allocation wrote this shard
        **outcomes(rows),
        R.STAT_RESUMED_TURNS: resumed_turns,
        R.STAT_PROMPT_TOKENS: sum(r["n_prompt_tokens"] for r in rows),
        R.STAT_OUTPUT_TOKENS: output_tokens,
        R.STAT_LOOP_TOKENS: sum(r["n_output_tokens"] for r in rows if r["finish_reason"] == R.FINISH_LOOP),
        R.STAT_WALL_SECONDS: round(wall, 3),
        # what the engine produced in this run: reused, resumed and continued-from tokens cost nothing
        R.STAT_OUTPUT_TOK_PER_S: round(engine_tokens / wall, 3) if wall > 0 else None,
        "started_at": round(time.time() - wall, 3),
        "finished_at": round(time.time(), 3),
        "errors": error_summary(rows),
        R.STAT_DRAFTING: drafting(rows),
    }
    outcome_keys = (R.STAT_OK, R.STAT_TRUNCATED, R.STAT_WINDOW, R.STAT_LOOPS_STOPPED, R.STAT_ERROR, R.STAT_SKIPPED)
    accounted = sum(stats[k] for k in outcome_keys)
    if accounted != stats[R.STAT_INPUT_ROWS]:
        raise RuntimeError(f"{source}/{shard}: {accounted} rows accounted for, {len(rows)} in the shard")
    return stats


def outcomes(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Rows by how they ended, and of the skipped ones those a selection left out (the window, copies)."""
    finish = Counter(r["finish_reason"] for r in rows)
    selections = Counter(R.selection_of(r["finish_reason"], r["error"]) for r in rows)
    return {
        R.STAT_INPUT_ROWS: len(rows),
        R.STAT_OK: finish[R.FINISH_STOP],
        R.STAT_TRUNCATED: finish[R.FINISH_LENGTH],
        R.STAT_WINDOW: finish[R.FINISH_WINDOW],
        R.STAT_LOOPS_STOPPED: finish[R.FINISH_LOOP],
        R.STAT_ERROR: finish[R.FINISH_ERROR] + finish[R.FINISH_ABORT],
        R.STAT_SKIPPED: finish[R.FINISH_SKIPPED],
        R.STAT_OUTSIDE_WINDOW: selections[R.STAT_OUTSIDE_WINDOW],
        R.STAT_CROSS_SOURCE: selections[R.CROSS_SOURCE_DUPLICATE] + selections[R.CROSS_SOURCE_NEAR_DUPLICATE],
    }


def error_summary(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Error and skip reasons with their counts (numbers folded so reasons group)."""
    import re

    counts: dict[str, int] = {}
    for r in rows:
        if r["error"]:
            reason = re.sub(r"\d+", "N", r["error"])[:200]
            counts[reason] = counts.get(reason, 0) + 1
    return counts


def drafting(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What the engine counted of the rows a drafter served (engine.drafter): rows measured, verify steps,
    draft tokens proposed and accepted, and τ (tokens per step, the bonus token included); None if none."""
    counted = [r["acceptance"] for r in rows if r.get("acceptance")]
    if not counted:
        return None
    totals = {k: sum(int(c[k]) for c in counted) for k in ("steps", "drafted", "accepted")}
    per_token = tau(totals["steps"], totals["accepted"])
    return {"rows": len(counted), **totals, "tau": None if per_token is None else round(per_token, 4)}
