"""Generate stage: one prompt shard → one completion shard, through any engine backend.

The driver renders every prompt with the target's chat template, builds one request per
(prompt, sample) with its own seed, streams results from the backend, accounts for every row and
publishes the shard and its stats sidecar atomically. A row that cannot be rendered is recorded as an
error with its reason instead of failing the shard.
"""

from __future__ import annotations

import json
import logging
import platform
import time
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_build import atomic, chat, engines, hashing
from dflash_build import records as R
from dflash_build.engines import Request, Result, SamplingParams
from dflash_build.plan import Plan

log = logging.getLogger(__name__)
PROGRESS_EVERY_SECONDS = 30.0


def row_seed(base_seed: int, prompt_id: str, sample_idx: int) -> int:
    """The seed of one (prompt, sample): independent of batch, shard and order; fits in int64."""
    return int(hashing.digest({"seed": base_seed, "prompt_id": prompt_id, "sample_idx": sample_idx})[:15], 16)


class Progress:
    """Rows done/total, output tok/s, ETA and truncation rate, logged at most every few seconds."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label = total, label
        self.done = self.truncated = self.output_tokens = 0
        self.start = self.last = time.monotonic()

    def update(self, result: Result) -> None:
        self.done += 1
        self.output_tokens += len(result.output_ids)
        self.truncated += result.finish_reason == R.FINISH_LENGTH
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_SECONDS or self.done == self.total:
            self.last = now
            log.info("%s", self.line())

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        return (
            f"{self.label}: {self.done}/{self.total} rows, {self.output_tokens / elapsed:.1f} output tok/s, "
            f"ETA {eta:.0f}s, truncated {self.truncated / max(self.done, 1):.1%}"
        )


def run(plan: Plan, source: str, shard: str) -> dict[str, Any]:
    """Generate every (prompt, sample) of one shard; returns the stats written beside it."""
    started = time.time()
    sp = plan.sources[source]
    cfg = plan.config
    sampling = sp.spec.sampling
    template_kwargs = sp.gen_components["chat_template_kwargs"]
    prompts = pq.read_table(plan.prompt_dir(source) / f"{shard}.parquet").to_pylist()
    tokenizer = chat.load_tokenizer(cfg.model)
    if any(p["tools"] for p in prompts):
        chat.check_renders_tools(tokenizer, template_kwargs)
    params = SamplingParams(
        sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p, sampling.max_new_tokens
    )

    prompt_ids: dict[str, list[int]] = {}
    requests: list[Request] = []
    results: dict[tuple[str, int], Result] = {}
    for p in prompts:
        pid = p["prompt_id"]
        try:
            ids = chat.render(
                tokenizer, json.loads(p["messages"]), json.loads(p["tools"]) if p["tools"] else None, template_kwargs
            )
        except Exception as e:  # a template may refuse one conversation; the shard goes on
            ids, error = [], f"chat template failed: {type(e).__name__}: {e}"
        else:
            error = None
        prompt_ids[pid] = ids
        for idx in range(sampling.samples_per_prompt):
            if error is not None:
                results[(pid, idx)] = Result(pid, idx, [], R.FINISH_ERROR, error=error)
            else:
                requests.append(Request(pid, idx, ids, params, row_seed(sampling.seed, pid, idx)))

    progress = Progress(len(requests), f"{source}/{shard}")
    if requests:
        engine = engines.load(
            cfg.backend, cfg.model.path, cfg.engine_options, chat.stop_token_ids(tokenizer, cfg.model.path)
        )
        try:
            for result in engine.generate(requests):
                results[(result.prompt_id, result.sample_idx)] = result
                progress.update(result)
        finally:
            engine.close()
    missing = [(r.prompt_id, r.sample_idx) for r in requests if (r.prompt_id, r.sample_idx) not in results]
    if missing:
        raise RuntimeError(f"engine returned no result for {len(missing)} rows, e.g. {missing[:3]}")

    rows = []
    for p in prompts:
        pid = p["prompt_id"]
        for idx in range(sampling.samples_per_prompt):
            res = results[(pid, idx)]
            rows.append(
                {
                    "prompt_id": pid,
                    "sample_idx": idx,
                    "seed": row_seed(sampling.seed, pid, idx),
                    "prompt_ids": prompt_ids[pid],
                    "output_ids": res.output_ids,
                    "stop_token_id": res.stop_token_id,
                    "text": tokenizer.decode(res.output_ids, skip_special_tokens=False),
                    "finish_reason": res.finish_reason,
                    "error": res.error,
                    "n_prompt_tokens": len(prompt_ids[pid]),
                    "n_output_tokens": len(res.output_ids),
                }
            )
    out_dir = plan.completion_dir(source)
    wall = time.time() - started
    output_tokens = sum(r["n_output_tokens"] for r in rows)
    stats = {
        "stage": "generate",
        "source": source,
        "shard": shard,
        "gen_key": sp.gen_key,
        "components": sp.gen_components,
        "model_fingerprint": plan.model_fingerprint,
        "template_fingerprint": plan.template_fingerprint,
        # Recorded, never keyed: they change speed, not the distribution.
        "engine": {"backend": cfg.backend, "options": dict(cfg.engine_options), "host": platform.node()},
        R.STAT_INPUT_ROWS: len(prompts) * sampling.samples_per_prompt,
        R.STAT_OK: sum(r["finish_reason"] == R.FINISH_STOP for r in rows),
        R.STAT_TRUNCATED: sum(r["finish_reason"] == R.FINISH_LENGTH for r in rows),
        R.STAT_ERROR: sum(r["finish_reason"] in (R.FINISH_ERROR, R.FINISH_ABORT) for r in rows),
        R.STAT_SKIPPED: 0,
        R.STAT_PROMPT_TOKENS: sum(r["n_prompt_tokens"] for r in rows),
        R.STAT_OUTPUT_TOKENS: output_tokens,
        R.STAT_WALL_SECONDS: round(wall, 3),
        R.STAT_OUTPUT_TOK_PER_S: round(output_tokens / wall, 3) if wall > 0 else None,
    }
    accounted = stats[R.STAT_OK] + stats[R.STAT_TRUNCATED] + stats[R.STAT_ERROR] + stats[R.STAT_SKIPPED]
    assert accounted == stats[R.STAT_INPUT_ROWS], "every input row is accounted for"
    atomic.write_parquet(out_dir / f"{shard}.parquet", pa.Table.from_pylist(rows, schema=R.COMPLETION_SCHEMA))
    atomic.write_json(out_dir / f"{shard}.stats.json", stats)
    log.info("%s/%s: %s", source, shard, {k: stats[k] for k in (R.STAT_OK, R.STAT_TRUNCATED, R.STAT_ERROR)})
    return stats
